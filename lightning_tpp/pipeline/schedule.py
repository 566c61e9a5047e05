"""Pipeline schedules as data: the ordered actions of each rank, checked and timed without processes.

An action is ``(kind, microbatch, chunk)``: ``F`` forward, ``B`` backward (input and weight gradients), ``I``
input gradient only, ``W`` weight gradient only (zero-bubble and zb-drain split ``B`` into ``I`` then ``W``). Rank
``r`` holds the virtual stages ``chunk * pp + r``::

    1F1B, pp=4, m=8, rank 0:  F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7
                    rank 3:  F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7

A :class:`Schedule` names a function producing those lists plus the micro-batch constraints it relies on;
:data:`SCHEDULES` is the registry of named ones (the six built-ins, and any added with :func:`register_schedule`).
:func:`resolve` also turns a user's explicit per-rank action lists and ``torch.distributed.pipelining`` schedule
classes into a ``Schedule`` (``schedule_input``), and :func:`validate` checks one before any process runs: every
micro-batch forwarded once and backwarded once, and :func:`simulate` (sends asynchronous, receives blocking, as the
engine does) finding no deadlock; it also reports each rank's idle fraction (``schedule="auto"`` chooses among
the schedules with it: ``pipeline.auto``).
"""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Optional, Sequence, Union

Action = tuple[str, int, int]
Orders = Callable[[int, int, int, int], Sequence[Action]]  # (rank, pp, microbatches, virtual) -> that rank's actions


class ScheduleConfigError(ValueError):
    """Micro-batch count, stage count and schedule do not fit together."""


@dataclass(frozen=True)
class Schedule:
    """A pipeline schedule: ``orders(rank, pp, microbatches, virtual)`` gives a rank's actions, and the fields say
    which layouts the orders are written for, so that :meth:`check` refuses a bad one at construction rather than a
    hang at the first step.

    Args:
        name: the name ranks and messages use (the registry key once registered).
        orders: a rank's ordered ``(kind, microbatch, chunk)`` actions; stage of a chunk = ``chunk * pp + rank``.
        min_microbatches: ``"pp"`` if the orders keep ``pp`` micro-batches in flight (1F1B and its kin), else ``1``.
        interleaved: orders for ``virtual_stages >= 2`` chunks per rank with ``microbatches`` divisible by ``pp``
            (Megatron's grouping); ``False``: one chunk per rank.
        fixed: ``(pp, microbatches, virtual_stages)`` that explicit action lists were written for.
        key: what identifies ``orders`` in ``repr`` (ranks compare reprs to agree on the configuration); default
            the function's qualified name.
    """

    name: str
    orders: Orders
    min_microbatches: Literal[1, "pp"] = "pp"
    interleaved: bool = False
    fixed: Optional[tuple[int, int, int]] = None
    key: str = ""

    def __repr__(self) -> str:
        key = self.key or f"{getattr(self.orders, '__module__', '')}.{getattr(self.orders, '__qualname__', '')}"
        return (f"Schedule(name={self.name!r}, orders={key}, min_microbatches={self.min_microbatches!r}, "
                f"interleaved={self.interleaved}, fixed={self.fixed})")

    def check(self, pp: int, microbatches: int, virtual: int) -> None:
        """Refuse a layout the orders are not written for, with the values and a fix."""
        if microbatches < 1:
            raise ScheduleConfigError(f"microbatches={microbatches} must be at least 1")
        if self.fixed is not None:
            return self._check_fixed(pp, microbatches, virtual)
        if self.min_microbatches == "pp" and microbatches < pp:
            raise ScheduleConfigError(
                f"schedule={self.name!r} needs microbatches >= pp: got microbatches={microbatches}, pp={pp}. "
                f"Use microbatches={2 * pp} (bubble (p-1)/(m+p-1) = {(pp - 1) / (3 * pp - 1):.0%}) or "
                f"schedule='gpipe'")
        if self.interleaved:
            if virtual < 2:
                raise ScheduleConfigError(f"schedule={self.name!r} needs virtual_stages >= 2, got {virtual}")
            if microbatches % pp:
                raise ScheduleConfigError(f"schedule={self.name!r} needs microbatches divisible by pp={pp}, got "
                                          f"{microbatches}; use {((microbatches + pp - 1) // pp) * pp}")
        elif virtual != 1:
            raise ScheduleConfigError(f"virtual_stages={virtual} needs schedule='interleaved-1f1b', not {self.name!r}")

    def _check_fixed(self, pp: int, microbatches: int, virtual: int) -> None:
        assert self.fixed is not None
        got = {"pp": pp, "microbatches": microbatches, "virtual_stages": virtual}
        wrong = [f"{k}={got[k]}" for k, want in zip(got, self.fixed) if got[k] != want]
        if wrong:
            fpp, fm, fv = self.fixed
            raise ScheduleConfigError(
                f"schedule {self.name!r} is action lists for pp={fpp}, microbatches={fm}, virtual_stages={fv} "
                f"(one list per rank; micro-batches and chunks counted from the actions), but got {', '.join(wrong)}; "
                f"pass pp={fpp}, microbatches={fm}, virtual_stages={fv}, or write lists for this layout")

    def actions(self, rank: int, pp: int, microbatches: int, virtual: int = 1) -> list[Action]:
        self.check(pp, microbatches, virtual)
        return list(self.orders(rank, pp, microbatches, virtual))


ScheduleLike = Union[str, Schedule, Sequence[Sequence[Action]], type]  # what TensorPipeStrategy(schedule=) takes
SCHEDULES: dict[str, Schedule] = {}


def register_schedule(schedule: Schedule, *, replace: bool = False) -> Schedule:
    """Add ``schedule`` to :data:`SCHEDULES` under its name, so that ``TensorPipeStrategy(schedule=name)`` finds it.
    Register it in every process (at import time of the training script) before building the strategy."""
    if not isinstance(schedule, Schedule):
        raise TypeError(f"register_schedule takes a Schedule, got {type(schedule).__name__}: {schedule!r}; "
                        f"wrap the function: register_schedule(Schedule('my-schedule', orders))")
    if schedule.name in SCHEDULES and SCHEDULES[schedule.name] != schedule and not replace:
        raise ScheduleConfigError(f"a schedule named {schedule.name!r} is already registered "
                                  f"({SCHEDULES[schedule.name]!r}); choose another name or pass replace=True")
    SCHEDULES[schedule.name] = schedule
    return schedule


def _one_f_one_b(rank: int, pp: int, m: int, v: int = 1, *, lead: int = 0) -> list[Action]:
    """``lead``: forwards run ahead of 1F1B's warm-up before the first backward (see :func:`_zb_lead`)."""
    warmup = min(pp - rank - 1 + lead, m)
    order: list[Action] = [("F", i, 0) for i in range(warmup)]
    for i in range(m - warmup):
        order += [("F", warmup + i, 0), ("B", i, 0)]
    return order + [("B", i, 0) for i in range(m - warmup, m)]


def _zero_bubble(rank: int, pp: int, m: int, v: int = 1) -> list[Action]:
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


def _zb_drain(rank: int, pp: int, m: int, v: int = 1) -> list[Action]:
    """1F1B in which rank ``r > 0`` splits only the backward of its first ``r`` micro-batches and of its last one,
    and runs those ``W`` in the drain, where 1F1B idles::

        pp=2, m=8, rank 1:  F0 I0 F1 B1 F2 B2 ... F6 B6 F7 I7 W0 W7
                   rank 0:  F0 F1 B0 F2 B1 ... F7 B6 B7          (B0 starts a W sooner, B7 while rank 1 runs W0 W7)

    Zero-bubble's gain at small ``pp`` for ``r + 1`` splits per rank instead of ``m``: where splitting a backward
    costs (on CPU ``I`` + ``W`` take ~10% more than ``B``, the weight products re-reading their operands), this is
    the faster of the two; where it is free, zero-bubble's every-backward split leaves less bubble at larger ``pp``.
    Holds the weight-gradient operands of up to ``r`` micro-batches until the drain."""
    return _drain_splits(_one_f_one_b(rank, pp, m), rank, m)


def _drain_splits(order: list[Action], rank: int, m: int) -> list[Action]:
    """zb-drain's splits of a 1F1B-like ``order``: the first ``rank`` backwards and the last, their ``W`` at the end."""
    if rank == 0:  # nothing upstream waits for its input gradients
        return order
    early = list(range(min(rank, m - 1)))
    split = set(early) | {m - 1}
    order = [("I", mb, chunk) if kind == "B" and mb in split else (kind, mb, chunk) for kind, mb, chunk in order]
    return order + [("W", mb, 0) for mb in [*early, m - 1]]


def _zb_lead(rank: int, pp: int, m: int, v: int = 1) -> list[Action]:
    """zb-drain in which every rank but the last runs one forward more before its first backward::

        pp=2, m=8, rank 0:  F0 F1 F2 B0 F3 B1 ... F7 B5 B6 B7     (zb-drain: F0 F1 B0 F2 B1 ...)
                   rank 1:  F0 I0 F1 B1 F2 B2 ... F6 B6 F7 I7 W0 W7

    With every action taking its mean time it finishes when zb-drain does: the last stage sets the pace. But in
    zb-drain an upstream rank sends each forward only a little before the next stage needs it (pp=2: F + B of one
    stage against the next's), so any action that runs long there makes the later stages wait. Running one
    micro-batch ahead leaves them a forward's time of slack. ``schedule="auto"`` takes it where the measured
    action times vary enough for that to pay (:func:`choose_schedule`'s ``jitter``). Holds one more micro-batch of
    activations on every rank but the last."""
    return _drain_splits(_one_f_one_b(rank, pp, m, lead=int(rank < pp - 1)), rank, m)


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


def _gpipe(rank: int, pp: int, m: int, v: int = 1) -> list[Action]:
    return [("F", i, 0) for i in range(m)] + [("B", i, 0) for i in range(m)]


_BUILTINS = (Schedule("gpipe", _gpipe, min_microbatches=1), Schedule("1f1b", _one_f_one_b),
             Schedule("interleaved-1f1b", _interleaved, interleaved=True),
             Schedule("zero-bubble", _zero_bubble), Schedule("zb-drain", _zb_drain), Schedule("zb-lead", _zb_lead))
for _builtin in _BUILTINS:
    register_schedule(_builtin)


def resolve(schedule: Union[str, Schedule]) -> Schedule:
    """The :class:`Schedule` of a registered name (or the ``Schedule`` itself). What users pass besides (per-rank
    action lists, a ``torch.distributed.pipelining`` class) becomes one in ``schedule_input.resolve``."""
    if isinstance(schedule, Schedule):
        return schedule
    if not isinstance(schedule, str) or schedule not in SCHEDULES:
        raise ScheduleConfigError(
            f"unknown schedule {schedule!r}: schedule={schedule!r} is not one of {tuple(SCHEDULES)}; pass one "
            f"of those, add yours with register_schedule(Schedule(name, orders)), or pass a Schedule, per-rank "
            f"action lists or a torch.distributed.pipelining schedule class")
    return SCHEDULES[schedule]


def registered(name: str) -> Optional[Schedule]:
    """The schedule registered under ``name``, if any."""
    return SCHEDULES.get(name)


def check(schedule: Union[str, Schedule], pp: int, microbatches: int, virtual: int) -> None:
    resolve(schedule).check(pp, microbatches, virtual)


def actions(schedule: Union[str, Schedule], rank: int, pp: int, microbatches: int, virtual: int = 1) -> list[Action]:
    """The ordered actions of ``rank``."""
    return resolve(schedule).actions(rank, pp, microbatches, virtual)


def validate(schedule: Union[str, Schedule], pp: int, microbatches: int, virtual: int) -> None:
    """At construction: the layout fits, each rank's orders run every micro-batch and chunk once (``F``, then ``B``
    or ``I`` then ``W``), and the ranks' orders together do not deadlock. The built-ins' orders are proven by the
    unit tests, so only their layout is checked (simulating pp=32, m=256 takes seconds)."""
    check(schedule, pp, microbatches, virtual)
    spec = resolve(schedule)
    if any(spec is b for b in _BUILTINS):
        return
    name = spec.name
    for rank in range(pp):
        check_orders(name, rank, actions(schedule, rank, pp, microbatches, virtual), microbatches, virtual)
    simulate(schedule, pp, microbatches, virtual)


def check_orders(name: str, rank: int, order: Sequence[Action], microbatches: int, virtual: int) -> None:
    """One rank's actions are complete and in dependency order on that rank."""
    where = f"schedule {name!r}, rank {rank}"
    for action in order:
        if action[0] not in "FBIW" or not (0 <= action[1] < microbatches and 0 <= action[2] < virtual):
            raise ScheduleConfigError(f"{where}: action {action!r} is outside microbatches={microbatches}, "
                                      f"virtual_stages={virtual} (kinds 'F', 'B', 'I', 'W')")
    counts = Counter(order)
    pos = {a: i for i, a in enumerate(order)}
    for mb in range(microbatches):
        for c in range(virtual):
            n = {k: counts[(k, mb, c)] for k in "FBIW"}
            what = f"{where}: micro-batch {mb}, chunk {c}"
            if n["F"] != 1 or (n["B"], n["I"], n["W"]) not in ((1, 0, 0), (0, 1, 1)):
                raise ScheduleConfigError(
                    f"{what} has {n['F']} F, {n['B']} B, {n['I']} I, {n['W']} W; each micro-batch and chunk needs "
                    f"one F, then one B or one I then one W")
            back = ("B" if n["B"] else "I", mb, c)
            if pos[back] < pos[("F", mb, c)]:
                raise ScheduleConfigError(f"{what}: {back[0]} (action {pos[back]}) comes before its F (action "
                                          f"{pos[('F', mb, c)]}); a backward must follow its forward")
            if n["W"] and pos[("W", mb, c)] < pos[back]:
                raise ScheduleConfigError(f"{what}: W (action {pos[('W', mb, c)]}) comes before its I (action "
                                          f"{pos[back]}); the weight gradient must follow the input gradient")


def split_backwards(order: Sequence[Action], rank: int, pp: int) -> set[tuple[int, int]]:
    """The ``(micro-batch, chunk)`` whose backward ``rank`` runs split (their forward under ``DeferWeightGrads``): an
    ``I`` in ``order``, off the first stage. The first stage has no input gradient to send before the weight
    gradients, so its ``I`` does nothing and its ``W`` runs the whole backward."""
    return {(mb, chunk) for kind, mb, chunk in order if kind == "I" and chunk * pp + rank > 0}


@dataclass
class Simulation:
    makespan: float
    busy: list[float]

    @property
    def bubble(self) -> list[float]:
        """Idle fraction of each rank over the step."""
        return [1.0 - b / self.makespan for b in self.busy]


def simulate(schedule: Union[str, Schedule], pp: int, microbatches: int, virtual: int = 1, *, f: float = 1.0,
             b: float = 2.0, w_share: float = 0.5, split_cost: float = 0.0,
             rank_costs: Optional[Sequence[Mapping[str, float]]] = None, jitter: float = 0.0,
             samples: int = 32) -> Simulation:
    """Run every rank's order with action costs ``f`` (forward) and ``b`` (backward; ``I`` and ``W`` take
    ``(1 - w_share) * b`` and ``w_share * b``, plus half of ``split_cost`` each: what splitting a backward costs
    beyond it) per stage chunk; raises ``ScheduleConfigError`` on a deadlock. ``rank_costs``: instead, one
    ``{"F", "B", "I", "W"}`` cost mapping per rank (measured stages that differ, see :func:`choose_schedule`), with
    optionally ``"FS"``: the forward of a micro-batch whose backward is split, off the first stage (it runs under
    ``DeferWeightGrads``; ``F`` where not given).

    ``jitter``: every action takes its cost times ``1 + jitter * z`` (``z`` standard normal, the factor kept within
    [0.5, 1.5]), as on a machine whose speed varies; the result is the mean of ``samples`` such runs, drawn from a
    fixed seed (the same numbers give the same result in every process)."""
    orders = [actions(schedule, r, pp, microbatches, virtual) for r in range(pp)]
    uniform = {"F": f, "FS": f, "B": b, "I": (1 - w_share) * b + split_cost / 2, "W": w_share * b + split_cost / 2}
    if rank_costs is not None and len(rank_costs) != pp:
        raise ValueError(f"rank_costs has {len(rank_costs)} entries, one per rank is needed (pp={pp})")
    per_rank = [uniform] * pp if rank_costs is None else [
        {**{k: float(c[k]) for k in "FBIW"}, "FS": float(c.get("FS", c["F"]))} for c in rank_costs]
    name = schedule if isinstance(schedule, str) else schedule.name
    if jitter <= 0:
        return _play(name, orders, per_rank, microbatches, virtual, lambda: 1.0)
    rng = random.Random(0)

    def factor() -> float:
        return min(max(1.0 + jitter * rng.gauss(0.0, 1.0), 0.5), 1.5)

    runs = [_play(name, orders, per_rank, microbatches, virtual, factor) for _ in range(samples)]
    return Simulation(sum(r.makespan for r in runs) / samples,
                      [sum(r.busy[k] for r in runs) / samples for k in range(pp)])


def _play(name: str, orders: list[list[Action]], per_rank: list[dict[str, float]], microbatches: int, virtual: int,
          factor: Callable[[], float]) -> Simulation:
    """One run of ``orders`` (sends asynchronous, receives blocking), each action's cost times ``factor()``."""
    pp = len(orders)
    stages = pp * virtual
    done: dict[tuple[str, int, int], float] = {}  # (kind, mb, global stage) -> finish time
    split = [split_backwards(order, r, pp) for r, order in enumerate(orders)]  # their forwards cost "FS"
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
                kind = "FS" if act[0] == "F" and (act[1], act[2]) in split[r] else act[0]
                cost = per_rank[r][kind] * factor()
                clock[r] = max(clock[r], t) + cost
                busy[r] += cost
                done[(act[0], act[1], act[2] * pp + r)] = clock[r]
                pos[r] += 1
                progressed = True
        if not progressed:
            stuck = {r: orders[r][pos[r]] for r in range(pp) if pos[r] < len(orders[r])}
            raise ScheduleConfigError(f"schedule {name!r} deadlocks (pp={pp}, m={microbatches}, v={virtual}): "
                                      f"ranks wait at {stuck}; each rank's next action waits for one that another "
                                      f"rank runs only later: reorder them")
    return Simulation(max(clock), busy)


def theoretical_bubble(pp: int, microbatches: int, virtual: int = 1) -> float:
    """(p - 1) / (m * v + p - 1): the idle fraction of GPipe/1F1B (v = 1) and interleaved 1F1B."""
    return (pp - 1) / (microbatches * virtual + pp - 1)
