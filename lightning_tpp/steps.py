"""The order of operations at setup, in one place: a tuple of named steps that the strategy runs on the model, and the
memory planner and the layout profile run on meta copies (``until=``), so that what they measure can never drift
from what setup does. A new capability is a new step::

    agree             ranks agree on arguments, model and seed; rank 0's weights broadcast        (live)
    refuse            what a pipeline cannot run (manual optimization, a loss-scaling GradScaler) (live)
    sync_batchnorm    Trainer(sync_batchnorm=True): SyncBatchNorm over the dp group               (live)
    seed              rank 0's seed: meta-built tensors, the strategy's own random stream         (live)
    map               the whole model read once: names, blocks, experts, HF plan (ModelMap)
    stages            pipeline partition; this rank keeps its units, stand-ins for the others
    blocks            this rank's blocks, in order (read by the steps below)
    tp_plan           the tensor-parallel plan: detected, Hugging Face's, the user's globs
    tp_apply          the plan applied (layers swapped and cut)
    experts           expert banks cut over tp, or split over ep
    coverage          what tensor parallelism left whole, said
    loss_parallel     loss_parallel=False: cross-entropy on gathered logits
    sequence_parallel the blocks run on sequence shards
    context_parallel  the blocks run on this rank's positions of each sequence, the LM head on its columns (cp > 1)
    recompute         activation checkpointing of this rank's blocks
    engine            batch statistics deferred; dispatchers, tied weights, the engine            (live)
    compile           compile=: the blocks to compile after the first step (regional)            (live)
    materialize       a meta-built model: this rank's shards allocated and initialised (banks     (live)
                      that FSDP2 shards over their replicas: left on meta for later)
    report            the plan table, the partition                                               (live)
    weights           weights= loaded into this rank's shards                                     (live)
    split             the experts split over ep (sharded over their replicas, or reduced apart)   (live)
    dp                FSDP2 over dp (after the precision plugin fixed the dtype)                  (live)
    expert_shards     the banks left for later, now FSDP2's shards: each rank initialises or     (live)
                      reads (weights=) its part only
    reduction         the per-step gradient reduction, built once                                 (live)

Live steps touch other ranks, real tensors or the user's files: the planner's meta copies stop before them.
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass, field
from itertools import chain
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_warn
from torch import nn

from lightning_tpp.checkpoint.weights import covered_names, fill_from_whole, load_weights
from lightning_tpp.config import TensorPipeConfig
from lightning_tpp.context_parallel import (
    ContextParallelError,
    apply_context_parallel,
    cut_heads,
    mixing_layers,
    vocab_heads,
)
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.grads import broadcast_module
from lightning_tpp.core.materialize import has_meta, initialise_whole, materialize
from lightning_tpp.core.mesh import MeshDims, replica_mesh
from lightning_tpp.core.recompute import recompute_blocks
from lightning_tpp.data_parallel import ExpertShards, shard_over_dp, sharded_numel, sync_batchnorm_over_dp
from lightning_tpp.experts import ExpertParallelConfigError, active_parameters, find_experts, shard_banks
from lightning_tpp.experts.expert_parallel import expert_parameters, split_banks, split_experts
from lightning_tpp.parallel_state import GradientReduction, Materialization, ModelMap, ParallelState, ProcessGroups
from lightning_tpp.pipeline.auto import AutoChoice, settle_auto
from lightning_tpp.pipeline.batchnorm import DeferredStatistics
from lightning_tpp.pipeline.build import finish_stages, format_partition, prepare_stages
from lightning_tpp.pipeline.partition import PipelinePartitionError, block_modules
from lightning_tpp.pipeline.stage import end_stage_forward_last
from lightning_tpp.pipeline.tied import send_tied, tied_shape_problem
from lightning_tpp.reliability.preflight import check_agreement
from lightning_tpp.tensor_parallel import (
    TensorParallelConfigError,
    TPPlan,
    apply_plan,
    check_divisible,
    coverage_warning,
    detect,
    format_plan,
    overlay,
    plan_rows,
    whole_kinds,
)
from lightning_tpp.tensor_parallel.apply import block_states, checks_off, unchecked_replicated
from lightning_tpp.tensor_parallel.sequence import apply_sequence_parallel, sequence_runs


@dataclass
class Setup:
    """What the steps read (the model, the config, where this rank sits) and what they found so far (``map``,
    ``state``). ``live``: the strategy's own run (ranks agree, tensors are materialised, weights loaded, FSDP2);
    the planner's meta copies are not live."""

    module: nn.Module
    config: TensorPipeConfig
    dims: MeshDims
    groups: ProcessGroups
    rank: int = 0
    device: torch.device = torch.device("meta")
    live: bool = False
    fingerprint: Mapping[str, Any] = field(default_factory=dict)  # what every rank must agree on (live)
    sync_batchnorm: bool = False  # Trainer(sync_batchnorm=True)
    loss_scaling: bool = False  # a GradScaler (precision="16-mixed")
    convert: Callable[[nn.Module], Any] = lambda module: module  # the precision plugin's convert_module
    plan: Optional[TPPlan] = None  # a plan already made: applied as it is (the planner's whole meta copy)
    map: Optional[ModelMap] = None
    state: Optional[ParallelState] = None
    meta: Optional[Materialization] = None  # a model built on the meta device: how its tensors are made
    split: list[nn.Parameter] = field(default_factory=list)  # experts split over ep: outside the dp units
    context_runs: list[list[str]] = field(default_factory=list)  # cp > 1: the runs of blocks, read on the whole model
    context_heads: list[str] = field(default_factory=list)  # ... and the LM heads whose columns cp cuts
    deferred: list[str] = field(default_factory=list)  # banks left on meta until FSDP2 cut them

    @property
    def pp_rank(self) -> int:
        return self.dims.coords(self.rank)["pp"]


class Step(NamedTuple):
    name: str
    run: Callable[[Setup], None]
    live: bool = False  # only in the strategy's own run


def run(module: nn.Module, config: TensorPipeConfig, groups: ProcessGroups, *, dims: MeshDims,
        until: Optional[str] = None, **context: Any) -> Setup:
    """Run the setup steps on ``module`` in order, through ``until`` (inclusive; all by default). ``context``: the
    other fields of :class:`Setup`. Returns the setup, its ``state`` holding what was decided."""
    names = [step.name for step in STEPS]
    if until is not None and until not in names:
        raise ValueError(f"until={until!r} is not a setup step; the steps are {names}")
    setup = Setup(module, config, dims or MeshDims(config.int_dp, config.int_pp, config.tp), groups, **context)
    for step in STEPS:
        if setup.live or not step.live:
            step.run(setup)
        if step.name == until:
            break
    return setup


def meta_groups(config: TensorPipeConfig) -> ProcessGroups:
    """The groups of a meta copy cut alone: tp rank 0 of ``config.tp``, ep rank 0 of ``config.ep``, no process
    groups (the planner and the layout profile)."""
    return ProcessGroups(None, TPGroup(None, 0, config.tp), None, None,  # type: ignore[arg-type]
                         TPGroup(None, 0, config.ep) if config.ep > 1 else None,  # type: ignore[arg-type]
                         TPGroup(None, 0, config.cp) if config.cp > 1 else None)


# ---------------------------------------------------------------------------------------------------------------
# live steps before the cut


def _agree(s: Setup) -> None:
    check_agreement({**s.fingerprint, "built on the meta device": has_meta(s.module)})
    broadcast_module(s.module, src=0)  # what exists already (an eager model); meta tensors are initialised per rank


def _refuse(s: Setup) -> None:
    if s.config.pp == 1:
        return
    if not getattr(s.module, "automatic_optimization", True):
        raise ValueError("pipeline parallelism (pp>1) runs forward and backward inside the schedule and "
                         "needs automatic optimization; set automatic_optimization = True or use pp=1")
    if s.loss_scaling:
        raise ValueError("pipeline parallelism (pp>1) does not support a loss-scaling GradScaler "
                         "(precision='16-mixed'): every stage would have to agree on each step's scale and "
                         "skip decision. Use precision='bf16-mixed' (no scaler needed) or '32-true'")


def _sync_batchnorm(s: Setup) -> None:  # before the cut: over dp only
    sync_batchnorm_over_dp(s.module, convert=s.sync_batchnorm, dp=s.dims.dp, group=s.groups.dp, device=s.device)


def _seed(s: Setup) -> None:
    """Rank 0's seed (``seed_everything``'s on every rank): a meta-built model is initialised from it, and the
    strategy's own random stream derives from it."""
    seed = torch.tensor([torch.initial_seed() % (2 ** 63)], dtype=torch.int64, device=s.device)
    if dist.is_available() and dist.is_initialized():
        dist.broadcast(seed, src=0)
    s.groups.tp.stream.seed = int(seed.item())


# ---------------------------------------------------------------------------------------------------------------
# the cut (also run by the planner on meta copies)


def _map(s: Setup) -> None:
    s.map = ModelMap.of(s.module, s.config)
    s.state = ParallelState(s.dims, s.groups, s.map.names)  # names before the stages drop modules
    if s.config.ep > 1 and not s.map.experts:
        raise ExpertParallelConfigError(f"ep={s.config.ep} splits the experts of mixture-of-experts layers, and "
                                        f"{type(s.module).__name__} has none that lightning_tpp recognises (a router "
                                        f"and a bank of 3-D expert weights); use ep=1")
    if s.live and has_meta(s.module):  # what a weights file fills is only allocated (the rest is initialised)
        seed = s.groups.tp.stream.seed
        loaded = covered_names(s.config.weights, names=s.map.names, prefix=s.config.weights_prefix,
                               module=s.module) if s.config.weights is not None else frozenset()
        s.meta = Materialization(s.device, seed, loaded)


def _stages(s: Setup) -> None:
    _refuse_context(s)
    if s.config.pp == 1:
        return
    assert s.map is not None and s.state is not None
    s.state.stages = prepare_stages(s.module, s.map.blocks(), dims=s.dims, pp_rank=s.pp_rank,
                                    virtual=s.config.virtual_stages, device=s.device, balance=s.config.balance,
                                    split_points=s.config.split_points, found=s.config.blocks is None,
                                    weight=active_parameters)  # experts counted as they run: top-k of E


def _blocks(s: Setup) -> None:
    assert s.map is not None and s.state is not None
    if s.map.sequence is None:
        return
    stages = s.state.stages
    names = block_modules(s.module, stages.partition.members if stages is not None else s.map.sequence.members)
    remote = stages.remote_names() if stages is not None else frozenset()
    s.state.blocks = tuple(n for n in names if n not in remote)


def _remote(s: Setup) -> frozenset[str]:
    assert s.state is not None
    return s.state.stages.remote_names() if s.state.stages is not None else frozenset()


def _tp_plan(s: Setup) -> None:
    assert s.map is not None and s.state is not None
    config, stages = s.config, s.state.stages
    if s.plan is not None:  # made on another copy: applied by name
        s.state.plan = s.plan.to_apply()
        return
    remote = _remote(s)
    plan = detect(s.module, config.tp, check=False, remote=stages.remote_twins() if stages is not None else remote)
    if config.tp > 1:
        overlay(s.module, plan, s.map.hf_plan, source="Hugging Face tp plan", strict=False, remote=remote)
        if isinstance(config.tp_plan, Mapping):
            overlay(s.module, plan, config.tp_plan, source="tp_plan", strict=True, whole_model=s.map.modules,
                    remote=remote)
        check_divisible(plan, config.tp)
    s.state.plan = plan


def _tp_apply(s: Setup) -> None:
    assert s.state is not None
    if s.config.tp == 1:
        return
    verify = s.config.verify and s.live
    s.state.shards = apply_plan(s.module, s.state.plan, s.groups.tp, verify=verify)
    unchecked = [] if verify or not s.live else unchecked_replicated(s.module)
    if unchecked:
        rank_zero_warn(
            f"verify=False: the gradient check is off, so nothing finds which replicated parameters inside "
            f"tensor-parallel attention blocks are applied to this rank's heads only (a per-head norm, a "
            f"per-head bias table): each rank's gradient of such a parameter is a part, to be summed over tp. "
            f"These {len(unchecked)} train as if every rank's gradient were whole: {unchecked[:6]}"
            f"{' ...' if len(unchecked) > 6 else ''}. Leave verify=True (the default) to have them found at the "
            f"first training step, or keep such a block whole with tp_plan={{'<block>': 'replicate'}}")


def _experts(s: Setup) -> None:
    """Expert tensor parallelism for experts held as 3-D banks (a list of expert MLPs was already cut by the plan,
    each expert an MLP; a ``replicate`` entry of ``tp_plan`` keeps a bank whole), or expert parallelism: each rank
    keeps ``experts / ep`` whole experts of every bank, the tokens travel."""
    assert s.map is not None and s.state is not None
    config, plan, shards = s.config, s.state.plan, s.state.shards
    here = set(dict(s.module.named_modules()))
    if s.plan is not None:  # a plan made elsewhere names the banks it cut or split
        here &= {name for name, style in s.plan.styles.items() if style in ("experts", "ep")}
    layers = [layer for layer in s.map.experts if layer.experts in here]  # this rank's stages'
    verify = config.verify and s.live
    if config.ep > 1:
        assert s.groups.ep is not None and s.groups.ep.size == config.ep
        lists = [layer for layer in layers if layer.kind == "list"]
        if lists:
            how = (f"cut over tp={config.tp} instead, each expert an MLP" if config.tp > 1 else
                   "kept whole on every rank (averaged over dp as the dense layers; tp > 1 would cut them)")
            rank_zero_warn(f"ep={config.ep} splits experts held as 3-D banks; the experts of "
                           f"{', '.join(layer.name for layer in lists)} are lists of modules that the model's own "
                           f"loop calls one by one, so they are {how}")
        layers = [layer for layer in layers if layer.kind != "list"]
        for name in split_experts(s.module, layers, s.groups.ep, s.groups.tp, shards, verify=verify):
            plan.styles[name] = "ep"
        notes = [f"{layer.name}: {layer.count} experts, {layer.count // config.ep} per rank over ep={config.ep} "
                 f"(tokens exchanged by all-to-all; router {layer.router or 'not found'} replicated)" for layer in layers]
    elif config.tp > 1:
        whole = [g for g, style in config.tp_plan.items() if style == "replicate"] \
            if isinstance(config.tp_plan, Mapping) else []
        layers = [layer for layer in layers if not any(fnmatch.fnmatchcase(layer.experts, g) for g in whole)]
        for name in shard_banks(s.module, layers, s.groups.tp, shards, verify=verify):
            plan.styles[name] = "experts"
        notes = [f"{layer.name}: {layer.count} experts ({layer.kind}), each cut over tp (router "
                 f"{layer.router or 'not found'} replicated"
                 + (f"; shared: {', '.join(n.rpartition('.')[2] for n in layer.shared)})" if layer.shared else ")")
                 for layer in layers]
    else:
        notes = []
    if s.plan is None:  # a plan made elsewhere already holds its notes
        plan.notes += notes
    s.state.experts = find_experts(s.module)  # as cut: a rank's share of each bank
    s.state.tp_blocks = block_states(s.module) if config.tp > 1 else []


def _coverage(s: Setup) -> None:
    assert s.state is not None
    if s.config.tp == 1:
        return
    blocks = list(s.state.blocks) or [n for n, m in s.module.named_modules() if isinstance(m, (nn.Linear,
                                                                                                   nn.Embedding))]
    args = (s.module, s.state.plan, s.config.tp, s.state.shards, blocks)
    warning = coverage_warning(*args) or whole_kinds(*args)
    if warning:
        rank_zero_warn(warning)


def _loss_parallel(s: Setup) -> None:
    if not s.config.loss_parallel:
        no_loss_parallel(s.module)


def no_loss_parallel(module: nn.Module, keep: tuple[str, ...] = ()) -> None:
    """Cross-entropy on whole (gathered) logits for every tensor-parallel LM head of ``module`` (but ``keep``)."""
    for name, m in module.named_modules():
        layer = getattr(m, "_tpp_layer", None)
        if layer is not None and name not in keep:
            layer.loss_parallel = False


def _sequence_parallel(s: Setup) -> None:
    """The model's block sequence run on sequence shards (``tensor_parallel.sequence``)."""
    assert s.map is not None and s.state is not None
    if not s.config.sequence_parallel or s.config.tp == 1:
        return
    try:
        sequence = s.map.blocks()
    except PipelinePartitionError as err:
        raise ValueError(f"sequence_parallel=True runs the blocks of the model's repeated block sequence (an "
                         f"nn.ModuleList or nn.Sequential of same-class layers) on sequence shards, and none was "
                         f"found in {type(s.module).__name__}: {err}. Name their container with blocks='<module "
                         f"name>', or use sequence_parallel=False") from err
    runs = sequence_runs(s.module, sequence.containers, sequence.members)
    stages = s.state.stages
    s.state.sequence = apply_sequence_parallel(
        s.module, runs, s.groups.tp, s.state.shards, local_names=set(s.state.blocks) if stages is not None else None,
        twins=stages.twins if stages is not None else None, verify=s.config.verify and s.live)


def _context_parallel(s: Setup) -> None:
    """The model's block sequence run on this rank's positions of each sequence (``context_parallel``)."""
    assert s.map is not None and s.state is not None
    if s.config.cp == 1:
        return
    assert s.groups.cp is not None
    stages = s.state.stages
    s.state.context = apply_context_parallel(
        s.module, s.context_runs, s.groups.cp, pipelined=stages is not None,
        local_names=set(s.state.blocks) if stages is not None else None,
        twins=stages.twins if stages is not None else None, verify=s.config.verify and s.live,
        sp=s.groups.tp if s.state.sequence else None, draws=s.groups.tp.stream, a2a=s.config.cp_mode == "a2a")
    if s.config.loss_parallel:  # loss_parallel=False: the head's logits whole on every cp rank
        s.state.context.heads = cut_heads(s.module, s.context_heads, s.groups.cp,
                                          twins=stages.twins if stages is not None else None)


def _context_runs(s: Setup) -> list[list[str]]:
    """The runs of blocks cp cuts, or the reason it cannot (read on the whole model, before the stages drop
    modules, so that every rank refuses alike)."""
    assert s.map is not None
    cp, name = s.config.cp, type(s.module).__name__
    try:
        sequence = s.map.blocks()
    except PipelinePartitionError as err:
        raise ValueError(f"cp={cp} runs the blocks of the model's repeated block sequence (an nn.ModuleList or "
                         f"nn.Sequential of same-class layers) on parts of each sequence, and none was found in "
                         f"{name}: {err}. Name their container with blocks='<module name>', or use cp=1") from err
    try:
        runs = sequence_runs(s.module, sequence.containers, sequence.members)
    except ValueError as err:
        raise ValueError(str(err).replace("sequence_parallel=True", f"cp={cp}").replace(
            "sequence_parallel=False", "cp=1")) from err
    mixing = mixing_layers(s.module, [n for run in runs for n in run])
    if mixing:
        raise ContextParallelError(
            f"cp={cp} runs each block on parts of the sequence, and these layers mix positions outside attention, "
            f"which would see only this rank's part: {'; '.join(mixing[:4])}{' ...' if len(mixing) > 4 else ''}. "
            f"Use cp=1 for this model")
    return runs


def _refuse_context(s: Setup) -> None:
    """Before the stages drop modules: the runs cp cuts, or what it cannot run refused on every rank."""
    if s.config.cp > 1:
        s.context_runs = _context_runs(s)
        s.context_heads = vocab_heads(s.module, [n for run in s.context_runs for n in run])


def _recompute(s: Setup) -> None:
    """Activation checkpointing on this rank's blocks, inside the pipeline's dispatchers, around the tensor-parallel
    blocks."""
    assert s.map is not None and s.state is not None
    if not s.config.activation_checkpointing:
        return
    if s.map.sequence is None:
        assert s.map.missing is not None
        if s.config.blocks is not None:  # the user's containers: the partitioner says what is wrong with them
            raise s.map.missing
        raise ValueError(f"activation_checkpointing=True recomputes each block of the model's repeated block sequence "
                         f"(an nn.ModuleList or nn.Sequential of same-class layers, e.g. transformer layers) in "
                         f"backward, and none was found in {type(s.module).__name__}. Name the container of the blocks "
                         f"with blocks='<module name>', or use activation_checkpointing=False") from s.map.missing
    s.state.recomputed = recompute_blocks(s.module, list(s.state.blocks))
    for element in s.state.sequence:
        element.recomputed = element.name in s.state.recomputed


def _compile(s: Setup) -> None:
    """``compile=``: the blocks of this rank to compile (``integration.compile_metrics.Compiled`` compiles them after
    the first training step, whose first-call checks and one-time branches run eagerly). A schedule that splits
    backward is refused: its weight-gradient split (``pipeline.wgrad``) is a function mode that a compiled graph's
    backward bypasses."""
    options = s.config.compile
    state = s.state
    if options is False or state is None:
        return
    engine = state.engine
    if engine is not None and engine.deciding:
        engine.settle(AutoChoice("1f1b", {}, [], reason="compile=True: a schedule that splits backward (zero-bubble, "
                                                          "zb-drain, zb-lead) cannot split a compiled block's "
                                                          "backward into input and weight gradients"))
    elif engine is not None and engine.splits_backward:
        raise ValueError(f"compile={options!r} with schedule={s.config.schedule!r}: this schedule splits each "
                         f"backward into input and weight gradients, which a compiled block's backward cannot do; "
                         f"use schedule='1f1b', 'interleaved-1f1b', 'gpipe' or 'auto', or compile=False")
    state.compiled = list(state.blocks)


def _engine(s: Setup) -> None:
    """Running statistics over the whole batch (below the dispatchers, which decide whether a layer runs), then the
    stages finished: dispatchers, tied-weight groups, the engine."""
    assert s.map is not None and s.state is not None
    state, config = s.state, s.config
    if state.stages is None:
        return
    deferred = DeferredStatistics.install(s.module, pp=config.pp, microbatches=config.microbatches,
                                          warn=list(s.map.statistics))
    state.engine = finish_stages(s.module, state.stages, dims=s.dims, coords=s.dims.coords(s.rank),
                                 virtual=config.virtual_stages, schedule=config.schedule,
                                 microbatches=config.microbatches, pp_group=s.groups.pp)
    state.engine.batch_statistics = deferred
    if config.tp > 1:
        _check_tied(s)


def _check_tied(s: Setup) -> None:
    state = s.state
    assert state is not None and state.stages is not None and state.engine is not None
    problem = tied_shape_problem(s.module, state.stages, state.engine, s.device)
    if problem is not None:
        raise TensorParallelConfigError(problem)


# ---------------------------------------------------------------------------------------------------------------
# live steps after the cut


def _materialize(s: Setup) -> None:
    """A model built on the meta device: this rank's shards allocated and initialised; a weight that several stages
    hold (tied embedding and head) then sent from the stage holding the module of its single-device name (what one
    process does) to the others."""
    state = s.state
    if s.meta is None or state is None:
        return
    s.deferred = _sharded_on_meta(s)
    materialize(s.module, device=s.meta.device, names=state.names, shards=state.shards, tp_rank=s.groups.tp.rank,
                tp_size=s.groups.tp.size, base_seed=s.meta.base_seed, loaded=s.meta.loaded, leave=s.deferred)
    if state.stages is not None:
        assert state.engine is not None
        send_tied(s.module, state.stages, state.engine, s.dims, s.dims.coords(s.rank))


def _experts_over_replicas(s: Setup) -> Optional[ExpertShards]:
    """The banks split over ep that FSDP2 shards over their replicas (the ranks holding the same experts), where
    there are several replicas and dp sharding is on."""
    ep = s.groups.ep
    if s.config.dp_sharding == "no_shard" or ep is None or ep.replicas is None or \
            dist.get_world_size(ep.replicas) == 1:
        return None
    banks = split_banks(s.module)
    return ExpertShards(tuple(banks), ep.mesh["edp"], float(ep.dp)) if banks else None


def _sharded_on_meta(s: Setup) -> list[str]:
    """Banks built on the meta device that FSDP2 shards over their replicas: left unallocated until it has, so
    that no rank ever holds more of its experts than its part (not the ``experts / ep`` it computes with, for every
    layer at once)."""
    experts = _experts_over_replicas(s)
    if s.meta is None or experts is None:
        return []

    def on_meta(name: str) -> bool:
        bank = s.module.get_submodule(name)
        return all(t.is_meta for t in chain(bank.parameters(recurse=False), bank.buffers(recurse=False)))

    return [name for name in experts.banks if on_meta(name)]


def _report(s: Setup) -> None:
    """The plan table of the whole model (under a pipeline each rank knows only its stages' modules, so every pp
    rank's rows are gathered: an object collective over the pp group on every rank, as ``print_plan`` may differ
    between ranks, e.g. ``print_plan=rank == 0``), the partition, the recomputed blocks."""
    state, config = s.state, s.config
    assert state is not None
    if config.tp > 1:
        part = plan_rows(s.module, state.plan, state.shards)
        if state.stages is None or s.groups.pp is None:
            table = format_plan([part], config.tp)
        else:
            parts: list[Any] = [None] * dist.get_world_size(s.groups.pp)
            dist.all_gather_object(parts, part, group=s.groups.pp)
            table = format_plan(parts, config.tp, model_params=state.stages.total_params)
        if config.print_plan:
            rank_zero_info(table)
    if config.print_plan and state.stages is not None:
        rank_zero_info(format_partition(state.stages.partition, s.dims.pp))
    if config.print_plan and state.context is not None:
        rank_zero_info(state.context.describe(len(state.blocks) if state.blocks else None))
    if config.print_plan and state.recomputed:
        rank_zero_info(f"Activation checkpointing: {len(state.recomputed)} blocks of this rank recomputed in backward "
                       f"({state.recomputed[0]}..{state.recomputed[-1]})")


def _weights(s: Setup) -> None:
    if s.config.weights is not None:
        _load(s, banks_left=False)


def _expert_shards(s: Setup) -> None:
    """The banks left on the meta device (``_sharded_on_meta``), now FSDP2's shards (allocated, uninitialised):
    each rank fills its part of its experts. A bank is initialised at full size one at a time, as ``materialize``
    does (the same values in every layout), and this rank's part kept; then ``weights=`` reads what it fills."""
    state, meta = s.state, s.meta
    if not s.deferred or state is None or meta is None:
        return
    for name in s.deferred:
        bank = s.module.get_submodule(name)
        own = dict(chain(bank.named_parameters(recurse=False), bank.named_buffers(recurse=False)))
        if all(f"{name}.{n}" in meta.loaded for n in own):
            continue
        whole = initialise_whole(s.module, name, {n: (state.shards.full_shape(t), t.dtype) for n, t in own.items()},
                                 base_seed=meta.base_seed, device=meta.device)
        for n, t in own.items():
            fill_from_whole(f"{name}.{n}", t, whole.pop(n), state.shards.spec(t), s.groups.tp.rank, s.groups.tp.size)
    if s.config.weights is not None:
        _load(s, banks_left=True)


def _load(s: Setup, *, banks_left: bool) -> None:
    """``weights=`` into this rank's entries: those of the banks left on meta (``banks_left``), or all the others."""
    state, config = s.state, s.config
    assert state is not None and config.weights is not None
    deferred = set(s.deferred)
    loaded = load_weights(s.module, config.weights, names=state.names, shards=state.shards, tp_rank=s.groups.tp.rank,
                          tp_size=s.groups.tp.size, prefix=config.weights_prefix,
                          strict=getattr(s.module, "strict_loading", True),
                          select=lambda name: (name.rpartition(".")[0] in deferred) == banks_left)
    state.loaded.append(loaded)
    rank_zero_info(loaded.describe())


def _split(s: Setup) -> None:
    s.split = expert_parameters(s.module)  # left out of the dp units (each bank a unit over its replicas)


def _dp(s: Setup) -> None:
    """FSDP2 over the dp mesh axis, last (after tensor parallelism, the stages, materialising and loading weights;
    after the precision plugin, which fixes the dtype FSDP2 gathers in): each of this rank's blocks one unit, the
    other parameters grouped by the module holding them; each bank split over ep a unit of its own over the ranks
    that hold the same experts (``data_parallel.fsdp.ExpertShards``), where there are several (with dp x cp = 1,
    tp ranks: then the banks alone). Everything that held the replaced parameter objects follows them."""
    state, config = s.state, s.config
    assert state is not None
    if config.dp_sharding == "no_shard":
        return
    experts = _experts_over_replicas(s)
    dense = s.dims.dp * s.dims.cp > 1  # else only experts whose replicas are tp ranks are sharded (over them)
    if not dense and experts is None:
        return
    assert s.groups.mesh is not None
    replicas = replica_mesh(s.groups.mesh, s.dims)  # dp, or dp x cp (the cp ranks hold the same weights)
    if config.blocks is not None and not state.blocks:
        assert s.map is not None
        s.map.blocks()  # the user's containers: the partitioner says what is wrong with them
    s.convert(s.module)
    state.dp = dp = shard_over_dp(s.module, replicas, blocks=list(state.blocks),
                                  sharding=config.dp_sharding, keep=s.split, experts=experts, dense=dense,
                                  # the cp ranks of a replica hold the same tokens at the head: exchanged over dp x cp
                                  # they would be computed cp times; FSDP2 gathers the head instead
                                  vocab_exchange=config.vocab_exchange and s.dims.cp == 1 and dense,
                                  tp_blocks=[b.name for b in state.tp_blocks], quiet=checks_off,
                                  allocate=s.meta.device if s.deferred and s.meta is not None else None)
    if dense:  # FSDP2 gathers a unit for backward when its output's gradient arrives: a loss computed from the
        # head's shards would bypass that output (a head computed over dp has no such hook)
        no_loss_parallel(s.module, keep=tuple(r.name for r in dp.rows))
    state.shards.rekey(dp.replaced)
    state.shards.resolve = dp.sharded_of
    engine = state.engine
    if engine is not None:
        engine.rekey(dp.replaced)
        end_stage_forward_last(s.module)  # FSDP2's post-forward hooks run before a stage's forward is cut short
        if engine.deciding:
            choice = settle_auto(engine.pp, engine.microbatches, engine.virtual,
                                 dp_sharded=f"dp={replicas.size()} ({config.dp_sharding}, FSDP2)")
            assert choice is not None  # always one with dp_sharded
            engine.settle(choice)
        if engine.splits_backward:
            module = s.module
            engine.reduction = lambda: dp.reduce_at_end(module)
    if config.print_plan:
        rank_zero_info(dp.describe(*sharded_numel(s.module)))


def _reduction(s: Setup) -> None:
    assert s.state is not None
    # the parameters as FSDP2 left them (experts sharded over their replicas are new objects)
    s.state.reduction = GradientReduction.of(s.module, s.state, expert_parameters(s.module))


STEPS: tuple[Step, ...] = (
    Step("agree", _agree, live=True),
    Step("refuse", _refuse, live=True),
    Step("sync_batchnorm", _sync_batchnorm, live=True),
    Step("seed", _seed, live=True),
    Step("map", _map),
    Step("stages", _stages),
    Step("blocks", _blocks),
    Step("tp_plan", _tp_plan),
    Step("tp_apply", _tp_apply),
    Step("experts", _experts),
    Step("coverage", _coverage),
    Step("loss_parallel", _loss_parallel),
    Step("sequence_parallel", _sequence_parallel),
    Step("context_parallel", _context_parallel),
    Step("recompute", _recompute),
    Step("engine", _engine, live=True),
    Step("compile", _compile, live=True),
    Step("materialize", _materialize, live=True),
    Step("report", _report, live=True),
    Step("weights", _weights, live=True),
    Step("split", _split, live=True),
    Step("dp", _dp, live=True),
    Step("expert_shards", _expert_shards, live=True),
    Step("reduction", _reduction, live=True),
)
