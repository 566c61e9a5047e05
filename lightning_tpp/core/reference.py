"""A parallel module checked against its original: a copy with the original classes and whole (gathered) weights,
run on the same inputs, and the first difference between the two outputs. The first-call checks of every swapped
module kind (tensor-parallel blocks and layers, sequence-parallel elements, expert banks cut over tp or split over
ep) are the two functions at the end, :func:`check_forward` and :func:`check_gradients`, with one error contract
(:class:`Mismatch`)::

    first call:  copies of the inputs -> original (whole weights, eval) -> parallel (eval) -> first difference
                 -> every rank of the group agrees -> all raise the same Mismatch, or all go on
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_tpp._compat import (fsdp_gathered, hf_output_collector, outside_function_modes, outside_saved_tensors_hooks,
                                   tree_flatten)
from lightning_tpp.core.comm import TPGroup, all_reduce_flag, gather_with_spec
from lightning_tpp.core.dp_shard import fsdp_classes_hidden, gather_dp, is_dp_sharded
from lightning_tpp.core.params import ShardIndex
from lightning_tpp.core.sharding import ShardSpec
from lightning_tpp.core.swap import slots, unswap
from lightning_tpp.core.walk import VERIFYING, tensors_in


class TensorParallelMismatchError(RuntimeError):
    """A parallelised block does not compute what the original computed."""


def reference_copy(block: nn.Module, group: TPGroup, shards: ShardIndex) -> nn.Module:
    """A copy of ``block`` with the original classes, attributes and full (gathered) weights."""
    memo: dict[int, Any] = {id(o): o for o in slots(block)}
    for p in block.parameters():
        spec = shards.spec(p)
        if spec is not None or is_dp_sharded(p):  # a weight computed over dp (data_parallel.rows): its rows gathered
            whole = gather_dp(p.detach())
            memo[id(p)] = nn.Parameter(whole if spec is None else gather_with_spec(whole, spec, group),
                                       requires_grad=False)
        else:
            memo[id(p)] = p
    for m in block.modules():  # hooks are shared, not copied (FSDP2's and the strategy's reach the whole model)
        for hooks in _HOOKS(m):
            memo.update({id(h): h for h in hooks.values()})
    with fsdp_classes_hidden(block) as shared:
        ref = copy.deepcopy(block, {**memo, **shared})
    for m in ref.modules():
        unswap(m)
        _drop_fsdp_hooks(m)
    return ref


def _HOOKS(m: nn.Module) -> tuple[dict, ...]:  # noqa: N802
    return (m._forward_pre_hooks, m._forward_hooks, m._backward_hooks, m._backward_pre_hooks)


@contextlib.contextmanager
def against_reference(block: nn.Module, group: TPGroup, shards: ShardIndex) -> Iterator[nn.Module]:
    """``block`` and its :func:`reference_copy`, both in eval mode (no dropout) for a first-call check; ``block``'s
    training modes are put back after."""
    ref = reference_copy(block, group, shards)
    modes = {m: m.training for m in block.modules()}
    block.eval()
    ref.eval()
    try:
        yield ref
    finally:
        for m, mode in modes.items():
            m.training = mode


def _drop_fsdp_hooks(module: nn.Module) -> None:
    """A copied FSDP2 unit keeps its hooks, bound to the state it shares with the original: running the copy would
    reshard the original's parameters; the strategy's own hooks (reads guarded over dp) belong to the original."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(hooks.items()):
            if _hook_from(hook, ("torch.distributed", "lightning_tpp.")):
                del hooks[key]


def _hook_from(hook: Any, packages: tuple[str, ...]) -> bool:
    return (getattr(getattr(hook, "__func__", hook), "__module__", "") or "").startswith(packages)


@contextlib.contextmanager
def units_gathered(module: nn.Module, *, itself: bool = False) -> Iterator[None]:
    """The FSDP2 units inside ``module`` (an expert bank sharded over its replicas, inside a block checked whole; with
    ``itself``, ``module`` too) gathered, and their FSDP2 hooks off, for a check's forward and backward; after it,
    those that were sharded before are sharded again. Through its hooks, the check's own backward would fire FSDP2's
    end-of-backward callback, which reshards every unit: the enclosing block's too, in the middle of its forward (its
    weights' storage freed)."""
    from torch.distributed.fsdp import FSDPModule

    units = [m for m in module.modules() if (itself or m is not module) and isinstance(m, FSDPModule)]
    sharded = [unit for unit in units if not fsdp_gathered(unit)]
    saved = []
    for unit in units:
        unit.unshard()
        for hooks in (unit._forward_pre_hooks, unit._forward_hooks):
            saved.append((hooks, dict(hooks)))
            for key in [k for k, h in hooks.items() if _hook_from(h, ("torch.distributed",))]:
                del hooks[key]
    try:
        yield
    finally:
        for hooks, before in saved:
            added = {k: h for k, h in hooks.items() if k not in before}
            hooks.clear()
            hooks.update({**before, **added})
        for unit in sharded:
            unit.reshard()


def isolated(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Copies of the call's containers and stateful objects (e.g. a KV cache), sharing its tensors."""
    memo = {id(t): t for t in tensors_in((args, kwargs), set())}
    return copy.deepcopy((args, kwargs), memo)


def _local_slice(got: Tensor, want: Tensor, group: TPGroup) -> Optional[Tensor]:
    """``want`` cut to this rank's part when ``got`` is a per-head output (e.g. attention probabilities)."""
    if got.dim() != want.dim():
        return None
    diff = [d for d in range(want.dim()) if got.shape[d] != want.shape[d]]
    if len(diff) != 1 or got.shape[diff[0]] * group.size != want.shape[diff[0]]:
        return None
    n = got.shape[diff[0]]
    return want.narrow(diff[0], group.rank * n, n)


def _low_precision(t: Tensor) -> bool:
    """Whether ``t`` holds values of low precision: half-precision values, values computed under autocast (a
    parameter's float32 gradient from bf16 products), or float32 products on a GPU that runs them in TF32
    (``torch.set_float32_matmul_precision("high")``): two kernels' roundings then differ well above 1e-4."""
    kind = t.device.type
    return t.dtype in (torch.float16, torch.bfloat16) or (kind != "meta" and torch.is_autocast_enabled(kind)) or \
        (kind == "cuda" and torch.get_float32_matmul_precision() != "highest")


def first_difference(got: Any, want: Any, group: TPGroup, path: str = "output") -> Optional[str]:
    """None when ``got`` matches ``want``; else a description of the first difference."""
    if isinstance(want, Tensor):
        if isinstance(got, Tensor) and got.shape != want.shape:
            want = _local_slice(got, want, group)
            if want is None:
                return f"{path}: shape {tuple(got.shape)} does not match the original's"
        if not isinstance(got, Tensor):
            return f"{path}: {type(got).__name__} instead of a tensor"
        rtol = 2e-2 if _low_precision(want) else 1e-4
        scale = max(1.0, float(want.abs().max())) if want.numel() and want.is_floating_point() else 1.0
        if want.is_floating_point() and not torch.allclose(got.float(), want.float(), rtol=rtol, atol=rtol * scale,
                                                           equal_nan=True):
            return f"{path}: max abs difference {float((got.float() - want.float()).abs().max()):.3g}"
        return None
    if isinstance(want, dict):
        for k in want:
            r = first_difference(got[k] if k in got else None, want[k], group, f"{path}[{k!r}]")
            if r:
                return r
        return None
    if isinstance(want, (list, tuple)):
        for i, (g, w) in enumerate(zip(got, want)):
            r = first_difference(g, w, group, f"{path}[{i}]")
            if r:
                return r
    return None


def summed(g: Tensor, group: TPGroup) -> Tensor:
    """``g`` added up over the ranks of ``group`` (a copy)."""
    g = g.clone()
    torch.distributed.all_reduce(g, group=group.group)
    return g


def whole_or_part(got: Tensor, want: Tensor, group: TPGroup) -> Optional[str]:
    """How a replicated parameter's gradient on this rank stands to the original's, decided by every rank of ``group``
    together: ``"whole"`` (it is the original's), ``"part"`` (the ranks' gradients sum to it: the parameter was used
    on this rank's share only, a per-head norm), or None (neither: a mismatch)."""
    whole = first_difference(got, want, group) is None
    total = summed(got, group)
    part = first_difference(total, want, group) is None
    if whole and part:  # values far below the tolerance's floor (a norm's gradient of 1e-6 on a small micro-batch):
        # the nearer one (a part is off by the other ranks' parts, a whole one summed by tp - 1 times itself)
        whole = bool((got - want).abs().max() <= (total - want).abs().max())
        part = not whole
    if all_reduce_flag(whole, group.group):
        return "whole"
    return "part" if all_reduce_flag(part, group.group) else None


# ----------------------------------------------------------------------------------------------------------------
# the first-call checks, one for the forward and one for the gradients, whatever the module kind

Key = tuple[str, Any]  # where an input is in a call: ("arg", position) or ("kw", name)


@dataclass(frozen=True)
class Mismatch:
    """How a first-call check fails, for every kind of swapped module: every rank of the group decides together,
    and all raise ``error`` with ``{kind} {name!r} ({cls}) {claim}: {problem}. {cause}; {fix}`` (a rank whose own
    comparison passed names ``others`` as the problem)."""

    kind: str  # "tensor-parallel mlp block", "expert parallelism of", "sequence parallelism: block", ...
    name: str  # the module's name in the model, as tp_plan= names it
    cls: str  # its class, as the user knows it
    cause: str  # what the parallel version probably does not model
    claim: str = "does not match the original model on this rank"
    fix: str = ""  # empty: keep it replicated with tp_plan={name: 'replicate'}, or pass verify=False
    error: type[Exception] = TensorParallelMismatchError
    others: str = "another tp rank differs"

    def raised(self, problem: Optional[str]) -> Exception:
        fix = self.fix or (f"keep it replicated with tp_plan={{'{self.name}': 'replicate'}}, or pass verify=False "
                           f"to skip this check")
        return self.error(f"{self.kind} {self.name!r} ({self.cls}) {self.claim}: {problem or self.others}. "
                          f"{self.cause}; {fix}")


def _agreed(ok: bool, group: TPGroup, also: Sequence[Optional[ProcessGroup]]) -> bool:
    """``ok`` on every rank of ``group``, then of each of ``also`` (the same decision everywhere)."""
    ok = all_reduce_flag(ok, group.group)
    for other in also:
        ok = all_reduce_flag(ok, other)
    return ok


@contextlib.contextmanager
def _verifying(on: bool = True) -> Iterator[None]:
    """Forwards that are not the model's run (:data:`~lightning_tpp.core.walk.VERIFYING`)."""
    token = VERIFYING.set(True) if on else None
    try:
        yield
    finally:
        if token is not None:
            VERIFYING.reset(token)


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """``module`` in eval mode (no dropout draws) for a comparison, each submodule's mode restored after."""
    modes = [(m, m.training) for m in module.modules()]
    module.train(False)
    try:
        yield
    finally:
        for m, mode in modes:
            m.training = mode


@contextlib.contextmanager
def _records_kept() -> Iterator[None]:
    """What the layers record while a check runs (Hugging Face's output collector: router logits, attentions) is
    dropped after it: the model's own run reads only its own records (a router's logits from a check's graph would
    enter the auxiliary loss, and its backward)."""
    collector = hf_output_collector()
    lengths = {k: len(v) for k, v in collector.items() if isinstance(v, list)} if collector else {}
    try:
        yield
    finally:
        for k, n in lengths.items():
            del collector[k][n:]  # type: ignore[index]


@contextlib.contextmanager
def records_gathered(batch: Optional[int], part: int, whole: int,
                     gather: Callable[[Tensor], Tensor]) -> Iterator[None]:
    """What a block's layers record on this rank's ``part`` of the sequence for the model to read after its layers
    (Hugging Face's output collector: a router's logits for the load-balancing loss, attentions), made what one
    process records on the ``whole`` sequence by ``gather(t)`` along dim 1: ``(batch, part, ...)`` records as they
    are, ``(batch * part, ...)`` (flattened tokens, by batch then position) through ``(batch, part, ...)``. The
    gather's backward decides what each rank's part receives."""
    collector = hf_output_collector()
    lengths = {k: len(v) for k, v in collector.items() if isinstance(v, list)} if collector else {}
    try:
        yield
    finally:
        for key, n in lengths.items() if batch is not None else ():
            records = collector[key]  # type: ignore[index]
            for i in range(n, len(records)):
                t = records[i]
                if not isinstance(t, Tensor) or t.dim() < 1:
                    continue
                if t.dim() >= 2 and t.shape[:2] == (batch, part):
                    records[i] = gather(t)
                elif t.shape[0] == batch * part:
                    records[i] = gather(t.reshape(batch, part, *t.shape[1:])).reshape(batch * whole, *t.shape[1:])


def hidden_state_whole(stream: Tensor, gather: Callable[[Tensor], Tensor]) -> None:
    """At the entry of a block that takes ``stream``, this rank's part of the block before's output: where Hugging
    Face's output collector recorded that output as the model's hidden state (``output_hidden_states=True``; a hook
    on the block before, run after its forward returned, so outside :func:`records_gathered`), the record is made
    what one process records, ``gather(record)``. The record is the stream's tensor, or a view of it that FSDP2's
    pre-forward hook made (the same elements)."""
    collector = hf_output_collector()
    records = collector.get("hidden_states") if collector else None
    if not isinstance(records, list) or not records or stream.is_meta:
        return
    last = records[-1]
    if last is stream or (isinstance(last, Tensor) and last.shape == stream.shape and last.stride() == stream.stride()
                          and last.data_ptr() == stream.data_ptr()):
        records[-1] = gather(last)


def _forward(ref: nn.Module, args: tuple, kwargs: dict) -> Any:
    return ref.forward(*args, **kwargs)


@torch.compiler.disable  # compile=: a first-call check inside a compiled block runs eagerly, outside its graph
def check_forward(module: nn.Module, args: tuple, kwargs: dict, *, group: TPGroup, shards: ShardIndex,
                  parallel: Callable[[tuple, dict], Any], mismatch: Mismatch,
                  reference: Callable[[nn.Module, tuple, dict], Any] = _forward,
                  whole: Optional[Callable[[tuple, dict], tuple[tuple, dict]]] = None,
                  layouts: Sequence[Callable[[], None]] = (), also: Sequence[Optional[ProcessGroup]] = (),
                  mark_parallel: bool = True) -> None:
    """``parallel(args, kwargs)`` (the swapped module's forward) against ``reference(original, args, kwargs)`` (its
    :func:`reference_copy`), each on its own copies of this call's inputs (``whole(args, kwargs)``: as the original
    takes them), in eval mode without gradients; an error of the parallel forward is a mismatch. The ranks of
    ``group`` (then of each of ``also``) decide together; a mismatch raises ``mismatch``. ``layouts``: functions
    that re-cut the module in another layout (a fused projection's other order), tried in turn before failing.
    ``mark_parallel=False``: the parallel forward runs as the model's own run (not
    :data:`~lightning_tpp.core.walk.VERIFYING`: what is swapped inside it checks itself there)."""
    problem = None
    with torch.no_grad(), against_reference(module, group, shards) as ref, _records_kept():
        a, k = isolated(args, kwargs)
        with _verifying():
            want = reference(ref, *(whole(a, k) if whole is not None else (a, k)))
        for relayout in (None, *layouts):
            if relayout is not None:
                with _verifying():
                    relayout()
            with _verifying(mark_parallel):
                try:
                    problem = first_difference(parallel(*isolated(args, kwargs)), want, group)
                except Exception as err:  # noqa: BLE001 - local shapes the forward cannot take (a misread layer
                    # order, an index over the whole width): any error of the parallel forward is a mismatch
                    problem = f"the parallel forward raised {type(err).__name__}: {err}"
            if _agreed(problem is None, group, also):
                return
    raise mismatch.raised(problem)


def _leaves(args: tuple, kwargs: dict) -> tuple[tuple, dict, list[tuple[Key, Tensor]]]:
    """Copies of the call's inputs in which each floating tensor that needs a gradient is a new leaf."""
    args, kwargs = isolated(args, kwargs)
    made: list[tuple[Key, Tensor]] = []

    def leaf(key: Key, t: Any) -> Any:
        if not isinstance(t, Tensor) or not t.is_floating_point() or not t.requires_grad:
            return t
        made.append((key, t.detach().requires_grad_(True)))
        return made[-1][1]

    return (tuple(leaf(("arg", i), a) for i, a in enumerate(args)),
            {n: leaf(("kw", n), v) for n, v in kwargs.items()}, made)


def output_gradient(like: Tensor) -> Tensor:
    """The random output gradient a gradient check differentiates with: the same on every rank and in every call (its
    own generator), of ``like``'s shape, dtype and device."""
    gen = torch.Generator(device="cpu").manual_seed(20261)
    return torch.randn(like.shape, generator=gen, dtype=torch.float32).to(like)


def _graded(out: Any) -> Optional[Tensor]:
    """The output that is differentiated: the first tensor of it that has a gradient."""
    return next((t for t in tree_flatten(out)[0] if isinstance(t, Tensor) and t.requires_grad), None)


@torch.compiler.disable
def check_gradients(module: nn.Module, args: tuple, kwargs: dict, *, group: TPGroup, shards: ShardIndex,
                    parallel: Callable[[tuple, dict], Any], mismatch: Mismatch,
                    reference: Callable[[nn.Module, tuple, dict], Any] = _forward,
                    whole: Optional[Callable[[tuple, dict], tuple[tuple, dict]]] = None,
                    replicated: Optional[Callable[[str, Tensor, Tensor, Tensor], Optional[str]]] = None,
                    input_parts: Callable[[Key], bool] = lambda key: False, output_dim: Optional[int] = None,
                    mark_parallel: bool = True) -> None:
    """The gradients of the swapped module's inputs and parameters (shards gathered) against its original's on the
    same inputs, for one random output gradient (the same on every rank), both in eval mode: catches what the
    forward check cannot (a backward that loses or doubles a part). Runs outside the step's function modes and
    saved-tensor hooks; any error is a mismatch, decided and raised as in :func:`check_forward`. What differs by kind:

    * ``whole(args, kwargs)``: the inputs as the original takes them (sequence parallelism: the stream gathered);
    * ``input_parts(key)``: an input whose gradient each rank holds a part of (summed over the group first);
    * ``output_dim``: the dimension along which the parallel output is this rank's part of the original's (None: an
      output of another shape, a per-head one, is left to the forward check);
    * ``replicated(name, param, grad, original's grad)``: the problem with a replicated parameter's gradient, which
      may be each rank's part (a per-head norm: the caller records it, to be summed over tp); default: compared whole.
    """
    problem = None
    with outside_function_modes(), outside_saved_tensors_hooks(), against_reference(module, group, shards) as ref, \
            units_gathered(module), _verifying(mark_parallel), _records_kept():
        try:
            ref_params = dict(ref.named_parameters())
            named = [(n, q) for n, q in module.named_parameters()
                     if q.requires_grad and n in ref_params and _gradient_of_group(shards.spec(q), group)]
            for n, _ in named:  # the gathered copies of shards (replicated parameters are the module's own)
                ref_params[n].requires_grad_(True)
            a, k, inputs = _leaves(args, kwargs)
            got = _graded(parallel(a, k)) if inputs or named else None  # (else nothing of it trains)
            want = None
            if got is not None:
                a, k, ref_inputs = _leaves(*(whole(*isolated(args, kwargs)) if whole is not None else (args, kwargs)))
                with _verifying():
                    want = _graded(reference(ref, a, k))
            if got is not None and want is not None and (got.shape == want.shape or output_dim is not None):
                cotangent = output_gradient(want)
                part = cotangent if got.shape == want.shape else \
                    cotangent.narrow(output_dim, group.rank * got.shape[output_dim], got.shape[output_dim])
                mine = torch.autograd.grad(got, [t for _, t in inputs] + [q for _, q in named], part,
                                           allow_unused=True)
                theirs = torch.autograd.grad(want, [t for _, t in ref_inputs] + [ref_params[n] for n, _ in named],
                                             cotangent, allow_unused=True)
                problem = _first_gradient_difference(inputs, named, mine, theirs, group, shards, replicated,
                                                     input_parts)
            # (else nothing to differentiate, or a per-head output: the forward check has compared it)
        except Exception as err:  # noqa: BLE001 - any error of the parallel backward is a mismatch
            problem = f"its backward raised {type(err).__name__}: {err}"
    if not _agreed(problem is None, group, ()):
        raise mismatch.raised(problem)


def _gradient_of_group(spec: Optional[ShardSpec], group: TPGroup) -> bool:
    """Whether a parameter's gradient comes from the checked group's inputs alone. Experts split over an ep group
    that spans replicas (ep drawn from tp and dp) sum rows from the other replicas' batches, which the original, run
    on this replica's inputs, never sees: their gradients are left out (the inputs' gradients still cover the
    exchange's backward)."""
    over = spec.over if spec is not None else None
    if over is None or over.group is None or group.group is None:
        return True
    return set(dist.get_process_group_ranks(over.group)) <= set(dist.get_process_group_ranks(group.group))


def _first_gradient_difference(inputs: list[tuple[Key, Tensor]], named: list[tuple[str, Tensor]],
                               mine: Sequence[Optional[Tensor]], theirs: Sequence[Optional[Tensor]],
                               group: TPGroup, shards: ShardIndex,
                               replicated: Optional[Callable[[str, Tensor, Tensor, Tensor], Optional[str]]],
                               input_parts: Callable[[Key], bool]) -> Optional[str]:
    """The gradients of the inputs, then of the parameters (see :func:`check_gradients`): the first difference.
    The collectives run on every rank, whatever was found before."""
    problem = None
    for (key, _), g, w in zip(inputs, mine, theirs):
        if g is not None and input_parts(key):
            g = summed(g, group)
        if w is not None:
            problem = problem or first_difference(g, w, group, f"gradient of input {key[1]!r}")
    for (name, q), g, w in zip(named, mine[len(inputs):], theirs[len(inputs):]):
        if g is None or w is None:
            if (g is None) != (w is None):
                problem = problem or f"gradient of {name!r}: {'none' if g is None else 'one'} on this rank, " \
                                     f"{'none' if w is None else 'one'} in the original"
            continue
        info = shards.get(q)
        if info is not None:
            found = first_difference(gather_with_spec(g, info.spec, group), w, group, f"gradient of {name!r}")
        elif replicated is not None:
            found = replicated(name, q, g, w)
        else:
            found = first_difference(g, w, group, f"gradient of {name!r}")
        problem = problem or found
    return problem
