"""Batch statistics under micro-batching: running statistics kept over the whole batch (torchgpipe's
``DeferredBatchNorm``), and a warning where the normalisation itself cannot be.

In training, ``BatchNorm`` normalises with the mean and variance of the batch it is given and moves its running
statistics towards them. Under a pipeline every layer sees one micro-batch at a time::

    one process       BN(batch of 8)                        one running-statistics update, from 8 samples
    pp, m=2           BN(micro-batch 0: 4)  BN(micro-batch 1: 4)   two updates, each from 4 samples

The normalisation of each micro-batch by its own statistics cannot be undone without gathering the whole batch at
every layer (what the schedule exists to avoid): :func:`microbatch_warning` says so, once, on rank 0. The running
statistics can be kept exact: each layer of this rank (a ``_BatchNorm``, ``SyncBatchNorm`` included, or an
``_InstanceNorm`` that tracks running statistics) normalises each micro-batch as before, without touching its
buffers, while its per-channel sums are added up; :meth:`DeferredStatistics.commit`, once per training step, moves
the buffers as one process's layer would have from the whole batch: mean, unbiased variance (``n / (n - 1)`` over
the whole batch's ``n`` values per channel), ``num_batches_tracked`` and the cumulative average of ``momentum=None``.
``SyncBatchNorm`` adds its sums over its process group (the dp replicas) first. Eval mode is untouched.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor, nn

from lightning_tpp._compat import BatchNormBase as _BatchNorm
from lightning_tpp._compat import InstanceNormBase as _InstanceNorm
from lightning_tpp.core.recompute import recomputing
from lightning_tpp.core.swap import original_class, swap_class

_SLOT = "_tpp_batch_stats"  # a layer's _Sums
_RUNNING = ("running_mean", "running_var", "num_batches_tracked")


@dataclass(frozen=True)
class StatisticsLayer:
    """A layer whose training forward normalises with statistics of the batch it is given."""

    name: str
    cls: str  # its class's name
    deferred: bool  # its running statistics are kept over the whole batch, or it has none (torch's layers)


def batch_statistics_layers(module: nn.Module) -> list[StatisticsLayer]:
    """Found by class: ``_BatchNorm`` (BatchNorm1d/2d/3d, SyncBatchNorm, lazy ones, subclasses), and layers of other
    classes that keep ``running_mean``/``running_var`` buffers as batch normalisation does (a user's own; not
    torchvision's ``FrozenBatchNorm2d``, which never reads the batch). Instance normalisation reads one sample's
    statistics: micro-batching does not change it (its running statistics are deferred all the same)."""
    out = []
    for name, m in module.named_modules():
        cls = original_class(m)
        if issubclass(cls, _BatchNorm):
            out.append(StatisticsLayer(name, cls.__name__, True))
        elif not issubclass(cls, _InstanceNorm) and not cls.__name__.startswith("Frozen") and all(
                isinstance(m._buffers.get(b), Tensor) for b in ("running_mean", "running_var")):
            out.append(StatisticsLayer(name, cls.__name__, False))
    return out


def microbatch_warning(layers: list[StatisticsLayer], *, microbatches: int, batch: int, pp: int) -> str:
    """What rank 0 says when ``layers`` see micro-batches: which layers, how many samples each normalises, what
    stays exact (the running statistics of torch's layers) and what to do."""
    per = -(-batch // microbatches)
    names = [layer.name for layer in layers]
    shown = ", ".join(names[:6]) + (f", ... ({len(names) - 6} more)" if len(names) > 6 else "")
    classes = "/".join(sorted({layer.cls for layer in layers}))
    other = [layer.name for layer in layers if not layer.deferred]
    running = "the running statistics are kept over the whole batch and match" if not other else (
        f"the running statistics of {', '.join(other[:6])} are updated once per micro-batch, the others' are kept "
        f"over the whole batch")
    return (f"pp={pp} with microbatches={microbatches}: {len(names)} layer(s) normalise with batch statistics in "
            f"training ({classes}: {shown}). Under the pipeline each sees one micro-batch at a time: a batch of "
            f"{batch} samples is normalised as micro-batches of {per} samples or fewer, each by its own mean and "
            f"variance, so losses and gradients differ from one process's ({running}). For one process's results "
            f"use microbatches=1 (no pipeline overlap), GroupNorm/LayerNorm in place of BatchNorm, or a batch large "
            f"enough that {per} samples give the statistics you want")


@dataclass
class _Sums:
    """Per-channel sums of one layer over the micro-batches of a step (float64). Batch normalisation: ``count``
    values per channel, their sum and sum of squares. Instance normalisation: ``count`` instances, the sum of their
    means and of their unbiased variances (what ``F.instance_norm`` averages over the batch)."""

    instance: bool
    count: float = 0.0
    total: Optional[Tensor] = None
    squares: Optional[Tensor] = None

    def add(self, module: nn.Module, x: Tensor) -> None:
        x = x.detach()
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        if self.instance:
            if x.dim() == module._get_no_batch_dim():  # type: ignore[operator]  # one unbatched sample
                x = x.unsqueeze(0)
            var, mean = torch.var_mean(x, dim=tuple(range(2, x.dim())), correction=1)
            total, squares, count = mean.double().sum(0), var.double().sum(0), x.shape[0]
        else:
            dims = (0, *range(2, x.dim()))
            var, mean = torch.var_mean(x, dim=dims, correction=0)
            count = x.numel() // x.shape[1]
            mean, var = mean.double(), var.double()
            total, squares = count * mean, count * (var + mean * mean)
        self.total = total if self.total is None else self.total + total
        self.squares = squares if self.squares is None else self.squares + squares
        self.count += count

    def reset(self) -> None:
        self.count, self.total, self.squares = 0.0, None, None


class _Deferred:
    """Mixin (a class swap, see ``core.swap``) for a layer whose running statistics are committed once per step: in
    training it runs its own forward on scratch copies of its running buffers (normalising by the micro-batch's
    statistics, as before) and adds the micro-batch to its sums. Below a pipeline dispatcher, so only micro-batches
    that this layer really runs are counted; a recomputation (activation checkpointing) is not counted again."""

    def forward(self, input: Tensor, *args: Any, **kwargs: Any) -> Any:
        module: nn.Module = self  # type: ignore[assignment]
        sums: Optional[_Sums] = module.__dict__.get(_SLOT)
        if not module.training or sums is None:
            return super().forward(input, *args, **kwargs)  # type: ignore[misc]
        if not recomputing():
            sums.add(module, input)
        kept = {n: module._buffers[n] for n in _RUNNING if module._buffers.get(n) is not None}
        module._buffers.update({n: b.clone() for n, b in kept.items()})  # what the forward moves is thrown away
        try:
            return super().forward(input, *args, **kwargs)  # type: ignore[misc]
        finally:
            module._buffers.update(kept)


def _tracks(m: nn.Module) -> bool:
    cls = original_class(m)
    return issubclass(cls, (_BatchNorm, _InstanceNorm)) and m._buffers.get("running_mean") is not None \
        and m._buffers.get("running_var") is not None


class DeferredStatistics:
    """The layers of this rank whose running statistics are committed once per training step (see the module
    docstring). ``warn``: the layers that normalise by batch statistics (the whole model's; said once, on rank 0,
    at the first training step, when the batch size is known)."""

    def __init__(self, layers: list[tuple[str, nn.Module]], *, warn: list[StatisticsLayer], pp: int,
                 microbatches: int) -> None:
        self.layers = layers
        self._warn, self.pp, self.microbatches = warn, pp, microbatches

    @classmethod
    def install(cls, module: nn.Module, *, pp: int, microbatches: int,
                warn: Optional[list[StatisticsLayer]] = None) -> Optional["DeferredStatistics"]:
        """Defer the running statistics of ``module``'s layers (this rank's; call before the pipeline dispatchers
        are put on the units, so that they sit outside). ``warn``: the whole model's layers (found before the cut;
        by default ``module``'s). ``None`` at one micro-batch, or without such layers: nothing to do."""
        if microbatches <= 1:
            return None
        layers = [(n, m) for n, m in module.named_modules() if _tracks(m)]
        for _, m in layers:
            if _SLOT not in m.__dict__:
                m.__dict__[_SLOT] = _Sums(instance=issubclass(original_class(m), _InstanceNorm))
                swap_class(m, _Deferred)
        found = batch_statistics_layers(module) if warn is None else warn
        return cls(layers, warn=found, pp=pp, microbatches=microbatches) if layers or found else None

    def begin(self, batch: int, microbatches: int) -> None:
        """A training step starts: forget what an interrupted step added; the first with micro-batches warns."""
        for _, m in self.layers:
            m.__dict__[_SLOT].reset()
        if self._warn and microbatches > 1:
            rank_zero_warn(microbatch_warning(self._warn, microbatches=microbatches, batch=batch, pp=self.pp))
            self._warn = []

    @torch.no_grad()
    def commit(self) -> None:
        """The step's micro-batches have all run forward: move each layer's running statistics once."""
        for _, m in self.layers:
            sums: _Sums = m.__dict__[_SLOT]
            if sums.total is not None:
                _commit(m, sums)
            sums.reset()


def _commit(m: nn.Module, sums: _Sums) -> None:
    assert sums.total is not None and sums.squares is not None
    count, total, squares = sums.count, sums.total, sums.squares
    group = getattr(m, "process_group", None)
    if isinstance(m, nn.SyncBatchNorm) and dist.is_available() and dist.is_initialized() \
            and dist.get_world_size(group) > 1:  # the union of the replicas' batches, as SyncBatchNorm's update
        packed = torch.cat([total.new_tensor([count]), total, squares])
        dist.all_reduce(packed, group=group)
        count, total, squares = float(packed[0]), packed[1:1 + total.numel()], packed[1 + total.numel():]
    mean = total / count
    if sums.instance:
        var = squares / count  # the mean of the instances' unbiased variances
        factor = m.momentum if m.momentum is not None else 0.0  # as F.instance_norm: no update without momentum
    else:
        var = (squares / count - mean * mean).clamp_min(0.0) * (count / max(count - 1.0, 1.0))  # unbiased
        tracked = m._buffers.get("num_batches_tracked")
        if tracked is not None:
            tracked.add_(1)
        factor = m.momentum if m.momentum is not None else 1.0 / float(tracked)  # type: ignore[arg-type]
    for name, value in (("running_mean", mean), ("running_var", var)):
        buffer: Tensor = m._buffers[name]  # type: ignore[assignment]
        buffer.mul_(1.0 - factor).add_(value.to(buffer.dtype), alpha=factor)
