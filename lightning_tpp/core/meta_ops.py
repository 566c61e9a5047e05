"""Shape-only runs of data-dependent operations on the meta device.

A routed layer (a mixture of experts) finds which tokens each expert got (``nonzero``, ``torch.where(mask)``) and may
run its experts through a grouped matmul whose meta kernel checks dtypes the real one does not. On the meta device,
where only output shapes are wanted (a pipeline stage's stand-in for another stage's layer, the memory planner), this
mode answers them: index-finding ops find nothing (no token reaches an expert: the layer's output keeps its
shape, filled by whatever the layer starts from), and grouped matmuls return their output's shape.
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


def _grouped_mm_shape(a: Tensor, b: Tensor, out_dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    if a.dim() == 2 and b.dim() == 3:  # tokens sorted by group (offsets) x one matrix per group
        shape = (a.shape[0], b.shape[-1])
    elif a.dim() == 3 and b.dim() == 3:
        shape = (a.shape[0], a.shape[1], b.shape[-1])
    else:
        return None
    return torch.empty(shape, dtype=out_dtype or a.dtype, device="meta")


class DataDependentOnMeta(TorchFunctionMode):
    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        first = args[0] if args and isinstance(args[0], Tensor) else None
        if first is not None and first.is_meta:
            if func in _FINDERS:
                return _nothing(first, bool(kwargs.get("as_tuple", False)))
            if func is torch.where and len(args) == 1 and not kwargs:
                return _nothing(first, True)
            if func is getattr(torch, "_grouped_mm", None) and len(args) >= 2 and isinstance(args[1], Tensor):
                out = _grouped_mm_shape(first, args[1], kwargs.get("out_dtype"))
                if out is not None:
                    return out
        return func(*args, **kwargs)
