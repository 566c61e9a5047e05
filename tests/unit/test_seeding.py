"""Unit tests of ``lightning_tpp.core.seeding``: the draws a pipeline unit makes per micro-batch (``seeded``), the
strategy's own stream for dropout over tensor-parallel shards, and the user's streams left alone."""

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


# ---- the strategy's own stream (dropout over tensor-parallel shards) and the user's streams --------------------------
def test_derived_seeds_are_stable_across_processes() -> None:
    """hash() of a string is salted per process; tp ranks and reruns must derive the same seeds from the same parts."""
    from lightning_tpp.core.seeding import derived_seed

    assert derived_seed(0, 1, "blocks.0", b"\x01") == derived_seed(0, 1, "blocks.0", b"\x01")
    assert derived_seed(0, 1, "blocks.0") != derived_seed(0, 1, "blocks.1")
    assert 0 <= derived_seed("x") < 2 ** 63


def test_own_stream_keys_calls_and_replays_recomputation() -> None:
    from lightning_tpp.core.seeding import OwnStream

    cpu = torch.device("cpu")
    stream = OwnStream(seed=7)
    stream.start_step(3)
    torch.manual_seed(0)
    before = torch.get_rng_state()
    first = stream.enter("blocks.0", cpu, recomputing=False)
    again = stream.enter("blocks.0", cpu, recomputing=False)  # the same block from the same state: another call
    other = stream.enter("blocks.1", cpu, recomputing=False)
    assert torch.equal(torch.get_rng_state(), before), "keying a call drew from the user's generator"
    assert len({first, again, other}) == 3 and first[:2] == (7, 3)
    torch.rand(1)  # the user draws: the state the block is entered from moves on
    moved = stream.enter("blocks.0", cpu, recomputing=False)
    assert moved != first
    assert stream.enter("blocks.0", cpu, recomputing=True) == moved  # the recomputation replays the one call
    stream.start_step(4)  # a new batch: new keys even where nothing was drawn in between
    assert stream.enter("blocks.0", cpu, recomputing=False) != moved


def test_own_stream_refuses_an_ambiguous_recomputation() -> None:
    from lightning_tpp.core.seeding import AmbiguousRecomputationError, OwnStream

    stream, cpu = OwnStream(), torch.device("cpu")
    stream.enter("layers.0", cpu, recomputing=False)
    stream.enter("layers.0", cpu, recomputing=False)
    with pytest.raises(AmbiguousRecomputationError, match="block 'layers.0' was called 2 times in this training step "
                                                          "from the same random state.*Draw a random number between"):
        stream.enter("layers.0", cpu, recomputing=True)


def test_agree_with_rank0_without_a_process_group_is_a_no_op() -> None:
    from lightning_tpp.core.seeding import agree_with_rank0

    torch.manual_seed(3)
    before = torch.get_rng_state()
    agree_with_rank0(torch.device("cpu"))
    assert torch.equal(torch.get_rng_state(), before)


@pytest.fixture
def process_group():
    """The strategy starts a one-rank process group; other unit tests expect none (test_compat checks so)."""
    import torch.distributed as dist

    existed = dist.is_initialized()
    yield
    if dist.is_initialized() and not existed:
        dist.destroy_process_group()


def test_strategy_in_one_process_leaves_the_users_draws_alone(process_group: None) -> None:
    """A DiT-style step drawing timesteps and noise from the global generator (issue #30): with the strategy in one
    process (tp=pp=1) the same losses and the same generator state after every step as without it (the strategy
    used to reseed at setup, as Lightning's DDP does)."""
    from parity import train  # tests/ is on the path (conftest)

    from lightning_tpp import TensorPipeStrategy

    plain = train("dit_noisy", steps=3)
    with_strategy = train("dit_noisy", strategy=TensorPipeStrategy(print_plan=False), steps=3)
    assert with_strategy.losses == plain.losses
    assert with_strategy.rng == plain.rng and len(set(plain.rng)) == 3
