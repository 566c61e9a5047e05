"""Schedules the user brings: explicit per-rank action lists, and ``torch.distributed.pipelining`` schedule classes.

Both become a :class:`~lightning_tpp.pipeline.schedule.Schedule`, so that the strategy checks and runs them like the
built-ins. A torch class is mapped to the built-in with the same order (our engine runs the model's own forward on
each stage, so torch's stage objects and runtime are not used); torch schedules whose order or stage placement the
engine cannot run are refused with the reason, rather than approximated::

    ScheduleGPipe -> 'gpipe'    Schedule1F1B -> '1f1b'    ScheduleInterleaved1F1B -> 'interleaved-1f1b'
    ScheduleZBVZeroBubble, ScheduleDualPipeV: V placement (rank r holds stages r and 2pp-1-r)   -> refused
    ScheduleInterleavedZeroBubble: ZB1P over virtual stages, not our ZB-H1 'zero-bubble'         -> refused
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence, Union

from lightning_tpp.pipeline.schedule import SCHEDULES, Action, Schedule, ScheduleConfigError, ScheduleLike
from lightning_tpp.pipeline.schedule import registered as lookup_registered
from lightning_tpp.pipeline.schedule import resolve as lookup

_TORCH = {"ScheduleGPipe": "gpipe", "Schedule1F1B": "1f1b", "ScheduleInterleaved1F1B": "interleaved-1f1b"}
_V_SHAPED = ("it places stages in a V (rank r holds stages r and 2*pp-1-r); V-shaped placements are not supported, "
             "lightning_tpp places stages looped (rank r holds stages r, r+pp, ...)")
_REFUSED = {
    "ScheduleZBVZeroBubble": _V_SHAPED,
    "ScheduleDualPipeV": _V_SHAPED,
    "ScheduleInterleavedZeroBubble": "its order (ZB1P over virtual stages, weight gradients placed by a cost "
                                     "model) is not schedule='zero-bubble' (ZB-H1, one chunk per rank), which is "
                                     "the closest one lightning_tpp runs",
    "ScheduleLoopedBFS": "its breadth-first order over virtual stages is not one lightning_tpp runs; "
                         "'interleaved-1f1b' is the depth-first one",
}


def from_torch(cls: type) -> Schedule:
    """The built-in schedule with the order of ``torch.distributed.pipelining``'s ``cls``."""
    supported = ", ".join(f"{k} ({v!r})" for k, v in _TORCH.items())
    name = cls.__name__
    if not cls.__module__.startswith("torch.distributed.pipelining"):
        raise ScheduleConfigError(f"schedule={name} is a class lightning_tpp cannot run: pass a registered name, a "
                                  f"Schedule, per-rank action lists, or one of the torch.distributed.pipelining "
                                  f"classes {supported}")
    if name in _TORCH:
        return SCHEDULES[_TORCH[name]]
    reason = _REFUSED.get(name, "lightning_tpp has no equivalent order")
    raise ScheduleConfigError(f"schedule={name} is not supported: {reason}. Supported torch.distributed.pipelining "
                              f"classes: {supported}; or pass a name from {tuple(SCHEDULES)}")


@dataclass(frozen=True)
class _Listed:
    """The orders of explicit action lists (a function of the rank only; the layout is ``Schedule.fixed``)."""

    lists: tuple[tuple[Action, ...], ...]

    def __call__(self, rank: int, pp: int, microbatches: int, virtual: int) -> list[Action]:
        return list(self.lists[rank])


def from_actions(lists: Sequence[Sequence[Any]], *, name: str = "custom") -> Schedule:
    """A schedule from one list per pipeline rank of ``(kind, microbatch, chunk)`` actions, e.g. 1F1B at pp=2, m=2::

        [[("F", 0, 0), ("F", 1, 0), ("B", 0, 0), ("B", 1, 0)],
         [("F", 0, 0), ("B", 0, 0), ("F", 1, 0), ("B", 1, 0)]]

    ``pp`` is the number of lists, the micro-batch and chunk counts one more than the largest index used: the
    strategy must be built with those. Its ``repr`` carries a digest of the lists, so ranks that were given
    different lists disagree at start-up instead of hanging."""
    if isinstance(lists, (str, bytes)) or not lists or any(
            isinstance(order, (str, bytes)) or not isinstance(order, Sequence) or not order for order in lists):
        raise ScheduleConfigError(f"schedule action lists must be one non-empty list per pipeline rank of "
                                  f"(kind, microbatch, chunk) tuples, e.g. [[('F', 0, 0), ('B', 0, 0)], ...]; "
                                  f"got {lists!r}")
    frozen = tuple(tuple(_action(a, rank, i) for i, a in enumerate(order)) for rank, order in enumerate(lists))
    microbatches = 1 + max(mb for order in frozen for _, mb, _ in order)
    virtual = 1 + max(chunk for order in frozen for _, _, chunk in order)
    digest = hashlib.sha256(repr(frozen).encode()).hexdigest()[:16]
    return Schedule(name, _Listed(frozen), min_microbatches=1, fixed=(len(frozen), microbatches, virtual),
                    key=f"actions-sha256:{digest}")


def _action(action: Any, rank: int, index: int) -> Action:
    ok = (isinstance(action, Sequence) and not isinstance(action, str) and len(action) == 3
          and action[0] in ("F", "B", "I", "W")
          and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in action[1:]))
    if not ok:
        raise ScheduleConfigError(f"rank {rank}, action {index}: {action!r} is not (kind, microbatch, chunk) with kind "
                                  f"one of 'F', 'B', 'I', 'W' and non-negative integers, e.g. ('F', 0, 0)")
    return (action[0], action[1], action[2])


def resolve(schedule: ScheduleLike) -> Schedule:
    """The :class:`Schedule` for a registered name, a ``Schedule``, explicit per-rank action lists or a
    ``torch.distributed.pipelining`` schedule class."""
    if isinstance(schedule, (str, Schedule)):
        return lookup(schedule)
    if isinstance(schedule, type):
        return from_torch(schedule)
    if isinstance(schedule, Sequence):
        return from_actions(schedule)
    raise TypeError(f"schedule must be a registered name {tuple(SCHEDULES)}, a Schedule, per-rank action lists or a "
                    f"torch.distributed.pipelining schedule class, got {type(schedule).__name__}: {schedule!r}")


def normalize(schedule: ScheduleLike) -> Union[str, Schedule]:
    """What a strategy keeps: the name of a registered schedule (as before the registry), else the ``Schedule``;
    either has the same ``repr`` on every rank (ranks compare their configurations)."""
    spec = resolve(schedule)
    return spec.name if lookup_registered(spec.name) is spec else spec
