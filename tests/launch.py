"""Start N ranks of a script as Lightning would on one node, bounded in time; a hang fails instead of blocking CI.

Each rank gets ``LOCAL_RANK``/``NODE_RANK``/``MASTER_*`` so Lightning treats the processes as launched externally.
Every rank runs in its own process session; on timeout every session is killed with SIGKILL (Lightning swallows
SIGTERM).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class RunResult:
    returncodes: list[int]
    outputs: list[str]
    elapsed: float
    timed_out: bool

    def check(self) -> "RunResult":
        if self.timed_out or any(self.returncodes):
            logs = "\n".join(f"---- rank {r} (exit {c}) ----\n{o[-6000:]}"
                             for r, (c, o) in enumerate(zip(self.returncodes, self.outputs)))
            raise AssertionError(f"distributed run failed (timed out: {self.timed_out}, "
                                 f"exit codes {self.returncodes}, {self.elapsed:.0f}s)\n{logs}")
        return self


def run_ranks(script: Path, nprocs: int, args: list[str], *, timeout: float = 240.0,
              env: dict[str, str] | None = None) -> RunResult:
    port = free_port()
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(nprocs):
        rank_env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "LOCAL_RANK": str(rank), "RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(nprocs),
                    "PYTHONPATH": f"{ROOT}{os.pathsep}{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
                    "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"tpp_rank{rank}_{port}.log", "w+")
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=rank_env, stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True, cwd=ROOT))
        logs.append(log)
    timed_out = False
    for p in procs:
        remaining = timeout - (time.monotonic() - start)
        try:
            p.wait(timeout=max(remaining, 0.1))
        except subprocess.TimeoutExpired:
            timed_out = True
            break
    for p in procs:  # kill whatever is left, children included
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    outputs = []
    for log in logs:
        log.seek(0)
        outputs.append(log.read())
        log.close()
        os.unlink(log.name)
    return RunResult([p.returncode for p in procs], outputs, time.monotonic() - start, timed_out)
