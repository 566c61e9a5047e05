"""reliability.watch.FailureWatch in one process, on a HashStore: the rank that falls silent is the one reported."""

from __future__ import annotations

import time

import torch.distributed as dist

from lightning_tpp.reliability.watch import FailureWatch


def _watch(store: dist.Store, rank: int) -> tuple[FailureWatch, list[str]]:
    died: list[str] = []
    watch = FailureWatch(store, rank, 3, timeout=0.3, interval=0.05)

    def die(message: str) -> None:  # stops the watch's thread instead of ending the test's process
        died.append(message)
        watch._stop.set()

    watch._die = die  # type: ignore[method-assign]
    return watch, died


def _wait(died: list[str]) -> None:
    deadline = time.monotonic() + 5
    while not died and time.monotonic() < deadline:
        time.sleep(0.05)


def test_a_silent_rank_is_written_as_the_failure_report() -> None:
    """Rank 0 sees rank 2 silent and ends: the store says rank 2 was lost, so a rank that then meets rank 0's closed
    connection reports rank 2, not rank 0 (under torchrun the first report is the one shown)."""
    store = dist.HashStore()
    store.set("tpp/done/1", "1")  # finished normally
    store.set("tpp/done/2", "0")
    watch, died = _watch(store, 0)
    watch.start()
    _wait(died)
    assert died and died[0].startswith("rank 2 stopped responding")
    assert store.get("tpp/abort").decode() == died[0]
    first = FailureWatch(store, 1, 3, timeout=1.0)
    assert first._first("rank(s) [0] stopped responding (killed or lost)") == died[0]


def test_an_earlier_report_wins() -> None:
    store = dist.HashStore()
    store.set("tpp/abort", "rank 1 failed during train: ValueError: bad")
    store.set("tpp/done/1", "0")
    store.set("tpp/done/2", "0")
    watch, died = _watch(store, 0)
    watch.start()
    _wait(died)
    assert died[0] == "rank 1 failed during train: ValueError: bad"


def test_a_signal_handler_raising_during_the_wait_blames_no_one_else() -> None:
    """``silent_ranks`` waits for heartbeats to advance; a signal handler that raises meanwhile (under torchrun the
    survivors of a lost rank get SIGTERM, and Lightning's handler broadcasts over the world, the lost rank included)
    is not the store gone: the silent rank is still the one named, not rank 0."""
    import signal

    store = dist.HashStore()
    for r in range(3):
        store.set(f"tpp/done/{r}", "0")
    store.set("tpp/hb/0", "1")  # rank 0 beats; rank 2 is silent
    watch = FailureWatch(store, 1, 3, timeout=5.0)

    def raising(signum, frame):
        store.set("tpp/hb/0", "2")
        raise RuntimeError("Connection closed by peer (the handler's broadcast to the lost rank)")

    previous = signal.signal(signal.SIGALRM, raising)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.2)
        started = time.monotonic()
        assert watch.silent_ranks(wait=0.5) == [2]
        assert time.monotonic() - started >= 0.5  # the whole wait, not cut short by the handler
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
