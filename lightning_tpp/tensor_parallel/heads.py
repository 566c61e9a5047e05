"""Per-head side tensors of a head-parallel attention: a relative position bias (T5's, computed by the first layer
from an ``nn.Embedding(buckets, heads)`` and passed to the others), ALiBi slopes, any bias indexed by head.

Inside a tensor-parallel attention the scores hold this rank's heads only, ``(B, heads / tp, S, S)``, while such a
tensor is made whole, ``(1, heads, S, S)``. Where the two meet in an element-wise operation (which could not
broadcast: ``heads`` against ``heads / tp`` at the same dimension) the whole one is cut to this rank's heads::

    scores (B, h/tp, S, S)  +  bias (1, h, S, S)   ->   scores + bias[:, rank*h/tp : (rank+1)*h/tp]

The cut passes through ``copy_to_tp`` first, so the bias's gradient (each rank's heads' part) is summed over tp: the
table that made it (kept whole, it is small) gets one process's gradient on every rank. Any tensor of the block
works alike, whatever its name or where it was made.

A bias whose batch and heads are one dimension, ``(batch * heads, 1, S)`` (BLOOM's ALiBi, added by ``baddbmm`` to
the scores of ``(batch * heads / tp)`` matrices), is cut alike, each sequence's heads in turn.

The first-call check runs the original block whole; a per-head tensor that reached it cut (a bias made inside an
earlier parallel block from a local head count, as T5's cross-attention makes its zeros) is gathered back there
(:class:`WholeHeads`).

A *parameter* of the attention read per head (gpt-oss's learned sink logit per head, concatenated to the scores; a
per-head gate or slope) is cut with the heads instead, once, by :func:`per_head_parameters`: each rank holds its
heads' entries, in the q projection's head order, recorded with the other shards (checkpoints see it whole)::

    sinks (h,)  ->  rank r: sinks[r*h/tp : (r+1)*h/tp]        q columns of rank r: heads r*h/tp .. (r+1)*h/tp - 1
"""

from __future__ import annotations

from typing import Any, Callable, Collection, Optional

import torch
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_tpp.core.comm import TPGroup, copy_to_tp, gather_from_tp

# element-wise operations of two tensors that broadcast
BINARY = frozenset(f"{p}{op}{s}" for op in ("add", "sub", "mul", "div", "truediv") for p, s in
                   (("", ""), ("", "_"), ("__", "__"), ("__i", "__"), ("__r", "__"))) | {"where", "masked_fill"}


def _head_dim(whole: Tensor, part: Tensor, heads: int, tp: int) -> Optional[int]:
    """The dimension (counted from the right) at which ``whole`` has ``heads`` and ``part`` this rank's share."""
    local = heads // tp
    if local < 1:
        return None
    # one head per rank: a size-1 dim also broadcasts, and a batch of as many sequences as heads looks like heads:
    # only attention's head dim, (..., heads, S, S) or (B, heads, S, D), counts (the first-call check has the rest)
    for i in range(1, min(whole.dim(), part.dim()) + 1) if local > 1 else (3,) * (min(whole.dim(), part.dim()) >= 3):
        if whole.shape[-i] == heads and part.shape[-i] == local:
            return whole.dim() - i
    return None


def _merged(whole: Tensor, part: Tensor, heads: int, tp: int) -> bool:
    """``whole`` is ``(batch * heads, ...)`` where ``part`` is ``(batch * heads / tp, ...)`` (a batched matrix
    product's batch)."""
    local = heads // tp
    return (local >= 1 and whole.dim() == part.dim() == 3 and whole.shape[0] % heads == 0
            and part.shape[0] * tp == whole.shape[0])


def _operands(func: Any, args: tuple, kwargs: dict) -> Optional[tuple[Any, Any]]:
    """Keys (an index into ``args`` or a name in ``kwargs``) of the two tensors that must agree in heads: the two
    operands of an element-wise operation, ``scaled_dot_product_attention``'s mask and query, or ``baddbmm``'s
    added input and first batch of matrices."""
    name = getattr(func, "__name__", "")
    if name == "baddbmm":
        first = "batch1" if isinstance(kwargs.get("batch1"), Tensor) else 1
        return (0, first) if args and isinstance(args[0], Tensor) and (first == "batch1" or len(args) > 1) else None
    if name == "scaled_dot_product_attention":
        mask = "attn_mask" if isinstance(kwargs.get("attn_mask"), Tensor) else 3
        return (mask, 0) if mask != 3 or len(args) > 3 and isinstance(args[3], Tensor) else None
    if name not in BINARY:
        return None
    found = [i for i, a in enumerate(args[:3]) if isinstance(a, Tensor)]
    return (found[0], found[1]) if len(found) >= 2 else None


def _aligned(func: Any, args: tuple, kwargs: dict, heads: int, tp: int, fix: Callable[[Tensor, int], Tensor]
             ) -> tuple[tuple, dict]:
    """``args``/``kwargs`` with ``fix(tensor, dim)`` applied to the operand that has ``heads`` where the other has
    this rank's share of them."""
    keys = _operands(func, args, kwargs) if heads else None
    if keys is None:
        return args, kwargs
    get = lambda k: kwargs[k] if isinstance(k, str) else args[k]  # noqa: E731
    for whole, part in (keys, keys[::-1]):
        dim = _head_dim(get(whole), get(part), heads, tp)
        merged = dim is None and getattr(func, "__name__", "") == "baddbmm" and _merged(get(whole), get(part),
                                                                                      heads, tp)
        if dim is not None or merged:
            args, kwargs = list(args), dict(kwargs)
            target = kwargs if isinstance(whole, str) else args
            t = get(whole)
            # (batch * heads, ...) cut as (batch, heads, ...) at the heads, then merged back
            target[whole] = fix(t.unflatten(0, (-1, heads)), 1).flatten(0, 1) if merged else fix(t, dim)
            return tuple(args), kwargs
    return args, kwargs


def to_local_heads(func: Any, args: tuple, kwargs: dict, heads: int, group: TPGroup) -> tuple[tuple, dict]:
    """A whole per-head tensor cut to this rank's heads where it meets a local one (see above)."""
    n = heads // group.size if heads else 0

    def cut(t: Tensor, dim: int) -> Tensor:
        return (copy_to_tp(t, group) if torch.is_grad_enabled() else t).narrow(dim, group.rank * n, n)

    return _aligned(func, args, kwargs, heads, group.size, cut)


class WholeHeads(TorchFunctionMode):
    """The original block's forward (first-call check): a per-head tensor that arrives cut is gathered whole."""

    def __init__(self, heads: int, group: TPGroup) -> None:
        super().__init__()
        self.heads, self.group = heads, group

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        # the roles swap: here the whole tensor is the block's, the operand with a share of the heads is gathered
        tp, local = self.group.size, self.heads // self.group.size

        def gather(t: Tensor, dim: int) -> Tensor:
            return gather_from_tp(t.movedim(dim, -1).contiguous(), self.group).movedim(-1, dim)

        keys = _operands(func, args, kwargs or {}) if local >= 1 else None
        if keys is not None:
            get = lambda k: (kwargs or {})[k] if isinstance(k, str) else args[k]  # noqa: E731
            for whole, part in (keys, keys[::-1]):
                dim = _head_dim(get(whole), get(part), self.heads, tp)
                if dim is not None:
                    args, kwargs = list(args), dict(kwargs or {})
                    target = kwargs if isinstance(part, str) else args
                    target[part] = gather(get(part), dim - get(whole).dim() + get(part).dim())
                    break
        return func(*tuple(args), **(kwargs or {}))


def per_head_parameters(module: nn.Module, heads: int, head_dim: int, skip: Collection[int],
                        scored: Optional[Collection[str]] = None) -> dict[str, bool]:
    """The parameters of an attention ``module`` read per head, to be cut with the heads: name (relative to
    ``module``) -> whether a traced forward saw them read per head. A parameter qualifies by what the forward does
    with it, not by its name: its leading dimension is the head count, and

    * ``scored`` given (the forward was traced on made-up inputs, ``LinearFlow.scored``): its values met the
      attention's scores, probabilities or weighted values (a sink logit concatenated to the scores, a slope added
      to them, a gate on each head's output);
    * else (a forward that needs rotary tables or a mask): it is the attention's own parameter (not a norm's or
      another child's), and the head count is not also the head size (a per-head norm's weight would have it). The
      block's first-call check then confirms the cut: a parameter that is not read per head fails it.

    ``skip``: ids of modules whose parameters never qualify (the block's linear layers, blocks inside it)."""
    out: dict[str, bool] = {}
    for mname, sub in module.named_modules():
        if any(id(m) in skip for m in _path(module, mname)):
            continue
        for pname, p in sub.named_parameters(recurse=False):
            name = f"{mname}.{pname}" if mname else pname
            if p.dim() == 0 or p.shape[0] != heads or heads < 2:
                continue
            if scored is not None:
                if name in scored:
                    out[name] = True
            elif not mname and heads != head_dim:
                out[name] = False
    return out


def _path(module: nn.Module, name: str) -> list[nn.Module]:
    """The modules from ``module``'s child down to ``name``."""
    out, m = [], module
    for part in name.split(".") if name else ():
        m = getattr(m, part)
        out.append(m)
    return out
