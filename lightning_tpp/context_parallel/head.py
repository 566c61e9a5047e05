"""The LM head under context parallelism: the whole sequence on every cp rank, ``1 / cp`` of the vocabulary each.

The blocks hand the head the whole sequence (their last one gathers it), so the model's own code after them — the
final norm, the head, the user's label shift and loss — sees what one process sees. The head's logits are what
would not fit: ``tokens x vocabulary`` (262,144 x 128,256 in fp32 is 125 GiB). So each cp rank computes its columns
of them only, as tensor parallelism's vocabulary-parallel head does with its shard::

    rank r:  y_r = x W_r^T + b_r      W_r: rows start_r .. start_r + V/cp of the head's weight (torch.chunk's rule)

and the head returns a :class:`~lightning_tpp.core.vocab_cut.VocabCut`: the whole logits' shape, this rank's columns
inside. ``F.cross_entropy`` of it is computed from the columns (a max, a sum of exponentials and the target's logit
all-reduced over cp), so no rank holds whole logits or their log-softmax; the shape operations of a loss keep the cut;
anything else gathers them (``core.vocab_cut``).

Gradients follow the strategy's one rule for cp (``split.py``): a rank carries cp times the gradient of what it
computed, and averaging over dp x cp gives one process's. The head's input gradient is a sum over the ranks' columns
(all-reduced over cp); its weight's rows get ``cp x`` their gradient on the rank that computed them, zero elsewhere.

Under tensor parallelism the head is already cut over tp; cp cuts each tp shard again, and the logits stay cut over
tp x cp (the tp layer joins the cut instead of gathering). Only ``F.linear`` on the head's own weight inside its own
forward is cut: a weight read elsewhere (``h @ self.lm_head.weight.T`` in the model's forward) gives whole logits,
exactly as before.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_tpp.core.comm import TPGroup, copy_to_tp
from lightning_tpp.core.swap import original_class, swap_class
from lightning_tpp.core.vocab_cut import Cut, VocabCut
from lightning_tpp.core.walk import ancestors


def column_widths(columns: int, parts: int) -> tuple[int, ...]:
    """Columns of each rank (``torch.chunk``'s rule; the last ranks may hold fewer)."""
    each = -(-columns // parts)
    return tuple(max(0, min(each, columns - r * each)) for r in range(parts))


def vocab_heads(module: nn.Module, blocks: Sequence[str]) -> list[str]:
    """The LM heads: linear layers outside the blocks mapping an embedding's width to its vocabulary (``D -> V``,
    ``V >= D``), found on the whole model (under a pipeline, before the stages drop the embedding)."""
    vocabularies = {(m.embedding_dim, m.num_embeddings) for m in module.modules()
                    if isinstance(m, nn.Embedding) and m.num_embeddings >= m.embedding_dim}
    return [name for name, m in module.named_modules()
            if issubclass(original_class(m), nn.Linear) and not any(name == b or name.startswith(b + ".") for b in blocks)
            and (m.in_features, m.out_features) in vocabularies]


@dataclass
class HeadSlot:
    """What a cut head needs at run time."""

    name: str
    group: TPGroup


def cut_heads(module: nn.Module, names: Sequence[str], group: TPGroup,
              twins: Optional[dict[str, nn.Module]] = None) -> list[str]:
    """Cut the heads ``names`` this rank holds over the cp ``group``; returns those cut. Under a pipeline the heads'
    meta ``twins`` are cut too: the route trace runs the step on zeros shaped like their outputs (cut, not whole)."""
    modules = dict(module.named_modules())
    cut = []
    for name in names:
        twin_of = next((n for n in reversed(ancestors(name) + [name]) if n in (twins or {})), None)
        if twin_of is not None:
            twin = twins[twin_of] if name == twin_of else twins[twin_of].get_submodule(name[len(twin_of) + 1:])
            _cut(twin, HeadSlot(name, group))
        m = modules.get(name)
        if m is None or not isinstance(m.__dict__["_parameters"].get("weight"), Tensor):  # another stage's stand-in
            continue
        _cut(m, HeadSlot(name, group))
        cut.append(name)
    return cut


def _cut(m: nn.Module, slot: HeadSlot) -> None:
    if not isinstance(m, _ContextHead):
        m._tpp_cp_head = slot
        swap_class(m, _ContextHead)


class _ContextHead:
    """The head's own forward, its ``F.linear`` on its weight computing this rank's columns (see above)."""

    _tpp_cp_head: HeadSlot
    weight: Tensor

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        with _HeadMode(self):
            return super().forward(*args, **kwargs)  # type: ignore[misc]


class _HeadMode(TorchFunctionMode):
    def __init__(self, head: _ContextHead) -> None:
        super().__init__()
        self.head = head

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is F.linear:
            given = {**dict(zip(("input", "weight", "bias"), args)), **kwargs}
            if given.get("weight") is self.head.weight:
                return cut_linear(given["input"], given["weight"], given.get("bias"), self.head._tpp_cp_head)
        return func(*args, **kwargs)


def cut_linear(x: Tensor, weight: Tensor, bias: Optional[Tensor], slot: HeadSlot) -> VocabCut:
    """``F.linear(x, weight, bias)`` as this rank's columns of the output (see the module docstring)."""
    group = slot.group
    widths = column_widths(weight.shape[0], group.size)
    start = sum(widths[:group.rank])
    stop = start + widths[group.rank]
    x = copy_to_tp(x, group)  # backward: the input's gradient from every rank's columns, summed
    w = _Rows.apply(weight, start, stop, group.size)
    b = _Rows.apply(bias, start, stop, group.size) if bias is not None else None
    local = F.linear(x, w, b)
    return VocabCut(local, (*local.shape[:-1], weight.shape[0]), Cut(((group, widths),), start), slot.name)


class _Rows(torch.autograd.Function):
    """Rows ``start .. stop`` of a parameter; backward: their gradient times ``scale`` (cp), zeros elsewhere."""

    @staticmethod
    def forward(ctx: Any, p: Tensor, start: int, stop: int, scale: int) -> Tensor:
        ctx.shape, ctx.start, ctx.stop, ctx.scale = p.shape, start, stop, scale
        return p[start:stop]

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        out = grad.new_zeros(ctx.shape)
        out[ctx.start:ctx.stop] = grad * ctx.scale
        return out, None, None, None
