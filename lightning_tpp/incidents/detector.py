"""The pure part of the spike guard: a running window per watched signal, the spike test, and the incident budget.

Every rank feeds the same numbers (the loss averaged over the data-parallel replicas and the gradient norm over every
shard, both after a collective over the world) in the same order, so every rank reaches the same verdict without a
further exchange. Nothing here touches ``torch.distributed``: it is tested in one process.

A value is a spike when it is far above its window on both counts::

    z     = (value - mean) / max(std, 1e-3 * |mean|)     > z_threshold     (rare for the window's own noise)
    ratio = value / mean                                 > ratio_threshold (large in absolute terms too)

Both are needed: a flat window has a tiny ``std`` (a z-score alone fires on harmless wiggles), and a noisy window
has a large ``std`` (a ratio alone fires on its ordinary peaks). A spike is not added to the window, so one bad
batch does not raise the bar for the next. Non-finite values are always spikes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import Deque, Optional


@dataclass(frozen=True)
class Trigger:
    """One signal over its thresholds at one step."""

    signal: str  # "loss" or "grad_norm"
    value: float
    mean: float  # the window's mean before this value (nan while the window warms up)
    z: float
    ratio: float


class RunningWindow:
    """The last ``size`` accepted values of one signal."""

    def __init__(self, size: int) -> None:
        self.values: Deque[float] = deque(maxlen=size)

    def __len__(self) -> int:
        return len(self.values)

    def stats(self) -> tuple[float, float]:
        """(mean, standard deviation) of the window (population, as the window is all there is)."""
        n = len(self.values)
        if n == 0:
            return math.nan, math.nan
        mean = sum(self.values) / n
        return mean, math.sqrt(sum((v - mean) ** 2 for v in self.values) / n)

    def add(self, value: float) -> None:
        self.values.append(value)


@dataclass
class SpikeDetector:
    """One window per signal; ``check`` returns the signals over their thresholds (empty: a healthy step)."""

    window: int = 100
    warmup: int = 20
    z_threshold: float = 6.0
    ratios: dict[str, Optional[float]] = field(default_factory=lambda: {"loss": 2.0, "grad_norm": 10.0})
    windows: dict[str, RunningWindow] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.window, int) or self.window < 2:
            raise ValueError(f"window={self.window!r} must be an integer >= 2 (steps whose values make the running "
                             f"mean and deviation)")
        if not isinstance(self.warmup, int) or not 1 <= self.warmup <= self.window:
            raise ValueError(f"warmup={self.warmup!r} must be an integer in [1, window={self.window}]: the steps "
                             f"watched before the first verdict")
        if not self.z_threshold > 0:
            raise ValueError(f"z_threshold={self.z_threshold!r} must be > 0 (standard deviations above the mean)")
        for signal, ratio in self.ratios.items():
            if ratio is not None and not ratio > 1:
                raise ValueError(f"{signal}_ratio={ratio!r} must be > 1 (times the running mean), or None to not "
                                 f"watch the {signal}")
        self.windows = {s: RunningWindow(self.window) for s, r in self.ratios.items() if r is not None}

    def check(self, values: dict[str, float]) -> list[Trigger]:
        """The triggers of this step's ``values`` (signals not watched are ignored); a healthy step's values join
        their windows, a spiking step's do not (none of them: the step is not trusted)."""
        triggers = [t for t in (self._test(s, v) for s, v in values.items() if s in self.windows) if t is not None]
        if not triggers:
            for s, v in values.items():
                if s in self.windows:
                    self.windows[s].add(v)
        return triggers

    def _test(self, signal: str, value: float) -> Optional[Trigger]:
        window = self.windows[signal]
        mean, std = window.stats()
        if not math.isfinite(value):
            return Trigger(signal, value, mean, math.inf, math.inf)
        if len(window) < self.warmup:
            return None
        z = (value - mean) / max(std, 1e-3 * abs(mean), 1e-12)
        ratio = value / mean if mean > 0 else math.inf
        if z > self.z_threshold and ratio > self.ratios[signal]:
            return Trigger(signal, value, mean, z, ratio)
        return None


class TooManyIncidentsError(FloatingPointError):
    """More incidents in a window of steps than the guard allows (raised on every rank at once)."""


@dataclass
class IncidentBudget:
    """At most ``limit`` incidents within any ``within`` consecutive steps; one more stops the run."""

    limit: int = 3
    within: int = 1000
    steps: list[tuple[int, str]] = field(default_factory=list)  # (step, description) of every incident so far

    def __post_init__(self) -> None:
        if not isinstance(self.limit, int) or self.limit < 0:
            raise ValueError(f"max_incidents={self.limit!r} must be an integer >= 0")
        if not isinstance(self.within, int) or self.within < 1:
            raise ValueError(f"incident_window={self.within!r} must be a positive number of steps")

    def add(self, step: int, description: str) -> None:
        """Count an incident at ``step``; raise when the window now holds more than ``limit``."""
        self.steps.append((step, description))
        recent = [(s, d) for s, d in self.steps if s > step - self.within]
        if len(recent) > self.limit:
            listed = "\n".join(f"  step {s}: {d}" for s, d in recent)
            raise TooManyIncidentsError(
                f"{len(recent)} incidents within {self.within} steps (max_incidents={self.limit}); stopping:\n"
                f"{listed}\nthe run is unstable rather than meeting a bad batch now and then: lower the learning "
                f"rate, check the data of these steps, or raise SpikeGuard(max_incidents=...)")
