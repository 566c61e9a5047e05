"""A rank lost under ``torchrun --max-restarts``: the job restarts, resumes from the last checkpoint in the smaller
world that is left (tp2 x dp2 -> tp2 x dp1, ``dp="auto"``), keeps the global batch (accumulation 1 -> 2) and the data
position, and trains as one process does on the same global batches."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from launch import ROOT, _pythonpath, free_port
from lightning_tpp import consolidate

SCRIPT = ROOT / "tests" / "distributed" / "worker_elastic.py"


def _step_losses(out: Path, attempt: int, ranks: list[int]) -> dict[int, float]:
    """Per optimizer step: the mean over dp replicas of the step's loss (Lightning reports each micro-batch's loss
    divided by the accumulation, so a replica's micro-batches add up to its loss)."""
    per_rank: dict[int, dict[int, float]] = {}
    for rank in ranks:
        rows = json.loads((out / f"losses.attempt{attempt}.rank{rank}.json").read_text())["rows"]
        sums: dict[int, float] = defaultdict(float)
        for _, step, loss in rows:
            sums[step] += loss
        per_rank[rank] = sums
    steps = sorted(set.intersection(*(set(v) for v in per_rank.values())))
    return {s: sum(v[s] for v in per_rank.values()) / len(ranks) for s in steps}


@pytest.mark.slow  # ~80 s: torchrun, 4 workers, 10 s to notice the lost one, a restart of all workers
def test_lost_rank_resumes_in_a_smaller_world(tmp_path: Path) -> None:
    from worker_elastic import reference

    (tmp_path / "world").write_text(f"2 {free_port()}")
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=4",
           "--max-restarts=1", "--monitor-interval=1", str(SCRIPT), str(tmp_path), "killed"]
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        log, _ = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish in 300 s:\n{log[-6000:]}")
    assert proc.returncode == 0, log[-6000:]
    assert "accumulate_grad_batches=1 -> 2, keeping 2 batches per optimizer step" in log
    first = json.loads((tmp_path / "losses.attempt0.rank3.json").read_text())
    assert first["world"] == 4 and max(step for _, step, _ in first["rows"]) == 3  # rank 3 died as step 4 began
    second = json.loads((tmp_path / "losses.attempt1.rank0.json").read_text())
    assert second["world"] == 2
    # the checkpoint of step 4 was the last: nothing lost beyond it, nothing trained twice
    assert sorted({step for _, step, _ in second["rows"]}) == [4, 5, 6, 7]
    assert len(second["rows"]) == 8  # two micro-batches per step

    ref_state = reference(tmp_path / "ref")
    ref = _step_losses(tmp_path / "ref", 0, [0])
    got = {**_step_losses(tmp_path, 0, [0, 2]), **_step_losses(tmp_path, 1, [0])}  # tp rank 0 of each replica
    assert sorted(got) == list(range(8))
    torch.testing.assert_close(torch.tensor([got[s] for s in range(8)]), torch.tensor([ref[s] for s in range(8)]),
                               rtol=1e-5, atol=1e-6)
    consolidate(tmp_path / "final.killed.ckpt", tmp_path / "final.whole.ckpt")
    final = torch.load(tmp_path / "final.whole.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == 8
    assert final["state_dict"].keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(final["state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)
