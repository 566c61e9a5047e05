"""``TensorPipeStrategy``: the Lightning glue. Parallelism lives in the subpackages; this class orders the steps.

Setup order (runs for every fit/validate/test/predict; a module that already holds a ``ParallelState`` adopts it)::

    init process group -> mesh (dp, pp, tp) and groups          (integration.topology)
      -> model to device -> ranks agree, rank 0's weights broadcast  (reliability.preflight)
      -> sync_batchnorm: BatchNorm to SyncBatchNorm over the dp group  (integration.sync_batchnorm)
      -> parallel_state.build_state: names -> pipeline stages -> tensor-parallel plan -> apply -> engine
      -> precision -> optimizers

Per optimizer step: the Trainer's closure runs ``training_step`` (under a pipeline: the whole schedule,
``integration.pipeline_steps``) + backward; then gradients are averaged over dp, then Lightning clips through the
precision plugin (global norm over every shard, ``integration.precision``) and steps.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Generator, Literal, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_tpp._compat import StrategyRegistryType, layer_sync_requested, optimizers_to_device
from lightning_tpp.checkpoint.async_save import AsyncSaver, check_async_save
from lightning_tpp.checkpoint.state import check_state_layout
from lightning_tpp.checkpoint.weights import covered_names, load_weights
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.dp_shard import DPSharding, normalize_sharding
from lightning_tpp.core.grads import average_gradients, broadcast_module
from lightning_tpp.tensor_parallel.apply import sum_block_partials
from lightning_tpp.tensor_parallel.sequence import sum_partial_gradients
from lightning_tpp.core.materialize import has_meta, move_real
from lightning_tpp.core.mesh import MeshDims, resolve_dims
from lightning_tpp.core.params import ParamNames, ShardIndex
from lightning_tpp.core.token_mean import GlobalTokenMean, LossNormalization, check_normalization
from lightning_tpp.integration.checkpointing import CheckpointMixin, torch_optimizer
from lightning_tpp.integration.collectives import ReplicaCollectives
from lightning_tpp.integration.launchers import make_launcher
from lightning_tpp.integration.pipeline_steps import PipelineSteps
from lightning_tpp.integration.precision import GlobalNormClippingStrategy
from lightning_tpp.integration.summary import count_whole_model
from lightning_tpp.integration.sync_batchnorm import sync_batchnorm_over_dp
from lightning_tpp.integration.topology import MeshTopology
from lightning_tpp.layout.strategy import AutoLayout, auto_request
from lightning_tpp.parallel_state import (Materialization, ParallelConfig, ParallelState, ProcessGroups, build_state,
                                         shard_state_over_dp)
from lightning_tpp.pipeline.engine import PipelineEngine
from lightning_tpp.pipeline.metrics import PipelineMetrics
from lightning_tpp.experts.expert_parallel import ExpertGroup, check_ep, expert_parameters, reduce_expert_grads
from lightning_tpp.integration.expert_load import ExpertLoad
from lightning_tpp.pipeline.auto import AUTO as AUTO_SCHEDULE
from lightning_tpp.pipeline.auto import settle_auto
from lightning_tpp.pipeline.schedule import ScheduleLike
from lightning_tpp.pipeline.schedule import normalize as normalize_schedule
from lightning_tpp.pipeline.schedule import resolve as resolve_schedule
from lightning_tpp.pipeline.schedule import validate as validate_schedule
from lightning_tpp.reliability.nonfinite import finite_everywhere
from lightning_tpp.reliability.preflight import check_agreement, model_structure
from lightning_tpp.reliability.watch import FailureWatch, SignalReport, rank_report
from lightning_tpp.tensor_parallel.plan import TPPlan


class TensorPipeStrategy(AutoLayout, CheckpointMixin, PipelineSteps, GlobalNormClippingStrategy, ReplicaCollectives,
                         MeshTopology, ParallelStrategy):
    """Tensor (``tp``), pipeline (``pp``) and data (``dp``) parallelism for an unmodified LightningModule.

    Args:
        tp: tensor-parallel size (ranks that split each layer; keep it within a node), or ``"auto"`` (searched
            with dp, micro-batches and schedule; pp, activation checkpointing and dp sharding as given).
        pp: pipeline-parallel size (stages), or ``"auto"`` (as ``tp="auto"``).
        layout: ``"auto"``: choose tp, pp, dp, micro-batches, schedule, activation checkpointing and dp sharding at
            setup from a cost model of one step and the memory planner (``docs/layout.md``): one block of each kind
            timed on this device on the shape of one per-process batch of token ids (rank 0 reads the first batch of
            the run's data: the loader given to ``fit``, or the ``train_dataloader()`` of the module or datamodule;
            the module's ``example_input_array``, where set, overrides it), the links measured; the top candidates
            and why the winner won are logged on rank 0, the choice is ``trainer.strategy.parallel_state.layout``.
        device_memory: with a searched layout, the memory budget per device in bytes (or ``"80GB"``); default what
            the device has (on CPU, this process's share of the machine's memory). Layouts the planner finds above
            it (less a 10% margin) are dropped.
        global_batch: with a searched layout, samples per optimizer step kept fixed: gradient accumulation is set
            to ``global_batch / (dp x per-process batch)`` and layouts are ranked at that batch.
        dp: data-parallel size, or ``"auto"`` for ``world_size // (tp * pp)``.
        ep: expert parallelism for mixture-of-experts models: each rank holds ``experts / ep`` whole experts of
            every bank and the tokens travel to them by all-to-all (dropless). The ep group is drawn from the
            data-parallel and tensor-parallel ranks of a stage (``ep`` must divide ``dp * tp``); expert gradients
            are averaged over the ranks holding the same experts. Searched with ``layout="auto"`` where the model
            has experts (``docs/layout.md``). See ``docs/experts.md``.
        microbatches: micro-batches per step for the pipeline (default ``2 * pp``).
        schedule: pipeline schedule, one of ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zero-bubble"``,
            ``"zb-drain"``, ``"zb-lead"`` (see ``docs/pipeline.md``: zero-bubble splits every backward, zb-drain a
            few, zb-lead as zb-drain with upstream ranks one forward ahead), a name added with
            ``register_schedule``, a ``Schedule``, one list per rank of ``(kind, microbatch, chunk)`` actions, or
            ``torch.distributed.pipelining``'s ``ScheduleGPipe``/``Schedule1F1B``/``ScheduleInterleaved1F1B``.
            ``"auto"`` (the default) runs zb-drain for three steps, timing each stage's forward, backward and split
            backward and how much they vary, then simulates 1F1B, zb-drain, zero-bubble and zb-lead with those
            costs, varying as measured, and keeps the fastest (a tie: the simpler), logging its choice on rank 0
            (the choice is not saved in checkpoints: a resumed run measures again). Where the layout decides, it
            measures nothing: ``"interleaved-1f1b"`` for ``virtual_stages`` > 1, ``"gpipe"`` for fewer micro-batches
            than ``pp``, ``"1f1b"`` when FSDP2 shards the parameters over dp (a split backward would keep the
            stage's parameters and gradients gathered until the step ends).
        virtual_stages: model chunks per pipeline rank (``"interleaved-1f1b"`` needs 2 or more).
        balance: ``"params"`` (balance stages by parameter count, a routed layer's experts counted as a token runs
            through them: top-k of E), ``"time"`` (by measured block time on the
            module's ``example_input_array``), or blocks per stage, e.g. ``[3, 5]``.
        split_points: names of the blocks that start stages 1.., e.g. ``["model.layers.12"]`` (overrides balance).
        blocks: name of the module holding the blocks to pipeline, or names of several run one after the other
            (an encoder's layers, then a decoder's); found automatically when omitted.
        tp_plan: ``"auto"``, or a mapping of module-name globs to styles (``"colwise"``, ``"rowwise"``,
            ``"colwise_gather"``, ``"vocab"``, ``"mha"``, ``"replicate"``) laid over the automatic plan.
        verify: check each parallelised block against the original on its first call.
        activation_checkpointing: recompute each block's activations in backward instead of keeping them
            (``torch.utils.checkpoint``, non-reentrant; the blocks are the repeated block sequence the pipeline
            partitioner finds, or ``blocks``, also without a pipeline). Same results, less activation memory, about
            one more forward of the blocks per step. See ``docs/pipeline.md``.
        loss_parallel: ``F.cross_entropy`` of a vocabulary-parallel LM head's logits is computed from each rank's
            shard of the vocabulary (the logits are still gathered for any other use), so neither the
            cross-entropy's saved log-softmax nor the logits' gradient is ever whole. Not for a head that FSDP2
            gathers (``vocab_exchange=False`` under dp sharding). See ``docs/tensor_parallel.md``.
        sequence_parallel: with tp > 1, Megatron's sequence parallelism: the blocks of the model's block sequence
            run norms, dropout and residual adds on this rank's part of the sequence (dim 1), gathering it before
            each attention/MLP and reduce-scattering after it (the bytes of the all-reduces they replace), so those
            activations take ``1/tp`` of the memory. Needs a sequence length divisible by ``tp``. Each block is
            checked against the original on its first call. See ``docs/tensor_parallel.md``.
        save_distributed_checkpoint: write checkpoints as a folder of shards (torch.distributed.checkpoint, each
            rank writing its own; ``lightning-tpp consolidate`` makes one file of it) instead of one whole-model
            file written by rank 0. Both load into any layout.
        async_save: write sharded checkpoints saved during ``fit`` in the background
            (``torch.distributed.checkpoint.async_save``): the step waits only for this rank's shards to be copied
            to host memory; the folder is published when every rank's shards are written, so a crash meanwhile
            leaves the previous checkpoint. The next save and the teardown wait for it and raise its failure on
            every rank (``AsyncCheckpointError``). See ``docs/checkpoints_and_failures.md``.
        dp_sharding: with dp > 1, how parameters, gradients and optimizer state are spread over the data-parallel
            ranks (torch's FSDP2, ``fully_shard`` on the dp mesh axis, a unit per block): ``"full_shard"`` (each
            rank holds 1/dp of them; parameters gathered per block for forward and again for backward),
            ``"shard_grad_op"`` (the same, parameters kept gathered from forward to backward: one all-gather less
            per block and step, more memory) or ``"no_shard"`` (replicated, gradients all-reduced). Lightning's
            spellings (``"FULL_SHARD"``, ...) are accepted. See ``docs/large_models.md``.
        vocab_exchange: with dp sharding, the vocabulary matrices (an embedding or LM head larger than a block)
            stay cut by rows over dp and each rank computes with its rows on every dp rank's tokens (tokens are
            exchanged, the matrix is never gathered: FSDP2's gather of it set the peak). ``False``: FSDP2 gathers
            them like every other unit. See ``docs/large_models.md``.
        loss_normalization: how a loss that is a mean over tokens (``F.cross_entropy``/``F.nll_loss`` with
            ``reduction="mean"``, Hugging Face's own losses: targets of ``ignore_index`` not counted) is averaged when
            a batch runs as micro-batches: ``"batch"`` (default) over every counted token of the replica's batch, as
            one process computes it; ``"global"`` over every token of every dp replica (as torchtitan; also without
            a pipeline); ``"microbatch"`` each micro-batch's mean weighted by its share of the samples. A reduction
            written by hand is named in a warning where micro-batches count different tokens. See
            ``docs/pipeline.md``.
        print_plan: print the plan table on global rank 0 at setup.
        process_group_backend: ``"gloo"``/``"nccl"``; default by device.
        timeout: how long a collective may wait, and how long a silent peer is tolerated before every rank stops
            with a message naming it (the latter capped at 60 s).
        on_nonfinite: a NaN/inf loss on any rank: ``"raise"`` on every rank, ``"skip"`` the step everywhere, or
            ``"warn"`` and go on. All ranks take the same decision.
        pipeline_metrics: with pp > 1, log ``pipeline/`` metrics (measured and theoretical bubble, stage imbalance,
            per-stage compute/send/receive/wait seconds, samples per second) through Lightning's loggers every
            ``log_every_n_steps``; timing costs two clock reads per action, the values one all-gather per logging
            step. See ``docs/pipeline_observability.md``.
        weights: a file or folder of weights loaded into the model at the end of setup, each rank reading only
            its own slices: a Hugging Face ``model.safetensors``, a folder with it or with
            ``model.safetensors.index.json`` (sharded), a consolidated Lightning ``.ckpt``, or a sharded
            checkpoint folder (model weights only). Missing, unexpected and mis-shaped keys raise one
            ``WeightsMismatchError`` on every rank (the module's ``strict_loading = False`` skips missing and
            unexpected ones). ``trainer.fit(ckpt_path=...)`` still restores over them.
        weights_prefix: the module path put before the file's keys to name the model's parameters
            (``"model."`` for a Hugging Face model held as ``self.model``); ``"auto"`` finds it.
        start_method: ``"auto"`` (``"fork"`` in notebooks, else ``"popen"``: the script is run again per rank),
            ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
    """

    strategy_name = "tensor_pipe"

    def __init__(
        self,
        tp: Union[int, Literal["auto"]] = 1,
        pp: Union[int, Literal["auto"]] = 1,
        dp: Union[int, Literal["auto"]] = "auto",
        *,
        ep: int = 1,
        layout: Optional[Literal["auto"]] = None,
        device_memory: Optional[Union[float, str]] = None,
        global_batch: Optional[int] = None,
        microbatches: Optional[int] = None,
        schedule: ScheduleLike = "auto",
        virtual_stages: int = 1,
        balance: Union[Literal["params", "time"], list[int]] = "params",
        split_points: Optional[list[str]] = None,
        blocks: Optional[Union[str, Sequence[str]]] = None,
        tp_plan: Union[Literal["auto"], dict[str, str]] = "auto",
        verify: bool = True,
        activation_checkpointing: bool = False,
        loss_parallel: bool = True,
        sequence_parallel: bool = False,
        dp_sharding: DPSharding = "full_shard",
        vocab_exchange: bool = True,
        loss_normalization: LossNormalization = "batch",
        print_plan: bool = True,
        save_distributed_checkpoint: bool = True,
        async_save: bool = False,
        on_nonfinite: Literal["raise", "skip", "warn"] = "raise",
        pipeline_metrics: bool = True,
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["auto", "popen", "spawn", "fork", "forkserver"] = "auto",
        weights: Optional[Union[str, "os.PathLike[str]"]] = None,
        weights_prefix: str = "auto",
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        self._auto_layout = auto_request(tp=tp, pp=pp, dp=dp, layout=layout, device_memory=device_memory,
                                         global_batch=global_batch, activation_checkpointing=activation_checkpointing,
                                         dp_sharding=normalize_sharding(dp_sharding), ep=ep)
        if self._auto_layout is not None:  # decided at setup (AutoLayout._before_mesh); placeholders until then
            tp, pp, dp = (1 if tp == "auto" or layout else tp), (1 if pp == "auto" or layout else pp), "auto"
        resolve_dims(tp * pp * (dp if isinstance(dp, int) else 1), tp, pp, dp)  # argument types and ranges
        auto = isinstance(schedule, str) and schedule == AUTO_SCHEDULE
        schedule = AUTO_SCHEDULE if auto else normalize_schedule(schedule)  # a registered name, else a Schedule
        if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
            raise ValueError(f"microbatches={microbatches!r} must be a positive integer")
        if tp_plan != "auto" and not isinstance(tp_plan, Mapping):
            raise TypeError(f"tp_plan must be 'auto' or a mapping of module globs to styles, got {tp_plan!r}")
        check_ep(ep, dp=ep, tp=1)  # its type and range; that it divides dp*tp is checked once the world is known
        self._tp, self._pp, self._dp_arg, self._ep = tp, pp, dp, ep
        fixed = None if auto else resolve_schedule(schedule).fixed  # action lists: for one micro-batch count
        self.microbatches = microbatches if microbatches is not None else fixed[1] if fixed else 2 * pp
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        if pp > 1:
            if auto:
                settle_auto(pp, self.microbatches, virtual_stages)  # raises for a layout no schedule fits
            else:
                validate_schedule(schedule, pp, self.microbatches, virtual_stages)
        if isinstance(balance, str) and balance not in ("params", "time"):
            raise ValueError(f"balance={balance!r} must be 'params', 'time' or a list of blocks per stage")
        self._balance, self._split_points, self._blocks = balance, split_points, blocks
        self._state: Optional[ParallelState] = None
        self.worker_plan: Optional[TPPlan] = None  # rank 0's plan, handed back by a spawn/fork launch
        self._tp_plan_arg = tp_plan
        self._verify = verify
        if not isinstance(activation_checkpointing, bool):
            raise TypeError(f"activation_checkpointing={activation_checkpointing!r} must be True or False")
        self._activation_checkpointing = activation_checkpointing
        if not isinstance(loss_parallel, bool):
            raise TypeError(f"loss_parallel={loss_parallel!r} must be True or False")
        self._loss_parallel = loss_parallel
        if not isinstance(sequence_parallel, bool):
            raise TypeError(f"sequence_parallel={sequence_parallel!r} must be True or False")
        if sequence_parallel and tp < 2:
            raise ValueError(f"sequence_parallel=True cuts the sequence over the tensor-parallel ranks and needs "
                             f"tp >= 2, got tp={tp}")
        self._sequence_parallel = sequence_parallel
        self._dp_sharding = normalize_sharding(dp_sharding)
        if not isinstance(vocab_exchange, bool):
            raise TypeError(f"vocab_exchange={vocab_exchange!r} must be True or False")
        self._vocab_exchange = vocab_exchange
        self._loss_normalization = check_normalization(loss_normalization)
        self._save_sharded = save_distributed_checkpoint
        self._async_saver = AsyncSaver(timeout) if check_async_save(async_save, sharded=save_distributed_checkpoint) \
            else None
        if on_nonfinite not in ("raise", "skip", "warn"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} must be 'raise', 'skip' or 'warn'")
        self._on_nonfinite = on_nonfinite
        if not isinstance(pipeline_metrics, bool):
            raise TypeError(f"pipeline_metrics={pipeline_metrics!r} must be True or False")
        self._pipeline_metrics = pipeline_metrics
        self._metrics: Optional[PipelineMetrics] = None
        self._expert_load: Optional[ExpertLoad] = None  # tokens per expert, logged under moe/
        self._signal_report: Optional[SignalReport] = None
        self._watch: Optional[FailureWatch] = None
        self._skip_backward = False
        self._skip_manual_steps = False  # a non-finite loss met manual_backward in this training_step
        self.nonfinite_replicas: list[int] = []  # dp replicas of the last non-finite loss (SpikeGuard records them)
        self._restored_sharded = False
        self._checked_optimizers: set[int] = set()
        self._print_plan = print_plan
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._weights = None if weights is None else os.fspath(weights)
        self._weights_prefix = weights_prefix
        self._num_nodes = 1
        self._dims: Optional[MeshDims] = None
        self._mesh: Optional[DeviceMesh] = None
        self._tp_group = TPGroup(None, 0, 1)
        self._dp_group: Optional[ProcessGroup] = None
        self._pp_group: Optional[ProcessGroup] = None
        self._ep_group: Optional[ExpertGroup] = None

    @property
    def parallel_state(self) -> ParallelState:
        """What this strategy decided for the model: groups, names, plan, shards, stages (after setup)."""
        if self._state is None:
            raise RuntimeError("the parallel state exists once the Trainer has set the model up (Strategy.setup)")
        return self._state

    @property
    def plan(self) -> TPPlan:
        """The tensor-parallel plan as data (module name -> style, blocks)."""
        if self._state is not None:
            return self._state.plan
        return self.worker_plan if self.worker_plan is not None else TPPlan()

    @property
    def _engine(self) -> Optional[PipelineEngine]:
        return self._state.engine if self._state is not None else None

    @property
    def _param_names(self) -> ParamNames:
        return self.parallel_state.names

    @override
    def _configure_launcher(self) -> None:  # Lightning's hook for a strategy's launcher (DDPStrategy overrides it too)
        self._launcher = make_launcher(self, self._start_method)

    # ------------------------------------------------------------------------------------------------------------
    # model

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        module = self.lightning_module
        assert module is not None
        state = ParallelState.of(module)
        if state is None:
            state = self._parallelize(module)
            state.attach(module)
        else:  # a second run, or a second Trainer: the model is already cut; keep the groups its layers use
            state.check_same(self._config(), self.dims)
            self._mesh, self._tp_group = state.groups.mesh, state.groups.tp
            self._pp_group, self._dp_group, self._ep_group = state.groups.pp, state.groups.dp, state.groups.ep
        self._state = state
        if state.engine is not None:
            executor = state.engine.executor
            executor.normalization, executor.dp_group, executor.dp_size = (self._loss_normalization, self._dp_group,
                                                                           self.dims.dp)
        self._observe()
        self.model = self.precision_plugin.convert_module(self.model)
        self._use_dp_groups_for_metrics(module)
        self._patch_trainer(trainer)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: nn.Module) -> ParallelState:
        on_meta = has_meta(module)
        check_agreement({**self._fingerprint(module), "built on the meta device": on_meta})
        broadcast_module(module, src=0)  # what exists already (an eager model); meta tensors are initialised per rank
        if self._pp > 1:
            if not module.automatic_optimization:
                raise ValueError("pipeline parallelism (pp>1) runs forward and backward inside the schedule and "
                                 "needs automatic optimization; set automatic_optimization = True or use pp=1")
            if getattr(self.precision_plugin, "scaler", None) is not None:
                raise ValueError("pipeline parallelism (pp>1) does not support a loss-scaling GradScaler "
                                 "(precision='16-mixed'): every stage would have to agree on each step's scale and "
                                 "skip decision. Use precision='bf16-mixed' (no scaler needed) or '32-true'")
        sync_batchnorm_over_dp(module, convert=self._sync_batchnorm, dp=self.dims.dp, group=self._dp_group,
                               device=self.root_device)  # before the cut: Trainer(sync_batchnorm=True), over dp only
        config = ParallelConfig(self._tp, self._pp, self.microbatches, self.schedule, self.virtual_stages,
                                self._balance, self._split_points, self._blocks, self._tp_plan_arg, self._verify,
                                activation_checkpointing=self._activation_checkpointing,
                                loss_parallel=self._loss_parallel, sequence_parallel=self._sequence_parallel,
                                ep=self._ep)
        groups = ProcessGroups(self._mesh, self._tp_group, self._pp_group, self._dp_group, self._ep_group)
        self._tp_group.stream.seed = seed = self._agreed_seed()  # the strategy's own draws derive from it
        meta = None
        if on_meta:  # what a weights file fills is only allocated (strict or not, the rest is initialised)
            loaded = covered_names(self._weights, names=ParamNames.of(module), prefix=self._weights_prefix,
                                   module=module) \
                if self._weights is not None else frozenset()
            meta = Materialization(self.root_device, seed, loaded)
        state = build_state(module, config, self.dims, groups, rank=self.global_rank, device=self.root_device,
                            print_plan=self._print_plan, meta=meta)
        state.config = self._config()
        state.layout = self.layout_choice  # layout="auto": what was chosen (None when the degrees were given)
        if self._weights is not None:
            loaded = load_weights(module, self._weights, names=state.names, shards=state.shards,
                                  tp_rank=self._tp_group.rank, tp_size=self._tp_group.size,
                                  prefix=self._weights_prefix, strict=module.strict_loading)
            rank_zero_info(loaded.describe())
        if self.dims.dp > 1 and self._dp_sharding != "no_shard":
            self.precision_plugin.convert_module(module)  # before FSDP2 fixes the dtype it gathers in (bf16-true)
            shard_state_over_dp(module, state, self._blocks, sharding=self._dp_sharding,
                                keep=expert_parameters(module), vocab_exchange=self._vocab_exchange, print_plan=self._print_plan)
        return state

    def _observe(self) -> None:
        """Pipeline metrics, and the hang report (on SIGUSR1, and when the failure watch stops this rank)."""
        coords = self.dims.coords(self.global_rank)
        self._metrics = PipelineMetrics(self._engine, coords=coords, tp=self.dims.tp) \
            if self._pipeline_metrics and self._engine is not None else None
        layers = self.parallel_state.experts
        if self._expert_load is not None:
            self._expert_load.remove()
        self._expert_load = ExpertLoad(self.lightning_module, layers, counts=coords["tp"] == 0,
                                       traffic=self._ep_group.traffic if self._ep_group is not None else None,
                                       ) if layers else None
        if self._watch is not None:
            engine = self._engine
            label = f"rank {self.global_rank} {coords}"
            self._watch.describe = lambda: rank_report(label, engine.describe_activity if engine else None)
            if self._signal_report is None:
                self._signal_report = SignalReport(self._watch.describe)
                self._signal_report.install()

    def _agreed_seed(self) -> int:
        """The seed a meta-built model is initialised from, and the strategy's own random stream: rank 0's
        (``seed_everything``'s on every rank)."""
        seed = torch.tensor([torch.initial_seed() % (2 ** 63)], dtype=torch.int64, device=self.root_device)
        if dist.is_available() and dist.is_initialized():
            dist.broadcast(seed, src=0)
        return int(seed.item())

    def _config(self) -> dict[str, str]:
        """The arguments that decide how the model is cut and run, as compared across ranks and runs."""
        return {k: repr(getattr(self, k)) for k in ("_tp", "_pp", "_dp_arg", "_ep", "microbatches", "schedule",
                                                     "virtual_stages", "_tp_plan_arg", "_balance", "_split_points",
                                                     "_blocks", "_save_sharded", "_on_nonfinite", "_weights",
                                                     "_weights_prefix", "_activation_checkpointing",
                                                     "_dp_sharding", "_vocab_exchange", "_sequence_parallel",
                                                     "_sync_batchnorm")}

    @property
    def _sync_batchnorm(self) -> bool:
        """``Trainer(sync_batchnorm=True)``."""
        return layer_sync_requested(self)

    def _fingerprint(self, module: nn.Module) -> dict[str, Any]:
        return {"configuration": self._config(), "model": model_structure(module),
                "loss normalization": self._loss_normalization,
                "seed": os.environ.get("PL_GLOBAL_SEED"), "pipeline metrics": self._pipeline_metrics}

    def _use_dp_groups_for_metrics(self, module: nn.Module) -> None:
        """torchmetrics sync over the world by default; tp (and pp) replicas are not extra samples."""
        try:
            from torchmetrics import Metric
        except ImportError:  # pragma: no cover - torchmetrics is a dependency
            return
        for m in module.modules():
            if isinstance(m, Metric) and m.process_group is None:
                m.process_group = self._dp_group

    def _patch_trainer(self, trainer: "pl.Trainer") -> None:
        """Whole-model parameter counts in the user's ModelSummary callbacks (global-norm gradient clipping comes
        with the precision plugin: see ``precision_plugin``)."""
        count_whole_model(trainer.callbacks)  # type: ignore[attr-defined]

    @property
    def whole_model_totals(self) -> Optional[tuple[int, int]]:
        """(all, trainable) parameters of the whole model under a pipeline (this rank holds one stage), else None:
        the summary then counts the whole tensors of this rank's shards."""
        stages = self._state.stages if self._state is not None else None
        return (stages.total_params, stages.trainable_params) if stages is not None else None

    @property
    def parameter_shards(self) -> ShardIndex:
        """Which parameters tensor parallelism cut, and how (empty before setup and at tp=1)."""
        return self._state.shards if self._state is not None else ShardIndex()

    @property
    def parameter_names(self) -> dict[str, str]:
        """Every alias of every parameter of the whole model -> its one-process name (empty before setup): the summary
        counts a weight tied across pipeline stages once."""
        return dict(self._state.names.canonical) if self._state is not None else {}

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        move_real(self.model, self.root_device)  # meta tensors (a model built to be cut) are materialised in setup

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        """``trainer.init_module(empty_init=True)`` builds on the meta device: setup allocates only this rank's
        shards and initialises them (see ``core/materialize.py``)."""
        with torch.device("meta") if empty_init else nullcontext(), self.precision_plugin.tensor_init_context():
            yield

    @contextmanager
    @override
    def model_sharded_context(self) -> Generator[None, None, None]:
        """``configure_model`` builds on the meta device (what it creates on a real device explicitly stays)."""
        with torch.device("meta"):
            yield

    # ------------------------------------------------------------------------------------------------------------
    # steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        self._skip_manual_steps = False
        if self.lightning_module is not None:  # the strategy's own random stream moves on per training batch
            self._tp_group.stream.start_step(self.lightning_module.trainer.fit_loop.total_batch_idx)
        if self._engine is not None:
            out = self._pipeline_training_step(*args, **kwargs)
        elif self._loss_normalization == "global" and self.dims.dp > 1:  # a token mean over every replica's tokens
            with GlobalTokenMean(self._dp_group, self.dims.dp, self.root_device):
                out = super().training_step(*args, **kwargs)
        else:
            out = super().training_step(*args, **kwargs)
        if self._metrics is not None and self.lightning_module is not None:
            self._metrics.after_step(self.lightning_module, args[0], args[1] if len(args) > 1 else None)
        if self._expert_load is not None and self.lightning_module is not None:
            self._expert_load.after_step(self.lightning_module, args[1] if len(args) > 1 else None)
        if self.lightning_module is not None and not self.lightning_module.automatic_optimization:
            return out  # the loss was checked where it met manual_backward (see backward)
        loss = out.get("loss") if isinstance(out, dict) else out
        if isinstance(loss, Tensor) and not self._finite_everywhere(loss):
            if self._engine is not None:
                self._engine.discard_grads()
            self._skip_backward = True  # skip: no gradient from this batch on any rank (Lightning refuses None)
            return torch.zeros((), device=self.root_device)
        return out

    def _finite_everywhere(self, loss: Tensor) -> bool:
        step = self.lightning_module.trainer.global_step if self.lightning_module is not None else -1
        return finite_everywhere(loss, dims=self.dims, rank=self.global_rank, dp_group=self._dp_group,
                                 policy=self._on_nonfinite, step=step, found=self.nonfinite_replicas)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Manual optimization: ``manual_backward`` meets the loss before the user's ``opt.step()``, so a non-finite
        loss is decided here (``on_nonfinite``); skipped, it leaves no gradient, and the optimizer steps of this
        ``training_step`` do nothing on every rank."""
        module = self.lightning_module
        if module is not None and not module.automatic_optimization and not self._finite_everywhere(closure_loss):
            for p in module.parameters():
                p.grad = None
            self._skip_manual_steps = True
            return closure_loss.detach()
        return super().backward(closure_loss, optimizer, *args, **kwargs)

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        if self._skip_manual_steps:
            return None
        def closure_then_average() -> Any:
            out = closure()
            if self.lightning_module is None or self.lightning_module.automatic_optimization:
                self._average_dp_gradients()
            return out

        out = super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
        inner = torch_optimizer(optimizer)
        if self.dims.tp > 1 and id(inner) not in self._checked_optimizers and self.lightning_module is not None:
            check_state_layout(inner, self._param_names.local(self.lightning_module), self.parallel_state.shards,
                               self.dims.tp)  # once: state exists now
            self._checked_optimizers.add(id(inner))
        return out

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # manual optimization: the user may clip before ``opt.step()``, so average right after each backward
        if self.lightning_module is not None and not self.lightning_module.automatic_optimization:
            self._average_dp_gradients()

    def _average_dp_gradients(self) -> None:
        assert self.lightning_module is not None
        if self._state is not None:
            sum_partial_gradients(self._state.sequence)  # sequence parallelism: each tp rank saw part of the tokens
            sum_block_partials(self._state.tp_blocks)  # replicated parameters used on this rank's heads only
        experts = expert_parameters(self.lightning_module)  # averaged over their replicas only
        split = {id(p) for p in experts}
        params = [p for p in self.lightning_module.parameters() if p.requires_grad and id(p) not in split]
        average_gradients(params, self._dp_group)
        if self._ep_group is not None:
            reduce_expert_grads(experts, self._ep_group)

    # ------------------------------------------------------------------------------------------------------------
    # failures

    @override
    def on_exception(self, exception: BaseException) -> None:
        """This rank failed: tell every other rank who failed, where and why, so that none waits for it."""
        if self._watch is None:
            return
        where = self._engine.describe_position() if self._engine is not None else ""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        stage = getattr(getattr(trainer, "state", None), "stage", None)
        coords = self.dims.coords(self.global_rank) if self._dims is not None else {}
        message = (f"rank {self.global_rank} {coords} failed during {stage.value if stage else 'setup'}{where}: "
                   f"{type(exception).__name__}: {str(exception)[:500]}")
        if isinstance(exception, (dist.DistBackendError, RuntimeError)):  # a peer may be gone: name it
            silent = self._watch.silent_ranks()
            if silent:
                message = (f"rank(s) {silent} stopped responding (killed or lost); rank {self.global_rank} {coords} "
                           f"noticed{where}: {type(exception).__name__}: {str(exception)[:300]}")
        self._watch.report(message)

    @override
    def teardown(self) -> None:
        self.finish_async_saves(failed=self._watch is not None and self._watch.reported)
        if self._signal_report is not None:
            self._signal_report.uninstall()
            self._signal_report = None
        if self._watch is not None:
            self._watch.stop()
            if not self._watch.reported:  # no rank exits (taking the store with it) while another still uses it
                self.barrier("lightning_tpp-teardown")
            self._watch = None
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="tensor x pipeline x data parallelism")

