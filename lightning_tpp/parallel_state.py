"""``ParallelState``: everything the strategy decided for one model, in one typed object that every part is handed.

Built once per model by ``TensorPipeStrategy.setup`` (mesh and groups -> single-device names -> pipeline stages ->
tensor-parallel plan -> shards -> pipeline engine) and kept on the module, so that a second Trainer (or a second
``fit``/``validate``) adopts it instead of parallelising the already parallel model again::

    ParallelState
      dims, groups (mesh, tp, pp, dp)      where this rank sits and whom it talks to
      names                                 the single-device parameter names (checkpoints, optimizer state)
      plan, shards                          what tensor parallelism swapped, and which parameters it cut how
      stages, engine                        pipeline partition, this rank's units, tied weights; the schedule runner
      config                                the strategy arguments it was built with (compared on adoption)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.mesh import MeshDims
from lightning_tpp.core.params import ParamNames, ShardIndex
from lightning_tpp.pipeline.build import PreparedStages
from lightning_tpp.pipeline.engine import PipelineEngine
from lightning_tpp.tensor_parallel.plan import TPPlan

_SLOT = "_tpp_state"  # the one attribute lightning_tpp keeps on the user's LightningModule


@dataclass(frozen=True)
class ProcessGroups:
    """The device mesh and this rank's groups along each axis (``None``: a single rank on that axis)."""

    mesh: Optional[DeviceMesh]
    tp: TPGroup
    pp: Optional[ProcessGroup]
    dp: Optional[ProcessGroup]


@dataclass
class ParallelState:
    dims: MeshDims
    groups: ProcessGroups
    names: ParamNames
    plan: TPPlan = field(default_factory=TPPlan)
    shards: ShardIndex = field(default_factory=ShardIndex)
    stages: Optional[PreparedStages] = None
    engine: Optional[PipelineEngine] = None
    config: dict[str, str] = field(default_factory=dict)

    def attach(self, module: nn.Module) -> None:
        module.__dict__[_SLOT] = self

    @staticmethod
    def of(module: nn.Module) -> Optional["ParallelState"]:
        return module.__dict__.get(_SLOT)

    def counted_elsewhere(self, module: nn.Module) -> list[nn.Parameter]:
        """Tied weights whose gradient norm another rank counts (the lowest stage that holds them)."""
        return self.stages.tied_params(module, secondary=True) if self.stages is not None else []

    def check_same(self, config: dict[str, Any], dims: MeshDims) -> None:
        """A model parallelised by one strategy can only be reused by a strategy with the same arguments."""
        differences = {k: (v, config.get(k)) for k, v in self.config.items() if config.get(k) != v}
        if dims != self.dims:
            differences["dims"] = (repr(self.dims), repr(dims))
        if differences:
            raise ValueError(
                "this LightningModule was already parallelised by a TensorPipeStrategy with other arguments "
                + ", ".join(f"{k}: {a} (then) vs {b} (now)" for k, (a, b) in differences.items())
                + "; its layers are already cut that way. Use the same arguments, or build a fresh module")
