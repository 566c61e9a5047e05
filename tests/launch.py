"""Start N ranks of a script as Lightning would on one node, bounded in time; a hang fails instead of blocking CI.

Each rank gets ``LOCAL_RANK``/``NODE_RANK``/``MASTER_*`` so Lightning treats the processes as launched externally.
Every rank runs in its own process session; on timeout every session is killed with SIGKILL (Lightning swallows
SIGTERM).

Ranks are forked from ``tests/zygote.py``, a Python that imported torch, Lightning and lightning_tpp once per test
session, instead of each importing them again (``TPP_TEST_FORK=0``, or a zygote that cannot fork safely, starts
fresh interpreters with ``subprocess`` as before).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

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


class _Zygote:
    """The client side of ``tests/zygote.py``."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "zygote.py")], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, env=env, cwd=ROOT, text=True)
        self.lock = threading.Lock()
        self.ready = bool(self.ask(None).get("ready"))
        atexit.register(self.close)

    def ask(self, request: Optional[dict]) -> dict:
        with self.lock:
            if request is not None:
                self.proc.stdin.write(json.dumps(request) + "\n")
                self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"tests/zygote.py exited ({self.proc.poll()})")
        return json.loads(line)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


_zygote: Any = None


def _get_zygote() -> Optional[_Zygote]:
    global _zygote
    if _zygote is None:
        _zygote = False
        if os.environ.get("TPP_TEST_FORK", "1") != "0":
            try:
                zygote = _Zygote()
                _zygote = zygote if zygote.ready else False
            except (OSError, RuntimeError, ValueError):
                pass
    return _zygote or None


class _Forked:
    """A rank forked by the zygote, with the part of ``subprocess.Popen``'s interface ``run_ranks`` uses."""

    def __init__(self, zygote: _Zygote, argv: list[str], env: dict[str, str], log: Any) -> None:
        self.zygote, self.returncode = zygote, None
        self.pid = zygote.ask({"op": "start", "argv": argv, "env": env, "cwd": str(ROOT), "log": log.name})["pid"]

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            code = self.zygote.ask({"op": "poll", "pids": [self.pid]})["codes"].get(str(self.pid))
            self.returncode = code
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        end = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if end is not None and time.monotonic() > end:
                raise subprocess.TimeoutExpired(str(self.pid), timeout)
            time.sleep(0.05)
        return self.returncode


def _pythonpath() -> str:
    return f"{ROOT}{os.pathsep}{ROOT / 'tests'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"


def run_ranks(script: Path, nprocs: int, args: list[str], *, timeout: float = 240.0,
              env: dict[str, str] | None = None, fresh: bool = False) -> RunResult:
    """``fresh``: start fresh interpreters even where the zygote runs (a test of a rank's own resident memory: a
    forked rank's memory differs by what it shares with the zygote)."""
    port = free_port()
    procs, logs = [], []
    start = time.monotonic()
    for rank in range(nprocs):
        rank_env = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                    "LOCAL_RANK": str(rank), "RANK": str(rank), "NODE_RANK": "0", "WORLD_SIZE": str(nprocs),
                    "PYTHONPATH": _pythonpath(), "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        log = open(Path(os.environ.get("TMPDIR", "/tmp")) / f"tpp_rank{rank}_{port}.log", "w+")
        zygote = None if fresh else _get_zygote()
        if zygote is not None:
            procs.append(_Forked(zygote, [str(script), *args], rank_env, log))
        else:
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
        kills = [os.killpg] + ([os.kill] if p.poll() is None else [])  # a rank forked but not yet in its session
        for kill in kills:
            try:
                kill(p.pid, signal.SIGKILL)
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
