"""The memory planner's report and estimate: ``estimate_memory`` cuts a meta copy for every pipeline rank as the
strategy cuts the real model and counts parameters, gradients, optimizer state and the activations the schedule
holds (``activations``). How and why: see the package's docstring (``lightning_tpp.memory``)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn

from lightning_tpp.data_parallel import candidates, fsdp_units
from lightning_tpp.core.mesh import MeshDims
from lightning_tpp.experts.expert_parallel import check_ep, expert_parameters, split_banks
from lightning_tpp.pipeline.partition import Partition
from lightning_tpp.pipeline.auto import AUTO, AUTO_CANDIDATES, AUTO_MEASURE, settle_auto
from lightning_tpp.pipeline.schedule import ScheduleLike, actions
from lightning_tpp.pipeline.schedule_input import resolve
from lightning_tpp.config import planning_config
from lightning_tpp.steps import meta_groups, run
from lightning_tpp.tensor_parallel import TPPlan
from lightning_tpp.memory.activations import ForwardFn, activations_per_stage, meta_copy
from lightning_tpp.parallel_state import ParallelState

GiB = 1024 ** 3
OPTIMIZER_STATES = {"adamw": 2, "adam": 2, "sgd-momentum": 1, "sgd": 0}  # states shaped like the parameter


@dataclass(frozen=True)
class RankMemory:
    """Bytes one rank holds (all tp ranks of a pipeline rank hold the same)."""

    pp_rank: int
    tp_rank: int
    stages: tuple[int, ...]  # the (virtual) pipeline stages it runs
    param_count: int  # parameter elements it holds (after tp and, with dp_shard, dp sharding)
    params: int
    grads: int
    optimizer: int
    activations: int  # at the schedule's peak: saved tensors + sent outputs + recompute
    in_flight: int  # the most micro-batches it holds at once
    sent: int = 0  # of which: outputs sent to the next stage, held until their gradients come back
    recompute: int = 0  # of which: one block's activations while it recomputes (activation checkpointing)
    transient: int = 0  # of which: what the loss's backward holds beside the saved tensors (its gradients in flight)
    gathered: int = 0  # FSDP2's gathered parameters and unsharded gradients in flight (dp-sharded states)
    step: int = 0  # the optimizer step's temporary (torch's foreach Adam/AdamW: one tensor per parameter)
    snapshot: int = 0  # host memory, not the device's: SpikeGuard(action="rollback")'s copy of params + optimizer

    @property
    def states(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        """The states, and at their most either the backward's (activations, gathered) or the optimizer step's."""
        return self.states + max(self.activations + self.gathered, self.step)


@dataclass
class MemoryReport:
    """What :func:`estimate_memory` found: one :class:`RankMemory` per (pp rank, tp rank), and the partition."""

    ranks: list[RankMemory]
    dims: MeshDims
    partition: Optional[Partition]
    microbatches: int
    micro_batch_size: int
    seq_len: int
    schedule: str
    optimizer: str
    param_dtype: torch.dtype
    activation_checkpointing: bool
    dp_shard: bool
    whole_params: int  # parameter elements of the whole model (shared weights once)
    notes: list[str] = field(default_factory=list)
    ep: int = 1  # experts split over ep ranks (tokens exchanged)

    @property
    def largest(self) -> RankMemory:
        return max(self.ranks, key=lambda r: r.total)

    def ideal_share(self) -> float:
        """Bytes of the whole model's params + grads + optimizer state divided by the world size."""
        per_param = torch.empty((), dtype=self.param_dtype).element_size() * (2 + OPTIMIZER_STATES[self.optimizer])
        return self.whole_params * per_param / self.dims.world_size

    @property
    def largest_snapshot(self) -> int:
        """Host bytes of the largest rank's rollback snapshot (0 without ``snapshot=True``)."""
        return max((r.snapshot for r in self.ranks), default=0)

    def fits(self, device_bytes: float) -> bool:
        return self.largest.total <= device_bytes

    def _sharding(self) -> str:
        d = self.dims
        over = "dp x cp" if d.cp > 1 else "dp"
        return f"sharded over {over} (FSDP2)" if self.dp_shard and d.dp * d.cp > 1 else f"replicated over {over}"

    def __str__(self) -> str:
        d = self.dims
        experts = f" (experts over ep={self.ep})" if self.ep > 1 else ""
        layout = (f"tp={d.tp} x pp={d.pp} x {f'cp={d.cp} x ' if d.cp > 1 else ''}dp={d.dp}{experts}, "
                  f"{self.microbatches} micro-batch(es) of "
                  f"{self.micro_batch_size} x {self.seq_len} tokens, schedule {self.schedule!r}, {self.optimizer}, {self.param_dtype}, "
                  f"activation checkpointing {'on' if self.activation_checkpointing else 'off'}, "
                  f"states {self._sharding()}")
        unit, scale = ("GiB", GiB) if self.largest.total >= GiB else ("MiB", 1024 ** 2)
        lines = [f"Memory per rank ({unit}): {layout}; whole model {self.whole_params / 1e6:,.1f} M parameters",
                 f"{'pp':>3} {'tp':>5} {'stages':>8} {'params':>9} {'grads':>9} {'optimizer':>10} "
                 f"{'activations':>12} {'in flight':>9} {'gathered':>9} {'total':>9}"]
        for r in self.ranks:
            if r.tp_rank:
                continue  # the tp ranks of one pipeline rank hold the same
            tps = f"0-{d.tp - 1}" if d.tp > 1 else "0"
            lines.append(f"{r.pp_rank:>3} {tps:>5} {','.join(map(str, r.stages)):>8} {r.params / scale:9.2f} "
                         f"{r.grads / scale:9.2f} {r.optimizer / scale:10.2f} {r.activations / scale:12.2f} "
                         f"{r.in_flight:>9} {r.gathered / scale:9.2f} {r.total / scale:9.2f}"
                         f"{' *' if r.step > r.activations + r.gathered else ''}")
        if any(r.step > r.activations + r.gathered for r in self.ranks):
            lines.append("* set by the optimizer step: AdamW's temporary, the size of the rank's parameters, is more "
                         "than its activations + gathered")
        lines.append(f"largest rank: {self.largest.total / scale:.2f} {unit} (pp rank {self.largest.pp_rank}); "
                     f"ideal share of params+grads+optimizer: {self.ideal_share() / scale:.2f} {unit}")
        if self.largest_snapshot:
            lines.append(f"host memory for SpikeGuard's snapshot (parameters + optimizer state, not on the device): "
                         f"{self.largest_snapshot / scale:.2f} {unit} on the largest rank")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def estimate_memory(module: nn.Module, *, tp: int, pp: int, dp: int = 1, microbatches: Optional[int] = None,
                    batch_size: int, seq_len: int, schedule: ScheduleLike = "auto", virtual_stages: int = 1,
                    optimizer: str = "adamw", param_dtype: torch.dtype = torch.float32,
                    activation_checkpointing: bool = False, dp_shard: bool = True, vocab_exchange: bool = True,
                    backend: str = "nccl",
                    balance: Union[str, Sequence[int]] = "params", split_points: Optional[Sequence[str]] = None,
                    blocks: Optional[Union[str, Sequence[str]]] = None,
                    tp_plan: Union[str, Mapping[str, str]] = "auto",
                    forward: Optional[ForwardFn] = None, ep: int = 1, snapshot: bool = False, cp: int = 1,
                    cp_mode: str = "allgather") -> MemoryReport:
    """Bytes per rank of training ``module`` with ``TensorPipeStrategy(tp, pp, dp, ...)``, without allocating.

    ``module`` is usually built on the meta device (``with torch.device("meta"): ...``); a module with real weights
    is copied to meta first and left as it was. ``batch_size`` is the global batch (all dp replicas together): a
    micro-batch is ``batch_size / dp / microbatches`` sequences of ``seq_len`` tokens (``microbatches`` defaults to
    ``2 * pp`` as in the strategy; 1 without a pipeline). ``forward(model, ids)`` replaces the default call
    (``model(ids)`` and a cross-entropy on the logits; a Hugging Face model's own loss). ``balance``,
    ``split_points``, ``blocks`` and ``tp_plan`` are the strategy's. ``backend`` is the process groups' ("nccl" on
    GPUs; "gloo" for CPU processes, where FSDP2 runs with ``data_parallel.fsdp``'s CPU collectives).
    ``vocab_exchange`` is the strategy's (vocabulary matrices computed over dp, ``data_parallel.rows``, instead of
    gathered). See the module docstring for the method. ``snapshot``: a ``SpikeGuard(action="rollback")`` keeps a
    copy of each rank's parameters and optimizer state in host memory (``RankMemory.snapshot``, not part of the
    device ``total``). ``cp``: context parallelism (the blocks run on ``seq_len / cp`` positions of each sequence;
    the cp ranks of a replica read the same batch, and dp sharding spans dp x cp); ``cp_mode`` as the strategy's
    (``"a2a"``: the attention keeps ``1/cp`` of the heads over the whole sequence, nothing recomputed)."""
    if optimizer not in OPTIMIZER_STATES:
        raise ValueError(f"optimizer={optimizer!r} is not one of {tuple(OPTIMIZER_STATES)}")
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"backend={backend!r} is not one of ('nccl', 'gloo')")
    if balance == "time":
        raise ValueError("estimate_memory cannot measure block times on the meta device: balance='time' is not "
                         "supported here; pass balance='params' or blocks per stage, e.g. balance=[10, 10]")
    check_ep(ep, dp=dp, tp=tp, cp=cp)
    dims = MeshDims(dp, pp, tp, cp)
    m = (microbatches or 2 * pp) if pp > 1 else 1
    specs = [resolve(n) for n in _runs(schedule, pp, m, virtual_stages, dp > 1 and dp_shard)]
    if pp > 1:
        for spec in specs:
            spec.check(pp, m, virtual_stages)
    if batch_size % (dp * m):
        raise ValueError(f"batch_size={batch_size} must be divisible by dp * microbatches = {dp} * {m}: each "
                         f"micro-batch holds batch_size / dp / microbatches sequences")
    mb = batch_size // (dp * m)
    whole = sum(p.numel() for p in {id(p): p for p in module.parameters()}.values())
    name = specs[0].name if len(specs) == 1 else f"auto (the most of {', '.join(s.name for s in specs)})"
    report = MemoryReport([], dims, None, m, mb, seq_len, name, optimizer, param_dtype,
                          activation_checkpointing, dp_shard, whole, ep=ep)
    cuts = [_cut(module, dims, r, virtual_stages, param_dtype, balance=balance, split_points=split_points,
                 blocks=blocks, tp_plan=tp_plan, ep=ep) for r in range(pp)]
    report.partition = cuts[0][1].stages.partition if cuts[0][1].stages is not None else None
    plan = TPPlan()  # the pipeline ranks' plans name disjoint modules: one meta forward measures every stage
    for _, state in cuts:
        plan.styles.update(state.plan.styles)
        plan.blocks.update(state.plan.blocks)
    per_stage, saved, recompute, waiting, transient = activations_per_stage(
        module, plan, report.partition, dims, mb, seq_len, param_dtype, activation_checkpointing, forward, ep, cp_mode)
    waiting_saved = {g: max(w - (per_stage.get(g, 0) - saved.get(g, 0)), 0) for g, w in waiting.items()}  # not sent
    splitting = [pp > 1 and any(kind in ("I", "W") for kind, _, _ in spec.orders(0, pp, m, virtual_stages))
                 for spec in specs]
    for r, (rank_copy, rank_state) in enumerate(cuts):
        # experts split over ep, sharded over their replicas (dp x cp x tp / ep ranks: tp ranks alone where dp x cp
        # is 1) where FSDP2 runs (data_parallel.fsdp.ExpertShards)
        replicas = dp * cp * tp // ep if dp_shard and ep > 1 else 1
        params, grads, optim, count = _state_bytes(rank_copy, optimizer, dp * cp if dp_shard else 1, replicas)
        stages = tuple(c * pp + r for c in range(virtual_stages)) if pp > 1 else (0,)
        extra = max((recompute.get(g, 0) for g in stages), default=0)
        loss = max((transient.get(g, 0) for g in stages), default=0)
        options = []  # per schedule "auto" may run: the rank holds the most of them
        for spec, splits in zip(specs, splitting):
            in_flight, held = _held(spec, r, pp, m, virtual_stages, [per_stage.get(g, 0) for g in stages],
                                    [waiting.get(g, 0) for g in stages])
            held_saved = _held(spec, r, pp, m, virtual_stages, [saved.get(g, 0) for g in stages],
                               [waiting_saved.get(g, 0) for g in stages])[1]
            gathered = _gathered(rank_copy, rank_state, splits, backend,
                                 mb * seq_len if vocab_exchange and cp == 1 else 0, dp * cp, replicas,
                                 dense=dp_shard and dp * cp > 1) \
                if (dp_shard and dp * cp > 1) or replicas > 1 else 0
            step = params if optimizer in ("adam", "adamw") else 0
            options.append(RankMemory(r, 0, stages, count, params, grads, optim, held + extra + loss, in_flight,
                                      held - held_saved, extra, loss, gathered, step,
                                      params + optim if snapshot else 0))
        most = max(options, key=lambda o: o.total)
        report.ranks += [dataclasses.replace(most, tp_rank=t) for t in range(tp)]
    return report


def _runs(schedule: ScheduleLike, pp: int, microbatches: int, virtual: int, dp_sharded: bool) -> list[ScheduleLike]:
    """The schedules a strategy given ``schedule`` runs: itself, or for ``"auto"`` the one the layout decides
    (:func:`settle_auto`, as ``TensorPipeStrategy`` asks it), else every candidate (one measures first)."""
    if not (isinstance(schedule, str) and schedule == AUTO):
        return [schedule]
    if pp == 1:
        return ["1f1b"]
    settled = settle_auto(pp, microbatches, virtual, dp_sharded="dp (FSDP2)" if dp_sharded else None)
    if settled is not None:
        return [settled.schedule]
    return [AUTO_MEASURE, *(c for c in AUTO_CANDIDATES if c != AUTO_MEASURE)]


def _gathered(cut: nn.Module, state: ParallelState, splits_backward: bool, backend: str,
              exchanged_tokens: int, dp: int, expert_replicas: int = 1, dense: bool = True) -> int:
    """What dp sharding holds whole beside the shards, at its most. FSDP2 (torch 2.13's, read from its source): when
    a unit's backward ends it holds the unit gathered and its unsharded gradient, beside the unit enclosing it (a
    block around its expert bank) still gathered, the previous unit's reduce-scatter input (kept until this unit's
    reduce-scatter starts) and the next unit prefetched. Its reduce-scatter then frees the gathered parameters and
    the previous input, copies the gradient into its own input and frees the gradient, but for its last parameter's
    (a loop variable keeps it to the end: ``_compat._leaks_last_gradient``), beside the output (1 / its ranks). So a
    unit ``U`` of ``n`` ranks holds at most ``2U + max(previous, U / n)`` with the units around it; taken as blocks:
    twice the largest unit and two blocks; with banks (units of their own over their ``expert_replicas`` ranks,
    inside the blocks) twice a bank, its block, the block after prefetched and the larger of a block and the bank's
    output; the banks alone (``dense=False``: dp x cp = 1, their replicas tp ranks) twice a bank and two more. Over
    gloo (``data_parallel.fsdp``'s CPU collectives) a unit's weight and gradient, nothing prefetched and no input
    kept. Under a schedule that splits backward (zero-bubble): the stage's parameters and gradients, which stay whole
    until the schedule ends. The vocabulary matrices computed over dp (``data_parallel.rows``; ``exchanged_tokens``
    per micro-batch and rank, 0 when they are FSDP2 units) are never gathered: what they hold is their all-to-all's
    buffers, the send and the receive side of a head's logits (``_exchange_bytes``)."""
    blocks, tp_blocks = list(state.blocks), [b.name for b in state.tp_blocks]  # what setup's FSDP2 step reads
    exchanged = candidates(cut, blocks, tp_blocks) if exchanged_tokens else []
    rows = {id(p) for n in exchanged for p in cut.get_submodule(n).parameters()}
    experts = expert_parameters(cut)
    rows |= {id(p) for p in experts}  # split over ep: outside the dp units
    bank = sum(p.numel() * p.element_size() for p in experts) // max(len(split_banks(cut)), 1) \
        if expert_replicas > 1 else 0  # one bank gathered over its replicas
    exchange = max((_exchange_bytes(cut.get_submodule(n), exchanged_tokens, dp) for n in exchanged), default=0)
    if not dense:
        return 2 * bank if backend == "gloo" else int(fsdp_backward_peak(bank, bank, expert_replicas))
    if splits_backward:
        return max(exchange, 2 * sum(p.numel() * p.element_size() for p in {id(p): p for p in cut.parameters()
                                                                            if id(p) not in rows}.values()))
    units, _ = fsdp_units(cut, blocks, skip=rows, tp_blocks=tp_blocks)
    modules = dict(cut.named_modules())
    claimed: set[int] = set(rows)
    sizes = {}
    for name in units:  # children first: a unit holds what no unit inside it holds
        own = {id(p): p for p in modules[name].parameters() if id(p) not in claimed}
        claimed |= own.keys()
        sizes[name] = sum(p.numel() * p.element_size() for p in own.values())
    largest, block = max(sizes.values(), default=0), max((sizes.get(n, 0) for n in blocks), default=0)
    if backend == "gloo":
        return max(exchange, 2 * largest, 2 * bank)
    return int(max(exchange, fsdp_backward_peak(largest, block, dp),
                   fsdp_backward_peak(bank, block, expert_replicas, enclosing=block) if bank else 0))


def fsdp_backward_peak(unit: float, neighbour: float, ranks: int, enclosing: float = 0.0) -> float:
    """FSDP2's most (NCCL, torch 2.13; see ``_gathered``) around the backward of a unit of ``unit`` bytes sharded over
    ``ranks``: it gathered and its gradient, the unit enclosing it still gathered, the next unit (``neighbour``
    bytes) prefetched, and the larger of the previous unit's reduce-scatter input (``neighbour``) and this unit's
    reduce-scatter output. The layout search (``layout.memory``) counts the same."""
    return 2 * unit + enclosing + neighbour + max(neighbour, unit / ranks)


def _exchange_bytes(layer: nn.Module, tokens: int, dp: int) -> int:
    """What a layer computed over dp holds in flight for a micro-batch of ``tokens`` per rank: a head, its output
    (tokens x its rows) beside the other side of its all-to-all, or beside the whole logits when tensor parallelism
    gathers them (tp x its output); an embedding, its partial lookup of every dp rank's tokens and the sum's copy
    (dp x tokens x hidden each)."""
    w = layer.weight
    if isinstance(layer, nn.Embedding):
        return 2 * dp * tokens * w.shape[1] * w.element_size()
    tp = getattr(layer, "_tpp_layer", None)
    beside = tp.group.size if tp is not None and tp.gather else 1
    return (1 + beside) * tokens * w.shape[0] * w.element_size()


def _cut(module: nn.Module, dims: MeshDims, pp_rank: int, virtual: int, dtype: torch.dtype, *,
         balance: Union[str, Sequence[int]], split_points: Optional[Sequence[str]],
         blocks: Optional[Union[str, Sequence[str]]], tp_plan: Union[str, Mapping[str, str]], ep: int = 1
         ) -> tuple[nn.Module, ParallelState]:
    """A meta copy of ``module`` cut for ``pp_rank`` by the setup steps, as the strategy cuts it (tp rank 0), and what
    the steps decided for it."""
    copy = meta_copy(module, dtype)
    config = planning_config(dims.tp, dims.pp, virtual, balance=balance, split_points=split_points, blocks=blocks,
                             tp_plan=tp_plan, ep=ep)
    state = run(copy, config, meta_groups(config), dims=dims, rank=dims.rank_of(dp=0, pp=pp_rank, tp=0),
                until="coverage").state
    assert state is not None
    return copy, state


def _state_bytes(cut: nn.Module, optimizer: str, dp: int, replicas: int = 1) -> tuple[int, int, int, int]:
    """(params, grads, optimizer state) bytes and the parameter elements of a cut copy, each parameter's dim 0
    divided into ``dp`` padded pieces (FSDP2) when ``dp > 1``; experts split over ep divided over their ``replicas``
    instead (dim 0 where a rank's experts are at least its replicas, else dim 1, as ``ExpertShards`` places them)."""
    params = grads = optim = count = 0
    experts = {id(p) for p in expert_parameters(cut)}
    for p in {id(p): p for p in cut.parameters()}.values():
        parts = replicas if id(p) in experts else dp
        dim = 1 if id(p) in experts and p.dim() >= 2 and p.shape[0] < replicas else 0
        whole = parts == 1 or p.dim() == 0
        n = p.numel() if whole else math.ceil(p.shape[dim] / parts) * (p.numel() // p.shape[dim])
        size = n * p.element_size()
        count, params = count + n, params + size
        if p.requires_grad:
            grads += size
            optim += OPTIMIZER_STATES[optimizer] * size + (4 if optimizer in ("adam", "adamw") else 0)  # fp32 step
    return params, grads, optim, count


def _held(spec: Any, rank: int, pp: int, m: int, virtual: int, chunk_bytes: Sequence[int],
          waiting_bytes: Optional[Sequence[int]] = None) -> tuple[int, int]:
    """(most micro-batches held at once, most activation bytes held at once) over ``rank``'s actions: ``chunk_bytes``
    from ``F`` until ``B`` or ``I``, then ``waiting_bytes`` (what the weight products keep; all of it by default)
    until ``W`` when the backward is split."""
    if pp == 1:
        return 1, chunk_bytes[0]
    waiting_bytes = chunk_bytes if waiting_bytes is None else waiting_bytes
    full: set[tuple[int, int]] = set()
    waiting: set[tuple[int, int]] = set()
    most = most_bytes = 0
    for kind, mb, chunk in actions(spec, rank, pp, m, virtual):
        key = (mb, chunk)
        if kind == "F":
            full.add(key)
        elif kind in "BI":
            full.discard(key)
            if kind == "I":
                waiting.add(key)
        elif kind == "W":
            waiting.discard(key)
        most = max(most, len(full | waiting))
        most_bytes = max(most_bytes, sum(chunk_bytes[c] for _, c in full) +
                         sum(min(waiting_bytes[c], chunk_bytes[c]) for _, c in waiting))
    return most, most_bytes
