"""``TensorPipeStrategy``: the Lightning glue. Parallelism lives in the subpackages; this class orders the steps.

Setup order (runs for every fit/validate/test/predict; a module that already holds a ``ParallelState`` adopts it)::

    init process group -> mesh (dp, pp, tp) and groups          (integration.topology)
      -> model to device -> the setup steps (lightning_tpp.steps.STEPS: agree ... stages ... tp ... dp, reduction)
      -> precision -> optimizers

Per optimizer step: the Trainer's closure runs ``training_step`` (under a pipeline: the whole schedule,
``integration.pipeline_steps``) + backward; then gradients are averaged over dp, then Lightning clips through the
precision plugin (global norm over every shard, ``integration.precision``) and steps.
"""

from __future__ import annotations

import os
from contextlib import contextmanager, nullcontext
from datetime import timedelta
from typing import Any, Callable, Generator, Literal, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tpp._compat import StrategyRegistryType, layer_sync_requested, optimizers_to_device
from lightning_tpp.checkpoint.async_save import AsyncSaver
from lightning_tpp.checkpoint.state import check_state_layout
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.config import TensorPipeConfig
from lightning_tpp.data_parallel import DPSharding
from lightning_tpp.core.materialize import move_real
from lightning_tpp.core.mesh import MeshDims
from lightning_tpp.core.params import ShardIndex
from lightning_tpp.core.token_mean import GlobalTokenMean, LossNormalization
from lightning_tpp.integration.checkpointing import CheckpointMixin, torch_optimizer
from lightning_tpp.integration.collectives import ReplicaCollectives, metrics_over
from lightning_tpp.integration.launchers import make_launcher
from lightning_tpp.integration.pipeline_steps import PipelineSteps
from lightning_tpp.integration.precision import GlobalNormClippingStrategy
from lightning_tpp.integration.summary import count_whole_model
from lightning_tpp.integration.topology import MeshTopology
from lightning_tpp.layout.strategy import AutoLayout
from lightning_tpp.parallel_state import ParallelState, ProcessGroups
from lightning_tpp.steps import run as run_steps
from lightning_tpp.pipeline.engine import PipelineEngine
from lightning_tpp.pipeline.metrics import PipelineMetrics
from lightning_tpp.integration.compile_metrics import Compiled
from lightning_tpp.integration.context_metrics import ContextMetrics
from lightning_tpp.integration.expert_load import ExpertLoad
from lightning_tpp.pipeline.schedule import ScheduleLike
from lightning_tpp.reliability.nonfinite import finite_everywhere
from lightning_tpp.reliability.preflight import model_structure
from lightning_tpp.reliability.watch import FailureWatch, SignalReport
from lightning_tpp.tensor_parallel.plan import TPPlan


class TensorPipeStrategy(AutoLayout, CheckpointMixin, PipelineSteps, GlobalNormClippingStrategy, ReplicaCollectives,
                         MeshTopology, ParallelStrategy):
    """Tensor (``tp``), pipeline (``pp``) and data (``dp``) parallelism for an unmodified LightningModule.

    The arguments below are kept as one validated :class:`~lightning_tpp.config.TensorPipeConfig`
    (``strategy.config``); ``accelerator``, ``parallel_devices``, ``cluster_environment``, ``checkpoint_io`` and
    ``precision_plugin`` are Lightning's.
    """

    strategy_name = "tensor_pipe"

    def __init__(
        self,
        tp: Union[int, Literal["auto"]] = 1,
        pp: Union[int, Literal["auto"]] = 1,
        dp: Union[int, Literal["auto"]] = "auto",
        *,
        ep: Union[int, Literal["auto"]] = 1,
        cp: int = 1,
        cp_mode: Literal["allgather", "a2a", "auto"] = "allgather",
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
        compile: Union[bool, dict[str, Any]] = False,
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
        self.config = TensorPipeConfig(
            tp=tp, pp=pp, dp=dp, ep=ep, cp=cp, cp_mode=cp_mode, layout=layout, device_memory=device_memory,
            global_batch=global_batch,
            microbatches=microbatches, schedule=schedule, virtual_stages=virtual_stages, balance=balance,
            split_points=split_points, blocks=blocks, tp_plan=tp_plan, verify=verify,
            activation_checkpointing=activation_checkpointing, loss_parallel=loss_parallel,
            sequence_parallel=sequence_parallel, dp_sharding=dp_sharding, vocab_exchange=vocab_exchange,
            loss_normalization=loss_normalization, print_plan=print_plan,
            save_distributed_checkpoint=save_distributed_checkpoint, async_save=async_save,
            on_nonfinite=on_nonfinite, pipeline_metrics=pipeline_metrics, compile=compile,
            process_group_backend=process_group_backend, timeout=timeout, start_method=start_method,
            weights=weights, weights_prefix=weights_prefix)
        self._auto_layout = self.config.auto_request()  # decided at setup (AutoLayout._before_mesh)
        self._state: Optional[ParallelState] = None
        self.worker_plan: Optional[TPPlan] = None  # rank 0's plan, handed back by a spawn/fork launch
        self._async_saver = AsyncSaver(timeout) if async_save else None
        self._metrics: Optional[PipelineMetrics] = None
        self._expert_load: Optional[ExpertLoad] = None  # tokens per expert, logged under moe/
        self._context_metrics: Optional[ContextMetrics] = None  # cp > 1: exchanges and attention time, under cp/
        self._compiled: Optional[Compiled] = None  # compile=: the blocks compiled after the first step, compile/
        self._signal_report: Optional[SignalReport] = None  # the hang report on SIGUSR1 (MeshTopology)
        self._watch: Optional[FailureWatch] = None  # the failure watch (MeshTopology)
        self._skip_backward = False
        self._skip_manual_steps = False  # a non-finite loss met manual_backward in this training_step
        self.nonfinite_replicas: list[int] = []  # dp replicas of the last non-finite loss (SpikeGuard records them)
        self._restored_sharded = False
        self._checked_optimizers: set[int] = set()
        self._process_group_backend = process_group_backend  # the backend in use once set up
        self._num_nodes = 1
        self._dims: Optional[MeshDims] = None
        self._groups = ProcessGroups(None, TPGroup(None, 0, 1), None, None)  # the mesh's (setup_environment)

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

    @override
    def _configure_launcher(self) -> None:  # Lightning's hook for a strategy's launcher (DDPStrategy overrides it too)
        self._launcher = make_launcher(self, self.config.start_method)

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
            self._groups = state.groups
        self._state = state
        if state.engine is not None:
            executor = state.engine.executor
            executor.normalization, executor.dp_group, executor.dp_size = (self.config.loss_normalization, self._groups.dp,
                                                                           self.dims.dp)
        self._observe()
        self.model = self.precision_plugin.convert_module(self.model)
        metrics_over(module, self._groups.dp)  # torchmetrics: tp (and pp) replicas are not extra samples
        count_whole_model(trainer.callbacks)  # type: ignore[attr-defined]  (whole-model counts in ModelSummary)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: nn.Module) -> ParallelState:
        """The setup steps (``lightning_tpp.steps``), all of them, on this rank."""
        state = run_steps(module, self.config, self._groups, dims=self.dims, rank=self.global_rank, device=self.root_device,
                          live=True, fingerprint=self._fingerprint(module), sync_batchnorm=self._sync_batchnorm,
                          loss_scaling=getattr(self.precision_plugin, "scaler", None) is not None,
                          convert=self.precision_plugin.convert_module).state
        assert state is not None
        state.config = self._config()
        state.layout = self.layout_choice  # layout="auto": what was chosen (None when the degrees were given)
        return state

    def _observe(self) -> None:
        """Pipeline metrics, and the hang report (on SIGUSR1, and when the failure watch stops this rank)."""
        coords = self.dims.coords(self.global_rank)
        self._metrics = PipelineMetrics(self._engine, coords=coords, tp=self.dims.tp) \
            if self.config.pipeline_metrics and self._engine is not None else None
        layers = self.parallel_state.experts
        if self._expert_load is not None:
            self._expert_load.remove()
        self._expert_load = ExpertLoad(self.lightning_module, layers, counts=coords["tp"] == 0,
                                       traffic=self._groups.ep.traffic if self._groups.ep is not None else None,
                                       ) if layers else None
        context = self.parallel_state.context
        self._context_metrics = ContextMetrics(context.traffic, context.a2a) if context is not None else None
        compiled = self.parallel_state.compiled
        # each compiled block checked against its eager forward on its first compiled call (under a pipeline, what
        # is compiled runs inside the stage runtime's dispatch, so the check's extra forwards are not calls it counts)
        self._compiled = Compiled(self.lightning_module, compiled, self.config.compile,
                                  check=self.config.verify) if compiled else None
        self._watch_describes(f"rank {self.global_rank} {coords}", self._engine)

    def _config(self) -> dict[str, str]:
        """The arguments that decide how the model is cut and run, as compared across runs (adoption)."""
        return {**self.config.cutting(), "sync_batchnorm": repr(self._sync_batchnorm)}

    @property
    def microbatches(self) -> int:
        return self.config.microbatches  # type: ignore[return-value]  (set at construction)

    @property
    def schedule(self) -> ScheduleLike:
        return self.config.schedule

    @property
    def virtual_stages(self) -> int:
        return self.config.virtual_stages

    @property
    def _sync_batchnorm(self) -> bool:
        """``Trainer(sync_batchnorm=True)``."""
        return layer_sync_requested(self)

    def _fingerprint(self, module: nn.Module) -> dict[str, Any]:
        """What every rank must agree on before the model is cut: every argument (but print_plan), the model."""
        return {"configuration": {**self.config.agreement(), "sync_batchnorm": repr(self._sync_batchnorm)},
                "model": model_structure(module), "seed": os.environ.get("PL_GLOBAL_SEED")}

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
        if self._compiled is not None:
            self._compiled.before_step()
        if self.lightning_module is not None:  # the strategy's own random stream moves on per training batch
            self._groups.tp.stream.start_step(self.lightning_module.trainer.fit_loop.total_batch_idx)
        if self._engine is not None:
            out = self._pipeline_training_step(*args, **kwargs)
        elif self.config.loss_normalization == "global" and self.dims.dp > 1:  # a token mean over every replica's tokens
            with GlobalTokenMean(self._groups.dp, self.dims.dp, self.root_device):
                out = super().training_step(*args, **kwargs)
        else:
            out = super().training_step(*args, **kwargs)
        if self._metrics is not None and self.lightning_module is not None:
            self._metrics.after_step(self.lightning_module, args[0], args[1] if len(args) > 1 else None)
        if self._expert_load is not None and self.lightning_module is not None:
            self._expert_load.after_step(self.lightning_module, args[1] if len(args) > 1 else None)
        if self._context_metrics is not None and self.lightning_module is not None:
            self._context_metrics.after_step(self.lightning_module, args[1] if len(args) > 1 else None)
        if self._compiled is not None and self.lightning_module is not None:
            self._compiled.after_step(self.lightning_module, args[1] if len(args) > 1 else None)
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
        return finite_everywhere(loss, dims=self.dims, rank=self.global_rank, dp_group=self._groups.dp,
                                 policy=self.config.on_nonfinite, step=step, found=self.nonfinite_replicas)

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
            check_state_layout(inner, self.parallel_state.names.local(self.lightning_module), self.parallel_state.shards,
                               self.dims.tp)  # once: state exists now
            self._checked_optimizers.add(id(inner))
        return out

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # manual optimization: the user may clip before ``opt.step()``, so average right after each backward
        if self.lightning_module is not None and not self.lightning_module.automatic_optimization:
            self._average_dp_gradients()

    def _average_dp_gradients(self) -> None:
        reduction = self.parallel_state.reduction
        assert reduction is not None
        reduction()

    # ------------------------------------------------------------------------------------------------------------
    # failures

    @override
    def on_exception(self, exception: BaseException) -> None:
        """This rank failed: tell every other rank who failed, where and why, so that none waits for it."""
        if self._watch is None:
            return
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        stage = getattr(getattr(trainer, "state", None), "stage", None)
        coords = self.dims.coords(self.global_rank) if self._dims is not None else {}
        self._watch.report_exception(exception, label=f"rank {self.global_rank} {coords}",
                                     during=stage.value if stage else "setup",
                                     where=self._engine.describe_position() if self._engine is not None else "")

    @override
    def teardown(self) -> None:
        self.finish_async_saves(failed=self._watch is not None and self._watch.reported)
        self._stop_watch()
        assert self.cluster_environment is not None
        assert self.accelerator is not None
        self.cluster_environment.teardown()
        self.precision_plugin.teardown()
        self.accelerator.teardown()

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: StrategyRegistryType) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="tensor x pipeline x data parallelism")


# the arguments' documentation lives with the config; the strategy's docstring shows it (help, LightningCLI)
TensorPipeStrategy.__doc__ = f"{(TensorPipeStrategy.__doc__ or '').rstrip()}\n\n" \
                             f"{(TensorPipeConfig.__doc__ or '').partition(chr(10) * 2)[2]}"
