"""``schedule="auto"``: choose the pipeline schedule from the stages' measured action costs.

The engine runs :data:`AUTO_MEASURE` for a few steps, timing each rank's actions; :func:`costs_from_times` turns
those times into per-rank costs, and :func:`choose_schedule` simulates every candidate with them
(``schedule.simulate``) and returns the fastest as an :class:`AutoChoice` (the engine switches and logs it).
:func:`settle_auto` is the choice where the layout leaves one sensible schedule and nothing needs measuring.
Pure functions of their arguments: every rank given the same numbers chooses the same schedule.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional, Sequence

from lightning_tpp.pipeline.schedule import ScheduleConfigError, check, simulate

AUTO = "auto"
# the preference on a tie: the simpler schedule first. Not GPipe: with the same costs it never finishes before 1F1B
# (the simulator on 3000 random per-rank cost profiles, pp 2-8) and holds every micro-batch at once
AUTO_CANDIDATES = ("1f1b", "zb-drain", "zero-bubble", "zb-lead")
AUTO_MEASURE = "zb-drain"  # runs while "auto" measures: times F and B on every rank, I and W on the others
AUTO_TIE = 0.01  # a schedule simulated less than 1% faster than a simpler one is a tie (noise; more memory held)


def settle_auto(pp: int, microbatches: int, virtual: int, *, dp_sharded: Optional[str] = None
                ) -> Optional[AutoChoice]:
    """What ``schedule="auto"`` takes without measuring, where the layout leaves one sensible schedule: interleaved
    1F1B with several chunks per rank, GPipe with fewer micro-batches than stages (what measures, zb-drain, and 1F1B
    need at least ``pp``), 1F1B when FSDP2 shards the parameters over dp (``dp_sharded`` says how, e.g.
    ``"dp=2 (full_shard, FSDP2)"``): a split backward would keep them gathered until the step ends. ``None``:
    measure and choose among :data:`AUTO_CANDIDATES`."""
    if virtual > 1:
        check("interleaved-1f1b", pp, microbatches, virtual)
        return AutoChoice("interleaved-1f1b", {}, [], reason=f"virtual_stages={virtual}: the one schedule with "
                                                             f"several chunks per rank")
    if microbatches < pp:
        return AutoChoice("gpipe", {}, [], reason=f"microbatches={microbatches} < pp={pp}: the one schedule that "
                                                  f"runs fewer micro-batches than stages")
    if dp_sharded is not None:
        return AutoChoice("1f1b", {}, [], reason=(
            f"parameters sharded over {dp_sharded}: a schedule that splits backward would keep the stage's "
            f"parameters and gradients gathered until the step ends; schedule='zb-drain' trades that memory for "
            f"speed"))
    return None


def costs_from_times(measured: Sequence[Mapping[str, tuple[float, int]]]) -> list[dict[str, float]]:
    """Each rank's seconds per ``F``, ``FS``, ``B``, ``I`` and ``W`` action for :func:`simulate` (``rank_costs``),
    from what that rank timed in a step of :data:`AUTO_MEASURE` (``kind -> (seconds in all, actions)``, as
    ``executor.StepTimes.costs``: ``FS`` the forwards among ``F`` whose backward was split). A kind a rank did not
    run is derived: ``B`` from ``I + W`` and ``I``/``W`` from ``B`` with the median split overhead and ``W`` share of
    the ranks that ran both, ``FS`` from ``F`` (or ``F`` from ``FS``) with the median ``FS / F`` of the ranks that
    ran both. The first rank's split backward runs whole in ``W`` (no input gradient to send), so there ``I`` costs
    nothing, ``W`` a whole backward and ``FS`` a plain forward."""
    means = []
    for m in measured:
        mean = {k: t / n for k, (t, n) in m.items() if n and k not in ("F", "FS")}
        (f_total, f_n), (fs_total, fs_n) = m.get("F", (0.0, 0)), m.get("FS", (0.0, 0))
        if f_n > fs_n:  # "F" counts both kinds of forward
            mean["F"] = (f_total - fs_total) / (f_n - fs_n)
        if fs_n:
            mean["FS"] = fs_total / fs_n
        means.append(mean)
    both = [m for m in means if {"I", "W"} <= m.keys() and m["I"] + m["W"] > 0]
    ratio = _median([(m["I"] + m["W"]) / m["B"] for m in both if m.get("B", 0) > 0], 1.0)  # I + W over a whole B
    share = _median([m["W"] / (m["I"] + m["W"]) for m in both], 0.5)
    defer = _median([m["FS"] / m["F"] for m in means if {"F", "FS"} <= m.keys() and m["F"] > 0], 1.0)  # FS / F
    out = []
    for r, m in enumerate(means):
        f = m["F"] if "F" in m else m["FS"] / defer if "FS" in m else 0.0
        has_split = {"I", "W"} <= m.keys()
        b = m["B"] if "B" in m else (m["I"] + m["W"]) / ratio if has_split else 2 * f
        i, w = (m["I"], m["W"]) if has_split else ((1 - share) * b * ratio, share * b * ratio)
        out.append({"F": f, "FS": f, "B": b, "I": 0.0, "W": b} if r == 0 else
                   {"F": f, "FS": m.get("FS", defer * f), "B": b, "I": i, "W": w})
    return out


def _median(values: Sequence[float], default: float) -> float:
    """The upper median of ``values`` (one of them: the same on every rank given the same numbers)."""
    return sorted(values)[len(values) // 2] if values else default


@dataclass(frozen=True)
class AutoChoice:
    """What ``schedule="auto"`` chose: the schedule, every candidate's simulated step, the per-rank costs used."""

    schedule: str
    makespans: dict[str, float]
    costs: list[dict[str, float]]
    reason: str = ""  # why, where the layout alone decided (nothing measured)
    jitter: float = 0.0  # how much the measured action times varied (the simulation's ``jitter``)

    def describe(self) -> str:
        """One line for the log: the choice, each candidate's simulated step relative to 1F1B, the costs."""
        if not self.makespans:
            return f"schedule='auto': chose {self.schedule!r} ({self.reason})"
        base = self.makespans.get("1f1b") or self.makespans[self.schedule]
        ref = "1f1b" if "1f1b" in self.makespans else self.schedule
        ratios = ", ".join(f"{n} {t / base:.3f}" for n, t in self.makespans.items())
        costs = " ".join(f"{k}=" + "/".join(f"{c[k] * 1e3:.2f}" for c in self.costs)
                         for k in ("F", "FS", "B", "I", "W") if all(k in c for c in self.costs))
        return (f"schedule='auto': chose {self.schedule!r} (simulated step {self.makespans[self.schedule] / base:.3f} "
                f"x {ref}; candidates {ratios}; measured ms per action on pp ranks 0..{len(self.costs) - 1}: "
                f"{costs}; action times vary by {self.jitter:.1%})")


def choose_schedule(pp: int, microbatches: int, costs: Sequence[Mapping[str, float]], *,
                    candidates: Sequence[str] = AUTO_CANDIDATES, tie: float = AUTO_TIE,
                    jitter: float = 0.0) -> AutoChoice:
    """The candidate whose simulated step with each rank's measured ``costs`` (:func:`costs_from_times`) is
    shortest; within ``tie`` of the shortest, the first in ``candidates`` (the simpler one). ``jitter``: how much
    the measured action times vary (their coefficient of variation); the steps are then simulated with actions
    that vary as much (:func:`simulate`), which is where zb-lead's slack pays. A pure function of its arguments:
    every rank given the same numbers chooses the same schedule."""
    makespans: dict[str, float] = {}
    samples = max(4, min(32, 50_000 // (3 * pp * microbatches)))  # under a second or so in all, at any size
    for name in candidates:
        try:
            makespans[name] = simulate(name, pp, microbatches, rank_costs=costs, jitter=jitter,
                                       samples=samples).makespan
        except ScheduleConfigError:
            continue  # does not fit this layout
    if not makespans:
        raise ScheduleConfigError(f"schedule='auto': none of {tuple(candidates)} fits pp={pp}, "
                                  f"microbatches={microbatches}")
    best = min(makespans.values())
    chosen = next(n for n, t in makespans.items() if t <= best * (1 + tie))
    return AutoChoice(chosen, makespans, [dict(c) for c in costs], jitter=jitter)
