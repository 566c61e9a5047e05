"""Whole-model parameter counts in the user's ``ModelSummary``/``RichModelSummary`` callback, whatever the layout.

The strategy cannot add callbacks (``configure_callbacks`` is the user's), and the user keeps a reference to their
own callback: :func:`count_whole_model` makes that very instance a ``WholeModelSummaryCallback`` (see
:mod:`~lightning_tpp.integration.subclass`), whose summary is a :class:`ShardedModelSummary` with the strategy's
whole-model totals. Under another strategy it summarises as Lightning does."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable, Optional

from lightning.pytorch.callbacks import ModelSummary as ModelSummaryCallback
from lightning.pytorch.utilities.model_summary import LayerSummary, ModelSummary
from torch import nn
from typing_extensions import override

from lightning_tpp._compat import SummaryCallbackAdapter
from lightning_tpp.core.params import ShardIndex
from lightning_tpp.integration.subclass import Swappable, swap_in


class _ShardedLayerSummary(LayerSummary):
    def __init__(self, module: nn.Module, shards: ShardIndex) -> None:
        super().__init__(module)
        self._layer, self._shards = module, shards

    @property
    @override
    def num_parameters(self) -> int:
        return sum(self._shards.full_numel(p) for p in self._layer.parameters())


class ShardedModelSummary(ModelSummary):
    """Lightning's ModelSummary with whole-model parameter counts (it would otherwise count one rank's shards).

    ``totals`` (all, trainable), counted before pipeline stages dropped other stages' modules, replace the sums."""

    def __init__(self, model: Any, max_depth: int = 1, totals: Optional[tuple[int, int]] = None,
                 shards: Optional[ShardIndex] = None) -> None:
        self._totals = totals
        self._summarized, self._depth = model, max_depth
        self._shards = shards if shards is not None else ShardIndex()
        super().__init__(model, max_depth=max_depth)

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        summary: dict[str, Any] = OrderedDict(
            (name, _ShardedLayerSummary(m, self._shards)) for name, m in self.named_modules)
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
        return sum(self._shards.full_numel(p) for p in self._summarized.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        if self._totals is not None:
            return self._totals[1]
        return sum(self._shards.full_numel(p) for p in self._summarized.parameters() if p.requires_grad)


class WholeModelSummaryCallback(Swappable, SummaryCallbackAdapter):
    """Mixin for the user's summary callback: under a strategy that knows the whole model's totals
    (``whole_model_totals``), summarise with :class:`ShardedModelSummary`."""

    @override
    def build_summary(self, trainer: Any, pl_module: Any) -> Any:
        strategy = trainer.strategy
        if not hasattr(strategy, "whole_model_totals"):
            return super().build_summary(trainer, pl_module)
        return ShardedModelSummary(pl_module, max_depth=self.summary_max_depth, totals=strategy.whole_model_totals,
                                  shards=strategy.parameter_shards)


def count_whole_model(callbacks: Iterable[Any]) -> None:
    """Every ``ModelSummary`` callback (Rich ones included) among ``callbacks`` counts whole parameters."""
    for cb in callbacks:
        if isinstance(cb, ModelSummaryCallback):
            swap_in(cb, WholeModelSummaryCallback)
