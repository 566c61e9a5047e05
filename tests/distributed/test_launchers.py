"""Launch paths other than one process per rank started from outside: spawn/fork from one process (notebooks)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

from launch import ROOT


@pytest.mark.parametrize("method", [pytest.param("spawn", marks=pytest.mark.slow), "fork"])
def test_spawned_ranks_hand_back_whole_weights(method: str) -> None:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}", "OMP_NUM_THREADS": "1"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "distributed" / "script_spawn.py"), method],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"{method} launch hung:\n{out[-3000:]}")
    assert proc.returncode == 0 and "SPAWN-OK" in out, out[-3000:]
