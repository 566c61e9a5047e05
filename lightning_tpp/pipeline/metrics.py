"""Pipeline metrics through Lightning's loggers: where a step's time goes, measured, beside the schedule's theory.

Every rank times its own schedule (``executor.StepTimes``: two ``perf_counter`` reads per action and per message).
On a logging step (Lightning's rule: every ``log_every_n_steps`` optimizer steps) one all-gather of a few numbers per
rank gives every rank the same values, which each logs with the module's own ``self.log`` from the strategy's
``training_step`` (after the pipeline's logging adapter has replayed the user's values): any logger (CSV,
TensorBoard, W&B ...) gets them in the row of that step, and ``trainer.callback_metrics`` holds them on every rank.
Other steps cost no communication at all. ::

    pipeline rank r, one step:
      |-- compute --|recv|-- compute --|send|-- compute --| ... |send|            |
      first action starts                    its last send completes   the pipeline's longest rank ends: T

    pipeline/bubble                  idle fraction of the step, mean over every rank: (recv + wait) / T
    pipeline/bubble_theory           the schedule simulator's idle fraction for this schedule, pp, micro-batches and
                                     virtual stages, with the step's measured mean F, B, I and W compute times on
                                     every stage and no time in messages (measured above theory: messages, stage
                                     imbalance, a slow rank)
    pipeline/imbalance               max / mean of the pipeline ranks' compute (1.0: perfectly balanced)
    pipeline/pp{r}/compute|send|recv|wait   seconds of the step on pipeline rank r (its stages r, r + pp, ...;
                                     mean over its tp and dp replicas); wait = T - the rank's own span
    pipeline/step_time               T, the schedule's makespan in seconds (mean over dp replicas)
    pipeline/samples_per_sec         samples of every dp replica since the last logging step / the wall time
    pipeline/tokens_per_sec          the same for tokens: the elements of the batch's first integer tensor with two
                                     or more dimensions (token ids), when it has one

T is each pipeline's longest rank span: no clock is compared across ranks (or machines).
"""

from __future__ import annotations

import time
from collections import defaultdict
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tpp._compat import tree_flatten
from lightning_tpp.pipeline.microbatch import batch_size
from lightning_tpp.pipeline.schedule import ScheduleConfigError, simulate

if TYPE_CHECKING:
    from lightning_tpp.pipeline.engine import PipelineEngine

PREFIX = "pipeline/"
# what each rank contributes to the all-gather on a logging step
_PP, _PIPELINE, _COUNTS, _SPAN, _SEND, _RECV, _SAMPLES, _TOKENS, _ELAPSED = range(9)
_KINDS = "FBIW"  # then each kind's compute seconds and actions
_WIDTH = 9 + 2 * len(_KINDS)


def tokens_in(batch: Any) -> int:
    """The elements of the batch's first integer tensor with two or more dimensions (token ids), else 0."""
    for leaf in tree_flatten(batch)[0]:
        if isinstance(leaf, Tensor) and leaf.dim() >= 2 and not leaf.is_floating_point() and not leaf.is_complex():
            return leaf.numel()
    return 0


def is_logging_step(trainer: Any, batch_idx: Optional[int]) -> bool:
    """Lightning's own rule (its logger connector's ``should_update_logs`` after an optimizer step), from public
    attributes, as seen inside ``training_step``: under a pipeline optimization is automatic with one optimizer, so
    ``global_step`` counts the batches that stepped. ``batch_idx``: ``None`` when the step takes no index."""
    if not trainer.loggers or trainer.log_every_n_steps == 0:
        return False
    if not isinstance(batch_idx, int):
        batch_idx = trainer.fit_loop.epoch_loop.batch_idx
    final = batch_idx + 1 == trainer.num_training_batches
    if (batch_idx + 1) % trainer.accumulate_grad_batches and not final:
        return False  # accumulating: Lightning logs nothing for this batch
    # not Lightning's `or trainer.should_stop`: a callback may set it on one rank only before Lightning reduces it,
    # and this decision starts a collective that every rank must join
    return (trainer.global_step + 1) % trainer.log_every_n_steps == 0 or bool(trainer.fast_dev_run)


class PipelineMetrics:
    """Counts samples every step; on logging steps gathers every rank's step times and logs the ``pipeline/``
    values (see the module docstring).

    Args:
        engine: this rank's pipeline engine.
        coords: this rank's ``{"dp", "pp", "tp"}`` coordinates; ``tp``: the tensor-parallel size.
        group: the process group over every rank (``None``: the default group).
    """

    def __init__(self, engine: PipelineEngine, *, coords: dict[str, int], tp: int,
                 group: Optional[dist.ProcessGroup] = None) -> None:
        self.engine, self.group = engine, group
        self.pp_rank = coords["pp"]
        self.pipeline = coords["dp"] * tp + coords["tp"]  # ranks with the same dp and tp coordinates: one pipeline
        self.counts = coords["pp"] == 0 and coords["tp"] == 0  # one rank per dp replica counts its samples
        self._samples = self._tokens = 0
        self._since: Optional[float] = None
        self._theory: dict[int, float] = {}

    def after_step(self, module: Any, batch: Any, batch_idx: Optional[int]) -> None:
        """Called at the end of the strategy's ``training_step`` on every rank."""
        times = self.engine.times
        if times is None:
            return
        if self._since is None:
            self._since = times.start
        self._samples += batch_size(batch)
        self._tokens += tokens_in(batch)
        if is_logging_step(module.trainer, batch_idx):
            module.log_dict(self.gather(), on_step=True, on_epoch=False, prog_bar=False, logger=True)

    def gather(self) -> dict[str, float]:
        """One all-gather of this rank's numbers; every rank returns the same values."""
        times = self.engine.times
        assert times is not None and self._since is not None
        now = time.perf_counter()
        row = [0.0] * _WIDTH
        row[_PP], row[_PIPELINE], row[_COUNTS] = self.pp_rank, self.pipeline, float(self.counts)
        row[_SPAN], row[_SEND], row[_RECV] = times.span, times.send, times.recv
        row[_SAMPLES], row[_TOKENS], row[_ELAPSED] = self._samples, self._tokens, now - self._since
        for k, kind in enumerate(_KINDS):
            row[9 + 2 * k], row[10 + 2 * k] = times.costs.get(kind, (0.0, 0))
        mine = torch.tensor(row, dtype=torch.float64, device=self.engine.runtime.device)
        every = [torch.empty_like(mine) for _ in range(dist.get_world_size(self.group))]
        dist.all_gather(every, mine, group=self.group)
        self._samples = self._tokens = 0
        self._since = now
        rows = torch.stack(every).cpu().tolist()
        values = summarize(rows, self.engine.pp)
        values[PREFIX + "bubble_theory"] = self.theory(times.microbatches, simulator_costs(rows))
        return values

    def theory(self, microbatches: int, costs: dict[str, float]) -> float:
        """The simulator's mean idle fraction for the schedule that ran (GPipe for a short batch the schedule cannot
        take, as the engine does) with ``costs`` (:func:`simulator_costs`, rounded: computed once per value)."""
        key = (microbatches, *costs.values())
        if key not in self._theory:
            engine = self.engine
            try:
                bubble = simulate(engine.schedule, engine.pp, microbatches, engine.virtual, **costs).bubble
            except ScheduleConfigError:
                bubble = simulate("gpipe", engine.pp, microbatches, **costs).bubble
            self._theory[key] = sum(bubble) / len(bubble)
        return self._theory[key]


def simulator_costs(rows: list[list[float]]) -> dict[str, float]:
    """The simulator's arguments from the actions' mean compute times over every rank, relative to a forward
    (two decimals): ``b`` a whole backward (``I + W`` where none ran whole), ``w_share`` W's part of it,
    ``split_cost`` what ``I + W`` take beyond ``B``. Forward 1, backward 2 where a kind did not run."""
    means = {}
    for k, kind in enumerate(_KINDS):
        total, count = sum(r[9 + 2 * k] for r in rows), sum(r[10 + 2 * k] for r in rows)
        if count:
            means[kind] = total / count
    f = means.get("F", 0.0)
    if f <= 0:
        return {"f": 1.0, "b": 2.0, "w_share": 0.5, "split_cost": 0.0}
    b, split, w_share = means.get("B", 2 * f), 0.0, 0.5
    if "I" in means and "W" in means:
        whole = means["I"] + means["W"]
        b = means.get("B", whole)
        split = max(whole - b, 0.0)
        w_share = min(max((means["W"] - split / 2) / b, 0.0), 1.0) if b > 0 else 0.5
    return {"f": 1.0, "b": round(b / f, 2), "w_share": round(w_share, 2), "split_cost": round(split / f, 2)}


def summarize(rows: list[list[float]], pp: int) -> dict[str, float]:
    """The logged values from every rank's gathered row (a pure function: tested in one process)."""
    makespan: dict[int, float] = defaultdict(float)
    for row in rows:
        makespan[int(row[_PIPELINE])] = max(makespan[int(row[_PIPELINE])], row[_SPAN])
    per_rank: dict[int, list[tuple[float, float, float, float]]] = defaultdict(list)
    bubbles = []
    for row in rows:
        t = makespan[int(row[_PIPELINE])]
        span, send, recv = row[_SPAN], row[_SEND], row[_RECV]
        compute = max(span - send - recv, 0.0)
        per_rank[int(row[_PP])].append((compute, send, recv, t - span))
        bubbles.append(1.0 - (compute + send) / t if t > 0 else 0.0)
    values = {PREFIX + "bubble": sum(bubbles) / len(bubbles),
              PREFIX + "step_time": sum(makespan.values()) / len(makespan)}
    computes = []
    for r in range(pp):
        parts = per_rank.get(r, [])
        means = [sum(p[k] for p in parts) / max(len(parts), 1) for k in range(4)]
        computes.append(means[0])
        for name, value in zip(("compute", "send", "recv", "wait"), means):
            values[f"{PREFIX}pp{r}/{name}"] = value
    mean = sum(computes) / len(computes)
    values[PREFIX + "imbalance"] = max(computes) / mean if mean > 0 else 1.0
    elapsed = max(row[_ELAPSED] for row in rows)
    counted = [row for row in rows if row[_COUNTS]]
    if elapsed > 0:
        values[PREFIX + "samples_per_sec"] = sum(row[_SAMPLES] for row in counted) / elapsed
        tokens = sum(row[_TOKENS] for row in counted)
        if tokens:
            values[PREFIX + "tokens_per_sec"] = tokens / elapsed
    return values
