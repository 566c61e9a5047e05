"""Bytes per device of a layout, from a :class:`ModelProfile` by arithmetic (no meta run per candidate).

The same terms as the memory planner (``memory.estimate``), which this follows and is checked against
(``tests/unit/test_layout.py``)::

    per pipeline rank   states      (its blocks' and ends' parameters at tp) x (param + grad + optimizer states),
                                    / dp when FSDP2 shards them
                        activations (micro-batches the schedule holds at once, from its action lists)
                                    x (bytes each holds: its blocks' saved tensors, or only their inputs with
                                       activation checkpointing plus one block recomputing; the ends'; the output
                                       sent to the next stage)
                        gathered    FSDP2's whole units beside the shards (the largest block gathered with its
                                    gradient, the block before's reduce-scatter input and the next block prefetched
                                    on NCCL; a block's expert bank gathered over its replicas with its gradient,
                                    inside its block; kept gathered from forward to backward under shard_grad_op)
                        step        AdamW's foreach temporary, the size of the parameters
    total = states + max(activations + gathered, step)

With context parallelism (``cp > 1``) the blocks run on ``1/cp`` of each sequence's positions: their saved bytes,
what checkpointing keeps, a stage's send and the LM head's (``1/cp`` of the vocabulary's columns) are ``1/cp`` of
cp = 1's; the embeddings' are not (they run on the whole sequence); states are sharded over dp x cp.

With expert parallelism (``ep > 1``) a rank holds ``1 / ep`` of every expert bank (not cut by tp), and where FSDP2
shards (``dp x cp > 1``, not ``no_shard``) that part is sharded again over the ranks holding the same experts
(``dp x cp x tp / ep``: expert data parallelism), as ``estimate_memory(ep=)`` counts them; the dense rest keeps tp and FSDP2. The exchange's rows held for backward are measured once at ep = 2
(``BlockProfile.exchange_saved``): a rank receives about as many rows at any ep (its share of the group's tokens).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lightning_tpp.layout.plan import Layout
from lightning_tpp.layout.profile import ModelProfile
from lightning_tpp.memory import OPTIMIZER_STATES
from lightning_tpp.memory.estimate import fsdp_backward_peak
from lightning_tpp.pipeline.partition import balance
from lightning_tpp.pipeline.schedule import actions


@dataclass(frozen=True)
class LayoutMemory:
    """The largest pipeline rank's bytes, by kind."""

    pp_rank: int
    states: float
    activations: float
    gathered: float
    step: float

    @property
    def total(self) -> float:
        return self.states + max(self.activations + self.gathered, self.step)


@functools.lru_cache(maxsize=4096)
def in_flight(schedule: str, pp: int, microbatches: int, rank: int) -> int:
    """The most micro-batches ``rank`` holds at once under ``schedule``: from a forward until its backward (its
    weight-gradient half when the backward is split), counted on the schedule's own action lists."""
    if pp == 1:
        return 1
    held: set[int] = set()
    most = 0
    for kind, mb, _ in actions(schedule, rank, pp, microbatches):
        if kind == "F":
            held.add(mb)
        elif kind in ("B", "W"):  # I keeps what W still needs (an upper bound, as the planner counts)
            held.discard(mb)
        most = max(most, len(held))
    return most


def stage_params(profile: ModelProfile, layout: Layout, r: int, a: int, b: int) -> tuple[float, float, float]:
    """Parameter elements of pipeline rank ``r`` (blocks ``a:b``): (dense, its experts, the largest block's dense
    part). Under ``ep > 1`` the experts are ``1 / ep`` of the banks, whole; else they are in ``dense`` (cut by tp,
    sharded by FSDP2 as every other parameter)."""
    tp, ep = layout.tp, layout.ep
    blocks = profile.alike(a, b)
    split = ep > 1
    dense = sum((x.params.at(tp) - (x.experts.at(tp) if split else 0.0)) * n for x, n in blocks)
    experts = sum(x.experts.whole * n for x, n in blocks) / ep if split else 0.0
    largest = max((x.params.at(tp) - (x.experts.at(tp) if split else 0.0) for x, _ in blocks), default=0.0)
    if r == 0:
        dense += profile.first_params.at(tp)
    if r == layout.pp - 1:
        dense += profile.last_params.at(tp)
    if r == 0 and layout.pp == 1:
        dense -= profile.shared_params.at(tp)  # a tied embedding and head, once
    return dense, experts, largest


@functools.lru_cache(maxsize=1024)
def stage_blocks(costs: tuple[float, ...], pp: int, first: float, last: float) -> tuple[tuple[int, int], ...]:
    """The pipeline partition the strategy makes (``balance="params"``): contiguous block ranges per stage."""
    return tuple(balance(list(costs), pp, first_extra=first, last_extra=last))


def layout_memory(profile: ModelProfile, layout: Layout, *, batch: int, optimizer: str = "adamw",
                  backend: str = "nccl") -> LayoutMemory:
    """The largest pipeline rank of ``layout`` training on per-process batches of ``batch`` sequences."""
    tp, pp = layout.tp, layout.pp
    mb = batch / layout.microbatches
    elem = profile.dtype_bytes
    per_param = elem * (2 + OPTIMIZER_STATES[optimizer])
    bounds = stage_blocks(profile.actives, pp, profile.first_params.whole, profile.last_params.whole) if pp > 1 else \
        ((0, profile.n_blocks),)
    shard = layout.replicas if layout.sharded else 1
    cp = layout.cp
    best = None
    for r, (a, b) in enumerate(bounds):
        blocks = profile.alike(a, b)
        dense, experts, largest = stage_params(profile, layout, r, a, b)
        saved = 0.0
        if r == 0:
            saved += profile.first_saved.at(tp) * mb
        if r == pp - 1:
            saved += profile.last_saved.at(tp) * mb / cp
        exchange = (lambda x: x.exchange_saved / tp) if layout.ep > 1 else (lambda x: 0.0)  # noqa: E731
        if layout.activation_checkpointing:
            saved += sum(x.kept.at(tp) * n for x, n in blocks) * mb / cp
            extra = max((x.saved.at(tp) + exchange(x) for x, _ in blocks), default=0.0) * mb / cp
        else:
            saved += sum((x.saved.at(tp) + exchange(x)) * n for x, n in blocks) * mb / cp
            extra = 0.0
        if r < pp - 1:
            saved += profile.sent * mb / cp
        if r == pp - 1:
            extra += profile.last_transient.at(tp) * mb / cp  # the loss's backward, beside what the stage holds
        held = in_flight(layout.schedule, pp, layout.microbatches, r) * saved + extra
        largest *= elem
        # experts: sharded over their replicas (dp x cp x tp / ep ranks; tp ranks alone where dp x cp = 1) unless
        # dp_sharding="no_shard", as the strategy does; a block's bank is then gathered over them in its backward
        experts_sharded = layout.dp_sharding != "no_shard" and layout.expert_replicas > 1
        bank = max((x.experts.whole for x, _ in blocks), default=0.0) / layout.ep * elem \
            if experts_sharded and layout.ep > 1 else 0.0
        gathered = 0.0
        if layout.sharded:  # the largest block and its neighbours (memory.estimate._gathered)
            gathered = max(2 * largest, 2 * bank) if backend == "gloo" else max(
                fsdp_backward_peak(largest, largest, layout.replicas),
                fsdp_backward_peak(bank, largest, layout.expert_replicas, enclosing=largest))
            if layout.dp_sharding == "shard_grad_op":
                gathered += dense * elem
        elif bank:  # the banks alone are units (their replicas tp ranks)
            gathered = 2 * bank if backend == "gloo" else fsdp_backward_peak(bank, bank, layout.expert_replicas)
        held_params = dense / shard + experts / (layout.expert_replicas if experts_sharded else 1)
        step = held_params * elem if optimizer in ("adam", "adamw") else 0.0
        memory = LayoutMemory(r, held_params * per_param, held, gathered, step)
        if best is None or memory.total > best.total:
            best = memory
    assert best is not None
    return best
