"""Run a pipeline schedule inside the Trainer's step: the facade the strategy drives, composed of three parts::

    PipelineEngine.train_step
      split_batch, this rank's actions (schedule)      which micro-batches, in which order
      Executor.routes / .run                           F / B / I / W on this rank's chunks      (executor)
      Transport                                        activations, gradients, headers, loss    (transport)
      GradientParking.schedule                         .grad kept across Lightning's zero_grad  (parking)
      DeferredStatistics.begin / .commit               BatchNorm running statistics, once per step (batchnorm)

The logging adapter the strategy wraps around a step (``captured_logs``, ``replay_logs``) lives in ``logging``.

``schedule="auto"``: the first :data:`AUTO_STEPS` full-size steps run ``auto.AUTO_MEASURE`` (zb-drain: it times
``F`` and ``B`` on every rank, ``I`` and ``W`` on the others), all but the first measured (each kind's mean per
action over them, and how much the ``F`` and ``B`` actions varied); one all-gather over every rank gives each the
same per-stage costs and variation, with which each simulates the candidates and takes the same schedule for the
steps after (``choice``; logged once). A switch happens between steps, where no micro-batch state is alive.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_tpp._compat import tree_map
from lightning_tpp.pipeline.batchnorm import DeferredStatistics
from lightning_tpp.pipeline.errors import PipelineError
from lightning_tpp.pipeline.executor import COST_KINDS, Executor, Step, StepTimes, Trace
from lightning_tpp.pipeline.microbatch import batch_size, split_batch
from lightning_tpp.pipeline.logging import captured_logs, load_metric_state, metric_state, replay_logs
from lightning_tpp.pipeline.parking import GradientParking
from lightning_tpp.pipeline.partition import Partition
from lightning_tpp.pipeline.auto import AUTO, AUTO_MEASURE, AutoChoice, choose_schedule, costs_from_times, settle_auto
from lightning_tpp.pipeline.schedule import Action, Schedule, actions
from lightning_tpp.pipeline.stage import StageRuntime
from lightning_tpp.pipeline.transport import CommSpan, Transport

__all__ = ["PipelineEngine", "PipelineError", "captured_logs", "load_metric_state", "metric_state", "replay_logs",
           "split_batch"]

AUTO_STEPS = 3  # schedule="auto": a warm-up step, then measured ones, before choosing


class PipelineEngine:
    """This rank's part of one pipeline.

    Args:
        module: the LightningModule, with this rank's units real (``build.finish_stages``).
        partition, runtime: the stages and the dispatch state of their units.
        rank, pp, virtual: this rank's pp coordinate, the pipeline's ranks, the chunks per rank.
        schedule, microbatches: a registered schedule name, ``"auto"`` or a ``Schedule``, and micro-batches per
            step. ``schedule`` is what runs (under ``"auto"``: what measures, then what was chosen), ``requested``
            what was asked for, ``choice`` what ``"auto"`` chose and why (``None`` before).
        group: the pipeline's process group; ``stage_rank``: pp rank -> global rank (same dp and tp coordinates).
        chunk_params: each local chunk's trainable parameters; ``tied``: shared parameters and their groups.
        ancestor_params: parameters of the model itself used before the blocks (first stage).
    """

    def __init__(self, module: nn.Module, partition: Partition, runtime: StageRuntime, *, rank: int, pp: int,
                 virtual: int, schedule: str | Schedule, microbatches: int, group: Optional[ProcessGroup],
                 stage_rank: Callable[[int], int], chunk_params: list[list[nn.Parameter]],
                 tied: list[tuple[nn.Parameter, Optional[ProcessGroup]]], ancestor_params: tuple[str, ...] = ()
                 ) -> None:
        self.module, self.partition, self.runtime = module, partition, runtime
        self.rank, self.pp, self.virtual = rank, pp, virtual
        self.requested = schedule
        self._auto_steps: int = 0  # full-size steps run so far while "auto" measures
        self._auto_moments: dict[str, tuple[int, float, float]] = {}  # kind -> (actions, seconds, squared seconds)
        self.choice: Optional[AutoChoice] = settle_auto(pp, microbatches, virtual) if schedule == AUTO else None
        if schedule == AUTO:
            schedule = self.choice.schedule if self.choice else AUTO_MEASURE
        self.schedule, self.microbatches = schedule, microbatches
        self.group, self.stage_rank = group, stage_rank
        self.chunk_params, self.tied, self.ancestor_params = chunk_params, tied, ancestor_params
        self.transport = Transport(group, stages=partition.stages, pp=pp, stage_rank=stage_rank,
                                   device=runtime.device)
        self.last_rank = self.transport.last_rank
        self.executor = Executor(module, partition, runtime, self.transport, rank=rank, pp=pp, virtual=virtual,
                                 ancestor_params=ancestor_params)
        self.parking = GradientParking([p for chunk in chunk_params for p in chunk], tied)
        self.order = actions(schedule, rank, pp, microbatches, virtual)
        if self.choice is not None:  # "auto" where the layout alone decides
            rank_zero_info(self.choice.describe())
        # around a schedule: how gradients sharded over dp are reduced (FSDP2: per backward, or once at the end)
        self.reduction: Callable[[], ContextManager[None]] = contextlib.nullcontext
        # batch normalisation of this rank: running statistics committed once per step (``batchnorm``)
        self.batch_statistics: Optional[DeferredStatistics] = None

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule adds weight gradients after their backward (zero-bubble ``I``/``W``), or may once
        ``"auto"`` has chosen (read at setup: FSDP2 reduction at the end of a schedule that splits)."""
        return self.deciding or any(kind in ("I", "W") for kind, _, _ in self.order)

    @property
    def deciding(self) -> bool:
        """``schedule="auto"`` still measures."""
        return self.requested == AUTO and self.choice is None

    def rekey(self, replaced: Mapping[int, nn.Parameter]) -> None:
        """Follow parameters that were replaced by new objects (FSDP2 wraps each in a DTensor)."""
        self.chunk_params = [[replaced.get(id(p), p) for p in chunk] for chunk in self.chunk_params]
        self.tied = [(replaced.get(id(p), p), group) for p, group in self.tied]
        self.parking = GradientParking([p for chunk in self.chunk_params for p in chunk], self.tied)

    @property
    def trace(self) -> Optional[Trace]:
        return self.executor.trace

    @property
    def comm_trace(self) -> Optional[list[CommSpan]]:
        return self.transport.spans

    def record_trace(self, enabled: bool = True) -> None:
        """Record ``(kind, microbatch, chunk, start, end, seconds waiting for peers)`` per action (perf_counter) in
        ``trace``, and each send and blocking receive in ``comm_trace`` (``transport.CommSpan``)."""
        self.executor.trace = [] if enabled else None
        self.transport.spans = [] if enabled else None

    @property
    def times(self) -> Optional[StepTimes]:
        """Where the last schedule's time went on this rank."""
        return self.executor.times

    @property
    def position(self) -> Optional[Action]:
        return self.executor.position

    @property
    def holds_last(self) -> bool:
        return self.executor.holds_last

    def describe_position(self) -> str:
        return self.executor.describe_position()

    def describe_activity(self) -> str:
        """For the hang report: the action this rank runs and the message it is blocked on, e.g. 'in pipeline stage
        0, backward of micro-batch 3; waiting 4.2 s to receive the gradients of micro-batch 3 from stage 1 (rank
        1)'. Read from another thread: two attributes that the executor and the transport set as they go."""
        where = self.executor.describe_position().strip() or "not in a pipeline action"
        blocked = self.transport.describe_blocked()
        return f"{where}; {blocked}" if blocked else where

    def train_step(self, step: Step, batch: Any, *, loss_scale: float, stale_grads: bool = False) -> Tensor:
        """Run the schedule over ``batch``; returns the mean micro-batch loss (the same tensor value on every stage).
        ``stale_grads``: the gradients the parameters hold will be zeroed after this step (freed before it)."""
        micro, shares = split_batch(batch, min(self.microbatches, batch_size(batch)))
        if self.batch_statistics is not None:
            self.batch_statistics.begin(batch_size(batch), len(micro))
        order = self._order(len(micro))
        routes = self.executor.routes("training_step", step, micro[0])
        self.transport.post_headers(self.executor.inbound(routes), len(micro))
        # under "auto" the order may or may not split: the end-of-schedule reduction only where it does
        splits = self.requested != AUTO or any(kind in ("I", "W") for kind, _, _ in order)
        with self.parking.schedule(stale=stale_grads), (self.reduction if splits else contextlib.nullcontext)():
            total = self.executor.run(order, step, micro, routes, shares, loss_scale)
        if self.batch_statistics is not None:
            self.batch_statistics.commit()
        if self.deciding and len(micro) == self.microbatches:
            self._auto_steps += 1
            if self._auto_steps > 1:  # the first warms up
                self._add_measured()
            if self._auto_steps >= AUTO_STEPS:
                self._choose()
        return self.transport.broadcast_from_last(total)

    def _add_measured(self) -> None:
        """Add this measured step's action times: per kind, the actions, their seconds and squared seconds. Their
        means over the measured steps are the costs (not each kind's fastest step: the kinds a rank runs only a few
        of, ``I`` and ``W``, would come out lowest by chance and make splitting look cheap)."""
        times = self.executor.times
        assert times is not None
        for kind, (total, count) in times.costs.items():
            if count:
                n, seconds, squares = self._auto_moments.get(kind, (0, 0.0, 0.0))
                self._auto_moments[kind] = (n + count, seconds + total, squares + times.squares.get(kind, 0.0))

    def _jitter(self) -> float:
        """How much this rank's ``F`` and ``B`` actions varied over the measured steps: the coefficient of variation
        of each kind, weighted by its actions."""
        spread, weight = 0.0, 0
        for kind in "FB":
            n, seconds, squares = self._auto_moments.get(kind, (0, 0.0, 0.0))
            if n > 1 and seconds > 0:
                mean = seconds / n
                spread += n * max(squares / n - mean * mean, 0.0) ** 0.5 / mean
                weight += n
        return spread / weight if weight else 0.0

    def _choose(self) -> None:
        """``schedule="auto"``: from the measured action times of every rank and how much they varied (one
        all-gather over all of them, so that every pipeline, and every tp and dp replica, switches alike), simulate
        the candidates, switch."""
        costs = {kind: (seconds, n) for kind, (n, seconds, _) in self._auto_moments.items()}
        row = [float(self.rank)] + [x for kind in COST_KINDS for x in costs.get(kind, (0.0, 0))] + [self._jitter()]
        mine = torch.tensor(row, dtype=torch.float64, device=self.runtime.device)
        if dist.is_available() and dist.is_initialized():
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            rows = torch.stack(every).cpu().tolist()
        else:
            rows = [row]
        measured = [{kind: (sum(r[1 + 2 * k] for r in rows if int(r[0]) == p),
                            int(sum(r[2 + 2 * k] for r in rows if int(r[0]) == p)))
                     for k, kind in enumerate(COST_KINDS)}
                    for p in range(self.pp)]  # summed over the replicas of each pp rank: their mean per action
        jitter = sum(r[-1] for r in rows) / len(rows)  # every rank's, alike
        self.settle(choose_schedule(self.pp, self.microbatches, costs_from_times(measured), jitter=jitter))

    def settle(self, choice: AutoChoice) -> None:
        """``schedule="auto"``: run ``choice`` from the next step on, and say so."""
        self.choice = choice
        self.switch(choice.schedule)
        rank_zero_info(choice.describe())

    def switch(self, schedule: str | Schedule) -> None:
        """Run ``schedule`` from the next step on (between steps, where no micro-batch state is alive; every rank of
        the pipeline must switch alike). ``benchmarks/pipeline.py`` alternates schedules step by step with it."""
        self.order = actions(schedule, self.rank, self.pp, self.microbatches, self.virtual)
        self.schedule = schedule

    def _order(self, m: int) -> list[Action]:
        """This rank's actions for ``m`` micro-batches: the configured schedule, or GPipe for a short batch (an
        epoch's last) that has fewer samples than the schedule needs. Every rank sees the same batch size."""
        if m == self.microbatches:
            return self.order
        try:
            return actions(self.schedule, self.rank, self.pp, m, self.virtual)
        except ValueError:
            if self.virtual > 1:
                raise PipelineError(f"a batch of {m} samples cannot run the interleaved schedule (needs a multiple of "
                                    f"pp={self.pp} micro-batches): use drop_last=True") from None
            return actions("gpipe", self.rank, self.pp, m)

    def discard_grads(self) -> None:
        self.parking.discard()

    def restore_grads(self) -> None:
        """Add the gradients of the last schedule back (after Lightning's ``zero_grad``)."""
        self.parking.restore()

    def eval_step(self, step: Step, batch: Any, kind: str) -> Any:
        """Forward only, micro-batched as training is so that the stages work at once (``Executor.run_eval``); the
        last stage's result (the micro-batches' put together) on every rank."""
        result = self.executor.run_eval(step, batch, kind, self.microbatches)
        result = self.transport.broadcast_object_from_last(
            tree_map(lambda t: t.detach().cpu() if isinstance(t, Tensor) else t, result))
        return tree_map(lambda t: t.to(self.runtime.device) if isinstance(t, Tensor) else t, result)

    def broadcast_from_last(self, value: Tensor) -> Tensor:
        return self.transport.broadcast_from_last(value)
