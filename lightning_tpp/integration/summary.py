"""The user's ``ModelSummary``/``RichModelSummary`` callback shows the model as one process would, whatever the layout:
the model's own class names (not ``ColumnParallel[Linear]`` or ``PipelineDispatch[...]``) and whole-model parameter
counts on every row, other pipeline stages' modules included (read from their meta twins, whose shapes are whole).

The strategy cannot add callbacks (``configure_callbacks`` is the user's), and the user keeps a reference to their
own callback: :func:`count_whole_model` makes that very instance a ``WholeModelSummaryCallback`` (see
:mod:`~lightning_tpp.integration.subclass`), whose summary is a :class:`ShardedModelSummary` with the strategy's
whole-model totals. Under another strategy it summarises as Lightning does."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Mapping, Optional

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import LayerSummary, ModelSummary
from torch import nn
from torch.distributed.fsdp import FSDPModule
from typing_extensions import override

from lightning_tpp._compat import SummaryCallbackAdapter
from lightning_tpp.core.params import ShardIndex
from lightning_tpp.core.swap import original_class
from lightning_tpp.integration.subclass import Swappable, swap_in
from lightning_tpp.pipeline.stage import BINDING, _RemoteModule


def user_class(module: nn.Module) -> type:
    """The model's own class of ``module``: before tensor parallelism's swaps (``ColumnParallel[Linear]``), the
    pipeline's dispatchers and FSDP2's ``FSDP<class>`` subclasses."""
    cls = original_class(module)
    while issubclass(cls, FSDPModule) and cls is not FSDPModule:
        cls = next(b for b in cls.__bases__ if not issubclass(b, FSDPModule))
    return cls


def _shown(module: nn.Module) -> nn.Module:
    """What a row shows for ``module``: a stand-in for another stage's module shows that module's meta twin."""
    return module.__dict__[BINDING].twin if isinstance(module, _RemoteModule) else module


def whole_named_children(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``module.named_children()`` with other stages' stand-ins replaced by their meta twins."""
    return [(f"{prefix}{name}", _shown(child)) for name, child in module.named_children()]


def whole_named_modules(module: nn.Module, prefix: str = "") -> list[tuple[str, nn.Module]]:
    """``module.named_modules(prefix)`` (without ``module`` itself) of the whole model: other stages' modules as
    their meta twins, with their submodules."""
    out: list[tuple[str, nn.Module]] = []
    seen: set[int] = {id(module)}

    def walk(m: nn.Module, prefix: str) -> None:
        for name, child in whole_named_children(m, prefix):
            if id(child) not in seen:
                seen.add(id(child))
                out.append((name, child))
                walk(child, f"{name}.")

    walk(module, f"{prefix}." if prefix else "")
    return out


def whole_numel(module: nn.Module, shards: ShardIndex, *, name: str = "", canonical: Optional[Mapping[str, str]] = None,
                trainable: bool = False) -> int:
    """Parameters of ``module`` (named ``name`` in the model) as in one process: tensor-parallel shards counted
    whole, other stages' modules counted from their twins, each tensor once — a weight tied across stages (an
    embedding and the head of another stage: two objects here) by its one-process name in ``canonical``."""
    seen: set[Any] = set()
    total, canonical = 0, canonical or {}
    for prefix, m in [(name, module), *whole_named_modules(module, name)]:
        for pname, p in m.named_parameters(prefix=prefix, recurse=False):
            key = canonical.get(pname, id(p))
            if key not in seen and id(p) not in seen and (p.requires_grad or not trainable):
                seen.update((key, id(p)))
                total += shards.full_numel(p)
    return total


class _ShardedLayerSummary(LayerSummary):
    def __init__(self, module: nn.Module, shards: ShardIndex, name: str, canonical: Mapping[str, str]) -> None:
        super().__init__(module)
        self._layer, self._shards, self._name, self._canonical = module, shards, name, canonical

    @property
    @override
    def layer_type(self) -> str:
        return user_class(self._layer).__name__

    @property
    @override
    def num_parameters(self) -> int:
        return whole_numel(self._layer, self._shards, name=self._name, canonical=self._canonical)


class ShardedModelSummary(ModelSummary):
    """Lightning's ModelSummary with whole-model parameter counts (it would otherwise count one rank's shards).

    ``totals`` (all, trainable), counted before pipeline stages dropped other stages' modules, replace the sums
    (they count a weight tied across stages once). No example forward: under a pipeline it would need every stage."""

    def __init__(self, model: Any, max_depth: int = 1, totals: Optional[tuple[int, int]] = None,
                 shards: Optional[ShardIndex] = None, canonical: Optional[Mapping[str, str]] = None) -> None:
        self._totals, self._canonical = totals, dict(canonical or {})
        self._summarized, self._depth = model, max_depth
        self._shards = shards if shards is not None else ShardIndex()
        super().__init__(model, max_depth=max_depth)

    @property
    @override
    def named_modules(self) -> list[tuple[str, nn.Module]]:
        if self._depth == 0:
            return []
        if self._depth == 1:
            return whole_named_children(self._summarized)
        return whole_named_modules(self._summarized)

    @property
    @override
    def total_training_modes(self) -> dict[str, int]:
        modes = [m.training for _, m in whole_named_modules(self._summarized)]
        return {"train": modes.count(True), "eval": modes.count(False)}

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        summary: dict[str, Any] = OrderedDict(
            (name, _ShardedLayerSummary(m, self._shards, name, self._canonical)) for name, m in self.named_modules)
        for layer in summary.values():
            layer.detach_hook()
        if self._depth >= 1:
            for k in [k for k in summary if k.count(".") >= self._depth]:
                del summary[k]
        return summary

    @property
    @override
    def total_parameters(self) -> int:
        if self._totals is not None:
            return self._totals[0]
        return whole_numel(self._summarized, self._shards, canonical=self._canonical)

    @property
    @override
    def trainable_parameters(self) -> int:
        if self._totals is not None:
            return self._totals[1]
        return whole_numel(self._summarized, self._shards, canonical=self._canonical, trainable=True)


class WholeModelSummaryCallback(Swappable, SummaryCallbackAdapter):
    """Mixin for the user's summary callback: under a strategy that knows the whole model's totals
    (``whole_model_totals``), summarise with :class:`ShardedModelSummary`."""

    @override
    def build_summary(self, trainer: Any, pl_module: Any) -> Any:
        strategy = trainer.strategy
        if not hasattr(strategy, "whole_model_totals"):
            return super().build_summary(trainer, pl_module)
        return ShardedModelSummary(pl_module, max_depth=self.summary_max_depth, totals=strategy.whole_model_totals,
                                  shards=strategy.parameter_shards, canonical=strategy.parameter_names)


def count_whole_model(callbacks: Iterable[Any]) -> None:
    """Every ``ModelSummary`` callback (Rich ones included) among ``callbacks`` counts whole parameters."""
    for cb in callbacks:
        if isinstance(cb, ModelSummaryCallback):
            swap_in(cb, WholeModelSummaryCallback)
