"""Weights that several pipeline stages hold (a tied embedding and head): each holding rank keeps a copy, their
gradients are summed over the ranks holding one (``engine.tied``). Once the stages are finished: the copies checked to
be cut alike, and on a model built on the meta device, initialised once and sent to the others."""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_tpp.core.mesh import MeshDims
from lightning_tpp.pipeline.build import PreparedStages, TiedWeight
from lightning_tpp.pipeline.engine import PipelineEngine


def tied_copies(module: nn.Module, stages: PreparedStages, engine: PipelineEngine
                ) -> Iterator[tuple[TiedWeight, nn.Parameter, Any]]:
    """This rank's copy of each weight that several stages hold, with the group of the ranks holding one."""
    groups = {id(p): group for p, group in engine.tied}
    params = dict(module.named_parameters(remove_duplicate=False))
    for weight in stages.tied:
        here = next((params[n] for n in weight.names if n in params), None)
        if here is not None and id(here) in groups:
            yield weight, here, groups[id(here)]


def tied_shape_problem(module: nn.Module, stages: PreparedStages, engine: PipelineEngine, device: torch.device
                       ) -> Optional[str]:
    """What is wrong when a tied weight is cut differently on the stages holding it (its gradients are summed, and a
    whole-model load gives it to each), decided alike on every rank (no rank leaves while others still set up);
    None when nothing is. Collective over the world."""
    problem = None
    for weight, here, group in tied_copies(module, stages, engine):
        shapes = [torch.zeros(here.dim(), dtype=torch.long, device=device) for _ in range(dist.get_world_size(group))]
        dist.all_gather(shapes, torch.tensor(here.shape, device=device), group=group)
        if len({tuple(t.tolist()) for t in shapes}) > 1 and problem is None:  # cut on one stage, whole on another
            problem = (f"{' = '.join(weight.names)} is shared by pipeline stages {list(weight.stages)}, but tensor "
                       f"parallelism cut it differently on them (shapes {[tuple(t.tolist()) for t in shapes]}); give "
                       f"both modules the same style with tp_plan (e.g. 'vocab' for the embedding and "
                       f"'colwise_gather' for the head) or replicate both")
    problems: list[Optional[str]] = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    return next((p for p in problems if p), None)


def send_tied(module: nn.Module, stages: PreparedStages, engine: PipelineEngine, dims: MeshDims,
              coords: dict[str, int]) -> None:
    """A weight that several stages hold was initialised on each by its local module (a model built on the meta
    device); the stage holding the module of its single-device name did what one process does: its copy goes to the
    others."""
    owners = stages.partition.owners()
    units = sorted(owners, key=len, reverse=True)
    for weight, here, group in tied_copies(module, stages, engine):
        owner_module = weight.names[0].rpartition(".")[0]
        unit = next((u for u in units if owner_module == u or owner_module.startswith(u + ".")), None)
        stage = owners[unit] if unit is not None else min(weight.stages)
        src = dims.rank_of(dp=coords["dp"], pp=stage % dims.pp, tp=coords["tp"], cp=coords.get("cp", 0))
        dist.broadcast(here.data, src=src, group=group)
