"""Fewer K/V heads than tensor-parallel ranks (multi-query attention, grouped-query with ``kv_heads < tp``).

The query heads are cut as usual; each rank keeps the K/V heads its query heads read, whole (Megatron-Core's way)::

    heads = 8, kv_heads = 2, tp = 4         query heads per rank: 2, ranks per K/V head: 2

    rank 0:  q0 q1 | k0 v0        rank 2:  q4 q5 | k1 v1
    rank 1:  q2 q3 | k0 v0        rank 3:  q6 q7 | k1 v1

So ``tp`` must divide the query heads and ``kv_heads`` must divide ``tp``. The K/V projections (or the K/V rows of a
fused one) are then held by ``tp / kv_heads`` ranks each; each such rank back-propagates only its own query heads'
share of their gradient, so the shares are summed over the ranks that hold the same rows (:func:`summed_shared`, in
the layer's forward: the sum happens in backward, before FSDP2 or an accumulation sees the gradient). The gradient
of the block's input needs nothing more: ``copy_to_tp`` already sums every rank's part.
"""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any, Iterator, Mapping

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.params import ShardInfo
from lightning_tpp.core.sharding import ShardSpec


def shared_specs(specs: list[ShardSpec], heads: int, kv_heads: int, head_dim: int, tp: int) -> list[ShardSpec]:
    """A fused projection's candidate layouts (see ``plan._attention``) rewritten for ``kv_heads < tp``: the K/V
    segments held whole by ``tp / kv_heads`` ranks each; a contiguous candidate (layouts interleaved per K/V group,
    ``[q_g..., k_g, v_g]``) becomes one block per group."""
    share = tp // kv_heads
    with_q = any(s.parts is not None and len(s.parts) == 3 for s in specs)  # [q | k | v], else [k | v]
    kv_shares = (1, share, share) if with_q else (share, share)
    out = []
    for spec in specs:
        if spec.parts is not None:  # the segments side by side
            out.append(dataclasses.replace(spec, shares=kv_shares))
        else:  # interleaved per K/V group: [q_g... | k_g | v_g] per group, or [k_g | v_g]
            parts = (heads * head_dim // kv_heads, head_dim, head_dim) if with_q else (head_dim, head_dim)
            out.append(ShardSpec(spec.dim, parts, kv_shares, blocks=kv_heads))
    return out


def plain_kv_spec(dim: int, kv_width: int, kv_heads: int, tp: int) -> ShardSpec:
    """A separate K or V projection: rank ``r`` holds K/V head ``r // (tp / kv_heads)``, whole."""
    return ShardSpec(dim, (kv_width,), (tp // kv_heads,))


def _extents(spec: ShardSpec, size: int) -> list[tuple[int, int]]:
    """(start, length) of every replicated segment of the whole dimension."""
    parts = spec.parts or (size // spec.blocks,)
    out, start = [], 0
    for _ in range(spec.blocks):
        for part, share in zip(parts, spec.shares or (1,) * len(parts)):
            if share > 1:
                out.append((start, part))
            start += part
    return out


def sum_shared_grad(grad: Tensor, spec: ShardSpec, size: int, group: TPGroup) -> Tensor:
    """``grad`` with its replicated rows summed over the ranks that hold them: each rank writes its rows at their
    place in a buffer of every replicated segment, one all-reduce adds them (zeros where a rank holds nothing)."""
    extents = _extents(spec, size)
    at, total = {}, 0
    for start, length in extents:
        at[start], total = total, total + length
    shape = list(grad.shape)
    shape[spec.dim] = total
    buf = grad.new_zeros(shape)
    local, slots = 0, []
    parts = spec.parts or (size // spec.blocks,)
    shares = spec.shares or (1,) * len(parts)
    for (start, n), share in zip(spec.pieces(size, group.rank, group.size), shares):
        if share > 1:
            ext = next(s for s, length in extents if s <= start < s + length)
            pos = at[ext] + start - ext
            buf.narrow(spec.dim, pos, n).copy_(grad.narrow(spec.dim, local, n))
            slots.append((local, pos, n))
        local += n
    if not buf.is_meta:  # shapes only (the memory planner's meta backward): nothing to sum
        dist.all_reduce(buf, group=group.group)
    out = grad.clone()
    for local, pos, n in slots:
        out.narrow(spec.dim, local, n).copy_(buf.narrow(spec.dim, pos, n))
    return out


class _SumShared(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, w: Tensor, info: ShardInfo, group: TPGroup) -> Tensor:
        ctx.info, ctx.group = info, group
        return w.view_as(w)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        info = ctx.info
        return sum_shared_grad(grad, info.spec, info.full_shape[info.spec.dim], ctx.group), None, None


@contextlib.contextmanager
def summed_shared(layer: nn.Module, shared: Mapping[str, ShardInfo], group: TPGroup) -> Iterator[None]:
    """Inside: ``layer``'s replicated parameters (by attribute) are views whose gradient is summed over the ranks
    that hold the same rows. The layer's own forward runs unchanged (Falcon's ``x @ self.weight.T``)."""
    params = layer._parameters
    kept = {a: params[a] for a in shared if params.get(a) is not None}
    if not torch.is_grad_enabled() or not any(info.spec.replicated for info in shared.values()):
        yield
        return
    try:
        for attr, p in kept.items():
            params[attr] = _SumShared.apply(p, shared[attr], group)  # type: ignore[assignment]
        yield
    finally:
        params.update(kept)
