"""Where to cut an unmodified model into pipeline stages (pure: module trees and numbers, no process groups).

The model's *block sequence* is its repeated layers: the largest ``nn.ModuleList``/``nn.Sequential``/``nn.ModuleDict``
whose children share one class (``transformer.h``, ``model.layers``, ``encoder.layers``), or a list or dict of layers of
several classes that all hold parameters (a hybrid's Mamba and attention layers, in one list); without one, the children of the plain
``nn.Sequential`` holding most of the parameters, wherever it sits (``net``, ``model.encoder.layers``), its children
without parameters (activations) joined to the block before them. Other lists of comparable size join it: an
encoder-decoder's two stacks follow one another (``encoder.layers`` then ``decoder.layers``), sibling lists of equal
length zipped in one loop make one block of their i-th entries. Modules with parameters registered before the
sequence (embeddings) go with the first stage, those after it (final norm, head) with the last, those between two
stacks (the encoder's final norm) with the block before them; parameter-free modules (rotary tables, masks) run
everywhere::

    pre | b0 b1 b2 b3 b4 b5 b6 b7 | post         pp = 2, balanced by parameters
    stage 0: pre b0 b1 b2 b3
    stage 1:               b4 b5 b6 b7 post

Stages are contiguous; :func:`balance` minimises the largest stage cost (pre/post costs included). Which values
cross from stage to stage is not decided here: the stages trace it (see ``_pp_stage``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from lightning_tpp._compat import tree_map
from lightning_tpp.pipeline.stage import meta_twin


class PipelinePartitionError(ValueError):
    """The model cannot be cut as asked (no block sequence, too few blocks, bad split points)."""


@dataclass(frozen=True)
class Partition:
    """Block ``bounds[s] = (start, end)`` of each (virtual) stage ``s`` of the block sequence.

    The sequence may span several containers run one after the other (an encoder's layers, then a decoder's), and a
    block may be several modules (the i-th entry of sibling lists zipped in one loop)."""

    blocks: tuple[str, ...]  # FQNs of the containers of the blocks, in order
    members: tuple[tuple[str, ...], ...]  # FQNs of the modules of each block
    pre: tuple[str, ...]  # FQNs of modules with parameters before the blocks (first stage)
    post: tuple[str, ...]  # ... after the blocks (last stage)
    middle: tuple[tuple[str, int], ...]  # (module between two containers, blocks before it): stage of that block
    bounds: tuple[tuple[int, int], ...]

    @property
    def stages(self) -> int:
        return len(self.bounds)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m[0] for m in self.members)

    def stage_of_block(self, i: int) -> int:
        return next(s for s, (a, b) in enumerate(self.bounds) if a <= i < b)

    def owners(self) -> dict[str, int]:
        """Module FQN -> the stage that holds it."""
        owners = {name: self.stage_of_block(i) for i, names in enumerate(self.members) for name in names}
        owners.update({n: 0 for n in self.pre})
        owners.update({n: self.stage_of_block(i - 1) for n, i in self.middle})
        owners.update({n: self.stages - 1 for n in self.post})
        return owners


@dataclass(frozen=True)
class BlockSequence:
    """The model's block sequence, found once per setup (:func:`block_sequence`) and read by every step that needs
    it: the partition, activation checkpointing, sequence parallelism, FSDP2's units, the coverage report."""

    containers: tuple[str, ...]  # FQNs of the containers of the blocks, in order
    members: tuple[tuple[str, ...], ...]  # FQNs of the modules of each block
    pre: tuple[str, ...]
    post: tuple[str, ...]
    middle: tuple[tuple[str, int], ...]


def block_sequence(model: nn.Module, blocks: "str | Sequence[str] | None" = None, *, stages: int = 2,
                   ordered: bool = True) -> BlockSequence:
    """The block sequence of ``model``: found (:func:`find_block_sequences`), or the ``blocks`` containers run one
    after the other. ``ordered``: the modules outside the blocks placed by the forward's order (one meta forward,
    :func:`forward_order`; what a pipeline's first and last stage need), else by registration. Raises
    :class:`PipelinePartitionError` when there is none."""
    containers = find_block_sequences(model, stages=stages) if blocks is None else (
        (blocks,) if isinstance(blocks, str) else tuple(blocks))
    order = forward_order(model, containers) if ordered else None
    return BlockSequence(containers, *describe(model, containers, zip_siblings=blocks is None, order=order))


def _inside(name: str, outer: str) -> bool:
    """``name`` is a strict descendant of ``outer`` (the root is ``""``)."""
    return name != outer and (outer == "" or name.startswith(outer + "."))


def _params(m: nn.Module) -> int:
    return sum(p.numel() for p in m.parameters())


def _stack(m: nn.Module) -> bool:
    """Whether ``m``'s children are layers of a stack: two or more, in an ``nn.ModuleList``/``nn.ModuleDict``/
    ``nn.Sequential`` of one class, or in an ``nn.ModuleList``/``nn.ModuleDict`` of several classes that are all
    layers (a hybrid's Mamba and attention layers): each holds parameters and modules of its own, and none is a stack
    itself (nanoGPT's ``transformer`` dict of ``wte``, ``h``, ``ln_f`` is a namespace around the stack ``h``). A mixed
    ``nn.Sequential`` is :func:`plain_sequential`'s."""
    kids = list(m.children())
    if len(kids) < 2 or not isinstance(m, (nn.ModuleList, nn.ModuleDict, nn.Sequential)):
        return False
    if all(type(k) is type(kids[0]) for k in kids):
        return True
    return not isinstance(m, nn.Sequential) and all(
        _params(k) > 0 and any(True for _ in k.children()) and not _stack(k) for k in kids)


def find_block_sequences(model: nn.Module, *, stages: int = 2) -> tuple[str, ...]:
    """FQNs of the containers whose children are the pipeline's blocks (see the module docstring): the largest
    stack, and the other stacks of comparable size (an encoder-decoder's two stacks, a vision tower and a language
    model; lists zipped in one loop). Without one, the plain ``nn.Sequential`` holding most of the parameters (see
    :func:`plain_sequential`), cut into ``stages`` stages."""
    lists = [(n, m) for n, m in model.named_modules() if _stack(m) and _params(m) > 0]
    # keep the outermost lists (a list nested in a block is part of that block)
    outer = [(n, m) for n, m in lists if not any(_inside(n, o) for o, _ in lists)]
    if outer:
        biggest = max(_params(m) for _, m in outer)
        return tuple(n for n, m in outer if _params(m) >= 0.1 * biggest)  # registration order
    return (plain_sequential(model, stages),)


def plain_sequential(model: nn.Module, stages: int = 2) -> str:
    """The ``nn.Sequential`` whose children become the blocks when the model has no repeated layers (an MLP of
    mixed layers, wherever it sits: the model, ``net``, ``model.encoder.layers``). Its children run one after the other
    whatever the rest of the forward does, so any contiguous cut is a pipeline. Taken: a Sequential run by
    ``nn.Sequential.forward`` that holds more than half of the parameters (the rest runs as embeddings and heads do)
    and has at least ``stages`` children with parameters; of those (they nest), the deepest, whose children are the
    finest units. Otherwise :class:`PipelinePartitionError` names the largest Sequential and why it was not taken."""
    total = _params(model)
    chosen: Optional[str] = None
    refused: list[tuple[int, str, str]] = []  # (parameters, why not, how to take it anyway)
    for name, m in model.named_modules():  # outer before inner: the last one taken is the deepest
        if not isinstance(m, nn.Sequential):
            continue
        held, kids = _params(m), sum(1 for k in m.children() if _params(k) > 0)
        label, take = (f"{name!r}" if name else "the model itself"), f"blocks={name!r} takes its children"
        if type(m).forward is not nn.Sequential.forward:
            refused.append((held, f"{label} ({type(m).__name__}) has its own forward, which need not run its "
                                  f"children in order", f"{take} if its forward calls them one after the other"))
        elif 2 * held <= total:
            refused.append((held, f"{label} holds {held} of the {total} parameters, not more than half",
                            f"{take}; what lies outside it runs as embeddings and heads do"))
        elif kids < max(stages, 2):
            refused.append((held, f"{label} has {kids} child{'ren' if kids != 1 else ''} with parameters, fewer "
                                  f"than the {max(stages, 2)} {'stages' if stages > 1 else 'a pipeline needs'}",
                            f"use at most {kids} stages (pp x virtual stages), or name a container with more "
                            f"children"))
        else:
            chosen = name
    if chosen is not None:
        return chosen
    head = (f"no repeated block sequence in {type(model).__name__}: pipeline parallelism cuts an nn.ModuleList or "
            f"nn.Sequential of same-class layers (e.g. transformer layers), else the children of a plain "
            f"nn.Sequential holding more than half of the parameters")
    if not refused:
        raise PipelinePartitionError(f"{head}, and the model has no nn.Sequential. Pass blocks='<module name>' to "
                                     f"name the container whose children are the blocks")
    _, why, fix = max(refused, key=lambda r: r[0])
    raise PipelinePartitionError(
        f"{head}; the largest nn.Sequential is not taken: {why}. Pass blocks='<module name>' to name the container "
        f"whose children are the blocks ({fix}), then balance=[...] or split_points=[...] to choose the cuts")


def _groups(model: nn.Module, containers: Sequence[str], zip_siblings: bool) -> list[list[str]]:
    """Consecutive sibling containers of equal length are zipped (block i = their i-th children) unless named as an
    encoder and a decoder; other containers follow one another."""
    modules = dict(model.named_modules())
    groups: list[list[str]] = []
    for name in containers:
        prev = groups[-1][-1] if groups else None
        if (zip_siblings and prev is not None and prev.rpartition(".")[0] == name.rpartition(".")[0]
                and len(modules[prev]) == len(modules[name])
                and not any(w in n.rpartition(".")[2].lower() for n in (prev, name) for w in ("enc", "dec"))):
            groups[-1].append(name)
        else:
            groups.append([name])
    return groups


def _with_neighbours(modules: Mapping[str, nn.Module], container: str, kids: Sequence[str]) -> list[tuple[str, ...]]:
    """One block per child; in an ``nn.Sequential``, a child without parameters (an activation, ``Flatten``) joins
    the block before it (leading ones the first block with parameters): no stage holds only an activation, and the
    cuts fall where the weights are."""
    if not isinstance(modules[container], nn.Sequential) or all(_params(modules[k]) == 0 for k in kids):
        return [(k,) for k in kids]
    blocks: list[tuple[str, ...]] = []
    leading: tuple[str, ...] = ()
    for k in kids:
        if _params(modules[k]) > 0:
            blocks.append((*leading, k))
            leading = ()
        elif blocks:
            blocks[-1] += (k,)
        else:
            leading += (k,)
    return blocks


def describe(model: nn.Module, blocks: "str | Sequence[str]", *, zip_siblings: bool = True,
             order: Optional[Mapping[str, int]] = None
             ) -> tuple[tuple[tuple[str, ...], ...], tuple[str, ...], tuple[str, ...], tuple[tuple[str, int], ...]]:
    """(members of each block, pre modules, post modules, middle modules with the number of blocks before them).
    ``zip_siblings=False`` (containers named by the user) runs the containers one after the other. ``order`` (see
    :func:`forward_order`) places a module the forward was seen to call by when it is first called; the others by
    where they are registered."""
    containers = [blocks] if isinstance(blocks, str) else list(blocks)
    modules = dict(model.named_modules())
    for c in containers:
        if c not in modules:
            raise PipelinePartitionError(f"blocks={c!r} is not a module of the model")
    members: list[tuple[str, ...]] = []
    done_after: dict[str, int] = {}  # last container of each group -> blocks up to and including that group
    for group in _groups(model, containers, zip_siblings):
        prefixes = [f"{c}." if c else "" for c in group]
        kids = [[f"{p}{n}" for n, _ in modules[c].named_children()] for p, c in zip(prefixes, group)]
        members += list(zip(*kids)) if len(group) > 1 else _with_neighbours(modules, group[0], kids[0])
        done_after[group[-1]] = len(members)
    position = {n: i for i, n in enumerate(modules)}
    block_starts = [min((order[n] for m in block for n in forward_modules(modules[m], m) if n in order),
                        default=float("inf")) for block in members] if order else []
    pre, post, middle = [], [], []
    chosen: list[str] = []
    for i, (n, m) in enumerate(modules.items()):
        if any(n == c or _inside(n, c) or _inside(c, n) for c in containers):
            continue  # the blocks themselves; their ancestors (see ancestor_parameters)
        if any(_inside(n, o) for o in chosen) or not any(True for _ in m.parameters(recurse=False)):
            continue  # inside a module already placed; modules without parameters run on every stage
        chosen.append(n)
        before = max((k for c, k in done_after.items() if position[c] < i and not _inside(n, c)), default=0)
        if order and n in order:  # blocks whose forward started before this module's first call
            before = sum(1 for t in block_starts if t < order[n])
        if before == 0:
            pre.append(n)
        elif before == len(members):
            post.append(n)
        else:
            middle.append((n, before))
    return tuple(members), tuple(pre), tuple(post), tuple(middle)


def forward_order(model: nn.Module, containers: Sequence[str]) -> dict[str, int]:
    """Module name -> when the forward first calls it, from one forward of a meta copy (no memory, no data, no effect
    on the model or the random generators): of the LightningModule on its ``example_input_array``, else of the
    smallest module holding the blocks and the modules with parameters on token ids of shape ``(1, 8)`` when it holds
    an ``nn.Embedding``. A head registered before the blocks (litgpt's ``lm_head``) then goes with the last stage.
    Modules the forward did not reach (it needs other inputs, or fails on the meta device) are left out, and are
    placed by where they are registered; ``{}`` when there is nothing to run."""
    example = getattr(model, "example_input_array", None) if hasattr(type(model), "example_input_array") else None
    if example is not None:
        root = ""
    else:
        modules = dict(model.named_modules())
        held = [n for n, m in modules.items() if n and any(True for _ in m.parameters(recurse=False))]
        held += list(containers)
        parts = [n.split(".") for n in held]
        common = []
        for column in zip(*parts):
            if len(set(column)) > 1:
                break
            common.append(column[0])
        root = ".".join(common)
        if not any(isinstance(m, nn.Embedding) for m in modules[root].modules()):
            return {}
        example = torch.zeros(1, 8, dtype=torch.long)
    order: dict[str, int] = {}
    prefix = f"{root}." if root else ""
    try:
        twin = meta_twin(model.get_submodule(root))
        for n, m in twin.named_modules():
            m.register_forward_pre_hook(lambda mod, args, n=prefix + n if n else root: _first_call(order, n))
        inputs = tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, example)
        with torch.random.fork_rng(devices=[]), torch.device("meta"), torch.no_grad(), _TakenTrue():
            twin.eval()
            twin(*inputs) if isinstance(inputs, tuple) else twin(inputs)
    except Exception:  # noqa: BLE001 - what ran before the failure is still in order; the rest by registration
        pass
    return order


class _TakenTrue(TorchFunctionMode):
    """For the order of calls only: a condition on a meta tensor's values (``if mask.all():``, ``.item()``), which the
    meta device cannot answer, is taken as true (or one), so that the forward goes on and every module after it is
    seen (Hugging Face's decoder masks ask whether the padding mask is all ones)."""

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if func in (torch.Tensor.__bool__, torch.Tensor.item) and args and isinstance(args[0], torch.Tensor) \
                and args[0].is_meta and args[0].numel() == 1:
            return True if func is torch.Tensor.__bool__ or args[0].dtype == torch.bool else \
                (1.0 if args[0].is_floating_point() else 1)
        return func(*args, **(kwargs or {}))


def _first_call(order: dict[str, int], name: str) -> None:
    order.setdefault(name, len(order))


def forward_modules(module: nn.Module, name: str) -> list[str]:
    """The modules of a block that its forward calls: the block itself, or for a ModuleList/ModuleDict (a block
    ``[attn, ff]`` that the forward unpacks) its children."""
    if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
        return [n for k, child in module.named_children() for n in forward_modules(child, f"{name}.{k}")]
    return [name]


def block_modules(model: nn.Module, members: Sequence[Sequence[str]]) -> list[str]:
    """The modules whose forward the blocks run (each block member, or the children of a member that is a list), in
    order."""
    modules = dict(model.named_modules())
    return [n for block in members for m in block for n in forward_modules(modules[m], m)]


def ancestor_parameters(model: nn.Module, blocks: "str | Sequence[str]") -> tuple[str, ...]:
    """Parameters owned directly by an ancestor of the blocks (a ViT's ``cls_token``/``pos_embed`` on the root):
    the ancestor cannot move to one stage, so they are taken to be used before the blocks (first stage)."""
    containers = [blocks] if isinstance(blocks, str) else list(blocks)
    out = []
    for n, m in model.named_modules():
        if any(n == c or _inside(c, n) for c in containers):
            out += [f"{n}.{k}" if n else k for k, _ in m.named_parameters(recurse=False, remove_duplicate=False)]
    return tuple(dict.fromkeys(out))


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


def bounds_from_split_points(points: Sequence[str], members: Sequence[Sequence[str]], stages: int
                             ) -> list[tuple[int, int]]:
    names = [m[0] for m in members]
    if len(points) != stages - 1:
        raise PipelinePartitionError(f"split_points={list(points)} must name {stages - 1} blocks (where stages 1.."
                                     f"{stages - 1} start) for {stages} stages")
    idx = []
    for p in points:
        found = [i for i, m in enumerate(members) if p in m]
        if not found:
            raise PipelinePartitionError(f"split point {p!r} is not a block; blocks are {names}")
        first = members[found[0]][0]
        if found[0] > 0 and p != first and p.rpartition(".")[0] == first.rpartition(".")[0]:  # an activation
            raise PipelinePartitionError(f"split point {p!r} has no parameters and runs in the block of {first!r}; "
                                         f"name a block, e.g. {first!r}; blocks are {names}")
        idx.append(found[0])
    starts = [0, *idx]
    if any(b <= a for a, b in zip(starts, starts[1:])):
        raise PipelinePartitionError(f"split_points={list(points)} must be in increasing block order and skip the "
                                     f"first block {names[0]!r}")
    return [(a, b) for a, b in zip(starts, [*idx, len(names)])]


def minor_stack(model: nn.Module, containers: Sequence[str]) -> Optional[str]:
    """What to say when the stack(s) found for the stages hold less than half of the model's parameters: which was
    chosen, what it holds, and what else is large (it runs whole on one stage), with the ``blocks=`` to cut
    another; ``None`` when they hold most of the model."""
    modules = dict(model.named_modules())
    total = _params(model)
    held = sum(_params(modules[c]) for c in containers)
    if not total or 2 * held > total:
        return None
    others = sorted(((n, _params(m)) for n, m in model.named_modules() if _stack(m) and n not in containers
                     and not any(_inside(n, c) or _inside(c, n) for c in containers)),
                    key=lambda item: -item[1])[:3]
    label = ", ".join(repr(c) for c in containers)
    rest = "; other stacks: " + ", ".join(f"{n!r} ({p / total:.0%})" for n, p in others) if others else ""
    return (f"pipeline stages cut {label}, which holds {held / total:.0%} of the {total} parameters: the rest runs "
            f"whole on the stage that first uses it{rest}. Pass blocks='<module name>' (or several, run one after "
            f"the other) to cut another stack")


def plan_partition(model: nn.Module, stages: int, *, blocks: "str | Sequence[str] | None" = None,
                   sequence: Optional[BlockSequence] = None,
                   balance_by: "Sequence[int] | str" = "params", split_points: Optional[Sequence[str]] = None,
                   block_costs: Optional[Sequence[float]] = None,
                   weight: Callable[[nn.Module], float] = _params) -> Partition:
    """Choose the stage bounds of ``sequence`` (found from ``blocks`` when not given): ``split_points`` > explicit
    ``balance`` counts > costs (measured, or each module's ``weight``: its parameters, or what a token runs through of
    them)."""
    if sequence is None:
        sequence = block_sequence(model, blocks, stages=stages)
    containers, members, pre, post, middle = (sequence.containers, sequence.members, sequence.pre, sequence.post,
                                              sequence.middle)
    label = ", ".join(repr(c) for c in containers)
    modules = dict(model.named_modules())
    if stages > len(members):
        raise PipelinePartitionError(f"pp={stages} stages (x virtual stages) but {label} has only "
                                     f"{len(members)} blocks; use at most {len(members)} stages")
    if split_points is not None:
        bounds = bounds_from_split_points(split_points, members, stages)
    elif not isinstance(balance_by, str):
        bounds = bounds_from_counts(list(balance_by), len(members))
        if len(bounds) != stages:
            raise PipelinePartitionError(f"balance={list(balance_by)} has {len(bounds)} entries for {stages} stages")
    else:
        if block_costs is not None and len(block_costs) != len(members):
            raise PipelinePartitionError(f"{len(block_costs)} block costs for the {len(members)} blocks of {label}")
        if block_costs is not None:
            costs = list(block_costs)
        else:
            costs = [float(sum(weight(modules[n]) for n in m)) for m in members]
            for n, i in middle:  # a final encoder norm weighs on the encoder's last block
                costs[i - 1] += weight(modules[n])
        first = float(sum(weight(modules[n]) for n in pre)) if block_costs is None else 0.0
        last = float(sum(weight(modules[n]) for n in post)) if block_costs is None else 0.0
        bounds = balance(costs, stages, first_extra=first, last_extra=last)
    return Partition(containers, members, pre, post, middle, tuple(bounds))
