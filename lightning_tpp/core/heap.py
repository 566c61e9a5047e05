"""Freed large blocks leave a CPU rank's resident memory: glibc's ``mallopt(M_MMAP_THRESHOLD, 64 KiB)``.

glibc serves a request below its mmap threshold from the heap and, by default, raises that threshold to the size of
each mmapped block freed (up to 32 MiB). FSDP2 gathers a block's parameters and frees them again on every forward and
backward: after the first free those buffers come from the heap, and the heap keeps what is freed, so resident
memory counts memory no tensor holds (3.2x the ideal share at tp2 x pp2 x dp2 on CPU instead of 1.35x; see
docs/memory.md). A fixed threshold turns the dynamic one off: blocks of 64 KiB and more are mapped on allocation
and unmapped on free, so resident memory follows what tensors hold. It is what ``MALLOC_MMAP_THRESHOLD_=65536``
does; the strategy sets it on CPU ranks so that users need not know.

The price is speed on CPU: a block mapped on allocation is faulted in page by page and unmapped on free, every
time. Measured in one process (OMP_NUM_THREADS=1, 12 steps, benchmarks/layout.py's models), a step took 1.5-1.7x as
long at 64 KiB as at 4 MiB or more (T5 190 ms against 125, a Llama 397 against 240, a GPT-2 363 against 219; page
faults 3x), and larger thresholds keep more in the heap: the 154 M Llama at tp2 x pp2 x dp2 (checkpointing off)
peaks at 1.56-1.69x the ideal share at 1 MiB, 1.77-1.95x at 4 MiB, 2.4-2.8x with glibc's default and
``malloc_trim`` after every step (1.35x at 64 KiB; issue #30 asks for at most 1.5x; docs/memory.md). A user who prefers the speed sets ``MALLOC_MMAP_THRESHOLD_``
(e.g. 4194304): theirs wins. The layout search times its blocks under the same setting (it runs after it).

A no-op outside Linux/glibc (macOS, Windows, musl), and when the user set ``MALLOC_MMAP_THRESHOLD_`` (glibc read
their value at start-up: theirs wins). Set once per process (the setting is the process's, as the allocator is).
"""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from typing import Optional

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 64 * 1024  # bytes: glibc's initial threshold (128 KiB) halved, as benchmarks measured with
ENV = "MALLOC_MMAP_THRESHOLD_"


@functools.lru_cache(maxsize=None)  # once per process
def return_freed_blocks() -> str:
    """Fix glibc's mmap threshold at :data:`THRESHOLD`. Returns what happened: ``"set"``, ``"user"`` (the
    environment variable holds the user's value, left alone), ``"unavailable"`` (not Linux with glibc) or
    ``"refused"`` (``mallopt`` returned an error)."""
    if os.environ.get(ENV):
        return "user"
    libc = _glibc()
    if libc is None:
        return "unavailable"
    return "set" if libc.mallopt(ctypes.c_int(M_MMAP_THRESHOLD), ctypes.c_int(THRESHOLD)) == 1 else "refused"


def _glibc() -> Optional[ctypes.CDLL]:
    """The process's C library if it is glibc (which exports ``gnu_get_libc_version``; musl does not)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
    except OSError:  # pragma: no cover - a Linux process without a dynamic C library
        return None
    if not hasattr(libc, "gnu_get_libc_version") or not hasattr(libc, "mallopt"):
        return None
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    libc.mallopt.restype = ctypes.c_int
    return libc
