"""Unit tests of ``lightning_tpp.core.seeding.seeded``: the draws a pipeline unit makes per micro-batch."""

from __future__ import annotations

import pytest
import torch

from lightning_tpp.core.seeding import seeded


def test_draws_are_the_seeds_and_the_global_state_is_kept() -> None:
    torch.manual_seed(1)
    before = torch.get_rng_state()
    with seeded(5, torch.device("cpu")):
        inside = torch.rand(3)
    assert torch.equal(torch.get_rng_state(), before)
    with seeded(5 + 2 ** 63, torch.device("cpu")):  # hash() values: any int, folded into the generator's range
        assert torch.equal(torch.rand(3), inside)
    with seeded(None, torch.device("cpu")):  # a no-op
        pass
    assert torch.equal(torch.get_rng_state(), before)
    torch.manual_seed(5)
    assert torch.equal(inside, torch.rand(3))


def test_a_cpu_run_seeds_only_the_cpu_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """It runs per unit and micro-batch: torch.manual_seed would also seed every GPU, for good, and where CUDA is
    not initialised queue that with a formatted stack trace (~1 ms a call, 2-4% of a CPU pipeline step)."""
    def refuse(*args, **kwargs):
        raise AssertionError("seeded() on CPU reached the CUDA generators")

    monkeypatch.setattr(torch.cuda, "manual_seed_all", refuse)
    monkeypatch.setattr(torch.cuda, "manual_seed", refuse)
    with seeded(3, torch.device("cpu")):
        torch.rand(2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_a_gpu_run_seeds_its_device_and_restores_it() -> None:
    device = torch.device("cuda", 0)
    before = torch.cuda.get_rng_state(0)
    with seeded(11, device):
        inside = torch.rand(3, device=device)
    assert torch.equal(torch.cuda.get_rng_state(0), before)
    torch.cuda.manual_seed(11)
    assert torch.equal(inside, torch.rand(3, device=device))
