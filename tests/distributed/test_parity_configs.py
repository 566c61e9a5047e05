"""One-process parity of layouts no other default test trains (issue #45): pure dp=2 (FSDP2, and replicas), bf16
autocast under dp and under pp, the user's own cuts (``balance=[...]``, ``split_points=[...]``), pp=3, and tp, pp and
dp together (tp2 x pp2 x dp2: 8 ranks, the fewest with every axis above 1).

Each launch (2, 3 and 8 ranks) trains several configurations one after the other (``worker_parity_configs.py``)
and runs once per test run (a module fixture); each configuration is its own test, comparing per-step losses,
per-parameter gradients and updated parameters with one process from the same weights and batches
(``parity.assert_parity``), each pipeline's ranks joined."""

from __future__ import annotations

import functools
import json
import re
from pathlib import Path

import pytest

from launch import run_ranks
from parity import Record, assert_parity, load_record, merge_stages, train
from worker_parity_configs import CONFIGS

SCRIPT = Path(__file__).parent / "worker_parity_configs.py"
LAUNCHES = {2: ["dp2", "dp2_no_shard", "dp2_bf16", "dp2_tied_bias", "pp2_bf16", "pp2_balance", "pp2_split_points"],
            3: ["pp3", "pp3_split_points"], 8: ["tp2pp2dp2"]}


@functools.lru_cache(maxsize=None)
def reference(model: str, dp: int, **kwargs) -> Record:
    return train(model, dp=dp, **kwargs)


def _launch(tmp_path_factory: pytest.TempPathFactory, world: int) -> Path:
    out = tmp_path_factory.mktemp(f"parity_configs_{world}")
    assert all(CONFIGS[n].world == world for n in LAUNCHES[world])
    run_ranks(SCRIPT, world, [str(out), ",".join(LAUNCHES[world])], timeout=400).check()
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory, 3)


@pytest.fixture(scope="module")
def eight(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory, 8)


def _pipelines(out: Path, name: str, model: str) -> dict[tuple[int, ...], Record]:
    """Each pipeline's record (its stages' ranks joined), keyed by those ranks."""
    s = CONFIGS[name].strategy
    tp, pp, dp = s.get("tp", 1), s.get("pp", 1), s.get("dp", 1)
    got = {}
    for d in range(dp):
        for t in range(tp):
            ranks = tuple((d * pp + st) * tp + t for st in range(pp))
            got[ranks] = merge_stages([load_record(out / f"{name}.{model}.rank{r}.pt") for r in ranks])
    return got


def _extra(out: Path, name: str, model: str, rank: int) -> dict:
    return json.loads((out / f"{name}.{model}.rank{rank}.json").read_text())


def check_parity(out: Path, name: str, **tolerance) -> None:
    config = CONFIGS[name]
    for model in config.models:
        ref = reference(model, config.strategy.get("dp", 1), **config.train)
        for ranks, got in _pipelines(out, name, model).items():
            assert_parity(got, ref, **tolerance, where=f"{name} {model} ranks {ranks}")


def blocks_by_rank(out: Path, name: str, model: str, container: str) -> list[list[int]]:
    """The block indices of ``container`` whose parameters each rank of the first pipeline holds."""
    pattern = re.compile(rf"^{re.escape(container)}\.(\d+)\.")
    pp = CONFIGS[name].strategy.get("pp", 1)
    return [sorted({int(m.group(1)) for n in load_record(out / f"{name}.{model}.rank{r}.pt").params
                    if (m := pattern.match(n))}) for r in range(pp)]


def test_dp2_fsdp2(two: Path) -> None:
    """Pure dp=2 with the default FSDP2 sharding: each rank holds about half of every parameter."""
    check_parity(two, "dp2")
    for model in CONFIGS["dp2"].models:
        for rank in range(2):
            held = _extra(two, "dp2", model, rank)["held_fraction"]
            assert held <= 0.6, f"dp2 {model} rank {rank} holds {held:.2f} of its parameters: not sharded over dp"


def test_dp2_replicas(two: Path) -> None:
    """dp_sharding='no_shard': whole replicas, gradients all-reduced."""
    check_parity(two, "dp2_no_shard")
    assert _extra(two, "dp2_no_shard", "nanogpt", 0)["held_fraction"] == 1.0


def test_dp2_tied_bias(two: Path) -> None:
    """Hugging Face BERT: its head's bias is held by the head and by its decoder (one tensor). The decoder is a
    vocabulary matrix, but cut into rows the head's copy would stay whole, untrained and untied: FSDP2 takes it."""
    check_parity(two, "dp2_tied_bias")


def check_bf16(out: Path, name: str) -> None:
    """As test_tp_parity.py::test_parity_bf16_mixed: bf16 autocast against a bf16 one-process reference at rtol =
    atol = 2e-2 (bf16 keeps 8 bits of mantissa, a relative step of 2^-8 ~ 4e-3; micro-batches (pp) and a reduction
    over replicas (dp) change the order of sums, so values differ by a few bf16 ulps); each updated parameter also
    within a tenth of its last update of the reference, which a skipped or doubled step cannot be. And every rank's
    linear layers computed in bf16 (a run that left autocast off would be within the tolerance above)."""
    config = CONFIGS[name]
    (model,) = config.models
    ref = reference(model, config.strategy.get("dp", 1), **config.train)
    before_last = reference(model, config.strategy.get("dp", 1), **{**config.train, "steps": config.train["steps"] - 1})
    for ranks, got in _pipelines(out, name, model).items():
        assert_parity(got, ref, rtol=2e-2, atol=2e-2, where=f"{name} ranks {ranks}")
        for param, want in ref.params.items():
            step = float((want - before_last.params[param]).abs().max())
            error = float((got.params[param] - want).abs().max())
            assert error <= 0.1 * step, f"{name} ranks {ranks} {param}: off by {error:.2e}, its last update {step:.2e}"
    for rank in range(config.world):
        dtypes = _extra(out, name, model, rank)["dtypes"]
        assert dtypes == ["torch.bfloat16"], f"{name} rank {rank}: linear layers computed in {dtypes}"


def test_dp2_bf16(two: Path) -> None:
    check_bf16(two, "dp2_bf16")


def test_pp2_bf16(two: Path) -> None:
    check_bf16(two, "pp2_bf16")


def test_pp2_balance(two: Path) -> None:
    """balance=[1, 3]: the first stage holds block 0, the second blocks 1-3 (by parameters it would be 2 + 2)."""
    check_parity(two, "pp2_balance")
    assert blocks_by_rank(two, "pp2_balance", "nanogpt4", "model.transformer.h") == [[0], [1, 2, 3]]


def test_pp2_split_points(two: Path) -> None:
    """split_points=['model.transformer.h.3']: the second stage starts at block 3."""
    check_parity(two, "pp2_split_points")
    assert blocks_by_rank(two, "pp2_split_points", "nanogpt4", "model.transformer.h") == [[0, 1, 2], [3]]


def test_pp3(three: Path) -> None:
    """Three stages of four blocks (a middle stage that both receives and sends), nanoGPT's tied embedding and head
    on the first and the last, cut by parameters."""
    check_parity(three, "pp3")
    held = blocks_by_rank(three, "pp3", "nanogpt4", "model.transformer.h")
    assert all(held) and sorted(sum(held, [])) == [0, 1, 2, 3], held


def test_pp3_split_points(three: Path) -> None:
    """split_points at pp=3: stages of 2 + 1 + 1 blocks (by parameters: 1 + 2 + 1)."""
    check_parity(three, "pp3_split_points")
    assert blocks_by_rank(three, "pp3_split_points", "llama4", "model.layers") == [[0, 1], [2], [3]]


def test_tp2_pp2_dp2(eight: Path) -> None:
    """Every axis at once: FSDP2 over dp of each tp shard of each stage; every one of the four pipelines (dp x tp)
    at parity, each tp shard gathered whole."""
    check_parity(eight, "tp2pp2dp2")
    for rank in range(8):
        held = _extra(eight, "tp2pp2dp2", "nanogpt", rank)["held_fraction"]
        assert held <= 0.6, f"tp2pp2dp2 rank {rank} holds {held:.2f} of its stage's shard: not sharded over dp"
