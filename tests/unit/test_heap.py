"""core/heap: glibc's mmap threshold fixed on CPU ranks (freed large blocks leave resident memory), once per
process, never over the user's ``MALLOC_MMAP_THRESHOLD_``, a no-op without glibc. Each case runs in a fresh Python
process: the setting is the process's and this one's allocator is left as it was."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_PROBE = ("import importlib.util, sys; spec = importlib.util.spec_from_file_location('heap', {path!r}); "
          "heap = importlib.util.module_from_spec(spec); spec.loader.exec_module(heap); "
          "print(heap.return_freed_blocks(), heap.return_freed_blocks.cache_info().misses)")


def _probe(env_value: str | None = None) -> list[str]:
    """What ``return_freed_blocks`` answers in a fresh process (core/heap.py loaded alone: no torch import)."""
    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    if env_value is not None:
        env["MALLOC_MMAP_THRESHOLD_"] = env_value
    code = _PROBE.format(path=str(ROOT / "lightning_tpp" / "core" / "heap.py")) + \
        "; heap.return_freed_blocks(); print(heap.return_freed_blocks.cache_info().misses)"
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return done.stdout.split()


def _glibc() -> bool:
    import platform

    return sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"


@pytest.mark.skipif(not _glibc(), reason="mallopt(M_MMAP_THRESHOLD) is glibc's (Linux); elsewhere a no-op")
def test_threshold_is_set_once_on_glibc() -> None:
    status, first_misses, later_misses = _probe()
    assert status == "set"  # mallopt returned 1 (success)
    assert first_misses == later_misses == "1"  # asked three times, done once


@pytest.mark.skipif(not _glibc(), reason="mallopt(M_MMAP_THRESHOLD) is glibc's (Linux); elsewhere a no-op")
def test_the_users_variable_wins() -> None:
    assert _probe("1048576")[0] == "user"


def test_without_glibc_nothing_happens(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_tpp.core import heap

    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.setattr(heap.sys, "platform", "darwin")
    monkeypatch.setattr(heap, "return_freed_blocks", heap.return_freed_blocks.__wrapped__)  # not cached
    assert heap._glibc() is None
    assert heap.return_freed_blocks() == "unavailable"
