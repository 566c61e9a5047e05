"""How one parameter is split across the tensor-parallel ranks (pure functions, no process groups).


A :class:`ShardSpec` says along which dimension a parameter is split and, for fused projections, which segments
the dimension is made of. Each segment is split evenly, so that every rank holds its own slice of *each* segment::

    fused qkv weight, rows [ q | k | v ], tp = 2      parts = (q, k, v)

    full:    q0 q1 | k0 k1 | v0 v1
    rank 0:  q0 k0 v0
    rank 1:  q1 k1 v1

Without ``parts`` the dimension is cut into ``tp`` contiguous blocks (plain column/row parallel, vocab parallel, and
fused layouts that already interleave per head or per kv-group).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import torch
from torch import Tensor


@dataclass(frozen=True)
class ShardSpec:
    dim: int
    parts: Optional[tuple[int, ...]] = None

    def check(self, size: int, world: int, what: str) -> None:
        parts = self.parts or (size,)
        if sum(parts) != size:
            raise ValueError(f"{what}: parts {parts} do not add up to size {size} of dim {self.dim}")
        bad = [p for p in parts if p % world]
        if bad:
            raise ValueError(f"{what}: segment sizes {parts} along dim {self.dim} are not divisible by tp={world}")


def shard_tensor(full: Tensor, spec: ShardSpec, rank: int, world: int) -> Tensor:
    """The slice of ``full`` that ``rank`` of ``world`` holds (a fresh contiguous tensor)."""
    parts = spec.parts or (full.shape[spec.dim],)
    pieces = []
    for segment in torch.split(full, list(parts), dim=spec.dim):
        step = segment.shape[spec.dim] // world
        pieces.append(segment.narrow(spec.dim, rank * step, step))
    return torch.cat(pieces, dim=spec.dim).contiguous()


def unshard_tensor(shards: Sequence[Tensor], spec: ShardSpec) -> Tensor:
    """Inverse of :func:`shard_tensor`: rebuild the full tensor from every rank's slice (in rank order)."""
    world = len(shards)
    if spec.parts is None:
        return torch.cat(list(shards), dim=spec.dim)
    local_parts = [p // world for p in spec.parts]
    split = [torch.split(s, local_parts, dim=spec.dim) for s in shards]
    return torch.cat([split[r][i] for i in range(len(local_parts)) for r in range(world)], dim=spec.dim)
