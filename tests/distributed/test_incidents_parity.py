"""Spikes planted at chosen batches are dropped (``SpikeGuard(action="skip")``) or rolled back (``"rollback"``) on
every rank alike, at tp2 x pp2, tp2 x dp2 (FSDP2) and in one process: the final parameters and SGD momenta equal a
one-process run that never saw the dropped batches (skip) or that went on from the snapshot without the window's
batches (rollback), and every incident is listed the same on every rank and once in ``incidents.jsonl``.
The planted batches and the reference's batch lists are in ``worker_incidents.py``."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import ROOT, run_ranks
from parity import FP32

SCRIPT = ROOT / "tests" / "distributed" / "worker_incidents.py"
LAYOUTS = {"tp2xpp2": (2, 2, 1), "tp2xdp2": (2, 1, 2), "one-process": (1, 1, 1)}
EXPECTED = {  # (step, kind, action) per scenario; global_step at the end
    "skip": ([(4, "spike", "skip"), (7, "spike", "skip"), (9, "nonfinite", "skip")], 12),
    "rollback": ([(5, "spike", "rollback"), (7, "spike", "rollback")], 7),
    "accumulate": ([(3, "spike", "skip")], 6),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    from worker_incidents import SCENARIOS, run

    out = tmp_path_factory.mktemp("reference")
    return {name: run(out, name, 1, 1, 1, reference=True) for name in SCENARIOS}


def _close(got: torch.Tensor, want: torch.Tensor, what: str) -> None:
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    if not torch.allclose(got, want, **FP32):
        raise AssertionError(f"{what}: max abs difference {float((got - want).abs().max()):.3g}")


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_spikes_dropped_or_rolled_back_equal_the_clean_reference(tmp_path: Path, references, layout: str) -> None:
    from lightning_tpp.incidents import read_incidents
    from worker_incidents import FAULTY_RANK

    tp, pp, dp = LAYOUTS[layout]
    world = tp * pp * dp
    scenarios = ["skip", "rollback"] + (["accumulate"] if world == 1 else [])  # accumulation: one process is enough
    run_ranks(SCRIPT, world, [str(tmp_path), str(tp), str(pp), str(dp), ",".join(scenarios)], timeout=300).check()
    for scenario in scenarios:
        expected, steps = EXPECTED[scenario]
        records = [torch.load(tmp_path / f"{scenario}.rank{r}.pt", weights_only=False) for r in range(world)]
        for r, rec in enumerate(records):  # one decision, everywhere
            assert rec["incidents"] == records[0]["incidents"], f"{scenario}: rank {r} {rec['incidents']}"
            assert rec["global_step"] == steps, f"{scenario}: rank {r} ended at step {rec['global_step']}"
        incidents = records[0]["incidents"]
        assert [i[:3] for i in incidents] == expected, incidents
        assert incidents[0][3] == list(range(world))  # the loss x1000: every rank's replica
        if len(incidents) > 1:
            assert incidents[1][3] == [FAULTY_RANK if world > 1 else 0]  # the gradient x1e6 on one rank: named
        if scenario == "skip":  # the NaN loss: every replica had it, so every rank is named
            assert incidents[2][3] == list(range(world))
        if scenario == "rollback":
            assert incidents[0][4].startswith("rolled back to step 3; batches 3..5 of this epoch skipped")
            assert incidents[1][4].startswith("rolled back to step 6; batches 9..10 of this epoch skipped")
        lines = read_incidents(Path(records[0]["log_dir"]) / "incidents.jsonl")  # rank 0 wrote each one once
        assert [(d["step"], d["kind"], d["action"]) for d in lines] == expected
        ref = references[scenario]
        got: dict[str, torch.Tensor] = {}
        for rec in records[::tp]:  # tp rank 0 of every stage (and of every replica: the same)
            got.update(rec["params"])
        assert got.keys() == ref["params"].keys(), set(got) ^ set(ref["params"])
        for name, want in ref["params"].items():
            _close(got[name], want, f"{layout} {scenario}: {name}")
        assert records[0]["lr"] == pytest.approx(ref["lr"], rel=1e-12)  # the schedule: as the reference's
