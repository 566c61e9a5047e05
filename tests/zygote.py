"""The rank starter behind ``tests/launch.py``: one Python that imports torch, Lightning, transformers and
lightning_tpp once, then forks a process for every rank a test starts (``multiprocessing``'s forkserver idea).

Importing those takes about 5 s of CPU per process; a test suite that starts a few hundred ranks on 2 cores spent
much of its time there. A forked rank is a full process of its own (own pid, own session, so ``killpg`` works, own
environment, stdout/stderr to its log file) that runs the script as ``__main__`` and exits as a script does
(``SystemExit`` code, 1 on an uncaught exception, its non-daemon threads joined, atexit handlers run).

What the zygote imported is inherited, not the rank's: the heap is frozen for the garbage collector before any fork
(``gc.freeze``, as Python's documentation advises for fork without exec), and a rank ends with ``os._exit`` after its
threads and atexit handlers instead of tearing the interpreter down. Either one, left out, makes every rank walk
(and so copy, page by page) the whole inherited heap: measured at tp2 on a 0.3 s run, 0.4 s per collection and
0.7-2 s from the script's end to the rank's exit.

Protocol, one JSON object per line on stdin/stdout:
    -> {"op": "start", "argv": [script, ...], "env": {...}, "cwd": ..., "log": path}    <- {"pid": pid}
    -> {"op": "poll", "pids": [...]}                                                    <- {"codes": {pid: code}}
A code is ``Popen.returncode``'s (negative for a signal); pids still running are absent. EOF on stdin ends it.
"""

from __future__ import annotations

import atexit
import gc
import importlib
import io
import json
import os
import runpy
import sys
import threading
import traceback


def _preload() -> bool:
    for name in ("torch", "lightning.pytorch", "torchmetrics", "lightning_tpp", "lightning_tpp.strategy",
                 "transformers"):
        try:
            importlib.import_module(name)
        except ImportError:  # transformers is optional
            pass
    # forking is only safe from a single-threaded process (a thread holding a lock would leave it held in the child)
    return len(os.listdir("/proc/self/task")) == 1


def _reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


def _serve() -> dict:
    """Answer requests until stdin closes (then exit); returns only in a forked child, with its request."""
    codes: dict[int, int] = {}
    while True:
        line = sys.stdin.readline()
        if not line:
            sys.exit(0)
        request = json.loads(line)
        if request["op"] == "start":
            pid = os.fork()
            if pid == 0:
                return request
            _reply({"pid": pid})
        elif request["op"] == "poll":
            for pid in request["pids"]:
                if pid not in codes:
                    try:
                        done, status = os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        continue
                    if done:
                        codes[pid] = os.waitstatus_to_exitcode(status)
            _reply({"codes": {str(p): codes[p] for p in request["pids"] if p in codes}})


def _become(request: dict) -> str:
    """Turn this forked child into the rank ``request`` describes, as ``subprocess.Popen`` would have started it."""
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = os.path.abspath(request["argv"][0])
    sys.argv = [script, *request["argv"][1:]]
    # sys.path as a fresh interpreter builds it: the script's folder, then PYTHONPATH, then the rest
    extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    rest = [p for p in sys.path[1:] if p not in extra]
    sys.path[:] = [os.path.dirname(script), *extra, *rest]
    # Lightning reads the rank from the environment once, at import (in this process: before RANK was set)
    from lightning.fabric.utilities.rank_zero import _get_rank, rank_zero_only

    rank_zero_only.rank = _get_rank() or 0
    return script


def _run(script: str) -> None:
    """Run ``script`` as ``__main__`` and end this process as the interpreter would, less its teardown."""
    try:
        runpy.run_path(script, run_name="__main__")
        code = 0
    except SystemExit as stop:
        code = stop.code if isinstance(stop.code, int) else 0 if stop.code is None else 1
        if not isinstance(stop.code, (int, type(None))):
            print(stop.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - reported as the interpreter would, then exit 1
        traceback.print_exc()
        code = 1
    threading._shutdown()  # what the interpreter does first: threading's exit hooks (thread pools), then the joins
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    ready = _preload()
    gc.freeze()  # the preloaded heap: never walked by a rank's collections (no copy-on-write of it)
    _reply({"ready": ready})
    _run(_become(_serve()))
