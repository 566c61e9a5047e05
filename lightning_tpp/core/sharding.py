"""How one parameter is split across the tensor-parallel ranks (pure functions, no process groups).


A :class:`ShardSpec` says along which dimension a parameter is split and, for fused projections, which segments
the dimension is made of. Each segment is split evenly, so that every rank holds its own slice of *each* segment::

    fused qkv weight, rows [ q | k | v ], tp = 2      parts = (q, k, v)

    full:    q0 q1 | k0 k1 | v0 v1
    rank 0:  q0 k0 v0
    rank 1:  q1 k1 v1

Without ``parts`` the dimension is cut into ``tp`` contiguous blocks (plain column/row parallel, vocab parallel, and
fused layouts that already interleave per head or per kv-group).

Fewer K/V heads than ranks (multi-query, grouped-query with ``kv_heads < tp``): ``shares`` says, per segment, how
many consecutive ranks hold the same piece of it (Megatron-Core's replicated K/V heads), and ``blocks`` first cuts
the dimension into that many contiguous blocks, each given to ``tp / blocks`` consecutive ranks (a per-group
interleaved ``[q_g..., k_g, v_g]`` layout)::

    Falcon multi-query [ q | k | v ], tp = 2     parts = (q, k, v), shares = (1, 2, 2)
    rank 0:  q0 k v
    rank 1:  q1 k v

    per group [ q0 q1 q2 q3 k0 v0 | q4 .. q7 k1 v1 ], tp = 4     blocks = 2, parts = (4, 1, 1), shares = (1, 2, 2)
    rank 0:  q0 q1 k0 v0      rank 1:  q2 q3 k0 v0      rank 2:  q4 q5 k1 v1      rank 3:  q6 q7 k1 v1
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    parts: Optional[tuple[int, ...]] = None
    shares: Optional[tuple[int, ...]] = None  # per part: consecutive ranks holding the same piece (1: split)
    blocks: int = 1  # the dim first cut into this many contiguous blocks, one per ``world / blocks`` ranks
    # the group (a ``TPGroup``) the dim is cut over when it is not the tensor-parallel one: experts over ep
    over: Any = field(default=None, compare=False, repr=False)

    def placed(self, rank: int, world: int) -> tuple[int, int]:
        """(rank, world) in the group this spec cuts over: ``over``'s when set, else the tensor-parallel ``rank``
        and ``world`` given."""
        return (self.over.rank, self.over.size) if self.over is not None else (rank, world)

    @property
    def replicated(self) -> bool:
        """Whether some rank holds a piece that another rank holds too (its gradient is summed over them)."""
        return any(s > 1 for s in self.shares or ())

    def check(self, size: int, world: int, what: str) -> None:
        parts = self.parts or (size // self.blocks,)
        if sum(parts) * self.blocks != size:
            raise ValueError(f"{what}: parts {parts} do not add up to size {size} of dim {self.dim}"
                             + (f" in {self.blocks} blocks" if self.blocks > 1 else ""))
        if world % self.blocks:
            raise ValueError(f"{what}: tp={world} ranks cannot hold {self.blocks} blocks of dim {self.dim} alike")
        sub = world // self.blocks
        shares = self.shares or (1,) * len(parts)
        bad = [p for p, s in zip(parts, shares) if sub % s or p % (sub // s)]
        if bad:
            raise ValueError(f"{what}: segment sizes {parts} along dim {self.dim} are not divisible by tp={world}")

    def owned(self, local: Tensor, size: int, rank: int, world: int) -> list[Tensor]:
        """The parts of ``local`` (this rank's shard) that it counts once for the whole tensor: a piece several
        ranks hold counts on the first of them only (a global gradient norm)."""
        if not self.replicated:
            return [local]
        parts = self.parts or (size // self.blocks,)
        out, offset = [], 0
        sub = world // self.blocks
        for (_, n), share in zip(self.pieces(size, rank, world), self.shares or (1,) * len(parts)):
            if (rank % sub) % share == 0:
                out.append(local.narrow(self.dim, offset, n))
            offset += n
        return out

    def pieces(self, size: int, rank: int, world: int) -> list[tuple[int, int]]:
        """(start, length) along ``dim`` of the whole tensor's slices that ``rank`` holds, in order."""
        sub = world // self.blocks
        block, r = divmod(rank, sub)
        parts = self.parts or (size // self.blocks,)
        out, start = [], block * (size // self.blocks)
        for part, share in zip(parts, self.shares or (1,) * len(parts)):
            step = part // (sub // share)
            out.append((start + (r // share) * step, step))
            start += part
        return out


def shard_tensor(full: Tensor, spec: ShardSpec, rank: int, world: int) -> Tensor:
    """The slice of ``full`` that ``rank`` of ``world`` holds (a fresh contiguous tensor)."""
    rank, world = spec.placed(rank, world)
    pieces = spec.pieces(full.shape[spec.dim], rank, world)
    return torch.cat([full.narrow(spec.dim, start, n) for start, n in pieces], dim=spec.dim).contiguous()


def unshard_tensor(shards: Sequence[Tensor], spec: ShardSpec) -> Tensor:
    """Inverse of :func:`shard_tensor`: rebuild the full tensor from every rank's slice (in rank order)."""
    world = len(shards)
    if spec.parts is None and spec.blocks == 1:
        return torch.cat(list(shards), dim=spec.dim)
    local = shards[0].shape[spec.dim]
    size = spec.blocks * sum(spec.parts) if spec.parts is not None else local * world
    shape = list(shards[0].shape)
    shape[spec.dim] = size
    full = shards[0].new_empty(shape)
    for rank, shard in enumerate(shards):
        offset = 0
        for start, n in spec.pieces(size, rank, world):  # a replicated piece is written by each holder, alike
            full.narrow(spec.dim, start, n).copy_(shard.narrow(spec.dim, offset, n))
            offset += n
    return full
