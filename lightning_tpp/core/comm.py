"""Differentiable collectives of Megatron-style tensor parallelism, and the group they run on.

Megatron's two conjugate operators::

    f = copy_to_tp:      forward identity      backward all-reduce   (before column-parallel layers)
    g = reduce_from_tp:  forward all-reduce    backward identity     (after row-parallel layers)

A transformer block therefore costs two all-reduces forward (attention out, MLP out) and two backward (the inputs of
the qkv and MLP-in projections). Projections that read the same tensor (q, k and v; gate and up) share one ``f`` through
:class:`TPScope`, so that their input gradients are summed locally and all-reduced once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup

from lightning_tpp.core.sharding import ShardSpec, unshard_tensor


@dataclass
class TPGroup:
    """The tensor-parallel process group of this rank (``group=None`` means a single process)."""

    group: Optional[ProcessGroup]
    rank: int
    size: int


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


class _GatherFromTP(torch.autograd.Function):
    """All-gather along the last dim (forward); keep the local slice of the gradient (backward)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, group: TPGroup) -> Tensor:
        ctx.group = group
        x = x.contiguous()
        if x.is_meta:  # shapes only: the gathered shape, no communication
            return torch.cat([x] * group.size, dim=-1)
        comm = x.float() if x.device.type == "cpu" and x.dtype in (torch.bfloat16, torch.float16) else x
        out = [torch.empty_like(comm) for _ in range(group.size)]
        torch.distributed.all_gather(out, comm, group=group.group)
        return torch.cat(out, dim=-1).to(x.dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        g = ctx.group
        return grad.chunk(g.size, dim=-1)[g.rank].contiguous(), None


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
    t = t.contiguous()
    comm = t.float() if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) else t
    shards = [torch.empty_like(comm) for _ in range(group.size)]
    torch.distributed.all_gather(shards, comm, group=group.group)
    return unshard_tensor(shards, spec).to(t.dtype)
