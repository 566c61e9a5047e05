"""``ParallelState``: everything the strategy decided for one model, in one typed object that every part is handed,
and the ``ModelMap``: what setup reads of the whole model, found once before anything is cut.

Built once per model by the setup steps (``lightning_tpp.steps``) and kept on the module, so that a second Trainer
(or a second ``fit``/``validate``) adopts it instead of parallelising the already parallel model again::

    ParallelState
      dims, groups (mesh, tp, pp, dp)      where this rank sits and whom it talks to
      names                                 the single-device parameter names (checkpoints, optimizer state)
      plan, shards                          what tensor parallelism swapped, and which parameters it cut how
      stages, engine                        pipeline partition, this rank's units, tied weights; the schedule runner
      config                                the arguments that cut it (TensorPipeConfig.cutting: compared on adoption)
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

import torch
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_tpp.config import TensorPipeConfig
from lightning_tpp.context_parallel import ContextState
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.grads import average_gradients
from lightning_tpp.core.mesh import MeshDims
from lightning_tpp.core.params import ParamNames, ShardIndex
from lightning_tpp.data_parallel import DPShards
from lightning_tpp.experts import MoELayer, find_experts
from lightning_tpp.experts.expert_parallel import ExpertGroup, reduce_expert_grads
from lightning_tpp.pipeline.batchnorm import StatisticsLayer, batch_statistics_layers
from lightning_tpp.pipeline.build import PreparedStages
from lightning_tpp.pipeline.engine import PipelineEngine
from lightning_tpp.pipeline.partition import BlockSequence, PipelinePartitionError, block_sequence
from lightning_tpp.tensor_parallel.apply import BlockState, sum_block_partials
from lightning_tpp.tensor_parallel.sequence import ElementState, sum_partial_gradients
from lightning_tpp.tensor_parallel import TPPlan, hf_plan

_SLOT = "_tpp_state"  # the one attribute lightning_tpp keeps on the user's LightningModule


@dataclass(frozen=True)
class ProcessGroups:
    """The device mesh and this rank's groups along each axis (``None``: a single rank on that axis)."""

    mesh: Optional[DeviceMesh]
    tp: TPGroup
    pp: Optional[ProcessGroup]
    dp: Optional[ProcessGroup]
    ep: Optional[ExpertGroup] = None  # expert parallelism (ep > 1): tokens exchanged, experts split
    cp: Optional[TPGroup] = None  # context parallelism (cp > 1): the ranks holding other positions of the same samples
    replicas: Optional[ProcessGroup] = None  # cp > 1: dp x cp, the ranks holding the same weights

    @property
    def averaged(self) -> Optional[ProcessGroup]:
        """The group gradients are averaged over: the ranks holding the same weights (dp, or dp x cp)."""
        return self.replicas if self.replicas is not None else self.dp


@dataclass(frozen=True)
class ModelMap:
    """What setup reads of the whole model, found once before anything is cut and read by every later step: the
    single-device names, every module name (a ``tp_plan`` glob may match a module another stage holds), the block
    sequence (``None``: the model has none, ``missing`` says why), the mixture-of-experts layers and the Hugging
    Face tensor-parallel plan."""

    names: ParamNames
    modules: tuple[str, ...]
    sequence: Optional[BlockSequence]
    missing: Optional[PipelinePartitionError]
    experts: tuple[MoELayer, ...]
    hf_plan: Mapping[str, str]
    statistics: tuple[StatisticsLayer, ...]  # batch normalisation of the whole model (pp > 1: for the warning)

    @staticmethod
    def of(module: nn.Module, config: TensorPipeConfig) -> "ModelMap":
        try:  # placed by the forward's order when a pipeline's first and last stages need it (one meta forward)
            sequence, missing = block_sequence(module, config.blocks, stages=max(2, config.pp * config.virtual_stages),
                                               ordered=config.pp > 1), None
        except PipelinePartitionError as err:
            sequence, missing = None, err
        return ModelMap(ParamNames.of(module), tuple(n for n, _ in module.named_modules()), sequence, missing,
                        tuple(find_experts(module)), hf_plan(module) if config.tp > 1 else {},
                        tuple(batch_statistics_layers(module)) if config.pp > 1 else ())

    def blocks(self) -> BlockSequence:
        """The block sequence; raises the partitioner's error when the model has none."""
        if self.sequence is None:
            assert self.missing is not None
            raise self.missing
        return self.sequence


@dataclass
class ParallelState:
    dims: MeshDims
    groups: ProcessGroups
    names: ParamNames
    plan: TPPlan = field(default_factory=TPPlan)
    shards: ShardIndex = field(default_factory=ShardIndex)
    stages: Optional[PreparedStages] = None
    engine: Optional[PipelineEngine] = None
    recomputed: tuple[str, ...] = ()  # blocks whose activations are recomputed in backward (activation checkpointing)
    dp: Optional[DPShards] = None  # what FSDP2 sharded over dp (None: replicated)
    sequence: list[ElementState] = field(default_factory=list)  # blocks run on sequence shards (sequence_parallel)
    context: Optional[ContextState] = None  # cp > 1: the blocks run on this rank's positions of each sequence
    tp_blocks: list[BlockState] = field(default_factory=list)  # this rank's tensor-parallel blocks
    experts: list[MoELayer] = field(default_factory=list)  # the mixture-of-experts layers of this rank
    config: dict[str, str] = field(default_factory=dict)
    blocks: tuple[str, ...] = ()  # this rank's blocks, in order (the modules whose forward each block runs)
    compiled: list[str] = field(default_factory=list)  # compile=: this rank's blocks to compile (torch.compile)
    layout: Optional[Any] = None  # layout="auto": the chosen lightning_tpp.layout.Layout
    reduction: Optional["GradientReduction"] = None  # the per-step gradient reduction (built at the end of setup)
    loaded: list[Any] = field(default_factory=list)  # weights=: what each read did (checkpoint.weights.LoadedWeights)

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


@dataclass
class GradientReduction:
    """What each optimizer step does to the gradients before clipping, built once at setup (after FSDP2, whose
    parameters it holds) and run without walking the model: the partial sums over tp (sequence parallelism's
    norms, replicated parameters used on this rank's heads), then the dense parameters averaged over dp and each
    expert's gradient over the ranks holding it. Under context parallelism every rank's gradient is ``cp`` times its
    positions' part (``context_parallel``), so the average over dp x cp is one process's. ``requires_grad`` is read at every step (a callback may unfreeze
    layers mid-run)."""

    state: ParallelState
    dense: list[nn.Parameter]
    experts: list[nn.Parameter]

    @staticmethod
    def of(module: nn.Module, state: ParallelState, experts: list[nn.Parameter]) -> "GradientReduction":
        """``experts``: :func:`expert_parameters` of ``module`` as FSDP2 left them (split over ep; those sharded over
        their replicas were reduced in backward)."""
        split = {id(p) for p in experts}
        return GradientReduction(state, [p for p in module.parameters() if id(p) not in split], experts)

    def __call__(self) -> None:
        sum_partial_gradients(self.state.sequence)  # sequence parallelism: each tp rank saw part of the tokens
        sum_block_partials(self.state.tp_blocks)  # replicated parameters used on this rank's heads only
        average_gradients([p for p in self.dense if p.requires_grad], self.state.groups.averaged)
        if self.state.groups.ep is not None:  # averaged over their replicas only
            reduce_expert_grads(self.experts, self.state.groups.ep)


@dataclass(frozen=True)
class Materialization:
    """How a model built on the meta device gets its tensors: on ``device``, initialised per module from
    ``base_seed`` (the same on every rank), except modules whose tensors all come from a file (``loaded``: their
    single-device names), which are only allocated."""

    device: torch.device
    base_seed: int
    loaded: frozenset[str] = frozenset()
