"""Class swaps: a module keeps its identity, parameters and hooks while its methods come from a mixin first.

``swap_class(module, _ColumnParallel)`` turns an ``nn.Linear`` into ``ColumnParallel[Linear]`` in place. What the
swap changed — the original class, and attributes made local (head counts, widths) — is kept in one
:class:`SwapRecord`, so that a reference copy, the summary and checkpoints can still see the original.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Iterator

from torch import nn

SLOT_PREFIX = "_tpp_"  # every attribute lightning_tpp keeps on a user's module starts so
_SWAP = "_tpp_swap"


@dataclass
class SwapRecord:
    original_class: type
    saved_attrs: dict[str, Any] = field(default_factory=dict)  # attribute -> its value before it was made local
    # mixins a reference copy keeps (``swap_class(..., kept=True)``): what the model computes under a parallel mode,
    # not a cut of it (context parallelism's T5 bias of this rank's rows), which the original must compute alike
    kept: list[type] = field(default_factory=list)


@functools.lru_cache(maxsize=None)
def parallel_class(mixin: type, base: type) -> type:
    """A subclass of ``base`` whose methods come from ``mixin`` first (cached so each pair is made once)."""
    return type(f"{mixin.__name__.strip('_')}[{base.__name__}]", (mixin, base), {"__module__": base.__module__})


def swap_record(module: nn.Module) -> SwapRecord:
    """The module's record of what was swapped (made on first use)."""
    if _SWAP not in module.__dict__:
        module.__dict__[_SWAP] = SwapRecord(type(module))
    return module.__dict__[_SWAP]


def swap_class(module: nn.Module, mixin: type, *, kept: bool = False) -> None:
    record = swap_record(module)  # remembers the class before the first swap
    module.__class__ = parallel_class(mixin, type(module))
    if kept:
        record.kept.append(mixin)


def original_class(module: nn.Module) -> type:
    record = module.__dict__.get(_SWAP)
    return record.original_class if record is not None else type(module)


def original_attrs(module: nn.Module) -> dict[str, Any]:
    """The attributes a swap made local, with their values before (empty for a module never swapped)."""
    record = module.__dict__.get(_SWAP)
    return dict(record.saved_attrs) if record is not None else {}


def set_local_attr(module: nn.Module, name: str, value: Any) -> None:
    """Set an attribute to its per-rank value (e.g. ``out_features`` of a shard), remembering the original."""
    swap_record(module).saved_attrs.setdefault(name, getattr(module, name))
    setattr(module, name, value)


def unswap(module: nn.Module) -> None:
    """Undo the swap on ``module`` (a copy being turned back into the original, e.g. for a numerical check)."""
    record = module.__dict__.pop(_SWAP, None)
    if record is not None:
        module.__class__ = record.original_class
        for name, value in record.saved_attrs.items():
            setattr(module, name, value)
        for mixin in record.kept:
            swap_class(module, mixin, kept=True)


def slots(module: nn.Module) -> Iterator[Any]:
    """lightning_tpp's per-module slots in ``module`` and its submodules (bindings, groups, runtimes): a copy of the
    module shares them instead of copying them (``copy.deepcopy(module, memo)`` with these in ``memo``)."""
    for m in module.modules():
        for key, value in m.__dict__.items():
            if key.startswith(SLOT_PREFIX) and key != _SWAP:
                yield value
