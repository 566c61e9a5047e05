"""Random numbers under a pipeline: a micro-batch's ``training_step`` draws the same numbers on every stage (before
and after its forward, whatever the stage's units drew), and a unit's dropout draws the same wherever it runs, so
every schedule trains the same (dropout on), also across a resume."""

from __future__ import annotations

from pathlib import Path

import torch

from launch import ROOT, run_ranks


def test_draws_agree_across_stages_and_schedules(tmp_path: Path) -> None:
    run_ranks(ROOT / "tests" / "distributed" / "worker_rng.py", 2, [str(tmp_path)], timeout=300).check()
    ranks = [torch.load(tmp_path / f"rng.rank{r}.pt") for r in range(2)]
    for schedule, got in [(k, v) for k, v in ranks[0].items() if k not in ("whole", "resumed")]:
        # 3 steps x 4 micro-batches (and the trace); interleaved runs a micro-batch's step once per chunk
        distinct = [set(map(tuple, r[schedule]["draws"])) for r in ranks]
        assert len(distinct[0]) == 13, (schedule, len(distinct[0]))
        assert distinct[1] == distinct[0], f"{schedule}: stages drew different masks for one micro-batch"
        assert ranks[1][schedule]["losses"] == got["losses"]
    for r in ranks:  # resumed from a checkpoint saved after step 2: the draws (and so the losses) go on alike
        whole, resumed = r.pop("whole"), r.pop("resumed")
        assert len(whole) == 4 and resumed == whole[2:], (whole, resumed)
    reference = ranks[0]["gpipe"]["losses"]
    for schedule, got in ranks[0].items():
        torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference), rtol=1e-5, atol=1e-6,
                                   msg=f"{schedule} trains differently from gpipe with dropout on")
    assert reference[0] != reference[1]
