"""Fail fast, never hang: every rank ends within a bounded time when another rank fails or disappears.

A rank blocked in a collective or a pipeline receive cannot notice that its peer raised an exception or was killed;
it would wait for the process group's timeout (30 minutes by default). Each rank therefore runs a daemon thread that
talks to the rendezvous store (which every rank already has)::

    every 0.5 s:  write my heartbeat; read the others'
    a rank fails: its Lightning exception hook writes "tpp/abort" = who, where, what
    any rank:     sees "tpp/abort", or a heartbeat unchanged for `timeout` s, or loses the store
                  -> prints which rank failed and where, and ends its process (exit code 1)

Ranks that finish normally mark themselves done, so an early finisher is not taken for a lost one.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, Optional

_ABORT = "tpp/abort"


class FailureWatch:
    def __init__(self, store: Any, rank: int, world_size: int, *, timeout: float, interval: float = 0.5,
                 grace: float = 10.0) -> None:
        self.store, self.rank, self.world = store, rank, world_size
        self.timeout, self.interval, self.grace = timeout, interval, grace
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._reported = False

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
            time.sleep(wait)
            after = beats()
        except Exception:  # noqa: BLE001 - the store itself is gone: rank 0's process
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

    def _die(self, message: str) -> None:
        print(f"[lightning_tpp rank {self.rank}] stopping: {message}", file=sys.stderr, flush=True)
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
                        self._die(f"rank {r} stopped responding ({now - last[1]:.0f}s without a heartbeat): it was "
                                  f"killed or lost. Checkpoints already saved are intact; resume with "
                                  f"trainer.fit(..., ckpt_path='last')")
                failures = 0
            except Exception as err:  # noqa: BLE001 - the store lives in rank 0's process
                failures += 1
                if failures * self.interval > min(self.timeout, 10.0):
                    self._die(f"lost the rendezvous store hosted by rank 0 ({err}): rank 0 was killed or lost")
