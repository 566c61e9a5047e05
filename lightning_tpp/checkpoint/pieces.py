"""A tensor that tensor parallelism cuts into several pieces per rank (a fused ``[q | k | v]`` projection, its
optimizer state), saved by DCP as one chunk of the whole tensor per piece: no rank gathers it to save it.

::

    whole (dim 0):   [ q0 q1 | k0 k1 | v0 v1 ]          rank 0 holds [q0 k0 v0], rank 1 [q1 k1 v1]
    chunks written:    r0 r1   r0 r1   r0 r1             each at its offset in the whole tensor

DTensor cannot say this (a ``Shard`` placement is one contiguous slice per rank), so :class:`Pieces` speaks DCP's
own extension points: ``__create_write_items__`` (one write item per piece; a piece that several ranks hold alike
has the same index on each, and DCP's planner writes it once) and :meth:`PiecesPlanner.lookup_object` (the piece a
write item names). A load reads the chunks that overlap what it asks for, so these checkpoints load into any layout
as a gathered one did.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor
from torch.distributed.checkpoint import DefaultSavePlanner
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType


class Pieces:
    """``local`` (this rank's pieces, concatenated along ``dim``) and where each piece lies in the whole tensor of
    shape ``shape``: ``pieces`` is a list of (start, length) along ``dim``, in the order ``local`` holds them."""

    def __init__(self, local: Tensor, shape: Sequence[int], dim: int, pieces: Sequence[tuple[int, int]]) -> None:
        if sum(n for _, n in pieces) != local.shape[dim]:
            raise ValueError(f"pieces {list(pieces)} along dim {dim} do not add up to the local shape "
                             f"{tuple(local.shape)}")
        self.local, self.shape, self.dim, self.pieces = local, torch.Size(shape), dim, tuple(pieces)

    def like(self, local: Tensor) -> "Pieces":
        """The same pieces held in ``local`` (a host copy)."""
        return Pieces(local, self.shape, self.dim, self.pieces)

    def same_layout(self, other: Any) -> bool:
        return isinstance(other, Pieces) and (other.shape, other.dim, other.pieces) == (self.shape, self.dim,
                                                                                         self.pieces)

    def _offsets(self, start: int) -> torch.Size:
        return torch.Size(start if d == self.dim else 0 for d in range(len(self.shape)))

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        properties = TensorProperties.create_from_tensor(self.local)
        items = []
        for start, n in self.pieces:
            offsets = self._offsets(start)
            sizes = torch.Size(n if d == self.dim else s for d, s in enumerate(self.shape))
            items.append(WriteItem(index=MetadataIndex(fqn, offsets), type=WriteItemType.SHARD,
                                   tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets, sizes),
                                                               properties=properties, size=self.shape)))
        return items

    def piece(self, offsets: Sequence[int]) -> Tensor:
        """The piece whose chunk starts at ``offsets`` in the whole tensor (a view of ``local``)."""
        at = 0
        for start, n in self.pieces:
            if torch.Size(offsets) == self._offsets(start):
                return self.local.narrow(self.dim, at, n)
            at += n
        raise ValueError(f"no piece at offsets {tuple(offsets)}: this rank holds {list(self.pieces)} along dim "
                         f"{self.dim} of {tuple(self.shape)}")


class PiecesPlanner(DefaultSavePlanner):
    """DCP's default save planner, which also finds the piece of a :class:`Pieces` that a write item names."""

    def lookup_object(self, index: MetadataIndex) -> Any:
        obj = self.state_dict.get(index.fqn)
        if isinstance(obj, Pieces):
            assert index.offset is not None  # every write item of Pieces has one
            return obj.piece(index.offset)
        return super().lookup_object(index)
