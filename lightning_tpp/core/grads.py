"""Gradient collectives outside the model: data-parallel averaging and clipping by the global norm.

Why not ``DistributedDataParallel``: the Trainer's closure and (later) the pipeline schedule decide when backward
runs, and DDP's reducer would need ``no_sync`` bookkeeping for every micro-batch. One bucketed all-reduce per
optimizer step, after the closure, is what DDP does at a step boundary and composes with accumulation for free.

Global norm: a sharded parameter's squares are summed over the tensor-parallel group; a replicated parameter is
counted once (tp rank 0), so the norm equals ``clip_grad_norm_`` on the single-device model::

    ||g||^2 = sum_tp sum_sharded ||g_r||^2  +  sum_replicated ||g||^2
"""

from __future__ import annotations

from typing import Any, Container, Iterable, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_tpp._compat import flatten_dense_tensors as _flatten_dense_tensors
from lightning_tpp._compat import unflatten_dense_tensors as _unflatten_dense_tensors
from lightning_tpp.core.dp_shard import is_dp_sharded, local

_BUCKET_BYTES = 32 * 2**20


def _buckets(tensors: list[Tensor]) -> Iterable[list[Tensor]]:
    by_kind: dict[tuple[torch.dtype, torch.device], list[Tensor]] = {}
    for t in tensors:
        by_kind.setdefault((t.dtype, t.device), []).append(t)
    for group in by_kind.values():
        bucket: list[Tensor] = []
        size = 0
        for t in group:
            bucket.append(t)
            size += t.numel() * t.element_size()
            if size >= _BUCKET_BYTES:
                yield bucket
                bucket, size = [], 0
        if bucket:
            yield bucket


def all_reduce_coalesced(tensors: list[Tensor], group: Optional[ProcessGroup], *, average: bool) -> None:
    """Sum (or average) ``tensors`` in place over ``group`` in a few flat buckets."""
    n = dist.get_world_size(group)
    for bucket in _buckets(tensors):
        flat = _flatten_dense_tensors(bucket)
        dist.all_reduce(flat, group=group)
        if average:
            flat.div_(n)
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(synced)


def average_gradients(params: list[nn.Parameter], group: Optional[ProcessGroup]) -> None:
    """Average gradients over a data-parallel group (see :func:`reduce_gradients`)."""
    params = [p for p in params if not is_dp_sharded(p)]  # FSDP2 averaged those (reduce-scatter in backward)
    if group is None or dist.get_world_size(group) == 1 or not params:
        return
    reduce_gradients(params, group, divisor=dist.get_world_size(group))


def reduce_gradients(params: list[nn.Parameter], group: Optional[ProcessGroup], *, divisor: int = 1) -> None:
    """Sum the gradients of ``params`` over ``group`` (every rank passes the same parameters) and divide them by
    ``divisor``, in one all-reduce per flat bucket. A parameter without a gradient on some ranks (a branch not taken)
    gets zeros there, as DDP does; one without a gradient anywhere keeps ``None``: each bucket carries, after its
    gradients, one slot per parameter counting the ranks that hold one, so that the presence costs no collective of
    its own (on gloo, one all-reduce's latency was a third of a small model's reduction), and it is read back to
    the host only on a rank that lacks a gradient. The division is folded into the copy back (one pass)."""
    if group is None or dist.get_world_size(group) == 1:
        for p in params:
            if p.grad is not None and divisor != 1:
                p.grad.div_(divisor)
        return
    for bucket in _buckets(params):
        sizes = [p.numel() for p in bucket]
        total = sum(sizes)
        flat = torch.empty(total + len(bucket), dtype=bucket[0].dtype, device=bucket[0].device)
        views = flat[:total].split(sizes)
        for p, view in zip(bucket, views):
            if p.grad is None:
                view.zero_()
            else:
                view.view(p.grad.shape).copy_(p.grad)
        flat[total:].copy_(torch.tensor([float(p.grad is not None) for p in bucket], dtype=flat.dtype))
        dist.all_reduce(flat, group=group)
        missing = [i for i, p in enumerate(bucket) if p.grad is None]
        nowhere = set(i for i, n in zip(missing, flat[total:][missing].tolist()) if n == 0) if missing else set()
        for i, (p, view) in enumerate(zip(bucket, views)):
            if i in nowhere:
                continue
            if p.grad is None:
                p.grad = torch.empty_like(p)
            torch.div(view.view(p.grad.shape), divisor, out=p.grad)


def _norm_power(grads: list[Tensor], norm_type: float, device: torch.device) -> Tensor:
    grads = [g for g in grads if g.numel()]  # an uneven dp split can leave a rank an empty part
    if not grads:
        return torch.zeros((), device=device)
    if norm_type == float("inf"):
        return torch.stack([g.detach().abs().max().float() for g in grads]).max()
    return torch.stack([torch.linalg.vector_norm(g.detach().float(), norm_type) ** norm_type for g in grads]).sum()


def _counted(p: nn.Parameter, sharded: Container[Tensor], tp_rank: int, groups: list[Any]) -> list[Tensor]:
    """``p``'s gradient as this rank counts it: rows that several tp ranks hold (K/V heads fewer than tp) count on
    the first of them only."""
    spec_of = getattr(sharded, "spec", None)
    spec = spec_of(p) if spec_of is not None else None
    if spec is None or not spec.replicated or is_dp_sharded(p.grad):
        return [p.grad]
    world = dist.get_world_size(groups[0]) if groups and groups[0] is not None else 1
    size = sharded.full_shape(p)[spec.dim]  # type: ignore[attr-defined]
    return spec.owned(p.grad, size, tp_rank, world)


def global_grad_norm(params: Iterable[nn.Parameter], *, sharded: Container[Tensor], tp_rank: int, groups: list[Any],
                     norm_type: float = 2.0, dp_group: Optional[ProcessGroup] = None) -> Tensor:
    """Norm of all gradients of the whole (unsharded) model; every rank gets the same value. A shard's gradient counts
    on every tp rank, a replicated one on tp rank 0 only; a gradient sharded over dp (FSDP2) counts each dp rank's
    part, summed over ``dp_group``."""
    params = list(params)
    # the parameters' device even where no gradient is left (a step dropped everywhere): NCCL takes no CPU tensor
    device = local(params[0]).device if params else torch.device("cpu")
    params = [p for p in params if p.grad is not None]
    spec_of = getattr(sharded, "spec", lambda p: None)
    experts = [p for p in params if (s := spec_of(p)) is not None and s.over is not None]
    params = [p for p in params if (s := spec_of(p)) is None or s.over is None]
    mine = [g for p in params if p in sharded or tp_rank == 0 for g in _counted(p, sharded, tp_rank, groups)]
    inf = norm_type == float("inf")
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    total = _norm_power([g for g in mine if not is_dp_sharded(g)], norm_type, device)
    if experts:  # cut over the ep group (alike on their replicas): summed over it, then counted on tp rank 0
        over_ep = _norm_power([local(p.grad) for p in experts], norm_type, device)
        dist.all_reduce(over_ep, op=op, group=spec_of(experts[0]).over.group)
        on_replicas = next((p.grad for p in experts if is_dp_sharded(p.grad)), None)
        if on_replicas is not None:  # ... and sharded over their replicas (FSDP2): each part counted once
            dist.all_reduce(over_ep, op=op, group=on_replicas.device_mesh.get_group())
        if tp_rank == 0:
            total = torch.maximum(total, over_ep) if inf else total + over_ep
    parts = [local(g) for g in mine if is_dp_sharded(g)]
    if any(is_dp_sharded(p.grad) for p in params):  # the same parameters on every dp rank: all join
        over_dp = _norm_power(parts, norm_type, device)
        if dp_group is not None and dist.get_world_size(dp_group) > 1:
            dist.all_reduce(over_dp, op=op, group=dp_group)
        total = torch.maximum(total, over_dp) if inf else total + over_dp
    for group in groups:
        if group is not None and dist.get_world_size(group) > 1:
            dist.all_reduce(total, op=op, group=group)
    return total if inf else total ** (1.0 / norm_type)


def clip_by_global_norm(params: list[nn.Parameter], max_norm: float, *, sharded: Container[Tensor], tp_rank: int,
                        groups: list[Any], norm_type: float = 2.0,
                        apply_to: Optional[list[nn.Parameter]] = None,
                        dp_group: Optional[ProcessGroup] = None) -> Tensor:
    """``torch.nn.utils.clip_grad_norm_`` with the norm taken over every shard of every stage (``params``: each
    weight once; ``apply_to``: every local copy, e.g. both ends of a tied embedding)."""
    total = global_grad_norm(params, sharded=sharded, tp_rank=tp_rank, groups=groups, norm_type=norm_type,
                             dp_group=dp_group)
    coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    with torch.no_grad():
        for p in apply_to if apply_to is not None else params:
            if p.grad is not None:
                local(p.grad).mul_(coef.to(p.grad.dtype))
    return total


def broadcast_module(module: nn.Module, src: int = 0, group: Optional[ProcessGroup] = None) -> None:
    """Make every rank start from ``src``'s parameters and buffers (as DDP does at wrap time)."""
    tensors = [t.data for t in list(module.parameters()) + list(module.buffers()) if not t.is_meta]  # deduplicated
    for bucket in _buckets(tensors):
        flat = _flatten_dense_tensors(bucket)
        dist.broadcast(flat.view(torch.uint8) if flat.dtype == torch.bool else flat, src=src, group=group)
        for t, synced in zip(bucket, _unflatten_dense_tensors(flat, bucket)):
            t.copy_(synced)
