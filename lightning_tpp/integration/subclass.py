"""Giving one of Lightning's objects (the precision plugin, a ModelSummary callback) one more behaviour by making it
an instance of a subclass: the object keeps its identity, state and every ``isinstance`` answer, and no method is
assigned over on the instance.

``swap_in(plugin, GlobalNormClipping)`` turns a ``MixedPrecision`` into ``with_mixin(GlobalNormClipping,
MixedPrecision)``: same ``__name__``/``__qualname__`` (so messages and a callback's ``state_key`` do not change), the
mixin's methods first. Such an object pickles and deep-copies as its class plus the mixin (the spawn launcher pickles
the strategy and its plugin)."""

from __future__ import annotations

import functools
from typing import Any


class Swappable:
    """Base of every mixin given to :func:`swap_in`: pickles as (mixin, base class, state)."""

    def __reduce_ex__(self, protocol: Any) -> Any:
        mixin, base = type(self).__bases__
        getstate = getattr(self, "__getstate__", None)  # object.__getstate__ exists from Python 3.11 on
        return _rebuild, (mixin, base, getstate() if getstate is not None else self.__dict__)


@functools.lru_cache(maxsize=None)
def with_mixin(mixin: type, base: type) -> type:
    """A subclass of ``base`` whose methods come from ``mixin`` first (cached: one class per pair)."""
    return type(base.__name__, (mixin, base), {"__module__": base.__module__, "__qualname__": base.__qualname__})


def swap_in(obj: Any, mixin: type) -> None:
    """Make ``obj`` an instance of ``with_mixin(mixin, type(obj))`` (nothing to do when it already is one)."""
    if not isinstance(obj, mixin):
        obj.__class__ = with_mixin(mixin, type(obj))


def _rebuild(mixin: type, base: type, state: Any) -> Any:
    obj = base.__new__(base)
    if state:
        setstate = getattr(obj, "__setstate__", None)
        if setstate is not None:
            setstate(state)
        else:
            obj.__dict__.update(state)
    obj.__class__ = with_mixin(mixin, base)
    return obj
