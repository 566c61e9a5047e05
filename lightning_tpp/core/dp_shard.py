"""Parameters, gradients and optimizer state sharded over the data-parallel ranks with torch's FSDP2 (``fully_shard``).

Applied last, to this rank's stage after tensor parallelism: FSDP2 sees the tensor-parallel shards as ordinary
parameters and cuts each along dim 0 over the ``dp`` mesh axis (a ``Shard(0)`` DTensor per parameter, its gradient
and optimizer state alike). Before a module's forward it gathers its parameters, after backward it reduce-scatters
(averages) the gradients, so no gradient all-reduce over dp is left to do for them.

What is one FSDP unit (one all-gather / reduce-scatter)::

    each block of the repeated block sequence (this rank's)      model.layers.0, model.layers.1, ...
    for every other parameter: the smallest module holding all   model.embed_tokens, model.norm, lm_head,
    its aliases (a tied embedding and head: their common parent)  model (tied wte / lm_head)

The vocabulary matrices (an embedding or LM head larger than a block) are no unit by default: they stay cut by rows
and are computed over dp where they lie (``core.dp_rows``), so FSDP2 never gathers them.

A unit's hooks run when its ``forward`` is called; the LightningModule's own forward may never be (``training_step``
calls the model), so parameters held only by the LightningModule itself stay replicated and are averaged over dp as
before (``replicated``).

``sharding``: ``"full_shard"`` (parameters gathered per unit for forward and again for backward; least memory),
``"shard_grad_op"`` (kept gathered from forward to backward, ZeRO-2-like: one all-gather less per unit and step),
``"no_shard"`` (everything replicated, gradients all-reduced).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Container, Iterable, Iterator, Literal, Optional, Sequence

import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from lightning_tpp._compat import (
    fsdp_drop_gather_keepalive,
    fsdp_lazy_init,
    fsdp_no_backward_prefetch,
    fsdp_reduce_now,
    fsdp_sharded_params,
    fsdp_state,
    fsdp_track_gradients,
    in_place_reduce_scatter,
)
from lightning_tpp.core.dp_rows import RowsOverDP, candidates, shard_rows_over_dp

DPSharding = Literal["full_shard", "shard_grad_op", "no_shard"]
SHARDINGS: tuple[str, ...] = ("full_shard", "shard_grad_op", "no_shard")


def normalize_sharding(value: Any) -> str:
    """Lightning's FSDPStrategy spellings (``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``) are accepted too."""
    name = value.lower() if isinstance(value, str) else value
    if name not in SHARDINGS:
        raise ValueError(f"dp_sharding={value!r} must be one of {SHARDINGS}: 'full_shard' (parameters, gradients and "
                         f"optimizer state sharded over dp), 'shard_grad_op' (the same, parameters kept gathered "
                         f"between forward and backward) or 'no_shard' (replicated)")
    return name


def is_dp_sharded(t: Any) -> bool:
    return isinstance(t, DTensor)


def local(t: Tensor) -> Tensor:
    """This rank's part of a dp-sharded tensor (the tensor itself otherwise)."""
    return t.to_local() if isinstance(t, DTensor) else t


def gather_dp(t: Tensor) -> Tensor:
    """The tensor-parallel shard this dp-sharded tensor is a part of (collective over dp); others as they are."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def shard_dp_like(value: Tensor, like: Tensor) -> Tensor:
    """``value`` (what ``gather_dp(like)`` returns) cut as ``like`` is: this rank's part as a DTensor; no collective."""
    if not isinstance(like, DTensor):
        return value
    return distribute_tensor(value.to(device=like.device), like.device_mesh, like.placements, src_data_rank=None)


@dataclass
class DPShards:
    """What ``shard_over_dp`` did: the FSDP units (module names), the parameters left replicated (names) and the
    mapping from each replaced parameter object to its sharded one."""

    sharding: str
    units: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    modules: list[nn.Module] = field(default_factory=list)
    rows: list[RowsOverDP] = field(default_factory=list)  # vocabulary matrices computed over dp (core.dp_rows)

    @contextlib.contextmanager
    def reduce_at_end(self, root: nn.Module) -> Iterator[None]:
        """Gradients kept unsharded through a pipeline schedule and reduce-scattered once after it, parameters kept
        gathered from their first backward on (``torch.distributed.pipelining``'s way with FSDP2): needed where
        weight gradients are added after their backward (zero-bubble's ``W``), when FSDP2 has already reduced."""
        for m in self.modules:
            m.set_requires_gradient_sync(False, recurse=False)
            m.set_reshard_after_backward(False, recurse=False)
        try:
            yield
        finally:
            for m in self.modules:
                m.set_requires_gradient_sync(True, recurse=False)
                m.set_reshard_after_backward(True, recurse=False)
        fsdp_reduce_now(root)

    def sharded_of(self, p: Tensor) -> Optional[Tensor]:
        """The sharded parameter whose gathered copy (swapped in during forward) ``p`` is."""
        for m in self.modules:
            for sharded, unsharded in fsdp_sharded_params(m):
                if unsharded is p:
                    return sharded
        return None

    def describe(self, total: int, sharded: int) -> str:
        lines = [f"Data-parallel sharding ({self.sharding}, FSDP2): {len(self.units)} units, "
                 f"{sharded / max(total, 1):.0%} of this rank's parameters sharded over dp"]
        if self.rows:
            lines.append(f"  cut by rows over dp and computed there (tokens exchanged, the matrix never gathered): "
                         f"{', '.join(r.name for r in self.rows)}")
        if self.replicated:
            lines.append(f"  replicated (held by the LightningModule itself, whose forward the step may not call): "
                         f"{', '.join(self.replicated)}")
        return "\n".join(lines)


@contextlib.contextmanager
def fsdp_classes_hidden(module: nn.Module) -> Iterator[dict[int, Any]]:
    """``fully_shard`` makes each unit an instance of a generated ``FSDP<Class>``, which refuses ``deepcopy``: for
    the duration, the units are instances of their own class again (e.g. to copy a block for a numerical check).
    Yields a ``deepcopy`` memo that shares (does not copy) the units' FSDP states, which hold process groups."""
    from torch.distributed.fsdp import FSDPModule

    swapped, memo = [], {}
    for m in module.modules():
        cls = type(m)
        if isinstance(m, FSDPModule):
            state = fsdp_state(m)
            memo[id(state)] = state
            m.__class__ = next(b for b in cls.__bases__ if b is not FSDPModule)
            swapped.append((m, cls))
    try:
        yield memo
    finally:
        for m, cls in swapped:
            m.__class__ = cls


def _inside(name: str, outer: str) -> bool:
    return outer == "" or name == outer or name.startswith(outer + ".")


def _common_parent(names: Iterable[str]) -> str:
    parts = [n.split(".") if n else [] for n in names]
    common: list[str] = []
    for level in zip(*parts):
        if len(set(level)) != 1:
            break
        common.append(level[0])
    return ".".join(common)


def fsdp_units(module: nn.Module, blocks: Sequence[str], skip: Container[int] = ()) -> tuple[list[str], list[str]]:
    """The modules to wrap (children before parents) and the parameters that stay replicated (by name); parameters
    whose id is in ``skip`` are left out (sharded otherwise)."""
    holders: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is not None and id(p) not in skip:
                holders.setdefault(id(p), []).append(mname)
                first_name.setdefault(id(p), f"{mname}.{pname}" if mname else pname)
    units = set(blocks)
    replicated = []
    modules = dict(module.named_modules())
    for pid, names in holders.items():
        parent = _common_parent(names)
        if any(_inside(parent, b) for b in blocks):
            continue
        if parent == "":
            replicated.append(first_name[pid])
            continue
        # a tensor-parallel block outside the blocks (a conditioning MLP) is one unit: its first-call check gathers
        # all of its weights at its entry, before its layers' own calls would
        parts = parent.split(".")
        tp_block = next((a for a in (".".join(parts[:i]) for i in range(1, len(parts) + 1))
                         if getattr(modules.get(a), "_tpp_block", None) is not None), None)
        units.add(tp_block or parent)
    ordered = sorted(units, key=lambda n: (-n.count("."), n))  # children before the parents that enclose them
    return ordered, replicated


def shard_over_dp(module: nn.Module, mesh: DeviceMesh, *, blocks: Sequence[str], sharding: str,
                  vocab_exchange: bool = True, keep: Sequence[nn.Parameter] = ()) -> DPShards:
    """``fully_shard`` each unit of ``module`` (this rank's stage, tensor-parallel shards as plain parameters) over the
    1-d ``mesh``; with ``vocab_exchange``, the vocabulary matrices cut by rows instead (``core.dp_rows``); ``keep``
    stays as it is (not sharded, gradients not reduced). Returns
    what was done, with old parameter -> new parameter (FSDP2 replaces the objects)."""
    from torch.distributed.fsdp import fully_shard

    before = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if p is not None]
    rows, moved = shard_rows_over_dp(module, candidates(module, blocks) if vocab_exchange else [], mesh)
    units, replicated = fsdp_units(module, blocks, skip={id(p) for p in (*moved.values(), *keep)})
    ignored = {module.get_parameter(n) for n in replicated} | set(moved.values()) | set(keep)
    modules = dict(module.named_modules())
    # gloo (CPU): a reduce-scatter that neither clones its input nor keeps it (nor the gradient FSDP2 leaks through
    # it), no all-gather buffer kept for overlap, no all-gather issued ahead in backward (a CPU collective does not
    # overlap compute: the next unit's gathered parameters would only sit beside this unit's weight and gradient)
    cpu = dist.get_backend(mesh.get_group()) == "gloo"
    for name in units:
        fully_shard(modules[name], mesh=mesh, reshard_after_forward=sharding == "full_shard",
                    ignored_params=ignored or None)
        reduce_scatter = in_place_reduce_scatter() if cpu else None
        if reduce_scatter is not None:
            modules[name].set_custom_reduce_scatter(reduce_scatter)
            fsdp_track_gradients(modules[name], reduce_scatter)
        if cpu:
            fsdp_drop_gather_keepalive(modules[name])
            fsdp_no_backward_prefetch(modules[name])
    # one root enclosing every unit (FSDP2 shares its per-step state through the root): the LightningModule, with its
    # own parameters ignored, made the root now; it keeps the user's class (no method of FSDP's is called on it)
    cls = type(module)
    fully_shard(module, mesh=mesh, reshard_after_forward=sharding == "full_shard", ignored_params=ignored or None)
    fsdp_lazy_init(module)
    module.__class__ = cls
    replaced = {id(p): m._parameters[name] for m, name, p in before if m._parameters[name] is not p}
    return DPShards(sharding, units, replicated, replaced, [modules[n] for n in units], rows)


def sharded_numel(module: nn.Module) -> tuple[int, int]:
    """(this rank's parameters, those sharded over dp), counted as tensor-parallel shards."""
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if isinstance(p, DTensor))
