"""Class swaps: a module keeps its identity, parameters and hooks while its methods come from a mixin first.

``swap_class(module, _ColumnParallel)`` turns an ``nn.Linear`` into ``ColumnParallel[Linear]`` in place; the original


class is remembered so that a reference copy, the summary and checkpoints can still name it."""

from __future__ import annotations

import functools

from torch import nn

@functools.lru_cache(maxsize=None)
def parallel_class(mixin: type, base: type) -> type:
    """A subclass of ``base`` whose methods come from ``mixin`` first (cached so each pair is made once)."""
    return type(f"{mixin.__name__.strip('_')}[{base.__name__}]", (mixin, base), {"__module__": base.__module__})


def swap_class(module: nn.Module, mixin: type) -> None:
    original = type(module)
    if "_tpp_orig_class" not in module.__dict__:
        module._tpp_orig_class = original
    module.__class__ = parallel_class(mixin, original)
