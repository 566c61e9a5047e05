"""Hugging Face mixture-of-experts files as the model's 3-D banks: transformers 5 holds a layer's experts as one
``(E, 2I, H)`` bank but writes (and the Hub holds) one tensor per expert and projection, converting at load time
with its own conversion mapping. This source applies the same mapping to the keys, without reading data::

    file:   model.layers.0.block_sparse_moe.experts.{e}.w1.weight (I, H), ...w3.weight (I, H), ...w2.weight (H, I)
    model:  model.layers.0.mlp.experts.gate_up_proj (E, 2I, H) = stack_e [w1_e | w3_e],  ...down_proj = stack_e w2_e

A box of a bank (a rank's experts under ep, its rows under tp) is read as the boxes of the per-expert tensors it
covers: each rank reads its own experts only. The mapping's renames are transformers' own (GraniteMoE's
``block_sparse_moe.input_linear.weight`` is the model's ``block_sparse_moe.experts.gate_up_proj``); of its
converters, the stack-then-concatenate ones (what MoE families use). Anything else is left to the key matching,
which names what is missing.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from torch import nn

from lightning_tpp._compat import hf_renamed_keys

_REGEX = set("^$()[]+?\\|{}")


@dataclass(frozen=True)
class Stacked:
    """A bank built from per-expert tensors: expert ``e`` is the concatenation along its dim 0 of ``keys[e]``'s
    tensors (their row counts ``rows``)."""

    keys: tuple[tuple[str, ...], ...]
    rows: tuple[int, ...]


class StackedExperts:
    """A :class:`~lightning_tpp.checkpoint.weights.Source` with the per-expert tensors of ``inner`` shown as banks."""

    def __init__(self, inner: Any, renamed: Mapping[str, str], banks: Mapping[str, Stacked]) -> None:
        self.inner, self.kind = inner, inner.kind
        self.original = dict(renamed)  # shown key -> the inner key
        used = {k for bank in banks.values() for keys in bank.keys for k in keys}
        self.shapes = {shown: inner.shapes[key] for shown, key in renamed.items() if key not in used}
        self.banks = dict(banks)
        for name, bank in banks.items():
            cols = inner.shapes[bank.keys[0][0]][1:]
            self.shapes[name] = (len(bank.keys), sum(bank.rows), *cols)

    def read(self, wanted: Mapping[str, Sequence[Any]]) -> tuple[str, ...]:
        plain: dict[str, list[Any]] = {}
        for name, boxes in wanted.items():
            if name not in self.banks:
                plain.setdefault(self.original[name], []).extend(boxes)
                continue
            for box in boxes:
                for key, part in self._parts(self.banks[name], *box):
                    plain.setdefault(key, []).append(part)
        return self.inner.read(plain)

    @staticmethod
    def _parts(bank: Stacked, offsets: Sequence[int], sizes: Sequence[int], dest: Any) -> list[tuple[str, Any]]:
        """The per-expert boxes that make up one box of the bank."""
        (e0, r0, *c0), (ne, nr, *nc) = offsets, sizes
        out = []
        for e in range(e0, e0 + ne):
            start = 0
            for key, rows in zip(bank.keys[e], bank.rows):
                lo, hi = max(r0, start), min(r0 + nr, start + rows)
                if lo < hi:
                    out.append((key, ((lo - start, *c0), (hi - lo, *nc), dest[e - e0].narrow(0, lo - r0, hi - lo))))
                start += rows
        return out


def _conversions(module: nn.Module) -> list[Any]:
    try:
        from transformers import PreTrainedModel
        from transformers.conversion_mapping import extract_weight_conversions_for_model
    except ImportError:  # pragma: no cover - transformers is optional
        return []
    model = next((m for m in module.modules() if isinstance(m, PreTrainedModel)), None)
    return list(extract_weight_conversions_for_model(model) or []) if model is not None else []


def _kind(transform: Any) -> Optional[str]:
    """``"stack"`` for a stack (then concatenate) of per-expert tensors."""
    sources, targets = list(transform.source_patterns), list(transform.target_patterns)
    if any(_REGEX & set(p) for p in (*sources, *targets)) or len(targets) != 1:
        return None
    ops = [(type(op).__name__, getattr(op, "dim", None)) for op in getattr(transform, "operations", [])]
    if ops in ([("MergeModulelist", 0)], [("MergeModulelist", 0), ("Concatenate", 1)]) and all(
            p.count("*") == 1 for p in sources) and (len(sources) == 1) == (len(ops) == 1):
        return "stack"
    return None


def stack_experts(source: Any, module: nn.Module) -> Any:
    """``source`` as the model sees it, after transformers' conversion mapping for ``module``'s Hugging Face model
    (``source`` itself when nothing applies)."""
    transforms = _conversions(module)
    if not transforms:
        return source
    renamed = {shown: key for key, shown in hf_renamed_keys(source.shapes, transforms).items()}
    banks: dict[str, Stacked] = {}
    for t in transforms:
        if _kind(t) == "stack":
            banks.update(_stacks(t, renamed, source.shapes))
    if not banks and all(shown == key for shown, key in renamed.items()):
        return source
    return StackedExperts(source, renamed, banks)


def _stacks(transform: Any, renamed: Mapping[str, str], shapes: Mapping[str, tuple[int, ...]]) -> dict[str, Stacked]:
    """Each bank one converter makes: per key prefix, every expert's tensor for each source pattern."""
    found: dict[str, dict[int, dict[int, str]]] = {}  # prefix -> source pattern -> expert -> inner key
    patterns = [re.compile(re.escape(p).replace(r"\*", r"(\d+)") + "$") for p in transform.source_patterns]
    for shown, key in renamed.items():
        for i, pattern in enumerate(patterns):
            m = pattern.search(shown)
            if m:
                found.setdefault(shown[:m.start()], {}).setdefault(i, {})[int(m.group(1))] = key
    out = {}
    for prefix, per_source in found.items():
        experts = set(per_source.get(0, {}))
        complete = (len(per_source) == len(patterns) and experts == set(range(len(experts)))
                    and all(set(d) == experts for d in per_source.values()))
        if not complete:
            continue  # left to the key matching, which names what is missing
        keys = tuple(tuple(per_source[i][e] for i in range(len(patterns))) for e in range(len(experts)))
        rows = tuple(shapes[k][0] for k in keys[0])
        if len({shapes[k][1:] for row in keys for k in row}) == 1:
            out[prefix + transform.target_patterns[0]] = Stacked(keys, rows)
    return out
