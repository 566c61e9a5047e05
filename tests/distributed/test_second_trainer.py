"""A module meets a second Trainer: the new strategy adopts the parallel state the first one built (the model is
already cut) and trains, validates, tests and predicts at parity with one process doing the same, without building
process groups again; other arguments are refused with a clear error."""

from __future__ import annotations

import re
from pathlib import Path

from launch import ROOT, run_ranks
from parity import assert_parity, load_record, merge_stages

SCRIPT = ROOT / "tests" / "distributed" / "worker_second_trainer.py"


def test_second_trainer_adopts_the_parallel_state(tmp_path: Path) -> None:
    (tmp_path / "ref").mkdir()
    (tmp_path / "par").mkdir()
    run_ranks(SCRIPT, 1, [str(tmp_path / "ref"), "0", "0"], timeout=120).check()
    result = run_ranks(SCRIPT, 4, [str(tmp_path / "par"), "2", "2"], timeout=300)
    assert not result.timed_out
    for rank, out in enumerate(result.outputs):
        assert "adopted True" in out, f"rank {rank}:\n{out[-3000:]}"
        built = re.search(r"process groups after the first fit (\d+), after four more set-ups (\d+)", out)
        assert built and int(built[1]) == int(built[2]) > 1, f"rank {rank}: {built and built.group(0)}"
        assert "already parallelised by a TensorPipeStrategy with other arguments microbatches: 2 (then) vs 4 (now)" \
            in out, f"rank {rank}:\n{out[-3000:]}"
        assert result.returncodes[rank] != 0  # the third Trainer was refused on every rank
    got = merge_stages([load_record(tmp_path / "par" / f"second.rank{s * 2}.pt") for s in range(2)])
    ref = load_record(tmp_path / "ref" / "second.rank0.pt")
    assert_parity(got, ref, where="second Trainer, tp2 x pp2")
    for key in ("val_loss", "test_loss", "predicted"):
        assert abs(got.logged[key] - ref.logged[key]) <= 1e-5 * abs(ref.logged[key]), (key, got.logged, ref.logged)
