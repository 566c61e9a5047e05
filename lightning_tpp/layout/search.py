"""The search: every layout of a world size, those that do not fit dropped with the reason, the rest ranked.

Enumerated (all pure arithmetic on a :class:`ModelProfile`; nothing is allocated or run on a device)::

    tp   divides the world, the node's devices, and every block's heads/features (the profile's tp_choices)
    pp   divides world / tp, at most one block per stage
    cp   divides world / (tp x pp), where context parallelism can run the model (nothing that mixes positions outside
         attention: the profile's cp_problem) and each rank keeps at least MIN_CP_POSITIONS of
         the sequence (the cost model charges FLOPs at one rate, which a device does not reach on a few hundred
         positions; a cp given is taken down to 2 positions per rank); under a pipeline 2 x cp must divide the
         sequence (dropped with the reason where it does not)
    dp   world / (tp x pp x cp)
    ep   divisors of dp x cp x tp where the model has experts (else 1); dropped with the reason where they do not divide
         the experts or the experts are not a 3-D bank
    micro-batches   divisors of the per-process batch (1 without a pipeline), up to 4 x pp
    schedule        gpipe below pp micro-batches; else 1f1b, and zb-drain unless FSDP2 shards (as "auto" decides)
    activation checkpointing on / off;  dp sharding full_shard / shard_grad_op / no_shard (dp > 1)

Ranked by predicted seconds per sample (a layout with more dp reads more samples per step; with ``global_batch``
every layout runs the same samples per optimizer step, gradient accumulation making up the difference). Ties go to
the simpler layout (fewer stages, no checkpointing, smaller tp and ep, less sharding: fewer synchronisation points):
within 1%, or 5% where the collectives are gloo's (CPU processes, which share the cores they compute on). There
every collective waits for the slowest process to be scheduled, a wait the cost model charges in proportion to the
compute (``BlockTimes.straggle``), not per collective; measured on 2 cores, a Mixtral with ep=2 (20 all-to-alls per
step) predicted 2.4% faster than without ep measured 1.58x slower in one run, 2.5% faster in another.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

from lightning_tpp.layout.cost import BlockTimes, StepTime, step_time
from lightning_tpp.layout.links import DeviceSpec
from lightning_tpp.layout.memory import LayoutMemory, layout_memory
from lightning_tpp.layout.plan import SHARDINGS, Layout, Sharding
from lightning_tpp.config import parse_bytes  # noqa: F401 (its home: the config validates device_memory=)
from lightning_tpp.layout.profile import ModelProfile

GiB = 1024 ** 3
TIE = 0.01
TIE_GLOO = 0.05  # see the module docstring
MIN_CP_POSITIONS = 1024  # the fewest positions of a sequence the search leaves a context-parallel rank


class NoLayoutFitsError(ValueError):
    """No layout of the world size fits the device memory (the message lists the closest ones)."""


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    time: StepTime
    memory: LayoutMemory


@dataclass(frozen=True)
class Dropped:
    layout: Layout
    reason: str


@dataclass
class Ranking:
    """The ranked candidates (fastest per sample first) and the dropped ones with their reasons."""

    ranked: list[Candidate]
    dropped: list[Dropped]
    world: int
    batch: int
    device_memory: Optional[float]
    global_batch: Optional[int] = None
    notes: list[str] = field(default_factory=list)
    tie: float = TIE  # within it of the fastest, the simpler layout ranks first

    @property
    def best(self) -> Candidate:
        if not self.ranked:
            closest = sorted(self.dropped, key=lambda d: d.reason)[:3]
            raise NoLayoutFitsError(
                f"no layout of {self.world} devices fits: {len(self.dropped)} dropped, e.g. "
                + "; ".join(f"{d.layout.describe()}: {d.reason}" for d in closest)
                + ". Raise device_memory, lower the per-process batch, or use more devices")
        return self.ranked[0]

    def why(self) -> str:
        """Why the winner won: against the runner-up and the naive layout, by part."""
        best = self.best
        lines = [f"chosen {best.layout.describe()}: {best.time.per_sample * 1e3:.3f} ms/sample predicted, "
                 f"{size(best.memory.total)} on its largest rank, a global batch of {best.time.samples} samples per "
                 f"optimizer step"]
        if len(self.ranked) > 1:
            other = self.ranked[1]
            ratio = other.time.per_sample / best.time.per_sample
            verdict = f"{ratio:.3f}x slower per sample" if ratio >= 1 else \
                f"{ratio:.3f}x the chosen's time per sample, within the {self.tie:.0%} tie that the simpler layout wins"
            lines.append(f"runner-up {other.layout.describe()}: {verdict} (its step: {_parts(other.time)}; the "
                         f"chosen's: {_parts(best.time)})")
        return "; ".join(lines)

    def table(self, top: int = 10) -> str:
        budget = size(self.device_memory) if self.device_memory else "no memory limit"
        batch = f"{self.batch} sequences per process" + (f", {self.global_batch} per optimizer step"
                                                          if self.global_batch else "")
        head = (f"Layouts of {self.world} devices ({batch}; {budget}): {len(self.ranked)} fit, "
                f"{len(self.dropped)} dropped")
        rows = [head, f"{'#':>3} {'layout':<52} {'ms/sample':>10} {'step s':>9} {'bubble':>7} {'memory':>10} "
                      f"{'samples':>8}"]
        for i, c in enumerate(self.ranked[:top]):
            t = c.time
            rows.append(f"{i + 1:>3} {c.layout.describe():<52} {t.per_sample * 1e3:10.3f} {t.total:9.3f} "
                        f"{t.bubble / t.total if t.total else 0:7.1%} {size(c.memory.total):>10} {t.samples:>8}")
        reasons: dict[str, int] = {}
        for d in self.dropped:
            key = d.reason.split(":")[0]
            reasons[key] = reasons.get(key, 0) + 1
        rows += [f"dropped: {n} x {r}" for r, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
        rows += [f"note: {n}" for n in self.notes]
        return "\n".join(rows)


def size(nbytes: float) -> str:
    """``1.50 GiB``, ``12.0 MiB`` or ``300 KiB``: bytes in the unit that shows them."""
    for unit, scale in (("GiB", GiB), ("MiB", 1024 ** 2)):
        if nbytes >= scale:
            return f"{nbytes / scale:.{2 if unit == 'GiB' else 1}f} {unit}"
    return f"{nbytes / 1024:.0f} KiB"


def _parts(t: StepTime) -> str:
    return (f"pipeline {t.pipeline:.3g} s (bubble {t.bubble:.3g}), fsdp {t.fsdp:.3g}, dp {t.dp:.3g}, "
            f"optimizer {t.optimizer:.3g}" + (f", experts {t.experts:.3g}" if t.experts else ""))


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def enumerate_layouts(profile: ModelProfile, *, world: int, devices_per_node: int, batch: int,
                      tp: Optional[int] = None, pp: Optional[int] = None,
                      activation_checkpointing: Optional[bool] = None,
                      shardings: Optional[Sequence[Sharding]] = None, ep: Optional[int] = None,
                      cp: Optional[int] = None, cp_mode: Optional[str] = "allgather") -> list[Layout]:
    """Every layout the search considers (``tp``/``pp``/``activation_checkpointing``/``ep``/``cp``/``cp_mode``
    fixed where given; ``cp_mode=None``: both modes for each layout with ``cp > 1``)."""
    out = []
    tps = [t for t in profile.tp_choices if world % t == 0 and devices_per_node % t == 0] if tp is None else [tp]
    for t in tps:
        for p in ([d for d in _divisors(world // t) if d <= profile.n_blocks] if pp is None else [pp]):
            if world % (t * p):
                continue
            cps = [c for c in _divisors(world // (t * p)) if c == 1 or (
                profile.cp_problem is None and c * MIN_CP_POSITIONS <= profile.seq_len)] if cp is None else [cp]
            for c in cps:
                if world % (t * p * c):
                    continue
                d = world // (t * p * c)
                eps = [e for e in _divisors(d * c * t) if profile.routed or e == 1] if ep is None else [ep]
                acs = (False, True) if activation_checkpointing is None else (activation_checkpointing,)
                for e, m in ((e, m) for e in eps for m in _microbatches(p, batch)):
                    for schedule in _schedules(p, m):
                        for ac in acs:
                            for sharding in (("full_shard",) if d * c == 1 else tuple(shardings or SHARDINGS)):
                                if d * c > 1 and sharding != "no_shard" and schedule not in ("1f1b", "gpipe"):
                                    continue  # a split backward keeps FSDP2's units gathered ("auto" runs 1f1b)
                                modes = ("allgather",) if c == 1 else (cp_mode,) if cp_mode else ("allgather", "a2a")
                                out.extend(Layout(t, p, d, m, schedule, ac, sharding, ep=e, cp=c, cp_mode=mode)
                                           for mode in modes)
    return out


def _microbatches(pp: int, batch: int) -> list[int]:
    if pp == 1:
        return [1]
    return [m for m in _divisors(batch) if m <= 4 * pp]


def _schedules(pp: int, m: int) -> list[str]:
    if pp == 1:
        return ["1f1b"]
    return ["gpipe"] if m < pp else ["1f1b", "zb-drain"]


def search_layouts(profile: ModelProfile, *, world: int, device: DeviceSpec, times: BlockTimes, batch: int,
                   device_memory: Optional[float] = None, margin: float = 0.1, global_batch: Optional[int] = None,
                   tp: Optional[int] = None, pp: Optional[int] = None,
                   activation_checkpointing: Optional[bool] = None, shardings: Optional[Sequence[Sharding]] = None,
                   optimizer: str = "adamw", backend: str = "nccl", ep: Optional[int] = None,
                   cp: Optional[int] = None, cp_mode: Optional[str] = "allgather") -> Ranking:
    """Rank every layout of ``world`` devices for per-process batches of ``batch`` sequences. A layout whose
    largest rank needs more than ``device_memory / (1 + margin)`` is dropped (``margin``: what the planner does not
    count, allocator and communication buffers). ``cp_mode``: the strategy's, which the cost of every layout with
    ``cp > 1`` charges its attention calls by (``layout.cost``); ``None``: both modes ranked."""
    if batch < 1:
        raise ValueError(f"batch={batch} must be at least one sequence per process")
    if ep is not None and ep > 1 and not profile.routed:
        raise ValueError(f"ep={ep}: the model has no mixture-of-experts layer to split; use ep=1")
    if tp is not None and tp not in profile.tp_choices:
        raise ValueError(f"tp={tp} does not divide the model's blocks; choose tp in {list(profile.tp_choices)}")
    ranking = Ranking([], [], world, batch, device_memory, global_batch, tie=TIE_GLOO if backend == "gloo" else TIE)
    states = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}[optimizer]
    for layout in enumerate_layouts(profile, world=world, devices_per_node=device.devices_per_node, batch=batch,
                                    tp=tp, pp=pp, activation_checkpointing=activation_checkpointing,
                                    shardings=shardings, ep=ep, cp=cp, cp_mode=cp_mode):
        problem = _ep_problem(profile, layout) or _cp_problem(profile, layout)
        if problem is not None:
            ranking.dropped.append(Dropped(layout, problem))
            continue
        if global_batch is not None:
            if global_batch % (layout.dp * batch):
                ranking.dropped.append(Dropped(layout, f"global batch: {global_batch} is not a multiple of dp x "
                                                       f"batch = {layout.dp} x {batch}"))
                continue
            layout = replace(layout, accumulate=global_batch // (layout.dp * batch))
        memory = layout_memory(profile, layout, batch=batch, optimizer=optimizer, backend=backend)
        if device_memory is not None and memory.total * (1 + margin) > device_memory:
            ranking.dropped.append(Dropped(layout, f"memory: needs {size(memory.total)} (+{margin:.0%}) on "
                                                   f"pp rank {memory.pp_rank}, the device has "
                                                   f"{size(device_memory)}"))
            continue
        time = step_time(profile, layout, device, times, batch=batch, optimizer_states=states)
        ranking.ranked.append(Candidate(layout, time, memory))
    ranking.ranked.sort(key=lambda c: c.time.per_sample)
    ranking.ranked = _simpler_first(ranking.ranked, ranking.tie)
    return ranking


def _ep_problem(profile: ModelProfile, layout: Layout) -> Optional[str]:
    """Why ``layout.ep`` cannot run (``"ep: ..."``), or None: it must divide dp x tp, every bank's experts, and the
    experts must be 3-D banks (``experts.expert_parallel``)."""
    if layout.ep == 1:
        return None
    if (layout.dp * layout.cp * layout.tp) % layout.ep:
        return f"ep: ep={layout.ep} must divide dp*cp*tp = {layout.dp * layout.cp * layout.tp}"
    problem = profile.ep_problem(layout.ep)
    return f"ep: {problem}" if problem else None


def _cp_problem(profile: ModelProfile, layout: Layout) -> Optional[str]:
    """Why ``layout.cp`` cannot run (``"cp: ..."``), or None (as the strategy refuses at construction and setup)."""
    if layout.cp == 1:
        return None
    if profile.cp_problem is not None:
        return profile.cp_problem
    if layout.pp > 1 and profile.seq_len % (2 * layout.cp):
        return (f"cp: under a pipeline a sequence of {profile.seq_len} positions must be a multiple of 2 x cp = "
                f"{2 * layout.cp}")
    return None


def _simpler_first(ranked: list[Candidate], tie: float) -> list[Candidate]:
    """Within ``tie`` of the fastest, the simplest layout first (fewer stages, less context parallelism, no
    recompute, less sharding)."""
    if not ranked:
        return ranked
    best = ranked[0].time.per_sample
    tied = [c for c in ranked if c.time.per_sample <= best * (1 + tie)]
    rest = ranked[len(tied):]

    def complexity(c: Candidate) -> tuple:
        lay = c.layout
        return (lay.pp, lay.cp, lay.activation_checkpointing, lay.tp, lay.ep,
                SHARDINGS[::-1].index(lay.dp_sharding) if lay.replicas > 1 else 0, lay.microbatches, c.time.per_sample)

    return sorted(tied, key=complexity) + rest
