"""Parameters, gradients and optimizer state sharded over the data-parallel ranks with torch's FSDP2 (``fully_shard``).

Applied last, to this rank's stage after tensor parallelism: FSDP2 sees the tensor-parallel shards as ordinary
parameters and cuts each along dim 0 over the ``dp`` mesh axis (a ``Shard(0)`` DTensor per parameter, its gradient
and optimizer state alike). Before a module's forward it gathers its parameters, after backward it reduce-scatters
(averages) the gradients, so no gradient all-reduce over dp is left to do for them.

What is one FSDP unit (one all-gather / reduce-scatter)::

    each block of the repeated block sequence (this rank's)        model.layers.0, model.layers.1, ...
    for every other parameter: the smallest module holding all     model.embed_tokens, model.norm, lm_head,
    its aliases (a tied embedding and head: their common parent)    model (tied wte / lm_head)
    and every module whose forward reads it (data_parallel.reads)  mixer (reads F.conv1d(x, self.conv1d.weight))

FSDP2 gathers a unit only for the unit's own forward, so a unit must enclose every read of its parameters, wherever
the forward makes them: Jamba's Mamba mixer reads ``self.conv1d.weight`` with ``F.conv1d`` without calling
``self.conv1d``, ``nn.MultiheadAttention`` reads ``out_proj.weight``, a model ``F.linear(h, self.lm_head.weight)``.
The reads come from one forward of a meta copy at setup (``data_parallel.reads.find_reads``); a unit inside the
module that must enclose a parameter's reads (a block whose weight its parent reads) gives way to the enclosing one,
and a vocabulary matrix read outside its own module stays with FSDP2. What that forward could not see is found at the
first call of each module (``data_parallel.reads.guard_reads``): gathered where it is read, or a ``ShardedReadError``
saying what to do; DTensor's ``got mixed torch.Tensor and DTensor`` never reaches the user.

The vocabulary matrices (an embedding or LM head larger than a block) are no unit by default: they stay cut by rows
and are computed over dp where they lie (``data_parallel.rows``), so FSDP2 never gathers them.

A unit's hooks run when its ``forward`` is called; the LightningModule's own forward may never be (``training_step``
calls the model), so parameters held only by the LightningModule itself stay replicated and are averaged over dp as
before (``replicated``).

``sharding``: ``"full_shard"`` (parameters gathered per unit for forward and again for backward; least memory),
``"shard_grad_op"`` (kept gathered from forward to backward, ZeRO-2-like: one all-gather less per unit and step),
``"no_shard"`` (everything replicated, gradients all-reduced).

Experts split over ep (``experts.expert_parallel``) are not in the dp units: each bank is a unit of its own over the
mesh of its replicas (the ranks holding the same experts, ``ExpertShards``: expert data parallelism), along the expert
dimension (``Shard(0)``) where a rank keeps at least as many experts as it has replicas, else along the next one
(``Shard(1)``), so that no replica is left without a part. Their gradients are summed over the replicas and divided
by ``divide`` (dp, or dp x cp: what keeps one process's update, see ``reduce_expert_grads``).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Container, Iterable, Iterator, Literal, Mapping, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from lightning_tpp._compat import (
    fsdp_drop_gather_keepalive,
    fsdp_lazy_init,
    fsdp_no_backward_prefetch,
    fsdp_reduce_now,
    fsdp_sharded_params,
    fsdp_track_gradients,
    gloo_all_gather,
    gloo_reduce_scatter,
)
from lightning_tpp.core.collectives import all_gather_into, reduce_scatter_into
from lightning_tpp.core.materialize import has_meta
from lightning_tpp.data_parallel.reads import ReadGuard, Reads, find_reads, guard_reads
from lightning_tpp.data_parallel.rows import RowsOverDP, candidates, shard_rows_over_dp

DPSharding = Literal["full_shard", "shard_grad_op", "no_shard"]
SHARDINGS: tuple[str, ...] = ("full_shard", "shard_grad_op", "no_shard")


class DPUnitsMismatchError(ValueError):
    """The dp ranks would shard different FSDP2 units (see ``shard_over_dp``)."""


def normalize_sharding(value: Any) -> str:
    """Lightning's FSDPStrategy spellings (``"FULL_SHARD"``, ``"SHARD_GRAD_OP"``, ``"NO_SHARD"``) are accepted too."""
    name = value.lower() if isinstance(value, str) else value
    if name not in SHARDINGS:
        raise ValueError(f"dp_sharding={value!r} must be one of {SHARDINGS}: 'full_shard' (parameters, gradients and "
                         f"optimizer state sharded over dp), 'shard_grad_op' (the same, parameters kept gathered "
                         f"between forward and backward) or 'no_shard' (replicated)")
    return name


@dataclass(frozen=True)
class ExpertShards:
    """Expert banks split over ep to shard over their replicas: the banks (module names), the 1-d mesh of this rank's
    replicas, and what their summed gradients are divided by."""

    banks: tuple[str, ...]
    mesh: DeviceMesh
    divide: float

    def placement(self, p: nn.Parameter) -> Any:
        """``Shard(0)`` (whole experts per replica) where this rank's experts are at least its replicas, else
        ``Shard(1)``."""
        from torch.distributed.tensor import Shard

        return Shard(0) if p.dim() < 2 or p.shape[0] >= self.mesh.size() else Shard(1)


@dataclass
class DPShards:
    """What ``shard_over_dp`` did: the FSDP units (module names), the parameters left replicated (names) and the
    mapping from each replaced parameter object to its sharded one."""

    sharding: str
    units: list[str] = field(default_factory=list)
    replicated: list[str] = field(default_factory=list)
    replaced: dict[int, nn.Parameter] = field(default_factory=dict)
    modules: list[nn.Module] = field(default_factory=list)
    rows: list[RowsOverDP] = field(default_factory=list)  # vocabulary matrices computed over dp (data_parallel.rows)
    experts: list[str] = field(default_factory=list)  # expert banks sharded over their replicas (ExpertShards)
    reads: Reads = field(default_factory=Reads)  # where the forward reads each parameter (data_parallel.reads)
    guard: Optional[ReadGuard] = None  # the reads that forward did not see, handled at the first call

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
        if self.experts:
            lines.append(f"  expert banks, each a unit over the ranks holding the same experts (their replicas): "
                         f"{', '.join(self.experts)}")
        if self.rows:
            lines.append(f"  cut by rows over dp and computed there (tokens exchanged, the matrix never gathered): "
                         f"{', '.join(r.name for r in self.rows)}")
        if self.replicated:
            lines.append(f"  replicated (held by the LightningModule itself, whose forward the step may not call): "
                         f"{', '.join(self.replicated)}")
        lines.append(f"  units chosen from where the forward reads each parameter ({self.reads.source}"
                     f"{'' if self.reads.complete else '; the rest found at the first call of each module'})")
        return "\n".join(lines)


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


def fsdp_units(module: nn.Module, blocks: Sequence[str], skip: Container[int] = (),
               reads: Optional[Mapping[int, Iterable[str]]] = None, tp_blocks: Collection[str] = ()
               ) -> tuple[list[str], list[str]]:
    """The modules to wrap (children before parents) and the parameters that stay replicated (by name); parameters
    whose id is in ``skip`` are left out (sharded otherwise); ``tp_blocks``: the tensor-parallel blocks (each one unit
    when it sits outside the blocks). ``reads`` (``data_parallel.reads``: parameter id -> the
    modules whose forward reads it) widens a parameter's unit to a module enclosing its readers too: FSDP2 gathers a
    unit only for the unit's own forward."""
    holders: dict[int, list[str]] = {}
    first_name: dict[int, str] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for pname, p in m._parameters.items():
            if p is not None and id(p) not in skip:
                holders.setdefault(id(p), []).append(mname)
                first_name.setdefault(id(p), f"{mname}.{pname}" if mname else pname)
    units = set(blocks)
    replicated = []
    needs: dict[int, str] = {}  # parameter -> the module its unit must enclose (its holders and readers)
    for pid, names in holders.items():
        parent = _common_parent([*names, *((reads or {}).get(pid, ()))])
        if parent == "":
            replicated.append(first_name[pid])
            continue
        needs[pid] = parent
        if any(_inside(parent, b) for b in blocks):
            continue
        # a tensor-parallel block outside the blocks (a conditioning MLP) is one unit: its first-call check gathers
        # all of its weights at its entry, before its layers' own calls would
        parts = parent.split(".")
        tp_block = next((a for a in (".".join(parts[:i]) for i in range(1, len(parts) + 1)) if a in tp_blocks), None)
        units.add(tp_block or parent)
    return _enclosing(units, needs, holders), replicated


def _enclosing(units: set[str], needs: dict[int, str], holders: dict[int, list[str]]) -> list[str]:
    """``units`` children first, without those that would take a parameter read outside them: FSDP2 gives a
    parameter to the first unit wrapped (the innermost) holding it, so a unit inside the module that must enclose
    the parameter's readers (a block whose weight its parent reads) gives way to the enclosing one."""
    while True:
        ordered = sorted(units, key=lambda n: (-n.count("."), n))  # children before the parents that enclose them
        narrow = None
        for pid, need in needs.items():
            owner = next((u for u in ordered if any(_inside(h, u) for h in holders[pid])), None)
            if owner is not None and not _inside(need, owner):
                narrow = owner
                break
        if narrow is None:
            return ordered
        units.discard(narrow)


def shard_over_dp(module: nn.Module, mesh: DeviceMesh, *, blocks: Sequence[str], sharding: str,
                  vocab_exchange: bool = True, keep: Sequence[nn.Parameter] = (), tp_blocks: Collection[str] = (),
                  quiet: Optional[Callable[[nn.Module], None]] = None,
                  experts: Optional[ExpertShards] = None, dense: bool = True,
                  allocate: Optional[torch.device] = None) -> DPShards:
    """``fully_shard`` each unit of ``module`` (this rank's stage, tensor-parallel shards as plain parameters) over the
    1-d ``mesh``; with ``vocab_exchange``, the vocabulary matrices cut by rows instead (``data_parallel.rows``);
    ``keep`` stays as it is (not sharded, gradients not reduced). Units and vocabulary matrices follow where the
    forward reads each parameter (``data_parallel.reads``), and reads it could not see are guarded at the first call.
    ``tp_blocks``: the tensor-parallel blocks; ``quiet``: turns their first-call checks off on the meta copy that
    finds the reads. ``experts``: banks of ``keep`` each made a unit over its replicas' mesh instead; ``dense=False``:
    only they (``mesh`` has one rank: the replicas are tp ranks); a bank still on the meta device (its weights are
    read next) gets its shards allocated on ``allocate``. Returns what was done, with old parameter -> new
    parameter (FSDP2 replaces the objects)."""
    from torch.distributed.fsdp import fully_shard

    before = [(m, name, p) for m in module.modules() for name, p in m._parameters.items() if p is not None]
    reads = find_reads(module, quiet=quiet)
    names = called_where_read(module, candidates(module, blocks, tp_blocks), reads.readers) if vocab_exchange else []
    rows, moved = shard_rows_over_dp(module, names, mesh)
    units, replicated = fsdp_units(module, blocks, skip={id(p) for p in (*moved.values(), *keep)},
                                   reads=reads.readers, tp_blocks=tp_blocks)
    if not dense:  # nothing of the model's own but its expert banks
        units, replicated = [], [n for n, p in module.named_parameters() if all(p is not q for q in keep)]
    _check_same_units(units, mesh)
    modules = dict(module.named_modules())
    banks = list(experts.banks) if experts is not None else []
    sharded_experts = {id(p) for b in banks for p in modules[b].parameters(recurse=False)}
    # a bank made a unit of its own is a leaf to the units around it (FSDP2 skips a nested unit's parameters)
    ignored = {module.get_parameter(n) for n in replicated} | set(moved.values()) | \
        {p for p in keep if id(p) not in sharded_experts}
    # gloo (CPU): an all-gather and a reduce-scatter sent point to point, the latter neither keeping its input nor
    # the gradient FSDP2 leaks through it, no all-gather buffer kept for overlap, no all-gather issued ahead in
    # backward (a CPU collective does not overlap compute: the next unit's gathered parameters would only sit beside
    # this unit's weight and gradient)
    cpu = dist.get_backend(mesh.get_group()) == "gloo"
    for name in [*banks, *units]:
        bank = name in banks
        assert experts is not None or not bank
        fully_shard(modules[name], mesh=experts.mesh if bank else mesh,  # type: ignore[union-attr]
                    reshard_after_forward=sharding == "full_shard", ignored_params=None if bank else ignored or None,
                    shard_placement_fn=experts.placement if bank else None)  # type: ignore[union-attr]
        if bank:
            modules[name].set_gradient_divide_factor(experts.divide)  # type: ignore[union-attr]
            if allocate is not None and has_meta(modules[name]):
                _allocate(modules[name], allocate)
        if cpu:
            _gloo_collectives(modules[name])
            fsdp_drop_gather_keepalive(modules[name])
            fsdp_no_backward_prefetch(modules[name])
    # one root enclosing every unit (FSDP2 shares its per-step state through the root): the LightningModule, with its
    # own parameters ignored, made the root now; it keeps the user's class (no method of FSDP's is called on it)
    cls = type(module)
    fully_shard(module, mesh=mesh, reshard_after_forward=sharding == "full_shard", ignored_params=ignored or None)
    fsdp_lazy_init(module)
    module.__class__ = cls
    replaced = {id(p): m._parameters[name] for m, name, p in before if m._parameters[name] is not p}
    guard = guard_reads(module, [modules[n] for n in units], rows)
    return DPShards(sharding, [*banks, *units], replicated, replaced, [modules[n] for n in [*banks, *units]], rows,
                    banks, reads, guard)


def _gloo_collectives(unit: nn.Module) -> None:
    """``unit``'s all-gather and reduce-scatter over gloo sent point to point (``core.collectives``: about half gloo's
    ring's time here), the reduce-scatter freeing its input and the gradient FSDP2 leaks through it."""
    gather, reduce_scatter = gloo_all_gather(all_gather_into), gloo_reduce_scatter(reduce_scatter_into)
    if gather is not None:
        unit.set_custom_all_gather(gather)  # type: ignore[operator]
    if reduce_scatter is not None:
        unit.set_custom_reduce_scatter(reduce_scatter)  # type: ignore[operator]
        fsdp_track_gradients(unit, reduce_scatter)


def _allocate(unit: nn.Module, device: torch.device) -> None:
    """A unit's own tensors, built on the meta device and sharded by FSDP2 there, allocated (uninitialised) on
    ``device``: this rank's shards only. The parameter objects stay (swapped in place; FSDP2 re-pads them)."""
    swap = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        unit.to_empty(device=device, recurse=False)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(swap)


def called_where_read(module: nn.Module, names: Sequence[str], reads: Mapping[int, Iterable[str]]) -> list[str]:
    """The vocabulary matrices (``data_parallel.rows.candidates``) whose weight and bias are read only inside a module
    holding them: computed over dp in that module's forward, a matrix read elsewhere (``F.linear(h,
    self.lm_head.weight)`` in the model's forward) would meet its rows there; FSDP2 gathers it instead. A weight tied
    between candidates, or held by a module outside the matrix too, goes to FSDP2 from all of them."""
    held: dict[int, list[str]] = {}
    for mname, m in module.named_modules(remove_duplicate=False):
        for p in m._parameters.values():
            if p is not None:
                held.setdefault(id(p), []).append(mname)
    params = {n: [p for p in (module.get_submodule(n)._parameters.get(k) for k in ("weight", "bias")) if p is not None]
              for n in names}
    outside = {id(p) for ps in params.values() for p in ps
               if not all(any(_inside(r, h) for h in held[id(p)]) for r in reads.get(id(p), ()))}
    # a parameter its parent holds too (BERT's cls.predictions.bias is its decoder's bias): cut into rows, the
    # parent's would stay the old whole tensor, untrained and no longer tied
    shared = {id(p) for n, ps in params.items() for p in ps if any(not _inside(h, n) for h in held[id(p)])}
    return [n for n in names if not any(id(p) in outside or id(p) in shared for p in params[n])]


def _check_same_units(units: list[str], mesh: DeviceMesh) -> None:
    """The dp ranks must wrap the same units (else their collectives would not match and the step would hang): the
    reads come from a forward each rank ran on its own."""
    gathered: list[Any] = [None] * mesh.size()
    dist.all_gather_object(gathered, units, group=mesh.get_group())
    if any(g != units for g in gathered):
        raise DPUnitsMismatchError(f"the data-parallel ranks chose different FSDP2 units from their forward's reads: "
                                   f"{gathered}; a forward whose module calls depend on the rank cannot be sharded "
                                   f"over dp this way: use dp_sharding='no_shard'")


def sharded_numel(module: nn.Module) -> tuple[int, int]:
    """(this rank's parameters, those sharded over dp), counted as tensor-parallel shards."""
    params = list(module.parameters())
    return sum(p.numel() for p in params), sum(p.numel() for p in params if isinstance(p, DTensor))
