"""``PipelineTimeline``: every rank's pipeline actions during chosen steps, as a Chrome trace and a picture.

For each chosen step the ranks meet at a barrier, each notes its clock there (so no clock is compared across
machines), and the engine records its actions and messages. After the step rank 0 gathers them and writes::

    timeline.json   Chrome trace format (open in https://ui.perfetto.dev or chrome://tracing): one track per rank,
                    F / B / I / W spans named by micro-batch, with their stage; "receive" (blocked receiving) and
                    "send" spans inside them; "wait" spans where a rank idles until its pipeline's last rank ends
    timeline.png    the same drawn with matplotlib, one panel per recorded step (matplotlib is optional:
                    ``pip install matplotlib``, or ``png=False``)

    rank 0  |F0|F1|B0  |F2|B1  |F3|B2  |B3  |
    rank 1     |F0|B0  |F1|B1  |F2|B2  |F3|B3 |wait|
"""

from __future__ import annotations

import importlib.util
import json
import os
import time
from pathlib import Path
from typing import Any, Iterable, Optional

import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_tpp.core.optional import missing, require

__all__ = ["PipelineTimeline", "chrome_trace", "draw"]

# one recorded batch: {"step", "batch", "schedule", "pp", "virtual", "microbatches", "ranks": [per rank:
#   {"rank", "coords", "actions": [(kind, mb, stage, start, end)], "comms": [(direction, what, mb, src, dst, peer,
#    start, end)]}]}, times in seconds from the rank's clock at the barrier
Record = dict[str, Any]
COLORS = {"F": "#4C72B0", "B": "#55A868", "I": "#64B5CD", "W": "#DD8452", "receive": "#B0B0B0", "send": "#333333",
          "wait": "#E8E8E8"}
_PNG = dict(feature="PipelineTimeline drawing timeline.png", instead="or PipelineTimeline(..., png=False) for "
            "timeline.json alone")


class PipelineTimeline(Callback):
    """Record the pipeline's actions on every rank during ``steps`` (global steps, counted from 0) and write
    ``timeline.json`` and ``timeline.png`` to ``dirpath`` (see the module docstring).

    Args:
        dirpath: the folder to write to (created on rank 0).
        steps: which global steps to record; the files are written after the last of them (or at the end of
            training if it ends before).
        png: also draw ``timeline.png`` (needs matplotlib).
    """

    def __init__(self, dirpath: str | os.PathLike[str], *, steps: Iterable[int] = (2,), png: bool = True) -> None:
        self.dirpath = Path(dirpath)
        self.steps = sorted({int(s) for s in steps})
        if not self.steps or self.steps[0] < 0:
            raise ValueError(f"steps={steps!r} must name at least one global step >= 0, e.g. steps=[10]")
        if png and importlib.util.find_spec("matplotlib") is None:
            raise missing("matplotlib", **_PNG)
        self.png = png
        self.records: list[Record] = []  # on rank 0
        self._t0: Optional[float] = None  # this rank's clock at the barrier before a recorded batch
        self._step = -1
        self._written = 0

    @staticmethod
    def _engine(trainer: Any) -> Any:
        return getattr(trainer.strategy, "_engine", None)  # TensorPipeStrategy's; None without a pipeline

    @override
    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        if self._engine(trainer) is None:
            rank_zero_warn("PipelineTimeline records pipeline actions, and this run has no pipeline (pp=1 or not "
                           "the TensorPipeStrategy): it writes nothing")

    @override
    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        engine = self._engine(trainer)
        if engine is None or trainer.global_step not in self.steps:
            return
        trainer.strategy.barrier("lightning_tpp-timeline")
        self._t0, self._step = time.perf_counter(), trainer.global_step
        engine.record_trace(True)

    @override
    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        engine = self._engine(trainer)
        if engine is None or self._t0 is None:
            return
        t0, self._t0 = self._t0, None
        actions = [(kind, mb, engine.executor.stage(chunk), start - t0, end - t0)
                   for kind, mb, chunk, start, end, _ in engine.trace or []]
        comms = [(direction, *message, peer, start - t0, end - t0)
                 for direction, message, peer, start, end in engine.comm_trace or []]
        engine.record_trace(False)
        rank = trainer.global_rank
        mine = {"rank": rank, "coords": trainer.strategy.dims.coords(rank), "actions": actions, "comms": comms}
        every: list[Any] = [None] * trainer.world_size
        dist.all_gather_object(every, mine)
        schedule = engine.schedule  # what ran (under schedule='auto': what it measures with, then its choice)
        self.records.append({"step": self._step, "batch": batch_idx,
                             "schedule": schedule if isinstance(schedule, str) else schedule.name,
                             "pp": engine.pp, "virtual": engine.virtual,
                             "microbatches": engine.times.microbatches if engine.times else engine.microbatches,
                             "ranks": sorted(every, key=lambda r: r["rank"])})
        if self._step >= self.steps[-1]:
            self.write(trainer)

    @override
    def on_train_end(self, trainer: Any, pl_module: Any) -> None:
        if len(self.records) > self._written:
            self.write(trainer)

    def write(self, trainer: Any) -> None:
        """Write both files on rank 0 (every rank holds the records; only rank 0 writes)."""
        self._written = len(self.records)
        if trainer.global_rank != 0:
            return
        self.dirpath.mkdir(parents=True, exist_ok=True)
        (self.dirpath / "timeline.json").write_text(json.dumps(chrome_trace(self.records)))
        if self.png:
            draw(self.records, self.dirpath / "timeline.png")


def _waits(record: Record) -> dict[int, tuple[float, float]]:
    """Each rank's idle time after its last span, until the last rank of its pipeline (same dp and tp) ends."""
    ends: dict[tuple[int, int], float] = {}
    last: dict[int, float] = {}
    for r in record["ranks"]:
        spans = [a[4] for a in r["actions"]] + [c[-1] for c in r["comms"]]
        if spans:
            last[r["rank"]] = max(spans)
            key = (r["coords"]["dp"], r["coords"]["tp"])
            ends[key] = max(ends.get(key, 0.0), last[r["rank"]])
    return {r["rank"]: (last[r["rank"]], ends[(r["coords"]["dp"], r["coords"]["tp"])])
            for r in record["ranks"] if r["rank"] in last}


def _unblocked(start: float, end: float, receives: list[tuple[float, float]]) -> tuple[float, float]:
    """The longest part of ``[start, end]`` not blocked receiving (where an action's label goes)."""
    cuts = sorted((max(s, start), min(e, end)) for s, e in receives if s < end and e > start)
    parts, at = [], start
    for s, e in cuts:
        parts.append((at, s))
        at = max(at, e)
    parts.append((at, end))
    return max(parts, key=lambda p: p[1] - p[0])


def measured_bubble(record: Record) -> float:
    """Idle fraction over the recorded step, mean over ranks: time not in an action, or blocked receiving in one."""
    bubbles = []
    for r in record["ranks"]:
        spans = [(a[3], a[4]) for a in r["actions"]] + [(c[-2], c[-1]) for c in r["comms"]]
        if not spans:
            continue
        busy = sum(end - start for _, _, _, start, end in r["actions"])
        busy -= sum(c[-1] - c[-2] for c in r["comms"] if c[0] == "receive")
        first, (_, end) = min(s for s, _ in spans), _waits(record)[r["rank"]]
        bubbles.append(1.0 - busy / (end - first) if end > first else 0.0)
    return sum(bubbles) / max(len(bubbles), 1)


def chrome_trace(records: list[Record]) -> dict[str, Any]:
    """The Chrome trace of the recorded steps: one track (``tid``) per rank in one process; times in microseconds,
    each rank's from its clock at the step's barrier, the recorded steps one after the other."""
    us = lambda t: round(t * 1e6, 3)  # noqa: E731
    events: list[dict[str, Any]] = [{"name": "process_name", "ph": "M", "pid": 0,
                                     "args": {"name": "lightning_tpp pipeline"}}]
    for r in records[0]["ranks"] if records else []:
        c = r["coords"]
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": r["rank"],
                       "args": {"name": f"rank {r['rank']} (pp {c['pp']}, tp {c['tp']}, dp {c['dp']})"}})
        events.append({"name": "thread_sort_index", "ph": "M", "pid": 0, "tid": r["rank"],
                       "args": {"sort_index": r["rank"]}})
    offset = 0.0
    for record in records:
        waits = _waits(record)
        base = offset
        for r in record["ranks"]:
            rank = r["rank"]

            def span(name: str, cat: str, start: float, end: float, args: dict[str, Any]) -> None:
                ts = us(base + start)
                events.append({"name": name, "cat": cat, "ph": "X", "pid": 0, "tid": rank, "ts": ts,
                               "dur": max(us(base + end) - ts, 0.0), "args": {"step": record["step"], **args}})

            for kind, mb, stage, start, end in r["actions"]:
                span(f"{kind}{mb}", kind, start, end, {"stage": stage, "microbatch": mb})
            for direction, what, mb, src, dst, peer, start, end in r["comms"]:
                arrow = f"from stage {src}" if direction == "receive" else f"to stage {dst}"
                span(f"{direction} {what} {mb} {arrow}", direction, start, end,
                     {"microbatch": mb, "what": what, "from_stage": src, "to_stage": dst, "peer_rank": peer})
            if rank in waits and waits[rank][1] > waits[rank][0]:
                span("wait", "wait", *waits[rank], {})
        offset = base + max((end for _, end in waits.values()), default=0.0) * 1.05 + 1e-3
    return {"traceEvents": events, "displayTimeUnit": "ms",
            "otherData": {"producer": "lightning_tpp.PipelineTimeline"}}


def draw(records: list[Record], path: str | os.PathLike[str]) -> None:
    """``timeline.png``: one panel per recorded step, one row per rank; micro-batch numbers on the actions."""
    FigureCanvasAgg = require("matplotlib.backends.backend_agg", **_PNG).FigureCanvasAgg
    Figure = require("matplotlib.figure", **_PNG).Figure
    Patch = require("matplotlib.patches", **_PNG).Patch
    world = max(len(r["ranks"]) for r in records)
    fig = Figure(figsize=(12, 0.9 + len(records) * (0.35 * world + 0.9)), dpi=110)
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(records), 1, squeeze=False)[:, 0]
    for ax, record in zip(axes, records):
        waits = _waits(record)
        length = max((end for _, end in waits.values()), default=1.0) * 1e3
        for row, r in enumerate(record["ranks"]):
            y = world - 1 - row
            receives = [(c[-2], c[-1]) for c in r["comms"] if c[0] == "receive"]
            for kind, mb, stage, start, end in r["actions"]:
                ax.barh(y, (end - start) * 1e3, left=start * 1e3, height=0.8, color=COLORS[kind],
                        edgecolor="white", linewidth=0.5)
                left, right = _unblocked(start, end, receives)
                if (right - left) * 1e3 > length / 60:
                    label = f"{mb}" if record["virtual"] == 1 else f"{mb}.{stage}"
                    ax.text((left + right) / 2 * 1e3, y, label, ha="center", va="center", fontsize=7, color="white")
            for direction, *_, start, end in r["comms"]:
                if direction == "receive":
                    ax.barh(y, (end - start) * 1e3, left=start * 1e3, height=0.8, color=COLORS["receive"],
                            hatch="///", edgecolor="white", linewidth=0)
                else:
                    ax.barh(y + 0.36, max((end - start) * 1e3, length / 800), left=start * 1e3, height=0.08,
                            color=COLORS["send"], linewidth=0)
            if r["rank"] in waits:
                first, last = waits[r["rank"]]
                ax.barh(y, (last - first) * 1e3, left=first * 1e3, height=0.8, color=COLORS["wait"], hatch="..",
                        edgecolor="#C8C8C8", linewidth=0)
        ax.set_yticks(range(world))
        ax.set_yticklabels([f"rank {r['rank']} (pp {r['coords']['pp']})" for r in reversed(record["ranks"])],
                           fontsize=8)
        ax.set_xlim(0, length * 1.01)
        ax.set_xlabel("ms from the step's start", fontsize=8)
        ax.tick_params(axis="x", labelsize=8)
        v = f", virtual_stages={record['virtual']}" if record["virtual"] > 1 else ""
        ax.set_title(f"{record['schedule']}, pp={record['pp']}, microbatches={record['microbatches']}{v}: step "
                     f"{record['step']}, measured bubble {measured_bubble(record):.0%}", fontsize=9, loc="left")
    kinds = [k for k in ("F", "B", "I", "W") if any(a[0] == k for rec in records for r in rec["ranks"]
                                                    for a in r["actions"])]
    handles = [Patch(color=COLORS[k], label=k) for k in kinds]
    handles += [Patch(facecolor=COLORS["receive"], hatch="///", edgecolor="white", label="blocked receiving"),
                Patch(color=COLORS["send"], label="send"),
                Patch(facecolor=COLORS["wait"], hatch="..", edgecolor="#C8C8C8", label="wait (pipeline not done)")]
    fig.legend(handles=handles, loc="lower center", ncol=len(handles), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 if len(records) == 1 else 0.03, 1, 1))
    fig.savefig(path)
