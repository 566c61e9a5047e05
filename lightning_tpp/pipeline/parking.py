"""Gradients a pipeline schedule produces, kept out of Lightning's way until its backward.

The schedule runs forward *and* backward inside ``training_step``, but Lightning zeroes gradients *after*
``training_step`` and only then calls backward::

    training_step:  [stash .grad] schedule (F/B/I/W) [tied all-reduce] [park .grad, put the stash back]
    zero_grad:      clears the stash's values (as it would without a pipeline)
    backward:       restore(): parked gradients added back

so ``zero_grad``, gradient accumulation (the stash holds the previous batches' sum) and skipping a step
(:meth:`GradientParking.discard`) behave as without a pipeline.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_tpp.core.dp_shard import local


class GradientParking:
    """Args:
        params: this rank's trainable parameters (every local stage's).
        tied: parameters shared with other stages (tied embedding and head) and the group of the ranks holding a
            copy, ``None`` where this rank is the only holder.
    """

    def __init__(self, params: list[nn.Parameter], tied: list[tuple[nn.Parameter, Optional[ProcessGroup]]]) -> None:
        self.params, self.tied = params, tied
        self._parked: dict[nn.Parameter, Tensor] = {}

    @contextlib.contextmanager
    def schedule(self, *, stale: bool = False) -> Iterator[None]:
        """Run a schedule on cleared gradients; afterwards sum tied copies, park the result and put back what the
        parameters held before. A schedule that raises leaves the gradients as they are (the step is lost).

        ``stale``: what the parameters hold is the previous step's gradients, which Lightning's ``zero_grad`` clears
        right after this step anyway: freed now instead of kept beside the new ones (one gradient's worth of memory
        less at the peak)."""
        previous = {p: None if stale else p.grad for p in self.params}
        for p in self.params:
            p.grad = None
        yield
        self._sum_tied()
        self._parked = {p: p.grad for p in self.params if p.grad is not None}
        for p in self.params:
            p.grad = previous[p]

    def _sum_tied(self) -> None:
        """Every holder joins, with zeros if its copy got no gradient (never a lone rank), so the copies stay equal."""
        for p, group in self.tied:
            if group is not None:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(local(p.grad), group=group)  # a dp-sharded copy: the same part on each holder

    def discard(self) -> None:
        self._parked = {}

    def restore(self) -> None:
        """Add the gradients of the last schedule back (after Lightning's ``zero_grad``)."""
        for p, g in self._parked.items():
            p.grad = g if p.grad is None else p.grad + g
        self._parked = {}
