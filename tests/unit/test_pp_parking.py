"""Gradient parking around a schedule: old gradients kept (accumulation) or freed before it (Lightning zeroes them
right after the step anyway), and the schedule's gradients put back after Lightning's ``zero_grad``."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from torch import nn

from lightning_tpp.pipeline.parking import GradientParking


@pytest.mark.parametrize("stale", [False, True])
def test_old_gradients_kept_or_freed(stale: bool) -> None:
    p = nn.Parameter(torch.zeros(3))
    old = torch.ones(3)
    p.grad = old
    alive = weakref.ref(old)
    del old
    parking = GradientParking([p], [])
    with parking.schedule(stale=stale):
        gc.collect()
        assert p.grad is None  # the schedule starts from cleared gradients either way
        assert (alive() is None) == stale  # freed before the schedule: no two gradients of a parameter at once
        p.grad = torch.full((3,), 2.0)
    assert p.grad is None if stale else torch.equal(p.grad, torch.ones(3))
    p.grad = None  # Lightning's zero_grad
    parking.restore()
    assert torch.equal(p.grad, torch.full((3,), 2.0))


def test_zeroing_is_known_only_at_the_first_batch_of_a_window() -> None:
    import lightning as L

    from lightning_tpp.integration.pipeline_steps import PipelineSteps

    class Plain(L.LightningModule):
        pass

    class Inspects(L.LightningModule):
        def on_before_zero_grad(self, optimizer: object) -> None:  # sees the old gradients: keep them
            pass

    class Trainer:
        callbacks: list = []

    for cls, batch_idx, accumulate, expected in ((Plain, 0, 1, True), (Plain, 3, 1, True), (Plain, 1, 2, False),
                                                 (Plain, 2, 2, True), (Inspects, 0, 1, False)):
        module = cls()
        module.__dict__["_trainer"] = Trainer()
        assert PipelineSteps._zeroed_after_step(module, ({}, batch_idx), accumulate) is expected, (cls, batch_idx)
