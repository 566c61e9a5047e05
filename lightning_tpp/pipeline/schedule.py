"""Pipeline schedules as data: the ordered actions of each rank, checked and timed without processes.

An action is ``(kind, microbatch, chunk)``: ``F`` forward, ``B`` backward (input and weight gradients), ``I``
input gradient only, ``W`` weight gradient only (zero-bubble and zb-drain split ``B`` into ``I`` then ``W``). Rank
``r`` holds the virtual stages ``chunk * pp + r``::

    1F1B, pp=4, m=8, rank 0:  F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
                    rank 3:  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7

:func:`simulate` runs the orders with given action costs (sends asynchronous, receives blocking, as the engine does)
and reports each rank's idle fraction, or the deadlock if the orders have one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

Action = tuple[str, int, int]
SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zb-drain")


class ScheduleConfigError(ValueError):
    """Micro-batch count, stage count and schedule do not fit together."""


def check(schedule: str, pp: int, microbatches: int, virtual: int) -> None:
    if microbatches < 1:
        raise ScheduleConfigError(f"microbatches={microbatches} must be at least 1")
    if schedule in SCHEDULES and schedule != "gpipe" and microbatches < pp:  # the others keep pp in flight
        raise ScheduleConfigError(
            f"schedule={schedule!r} needs microbatches >= pp: got microbatches={microbatches}, pp={pp}. "
            f"Use microbatches={2 * pp} (bubble (p-1)/(m+p-1) = {(pp - 1) / (3 * pp - 1):.0%}) or schedule='gpipe'")
    if schedule == "interleaved-1f1b":
        if virtual < 2:
            raise ScheduleConfigError(f"schedule='interleaved-1f1b' needs virtual_stages >= 2, got {virtual}")
        if microbatches % pp:
            raise ScheduleConfigError(f"schedule='interleaved-1f1b' needs microbatches divisible by pp={pp}, got "
                                      f"{microbatches}; use {((microbatches + pp - 1) // pp) * pp}")
    elif virtual != 1:
        raise ScheduleConfigError(f"virtual_stages={virtual} needs schedule='interleaved-1f1b', not {schedule!r}")


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    order: list[Action] = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    return order + [("B", i, 0) for i in range(m - warmup, m)]


def _zero_bubble(rank: int, pp: int, m: int) -> list[Action]:
    """ZB-H1-style: 1F1B with each backward split into ``I`` (input gradient, sent upstream at once) and ``W``
    (weight gradient), ``W`` deferred by ``rank`` backward steps. Later stages put off the most weight work, so the
    input gradients the earlier stages wait for arrive sooner, and the deferred ``W`` fill the cool-down. With
    F = I = W the bubble is a third of 1F1B's (pp=4, m=8: 11% against 27%), for up to ``rank`` extra micro-batches
    of activations held."""
    lag = rank
    order: list[Action] = []
    done_i: list[int] = []
    for kind, mb, chunk in _one_f_one_b(rank, pp, m):
        if kind == "F":
            order.append((kind, mb, chunk))
            continue
        order.append(("I", mb, chunk))
        done_i.append(mb)
        if len(done_i) > lag:
            order.append(("W", done_i[len(done_i) - 1 - lag], chunk))
    return order + [("W", mb, 0) for mb in done_i[max(len(done_i) - lag, 0):]]


def _zb_drain(rank: int, pp: int, m: int) -> list[Action]:
    """1F1B in which rank ``r > 0`` splits only the backward of its first ``r`` micro-batches and of its last one,
    and runs those ``W`` in the drain, where 1F1B idles::

        pp=2, m=8, rank 1:  F0 I0 F1 B1 F2 B2 ... F6 B6 F7 I7 W0 W7
                   rank 0:  F0 F1 B0 F2 B1 ... F7 B6 B7          (B0 starts a W sooner, B7 while rank 1 runs W0 W7)

    Zero-bubble's gain at small ``pp`` for ``r + 1`` splits per rank instead of ``m``: where splitting a backward
    costs (on CPU ``I`` + ``W`` take ~10% more than ``B``, the weight products re-reading their operands), this is
    the faster of the two; where it is free, zero-bubble's every-backward split leaves less bubble at larger ``pp``.
    Holds the weight-gradient operands of up to ``r`` micro-batches until the drain."""
    order = _one_f_one_b(rank, pp, m)
    if rank == 0:  # nothing upstream waits for its input gradients
        return order
    early = list(range(min(rank, m - 1)))
    split = set(early) | {m - 1}
    order = [("I", mb, chunk) if kind == "B" and mb in split else (kind, mb, chunk) for kind, mb, chunk in order]
    return order + [("W", mb, 0) for mb in [*early, m - 1]]


def _interleaved(rank: int, pp: int, m: int, v: int) -> list[Action]:
    """Megatron's interleaved 1F1B: micro-batches advance in groups of ``pp`` through the ``v`` chunks."""
    total = m * v

    def ident(k: int, backward: bool) -> tuple[int, int]:
        chunk = (k // pp) % v
        return (k // (pp * v)) * pp + k % pp, (v - 1 - chunk if backward else chunk)

    warmup = total if m == pp else min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order: list[Action] = [("F", *ident(k, False)) for k in range(warmup)]
    for k in range(total - warmup):
        order += [("F", *ident(warmup + k, False)), ("B", *ident(k, True))]
    return order + [("B", *ident(k, True)) for k in range(total - warmup, total)]


def actions(schedule: str, rank: int, pp: int, microbatches: int, virtual: int = 1) -> list[Action]:
    """The ordered actions of ``rank``."""
    check(schedule, pp, microbatches, virtual)
    if schedule == "gpipe":
        return [("F", i, 0) for i in range(microbatches)] + [("B", i, 0) for i in range(microbatches)]
    if schedule == "1f1b":
        return _one_f_one_b(rank, pp, microbatches)
    if schedule == "zero-bubble":
        return _zero_bubble(rank, pp, microbatches)
    if schedule == "zb-drain":
        return _zb_drain(rank, pp, microbatches)
    if schedule == "interleaved-1f1b":
        return _interleaved(rank, pp, microbatches, virtual)
    raise ScheduleConfigError(f"unknown schedule {schedule!r}")


@dataclass
class Simulation:
    makespan: float
    busy: list[float]

    @property
    def bubble(self) -> list[float]:
        """Idle fraction of each rank over the step."""
        return [1.0 - b / self.makespan for b in self.busy]


def simulate(schedule: str, pp: int, microbatches: int, virtual: int = 1, *, f: float = 1.0, b: float = 2.0,
             w_share: float = 0.5, split_cost: float = 0.0) -> Simulation:
    """Run every rank's order with action costs ``f`` (forward) and ``b`` (backward; ``I`` and ``W`` take
    ``(1 - w_share) * b`` and ``w_share * b``, plus half of ``split_cost`` each: what splitting a backward costs
    beyond it) per stage chunk; raises ``ScheduleConfigError`` on a deadlock."""
    orders = [actions(schedule, r, pp, microbatches, virtual) for r in range(pp)]
    stages = pp * virtual
    cost = {"F": f, "B": b, "I": (1 - w_share) * b + split_cost / 2, "W": w_share * b + split_cost / 2}
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, global stage) -> finish time
    clock = [0.0] * pp
    busy = [0.0] * pp
    pos = [0] * pp

    def ready(rank: int, act: Action) -> Optional[float]:
        kind, mb, chunk = act
        g = chunk * pp + rank
        deps = []
        if kind == "F" and g > 0:
            deps.append(("F", mb, g - 1))
        if kind in ("B", "I"):
            deps.append(("F", mb, g))
            if g < stages - 1:
                deps.append(("B", mb, g + 1) if ("B", mb, g + 1) in done else ("I", mb, g + 1))
        if kind == "W":
            deps.append(("I", mb, g))
        if any(d not in done for d in deps):
            return None
        return max([done[d] for d in deps], default=0.0)

    while any(pos[r] < len(orders[r]) for r in range(pp)):
        progressed = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                act = orders[r][pos[r]]
                t = ready(r, act)
                if t is None:
                    break
                start = max(clock[r], t)
                clock[r] = start + cost[act[0]]
                busy[r] += cost[act[0]]
                done[(act[0], act[1], act[2] * pp + r)] = clock[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise ScheduleConfigError(f"schedule {schedule!r} deadlocks (pp={pp}, m={microbatches}, v={virtual}): "
                                      f"ranks wait at {stuck}")
    return Simulation(max(clock), busy)


def theoretical_bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """(p - 1) / (m * v + p - 1): the idle fraction of GPipe/1F1B (v = 1) and interleaved 1F1B."""
    return (pp - 1) / (microbatches * virtual + pp - 1)
