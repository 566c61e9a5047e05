"""Predicted seconds of one optimizer step of a layout, from the profile, the block times and the links.

What it adds up (per pipeline rank; a step is ``accumulate`` pipeline runs of ``microbatches`` micro-batches)::

    action F of a stage   its blocks' forward (timed on the device at tp = 1, divided by tp for the FLOPs the plan
                          cuts) + on the last stage the ends' (embeddings, head, loss: timed with every block
                          standing in, ``timing.time_ends``; else their FLOPs at the blocks' rate) + tp all-reduces
                          of the residual stream (2 per block: attention, MLP) + the send to the next stage
    action B              twice the forward's compute (timed), as many all-reduces, one more forward with
                          activation checkpointing (recompute), the send back
    pipeline run          the schedule simulator (``pipeline.schedule.simulate``) on those per-rank costs: the
                          bubble comes from the schedule's own action lists
    FSDP2 (dp sharded)    per micro-batch: all-gather of the stage's parameters for forward (again for backward
                          under full_shard), reduce-scatter of its gradients (each at its measured bandwidth, with
                          one host copy of the stage's bytes around it); ``overlap`` of it hidden by compute
    dp all-reduce         (no_shard) the stage's gradients once per step, after backward (the strategy averages
                          them in the optimizer's closure, ``core.grads``): not overlapped; with the two host
                          copies around it (into the flat bucket, back divided by dp)
    loss check            (dp > 1) per training_step, the replicas' non-finite flags gathered (fail-fast,
                          ``reliability.nonfinite``): one small all-gather, a synchronisation point
    optimizer             AdamW timed on the device (per parameter tensor + per element, on one block's shapes),
                          else the rank's parameters and states read and written once, at memory bandwidth

Expert parallelism (``ep > 1``, ``experts.dispatch``), per routed layer and micro-batch: forward, the counts'
all-to-all and two of the rows (to the experts, back), backward two more (again in a recomputation); each rank sends
its share of the tokens (1/tp of the micro-batch's under tp, 1/cp of its positions under cp) x top-k rows of
``hidden`` elements, (ep-1)/ep of them to other ranks, on the tp link while the ep group stays in a tp group or a node. The experts' compute per rank is
unchanged: every rank of a stage holds 1/ep of the experts and receives on average ep/tp ranks' shares of the rows,
the same work that expert tp gives it (1/tp of every expert for all its tokens). Where FSDP2 shards, the experts are
sharded over their replicas (dp x cp x tp / ep ranks) and gathered and reduce-scattered per micro-batch like a dense
unit (``StepTime.experts``, what compute does not hide); under ``no_shard`` their gradients are summed over the
replicas once per step, not overlapped.

Context parallelism (``cp > 1``, ``cp_mode="allgather"``): a block's compute is ``1/cp`` of cp = 1's (its positions;
the causal attention's work is equal on every rank by the head-and-tail chunks), its backward adds its attention's
forward again (the attention is recomputed), and each attention call all-gathers the whole sequence's keys and values
over cp in forward, again in backward, and reduce-scatters their gradients (the profile's ``keys`` bytes, cut by tp).
The stack's output is gathered once per micro-batch (reduce-scattered in backward); the LM head computes ``1/cp`` of
the vocabulary's columns (the ends' time / cp) and its input's gradient is all-reduced over cp. The cp group sits
next to tp in the mesh (its link: within a node while tp x cp fit in one). FSDP2 and the gradient average run over
dp x cp; a step reads ``dp`` samples per micro-batch row (the cp ranks read the same ones). Under ``cp_mode="a2a"``
each SDPA call instead moves its queries, keys and values to ``1/cp`` of the heads and its output back, one
all-to-all of ``(2 queries + keys) / cp`` per rank in forward and one in backward, and recomputes nothing (a block
whose attention is no SDPA call, which a2a runs as allgather, is charged as allgather; key/value heads per tp rank
that cp does not divide are repeated first, as the call does; query heads per tp rank that cp does not divide:
charged as allgather, as the call runs). ``cp_mode="auto"`` ranks both modes. On CPU, allgather's causal calls
without a mask or dropout are not recomputed (their parts joined by log-sum-exp, ``context_parallel.attention``).

Processes that share cores (CPU) wait for the slowest at each synchronisation point: the compute is scaled by
``1 + BlockTimes.straggle``, the wait measured at the barriers of the block timing (``timing.Meeting``); 0 on GPUs
(a device per process: timed alone), where stragglers are not modelled.

Assumptions: tp all-reduces and pipeline sends are not overlapped with compute (Megatron's defaults, and gloo's);
FSDP2's collectives overlap by ``DeviceSpec.overlap`` (0 for gloo, which runs on the compute cores) of what they
share with compute (``overlap x min(communication, compute)`` is hidden); the dp all-reduce and the experts'
reduction run after backward and are not;
compute of a micro-batch is linear in its sequences above the measured sizes; a tp rank computes 1/tp of what the
plan cuts at the measured rate (no loss of efficiency from smaller matmuls: an optimistic bias for large tp).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Mapping, Optional

from lightning_tpp.layout.links import DeviceSpec, Link
from lightning_tpp.layout.memory import stage_blocks, stage_params
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
    optimizer: Optional[tuple[float, float]] = None  # AdamW step: (seconds per tensor, per element), timed
    copy: Optional[float] = None  # seconds per byte of a host copy (read and written), timed beside the others
    straggle: float = 0.0  # processes sharing cores: wait for the slowest per second of compute (timing.Meeting)
    ends: Mapping[int, tuple[float, float]] = field(default_factory=dict)  # sequences -> (forward, backward) outside
    # the blocks, timed (timing.time_ends); empty: their FLOPs at the blocks' rate

    def copies(self, nbytes: float, passes: int, device: DeviceSpec) -> float:
        """Seconds of ``passes`` copies of ``nbytes`` (each read and written once): timed, else at memory
        bandwidth."""
        per_byte = self.copy if self.copy is not None else 2.0 / device.memory_bandwidth
        return passes * nbytes * per_byte

    def optimizer_step(self, tensors: int, elements: float, elem: int, states: int, device: DeviceSpec) -> float:
        """Seconds of the optimizer step of a rank holding ``tensors`` parameter tensors of ``elements`` in all:
        timed (AdamW; other optimizers by their states' share of the bytes), else its bytes at memory bandwidth."""
        share = (3 + 2 * states) / 7  # parameter, gradient and states read, parameter and states written
        if self.optimizer is not None:
            per_tensor, per_element = self.optimizer
            return (per_tensor * tensors + per_element * elements * share) * self.slowdown
        return elements * elem * (3 + 2 * states) / device.memory_bandwidth

    def block(self, block: BlockProfile, mb: float, tp: int, device: DeviceSpec) -> tuple[float, float]:
        share = block.flops.at(tp) / block.flops.whole if block.flops.whole else 1.0 / tp
        timed = self._timed(block.kind, mb)
        if timed is not None:
            return timed[0] * share * self.slowdown, timed[1] * share * self.slowdown
        f = block.flops.at(tp) * mb / (device.flops * device.efficiency)
        return f, 2 * f

    def ends_time(self, profile: ModelProfile, mb: float, tp: int, device: DeviceSpec) -> tuple[float, float]:
        """(forward, backward) seconds of what lies outside the blocks for a micro-batch of ``mb`` sequences: timed
        (``ends``, ``timing.time_ends``; the share tp cuts by the FLOPs it cuts), else their FLOPs at the blocks'
        rate (backward twice the forward)."""
        whole = profile.end_flops.whole
        share = profile.end_flops.at(tp) / whole if whole else 1.0
        if self.ends:
            size = max([s for s in self.ends if s <= mb] or [min(self.ends)])
            f, b = self.ends[size]
            return f * mb / size * share * self.slowdown, b * mb / size * share * self.slowdown
        f = profile.end_flops.at(tp) * mb / self.rate(profile, device)
        return f, 2 * f

    def rate(self, profile: ModelProfile, device: DeviceSpec) -> float:
        """FLOPs per second the timed blocks reached (untimed ends are charged at it), else the device's assumed
        rate."""
        for block, _ in profile.alike(0, profile.n_blocks):
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
    experts: float = 0.0  # ep > 1: the experts' gradients summed over their replicas

    @property
    def total(self) -> float:
        return self.pipeline + self.fsdp + self.dp + self.optimizer + self.experts

    @property
    def per_sample(self) -> float:
        return self.total / self.samples


def _links(layout: Layout, device: DeviceSpec) -> tuple[Link, Link, Link, Link, Link]:
    """tp, pp, dp, ep and cp links: tp within a node; cp while tp x cp fit in a node; pp while tp x cp x pp do; dp
    while the whole mesh does; ep while its group is inside a tp group or spans no more than ep x pp devices of a
    node (tp fastest, then dp)."""
    node = device.devices_per_node
    cp = device.intra if layout.tp * layout.cp <= node else device.inter
    pp = device.intra if layout.tp * layout.cp * layout.pp <= node else device.inter
    dp = device.intra if layout.world <= node else device.inter
    ep = device.intra if layout.ep <= layout.tp or layout.ep * layout.pp <= node else device.inter
    return device.intra, pp, dp, ep, cp


def _context(block: BlockProfile, bf: float, mb: float, layout: Layout, link: Link, *, cpu: bool = False
             ) -> tuple[float, float]:
    """(forward, backward) seconds that context parallelism adds to a block (0 at cp = 1): see the module
    docstring. ``bf``: the block's forward seconds at this rank's positions; ``cpu``: its causal calls are joined
    by log-sum-exp, not recomputed."""
    cp, tp = layout.cp, layout.tp
    if cp == 1:
        return 0.0, 0.0
    if layout.cp_mode == "a2a" and block.queries and block.heads and block.heads % (tp * cp) == 0:
        # queries, keys and values of this rank's positions to 1/cp of the heads (the output back), and their
        # gradients the other way; nothing recomputed. Key/value heads that cp does not divide are repeated first.
        keys = block.keys / tp
        if block.kv_heads:
            local = max(block.kv_heads // tp, 1)
            keys = block.keys * local / block.kv_heads * (cp // math.gcd(local, cp))
        moved = link.all_to_all((2 * block.queries / tp + keys) * mb / cp, cp)
        return moved, moved
    keys = block.keys * mb / tp  # the whole sequence's keys and values of this rank's heads
    gather = link.gather(keys, cp)
    recomputed = block.attention_flops - (block.joined_flops if cpu else 0.0)
    recompute = bf * recomputed / block.flops.whole if block.flops.whole else 0.0
    return gather, gather + link.reduce_scatter(keys, cp) + recompute


def _exchanges(block: BlockProfile, mb: float, layout: Layout, link: Link, seq_len: int, elem: int
               ) -> tuple[float, float]:
    """(forward, backward) seconds of the block's all-to-alls under ep (0 without): see the module docstring."""
    if layout.ep == 1 or not block.routed:
        return 0.0, 0.0
    f = b = 0.0
    for r in block.routed:
        rows = link.all_to_all(mb * seq_len / layout.cp * r.top_k / layout.tp * r.hidden * elem, layout.ep)
        f += 2 * rows + link.all_to_all(r.experts * 8, layout.ep)
        b += 2 * rows
    return f, b


def step_time(profile: ModelProfile, layout: Layout, device: DeviceSpec, times: BlockTimes, *, batch: int,
              optimizer_states: int = 2) -> StepTime:
    """Seconds of one optimizer step of ``layout`` on per-process batches of ``batch`` sequences."""
    tp, pp, m, cp = layout.tp, layout.pp, layout.microbatches, layout.cp
    mb = batch / m
    tp_link, pp_link, dp_link, ep_link, cp_link = _links(layout, device)
    hidden = profile.sent * mb  # the residual stream of a micro-batch, in bytes
    reduce = tp_link.all_reduce(hidden / cp, tp)
    send = pp_link.p2p(hidden / cp) if pp > 1 else 0.0
    bounds = stage_blocks(profile.actives, pp, profile.first_params.whole, profile.last_params.whole) if pp > 1 else \
        ((0, profile.n_blocks),)
    per_rank, stage_dense, stage_experts, stage_tensors = [], [], [], []
    for r, (a, b) in enumerate(bounds):
        f = bwd = 0.0
        for block, n in profile.alike(a, b):
            bf, bb = times.block(block, mb, tp, device)
            bf, bb = bf / cp, bb / cp
            xf, xb = _exchanges(block, mb, layout, ep_link, profile.seq_len, profile.dtype_bytes)
            cf, cb = _context(block, bf, mb, layout, cp_link, cpu=device.name == "cpu")
            comm = block.reductions * reduce
            f += (bf + comm + xf + cf) * n
            bwd += (bb + comm + xb + cb + (bf + comm + xf + cf if layout.activation_checkpointing else 0.0)) * n
        dense, experts, _ = stage_params(profile, layout, r, a, b)
        if cp > 1 and r == pp - 1:  # the stack's output gathered (reduce-scattered back), the head's input all-reduced
            f += cp_link.gather(hidden, cp)
            bwd += cp_link.reduce_scatter(hidden, cp) + cp_link.all_reduce(hidden, cp)
        if r == pp - 1:  # the ends, the embeddings' share included (small beside the head and loss)
            ef, eb = times.ends_time(profile, mb, tp, device)
            comm = profile.vocab_reductions * reduce
            f, bwd = f + ef / cp + comm, bwd + eb / cp + comm
        per_rank.append((f + send, bwd + send))
        stage_dense.append(dense * profile.dtype_bytes)
        stage_experts.append(experts * profile.dtype_bytes)
        stage_tensors.append(sum(x.tensors * n for x, n in profile.alike(a, b))
                             + (profile.end_tensors[0] if r == 0 else 0)
                             + (profile.end_tensors[1] if r == pp - 1 else 0))
    run, busy = _pipeline(layout.schedule, pp, m, tuple(per_rank))
    if layout.world > 1:  # every layout of more than one process meets the others in its step: the slowest sets the pace
        run, busy = run * (1 + times.straggle), busy * (1 + times.straggle)
    compute = max(m * (f + b) for f, b in per_rank) * layout.accumulate  # what FSDP2/dp traffic can hide behind
    largest = max(stage_dense)
    fsdp = dp = 0.0
    replicas = layout.replicas
    if layout.sharded:
        gathers = 2 if layout.dp_sharding == "full_shard" else 1
        per_mb = gathers * dp_link.gather(largest, replicas, dp_link.param_gather_factor) + \
            dp_link.reduce_scatter(largest, replicas, dp_link.grad_scatter_factor) + \
            times.copies(largest, gathers + 1, device)  # FSDP2's copy-in / copy-out around each collective
        fsdp = _exposed(per_mb * m * layout.accumulate, compute, device.overlap)
    elif replicas > 1:  # after backward: nothing left to hide it behind
        dp = dp_link.all_reduce(largest, replicas) + times.copies(largest, 2, device)
    if layout.dp > 1:
        dp += dp_link.gather(4.0 * layout.dp, layout.dp) * layout.accumulate  # the loss check's flags
    shard = replicas if layout.sharded else 1
    expert_shard = layout.expert_replicas if layout.sharded else 1  # FSDP2 over the experts' replicas
    optimizer = max(times.optimizer_step(n, (d / shard + e / expert_shard) / profile.dtype_bytes, profile.dtype_bytes,
                                         optimizer_states, device)
                    for n, d, e in zip(stage_tensors, stage_dense, stage_experts))
    experts = 0.0
    if layout.ep > 1 and expert_shard > 1:  # gathered and reduce-scattered per micro-batch, as the dense units
        bank = max(stage_experts)
        gathers = 2 if layout.dp_sharding == "full_shard" else 1
        per_mb = gathers * dp_link.gather(bank, expert_shard, dp_link.param_gather_factor) + \
            dp_link.reduce_scatter(bank, expert_shard, dp_link.grad_scatter_factor) + \
            times.copies(bank, gathers + 1, device)
        experts = _exposed(per_mb * m * layout.accumulate, compute, device.overlap)
    elif layout.ep > 1:  # whole on their replicas: summed once per step, after backward
        experts = dp_link.all_reduce(max(stage_experts), layout.expert_replicas) + \
            times.copies(max(stage_experts), 2, device)
    samples = batch * layout.dp * layout.accumulate
    return StepTime(run * layout.accumulate, (run - busy) * layout.accumulate, fsdp, dp, optimizer, samples,
                    experts)


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
