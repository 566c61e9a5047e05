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
