"""Differentiable collectives of Megatron-style tensor parallelism, and the group they run on.

Megatron's two conjugate operators::

    f = copy_to_tp:      forward identity      backward all-reduce   (before column-parallel layers)
    g = reduce_from_tp:  forward all-reduce    backward identity     (after row-parallel layers)

A transformer block therefore costs two all-reduces forward (attention out, MLP out) and two backward (the inputs of
the qkv and MLP-in projections). Projections that read the same tensor (q, k and v; gate and up) share one ``f`` through
:class:`TPScope`, so that their input gradients are summed locally and all-reduced once.
"""

from __future__ import annotations

import contextlib
import math

from dataclasses import dataclass, field
from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_tpp.core.seeding import OwnStream
from lightning_tpp.core.sharding import ShardSpec, unshard_tensor
from lightning_tpp.core.walk import Scoped


@dataclass
class TPGroup:
    """The tensor-parallel process group of this rank (``group=None`` means a single process), and the strategy's
    own random stream for dropout over its shards."""

    group: Optional[ProcessGroup]
    rank: int
    size: int
    stream: OwnStream = field(default_factory=OwnStream, compare=False, repr=False)


def _all_reduce(t: Tensor, group: TPGroup) -> Tensor:
    if t.is_meta:  # shapes only (the memory planner runs parallel layers on the meta device): nothing to reduce
        return t
    # gloo has no half-precision reductions: reduce in fp32 and cast back (CPU only; NCCL keeps the dtype).
    if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16):
        buf = t.float()
        torch.distributed.all_reduce(buf, group=group.group)
        return buf.to(t.dtype)
    t = t.contiguous()
    torch.distributed.all_reduce(t, group=group.group)
    return t


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _all_reduce(grad.clone(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup) -> Tensor:
        return _all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad, None


GATHER_PIECES = 8  # a large all-gather along the last dim is received in this many pieces (see _GatherFromTP)
_GATHER_WHOLE = 4 * 2 ** 20  # ... when it is larger than this (bytes)


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim (forward); keep the local slice of the gradient (backward).

    The ranks' slices are interleaved along the last dim, so what an all-gather receives (rank after rank) must be
    rearranged. A large result (an LM head's whole logits) is received a few rows at a time, each piece copied into
    its place: beside the result only ``1 / GATHER_PIECES`` of it is alive, where an all-gather into a list and a
    concatenation held it twice (profile of the last stage at tp2 x pp2 x dp2: the head's gather set the peak)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        if x.is_meta:  # shapes only: the gathered shape, no communication
            return torch.cat([x] * group.size, dim=-1)
        comm = x.float() if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) else x
        width, size = comm.shape[-1], group.size
        rows = comm.reshape(-1, width)
        out = rows.new_empty(rows.shape[0], size * width)
        pieces = GATHER_PIECES if out.numel() * out.element_size() > _GATHER_WHOLE else 1
        step = max(1, math.ceil(rows.shape[0] / pieces))
        for start in range(0, rows.shape[0], step):
            piece = rows[start:start + step]
            received = piece.new_empty(size * len(piece), width)  # rank after rank
            dist.all_gather_single(received, piece, group=group.group)
            out[start:start + len(piece)].view(len(piece), size, width).copy_(
                received.view(size, len(piece), width).transpose(0, 1))
            del received
        return out.view(*comm.shape[:-1], size * width).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        g = ctx.group
        return grad.chunk(g.size, dim=-1)[g.rank].contiguous(), None


# ----------------------------------------------------------------------------------------------------------------
# sequence parallelism (Megatron-SP): the residual stream between tensor-parallel blocks is cut along dim 1
#
#     scatter_seq:         forward: keep this rank's part       backward: all-gather     (entering the region)
#     gather_seq:          forward: all-gather                  backward: keep this part (entering a block, leaving)
#     seq_alias:           forward: the gathered tensor         backward: reduce-scatter (what column layers read)
#     reduce_scatter_seq:  forward: reduce-scatter              backward: all-gather     (after row layers)
#
# An all-gather and a reduce-scatter move the bytes of the all-reduce they replace (f and g above).

SEQ_DIM = 1


def _comm_dtype(t: Tensor) -> Tensor:
    # gloo has no half-precision reductions: communicate in fp32 on CPU (NCCL keeps the dtype)
    return t.float() if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) else t


def _seq_part(x: Tensor, group: TPGroup, dim: int = SEQ_DIM) -> Tensor:
    n = x.shape[dim] // group.size
    return x.narrow(dim, group.rank * n, n).contiguous()


def all_gather_seq(x: Tensor, group: TPGroup, dim: int = SEQ_DIM) -> Tensor:
    if x.is_meta:
        return torch.cat([x] * group.size, dim=dim)
    comm = _comm_dtype(x.contiguous())
    parts = [torch.empty_like(comm) for _ in range(group.size)]
    torch.distributed.all_gather(parts, comm, group=group.group)
    return torch.cat(parts, dim=dim).to(x.dtype)


def _seq_reduce_scatter(x: Tensor, group: TPGroup, dim: int = SEQ_DIM) -> Tensor:
    if x.shape[dim] % group.size:
        raise ValueError(f"sequence parallelism cuts dim {dim} (the sequence) into tp={group.size} parts, but it "
                         f"has {x.shape[dim]} (shape {tuple(x.shape)}); use a sequence length divisible by tp")
    if x.is_meta:
        return _seq_part(x, group, dim)
    # the tensor form, parts along dim 0 (dynamo traces it; the list form broke a compiled block's graph)
    comm = _comm_dtype(x).movedim(dim, 0).contiguous()
    out = comm.new_empty((comm.shape[0] // group.size, *comm.shape[1:]))
    torch.distributed.reduce_scatter_single(out, comm, group=group.group)
    return out.movedim(0, dim).contiguous().to(x.dtype)


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _seq_part(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return all_gather_seq(grad, ctx.group, ctx.dim), None, None


class _GatherSeq(torch.autograd.Function):
    """All-gather; backward keeps this rank's part (what used the gathered tensor ran replicated, or reduced its
    partial gradients itself: every rank holds the whole gradient), or with ``summed`` reduce-scatters (every rank's
    gradient of every part, summed: what used it ran on this rank's part of the work only, e.g. its queries against
    every key)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup, dim: int, summed: bool = False) -> Tensor:
        ctx.group, ctx.dim, ctx.summed = group, dim, summed
        return all_gather_seq(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        if ctx.summed:
            return _seq_reduce_scatter(grad.contiguous(), ctx.group, ctx.dim), None, None, None
        return _seq_part(grad, ctx.group, ctx.dim), None, None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return _seq_reduce_scatter(x, group, dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return all_gather_seq(grad, ctx.group, ctx.dim), None, None


def gather_summed(x: Tensor, group: TPGroup, dim: int) -> Tensor:
    return _GatherSeq.apply(x, group, dim, True)


class _SeqAlias(torch.autograd.Function):
    """The gathered stream as column-parallel layers read it: no communication forward (``whole`` is the gathered
    tensor); backward reduce-scatters their partial input gradients straight to ``shard``'s gradient."""

    @staticmethod
    def forward(ctx: Any, shard: Tensor, whole: Tensor, group: TPGroup, dim: int) -> Tensor:
        ctx.group, ctx.dim = group, dim
        return whole.view_as(whole)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _seq_reduce_scatter(grad, ctx.group, ctx.dim), None, None, None


def seq_alias(shard: Tensor, whole: Tensor, group: TPGroup, dim: int = SEQ_DIM) -> Tensor:
    return _SeqAlias.apply(shard, whole.detach(), group, dim)


def scatter_seq(x: Tensor, group: TPGroup) -> Tensor:
    if x.dim() < 3 or x.shape[SEQ_DIM] % group.size:
        raise ValueError(f"sequence parallelism cuts dim {SEQ_DIM} (the sequence) of the blocks' input, "
                         f"(batch, sequence, features), into tp={group.size} parts, but its shape is "
                         f"{tuple(x.shape)}; use a sequence length divisible by tp, or sequence_parallel=False")
    return _ScatterSeq.apply(x, group, SEQ_DIM)


def scatter_tokens(x: Tensor, group: TPGroup) -> Tensor:
    """This rank's part of flattened tokens (dim 0), all of which every rank holds; backward all-gathers."""
    return _ScatterSeq.apply(x, group, 0)


def gather_seq(x: Tensor, group: TPGroup, dim: int = SEQ_DIM) -> Tensor:
    return _GatherSeq.apply(x, group, dim)


def reduce_scatter_seq(x: Tensor, group: TPGroup, dim: int = SEQ_DIM) -> Tensor:
    return _ReduceScatterSeq.apply(x, group, dim)


# A layer cut over tp inside a block that runs on sequence shards (sequence parallelism) and that takes the block's
# tokens flattened (an expert bank: (tokens, features)) gathers them over the group first and reduce-scatters its
# partial output back: the group whose ranks hold different tokens while such a block runs, or None.
_TOKENS_SHARDED: Scoped[Optional[TPGroup]] = Scoped("lightning_tpp_tokens_sharded", None)


@contextlib.contextmanager
def tokens_sharded(group: Optional[TPGroup]) -> Iterator[None]:
    """While a block runs on sequence shards over ``group`` (None: inside it, where the stream is whole again)."""
    token = _TOKENS_SHARDED.set(group)
    try:
        yield
    finally:
        _TOKENS_SHARDED.reset(token)


def tokens_sharded_over() -> Optional[TPGroup]:
    return _TOKENS_SHARDED.get()


class _GatherTokens(torch.autograd.Function):
    """All-gather along dim 0 (flattened tokens); backward reduce-scatters: each rank's use of every token gave a
    partial gradient (its share of the features)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group = group
        return all_gather_seq(x, group, dim=0)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return _seq_reduce_scatter(grad, ctx.group, dim=0), None


def gather_tokens(x: Tensor, group: TPGroup) -> Tensor:
    """Every rank's tokens (dim 0), in rank order; integer tensors (routing indices) without a gradient."""
    return _GatherTokens.apply(x, group) if x.is_floating_point() else all_gather_seq(x, group, dim=0)


def reduce_scatter_tokens(x: Tensor, group: TPGroup) -> Tensor:
    """Partial outputs of every rank's tokens summed, this rank's tokens kept (dim 0)."""
    return _ReduceScatterSeq.apply(x, group, 0)


def _swap(x: Tensor, group: TPGroup, split: int, cat: int) -> Tensor:
    if x.shape[split] % group.size:
        raise ValueError(f"an all-to-all over {group.size} ranks cuts dim {split} of shape {tuple(x.shape)}, which "
                         f"{group.size} does not divide")
    send = _comm_dtype(torch.stack(x.chunk(group.size, dim=split)))  # piece j goes to rank j
    recv = torch.empty_like(send)
    if not x.is_meta:  # shapes only on the meta device (the memory planner)
        dist.all_to_all_single(recv, send, group=group.group)
    return torch.cat(recv.to(x.dtype).unbind(0), dim=cat)  # rank j's piece for this rank, in rank order


class _Swap(torch.autograd.Function):
    """All-to-all: ``x`` cut along ``split`` into one piece per rank, piece ``j`` sent to rank ``j``, the pieces
    received concatenated along ``cat`` in rank order. Backward: the same exchange the other way (each gradient
    element returned to the rank it came from)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup, split: int, cat: int) -> Tensor:
        ctx.group, ctx.split, ctx.cat = group, split, cat
        return _swap(x, group, split, cat)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _swap(grad.contiguous(), ctx.group, ctx.cat, ctx.split), None, None, None


def all_to_all_swap(x: Tensor, group: TPGroup, split: int, cat: int) -> Tensor:
    """Ulysses' exchange: e.g. ``(batch, heads, positions, features)`` with ``split=1, cat=2`` gives this rank
    ``1/size`` of the heads over every rank's positions (rank 0's first); ``split=2, cat=1`` undoes it."""
    return _Swap.apply(x, group, split % x.dim(), cat % x.dim()) if group.size > 1 else x


def copy_to_tp(x: Tensor, group: TPGroup) -> Tensor:
    return _CopyToTP.apply(x, group) if group.size > 1 else x


def reduce_from_tp(x: Tensor, group: TPGroup) -> Tensor:
    return _ReduceFromTP.apply(x, group) if group.size > 1 else x


def gather_from_tp(x: Tensor, group: TPGroup) -> Tensor:
    return _GatherFromTP.apply(x, group) if group.size > 1 else x


@dataclass
class TPScope:
    """Per-block cache so that sibling column-parallel layers reading the same input share one ``copy_to_tp``."""

    group: TPGroup
    _seen: list[tuple[Tensor, Tensor]] = field(default_factory=list)
    active: bool = False

    def copy(self, x: Tensor) -> Tensor:
        if not self.active or not torch.is_grad_enabled():
            return copy_to_tp(x, self.group)
        for src, dst in self._seen:
            if src is x:
                return dst
        y = copy_to_tp(x, self.group)
        self._seen.append((x, y))
        return y

    def enter(self) -> None:
        self._seen.clear()
        self.active = True

    def exit(self) -> None:
        self._seen.clear()
        self.active = False


def all_reduce_flag(ok: bool, group: Optional[ProcessGroup]) -> bool:
    """True only if ``ok`` is true on every rank of ``group`` (a decision all ranks then share)."""
    if not dist.is_initialized():
        return ok
    t = torch.tensor([1 if ok else 0], dtype=torch.int64)
    backend = dist.get_backend(group)
    if backend == "nccl":
        t = t.cuda()
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return bool(t.item())


# ----------------------------------------------------------------------------------------------------------------
# shards -> whole tensors


def gather_with_spec(t: Tensor, spec: ShardSpec, group: TPGroup) -> Tensor:
    group = spec.over if spec.over is not None else group  # experts: over the ep group
    t = t.contiguous()
    comm = t.float() if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) else t
    shards = [torch.empty_like(comm) for _ in range(group.size)]
    torch.distributed.all_gather(shards, comm, group=group.group)
    return unshard_tensor(shards, spec).to(t.dtype)
