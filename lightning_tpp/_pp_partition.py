"""Where to cut an unmodified model into pipeline stages (pure: module trees and numbers, no process groups).

The model's *block sequence* is its repeated layers: the largest ``nn.ModuleList``/``nn.Sequential`` whose children
share one class (``transformer.h``, ``model.layers``, ``encoder.layers``), or the children of a plain
``nn.Sequential`` model. Modules with parameters registered before the sequence (embeddings) go with the first stage,
those after it (final norm, head) with the last; parameter-free modules (rotary tables, masks) run everywhere::

    pre | b0 b1 b2 b3 b4 b5 b6 b7 | post         pp = 2, balanced by parameters
    stage 0: pre b0 b1 b2 b3
    stage 1:               b4 b5 b6 b7 post

Stages are contiguous; :func:`balance` minimises the largest stage cost (pre/post costs included).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from torch import nn


class PipelinePartitionError(ValueError):
    """The model cannot be cut as asked (no block sequence, too few blocks, bad split points)."""


@dataclass(frozen=True)
class Partition:
    """Block ``bounds[s] = (start, end)`` of each (virtual) stage ``s`` of the block sequence at ``blocks``."""

    blocks: str  # FQN of the container of the blocks
    names: tuple[str, ...]  # FQN of each block
    pre: tuple[str, ...]  # FQNs of modules with parameters before the blocks (first stage)
    post: tuple[str, ...]  # ... after the blocks (last stage)
    bounds: tuple[tuple[int, int], ...]

    @property
    def stages(self) -> int:
        return len(self.bounds)

    def stage_of_block(self, i: int) -> int:
        return next(s for s, (a, b) in enumerate(self.bounds) if a <= i < b)


def _inside(name: str, outer: str) -> bool:
    """``name`` is a strict descendant of ``outer`` (the root is ``""``)."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _homogeneous(m: nn.Module) -> bool:
    kids = list(m.children())
    return len(kids) >= 2 and all(type(k) is type(kids[0]) for k in kids)


def find_block_sequence(model: nn.Module) -> str:
    """FQN of the container whose children are the pipeline's blocks (see the module docstring)."""
    lists = [(n, m) for n, m in model.named_modules()
             if isinstance(m, (nn.ModuleList, nn.Sequential)) and _homogeneous(m) and _params(m) > 0]
    total = max(_params(model), 1)
    # keep the outermost lists (a list nested in a block is part of that block)
    outer = [(n, m) for n, m in lists if not any(_inside(n, o) for o, _ in lists)]
    big = sorted(outer, key=lambda nm: -_params(nm[1]))
    if len(big) >= 2 and _params(big[1][1]) > 0.25 * total:
        raise PipelinePartitionError(
            f"found two block sequences of similar size, {big[0][0]!r} ({len(big[0][1])} blocks) and {big[1][0]!r} "
            f"({len(big[1][1])} blocks): an encoder-decoder (the decoder reads the encoder's output, and its own "
            f"embedded input, at every block) or lists zipped in one loop. A linear pipeline of one sequence would "
            f"compute the other side's inputs on the wrong stage, so this model is refused: train it with tp and dp "
            f"(pp=1). blocks='<name>' overrides this check only for models whose modules before the blocks feed "
            f"nothing but the blocks")
    if big:
        return big[0][0]
    root = model
    while not isinstance(root, nn.Sequential) and len(list(root.children())) == 1:
        root = next(root.children())
    if isinstance(root, nn.Sequential) and len(root) >= 2:
        return next(n for n, m in model.named_modules() if m is root)
    raise PipelinePartitionError(
        f"no repeated block sequence in {type(model).__name__}: pipeline parallelism cuts an nn.ModuleList or "
        f"nn.Sequential of same-class layers (e.g. transformer layers). Pass blocks='<module name>' to name one")


def describe(model: nn.Module, blocks: str) -> tuple[tuple[str, ...], tuple[str, ...], tuple[str, ...]]:
    """(block names, pre modules, post modules) around the container ``blocks``."""
    modules = dict(model.named_modules())
    if blocks not in modules:
        raise PipelinePartitionError(f"blocks={blocks!r} is not a module of the model")
    container = modules[blocks]
    prefix = f"{blocks}." if blocks else ""
    names = tuple(f"{prefix}{n}" for n, _ in container.named_children())
    order = list(modules)
    start = order.index(blocks)
    pre, post = [], []
    for i, (n, m) in enumerate(modules.items()):
        if n == blocks or _inside(n, blocks) or _inside(blocks, n):
            continue  # the blocks themselves; their ancestors (see ancestor_parameters)
        if any(p is not None for p in m._parameters.values()):  # modules without parameters run on every stage
            (pre if i < start else post).append(n)
    return names, tuple(pre), tuple(post)


def ancestor_parameters(model: nn.Module, blocks: str) -> tuple[str, ...]:
    """Parameters owned directly by an ancestor of the blocks (a ViT's ``cls_token``/``pos_embed`` on the root):
    the ancestor cannot move to one stage, so they are taken to be used before the blocks (first stage)."""
    out = []
    for n, m in model.named_modules():
        if n == blocks or _inside(blocks, n):
            out += [f"{n}.{k}" if n else k for k, p in m._parameters.items() if p is not None]
    return tuple(out)


def balance(costs: Sequence[float], stages: int, *, first_extra: float = 0.0, last_extra: float = 0.0
            ) -> list[tuple[int, int]]:
    """Contiguous ``stages`` ranges of ``costs`` (each non-empty) minimising the largest stage cost.

    ``first_extra``/``last_extra`` are added to the first/last stage (embeddings, head). Exact dynamic programme,
    O(n^2 * stages)."""
    n = len(costs)
    if stages < 1:
        raise PipelinePartitionError(f"stages={stages} must be at least 1")
    if stages > n:
        raise PipelinePartitionError(f"{stages} stages but only {n} blocks; use at most {n} stages")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + c)

    def cost(s: int, a: int, b: int) -> float:
        extra = (first_extra if s == 0 else 0.0) + (last_extra if s == stages - 1 else 0.0)
        return prefix[b] - prefix[a] + extra

    inf = float("inf")
    best = [[inf] * (n + 1) for _ in range(stages + 1)]  # best[s][b]: first s stages cover blocks [0, b)
    cut = [[0] * (n + 1) for _ in range(stages + 1)]
    best[0][0] = 0.0
    for s in range(1, stages + 1):
        for b in range(s, n - (stages - s) + 1):
            for a in range(s - 1, b):
                v = max(best[s - 1][a], cost(s - 1, a, b))
                if v < best[s][b] - 1e-12:
                    best[s][b], cut[s][b] = v, a
    bounds, b = [], n
    for s in range(stages, 0, -1):
        a = cut[s][b]
        bounds.append((a, b))
        b = a
    return bounds[::-1]


def bounds_from_counts(counts: Sequence[int], n_blocks: int) -> list[tuple[int, int]]:
    if any(c < 1 for c in counts) or sum(counts) != n_blocks:
        raise PipelinePartitionError(f"balance={list(counts)} must give every stage at least one block and add up "
                                     f"to the {n_blocks} blocks")
    bounds, a = [], 0
    for c in counts:
        bounds.append((a, a + c))
        a += c
    return bounds


def bounds_from_split_points(points: Sequence[str], names: Sequence[str], stages: int) -> list[tuple[int, int]]:
    if len(points) != stages - 1:
        raise PipelinePartitionError(f"split_points={list(points)} must name {stages - 1} blocks (where stages 1.."
                                     f"{stages - 1} start) for {stages} stages")
    idx = []
    for p in points:
        if p not in names:
            raise PipelinePartitionError(f"split point {p!r} is not a block; blocks are {list(names)}")
        idx.append(names.index(p))
    starts = [0, *idx]
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise PipelinePartitionError(f"split_points={list(points)} must be in increasing block order and skip the "
                                     f"first block {names[0]!r}")
    return [(a, b) for a, b in zip(starts, [*idx, len(names)])]


def plan_partition(model: nn.Module, stages: int, *, blocks: Optional[str] = None,
                   balance_by: "Sequence[int] | str" = "params", split_points: Optional[Sequence[str]] = None,
                   block_costs: Optional[Sequence[float]] = None) -> Partition:
    """Choose the stage bounds: ``split_points`` > explicit ``balance`` counts > costs (parameters or measured)."""
    container = blocks if blocks is not None else find_block_sequence(model)
    names, pre, post = describe(model, container)
    modules = dict(model.named_modules())
    if stages > len(names):
        raise PipelinePartitionError(f"pp={stages} stages (x virtual stages) but {container!r} has only "
                                     f"{len(names)} blocks; use at most {len(names)} stages")
    if split_points is not None:
        bounds = bounds_from_split_points(split_points, names, stages)
    elif not isinstance(balance_by, str):
        bounds = bounds_from_counts(list(balance_by), len(names))
        if len(bounds) != stages:
            raise PipelinePartitionError(f"balance={list(balance_by)} has {len(bounds)} entries for {stages} stages")
    else:
        if block_costs is not None and len(block_costs) != len(names):
            raise PipelinePartitionError(f"{len(block_costs)} block costs for the {len(names)} blocks of "
                                         f"{container!r}")
        costs = list(block_costs) if block_costs is not None else [float(_params(modules[n])) for n in names]
        first = float(sum(_params(modules[n]) for n in pre)) if block_costs is None else 0.0
        last = float(sum(_params(modules[n]) for n in post)) if block_costs is None else 0.0
        bounds = balance(costs, stages, first_extra=first, last_extra=last)
    return Partition(container, names, pre, post, tuple(bounds))
