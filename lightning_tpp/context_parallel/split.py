"""Which positions each context-parallel rank holds, and the exchanges between its part and the whole sequence.

A sequence of ``S`` positions is padded to ``P``, a multiple of ``2 * cp``, and cut into ``2 * cp`` chunks of
``c = P / (2 cp)``. Rank ``r`` holds chunk ``r`` and chunk ``2 cp - 1 - r`` (head and tail)::

    cp = 2, S = 8:   positions 0 1 | 2 3 | 4 5 | 6 7
                     chunks    0   | 1   | 2   | 3
                     rank 0 holds chunks 0 and 3 (positions 0 1 6 7), rank 1 chunks 1 and 2 (positions 2 3 4 5)

Under a causal mask a query at position ``p`` attends ``p + 1`` keys, so a head chunk and a tail chunk together cost
every rank the same: ``c * (P + 1)`` query-key pairs per rank, whatever ``r``.

Gradients (one rule for everything, so that nothing is classified by hand): a tensor computed on this rank's
positions carries ``cp`` times its own positions' gradient; a tensor computed outside (embeddings, the head, the
loss: the same on every cp rank) carries a gradient whose average over cp is one process's. Gathering positions
(:func:`gather_positions`) sums the gradients over cp in backward (a reduce-scatter), and cutting them
(:func:`local_positions`) keeps this rank's rows: so every parameter's gradient, averaged over dp x cp, is one
process's.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from lightning_tpp.core.comm import TPGroup, gather_summed


@dataclass(frozen=True)
class SeqLayout:
    """The positions of one sequence of ``length`` over ``cp`` ranks (``padded``: ``length`` rounded up to a multiple
    of ``2 * cp``); ``rank``: this rank's place in the cp group."""

    length: int
    padded: int
    cp: int
    rank: int

    @staticmethod
    def of(length: int, cp: int, rank: int) -> "SeqLayout":
        step = 2 * cp
        return SeqLayout(length, -(-length // step) * step, cp, rank)

    @property
    def chunk(self) -> int:
        return self.padded // (2 * self.cp)

    @property
    def local(self) -> int:
        return self.padded // self.cp

    def starts(self, rank: int | None = None) -> tuple[int, int]:
        """The first positions of the head and tail chunks ``rank`` holds."""
        r = self.rank if rank is None else rank
        return r * self.chunk, (2 * self.cp - 1 - r) * self.chunk

    def positions(self, rank: int | None = None) -> list[int]:
        c = self.chunk
        return [p for a in self.starts(rank) for p in range(a, a + c)]

    def index(self, device: torch.device) -> Tensor:
        """This rank's positions, in the order it holds them."""
        return _index(self.padded, self.cp, self.rank, device)

    def natural(self, device: torch.device) -> Tensor:
        """Where each position sits in the concatenation of every rank's part (rank 0's, then rank 1's, ...)."""
        return _natural(self.padded, self.cp, device)

    def order(self, device: torch.device) -> Tensor:
        """The concatenation of every rank's positions (rank 0's, then rank 1's, ...): the inverse of ``natural``."""
        return _order(self.padded, self.cp, device)


@functools.lru_cache(maxsize=256)
def _index(padded: int, cp: int, rank: int, device: torch.device) -> Tensor:
    return torch.tensor(SeqLayout(padded, padded, cp, rank).positions(), dtype=torch.long, device=device)


@functools.lru_cache(maxsize=64)
def _order(padded: int, cp: int, device: torch.device) -> Tensor:
    layout = SeqLayout(padded, padded, cp, 0)
    return torch.tensor([p for r in range(cp) for p in layout.positions(r)], dtype=torch.long, device=device)


@functools.lru_cache(maxsize=64)
def _natural(padded: int, cp: int, device: torch.device) -> Tensor:
    return torch.argsort(_order(padded, cp, torch.device("cpu"))).to(device)


def pad_to(t: Tensor, dim: int, to: int, fill: Any) -> Tensor:
    """``t`` with ``fill`` appended along ``dim`` up to ``to`` (as it is where it is that long already)."""
    missing = to - t.shape[dim]
    if missing <= 0:
        return t
    shape = list(t.shape)
    shape[dim] = missing
    return torch.cat([t, t.new_full(shape, fill)], dim=dim)


def pad_fill(t: Tensor) -> Any:
    """What the padded positions of ``t`` hold: attended-everything rows for a boolean mask (no row without keys, no
    NaN), zeros otherwise (an additive mask's zero is "attend"; padded keys are never read)."""
    return True if t.dtype == torch.bool else 0


def local_positions(t: Tensor, dim: int, layout: SeqLayout) -> Tensor:
    """This rank's positions of ``t`` (whole along ``dim``: ``layout.length``), padded where needed. Backward: this
    rank's rows of the gradient, zeros elsewhere (autograd of the index)."""
    dim = dim % t.dim()
    return pad_to(t, dim, layout.padded, pad_fill(t)).index_select(dim, layout.index(t.device))


def gather_positions(x: Tensor, dim: int, layout: SeqLayout, group: TPGroup, *, trim: bool = True) -> Tensor:
    """The whole sequence from every rank's part of ``x`` along ``dim``, in natural order (``trim``: without the
    padding). Backward sums every rank's gradient (see the module docstring)."""
    dim = dim % x.dim()
    whole = gather_summed(x, group, dim).index_select(dim, layout.natural(x.device))
    return whole.narrow(dim, 0, layout.length) if trim and layout.padded != layout.length else whole
