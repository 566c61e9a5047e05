"""Optional packages (transformers, safetensors, matplotlib) imported where a feature needs them: a missing one ends
in a message that names the feature and the command that installs it, never a bare ``ModuleNotFoundError``."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional


class MissingDependencyError(ModuleNotFoundError):
    """An optional package a feature needs is not installed (still a ``ModuleNotFoundError``/``ImportError``, so
    code that catches those keeps working)."""


def require(module: str, feature: str, *, package: Optional[str] = None, instead: str = "") -> ModuleType:
    """``importlib.import_module(module)``, or :class:`MissingDependencyError` saying that ``feature`` needs it and
    how to install it (``pip install <package>``, the top-level module name by default), then ``instead`` (what to
    do without it) if given."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise missing(module, feature, package=package, instead=instead) from err


def missing(module: str, feature: str, *, package: Optional[str] = None, instead: str = "") -> MissingDependencyError:
    """The error :func:`require` raises (for a check made before importing, e.g. with ``find_spec``)."""
    top = module.partition(".")[0]
    return MissingDependencyError(f"{feature} needs {top}, which is not installed: pip install {package or top}"
                                  + (f" ({instead})" if instead else ""), name=top)
