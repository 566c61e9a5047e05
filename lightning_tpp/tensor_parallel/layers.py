"""Tensor-parallel versions of the layers the plan can name, made by swapping the instance's class.

The swap keeps the original module object, its attribute names and its ``state_dict`` keys (so checkpoints keep the
single-device names) and ``isinstance`` checks in user code keep passing: ``ColumnParallelLinear`` *is* an
``nn.Linear``. Parameters are replaced by this rank's shard (see :mod:`lightning_tpp.core.sharding`)::

    column parallel   y_r = x W_r^T + b_r        W split along the output dim; y stays split (or is all-gathered)
    row parallel      y = sum_r x_r W_r^T + b    W split along the input dim; partial sums all-reduced, then + b
    vocab parallel    e = sum_r E_r[ids]         each rank looks up the ids in its vocabulary range, zeros elsewhere
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_tpp.core.comm import TPGroup, TPScope, copy_to_tp, gather_from_tp, reduce_from_tp
from lightning_tpp.core.params import ShardInfo
from lightning_tpp.core.swap import original_class
from lightning_tpp.core.vocab_cut import VocabCut
from lightning_tpp.tensor_parallel.kv_share import summed_shared
from lightning_tpp.tensor_parallel.loss import VocabShardedLogits
from lightning_tpp.tensor_parallel.rng import mark_replicated, mark_sharded
from lightning_tpp.tensor_parallel.sequence_region import column_input, row_reduce


@dataclass
class LayerTP:
    """What a parallel layer needs at run time: the one slot (``_tpp_layer``) a swapped layer carries."""

    group: TPGroup
    scope: Optional[TPScope] = None  # shared with sibling layers that read the same input (one f for q, k, v)
    gather: bool = False  # column parallel: all-gather the output (an LM head whose logits are used whole)
    loss_parallel: bool = True  # ... and F.cross_entropy of them computed from the shards (tensor_parallel.loss)
    heads: int = 0  # nn.MultiheadAttention: the global number of heads
    vocab_start: int = 0  # vocab-parallel embedding: the first id of this rank's range
    padding_idx: Optional[int] = None  # ... and the padding id within it, if it falls there
    check: Optional[Callable[[nn.Module, tuple, dict, Any], None]] = None  # numerical check at the first call
    shared: dict[str, ShardInfo] = field(default_factory=dict)  # column parallel: rows other ranks hold too (K/V)
    rejoin: bool = False  # row parallel: the output's gradient is a part on each rank, all-reduced (BlockInfo.rejoin)


def is_transposed_linear(module: nn.Module) -> bool:
    """Hugging Face ``Conv1D`` (GPT-2): ``y = x @ W + b`` with ``W`` of shape ``(in, out)``."""
    return (original_class(module).__name__ == "Conv1D" and hasattr(module, "nf")
            and getattr(module, "weight", None) is not None)


def is_linear(module: nn.Module) -> bool:
    """An ``nn.Linear`` or a ``Conv1D``."""
    return isinstance(module, nn.Linear) or is_transposed_linear(module)


def linear_dims(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of an ``nn.Linear`` or a ``Conv1D``."""
    w = module.weight
    return (w.shape[0], w.shape[1]) if is_transposed_linear(module) else (w.shape[1], w.shape[0])


def _column_input(tp: LayerTP, x: Tensor) -> Tensor:
    """``f`` (copy_to_tp, shared through the block's scope), or under sequence parallelism the gathered stream's
    alias (whose backward reduce-scatters instead)."""
    alias = column_input(x)
    if alias is not None:
        return alias
    return tp.scope.copy(x) if tp.scope is not None else copy_to_tp(x, tp.group)


class _ColumnParallel:
    """Output dim split; input passes through ``copy_to_tp`` (shared with sibling layers via the block's scope)."""

    _tpp_layer: LayerTP

    def forward(self, x: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        tp = self._tpp_layer
        x = _column_input(tp, x)
        with summed_shared(self, tp.shared, tp.group):  # type: ignore[arg-type]
            y = super().forward(x, *args, **kwargs)  # type: ignore[misc]
        if tp.gather and isinstance(y, VocabCut):  # context parallelism cut these columns again: they stay cut
            return y.joined(tp.group)
        if tp.gather:
            local, y = y, gather_from_tp(y, tp.group)
            _first_call_check(self, (x, *args), kwargs, y)
            if tp.loss_parallel and tp.group.size > 1:
                y = VocabShardedLogits.wrap(y, local, tp.group, tp.group.rank * local.shape[-1])
        else:
            mark_sharded(y)  # dropout over it (or what is computed from it) draws per tp rank
        return y


class _RowParallel:
    """Input dim split; partial products all-reduced; the bias (replicated) is added once, after the reduction."""

    _tpp_layer: LayerTP
    weight: Tensor
    bias: Optional[Tensor]

    def forward(self, x: Tensor) -> Tensor:
        if is_transposed_linear(self):  # type: ignore[arg-type]
            y = torch.matmul(x, self.weight)
        else:
            y = F.linear(x, self.weight)
        group = self._tpp_layer.group
        scattered = None if self._tpp_layer.rejoin else row_reduce(y)  # sequence parallelism: reduce-scattered
        if self._tpp_layer.rejoin:  # read by this rank's channels only: each rank's gradient of it is a part
            y = copy_to_tp(reduce_from_tp(y, group), group)
        elif scattered is None:
            y = reduce_from_tp(y, group)
        else:
            y = scattered
        y = y + self.bias if self.bias is not None else y
        if scattered is None:
            mark_replicated(y)
        else:
            mark_sharded(y)  # this rank's part of the sequence: dropout over it draws per tp rank
        return y


class _VocabParallelEmbedding:
    """Rows of the table split by vocabulary range; out-of-range ids contribute zeros before the all-reduce. A
    subclass's own forward (Gemma's scaled embedding) runs as written, its lookup made vocab-parallel."""

    _tpp_layer: LayerTP
    weight: Tensor
    max_norm: Optional[float]
    norm_type: float

    def forward(self, ids: Tensor, *args: Any, **kwargs: Any) -> Tensor:
        if original_class(self).forward is nn.Embedding.forward:  # type: ignore[arg-type]
            out = self.vocab_lookup(ids)
        else:
            with _LookupOf(self):
                out = super().forward(ids, *args, **kwargs)  # type: ignore[misc]
        _first_call_check(self, (ids, *args), kwargs, out)
        return out

    def vocab_lookup(self, ids: Tensor) -> Tensor:
        local_vocab = self.weight.shape[0]
        shifted = ids - self._tpp_layer.vocab_start
        outside = (shifted < 0) | (shifted >= local_vocab)
        out = F.embedding(shifted.masked_fill(outside, 0), self.weight, self._tpp_layer.padding_idx, self.max_norm,
                          self.norm_type)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self._tpp_layer.group)


class _LookupOf(TorchFunctionMode):
    """Inside a vocab-parallel embedding's own forward: ``F.embedding`` on its weight is the vocab-parallel lookup."""

    def __init__(self, layer: _VocabParallelEmbedding) -> None:
        super().__init__()
        self.layer = layer

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        weight = args[1] if len(args) > 1 else kwargs.get("weight")
        if func is F.embedding and weight is self.layer.weight:
            return self.layer.vocab_lookup(args[0] if args else kwargs["input"])
        return func(*args, **kwargs)


def _first_call_check(layer: nn.Module, args: tuple, kwargs: dict, out: Any) -> None:
    tp: LayerTP = layer._tpp_layer  # type: ignore[assignment]
    if tp.check is not None:
        check, tp.check = tp.check, None
        check(layer, args, kwargs, out)


def _float_mask(mask: Tensor, dtype: torch.dtype) -> Tensor:
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, float("-inf"))
    return mask.to(dtype)


class _ParallelMultiheadAttention:
    """``nn.MultiheadAttention`` with this rank's heads: ``in_proj_weight`` holds ``[q_r; k_r; v_r]``.

    Same call signature and masks semantics as torch (bool masks: ``True`` = not allowed). ``out_proj`` is row
    parallel. ``_qkv_same_embed_dim`` is set to ``False`` so that torch's fused inference fast paths (which would read
    the local shards as if they were whole) are never taken.
    """

    _tpp_layer: LayerTP  # group, scope and the global number of heads

    def forward(  # noqa: PLR0913 - torch's signature
        self, query: Tensor, key: Tensor, value: Tensor, key_padding_mask: Optional[Tensor] = None,
        need_weights: bool = True, attn_mask: Optional[Tensor] = None, average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Optional[Tensor]]:
        mha: Any = self
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = query.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0)
            key_padding_mask = key_padding_mask.unsqueeze(0) if key_padding_mask is not None else None
        elif not mha.batch_first:
            query, key, value = query.transpose(0, 1), key.transpose(0, 1), value.transpose(0, 1)
        b, t, _ = query.shape
        s = key.shape[1]
        h, hd, group = mha.num_heads, mha.head_dim, self._tpp_layer.group
        wq, wk, wv = mha.in_proj_weight.chunk(3)
        bq, bk, bv = mha.in_proj_bias.chunk(3) if mha.in_proj_bias is not None else (None, None, None)
        assert self._tpp_layer.scope is not None  # q, k and v of one input share its f
        q = F.linear(_column_input(self._tpp_layer, query), wq, bq).view(b, t, h, hd).transpose(1, 2)
        k = F.linear(_column_input(self._tpp_layer, key), wk, bk).view(b, s, h, hd).transpose(1, 2)
        v = F.linear(_column_input(self._tpp_layer, value), wv, bv).view(b, s, h, hd).transpose(1, 2)
        for part in (q, k, v):
            mark_sharded(part)  # this rank's heads: attention dropout draws per tp rank

        mask = None
        if attn_mask is not None:
            am = _float_mask(attn_mask, q.dtype)
            mask = am.view(b, self._tpp_layer.heads, t, s)[:, group.rank * h:(group.rank + 1) * h] if am.dim() == 3 \
                else am.view(1, 1, t, s)
        if key_padding_mask is not None:
            kp = _float_mask(key_padding_mask, q.dtype).view(b, 1, 1, s)
            mask = kp if mask is None else mask + kp
        dropout = mha.dropout if mha.training else 0.0
        weights = None
        if need_weights:
            scores = torch.matmul(q, k.transpose(-2, -1)) / math.sqrt(hd)
            attn = torch.softmax(scores + mask if mask is not None else scores, dim=-1)
            out = torch.matmul(F.dropout(attn, dropout, mha.training), v)
            if average_attn_weights:
                weights = reduce_from_tp(attn.sum(dim=1), group) / self._tpp_layer.heads
            else:
                weights = gather_from_tp(attn.transpose(1, -1), group).transpose(1, -1)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout,
                                                 is_causal=is_causal and mask is None)
        out = mha.out_proj(out.transpose(1, 2).reshape(b, t, h * hd))
        if unbatched:
            out = out.squeeze(0)
            weights = weights.squeeze(0) if weights is not None else None
        else:  # torch's layer returns (t, b, width) in memory, viewed (b, t, width) when batch_first: a dropout over
            # the output draws its mask in memory order, so the strides decide which elements it drops
            out = out.transpose(0, 1).contiguous()
            out = out.transpose(0, 1) if mha.batch_first else out
        return out, weights
