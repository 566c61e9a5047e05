"""Token dispatch for expert parallelism: every (token, slot) row goes to the rank holding its expert by all-to-all,
is computed there by the bank's own forward, and comes back the same way. Dropless: no capacity factor, no row
dropped, so the result is one process's.

One MoE call on a rank of an ep group of P ranks (E experts, L = E / P on each)::

    x (T, H), index (T, k), weight (T, k)        routed by the model's own router, outside the bank
      tp > 1: this tp rank's slice of the tokens (the tokens are replicated over tp; each expert sees each once),
              unless the tp ranks hold different tokens (sequence parallelism: each its sequence shard, all of it)
    rows = (token, slot) pairs, sorted by expert          counts (E,) -> rows per destination rank
    counts  --all_to_all-->  rows per (source rank, local expert)
    x[rows] --all_to_all-->  received rows   --bank.forward(rows, local expert, weight 1)-->  outputs
    outputs --all_to_all-->  back in the sorted order -> unsorted, times weight, added per token
      tp > 1: the slices summed over tp (one all-reduce, as the attention's output)

Every rank joins every collective of the layer, in forward and in backward, whatever it received (an expert with
no row, a rank with none): the received rows and the bank's parameters are tied to the output by a zero-gradient
function, so that autograd runs the backward exchange on every rank.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_tpp._compat import functional_collectives, known_size
from lightning_tpp.core.comm import TPGroup, copy_to_tp, reduce_from_tp, tokens_sharded_over


@dataclass
class Traffic:
    """What this rank's exchanges sent to other ranks (rows to experts and back, forward and backward) and the time
    spent in them since the last reset: the ``moe/all_to_all_*`` metrics. Exchanges inside a compiled block add
    their bytes to a tensor on the device instead (``pending``, made by the first, eager call; read when the metric
    is: no host sync per call), and no time."""

    sent: int = 0
    seconds: float = 0.0
    calls: int = 0
    pending: Optional[Tensor] = None

    @property
    def bytes(self) -> int:
        if self.pending is not None:
            self.sent += int(self.pending.item())
            self.pending.zero_()
        return self.sent

    def reset(self) -> None:
        self.sent, self.seconds, self.calls = 0, 0.0, 0
        if self.pending is not None:
            self.pending.zero_()


def _on_wire(t: Tensor) -> Tensor:
    """``t`` as the exchange carries it: half precision in fp32 on the CPU (gloo)."""
    return t.float() if t.device.type == "cpu" and t.dtype in (torch.bfloat16, torch.float16) else t


def _exchange(x: Tensor, out_splits: list[int], in_splits: list[int], group: TPGroup,
              traffic: Optional[Traffic] = None) -> Tensor:
    """All-to-all of rows with the given split sizes (gloo: half precision carried in fp32)."""
    if x.is_meta:
        return x.new_empty((sum(out_splits), *x.shape[1:]))
    wire = _on_wire(x)
    out = wire.new_empty((sum(out_splits), *x.shape[1:]))
    start = time.perf_counter()
    dist.all_to_all_single(out, wire.contiguous(), out_splits, in_splits, group=group.group)
    if traffic is not None:  # rows that leave this rank
        if traffic.pending is None:  # for the exchanges traced later (compile=)
            traffic.pending = torch.zeros((), dtype=torch.long, device=x.device)
        row = math.prod(wire.shape[1:]) * wire.element_size()  # a rank may send no row at all
        traffic.sent += (sum(in_splits) - in_splits[group.rank]) * row
        traffic.seconds += time.perf_counter() - start
        traffic.calls += 1
    return out.to(x.dtype)


class _AllToAll(torch.autograd.Function):
    """Rows to their destination ranks; backward sends the gradients back along the same routes."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, out_splits: list[int], in_splits: list[int], group: TPGroup,
                traffic: Optional[Traffic]) -> Tensor:
        ctx.routes = (out_splits, in_splits, group, traffic)
        return _exchange(x, out_splits, in_splits, group, traffic)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], None, None, None, None]:
        out_splits, in_splits, group, traffic = ctx.routes
        return _exchange(grad, in_splits, out_splits, group, traffic), None, None, None, None


class _Joined(torch.autograd.Function):
    """``out`` unchanged; zero gradients for ``tied``: they stay in the graph when ``out`` does not depend on them
    (no row received), so backward reaches this rank's exchange and parameters as it does on the others."""

    @staticmethod
    def forward(ctx: Any, out: Tensor, *tied: Tensor) -> Tensor:
        ctx.shapes = [(t.shape, t.dtype, t.device) for t in tied]
        return out.view_as(out)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, ...]:
        return (grad, *(torch.zeros(s, dtype=d, device=v) for s, d, v in ctx.shapes))


def _joined(out: Tensor, rows: Tensor, params: list[Tensor]) -> Tensor:
    """``out`` tied to ``rows`` and ``params`` (:class:`_Joined`) where autograd records: without gradients there is
    nothing to tie, and traced there, dynamo ran ``_Joined.forward`` on its arguments shifted by one (the tie returned
    the first parameter in place of ``out``; torch 2.13)."""
    if not torch.is_grad_enabled():
        return out
    return _Joined.apply(out, *(t for t in (rows, *params) if t.requires_grad))


def _counts_exchange(counts: Tensor, group: TPGroup) -> Tensor:
    """(E,) rows per expert from this rank -> (P, L) rows each source rank sends for each local expert."""
    p = group.size
    out = torch.empty_like(counts)
    dist.all_to_all_single(out, counts, group=group.group)
    return out.view(p, -1)


def dispatch(compute: Callable[[Tensor, Tensor, Tensor], Tensor], x: Tensor, index: Tensor, weight: Tensor, *,
             experts: int, ep: TPGroup, tp: TPGroup, params: list[Tensor], traffic: Optional[Traffic] = None) -> Tensor:
    """The routed layer's output for ``x`` (T, H): ``compute(rows, local_index (N, 1), ones (N, 1))`` runs the
    bank's own forward on the rows this rank received (``params``: the bank's, for ``_Joined``); what is sent is
    counted in ``traffic``. Inside a compiled block (``compile=``) the exchange is traced in its graph."""
    tokens, k = index.shape
    # each tp rank sends a slice of the tokens, replicated over tp; f here, g at the end. Under sequence parallelism
    # the tp ranks hold different tokens already (their sequence shards): each sends its own, as at tp = 1
    if tp.size > 1 and tokens_sharded_over() is None:
        x, weight = copy_to_tp(x, tp), copy_to_tp(weight, tp)
        mine = torch.tensor_split(torch.arange(tokens, device=x.device), tp.size)[tp.rank]
        xs, index, weight = x[mine], index[mine], weight[mine]
    else:
        mine, xs = None, x
    local = experts // ep.size
    flat = index.reshape(-1)
    token = torch.arange(xs.shape[0], device=x.device).repeat_interleave(k)
    order = torch.argsort(flat, stable=True)
    if torch.compiler.is_compiling():
        return _traced(compute, x, xs, weight, mine, token, order, flat, experts=experts, ep=ep, tp=tp,
                       params=params, traffic=traffic)
    if x.is_meta:  # shapes only (the memory planner): the rows spread evenly over the experts and ranks
        counts = torch.full((experts,), flat.numel() // experts) + (torch.arange(experts) < flat.numel() % experts)
        received = counts.view(ep.size, local)[ep.rank].repeat(ep.size, 1)
    else:
        counts = torch.bincount(flat, minlength=experts)
        received = _counts_exchange(counts, ep)
    in_splits = counts.view(ep.size, local).sum(1).tolist()
    out_splits = received.sum(1).tolist()
    rows = _AllToAll.apply(xs[token[order]], out_splits, in_splits, ep, traffic)
    which = torch.arange(local, device=received.device).repeat(ep.size).repeat_interleave(received.reshape(-1))
    which = which.to(x.device)
    ones = torch.ones((rows.shape[0], 1), dtype=weight.dtype, device=x.device)
    done = _joined(compute(rows, which[:, None], ones), rows, params)
    back = _AllToAll.apply(done, in_splits, out_splits, ep, traffic)
    return _combined(back, x, xs, weight, mine, token, order, tp)


def _combined(back: Tensor, x: Tensor, xs: Tensor, weight: Tensor, mine: Optional[Tensor], token: Tensor,
              order: Tensor, tp: TPGroup) -> Tensor:
    """The rows back from the experts, unsorted, weighted and added per token (and summed over tp)."""
    unsorted = back.index_select(0, torch.argsort(order))
    weighted = unsorted * weight.reshape(-1, 1)
    out = xs.new_zeros(xs.shape).index_add(0, token, weighted.to(xs.dtype))
    if mine is None:
        return out
    return reduce_from_tp(x.new_zeros(x.shape).index_add(0, mine, out), tp)


def _traced(compute: Callable[[Tensor, Tensor, Tensor], Tensor], x: Tensor, xs: Tensor, weight: Tensor,
            mine: Optional[Tensor], token: Tensor, order: Tensor, flat: Tensor, *, experts: int, ep: TPGroup,
            tp: TPGroup, params: list[Tensor], traffic: Optional[Traffic]) -> Tensor:
    """:func:`dispatch` inside a compiled block (``compile=``): the same exchange with torch's functional
    collectives, which dynamo traces, their split sizes read from the routing as unbacked symbols
    (``capture_scalar_outputs``, set by ``compile=`` under ep): one graph across the block, the exchange in it."""
    funcol = functional_collectives()
    local = experts // ep.size
    counts = torch.zeros(experts, dtype=torch.long, device=flat.device).scatter_add_(0, flat, torch.ones_like(flat))
    received = funcol.all_to_all_single(counts, None, None, ep.group).view(ep.size, local)
    sent = counts.view(ep.size, local).sum(1)
    in_splits, out_splits = sent.tolist(), received.sum(1).tolist()
    for n in (*in_splits, *out_splits):
        known_size(n)
    wire = _on_wire(xs)
    rows = funcol.all_to_all_single_autograd(wire[token[order]], out_splits, in_splits, ep.group).to(x.dtype)
    which = torch.arange(local, device=x.device).repeat(ep.size).repeat_interleave(
        received.reshape(-1).to(x.device), output_size=sum(out_splits))
    ones = torch.ones((rows.shape[0], 1), dtype=weight.dtype, device=x.device)
    done = _joined(compute(rows, which[:, None], ones), rows, params)
    wire = _on_wire(done)
    back = funcol.all_to_all_single_autograd(wire, in_splits, out_splits, ep.group).to(done.dtype)
    if traffic is not None and traffic.pending is not None:  # rows that leave this rank, out and back, in forward
        # (and in backward, with gradients)
        row = math.prod(wire.shape[1:]) * wire.element_size()
        out = (sent.sum() - sent[ep.rank]) + (received.sum() - received[ep.rank].sum())
        traffic.pending.add_((2 if torch.is_grad_enabled() else 1) * row * out.to(traffic.pending.device))
    return _combined(back, x, xs, weight, mine, token, order, tp)
