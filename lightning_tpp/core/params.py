"""The single-device model's parameter names, which every layout-free piece (checkpoints, optimizer state) keys by."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn
from torch.optim import Optimizer

def params_by_index(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


@dataclass(frozen=True)
class ParamNames:
    """The single-device model's parameter names: ``order`` as ``parameters()`` yields them (what an optimizer's
    state indices refer to in an ordinary checkpoint), and ``canonical`` for every alias of a shared weight."""

    order: tuple[str, ...]
    canonical: dict[str, str]

    @classmethod
    def of(cls, module: nn.Module) -> "ParamNames":
        first: dict[int, str] = {}
        canonical = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            canonical[name] = first.setdefault(id(p), name)
        return cls(tuple(first.values()), canonical)

    def local(self, module: nn.Module) -> dict[int, str]:
        """id(parameter) -> canonical name, for this rank's (possibly partial) module."""
        out: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), self.canonical.get(name, name))
        return out
