"""Run a pipeline schedule inside the Trainer's step: the facade the strategy drives, composed of three parts::

    PipelineEngine.train_step
      split_batch, this rank's actions (schedule)      which micro-batches, in which order
      Executor.routes / .run                           F / B / I / W on this rank's chunks      (executor)
      Transport                                        activations, gradients, headers, loss    (transport)
      GradientParking.schedule                         .grad kept across Lightning's zero_grad  (parking)

The logging adapter the strategy wraps around a step (``captured_logs``, ``replay_logs``) lives in ``logging``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, ContextManager, Mapping, Optional

from torch import Tensor, nn
from torch.distributed import ProcessGroup

from lightning_tpp._compat import tree_map
from lightning_tpp.pipeline.errors import PipelineError
from lightning_tpp.pipeline.executor import Executor, Step, StepTimes, Trace, batch_size, split_batch
from lightning_tpp.pipeline.logging import captured_logs, load_metric_state, metric_state, replay_logs
from lightning_tpp.pipeline.parking import GradientParking
from lightning_tpp.pipeline.partition import Partition
from lightning_tpp.pipeline.schedule import Action, Schedule, actions
from lightning_tpp.pipeline.stage import StageRuntime
from lightning_tpp.pipeline.transport import CommSpan, Transport

__all__ = ["PipelineEngine", "PipelineError", "captured_logs", "load_metric_state", "metric_state", "replay_logs",
           "split_batch"]


class PipelineEngine:
    """This rank's part of one pipeline.

    Args:
        module: the LightningModule, with this rank's units real (``build.finish_stages``).
        partition, runtime: the stages and the dispatch state of their units.
        rank, pp, virtual: this rank's pp coordinate, the pipeline's ranks, the chunks per rank.
        schedule, microbatches: a registered schedule name or a ``Schedule``, and micro-batches per step.
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
        # around a schedule: how gradients sharded over dp are reduced (FSDP2: per backward, or once at the end)
        self.reduction: Callable[[], ContextManager[None]] = contextlib.nullcontext

    @property
    def splits_backward(self) -> bool:
        """Whether the schedule adds weight gradients after their backward (zero-bubble ``I``/``W``)."""
        return any(kind in ("I", "W") for kind, _, _ in self.order)

    def rekey(self, replaced: Mapping[int, nn.Parameter]) -> None:
        """Follow parameters that were replaced by new objects (FSDP2 wraps each in a DTensor)."""
        self.chunk_params = [[replaced.get(id(p), p) for p in chunk] for chunk in self.chunk_params]
        self.tied = [(replaced.get(id(p), p), group) for p, group in self.tied]
        self.parking = GradientParking([p for chunk in self.chunk_params for p in chunk], self.tied)

    @property
    def _early(self) -> bool:
        """Receives posted ahead (gloo); ``False`` is NCCL's in-posting-order path (tests/parity.py sets it)."""
        return self.transport.early

    @_early.setter
    def _early(self, value: bool) -> None:
        self.transport.early = value

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
        order = self._order(len(micro))
        routes = self.executor.routes("training_step", step, micro[0])
        self.transport.post_headers(self.executor.inbound(routes), len(micro))
        with self.parking.schedule(stale=stale_grads), self.reduction():
            total = self.executor.run(order, step, micro, routes, shares, loss_scale)
        return self.transport.broadcast_from_last(total)

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
