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
    seed %= 2 ** 63
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        if device.type not in ("cpu", "cuda"):  # another accelerator: its generator is reached through manual_seed
            torch.manual_seed(seed)
        else:
            # the generators fork_rng restores, and only those: torch.manual_seed would also seed every GPU (for
            # good, on a CPU run) and, while CUDA is not initialised, queue that with a formatted stack trace of the
            # caller (~1 ms each, per unit and micro-batch: 2-4% of a CPU pipeline step, profiled with py-spy)
            torch.default_generator.manual_seed(seed)
            if device.type == "cuda":
                index = device.index if device.index is not None else torch.cuda.current_device()
                torch.cuda.default_generators[index].manual_seed(seed)
        yield
