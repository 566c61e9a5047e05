"""A rank lost under ``torchrun --max-restarts``: the job restarts, resumes from the last checkpoint in the smaller
world that is left (tp2 x dp2 -> tp2 x dp1, ``dp="auto"``), keeps the global batch (accumulation 1 -> 2) and the data
position, and trains as one process does on the same global batches."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
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


@pytest.mark.parametrize("mode", ["same", pytest.param("same_async", marks=pytest.mark.slow)])
def test_lost_rank_restarts_in_the_same_world(tmp_path: Path, mode: str) -> None:
    """The most common single-node restart: torchrun --standalone restarts the 4 workers of tp2 x dp2 on its own
    store, which still holds the dead attempt's keys (before the per-attempt store prefix: init_process_group never
    returned). They re-form the group and resume from the step-4 checkpoint: losses equal one process's. With
    checkpoints saved in the background too (slow: the same path, ~60 s more)."""
    cmd = ["--standalone", "--nnodes=1", "--nproc-per-node=4", "--max-restarts=1", "--monitor-interval=1"]
    log = _finish(_torchrun(cmd, tmp_path, mode), 240)
    assert "restart" in log.lower() and (tmp_path / "losses.attempt1.rank0.json").exists(), log[-6000:]
    # the report names the lost rank: the ranks that ended on its silence said so before a peer of theirs could
    # blame them for their closed connections. Either report names it: the watch's (its heartbeat stopped) or a
    # rank's whose collective met the lost rank's closed connection first ("rank(s) [3] ...")
    assert re.search(r"rank(\(s\) \[3\]| 3) stopped responding", log) and "rank(s) [0]" not in log, log[-6000:]
    second = json.loads((tmp_path / "losses.attempt1.rank0.json").read_text())
    resumed = min(step for _, step, _ in second["rows"])
    # the step-4 checkpoint; in the background it may not be published yet when rank 3 dies: then step 2's, intact
    assert resumed in ((4,) if mode == "same" else (2, 4)), second
    assert second["world"] == 4 and sorted({step for _, step, _ in second["rows"]}) == list(range(resumed, 8))
    from worker_elastic import reference

    reference(tmp_path / "ref")
    ref = _step_losses(tmp_path / "ref", 0, [0])
    first = {s: v for s, v in _step_losses(tmp_path, 0, [0, 2]).items() if s < resumed}
    got = {**first, **_step_losses(tmp_path, 1, [0, 2])}
    assert sorted(got) == list(range(8)), got
    torch.testing.assert_close(torch.tensor([got[s] for s in range(8)]), torch.tensor([ref[s] for s in range(8)]),
                               rtol=1e-5, atol=1e-6)


@pytest.mark.slow  # ~80 s: torchrun, 4 workers, 10 s to notice the lost one, a restart of all workers
def test_lost_rank_resumes_in_a_smaller_world(tmp_path: Path) -> None:
    (tmp_path / "world").write_text(f"2 {free_port()}")
    cmd = ["--standalone", "--nnodes=1", "--nproc-per-node=4", "--max-restarts=1", "--monitor-interval=1"]
    proc = _torchrun(cmd, tmp_path, "killed")
    log = _finish(proc, 300)
    assert proc.returncode == 0, log[-6000:]
    _check_resumed(tmp_path, log, "killed", last_rank=3)


@pytest.mark.slow  # ~150 s: two agents, a lost node noticed (10 s), a rendezvous round without it, a restart
def test_lost_node_two_agents_c10d_rendezvous_in_a_smaller_world(tmp_path: Path) -> None:
    """Two torchrun agents (nodes) of 2 workers with --nnodes=1:2 and a c10d rendezvous; the second node is SIGKILLed
    (agent and workers) as step 5 starts. The first agent restarts its workers and the rendezvous itself forms the
    smaller world (one node: tp2 x dp1): nothing of the world comes from the test."""
    rdzv = ["--nnodes=1:2", "--nproc-per-node=2", "--max-restarts=1", "--monitor-interval=1",
            "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", "--rdzv-id=lost-node"]
    conf = "--rdzv-conf=last_call_timeout=10,join_timeout=120,is_host="  # both join within 10 s of the first
    first = _torchrun([*rdzv, conf + "true"], tmp_path, "node")  # hosts the rendezvous store: it must survive
    time.sleep(2.0)  # the first binds the store and joins first: its workers take ranks 0 and 1
    second = _torchrun([*rdzv, conf + "false"], tmp_path, "node")
    deadline = time.monotonic() + 200
    pids = [tmp_path / f"pid.rank{r}" for r in (2, 3)]
    while not all(p.exists() for p in pids) and time.monotonic() < deadline and first.poll() is None:
        time.sleep(0.5)
    try:
        assert all(p.exists() for p in pids), f"the second node never reached step 5:\n{_finish(first, 1)[-6000:]}"
        workers = [[int(v) for v in p.read_text().split()] for p in pids]
        assert {agent for _, agent in workers} == {second.pid}, (workers, first.pid, second.pid)
        os.killpg(second.pid, signal.SIGKILL)  # the node: its agent first (no restart of its workers), then them
        for pid, _ in workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        log = _finish(first, 300)
    finally:
        for proc in (first, second):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
    assert first.returncode == 0, log[-6000:]
    _check_resumed(tmp_path, log, "node", last_rank=2)


def _torchrun(args: list[str], out: Path, mode: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *args, str(SCRIPT), str(out), mode],
                            env=env, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)


def _finish(proc: subprocess.Popen, timeout: float) -> str:
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        log = proc.communicate()[0]
        pytest.fail(f"torchrun did not finish in {timeout} s:\n{log[-6000:]}")


def _check_resumed(out: Path, log: str, mode: str, last_rank: int) -> None:
    """Attempt 0 trained steps 0-3 in a world of 4, attempt 1 resumed from the step-4 checkpoint in a world of 2 with
    accumulation 2 and trained steps 4-7; losses and final parameters equal one process's on the same batches."""
    from worker_elastic import reference

    assert "accumulate_grad_batches=1 -> 2, keeping 2 batches per optimizer step" in log
    first = json.loads((out / f"losses.attempt0.rank{last_rank}.json").read_text())
    assert first["world"] == 4 and max(step for _, step, _ in first["rows"]) == 3  # lost as step 4 began
    second = json.loads((out / "losses.attempt1.rank0.json").read_text())
    assert second["world"] == 2
    # the checkpoint of step 4 was the last: nothing lost beyond it, nothing trained twice
    assert sorted({step for _, step, _ in second["rows"]}) == [4, 5, 6, 7]
    assert len(second["rows"]) == 8  # two micro-batches per step

    ref_state = reference(out / "ref")
    ref = _step_losses(out / "ref", 0, [0])
    got = {**_step_losses(out, 0, [0, 2]), **_step_losses(out, 1, [0])}  # tp rank 0 of each replica
    assert sorted(got) == list(range(8))
    torch.testing.assert_close(torch.tensor([got[s] for s in range(8)]), torch.tensor([ref[s] for s in range(8)]),
                               rtol=1e-5, atol=1e-6)
    consolidate(out / f"final.{mode}.ckpt", out / "final.whole.ckpt")
    final = torch.load(out / "final.whole.ckpt", map_location="cpu", weights_only=True)
    assert final["global_step"] == 8
    assert final["state_dict"].keys() == ref_state.keys()
    for name, value in ref_state.items():
        torch.testing.assert_close(final["state_dict"][name], value, rtol=1e-5, atol=1e-6, msg=name)
