"""The tensor-parallel plan as a table: what each module became and what it holds per rank."""

from __future__ import annotations

from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn

from lightning_tpp.core.params import ShardIndex
from lightning_tpp.core.swap import original_class
from lightning_tpp.tensor_parallel.plan import TPPlan


def format_plan(model: nn.Module, plan: TPPlan, tp: int, shards: ShardIndex) -> str:
    """A table: every parallelised module, its style and parameters per rank vs in total; then the totals."""
    modules = dict(model.named_modules())
    rows = [("module", "type", "style", "params/rank", "params total")]
    for name, style in plan.styles.items():
        m = modules[name]
        own = list(m.parameters(recurse=style == "mha"))
        rows.append((name, original_class(m).__name__,
                     style, get_human_readable_count(sum(p.numel() for p in own)),
                     get_human_readable_count(sum(shards.full_numel(p) for p in own))))
    params = list(model.parameters())
    local, total = sum(p.numel() for p in params), sum(shards.full_numel(p) for p in params)
    sharded = sum(1 for p in params if p in shards)
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"Tensor-parallel plan (tp={tp}): {len(plan.blocks)} blocks, {sharded} of {len(params)} parameter "
             f"tensors sharded, the rest replicated"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in rows]
    lines.append(f"parameters per rank: {get_human_readable_count(local)} of {get_human_readable_count(total)} "
                 f"({local / max(total, 1):.1%})")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
