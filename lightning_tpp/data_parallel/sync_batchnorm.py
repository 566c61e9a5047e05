"""``Trainer(sync_batchnorm=True)``: batch normalisation synchronised over the data-parallel replicas only.

Lightning's DDP and FSDP strategies convert every ``_BatchNorm`` with ``nn.SyncBatchNorm.convert_sync_batchnorm``,
which synchronises over the whole world. Here the tensor- and pipeline-parallel ranks of one replica see the same
batch (and a pipeline's ranks run different layers: a world-wide collective would pair layers of different stages),
so the statistics are gathered over the dp group::

    world 8 = dp 2 x pp 2 x tp 2          SyncBatchNorm group of rank (dp=0, pp=1, tp=1): the two dp replicas
                                          of that (pp, tp) coordinate, which see different samples

The conversion happens before the model is cut (``parallel_state.build_state``), on the meta device too, and is not
reverted at teardown (the cut model keeps its layers; in eval mode ``SyncBatchNorm`` is ``BatchNorm``).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup


class SyncBatchNormDeviceError(ValueError):
    """``SyncBatchNorm`` cannot run on this device."""


def sync_batchnorm_over_dp(module: nn.Module, *, convert: bool, dp: int, group: Optional[ProcessGroup],
                           device: torch.device) -> int:
    """Convert ``module``'s batch normalisation to ``SyncBatchNorm`` over ``group`` (the dp group) where ``convert``
    (Lightning's ``sync_batchnorm=True``) and there are replicas (``dp > 1``: with one, nothing to synchronise); give
    the user's own ``SyncBatchNorm`` layers without a process group the dp group, never the world's. Returns how many
    layers synchronise. Raises :class:`SyncBatchNormDeviceError` on a CPU, where torch's ``SyncBatchNorm`` refuses
    to train."""
    if convert and dp > 1:
        for name, child in list(module.named_children()):
            converted = nn.SyncBatchNorm.convert_sync_batchnorm(child, process_group=group)
            if converted is not child:
                setattr(module, name, converted)
    synced = [m for m in module.modules() if isinstance(m, nn.SyncBatchNorm)]
    for m in synced:
        if m.process_group is None:
            m.process_group = group
    if synced and device.type == "cpu":
        raise SyncBatchNormDeviceError(
            f"{len(synced)} SyncBatchNorm layer(s) (Trainer(sync_batchnorm=True) with dp={dp}, or the model's own) "
            f"cannot train on the CPU: torch's SyncBatchNorm runs on GPUs only. Use accelerator='gpu', or "
            f"Trainer(sync_batchnorm=False) and nn.BatchNorm (each dp replica then normalises its own samples)")
    return len(synced)
