"""A parallel module checked against its original: a copy with the original classes and whole (gathered) weights,
run on the same inputs, and the first difference between the two outputs. Used by every first-call check (tensor-
parallel blocks and layers, sequence-parallel elements, expert banks)."""

from __future__ import annotations

import contextlib
import copy
from typing import Any, Iterator, Optional

import torch
from torch import Tensor, nn

from lightning_tpp.core.comm import TPGroup, all_reduce_flag, gather_with_spec
from lightning_tpp.core.dp_shard import fsdp_classes_hidden, gather_dp, is_dp_sharded
from lightning_tpp.core.params import ShardIndex
from lightning_tpp.core.swap import slots, unswap
from lightning_tpp.core.walk import tensors_in


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
    with fsdp_classes_hidden(block) as shared:
        ref = copy.deepcopy(block, {**memo, **shared})
    for m in ref.modules():
        unswap(m)
        _drop_fsdp_hooks(m)
    return ref


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
    reshard the original's parameters."""
    for hooks in (module._forward_pre_hooks, module._forward_hooks):
        for key, hook in list(hooks.items()):
            if getattr(getattr(hook, "__func__", hook), "__module__", "").startswith("torch.distributed"):
                del hooks[key]


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


def first_difference(got: Any, want: Any, group: TPGroup, path: str = "output") -> Optional[str]:
    """None when ``got`` matches ``want``; else a description of the first difference."""
    if isinstance(want, Tensor):
        if isinstance(got, Tensor) and got.shape != want.shape:
            want = _local_slice(got, want, group)
            if want is None:
                return f"{path}: shape {tuple(got.shape)} does not match the original's"
        if not isinstance(got, Tensor):
            return f"{path}: {type(got).__name__} instead of a tensor"
        low = want.dtype in (torch.float16, torch.bfloat16) or torch.is_autocast_enabled("cpu")
        rtol = 2e-2 if low else 1e-4
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


def whole_or_part(got: Tensor, want: Tensor, group: TPGroup) -> Optional[str]:
    """How a replicated parameter's gradient on this rank stands to the original's, decided by every rank of ``group``
    together: ``"whole"`` (it is the original's), ``"part"`` (the ranks' gradients sum to it: the parameter was used
    on this rank's share only, a per-head norm), or None (neither: a mismatch)."""
    whole = first_difference(got, want, group) is None
    summed = got.clone()
    torch.distributed.all_reduce(summed, group=group.group)
    part = first_difference(summed, want, group) is None
    if whole and part:  # values far below the tolerance's floor (a norm's gradient of 1e-6 on a small micro-batch):
        # the nearer one (a part is off by the other ranks' parts, a whole one summed by tp - 1 times itself)
        whole = bool((got - want).abs().max() <= (summed - want).abs().max())
        part = not whole
    if all_reduce_flag(whole, group.group):
        return "whole"
    return "part" if all_reduce_flag(part, group.group) else None
