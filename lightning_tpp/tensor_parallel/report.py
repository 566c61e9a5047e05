"""The tensor-parallel plan as a table: what each module became and what it holds per rank (every pipeline rank's
modules, totals of the whole model); and the warning when it shards less than half of the blocks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
from torch import nn

from lightning_tpp.core.params import ShardIndex
from lightning_tpp.core.swap import original_class
from lightning_tpp.tensor_parallel.layers import is_transposed_linear
from lightning_tpp.tensor_parallel.plan import TPPlan

# the usual names of projections that return to the model width (row-parallel); any other linear layer: colwise
_ROW_NAMES = ("o", "wo", "o_proj", "out_proj", "out", "proj", "c_proj", "dense", "down", "down_proj", "fc2", "w2",
              "to_out", "dense_4h_to_h", "linear2")


@dataclass(frozen=True)
class PlanRows:
    """One pipeline rank's part of the plan table, as plain data: under a pipeline each rank knows only the modules
    of its own stage(s), so the parts are gathered to rank 0 (an object collective over the pp group) and printed as
    one table for the whole model."""

    rows: tuple[tuple[str, str, str, str, str], ...]  # module, type, style, params/rank, params total
    local: int  # parameter elements this rank holds
    whole: int  # the same parameters counted whole (before tensor parallelism cut them)
    sharded: int  # parameter tensors cut
    tensors: int  # parameter tensors held
    blocks: tuple[str, ...]  # the blocks the plan found (under a pipeline each rank may see every stage's)
    notes: tuple[str, ...]


def plan_rows(model: nn.Module, plan: TPPlan, shards: ShardIndex) -> PlanRows:
    """Every parallelised module of this rank, its style and parameters per rank vs in total; and this rank's sums."""
    modules = dict(model.named_modules())
    rows = []
    for name, style in plan.styles.items():
        m = modules[name]
        own = list(m.parameters(recurse=style == "mha"))
        rows.append((name, original_class(m).__name__, style, get_human_readable_count(sum(p.numel() for p in own)),
                     get_human_readable_count(sum(shards.full_numel(p) for p in own))))
    params = list(model.parameters())
    return PlanRows(tuple(rows), sum(p.numel() for p in params), sum(shards.full_numel(p) for p in params),
                    sum(1 for p in params if p in shards), len(params), tuple(plan.blocks), tuple(plan.notes))


def format_plan(parts: Sequence[PlanRows], tp: int, *, model_params: Optional[int] = None) -> str:
    """A table: every parallelised module, its style and parameters per rank vs in total; then the totals.

    ``parts``: one per pipeline rank (one without a pipeline); with several, a ``pp rank`` column says who holds
    each module, and the totals compare what each pp rank holds with the whole model's ``model_params``."""
    head = ("module", "type", "style", "params/rank", "params total")
    staged = len(parts) > 1
    rows = [(("pp rank",) if staged else ()) + head]
    rows += [((str(r),) if staged else ()) + row for r, part in enumerate(parts) for row in part.rows]
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    sharded, tensors = sum(p.sharded for p in parts), sum(p.tensors for p in parts)
    lines = [f"Tensor-parallel plan (tp={tp}): {len({b for p in parts for b in p.blocks})} blocks, {sharded} of {tensors} "
             f"parameter tensors sharded, the rest replicated"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    count = get_human_readable_count
    if not staged:
        local, whole = parts[0].local, model_params if model_params is not None else parts[0].whole
        lines.append(f"parameters per rank: {count(local)} of {count(whole)} ({local / max(whole, 1):.1%})")
    else:
        whole = model_params if model_params is not None else sum(p.whole for p in parts)
        most = max(p.local for p in parts)
        held = ", ".join(f"{count(p.local)} on pp rank {r}" for r, p in enumerate(parts))
        lines.append(f"parameters per rank: {held}, of {count(whole)} in the model ({most / max(whole, 1):.1%} at "
                     f"most)")
    notes = dict.fromkeys(n for p in parts for n in p.notes)
    lines += [f"note: {n}" for n in notes]
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
    reasons = [f"  {n or '<root>'}: {why}" for n, why in plan.whole.items()
               if n == first or n.startswith((f"{first}.", f"{first} ("))]
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


def whole_kinds(model: nn.Module, plan: TPPlan, tp: int, shards: ShardIndex, blocks: list[str], *,
                least: float = 0.02) -> Optional[str]:
    """Every kind of module inside ``blocks`` whose linear or convolution layers stay whole (by class: a Mamba
    mixer, an MLP of an unknown layout), with how many there are, their share of this rank's model and why, when a
    kind holds at least ``least`` of it: said whatever share of the blocks was sharded (a model whose MLPs stay whole
    while its attention is cut holds 0.78 of its parameters per rank at tp=2, and nothing said so). None when every
    such kind is smaller."""
    modules = dict(model.named_modules())
    total = sum(shards.full_numel(p) for p in model.parameters())
    kinds: dict[str, list[Any]] = {}  # class name -> [modules, parameter elements, reason]
    for block in blocks:
        for name, m in modules[block].named_modules(prefix=block):
            layers = [c for c in m.children() if (isinstance(c, (nn.Linear, nn.Conv1d)) or is_transposed_linear(c))
                      and not any(p in shards for p in c.parameters())]
            if not layers:
                continue
            own = [p for p in m.parameters(recurse=False) if p not in shards]
            numel = sum(p.numel() for c in layers for p in c.parameters()) + sum(p.numel() for p in own)
            why = "layers its tensor-parallel plan leaves whole beside those it cuts" if name in plan.blocks else \
                plan.whole.get(name) or next((w for n, w in plan.whole.items() if n.startswith(f"{name} (")),
                                             "no attention or MLP layout recognised in its forward")
            kind = kinds.setdefault(original_class(m).__name__, [0, 0, why])
            kind[0], kind[1] = kind[0] + 1, kind[1] + numel
    listed = sorted(((n, c, k / max(total, 1), why) for n, (c, k, why) in kinds.items() if k >= least * total),
                    key=lambda item: -item[2])
    if not listed:
        return None
    lines = [f"  {n}: {c} module{'s' if c != 1 else ''}, {share:.0%} of the parameters: {why}"
             for n, c, share, why in listed]
    return (f"tensor parallelism (tp={tp}) keeps these kinds of layers whole on every tp rank:\n" + "\n".join(lines)
            + "\nEach holds its whole weights on every rank; tp_plan= can cut them (see the plan table), "
              "tp_plan={'<glob>': 'replicate'} keeps them whole knowingly")
