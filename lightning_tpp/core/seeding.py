"""Draws from a generator seeded for one purpose, leaving the global random state as it was: a module's initialiser
(``materialize``), a pipeline micro-batch or unit call (``pipeline.stage``), a tp rank's dropout (``tensor_parallel.
rng``)."""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch


@contextlib.contextmanager
def seeded(seed: Optional[int], device: torch.device) -> Iterator[None]:
    """Random draws inside come from a generator seeded with ``seed`` (on ``device`` too when it is a GPU); the global
    random state is as before afterwards. A no-op for ``None``."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed % 2 ** 63)
        yield
