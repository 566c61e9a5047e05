"""Shape-only runs of data-dependent operations on the meta device.

A routed layer (a mixture of experts) finds which tokens each expert got (``nonzero``, ``torch.where(mask)``) and may
run its experts through a grouped matmul whose meta kernel checks dtypes the real one does not. On the meta device,
where only output shapes are wanted (a pipeline stage's stand-in for another stage's layer, the memory planner), this
mode answers them: index-finding ops find nothing (no token reaches an expert: the layer's output keeps its
shape, filled by whatever the layer starts from), and grouped matmuls run their meta kernel in the one dtype it
takes (every token reaches its experts: the path transformers takes by default).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

_FINDERS = (torch.nonzero, Tensor.nonzero, torch.argwhere, Tensor.argwhere)


def _nothing(t: Tensor, as_tuple: bool) -> Any:
    if as_tuple:
        return tuple(torch.empty(0, dtype=torch.long, device="meta") for _ in range(max(t.dim(), 1)))
    return torch.empty(0, t.dim(), dtype=torch.long, device="meta")


class _GroupedMM(torch.autograd.Function):
    """The grouped matmul's meta kernel run in bfloat16 (the one dtype it takes), cast back; it saves its two inputs
    for backward as the real kernel does (a memory measurement sees the tokens, not a copy of the weights)."""

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor, func: Any, rest: tuple, kwargs: dict) -> Tensor:
        ctx.save_for_backward(a, b)
        dtype = kwargs.get("out_dtype") or a.dtype
        low = {k: v for k, v in kwargs.items() if k != "out_dtype"}
        return func(a.to(torch.bfloat16), b.to(torch.bfloat16), *rest, **low).to(dtype)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Any:  # shapes only
        a, b = ctx.saved_tensors
        return torch.empty_like(a), torch.empty_like(b), None, None, None


def _grouped_mm(func: Any, args: tuple, kwargs: dict) -> Tensor:
    a, b, *rest = args
    return _GroupedMM.apply(a, b, func, tuple(rest), kwargs)


class DataDependentOnMeta(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], Tensor) else None
        if first is not None and first.is_meta:
            if func in _FINDERS:
                return _nothing(first, bool(kwargs.get("as_tuple", False)))
            if func is torch.where and len(args) == 1 and not kwargs:
                return _nothing(first, True)
            if (func is getattr(torch, "_grouped_mm", None) and len(args) >= 2 and isinstance(args[1], Tensor)
                    and first.dtype != torch.bfloat16):
                return _grouped_mm(func, args, kwargs)
        return func(*args, **kwargs)
