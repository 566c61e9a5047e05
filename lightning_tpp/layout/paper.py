"""The ranked table on paper (``lightning-tpp plan --auto``): no device, nothing allocated. Block times come from
their FLOPs at the device's assumed efficiency (``links.DEVICES``), memory from the profile's arithmetic."""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from lightning_tpp.layout.cost import BlockTimes
from lightning_tpp.layout.links import device_spec
from lightning_tpp.layout.profile import profile_model
from lightning_tpp.layout.search import Ranking, search_layouts


def rank_on_paper(model: nn.Module, *, devices: int, devices_per_node: int, device: str, batch: int, seq_len: int,
                  device_memory: Optional[float] = None, global_batch: Optional[int] = None,
                  dtype: torch.dtype = torch.bfloat16, optimizer: str = "adamw", margin: float = 0.1,
                  cp_mode: Optional[str] = "allgather") -> Ranking:
    """Every layout of ``devices`` ``device``s for ``model`` (on meta) on per-process batches of ``batch``
    sequences of ``seq_len`` tokens, ranked (layouts with cp charged as ``cp_mode``; ``None``: both modes)."""
    spec = device_spec(device, memory=device_memory, devices_per_node=devices_per_node)
    profile = profile_model(model, seq_len=seq_len, dtype=dtype, max_tp=devices_per_node)
    ranking = search_layouts(profile, world=devices, device=spec, times=BlockTimes(), batch=batch,
                             device_memory=spec.memory, margin=margin, global_batch=global_batch,
                             optimizer=optimizer, cp_mode=cp_mode)
    ranking.notes.append(f"{spec.name}: {spec.flops / 1e12:.0f} TFLOP/s at {spec.efficiency:.0%}, links "
                         f"{spec.intra.bandwidth / 1e9:.0f} GB/s within a node of {spec.devices_per_node}, "
                         f"{spec.inter.bandwidth / 1e9:.0f} GB/s across; states in {dtype} ({optimizer})")
    return ranking
