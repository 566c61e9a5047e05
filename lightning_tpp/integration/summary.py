"""A ModelSummary that counts whole parameters, whatever the layout."""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Optional

from lightning.pytorch.utilities.model_summary.model_summary import LayerSummary, ModelSummary
from typing_extensions import override

from lightning_tpp.core.params import ShardIndex


class _ShardedLayerSummary(LayerSummary):
    def __init__(self, module: Any, shards: ShardIndex) -> None:
        self._shards = shards
        super().__init__(module)

    @property
    @override
    def num_parameters(self) -> int:
        return sum(self._shards.full_numel(p) for p in self._module.parameters())


class ShardedModelSummary(ModelSummary):
    """Lightning's ModelSummary with whole-model parameter counts (it would otherwise count one rank's shards).

    ``totals`` (all, trainable), counted before pipeline stages dropped other stages' modules, replace the sums."""

    def __init__(self, model: Any, max_depth: int = 1, totals: Optional[tuple[int, int]] = None,
                 shards: Optional[ShardIndex] = None) -> None:
        self._totals = totals
        self._shards = shards if shards is not None else ShardIndex()
        super().__init__(model, max_depth=max_depth)

    @override
    def summarize(self) -> dict[str, LayerSummary]:
        summary: dict[str, Any] = OrderedDict((name, _ShardedLayerSummary(m, self._shards)) for name, m in self.named_modules)
        for layer in summary.values():
            layer.detach_hook()
        if self._max_depth >= 1:
            for k in [k for k in summary if k.count(".") >= self._max_depth]:
                del summary[k]
        return summary

    @property
    @override
    def total_parameters(self) -> int:
        if self._totals is not None:
            return self._totals[0]
        return sum(self._shards.full_numel(p) for p in self._model.parameters())

    @property
    @override
    def trainable_parameters(self) -> int:
        if self._totals is not None:
            return self._totals[1]
        return sum(self._shards.full_numel(p) for p in self._model.parameters() if p.requires_grad)
