"""The tensor-parallel plan as a table: what each module became and what it holds per rank; and the warning when it
shards less than half of the blocks."""

from __future__ import annotations

from typing import Optional

from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn

from lightning_tpp.core.params import ShardIndex
from lightning_tpp.core.swap import original_class
from lightning_tpp.tensor_parallel.layers import is_transposed_linear
from lightning_tpp.tensor_parallel.plan import TPPlan

# the usual names of projections that return to the model width (row-parallel); any other linear layer: colwise
_ROW_NAMES = ("o", "wo", "o_proj", "out_proj", "out", "proj", "c_proj", "dense", "down", "down_proj", "fc2", "w2",
              "to_out", "dense_4h_to_h", "linear2")


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


def coverage_warning(model: nn.Module, plan: TPPlan, tp: int, shards: ShardIndex, blocks: list[str]) -> Optional[str]:
    """A warning when the plan shards less than half of the parameters of ``blocks`` (this rank's repeated blocks):
    which blocks stay whole, why, and the ``tp_plan`` that would shard them (to check and adjust). None otherwise."""
    modules = dict(model.named_modules())
    total = sharded = 0
    whole: list[str] = []
    fraction: dict[str, float] = {}  # block -> share of its parameter elements that is sharded
    for name in blocks:
        params = list(modules[name].parameters())
        numel = [shards.full_numel(p) for p in params]
        cut = sum(n for p, n in zip(params, numel) if p in shards)
        total += sum(numel)
        sharded += cut
        fraction[name] = cut / max(sum(numel), 1)
        if not cut:
            whole.append(name)
    if not total or sharded >= total / 2:
        return None
    # the block to explain: a whole one, else the least sharded (every block partly cut: e.g. attention sharded,
    # a mixture of experts beside it left whole)
    first = whole[0] if whole else min(fraction, key=fraction.__getitem__)
    reasons = [f"  {n or '<root>'}: {why}" for n, why in plan.whole.items() if n == first or n.startswith(f"{first}.")]
    unsharded = [(n, m) for n, m in modules[first].named_modules()
                 if any(p not in shards for p in m.parameters(recurse=False))]
    linears = [n for n, m in unsharded if isinstance(m, nn.Linear) or is_transposed_linear(m)]
    if not whole:  # what stays whole inside the partly sharded block, largest first
        left = sorted(((sum(shards.full_numel(p) for p in m.parameters(recurse=False) if p not in shards), n)
                       for n, m in unsharded), reverse=True)
        reasons += [f"  {first}.{n}".rstrip(".") + f": {get_human_readable_count(k)} parameters left whole"
                    for k, n in left[:4]]
    pattern = lambda n: f"{_glob(first)}.{n}"  # noqa: E731
    suggestion = {pattern(n): "rowwise" if n.rpartition(".")[2] in _ROW_NAMES else "colwise" for n in linears}
    listed = ", ".join(whole[:4]) + (f" and {len(whole) - 4} more" if len(whole) > 4 else "")
    stay = (f"{len(whole)} of {len(blocks)} blocks stay whole on every tp rank ({listed})" if whole else
            f"every block is only partly sharded ({fraction[first]:.0%} of {first})")
    fix = (f"\nTo shard them, pass tp_plan= with the block's projections, e.g. (check which layers read the block's "
           f"input and which return to its width):\n  {suggestion}" if suggestion else "")
    return (f"tensor parallelism (tp={tp}) shards only {sharded / total:.0%} of the block parameters: {stay}. Why, "
            f"for {first} ({original_class(modules[first]).__name__}):\n" +
            ("\n".join(reasons) or "  no attention or MLP layout recognised") + fix)


def _glob(name: str) -> str:
    """``blocks.3`` -> ``blocks.*`` (every block of the list)."""
    parts = name.split(".")
    return ".".join("*" if p.isdigit() else p for p in parts)
