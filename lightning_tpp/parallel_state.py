"""``ParallelState``: everything the strategy decided for one model, in one typed object that every part is handed.

Built once per model by ``TensorPipeStrategy.setup`` (mesh and groups -> single-device names -> pipeline stages ->
tensor-parallel plan -> shards -> pipeline engine) and kept on the module, so that a second Trainer (or a second
``fit``/``validate``) adopts it instead of parallelising the already parallel model again::

    ParallelState
      dims, groups (mesh, tp, pp, dp)      where this rank sits and whom it talks to
      names                                 the single-device parameter names (checkpoints, optimizer state)
      plan, shards                          what tensor parallelism swapped, and which parameters it cut how
      stages, engine                        pipeline partition, this rank's units, tied weights; the schedule runner
      config                                the arguments that cut it (TensorPipeConfig.cutting: compared on adoption)
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_tpp.config import TensorPipeConfig
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.grads import average_gradients
from lightning_tpp.core.dp_shard import DPShards, shard_over_dp, sharded_numel
from lightning_tpp.core.materialize import materialize
from lightning_tpp.core.mesh import MeshDims
from lightning_tpp.core.params import ParamNames, ShardIndex
from lightning_tpp.core.recompute import recompute_blocks
from lightning_tpp.experts import ExpertParallelConfigError, MoELayer, active_parameters, find_experts, shard_banks
from lightning_tpp.experts.expert_parallel import ExpertGroup, reduce_expert_grads, split_experts
from lightning_tpp.pipeline.batchnorm import DeferredStatistics, batch_statistics_layers
from lightning_tpp.pipeline.build import PreparedStages, TiedWeight, finish_stages, format_partition, prepare_stages
from lightning_tpp.pipeline.engine import PipelineEngine
from lightning_tpp.pipeline.partition import PipelinePartitionError, block_modules, describe, find_block_sequences
from lightning_tpp.pipeline.auto import settle_auto
from lightning_tpp.pipeline.stage import end_stage_forward_last
from lightning_tpp.tensor_parallel.apply import BlockState, block_states, sum_block_partials, unchecked_replicated
from lightning_tpp.tensor_parallel.sequence import ElementState, apply_sequence_parallel, sum_partial_gradients
from lightning_tpp.tensor_parallel import (
    TensorParallelConfigError,
    TPPlan,
    apply_plan,
    check_divisible,
    coverage_warning,
    detect,
    format_plan,
    hf_plan,
    overlay,
    plan_rows,
    whole_kinds,
)

_SLOT = "_tpp_state"  # the one attribute lightning_tpp keeps on the user's LightningModule


@dataclass(frozen=True)
class ProcessGroups:
    """The device mesh and this rank's groups along each axis (``None``: a single rank on that axis)."""

    mesh: Optional[DeviceMesh]
    tp: TPGroup
    pp: Optional[ProcessGroup]
    dp: Optional[ProcessGroup]
    ep: Optional[ExpertGroup] = None  # expert parallelism (ep > 1): tokens exchanged, experts split


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
    tp_blocks: list[BlockState] = field(default_factory=list)  # this rank's tensor-parallel blocks
    experts: list[MoELayer] = field(default_factory=list)  # the mixture-of-experts layers of this rank
    config: dict[str, str] = field(default_factory=dict)
    layout: Optional[Any] = None  # layout="auto": the chosen lightning_tpp.layout.Layout
    reduction: Optional["GradientReduction"] = None  # the per-step gradient reduction (built at the end of setup)

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
    expert's gradient over the ranks holding it. ``requires_grad`` is read at every step (a callback may unfreeze
    layers mid-run)."""

    state: ParallelState
    dense: list[nn.Parameter]
    experts: list[nn.Parameter]

    @staticmethod
    def of(module: nn.Module, state: ParallelState, experts: list[nn.Parameter]) -> "GradientReduction":
        """``experts``: :func:`expert_parameters` of ``module`` (split over ep, outside FSDP2: the same objects)."""
        split = {id(p) for p in experts}
        return GradientReduction(state, [p for p in module.parameters() if id(p) not in split], experts)

    def __call__(self) -> None:
        sum_partial_gradients(self.state.sequence)  # sequence parallelism: each tp rank saw part of the tokens
        sum_block_partials(self.state.tp_blocks)  # replicated parameters used on this rank's heads only
        average_gradients([p for p in self.dense if p.requires_grad], self.state.groups.dp)
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


def _no_loss_parallel(module: nn.Module, keep: Sequence[str] = ()) -> None:
    """Cross-entropy on whole (gathered) logits for every tensor-parallel LM head of ``module`` (but ``keep``)."""
    for name, m in module.named_modules():
        layer = getattr(m, "_tpp_layer", None)
        if layer is not None and name not in keep:
            layer.loss_parallel = False


def build_state(module: nn.Module, config: TensorPipeConfig, dims: MeshDims, groups: ProcessGroups, *, rank: int,
                device: torch.device, meta: Optional[Materialization] = None) -> ParallelState:
    """Cut ``module`` for this rank, in the one order everything depends on::

        single-device names -> pipeline stages (this rank keeps its units; stand-ins for the others)
          -> tensor-parallel plan (automatic, Hugging Face, the user's globs) -> apply (swap and shard)
          -> activation checkpointing (each block of this rank) -> running statistics of this rank's batch
          normalisation kept over the whole batch (``pipeline.batchnorm``) -> finish the stages (dispatchers, tied
          weights, the engine)
          -> a model built on the meta device: this rank's shards allocated and initialised (``meta``)

    Everything before the last step works on meta tensors (shapes only), so no rank ever holds the whole model.
    """
    state = ParallelState(dims, groups, ParamNames.of(module))  # names before stages drop modules
    if config.ep > 1 and not find_experts(module):
        raise ExpertParallelConfigError(f"ep={config.ep} splits the experts of mixture-of-experts layers, and "
                                        f"{type(module).__name__} has none that lightning_tpp recognises (a router "
                                        f"and a bank of 3-D expert weights); use ep=1")
    coords = dims.coords(rank)
    statistics = batch_statistics_layers(module) if config.pp > 1 else []  # the whole model's, for the warning
    state.stages, state.plan, state.shards = cut(module, config, dims, pp_rank=coords["pp"], device=device,
                                                 tp_group=groups.tp, ep_group=groups.ep)
    state.experts = find_experts(module)
    state.tp_blocks = block_states(module) if config.tp > 1 else []
    if not config.loss_parallel:
        _no_loss_parallel(module)
    if config.sequence_parallel and config.tp > 1:
        state.sequence = _sequence_parallel(module, state.stages, config, groups.tp, state.shards)
    if config.activation_checkpointing:  # inside the pipeline's dispatchers, around the tensor-parallel blocks
        state.recomputed = _recompute_blocks(module, state.stages, config.blocks)
        for element in state.sequence:
            element.recomputed = element.name in state.recomputed
    if state.stages is not None:
        # running statistics over the whole batch: below the dispatchers, which decide whether a layer runs
        deferred = DeferredStatistics.install(module, pp=config.pp, microbatches=config.microbatches, warn=statistics)
        state.engine = finish_stages(module, state.stages, dims=dims, coords=coords, virtual=config.virtual_stages,
                                     schedule=config.schedule, microbatches=config.microbatches, pp_group=groups.pp)
        state.engine.batch_statistics = deferred
        if config.tp > 1:
            _check_tied(module, state, device)
    if meta is not None:
        materialize(module, device=meta.device, names=state.names, shards=state.shards, tp_rank=groups.tp.rank,
                    tp_size=groups.tp.size, base_seed=meta.base_seed, loaded=meta.loaded)
        if state.stages is not None:
            _sync_tied(module, state, dims, coords)
    print_plan = config.print_plan
    if config.tp > 1:  # the table's rows are gathered over pp whether or not this rank prints: every rank joins
        table = _plan_table(module, state, config.tp)
        if print_plan:
            rank_zero_info(table)
    if print_plan and state.stages is not None:
        rank_zero_info(format_partition(state.stages.partition, dims.pp))
    if print_plan and state.recomputed:
        rank_zero_info(f"Activation checkpointing: {len(state.recomputed)} blocks of this rank recomputed in backward "
                       f"({state.recomputed[0]}..{state.recomputed[-1]})")
    return state


def _plan_table(module: nn.Module, state: ParallelState, tp: int) -> str:
    """The plan table of the whole model: under a pipeline each rank knows only its stages' modules, so every pp
    rank's rows are gathered (an object collective over the pp group, once at setup, on every rank: ``print_plan``
    may differ between ranks, e.g. ``print_plan=rank == 0``)."""
    part = plan_rows(module, state.plan, state.shards)
    if state.stages is None or state.groups.pp is None:
        return format_plan([part], tp)
    parts: list[Any] = [None] * dist.get_world_size(state.groups.pp)
    dist.all_gather_object(parts, part, group=state.groups.pp)
    return format_plan(parts, tp, model_params=state.stages.total_params)


def cut(module: nn.Module, config: TensorPipeConfig, dims: MeshDims, *, pp_rank: int, device: torch.device,
        tp_group: TPGroup, ep_group: Optional[TPGroup] = None) -> tuple[Optional[PreparedStages], TPPlan, ShardIndex]:
    """This pipeline rank's stage (stand-ins for the others), then the tensor-parallel plan (automatic, Hugging Face,
    the user's globs) applied to it, then the experts split over ``ep_group`` (``config.ep > 1``): the part of
    ``build_state`` that decides what a rank holds, also run by the memory planner on a meta copy."""
    whole_model = [n for n, _ in module.named_modules()]
    stages = None
    if config.pp > 1:
        stages = prepare_stages(module, dims=dims, pp_rank=pp_rank, virtual=config.virtual_stages, device=device,
                                blocks=config.blocks, balance=config.balance, split_points=config.split_points,
                                weight=active_parameters)  # experts counted as they run: top-k of E
    remote = stages.remote_names() if stages is not None else frozenset()
    plan = detect(module, config.tp, check=False, remote=stages.remote_twins() if stages is not None else remote)
    shards = ShardIndex()
    if config.tp > 1:
        overlay(module, plan, hf_plan(module), source="Hugging Face tp plan", strict=False, remote=remote)
        if isinstance(config.tp_plan, Mapping):
            overlay(module, plan, config.tp_plan, source="tp_plan", strict=True, whole_model=whole_model,
                    remote=remote)
        check_divisible(plan, config.tp)
        shards = apply_plan(module, plan, tp_group, verify=config.verify)
        unchecked = [] if config.verify else unchecked_replicated(module)
        if unchecked:
            rank_zero_warn(
                f"verify=False: the gradient check is off, so nothing finds which replicated parameters inside "
                f"tensor-parallel attention blocks are applied to this rank's heads only (a per-head norm, a "
                f"per-head bias table): each rank's gradient of such a parameter is a part, to be summed over tp. "
                f"These {len(unchecked)} train as if every rank's gradient were whole: {unchecked[:6]}"
                f"{' ...' if len(unchecked) > 6 else ''}. Leave verify=True (the default) to have them found at the "
                f"first training step, or keep such a block whole with tp_plan={{'<block>': 'replicate'}}")
        if config.ep == 1:
            _shard_experts(module, plan, config, tp_group, shards)
    if config.ep > 1:
        assert ep_group is not None and ep_group.size == config.ep
        _split_experts(module, plan, config, tp_group, ep_group, shards)
    if config.tp > 1:
        try:
            blocks = _local_blocks(module, stages, config.blocks)
        except PipelinePartitionError:  # no repeated blocks: the model's linear and embedding layers are its blocks
            blocks = [n for n, m in module.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))]
        warning = coverage_warning(module, plan, config.tp, shards, blocks) or whole_kinds(
            module, plan, config.tp, shards, blocks)
        if warning:
            rank_zero_warn(warning)
    return stages, plan, shards


def _shard_experts(module: nn.Module, plan: TPPlan, config: TensorPipeConfig, tp_group: TPGroup,
                   shards: ShardIndex) -> None:
    """Expert tensor parallelism for the experts held as 3-D banks (listed in the plan as ``experts``); a list of
    expert MLPs was already cut by the plan, each expert an MLP. A ``replicate`` entry of ``tp_plan`` keeps a bank
    whole."""
    whole = [g for g, style in config.tp_plan.items() if style == "replicate"] if isinstance(config.tp_plan,
                                                                                            Mapping) else []
    layers = [layer for layer in find_experts(module)
              if not any(fnmatch.fnmatchcase(layer.experts, g) for g in whole)]
    for name in shard_banks(module, layers, tp_group, shards, verify=config.verify):
        plan.styles[name] = "experts"
    for layer in layers:
        plan.notes.append(f"{layer.name}: {layer.count} experts ({layer.kind}), each cut over tp "
                          f"(router {layer.router or 'not found'} replicated"
                          + (f"; shared: {', '.join(n.rpartition('.')[2] for n in layer.shared)})" if layer.shared
                             else ")"))


def _split_experts(module: nn.Module, plan: TPPlan, config: TensorPipeConfig, tp_group: TPGroup, ep_group: TPGroup,
                   shards: ShardIndex) -> None:
    """Expert parallelism: each rank keeps ``experts / ep`` whole experts of every bank; the tokens travel. A list of
    expert modules (the model's own loop calls each one) is cut over tp, each expert an MLP (kept whole at tp = 1),
    with a warning that names it."""
    layers = find_experts(module)
    lists = [layer for layer in layers if layer.kind == "list"]
    if lists:
        names = ", ".join(layer.name for layer in lists)
        how = (f"cut over tp={config.tp} instead, each expert an MLP" if config.tp > 1 else
               "kept whole on every rank (averaged over dp as the dense layers; tp > 1 would cut them)")
        rank_zero_warn(f"ep={config.ep} splits experts held as 3-D banks; the experts of {names} are lists of "
                       f"modules that the model's own loop calls one by one, so they are {how}")
        layers = [layer for layer in layers if layer.kind != "list"]
    for name in split_experts(module, layers, ep_group, tp_group, shards, verify=config.verify):
        plan.styles[name] = "ep"
    for layer in layers:
        plan.notes.append(f"{layer.name}: {layer.count} experts, {layer.count // config.ep} per rank over ep="
                          f"{config.ep} (tokens exchanged by all-to-all; router {layer.router or 'not found'} "
                          f"replicated)")


def _sequence_parallel(module: nn.Module, stages: Optional[PreparedStages], config: TensorPipeConfig, group: TPGroup,
                       shards: ShardIndex) -> list[ElementState]:
    """The model's block sequence (the pipeline partition's, else found or ``blocks``) run on sequence shards."""
    if stages is not None:
        containers, members = stages.partition.blocks, stages.partition.members
    else:
        try:
            containers = find_block_sequences(module) if config.blocks is None else (
                (config.blocks,) if isinstance(config.blocks, str) else tuple(config.blocks))
            members = describe(module, containers, zip_siblings=config.blocks is None)[0]
        except PipelinePartitionError as err:
            raise ValueError(f"sequence_parallel=True runs the blocks of the model's repeated block sequence (an "
                             f"nn.ModuleList or nn.Sequential of same-class layers) on sequence shards, and none was "
                             f"found in {type(module).__name__}: {err}. Name their container with blocks='<module "
                             f"name>', or use sequence_parallel=False") from err
    # several members: entries of zipped sibling lists, or a Sequential's layer and the activation after it
    zipped = [m for m in members if len({n.rpartition(".")[0] for n in m}) > 1]
    if zipped:
        raise ValueError(f"sequence_parallel=True passes the residual stream from block to block on sequence shards; "
                         f"the blocks {zipped[0]} are entries of sibling lists run in one loop, whose stream the "
                         f"model's own loop holds. Use sequence_parallel=False")
    # one run per stack (an encoder's, then a decoder's)
    runs: list[list[str]] = []
    container = lambda name: next((c for c in containers if name == c or name.startswith(f"{c}.")), None)  # noqa
    for member in (n for block in members for n in block):
        for name in _called_blocks(module, member):
            if not runs or container(name) != container(runs[-1][0]):
                runs.append([])
            runs[-1].append(name)
    local = set(_local_blocks(module, stages, config.blocks)) if stages is not None else None
    return apply_sequence_parallel(module, runs, group, shards, local_names=local,
                                   twins=stages.twins if stages is not None else None, verify=config.verify)


def _called_blocks(module: nn.Module, name: str) -> list[str]:
    """The modules the model calls for block ``name``: the block, or the entries of a list of layers that its loop
    unpacks and calls one by one (``for attn, ff in self.layers``), in order."""
    block = module.get_submodule(name)
    if not isinstance(block, (nn.ModuleList, nn.ModuleDict)):
        return [name]
    return [n for child, _ in block.named_children() for n in _called_blocks(module, f"{name}.{child}")]


def _tied_copies(module: nn.Module, state: ParallelState) -> Iterator[tuple[TiedWeight, nn.Parameter, Any]]:
    """This rank's copy of each weight that several stages hold, with the group of the ranks holding one."""
    assert state.stages is not None and state.engine is not None
    groups = {id(p): group for p, group in state.engine.tied}
    params = dict(module.named_parameters(remove_duplicate=False))
    for weight in state.stages.tied:
        here = next((params[n] for n in weight.names if n in params), None)
        if here is not None and id(here) in groups:
            yield weight, here, groups[id(here)]


def _sync_tied(module: nn.Module, state: ParallelState, dims: MeshDims, coords: dict[str, int]) -> None:
    """A weight that several stages hold (tied embedding and head) was initialised on each by its local module; the
    stage holding the module of its single-device name did what one process does: its copy goes to the others."""
    assert state.stages is not None
    owners = state.stages.partition.owners()
    units = sorted(owners, key=len, reverse=True)
    for weight, here, group in _tied_copies(module, state):
        owner_module = weight.names[0].rpartition(".")[0]
        unit = next((u for u in units if owner_module == u or owner_module.startswith(u + ".")), None)
        stage = owners[unit] if unit is not None else min(weight.stages)
        src = dims.rank_of(dp=coords["dp"], pp=stage % dims.pp, tp=coords["tp"])
        torch.distributed.broadcast(here.data, src=src, group=group)


def _check_tied(module: nn.Module, state: ParallelState, device: torch.device) -> None:
    """A weight that several stages hold must be cut alike on each (its gradients are summed, and a whole-model load
    gives it to each): the same clear error on every rank otherwise, instead of collectives of mismatched sizes."""
    problem = None
    for weight, here, group in _tied_copies(module, state):
        shapes = [torch.zeros(here.dim(), dtype=torch.long, device=device)
                  for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(shapes, torch.tensor(here.shape, device=device), group=group)
        if len({tuple(t.tolist()) for t in shapes}) > 1 and problem is None:  # cut on one stage, whole on another
            problem = (f"{' = '.join(weight.names)} is shared by pipeline stages {list(weight.stages)}, but tensor "
                       f"parallelism cut it differently on them (shapes {[tuple(t.tolist()) for t in shapes]}); give "
                       f"both modules the same style with tp_plan (e.g. 'vocab' for the embedding and "
                       f"'colwise_gather' for the head) or replicate both")
    problems: list[Optional[str]] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(problems, problem)  # one decision: no rank leaves while others still set up
    first = next((p for p in problems if p), None)
    if first is not None:
        raise TensorParallelConfigError(first)


def shard_state_over_dp(module: nn.Module, state: ParallelState, config: TensorPipeConfig, *,
                        keep: Sequence[nn.Parameter] = ()) -> None:
    """FSDP2 over the dp mesh axis, last (after tensor parallelism, the stages, materialising and loading weights):
    each block of this rank one unit, the other parameters grouped by the module holding them; ``keep`` (experts
    split over ep, whose replicas are not all of dp) left out. Everything that held the replaced parameter objects
    follows them."""
    assert state.groups.mesh is not None
    try:
        names = _local_blocks(module, state.stages, config.blocks)
    except PipelinePartitionError:
        if config.blocks is not None:
            raise
        names = []  # no block sequence: a unit per module holding parameters
    sharding = config.dp_sharding
    state.dp = shard_over_dp(module, state.groups.mesh["dp"], blocks=names, sharding=sharding,
                             vocab_exchange=config.vocab_exchange, keep=keep)
    # FSDP2 gathers a unit for backward when its output's gradient arrives: a loss computed from the head's shards
    # would bypass that output (a head computed over dp has no such hook)
    _no_loss_parallel(module, keep=[r.name for r in state.dp.rows])
    state.shards.rekey(state.dp.replaced)
    state.shards.resolve = state.dp.sharded_of
    if state.engine is not None:
        state.engine.rekey(state.dp.replaced)
        end_stage_forward_last(module)  # FSDP2's post-forward hooks run before a stage's forward is cut short
        dp = state.dp
        engine = state.engine
        if engine.deciding:
            choice = settle_auto(engine.pp, engine.microbatches, engine.virtual,
                                 dp_sharded=f"dp={state.groups.mesh['dp'].size()} ({sharding}, FSDP2)")
            assert choice is not None  # always one with dp_sharded
            engine.settle(choice)
        if engine.splits_backward:
            engine.reduction = lambda: dp.reduce_at_end(module)
    if config.print_plan:
        rank_zero_info(state.dp.describe(*sharded_numel(module)))


def _local_blocks(module: nn.Module, stages: Optional[PreparedStages], blocks: Optional[Union[str, Sequence[str]]],
                  ) -> list[str]:
    """This rank's blocks: the pipeline partition's, else the model's block sequence (raises if there is none)."""
    if stages is not None:
        return [n for n in block_modules(module, stages.partition.members) if n not in stages.remote_names()]
    return block_modules(module, blocks=blocks)


def _recompute_blocks(module: nn.Module, stages: Optional[PreparedStages],
                      blocks: Optional[Union[str, Sequence[str]]]) -> tuple[str, ...]:
    """Activation checkpointing on this rank's blocks: the pipeline partition's, else the model's block sequence."""
    try:
        names = _local_blocks(module, stages, blocks)
    except PipelinePartitionError as err:
        if blocks is not None:  # the user's containers: the partitioner says what is wrong with them
            raise
        raise ValueError(f"activation_checkpointing=True recomputes each block of the model's repeated block sequence "
                         f"(an nn.ModuleList or nn.Sequential of same-class layers, e.g. transformer layers) in "
                         f"backward, and none was found in {type(module).__name__}. Name the container of the blocks "
                         f"with blocks='<module name>', or use activation_checkpointing=False") from err
    return recompute_blocks(module, names)
