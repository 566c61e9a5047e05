"""Where the forward reads each parameter: the module whose ``forward`` is running when the parameter reaches an op.

FSDP2 gathers a unit's parameters when the unit's ``forward`` is called. Module boundaries do not say where a
parameter is read: Jamba's Mamba mixer computes ``F.conv1d(x, self.conv1d.weight, ...)`` without calling
``self.conv1d``, ``nn.MultiheadAttention`` reads ``self.out_proj.weight`` without calling ``out_proj``, a model reads
its head with ``F.linear(h, self.lm_head.weight)``. A unit made of the child would leave its weight sharded there
(``got mixed torch.Tensor and DTensor``). So the reads are found by running the forward:

- ``find_reads`` (setup, before sharding): one forward of a meta copy (no memory, no data, no effect on the model or
  the random generators) on the LightningModule's ``example_input_array``, else, as the pipeline partitioner does, on
  token ids of shape ``(1, 8)`` given to the smallest module holding every parameter when it holds an
  ``nn.Embedding``. A ``TorchFunctionMode`` records, for each parameter an op receives, the innermost module whose
  forward is running; ``data_parallel.fsdp`` then makes each unit a module enclosing every read of its parameters.
- ``guard_reads`` (after sharding; what that forward could not see: no input at setup, a forward that fails on the
  meta device, a branch the example did not take): the first call of each module runs observed. An op receiving a
  parameter that is still sharded is a read outside its unit: the unit is gathered there and, from then on, before
  each call of the reading module, kept gathered until its gradients are reduced after backward (FSDP2's final
  callback). A read that cannot be gathered that way raises :class:`ShardedReadError`, saying what to do, instead of
  DTensor's error.
"""

from __future__ import annotations

import copy
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode

from lightning_tpp._compat import BatchNormBase, fsdp_sharded_params, tree_flatten, tree_map
from lightning_tpp.core.meta_ops import DataDependentOnMeta
from lightning_tpp.core.walk import VERIFYING

# what an op may ask of a sharded parameter without its values (a DTensor answers for the whole tensor)
_METADATA = frozenset({"shape", "dtype", "device", "requires_grad", "ndim", "is_leaf", "grad_fn", "grad", "layout",
                       "is_cuda", "is_meta", "is_sparse", "is_quantized", "names", "size", "dim", "numel",
                       "nelement", "ndimension", "element_size", "is_floating_point", "is_complex", "get_device",
                       "is_contiguous", "stride", "__hash__"})
PROBE_TOKENS = (1, 8)  # the token ids a model is probed with when it names no example input


class ShardedReadError(ValueError):
    """A parameter sharded over dp is read where no FSDP2 unit gathers it (see ``guard_reads``)."""


def _op_name(func: Any) -> str:
    name = getattr(func, "__name__", "")
    if name == "__get__":  # a property: t.shape, t.data
        return getattr(getattr(func, "__self__", None), "__name__", name)
    return name


class _Reads(TorchFunctionMode):
    """Calls ``on_read(tensor, func)`` for each watched tensor an op receives; what it returns (a tensor) stands in
    for it in that op."""

    def __init__(self, watched: dict[int, Any], on_read: Callable[[Tensor, Any], Optional[Tensor]]) -> None:
        super().__init__()
        self.watched, self.on_read = watched, on_read

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if _op_name(func) not in _METADATA and any(
                isinstance(t, Tensor) and id(t) in self.watched for t in tree_flatten((args, kwargs))[0]):
            def swap(t: Any) -> Any:
                if isinstance(t, Tensor) and id(t) in self.watched:
                    other = self.on_read(t, func)
                    return t if other is None else other
                return t
            args, kwargs = tree_map(swap, (args, kwargs))
        return func(*args, **kwargs)


# ---- setup: one forward of a meta copy ---------------------------------------------------------------------------
@dataclass
class Reads:
    """``readers``: id of a parameter of the module -> the modules (names) whose forward was the innermost running
    when an op received it; ``complete``: the probe ran the whole forward (else what ran before it stopped)."""

    readers: dict[int, frozenset[str]] = field(default_factory=dict)
    complete: bool = False
    source: str = "no input"  # what the forward was given


def _runs(m: nn.Module) -> bool:
    return type(m).forward is not nn.Module.forward and not isinstance(m, (nn.ModuleList, nn.ModuleDict))


def probe_input(module: nn.Module) -> Optional[tuple[str, tuple, dict, str]]:
    """(module name to run, args, kwargs, what they are) of the probe, or None when there is nothing to give it."""
    example = getattr(module, "example_input_array", None)  # LightningModule's
    if example is not None:
        args, kwargs = ((), example) if isinstance(example, dict) else (
            (tuple(example) if isinstance(example, (tuple, list)) else (example,)), {})
        return "", args, kwargs, "example_input_array"
    holders = [n for n, m in module.named_modules() if any(True for _ in m.parameters(recurse=False))]
    if not holders:
        return None
    parts = [n.split(".") if n else [] for n in holders]
    common: list[str] = []
    for column in zip(*parts):
        if len(set(column)) > 1:
            break
        common.append(column[0])
    while common and not _runs(module.get_submodule(".".join(common))):  # nanoGPT's `transformer` dict
        common.pop()
    root = ".".join(common)
    if not any(isinstance(m, nn.Embedding) for m in module.get_submodule(root).modules()):
        return None
    return root, (torch.zeros(*PROBE_TOKENS, dtype=torch.long),), {}, f"token ids {PROBE_TOKENS}"


def _shared(module: nn.Module) -> list[Any]:
    """The process groups and device meshes the modules refer to (tensor-parallel layers' groups): a copy shares
    them (they cannot be copied)."""
    kinds = tuple(k for k in (getattr(dist, "ProcessGroup", None), DeviceMesh) if k is not None)
    found: list[Any] = []
    seen: set[int] = set()

    def walk(obj: Any, depth: int) -> None:
        if id(obj) in seen or depth > 6 or isinstance(obj, (Tensor, nn.Module, type, str, bytes, int, float)):
            return
        seen.add(id(obj))
        if isinstance(obj, kinds):
            found.append(obj)
        elif isinstance(obj, dict):
            for v in obj.values():
                walk(v, depth + 1)
        elif isinstance(obj, (list, tuple, set, frozenset)):
            for v in obj:
                walk(v, depth + 1)
        elif isinstance(obj, types.MethodType):
            walk(obj.__self__, depth + 1)
        elif hasattr(obj, "__dict__") and not isinstance(obj, types.FunctionType):
            walk(vars(obj), depth + 1)

    for m in module.modules():
        for k, v in vars(m).items():
            if k not in ("_parameters", "_buffers", "_modules", "_trainer"):  # the Trainer is not copied
                walk(v, 0)
    return found


def meta_copy(module: nn.Module, quiet: Optional[Callable[[nn.Module], None]] = None) -> nn.Module:
    """``module`` copied with its parameters and buffers on the meta device (no memory), sharing its process groups
    (``pipeline.stage.meta_twin``, which a tensor-parallel model's groups would stop); a LightningModule's copy has no
    Trainer. ``quiet`` turns the copy's first-call checks off (tensor parallelism's: they gather real weights; the
    model's run does them)."""
    memo: dict[int, Any] = {id(o): o for o in _shared(module)}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty(p.shape, dtype=p.dtype, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty(b.shape, dtype=b.dtype, device="meta")
    if module.__dict__.get("_trainer") is not None:
        memo[id(module.__dict__["_trainer"])] = None
    twin = copy.deepcopy(module, memo)
    for m in twin.modules():
        if isinstance(m, BatchNormBase) and m.momentum is None:  # would read num_batches_tracked's value
            m.momentum = 0.0
    if quiet is not None:
        quiet(twin)
    return twin


def find_reads(module: nn.Module, quiet: Optional[Callable[[nn.Module], None]] = None) -> Reads:
    """Which module's forward reads each parameter of ``module``, from one forward of a meta copy (module
    docstring; ``quiet``: see :func:`meta_copy`). Never raises: a forward that fails on the meta device leaves what it read until then."""
    found = probe_input(module)
    if found is None:
        return Reads()
    root, args, kwargs, source = found
    readers: dict[int, set[str]] = {}
    complete = False
    token = VERIFYING.set(True)  # extra forwards, not the model's run (pipeline stand-ins call their module)
    try:
        twin = meta_copy(module.get_submodule(root), quiet)
        originals = dict(module.get_submodule(root).named_parameters(remove_duplicate=False))
        watched = {id(p): id(originals[n]) for n, p in twin.named_parameters(remove_duplicate=False)}
        stack = _calls(twin, root)
        on_read = lambda t, func: readers.setdefault(watched[id(t)], set()).add(stack[-1])  # noqa: E731
        margs, mkwargs = tree_map(lambda t: torch.empty_like(t, device="meta") if isinstance(t, Tensor) else t,
                                  (args, kwargs))
        with torch.random.fork_rng(devices=[]), torch.device("meta"), torch.no_grad(), DataDependentOnMeta(), \
                _Reads(watched, on_read):
            twin(*margs, **mkwargs)
        complete = True
    except Exception:  # noqa: BLE001 - cannot be copied, needs other inputs, fails on meta: the reads until then
        pass
    finally:
        VERIFYING.reset(token)
    return Reads({k: frozenset(v) for k, v in readers.items()}, complete, source)


def _calls(twin: nn.Module, root: str) -> list[str]:
    """The names of the modules (``root`` the name of ``twin``) whose forward is running, innermost last."""
    stack: list[str] = []

    def enter(name: str) -> Callable[..., None]:
        return lambda module, args: stack.append(name)

    def leave(module: nn.Module, args: Any, out: Any) -> None:  # returns None: the output stays
        stack.pop()

    for n, m in twin.named_modules():
        m.register_forward_pre_hook(enter(f"{root}.{n}" if root and n else n or root))
        m.register_forward_hook(leave, always_call=True)
    return stack


# ---- after sharding: the first call of each module observed ------------------------------------------------------
@dataclass
class _Held:
    """Where a sharded parameter lives: its FSDP2 unit, and a module holding it (whose attribute FSDP2 points at the
    gathered copy while the unit is gathered)."""

    unit: nn.Module
    holder: nn.Module
    key: str
    name: str


class ReadGuard:
    """Hooks on every module; while a call of a module not observed before runs (outermost first), ``_Reads``
    watches the sharded parameters (module docstring). A module's hooks go when its first call returns: later calls
    cost nothing. A read in a module observed already is seen again only inside a module not observed yet."""

    def __init__(self, root: nn.Module, units: Sequence[nn.Module], rows: Sequence[Any]) -> None:
        self.names = {id(m): n for n, m in root.named_modules()}
        self.sharded: dict[int, _Held] = {}
        owner = {id(sp): u for u in units for sp, _ in fsdp_sharded_params(u)}
        for mname, m in root.named_modules(remove_duplicate=False):
            for key, p in m._parameters.items():
                if p is not None and id(p) in owner and id(p) not in self.sharded:
                    self.sharded[id(p)] = _Held(owner[id(p)], m, key, f"{mname}.{key}" if mname else key)
        self.rows: dict[int, list[Any]] = {}  # a weight tied between vocabulary matrices: each module holding it
        for layer in rows:
            for p in (layer.weight, layer.bias):
                if p is not None:
                    self.rows.setdefault(id(p), []).append(layer)
        self.mode = _Reads({**self.sharded, **self.rows}, self._read)
        self.stack: list[nn.Module] = []
        self.called: set[int] = set()
        self.gathered: set[tuple[int, int]] = set()
        self.deferred: list[nn.Module] = []  # observed, their hooks not removed yet
        self.handles: dict[int, list[Any]] = {}
        for m in root.modules():
            self.handles[id(m)] = [m.register_forward_pre_hook(_hook(self._enter), prepend=True),
                                   m.register_forward_hook(_hook(self._leave), always_call=True)]

    def _enter(self, m: nn.Module) -> None:
        if id(m) not in self.handles:  # a copy of a module (a numerical check's), or one observed already
            return
        if not self.stack:
            for done in [d for d in self.deferred if d is not m]:
                self._forget(done)
            self.mode.__enter__()
        self.stack.append(m)
        self.called.add(id(m))

    def _leave(self, m: nn.Module) -> None:
        if not self.stack or self.stack[-1] is not m:
            return
        self.stack.pop()
        if sys.exc_info()[1] is None:
            self._forget(m)
        else:  # torch iterates the hooks' dict itself when the forward raised: removed at the next call
            self.deferred.append(m)
        if not self.stack:
            self.mode.__exit__(None, None, None)

    def _forget(self, m: nn.Module) -> None:
        for h in self.handles.pop(id(m), []):
            h.remove()
        self.deferred = [d for d in self.deferred if d is not m]

    def _read(self, t: Tensor, func: Any) -> Optional[Tensor]:
        reader = self.stack[-1]
        where = f"{self.names[id(reader)] or 'the root module'}'s forward ({_op_name(func)})"
        if id(t) in self.rows:
            if any(layer.modes for layer in self.rows[id(t)]):  # inside a module holding it: computed over dp there
                return None
            layer = self.rows[id(t)][0]
            raise ShardedReadError(
                f"{layer.name}'s weight is cut by rows over dp and computed where {layer.name} is called "
                f"(vocab_exchange=True), but {where} reads it outside {layer.name}'s forward. Set the "
                f"LightningModule's example_input_array (one batch's input of its forward) so that the strategy sees "
                f"this read at setup and leaves the matrix to FSDP2, or pass vocab_exchange=False")
        held = self.sharded[id(t)]
        unit = self.names.get(id(held.unit), "?")
        if id(held.unit) in self.called:
            raise ShardedReadError(_called_message(held.name, unit, where))
        self._gather_at(reader, held, unit, where)
        return held.holder._parameters[held.key]

    def _gather_at(self, reader: nn.Module, held: _Held, unit: str, where: str) -> None:
        """``held``'s unit gathered now and before each call of ``reader``; kept gathered until its gradients are
        reduced (FSDP2's final callback after backward), so that the reader's backward finds it gathered."""
        if (id(reader), id(held.unit)) not in self.gathered:
            self.gathered.add((id(reader), id(held.unit)))
            held.unit.set_reshard_after_forward(False, recurse=False)  # type: ignore[operator]
            reader.register_forward_pre_hook(_gather(held.unit))
            held.unit.register_forward_pre_hook(_refuse(_called_message(held.name, unit, where)))
            rank_zero_info(f"lightning_tpp: {self.names[id(reader)] or 'the root module'} reads {held.name} outside "
                           f"the forward of its FSDP2 unit {unit}: the unit is gathered before each call of the "
                           f"reader (set example_input_array to have units chosen from the forward's reads at setup)")
        held.unit.unshard()  # type: ignore[operator]


def _hook(fn: Callable[[nn.Module], None]) -> Callable[..., None]:
    """A plain function (copied as itself by ``deepcopy``, which a bound method of the guard would not be)."""
    return lambda module, *rest: fn(module)


def _gather(unit: nn.Module) -> Callable[..., None]:
    return lambda module, args: unit.unshard()  # type: ignore[operator]


def _refuse(message: str) -> Callable[..., None]:
    def hook(module: nn.Module, args: Any) -> None:
        if torch.is_grad_enabled():  # its own backward would reduce its gradients before the reader's came
            raise ShardedReadError(message)
    return hook


def _called_message(param: str, unit: str, where: str) -> str:
    return (f"{param} is read by {where}, outside the forward of {unit}, its FSDP2 unit, which the step also calls: "
            f"no unit gathers it for both. Set the LightningModule's example_input_array (one batch's input of its "
            f"forward) so that the strategy sees the read at setup and makes a module enclosing both the unit, or "
            f"use dp_sharding='no_shard'")


def guard_reads(root: nn.Module, units: Sequence[nn.Module], rows: Sequence[Any]) -> ReadGuard:
    """A :class:`ReadGuard` on ``root``: its FSDP2 ``units`` and the vocabulary matrices computed over dp (``rows``,
    ``data_parallel.rows.RowsOverDP``)."""
    return ReadGuard(root, units, rows)
