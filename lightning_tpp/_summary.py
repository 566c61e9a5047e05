"""What the user sees: the tensor-parallel plan table, and a ModelSummary that counts whole parameters."""

from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Optional

from lightning.pytorch.utilities.model_summary.model_summary import (
    LayerSummary,
    ModelSummary,
    get_human_readable_count,
)
from torch import nn
from typing_extensions import override

from lightning_tpp._tp_plan import TPPlan


def full_numel(p: nn.Parameter) -> int:
    """Elements of the parameter in the single-device model (a shard counts for the whole tensor)."""
    shape = getattr(p, "_tpp_full_shape", None)
    return math.prod(shape) if shape is not None else p.numel()


def format_plan(model: nn.Module, plan: TPPlan, tp: int) -> str:
    """A table: every parallelised module, its style and parameters per rank vs in total; then the totals."""
    modules = dict(model.named_modules())
    rows = [("module", "type", "style", "params/rank", "params total")]
    for name, style in plan.styles.items():
        m = modules[name]
        own = list(m.parameters(recurse=style == "mha"))
        rows.append((name, getattr(m, "_tpp_orig_class", type(m)).__name__,
                     style, get_human_readable_count(sum(p.numel() for p in own)),
                     get_human_readable_count(sum(full_numel(p) for p in own))))
    params = list(model.parameters())
    local, total = sum(p.numel() for p in params), sum(full_numel(p) for p in params)
    sharded = sum(1 for p in params if hasattr(p, "_tpp_spec"))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"Tensor-parallel plan (tp={tp}): {len(plan.blocks)} blocks, {sharded} of {len(params)} parameter "
             f"tensors sharded, the rest replicated"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"parameters per rank: {get_human_readable_count(local)} of {get_human_readable_count(total)} "
                 f"({local / max(total, 1):.1%})")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


class _ShardedLayerSummary(LayerSummary):
    @property
    @override
    def num_parameters(self) -> int:
        return sum(full_numel(p) for p in self._module.parameters())


class ShardedModelSummary(ModelSummary):
    """Lightning's ModelSummary with whole-model parameter counts (it would otherwise count one rank's shards).

    ``totals`` (all, trainable), counted before pipeline stages dropped other stages' modules, replace the sums."""

    def __init__(self, model: Any, max_depth: int = 1, totals: Optional[tuple[int, int]] = None) -> None:
        self._totals = totals
        super().__init__(model, max_depth=max_depth)

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        summary: dict[str, Any] = OrderedDict((name, _ShardedLayerSummary(m)) for name, m in self.named_modules)
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for k in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[k]
        return summary

    @property
    @override
    def total_parameters(self) -> int:
        if self._totals is not None:
            return self._totals[0]
        return sum(full_numel(p) for p in self._model.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        if self._totals is not None:
            return self._totals[1]
        return sum(full_numel(p) for p in self._model.parameters() if p.requires_grad)
