"""The single-device model's parameter names, which every layout-free piece (checkpoints, optimizer state) keys by,
and the index of which parameters tensor parallelism cut."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_tpp.core.sharding import ShardSpec

def params_by_index(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


@dataclass(frozen=True)
class ParamNames:
    """The single-device model's parameter names: ``order`` as ``parameters()`` yields them (what an optimizer's
    state indices refer to in an ordinary checkpoint), and ``canonical`` for every alias of a shared weight.

    ``shapes`` holds every ``state_dict`` entry of the whole model (parameters under every alias, persistent
    buffers) with its single-device shape, and ``transient`` the non-persistent buffers: recorded before a pipeline
    drops other stages' modules, so that every rank can check a weights file against the whole model alike."""

    order: tuple[str, ...]
    canonical: dict[str, str]
    shapes: Mapping[str, tuple[int, ...]] = field(default_factory=dict)
    transient: frozenset[str] = frozenset()

    @classmethod
    def of(cls, module: nn.Module) -> "ParamNames":
        first: dict[int, str] = {}
        canonical = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            canonical[name] = first.setdefault(id(p), name)
        shapes = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items() if isinstance(v, Tensor)}
        transient = frozenset(n for n, _ in module.named_buffers(remove_duplicate=False) if n not in shapes)
        return cls(tuple(first.values()), canonical, shapes, transient)

    def local(self, module: nn.Module) -> dict[int, str]:
        """id(parameter) -> canonical name, for this rank's (possibly partial) module."""
        out: dict[int, str] = {}
        for name, p in module.named_parameters(remove_duplicate=False):
            out.setdefault(id(p), self.canonical.get(name, name))
        return out


@dataclass
class ShardInfo:
    """How tensor parallelism cut one parameter: its layout and the single-device shape. Mutable: the first-call
    check may pick another layout for a fused projection (``tensor_parallel.apply._reshard``)."""

    spec: ShardSpec
    full_shape: tuple[int, ...]


class ShardIndex:
    """Which parameters tensor parallelism cut, and how — the one interface between tensor parallelism and what needs
    whole tensors (checkpoints, the global gradient norm, summaries, parity checks).

    Filled by ``tensor_parallel.apply_plan``; keyed by the parameter object (held here, so an ``id`` is never reused),
    so every alias of a tied weight finds the same entry."""

    def __init__(self) -> None:
        self._by_id: dict[int, tuple[Tensor, ShardInfo]] = {}
        # another object standing for a parameter -> the parameter (FSDP2's gathered one during forward)
        self.resolve: Optional[Callable[[Tensor], Optional[Tensor]]] = None

    def add(self, p: Tensor, info: ShardInfo) -> None:
        self._by_id[id(p)] = (p, info)

    def get(self, p: Tensor) -> Optional[ShardInfo]:
        entry = self._by_id.get(id(p))
        if entry is None and self.resolve is not None and (stored := self.resolve(p)) is not None:
            entry = self._by_id.get(id(stored))
            return entry[1] if entry is not None and entry[0] is stored else None
        return entry[1] if entry is not None and entry[0] is p else None

    def stored(self, p: Tensor) -> Tensor:
        """The parameter ``p`` stands for (``p`` itself, or the dp-sharded one whose gathered copy ``p`` is)."""
        if id(p) not in self._by_id and self.resolve is not None:
            stored = self.resolve(p)  # a tensor: not ``or``, whose truth value a tensor refuses
            return stored if stored is not None else p
        return p

    def rekey(self, replaced: Mapping[int, Tensor]) -> None:
        """Follow parameters that were replaced by new objects (FSDP2 wraps each in a DTensor)."""
        for key, (p, info) in list(self._by_id.items()):
            new = replaced.get(key)
            if new is not None and p is not new:
                del self._by_id[key]
                self._by_id[id(new)] = (new, info)

    def __contains__(self, p: object) -> bool:
        return isinstance(p, Tensor) and self.get(p) is not None

    def __len__(self) -> int:
        return len(self._by_id)

    def spec(self, p: Tensor) -> Optional[ShardSpec]:
        info = self.get(p)
        return info.spec if info is not None else None

    def full_shape(self, p: Tensor) -> tuple[int, ...]:
        """The single-device shape (the parameter's own for one not cut)."""
        info = self.get(p)
        return info.full_shape if info is not None else tuple(p.shape)

    def full_numel(self, p: Tensor) -> int:
        return math.prod(self.full_shape(p))
