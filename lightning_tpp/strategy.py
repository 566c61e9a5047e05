"""``TensorPipeStrategy``: the Lightning glue. Parallelism lives in the other modules; this class orders the steps.

Setup order (runs for every fit/validate/test/predict; a second run finds the model already parallel)::

    init process group -> mesh (dp, pp, tp) -> model to device -> broadcast rank 0's weights
      -> tensor-parallel plan (auto, Hugging Face, user) -> apply -> optimizers

Per optimizer step: the Trainer's closure runs ``training_step`` + backward; then gradients are averaged over dp,
then Lightning clips (global norm over every shard) and steps.
"""

from __future__ import annotations

import atexit
import functools
import os
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Callable, Generator, Literal, Mapping, Optional, Sequence, Union

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout
from lightning.fabric.strategies import _StrategyRegistry
from lightning.fabric.utilities.imports import _IS_INTERACTIVE
from lightning.fabric.utilities.distributed import (
    _all_gather_ddp_if_available,
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.rank_zero import rank_zero_info, rank_zero_only, rank_zero_warn
from torch import Tensor, nn
from torch.distributed import ReduceOp
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tpp.checkpoint.state import check_state_layout
from lightning_tpp.core.params import ParamNames
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.integration.checkpointing import CheckpointMixin
from lightning_tpp.reliability.preflight import check_agreement, model_structure
from lightning_tpp.reliability.watch import FailureWatch, NonFiniteLossError
from lightning_tpp.core.grads import average_gradients, broadcast_module, clip_by_global_norm
from lightning_tpp.core.mesh import MeshDims, build_mesh, resolve_dims
from lightning_tpp.pipeline.build import PreparedStages, finish_stages, format_partition, prepare_stages
from lightning_tpp.pipeline.engine import PipelineEngine
from lightning_tpp.pipeline.logging import captured_logs, replay_logs
from lightning_tpp.pipeline.schedule import ScheduleLike, normalize as normalize_schedule, resolve as resolve_schedule
from lightning_tpp.pipeline.schedule import validate as validate_schedule
from lightning_tpp.integration.summary import ShardedModelSummary
from lightning_tpp.tensor_parallel.report import format_plan
from lightning_tpp.tensor_parallel.apply import apply_plan
from lightning_tpp.tensor_parallel.plan import TPPlan, check_divisible, detect, hf_plan, overlay


@functools.lru_cache(maxsize=None)
def _destroy_process_group_at_exit() -> None:
    """Destroy the process group before the interpreter tears down: gloo's threads otherwise may abort the process
    ("terminate called without an active exception") after all work is done. Registered once per process."""
    atexit.register(lambda: dist.destroy_process_group() if dist.is_initialized() else None)


class _WholeWeightsLauncher(_MultiProcessingLauncher):
    """spawn/fork launcher that hands whole tensors (not rank 0's shards) back to the main process's model, and
    destroys the process group when a worker is done (its process ends with ``os._exit``, skipping atexit)."""

    @override
    def _wrapping_function(self, *args: Any, **kwargs: Any) -> None:
        try:
            super()._wrapping_function(*args, **kwargs)
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()

    @override
    def _collect_rank_zero_results(self, trainer: "pl.Trainer", results: Any) -> Any:
        module = trainer.lightning_module
        full = self._strategy.whole_model_state()  # collective: every rank runs this method
        module.state_dict = lambda *args, **kwargs: full  # type: ignore[method-assign]
        try:
            return super()._collect_rank_zero_results(trainer, results)
        finally:
            del module.state_dict


class TensorPipeStrategy(CheckpointMixin, ParallelStrategy):
    """Tensor (``tp``), pipeline (``pp``) and data (``dp``) parallelism for an unmodified LightningModule.

    Args:
        tp: tensor-parallel size (ranks that split each layer; keep it within a node).
        pp: pipeline-parallel size (stages).
        dp: data-parallel size, or ``"auto"`` for ``world_size // (tp * pp)``.
        microbatches: micro-batches per step for the pipeline (default ``2 * pp``).
        schedule: pipeline schedule, one of ``"gpipe"``, ``"1f1b"``, ``"interleaved-1f1b"``, ``"zero-bubble"``,
            ``"zb-drain"`` (see ``docs/pipeline.md``: zero-bubble splits every backward, zb-drain a few), a name added
            with ``register_schedule``, a ``Schedule``, one list per rank of ``(kind, microbatch, chunk)`` actions,
            or ``torch.distributed.pipelining``'s ``ScheduleGPipe``/``Schedule1F1B``/``ScheduleInterleaved1F1B``.
        virtual_stages: model chunks per pipeline rank (``"interleaved-1f1b"`` needs 2 or more).
        balance: ``"params"`` (balance stages by parameter count), ``"time"`` (by measured block time on the
            module's ``example_input_array``), or blocks per stage, e.g. ``[3, 5]``.
        split_points: names of the blocks that start stages 1.., e.g. ``["model.layers.12"]`` (overrides balance).
        blocks: name of the module holding the blocks to pipeline, or names of several run one after the other
            (an encoder's layers, then a decoder's); found automatically when omitted.
        tp_plan: ``"auto"``, or a mapping of module-name globs to styles (``"colwise"``, ``"rowwise"``,
            ``"colwise_gather"``, ``"vocab"``, ``"mha"``, ``"replicate"``) laid over the automatic plan.
        verify: check each parallelised block against the original on its first call.
        save_distributed_checkpoint: write checkpoints as a folder of shards (torch.distributed.checkpoint, each
            rank writing its own; ``lightning-tpp consolidate`` makes one file of it) instead of one whole-model
            file written by rank 0. Both load into any layout.
        print_plan: print the plan table on global rank 0 at setup.
        process_group_backend: ``"gloo"``/``"nccl"``; default by device.
        timeout: how long a collective may wait, and how long a silent peer is tolerated before every rank stops
            with a message naming it (the latter capped at 60 s).
        on_nonfinite: a NaN/inf loss on any rank: ``"raise"`` on every rank, ``"skip"`` the step everywhere, or
            ``"warn"`` and go on. All ranks take the same decision.
        start_method: ``"auto"`` (``"fork"`` in notebooks, else ``"popen"``: the script is run again per rank),
            ``"popen"``, ``"spawn"``, ``"fork"`` or ``"forkserver"``.
    """

    strategy_name = "tensor_pipe"

    def __init__(
        self,
        tp: int = 1,
        pp: int = 1,
        dp: Union[int, Literal["auto"]] = "auto",
        *,
        microbatches: Optional[int] = None,
        schedule: ScheduleLike = "1f1b",
        virtual_stages: int = 1,
        balance: Union[Literal["params", "time"], list[int]] = "params",
        split_points: Optional[list[str]] = None,
        blocks: Optional[Union[str, Sequence[str]]] = None,
        tp_plan: Union[Literal["auto"], dict[str, str]] = "auto",
        verify: bool = True,
        print_plan: bool = True,
        save_distributed_checkpoint: bool = True,
        on_nonfinite: Literal["raise", "skip", "warn"] = "raise",
        accelerator: Optional["pl.accelerators.Accelerator"] = None,
        parallel_devices: Optional[list[torch.device]] = None,
        cluster_environment: Optional[ClusterEnvironment] = None,
        checkpoint_io: Optional[CheckpointIO] = None,
        precision_plugin: Optional[Precision] = None,
        process_group_backend: Optional[str] = None,
        timeout: Optional[timedelta] = default_pg_timeout,
        start_method: Literal["auto", "popen", "spawn", "fork", "forkserver"] = "auto",
    ) -> None:
        super().__init__(accelerator=accelerator, parallel_devices=parallel_devices,
                         cluster_environment=cluster_environment, checkpoint_io=checkpoint_io,
                         precision_plugin=precision_plugin)
        resolve_dims(tp * pp * (dp if isinstance(dp, int) else 1), tp, pp, dp)  # argument types and ranges
        schedule = normalize_schedule(schedule)  # a registered name, else a Schedule (same repr on every rank)
        if microbatches is not None and (not isinstance(microbatches, int) or microbatches < 1):
            raise ValueError(f"microbatches={microbatches!r} must be a positive integer")
        if tp_plan != "auto" and not isinstance(tp_plan, Mapping):
            raise TypeError(f"tp_plan must be 'auto' or a mapping of module globs to styles, got {tp_plan!r}")
        self._tp, self._pp, self._dp_arg = tp, pp, dp
        fixed = resolve_schedule(schedule).fixed  # action lists are written for one micro-batch count
        self.microbatches = microbatches if microbatches is not None else fixed[1] if fixed else 2 * pp
        self.schedule = schedule
        self.virtual_stages = virtual_stages
        if pp > 1:
            validate_schedule(schedule, pp, self.microbatches, virtual_stages)
        if isinstance(balance, str) and balance not in ("params", "time"):
            raise ValueError(f"balance={balance!r} must be 'params', 'time' or a list of blocks per stage")
        self._balance, self._split_points, self._blocks = balance, split_points, blocks
        self._prepared: Optional[PreparedStages] = None
        self._engine: Optional[PipelineEngine] = None
        self._tp_plan_arg = tp_plan
        self._verify = verify
        self._save_sharded = save_distributed_checkpoint
        if on_nonfinite not in ("raise", "skip", "warn"):
            raise ValueError(f"on_nonfinite={on_nonfinite!r} must be 'raise', 'skip' or 'warn'")
        self._on_nonfinite = on_nonfinite
        self._watch: Optional[FailureWatch] = None
        self._skip_backward = False
        self._restored_sharded = False
        self._checked_optimizers: set[int] = set()
        self._print_plan = print_plan
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method
        self._num_nodes = 1
        self._dims: Optional[MeshDims] = None
        self._mesh: Any = None
        self._tp_group = TPGroup(None, 0, 1)
        self._dp_group: Any = None
        self._pp_group: Any = None
        self.plan: TPPlan = TPPlan()

    # ------------------------------------------------------------------------------------------------------------
    # topology

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def dims(self) -> MeshDims:
        if self._dims is None:
            raise RuntimeError("the mesh exists once the Trainer has set up the processes (setup_environment)")
        return self._dims

    @property
    def device_mesh(self) -> Any:
        """The ``("dp", "pp", "tp")`` DeviceMesh."""
        self.dims  # noqa: B018 - raises before setup
        return self._mesh

    @property
    def tp_group(self) -> TPGroup:
        return self._tp_group

    @property
    def dp_group(self) -> Any:
        return self._dp_group

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        coords = self.dims.coords(self.global_rank)
        return {"num_replicas": self.dims.dp, "rank": coords["dp"]}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        method = self._start_method
        if method == "auto":
            method = "fork" if _IS_INTERACTIVE else "popen"
        if method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _WholeWeightsLauncher(self, start_method=method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        reset_seed()
        self._set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device)
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {"timeout": self._timeout}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        _init_dist_connection(self.cluster_environment, self._process_group_backend, **kwargs)
        _destroy_process_group_at_exit()
        self._dims = resolve_dims(self.world_size, self._tp, self._pp, self._dp_arg)
        self._mesh = build_mesh(self._dims, self.root_device.type)
        coords = self._dims.coords(self.global_rank)
        self._tp_group = TPGroup(self._mesh.get_group("tp"), coords["tp"], self._dims.tp)
        self._dp_group = self._mesh.get_group("dp")
        self._pp_group = self._mesh.get_group("pp")
        if self._watch is None and self.world_size > 1:
            seconds = self._timeout.total_seconds() if self._timeout is not None else 1800.0
            self._watch = FailureWatch(dist.distributed_c10d._get_default_store(), self.global_rank, self.world_size,
                                       timeout=min(seconds, 60.0))
            self._watch.start()

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        rank_zero_only.rank = self.global_rank

    # ------------------------------------------------------------------------------------------------------------
    # model

    @override
    def setup(self, trainer: "pl.Trainer") -> None:
        assert self.accelerator is not None
        self.accelerator.setup(trainer)
        self.model_to_device()
        module = self.lightning_module
        assert module is not None
        if not getattr(module, "_tpp_parallel", False):
            self._parallelize(module)
            module._tpp_parallel = True
        self.model = self.precision_plugin.convert_module(self.model)
        self._use_dp_groups_for_metrics(module)
        self._patch_trainer(trainer)
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)

    def _parallelize(self, module: nn.Module) -> None:
        check_agreement(self._fingerprint(module))
        broadcast_module(module, src=0)
        self._param_names = ParamNames.of(module)  # the single-device names, before stages drop modules
        whole_model = [n for n, _ in module.named_modules()]
        if self._pp > 1:
            if not module.automatic_optimization:
                raise ValueError("pipeline parallelism (pp>1) runs forward and backward inside the schedule and "
                                 "needs automatic optimization; set automatic_optimization = True or use pp=1")
            if getattr(self.precision_plugin, "scaler", None) is not None:
                raise ValueError("pipeline parallelism (pp>1) does not support a loss-scaling GradScaler "
                                 "(precision='16-mixed'): every stage would have to agree on each step's scale and "
                                 "skip decision. Use precision='bf16-mixed' (no scaler needed) or '32-true'")
            coords = self.dims.coords(self.global_rank)
            self._prepared = prepare_stages(module, dims=self.dims, pp_rank=coords["pp"],
                                            virtual=self.virtual_stages, device=self.root_device,
                                            blocks=self._blocks, balance=self._balance,
                                            split_points=self._split_points)
        plan = detect(module, self._tp, check=False)
        if self._tp > 1:
            overlay(module, plan, hf_plan(module), source="Hugging Face tp plan", strict=False)
            if isinstance(self._tp_plan_arg, Mapping):
                overlay(module, plan, self._tp_plan_arg, source="tp_plan", strict=True, whole_model=whole_model)
            check_divisible(plan, self._tp)
            apply_plan(module, plan, self._tp_group, verify=self._verify)
        self.plan = plan
        if self._prepared is not None:
            coords = self.dims.coords(self.global_rank)
            self._engine = finish_stages(module, self._prepared, dims=self.dims, coords=coords,
                                         virtual=self.virtual_stages, schedule=self.schedule,
                                         microbatches=self.microbatches, pp_group=self._pp_group)
        if self._print_plan and self._tp > 1:
            rank_zero_info(format_plan(module, plan, self._tp))
        if self._print_plan and self._prepared is not None:
            rank_zero_info(format_partition(self._prepared.partition, self.dims.pp))

    def _fingerprint(self, module: nn.Module) -> dict[str, Any]:
        config = {k: repr(getattr(self, k)) for k in ("_tp", "_pp", "_dp_arg", "microbatches", "schedule",
                                                       "virtual_stages", "_tp_plan_arg", "_balance", "_split_points",
                                                       "_blocks", "_save_sharded", "_on_nonfinite")}
        return {"configuration": config, "model": model_structure(module), "seed": os.environ.get("PL_GLOBAL_SEED")}

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
        """Whole-model parameter counts in ModelSummary; global-norm gradient clipping."""
        totals = (self._prepared.total_params, self._prepared.trainable_params) if self._prepared else None
        for cb in trainer.callbacks:  # type: ignore[attr-defined]
            if isinstance(cb, ModelSummary):
                cb._summary = lambda trainer, pl_module, cb=cb: ShardedModelSummary(
                    pl_module, max_depth=cb._max_depth, totals=totals)
        self.precision_plugin.clip_grad_by_norm = self._clip_grad_by_norm  # type: ignore[method-assign]

    def _clip_grad_by_norm(self, optimizer: Optimizer, clip_val: Union[int, float]) -> None:
        params = [p for p in self.precision_plugin.main_params(optimizer)]
        clip_by_global_norm([p for p in params if not getattr(p, "_tpp_tied_secondary", False)], float(clip_val),
                            tp_rank=self._tp_group.rank, groups=[self._tp_group.group, self._pp_group], apply_to=params)

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: Optional[bool] = None) -> Generator[None, None, None]:
        with self.precision_plugin.tensor_init_context():
            yield

    # ------------------------------------------------------------------------------------------------------------
    # steps

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        out = super().training_step(*args, **kwargs) if self._engine is None else self._pipeline_training_step(
            *args, **kwargs)
        loss = out.get("loss") if isinstance(out, dict) else out
        if isinstance(loss, Tensor) and not self._finite_everywhere(loss):
            if self._engine is not None:
                self._engine.discard_grads()
            self._skip_backward = True  # skip: no gradient from this batch on any rank (Lightning refuses None)
            return torch.zeros((), device=self.root_device)
        return out

    def _finite_everywhere(self, loss: Tensor) -> bool:
        """One decision for all ranks about a NaN/inf loss (``on_nonfinite``)."""
        bad = torch.tensor([0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0], device=self.root_device)
        # the ranks of one replica hold the same loss (tp computes it replicated, pp broadcasts it): ask only the
        # other replicas, and nobody when there are none (no synchronisation point added to the step)
        coords = self.dims.coords(self.global_rank)
        replicas = [self.dims.rank_of(dp=d, pp=coords["pp"], tp=coords["tp"]) for d in range(self.dims.dp)]
        flags = [bad]
        if self.dims.dp > 1:
            flags = [torch.zeros_like(bad) for _ in replicas]
            dist.all_gather(flags, bad, group=self._dp_group)
        ranks = [r for r, f in zip(replicas, flags) if f.item()]
        if not ranks:
            return True
        step = self.lightning_module.trainer.global_step if self.lightning_module is not None else -1
        message = f"non-finite loss at step {step} on ranks {ranks} (on_nonfinite={self._on_nonfinite!r})"
        if self._on_nonfinite == "raise":
            raise NonFiniteLossError(f"{message}; pass on_nonfinite='skip' to skip such steps, or lower the learning "
                                     f"rate / enable gradient clipping")
        rank_zero_warn(message + ("; skipping the step on every rank" if self._on_nonfinite == "skip" else ""))
        return self._on_nonfinite == "warn"

    def _pipeline_training_step(self, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None and module.trainer is not None

        def step(micro: Any) -> Any:
            with self.precision_plugin.train_step_context():
                return module.training_step(micro, *args[1:], **kwargs)

        with captured_logs(module) as logs:
            loss = self._engine.train_step(step, args[0], loss_scale=1.0 / module.trainer.accumulate_grad_batches)
        replay_logs(self._engine, module, logs)
        return loss

    def _pipeline_eval(self, hook: str, context: Any, *args: Any, **kwargs: Any) -> Any:
        module = self.lightning_module
        assert module is not None and self._engine is not None

        def step(batch: Any) -> Any:
            with context():
                return getattr(module, hook)(batch, *args[1:], **kwargs)

        with captured_logs(module) as logs:
            out = self._engine.eval_step(step, args[0], hook)
        replay_logs(self._engine, module, logs)
        return out

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            return super().validation_step(*args, **kwargs)
        return self._pipeline_eval("validation_step", self.precision_plugin.val_step_context, *args, **kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            return super().test_step(*args, **kwargs)
        return self._pipeline_eval("test_step", self.precision_plugin.test_step_context, *args, **kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        if self._engine is None:
            return super().predict_step(*args, **kwargs)
        return self._pipeline_eval("predict_step", self.precision_plugin.predict_step_context, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Under a pipeline the schedule already ran backward inside ``training_step``: run the hooks and restore
        the parked gradients instead of differentiating the (detached) step loss."""
        if self._engine is None and not self._skip_backward:
            return super().backward(closure_loss, optimizer, *args, **kwargs)
        assert self.lightning_module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, self.lightning_module)
        if self._engine is not None and not self._skip_backward:
            self._engine.restore_grads()
        self._skip_backward = False
        closure_loss = self.precision_plugin.post_backward(closure_loss, self.lightning_module)
        self.post_backward(closure_loss)
        return closure_loss

    @override
    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        def closure_then_average() -> Any:
            out = closure()
            if self.lightning_module is None or self.lightning_module.automatic_optimization:
                self._average_dp_gradients()
            return out

        out = super().optimizer_step(optimizer, closure_then_average, model, **kwargs)
        inner = getattr(optimizer, "_optimizer", optimizer)
        if self.dims.tp > 1 and id(inner) not in self._checked_optimizers and self.lightning_module is not None:
            check_state_layout(inner, self._param_names.local(self.lightning_module), self.dims.tp)  # once: state exists now
            self._checked_optimizers.add(id(inner))
        return out

    @override
    def post_backward(self, closure_loss: Tensor) -> None:
        # manual optimization: the user may clip before ``opt.step()``, so average right after each backward
        if self.lightning_module is not None and not self.lightning_module.automatic_optimization:
            self._average_dp_gradients()

    def _average_dp_gradients(self) -> None:
        assert self.lightning_module is not None
        params = [p for p in self.lightning_module.parameters() if p.requires_grad]
        average_gradients(params, self._dp_group)

    # ------------------------------------------------------------------------------------------------------------
    # collectives used by Lightning (self.log(sync_dist=True), all_gather, early stopping, checkpoint paths)

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not _distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def _replica_group(self, group: Optional[Any]) -> Any:
        """The world (Lightning's default) means "every replica": tp/pp ranks of one replica hold the same values,
        they are not more samples. An explicitly chosen sub-group is kept."""
        return self._dp_group if group is None or group is dist.group.WORLD else group

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        """Reduce over data-parallel replicas (``self.log(sync_dist=True)`` lands here)."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, self._replica_group(group), reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather from every data-parallel replica: one entry per replica, not per process."""
        return _all_gather_ddp_if_available(tensor, group=self._replica_group(group), sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not _distributed_is_initialized():
            return decision
        t = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(t, op=ReduceOp.SUM)
        return bool(t == self.world_size) if all else bool(t)

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
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        strategy_registry.register(cls.strategy_name, cls, description="tensor x pipeline x data parallelism")

