"""Predicted seconds of one optimizer step of a layout, from the profile, the block times and the links.

What it adds up (per pipeline rank; a step is ``accumulate`` pipeline runs of ``microbatches`` micro-batches)::

    action F of a stage   its blocks' forward (timed on the device at tp = 1, divided by tp for the FLOPs the plan
                          cuts) + the ends' (their FLOPs at the blocks' measured rate) + tp all-reduces of the
                          residual stream (2 per block: attention, MLP) + the send to the next stage
    action B              twice the forward's compute (timed), as many all-reduces, one more forward with
                          activation checkpointing (recompute), the send back
    pipeline run          the schedule simulator (``pipeline.schedule.simulate``) on those per-rank costs: the
                          bubble comes from the schedule's own action lists
    FSDP2 (dp sharded)    per micro-batch: all-gather of the stage's parameters for forward (again for backward
                          under full_shard), reduce-scatter of its gradients; ``overlap`` of it hidden by compute
    dp all-reduce         (no_shard) the stage's gradients once per step, ``overlap`` of it hidden
    optimizer             the rank's parameters and states read and written once, at memory bandwidth

Assumptions: tp all-reduces and pipeline sends are not overlapped with compute (Megatron's defaults, and gloo's);
FSDP2's and dp's collectives overlap by ``DeviceSpec.overlap`` (0 for gloo, which runs on the compute cores) of
what they share with compute (``overlap x min(communication, compute)`` is hidden);
compute of a micro-batch is linear in its sequences above the measured sizes; a tp rank computes 1/tp of what the
plan cuts at the measured rate (no loss of efficiency from smaller matmuls: an optimistic bias for large tp).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Mapping, Optional

from lightning_tpp.layout.links import DeviceSpec, Link
from lightning_tpp.layout.memory import stage_blocks
from lightning_tpp.layout.plan import Layout
from lightning_tpp.layout.profile import BlockProfile, ModelProfile
from lightning_tpp.pipeline.schedule import simulate


@dataclass(frozen=True)
class BlockTimes:
    """Forward and backward seconds of one block at tp = 1: timed on the device (``measured``: (kind, sequences
    per micro-batch) -> (forward, backward)), else its FLOPs at ``DeviceSpec.flops * efficiency``. ``slowdown``
    scales timed figures for processes that share the cores they were timed on alone."""

    measured: Mapping[tuple[str, int], tuple[float, float]] = field(default_factory=dict)
    slowdown: float = 1.0

    def block(self, block: BlockProfile, mb: float, tp: int, device: DeviceSpec) -> tuple[float, float]:
        share = block.flops.at(tp) / block.flops.whole if block.flops.whole else 1.0 / tp
        timed = self._timed(block.kind, mb)
        if timed is not None:
            return timed[0] * share * self.slowdown, timed[1] * share * self.slowdown
        f = block.flops.at(tp) * mb / (device.flops * device.efficiency)
        return f, 2 * f

    def rate(self, profile: ModelProfile, device: DeviceSpec) -> float:
        """FLOPs per second the timed blocks reached (the ends are timed at it), else the device's assumed rate."""
        for block in profile.blocks:
            timed = self._timed(block.kind, 1)
            if timed is not None and timed[0] > 0:
                return block.flops.whole / (timed[0] * self.slowdown)
        return device.flops * device.efficiency

    def _timed(self, kind: str, mb: float) -> Optional[tuple[float, float]]:
        sizes = sorted(s for k, s in self.measured if k == kind)
        if not sizes:
            return None
        size = max([s for s in sizes if s <= mb] or sizes[:1])  # the largest timed size not above mb, scaled
        f, b = self.measured[(kind, size)]
        return f * mb / size, b * mb / size


@dataclass(frozen=True)
class StepTime:
    """A step's predicted seconds, by part (``pipeline`` includes the bubble; ``bubble`` is its idle share)."""

    pipeline: float
    bubble: float
    fsdp: float
    dp: float
    optimizer: float
    samples: int

    @property
    def total(self) -> float:
        return self.pipeline + self.fsdp + self.dp + self.optimizer

    @property
    def per_sample(self) -> float:
        return self.total / self.samples


def _links(layout: Layout, device: DeviceSpec) -> tuple[Link, Link, Link]:
    """tp, pp and dp links: tp within a node; pp while tp x pp fit in a node; dp while the whole mesh does."""
    node = device.devices_per_node
    pp = device.intra if layout.tp * layout.pp <= node else device.inter
    dp = device.intra if layout.world <= node else device.inter
    return device.intra, pp, dp


def step_time(profile: ModelProfile, layout: Layout, device: DeviceSpec, times: BlockTimes, *, batch: int,
              optimizer_states: int = 2) -> StepTime:
    """Seconds of one optimizer step of ``layout`` on per-process batches of ``batch`` sequences."""
    tp, pp, m = layout.tp, layout.pp, layout.microbatches
    mb = batch / m
    tp_link, pp_link, dp_link = _links(layout, device)
    hidden = profile.sent * mb  # the residual stream of a micro-batch, in bytes
    reduce = tp_link.all_reduce(hidden, tp)
    send = pp_link.p2p(hidden) if pp > 1 else 0.0
    rate = times.rate(profile, device)
    costs = tuple(b.params.whole for b in profile.blocks)
    bounds = stage_blocks(costs, pp, profile.first_params.whole, profile.last_params.whole) if pp > 1 else \
        ((0, profile.n_blocks),)
    per_rank, stage_params = [], []
    for r, (a, b) in enumerate(bounds):
        f = bwd = 0.0
        for block in profile.blocks[a:b]:
            bf, bb = times.block(block, mb, tp, device)
            comm = block.reductions * reduce
            f += bf + comm
            bwd += bb + comm + (bf + comm if layout.activation_checkpointing else 0.0)
        params = sum(x.params.at(tp) for x in profile.blocks[a:b])
        if r == 0:
            params += profile.first_params.at(tp)
        if r == pp - 1:
            params += profile.last_params.at(tp)
            ends = profile.end_flops.at(tp) * mb / rate + profile.vocab_reductions * reduce
            f, bwd = f + ends, bwd + 2 * ends
        per_rank.append((f + send, bwd + send))
        stage_params.append(params * profile.dtype_bytes)
    run, busy = _pipeline(layout.schedule, pp, m, tuple(per_rank))
    compute = max(m * (f + b) for f, b in per_rank) * layout.accumulate  # what FSDP2/dp traffic can hide behind
    largest = max(stage_params)
    fsdp = dp = 0.0
    if layout.sharded:
        gathers = 2 if layout.dp_sharding == "full_shard" else 1
        per_mb = (gathers + 1) * dp_link.gather(largest, layout.dp)  # all-gathers + the reduce-scatter
        fsdp = _exposed(per_mb * m * layout.accumulate, compute, device.overlap)
    elif layout.dp > 1:
        dp = _exposed(dp_link.all_reduce(largest, layout.dp), compute, device.overlap)
    shard = layout.dp if layout.sharded else 1
    optimizer = largest / shard * (3 + 2 * optimizer_states) / device.memory_bandwidth
    samples = batch * layout.dp * layout.accumulate
    return StepTime(run * layout.accumulate, (run - busy) * layout.accumulate, fsdp, dp, optimizer, samples)


def _exposed(comm: float, compute: float, overlap: float) -> float:
    """What of ``comm`` seconds is not hidden: ``overlap`` of it at most, and no more than the compute beside it."""
    return comm - overlap * min(comm, compute)


def _pipeline(schedule: str, pp: int, m: int, per_rank: tuple[tuple[float, float], ...]) -> tuple[float, float]:
    """(seconds of one pipeline run, the busiest rank's compute in it)."""
    if pp == 1:
        f, b = per_rank[0]
        return f + b, f + b
    scale = max(f for f, _ in per_rank) or 1.0
    key = tuple((round(f / scale, 2), round(b / scale, 2)) for f, b in per_rank)  # simulations cached by shape
    makespan = _simulated(schedule, pp, m, key) * scale
    busy = max(m * (f + b) for f, b in per_rank)
    return makespan, busy


@functools.lru_cache(maxsize=8192)
def _simulated(schedule: str, pp: int, m: int, costs: tuple[tuple[float, float], ...]) -> float:
    rank_costs = [{"F": f, "B": b, "I": b / 2, "W": b / 2} for f, b in costs]
    return simulate(schedule, pp, m, rank_costs=rank_costs).makespan
