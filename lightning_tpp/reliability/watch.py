"""Fail fast, never hang: every rank ends within a bounded time when another rank fails or disappears.

A rank blocked in a collective or a pipeline receive cannot notice that its peer raised an exception or was killed;
it would wait for the process group's timeout (30 minutes by default). Each rank therefore runs a daemon thread that
talks to the rendezvous store (which every rank already has)::

    every 0.5 s:  write my heartbeat; read the others'
    a rank fails: its Lightning exception hook writes "tpp/abort" = who, where, what
    any rank:     sees "tpp/abort", or a heartbeat unchanged for `timeout` s, or loses the store
                  -> prints which rank failed and where, and ends its process (exit code 1)

Ranks that finish normally mark themselves done, so an early finisher is not taken for a lost one.

Who waits for whom: when the watch stops a rank, and whenever a rank receives SIGUSR1 (``kill -USR1 <pid>``, or
``pkill -USR1 -f train.py`` for every rank of a job), the rank prints what ``describe`` says (the pipeline action it
is in and the message it waits for) and where its main thread is blocked (the ``torch.distributed`` call, or the
line waiting on a transfer)::

    [lightning_tpp rank 0 {'dp': 0, 'pp': 0, 'tp': 0}] in pipeline stage 0, backward of micro-batch 0; waiting 4.1 s
        to receive the gradients of micro-batch 0 from stage 1 (rank 1) for stage 0
    [lightning_tpp rank 0 {'dp': 0, 'pp': 0, 'tp': 0}] main thread blocked at lightning_tpp/pipeline/transport.py:
        118 in wait: work.wait() <- lightning_tpp/pipeline/executor.py:246 in _roots <- ...

The report is printed by a thread of its own (:class:`SignalReport`): a main thread blocked in a C++ wait runs no
Python signal handler until the wait returns. That needs the blocked call to have released the GIL, as gloo's
waits and collectives do; a rank stuck in a call that holds it (a CUDA synchronisation such as ``.item()`` after a
hung NCCL kernel) prints once the call returns (``py-spy dump --pid`` shows it meanwhile).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
import traceback
from typing import Any, Callable, Optional

import torch.distributed as dist

_ABORT = "tpp/abort"


def job_store(store: Any) -> Any:
    """``store`` under a prefix that only this start of the job uses. torchrun hands restarted workers the
    rendezvous' store, which outlives them: the failure report and heartbeats of the attempt before would stop the
    new one at once (found by a two-agent test: the restarted ranks stopped on the lost node's report). Rank 0 draws
    the prefix; one broadcast gives it to every rank."""
    import uuid

    import torch.distributed as dist

    token = [uuid.uuid4().hex if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    return dist.PrefixStore(f"tpp/{token[0]}/", store)


class FailureWatch:
    def __init__(self, store: Any, rank: int, world_size: int, *, timeout: float, interval: float = 0.5,
                 grace: float = 10.0) -> None:
        self.store, self.rank, self.world = store, rank, world_size
        self.timeout, self.interval, self.grace = timeout, interval, grace
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._reported = False
        self.describe: Optional[Callable[[], str]] = None  # what this rank was doing, printed when it is stopped

    def start(self) -> None:
        self.store.set(f"tpp/done/{self.rank}", "0")
        self._thread = threading.Thread(target=self._run, name="lightning_tpp-watchdog", daemon=True)
        self._thread.start()

    def silent_ranks(self, wait: float = 2.0) -> list[int]:
        """Ranks (not done) whose heartbeat does not advance within ``wait`` seconds: the dead, after an error."""
        def beats() -> dict[int, bytes]:
            return {r: self.store.get(f"tpp/hb/{r}") if self.store.check([f"tpp/hb/{r}"]) else b""
                    for r in range(self.world) if r != self.rank and self.store.get(f"tpp/done/{r}") != b"1"}
        try:
            before = beats()
        except Exception:  # noqa: BLE001 - the store itself is gone: rank 0's process
            return [0]
        _sleep_through_handlers(wait)
        try:
            after = beats()
        except Exception:  # noqa: BLE001
            return [0]
        return [r for r, v in before.items() if after.get(r) == v]

    def stop(self) -> None:
        """Normal end: stop watching and tell the others this rank is done (not lost)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * self.interval)
        try:
            self.store.set(f"tpp/done/{self.rank}", "1")
        except Exception:  # noqa: BLE001 - the store may already be gone at shutdown
            pass

    @property
    def reported(self) -> bool:
        """This rank failed, or saw another rank's failure report."""
        try:
            return self._reported or bool(self.store.check([_ABORT]))
        except Exception:  # noqa: BLE001 - the store is gone: treat as failed, do not wait for anyone
            return True

    def report(self, message: str) -> None:
        """This rank failed: tell every rank (the first report wins) and let this process end on its own. If another
        rank failed first, this error is a consequence of that one: say so, and end now."""
        self._reported = True
        try:
            first = self.store.compare_set(_ABORT, "", message).decode()
        except Exception:  # noqa: BLE001 - the store is gone with rank 0's process: nobody left to tell
            self._die(f"{message} (the rendezvous store that rank 0 hosted is gone: rank 0 was killed or lost)")
        if first != message:
            self._die(first)
        print(f"[lightning_tpp rank {self.rank}] {message}", file=sys.stderr, flush=True)

    def report_exception(self, exception: BaseException, *, label: str, during: str, where: str = "") -> None:
        """This rank (``label``: its rank and coordinates) failed ``during`` a stage of the run (``where``: in the
        pipeline schedule): :meth:`report` it, naming the ranks that went silent when a peer may be gone."""
        message = f"{label} failed during {during}{where}: {type(exception).__name__}: {str(exception)[:500]}"
        if threading.current_thread() is threading.main_thread():  # where it was, for a report made meanwhile
            _RAISED[0] = traceback.extract_tb(exception.__traceback__)
        if isinstance(exception, (dist.DistBackendError, RuntimeError)):
            silent = self.silent_ranks()
            if silent:
                message = (f"rank(s) {silent} stopped responding (killed or lost); {label} noticed{where}: "
                           f"{type(exception).__name__}: {str(exception)[:300]}")
        self.report(message)

    def _first(self, message: str) -> str:
        """Put ``message`` in the store as the failure report unless one is there, and return the one that is: a
        rank that ends because it saw another rank fall silent says so first, so that a peer which then meets this
        rank's closed connection does not report this rank as the lost one (under torchrun the first report is the
        one that names the rank: rank 3 killed, rank 1 blamed rank 0, which had ended on rank 3's silence)."""
        try:
            return self.store.compare_set(_ABORT, "", message).decode() or message
        except Exception:  # noqa: BLE001 - the store is gone: say what this rank saw
            return message

    def _die(self, message: str) -> None:
        print(f"[lightning_tpp rank {self.rank}] stopping: {message}", file=sys.stderr, flush=True)
        if self.describe is not None:
            print(self.describe(), file=sys.stderr, flush=True)
        os._exit(1)

    def _run(self) -> None:
        beat = 0
        seen: dict[int, tuple[str, float]] = {}
        failures = 0
        while not self._stop.wait(self.interval):
            now = time.monotonic()
            try:
                beat += 1
                self.store.set(f"tpp/hb/{self.rank}", str(beat))
                if self.store.check([_ABORT]):
                    message = self.store.get(_ABORT).decode()
                    if self._reported:  # this rank failed: give its own traceback time to print and exit
                        if self._stop.wait(self.grace):
                            return
                        self._die(message)
                    self._die(message)
                for r in range(self.world):
                    if r == self.rank or self.store.get(f"tpp/done/{r}") == b"1":
                        continue
                    value = self.store.get(f"tpp/hb/{r}").decode() if self.store.check([f"tpp/hb/{r}"]) else ""
                    last = seen.get(r)
                    if last is None or last[0] != value:
                        seen[r] = (value, now)
                    elif now - last[1] > self.timeout:
                        self._die(self._first(f"rank {r} stopped responding ({now - last[1]:.0f}s without a "
                                              f"heartbeat): it was killed or lost. Checkpoints already saved are "
                                              f"intact; resume with trainer.fit(..., ckpt_path='last')"))
                failures = 0
            except Exception as err:  # noqa: BLE001 - the store lives in rank 0's process
                failures += 1
                if failures * self.interval > min(self.timeout, 10.0):
                    self._die(f"lost the rendezvous store hosted by rank 0 ({err}): rank 0 was killed or lost")


def _sleep_through_handlers(seconds: float) -> None:
    """Sleep ``seconds`` in all, whatever a signal handler raises meanwhile. Under torchrun the survivors of a lost
    rank get SIGTERM about a second later, and Lightning's handler broadcasts over the world, the lost rank included:
    that raised out of :meth:`FailureWatch.silent_ranks`'s wait, which took it for the store gone and blamed rank 0
    (reproduced with the same-world restart test on loaded cores: 'rank(s) [0] stopped responding', rank 3 killed)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        try:
            time.sleep(left)
        except Exception:  # noqa: BLE001 - a signal handler's error, not the wait's
            continue


def _in_torch_distributed(frame: traceback.FrameSummary) -> bool:
    return f"torch{os.sep}distributed{os.sep}" in frame.filename or "torch/distributed/" in frame.filename


def _short(frame: traceback.FrameSummary) -> str:
    parts = frame.filename.replace(os.sep, "/").split("/")
    name = "/".join(parts[parts.index("lightning_tpp"):]) if "lightning_tpp" in parts[:-1] else parts[-1]
    return f"{name}:{frame.lineno} in {frame.name}"


# where the exception the main thread is reporting (FailureWatch.report_exception) was raised, outermost frame first
_RAISED: list[Optional[traceback.StackSummary]] = [None]


def main_thread_location(callers: int = 3) -> str:
    """Where the main thread is now: the ``torch.distributed`` call it is in (the one called from outside
    torch.distributed) and its callers, else its innermost line and callers. While it reports its own exception
    (a peer's closed connection ended the wait it was blocked in), where it raised that exception."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    if frame is None:
        return "main thread not found"
    stack = traceback.extract_stack(frame)  # outermost first
    reporting = any(f.name == "report_exception" and f.filename == __file__ for f in stack)
    until = ""
    if reporting and _RAISED[0]:
        stack, until = _RAISED[0], " until it raised there"
    inside = [i for i, f in enumerate(stack) if _in_torch_distributed(f)]
    if inside:
        first = inside[-1]
        while first > 0 and _in_torch_distributed(stack[first - 1]):
            first -= 1
        call, innermost = stack[first], stack[inside[-1]]
        where = f"in torch.distributed {call.name}"
        where += f" ({innermost.name})" if innermost.name != call.name else ""
        outer = stack[max(first - callers, 0):first]
    else:
        where = f"at {_short(stack[-1])}: {(stack[-1].line or '').strip()}"
        outer = stack[max(len(stack) - 1 - callers, 0):-1]
    return f"main thread blocked {where}" + "".join(f" <- {_short(f)}" for f in reversed(outer)) + until


def rank_report(label: str, activity: Optional[Callable[[], str]] = None) -> str:
    """The hang report of one rank: what it is doing (``activity``: the pipeline engine's ``describe_activity``) and,
    from another thread, where its main thread is blocked. ``label``: e.g. "rank 0 {'dp': 0, 'pp': 0, 'tp': 0}"."""
    what = activity() if activity is not None else ""
    lines = [f"[lightning_tpp {label}] {what or 'not in a pipeline action'}"]
    if threading.current_thread() is not threading.main_thread():
        lines.append(f"[lightning_tpp {label}] {main_thread_location()}")
    return "\n".join(lines)


class SignalReport:
    """On ``signum`` (SIGUSR1) print ``describe()`` and where the main thread is to stderr, from a daemon thread of
    its own: Python runs signal handlers in the main thread only, and not while it is blocked in a C++ wait. The
    C-level handler Python installs writes the signal's number to the wakeup fd (:func:`signal.set_wakeup_fd`) in
    whichever thread the signal lands, so the reporting thread reads it from there. The Python-level handler only
    calls the one it replaced (Lightning's SLURM requeue handler uses SIGUSR1); :meth:`uninstall` restores both the
    handler and the wakeup fd (bytes meant for an earlier wakeup fd are passed on to it)."""

    def __init__(self, describe: Callable[[], str], signum: int = signal.SIGUSR1) -> None:
        self.describe, self.signum = describe, signum
        self._previous_handler: Any = None
        self._previous_fd = -1
        self._pipe: Optional[tuple[int, int]] = None
        self._thread: Optional[threading.Thread] = None

    def install(self) -> bool:
        """Install; ``False`` (nothing changed) outside the main thread, where Python refuses signal handlers."""
        if threading.current_thread() is not threading.main_thread() or self._pipe is not None:
            return False
        read, write = os.pipe()
        os.set_blocking(write, False)
        self._previous_handler = signal.signal(self.signum, self._handle)
        self._previous_fd = signal.set_wakeup_fd(write, warn_on_full_buffer=False)
        self._pipe = (read, write)
        self._thread = threading.Thread(target=self._run, args=(read,), name="lightning_tpp-report", daemon=True)
        self._thread.start()
        return True

    def uninstall(self) -> None:
        if self._pipe is None or threading.current_thread() is not threading.main_thread():
            return
        signal.set_wakeup_fd(self._previous_fd)
        signal.signal(self.signum, self._previous_handler if self._previous_handler is not None else signal.SIG_DFL)
        read, write = self._pipe
        self._pipe = None
        os.close(write)  # the reading thread sees the end of the pipe and returns
        if self._thread is not None:
            self._thread.join(timeout=2.0)
        os.close(read)

    def _handle(self, signum: int, frame: Any) -> None:
        if callable(self._previous_handler):
            self._previous_handler(signum, frame)

    def _run(self, read: int) -> None:
        while True:
            try:
                data = os.read(read, 64)
            except OSError:
                return
            if not data:
                return
            if self._previous_fd >= 0:
                try:
                    os.write(self._previous_fd, data)
                except OSError:
                    pass
            if self.signum in data:
                self.report()

    def report(self) -> None:
        try:
            text = self.describe()
        except Exception as err:  # noqa: BLE001 - a report must never take the process down
            text = f"(could not describe this rank: {type(err).__name__}: {err})"
        print(text, file=sys.stderr, flush=True)
