"""Gradient clipping by the global norm, through the precision plugin the Trainer chose.

Lightning clips in ``Precision.clip_grad_by_norm(optimizer, clip_val)`` (called from ``clip_gradients`` for automatic
and manual optimization alike, after a GradScaler unscaled). Under tensor and pipeline parallelism the norm is global
over tp and pp, so the strategy's ``precision_plugin`` setter (the public extension point FSDPStrategy overrides too)
makes the plugin the connector assigns an instance of a subclass whose ``clip_grad_by_norm`` is the strategy's::

    Trainer(precision="bf16-mixed")  ->  connector: strategy.precision_plugin = MixedPrecision(...)
                                     ->  setter:    with_mixin(GlobalNormClipping, MixedPrecision)
                                                    (still a MixedPrecision: autocast, scaler, dtypes unchanged)
"""

from __future__ import annotations

from typing import Any, Callable, Optional, TypeVar, Union

from lightning.pytorch.plugins.precision import Precision
from torch import Tensor
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tpp.core.grads import clip_by_global_norm, global_grad_norm
from lightning_tpp.integration.subclass import Swappable, swap_in
from lightning_tpp.parallel_state import ParallelState, ProcessGroups

Clip = Callable[[Optimizer, Union[int, float]], None]
P = TypeVar("P", bound=Optional[Precision])


class GlobalNormClipping(Swappable, Precision):
    """Placed before the user's precision class: ``clip_grad_by_norm`` is the strategy's global-norm clip."""

    global_norm_clip: Optional[Clip] = None

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        if self.global_norm_clip is None:
            return super().clip_grad_by_norm(optimizer, clip_val)
        self.global_norm_clip(optimizer, clip_val)


def with_global_norm(plugin: P, clip: Clip) -> P:
    """``plugin``, now clipping by ``clip`` (a plugin met again, by a second Trainer, only gets the new ``clip``)."""
    if plugin is None:
        return plugin
    swap_in(plugin, GlobalNormClipping)
    plugin.global_norm_clip = clip  # type: ignore[union-attr]
    return plugin


class GlobalNormClippingStrategy:
    """Strategy mixin: the precision plugin the Trainer assigns clips by the global norm (over tp and pp; a tied
    weight counted once, on its lowest stage), over the strategy's ``parallel_state`` and groups."""

    _precision_plugin: Optional[Precision]
    lightning_module: Any
    parallel_state: ParallelState
    _groups: ProcessGroups

    @property
    @override
    def precision_plugin(self) -> Precision:
        """The Trainer's precision plugin, clipping gradients by the norm over every shard and stage
        (:mod:`lightning_tpp.integration.precision`; bound to this strategy, also when a plugin is shared)."""
        plugin = self._precision_plugin if self._precision_plugin is not None else Precision()
        return with_global_norm(plugin, self._clip_grad_by_norm)

    @precision_plugin.setter
    @override
    def precision_plugin(self, precision_plugin: Optional[Precision]) -> None:
        self._precision_plugin = with_global_norm(precision_plugin, self._clip_grad_by_norm)

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params, counted = self._norm_params(optimizer)
        clip_by_global_norm(counted, float(clip_val),
                            sharded=self.parallel_state.shards, tp_rank=self._groups.tp.rank,
                            groups=[self._groups.tp.group, self._groups.pp], apply_to=params,
                            dp_group=self._groups.dp)

    def _norm_params(self, optimizer: Optimizer) -> tuple[list[Tensor], list[Tensor]]:
        """(every local parameter of ``optimizer``, those whose gradient this rank counts in the global norm)."""
        assert self.lightning_module is not None
        params = [p for p in self.precision_plugin.main_params(optimizer)]
        elsewhere = {id(p) for p in self.parallel_state.counted_elsewhere(self.lightning_module)}
        return params, [p for p in params if id(p) not in elsewhere]

    def global_grad_norm(self, optimizer: Optimizer) -> Tensor:
        """The 2-norm of the whole model's gradients, over every tp, pp and dp shard, as clipping measures it (the
        same value on every rank; a collective: every rank calls it). ``SpikeGuard`` watches it."""
        return global_grad_norm(self._norm_params(optimizer)[1], sharded=self.parallel_state.shards,
                                tp_rank=self._groups.tp.rank, groups=[self._groups.tp.group, self._groups.pp],
                                dp_group=self._groups.dp)
