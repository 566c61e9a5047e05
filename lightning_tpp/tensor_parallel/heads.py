"""Per-head side tensors of a head-parallel attention: a relative position bias (T5's, computed by the first layer
from an ``nn.Embedding(buckets, heads)`` and passed to the others), ALiBi slopes, any bias indexed by head.

Inside a tensor-parallel attention the scores hold this rank's heads only, ``(B, heads / tp, S, S)``, while such a
tensor is made whole, ``(1, heads, S, S)``. Where the two meet in an element-wise operation (which could not
broadcast: ``heads`` against ``heads / tp`` at the same dimension) the whole one is cut to this rank's heads::

    scores (B, h/tp, S, S)  +  bias (1, h, S, S)   ->   scores + bias[:, rank*h/tp : (rank+1)*h/tp]

The cut passes through ``copy_to_tp`` first, so the bias's gradient (each rank's heads' part) is summed over tp: the
table that made it (kept whole, it is small) gets one process's gradient on every rank. Any tensor of the block
works alike, whatever its name or where it was made.

The first-call check runs the original block whole; a per-head tensor that reached it cut (a bias made inside an
earlier parallel block from a local head count, as T5's cross-attention makes its zeros) is gathered back there
(:class:`WholeHeads`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch
from torch import Tensor
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


def _operands(func: Any, args: tuple, kwargs: dict) -> Optional[tuple[Any, Any]]:
    """Keys (an index into ``args`` or a name in ``kwargs``) of the two tensors that must agree in heads: the two
    operands of an element-wise operation, or ``scaled_dot_product_attention``'s mask and query."""
    name = getattr(func, "__name__", "")
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
        if dim is not None:
            args, kwargs = list(args), dict(kwargs)
            target = kwargs if isinstance(whole, str) else args
            target[whole] = fix(get(whole), dim)
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
