"""Random numbers the strategy needs for itself, never taken from the user's generators.

The user's code (``training_step``, the model's own dropout over replicated values) draws from the global generators
exactly as in one process: the strategy neither reseeds them nor advances them. Its own draws come from generators
seeded for one purpose (``seeded``): a module's initialiser (``materialize``), a pipeline micro-batch or unit call
(``pipeline.stage``), a tp rank's dropout over sharded values (``OwnStream``, read by ``tensor_parallel.rng``).
``agree_with_rank0`` makes every rank continue rank 0's streams at setup (Lightning's DDP reseeds them instead)."""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import random
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Optional

import torch
import torch.distributed as dist


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


def derived_seed(*parts: Any) -> int:
    """A seed from plain values (ints, strings, bytes), the same in every process and run (``hash()`` of a string is
    not: Python salts it per process)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2 ** 63)


def global_state_digest(device: torch.device) -> bytes:
    """Where the global generators stand (the CPU one, and ``device``'s when it is a GPU), without drawing."""
    h = hashlib.sha256(torch.get_rng_state().numpy().tobytes())
    if device.type == "cuda":
        h.update(torch.cuda.get_rng_state(device).numpy().tobytes())
    return h.digest()[:16]


class AmbiguousRecomputationError(ValueError):
    """A block recomputed in backward was called more than once from the same random state in one step."""


@dataclass
class OwnStream:
    """The strategy's own random stream for dropout over tensor-parallel shards (Megatron's RNG tracker keeps a
    second generator for the same reason): each block call draws from a generator seeded by (the run's seed, the
    training batch, the block, where the global generators stood when the block was entered, the how-many-th such
    call). Nothing of the user's generators is drawn, and a block recomputed in backward (activation checkpointing
    restores the global state it was entered with) draws the same masks; the batch index comes from the Trainer's
    progress, which checkpoints carry, so nothing more needs saving."""

    seed: int = 0
    step: int = 0
    _calls: dict[tuple[str, bytes], int] = field(default_factory=dict)
    # compile=: how a compiled block reaches this stream (``tensor_parallel.rng``'s key op takes plain values): its
    # handle, and a tensor each key counts into, which keeps the op in its place in the graph (never merged with
    # another call's, nor recomputed)
    handle: int = field(default_factory=lambda: next(_HANDLES), compare=False, repr=False)
    keyed: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int64), compare=False, repr=False)
    device: str = field(default="", compare=False, repr=False)  # the generator it keys on, found at its first call

    def __post_init__(self) -> None:
        _STREAMS[self.handle] = self

    def start_step(self, step: int) -> None:
        """A training batch begins (``step``: its index over the run, from the Trainer's progress)."""
        self.step = step
        self._calls.clear()  # (a second fit starts at batch 0 again: the calls of the first one are not this one's)

    def enter(self, block: str, device: torch.device, *, recomputing: bool) -> tuple[Any, ...]:
        """The key of this call of ``block``: a block called twice from one random state (weight sharing, a model
        run twice in a step with nothing drawn between) gets a different key each time; its recomputation must
        then know which call it replays, which it cannot, and that is refused rather than guessed."""
        where = global_state_digest(device)
        calls = self._calls.get((block, where), 0)
        if recomputing:
            if calls > 1:
                raise AmbiguousRecomputationError(
                    f"block {block!r} was called {calls} times in this training step from the same random state and "
                    f"is recomputed in backward with dropout over its tensor-parallel shards: which call's masks "
                    f"to replay is unknown. Draw a random number between the calls, leave this block out of "
                    f"activation checkpointing, or set its dropout to 0")
            occurrence = 0
        else:
            self._calls[(block, where)] = calls + 1
            occurrence = calls
        return (self.seed, self.step, block, where, occurrence)


_HANDLES = itertools.count()
_STREAMS: "weakref.WeakValueDictionary[int, OwnStream]" = weakref.WeakValueDictionary()


def stream_by_handle(handle: int) -> OwnStream:
    return _STREAMS[handle]


@contextlib.contextmanager
def calls_kept() -> Iterator[Callable[[], None]]:
    """Every own stream's count of calls put back after (and in between, by the function given): a check's extra
    calls of a block are not calls of the step, and would otherwise give the step's call another key than eager's."""
    saved = [(stream, dict(stream._calls)) for stream in list(_STREAMS.values())]

    def restore() -> None:
        for stream, calls in saved:
            stream._calls.clear()
            stream._calls.update(calls)

    try:
        yield restore
    finally:
        restore()


def agree_with_rank0(device: torch.device) -> None:
    """Every rank continues rank 0's random streams (torch's CPU generator, this rank's GPU, Python's, NumPy's): the
    same as they are when every rank ran the same code (rank 0's are what one process would hold), and made so when
    ranks were seeded differently, since tp ranks must draw alike. Lightning's DDP reseeds instead
    (``reset_seed``), which changes the user's numbers from what one process draws."""
    if not dist.is_available() or not dist.is_initialized() or dist.get_world_size() == 1:
        return
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if device.type == "cuda":
        state["cuda"] = torch.cuda.get_rng_state(device)
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # pragma: no cover - numpy is optional
        np = None  # type: ignore[assignment]
    box = [state]
    dist.broadcast_object_list(box, src=0, device=device if device.type == "cuda" else None)
    if dist.get_rank() == 0:
        return
    state = box[0]
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and device.type == "cuda":
        torch.cuda.set_rng_state(state["cuda"], device)
    if np is not None and "numpy" in state:
        np.random.set_state(state["numpy"])
