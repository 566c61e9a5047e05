"""Checkpoint glue of :class:`~lightning_tpp.TensorPipeStrategy` (a mixin): layout-free saves and loads.

Whole-file checkpoints hold the single-device ``state_dict`` and optimizer state (gathered over tp and pp); sharded
ones are a ``torch.distributed.checkpoint`` folder (:mod:`lightning_tpp.checkpoint.dcp`). Both load into any layout.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch.distributed as dist
from lightning.pytorch.core.optimizer import LightningOptimizer
from lightning.pytorch.trainer.states import TrainerFn, TrainerStatus
from torch.optim import Optimizer
from typing_extensions import override

from lightning_tpp._compat import optimizer_to_device, requested_weights_only
from lightning_tpp.checkpoint.dcp import (
    Layout,
    tp_dp_mesh,
    is_sharded_checkpoint,
    load_sharded,
    merge_param_groups,
    clear_partial,
    named_param_groups,
    partial_path,
    save_sharded,
    sharded_entries,
    sharded_meta,
)
from lightning_tpp.checkpoint.async_save import AsyncSaver
from lightning_tpp.config import TensorPipeConfig
from lightning_tpp.parallel_state import ParallelState, ProcessGroups
from lightning_tpp.reliability import elastic
from lightning_tpp.checkpoint.files import atomic_save
from lightning_tpp.checkpoint.rng import rng_state, set_rng_state
from lightning_tpp.checkpoint.safe_load import load_or_explain
from lightning_tpp.checkpoint.state import (
    full_state_dict,
    indexed_optimizer_state,
    load_full_state_dict,
    load_indexed_optimizer_state,
    merge_named,
    named_optimizer_state,
)


def torch_optimizer(optimizer: Any) -> Optimizer:
    """The torch optimizer behind Lightning's ``LightningOptimizer`` wrapper (or ``optimizer`` itself)."""
    return optimizer.optimizer if isinstance(optimizer, LightningOptimizer) else optimizer


class CheckpointMixin:
    """Strategy mixin: the checkpoint hooks, reading the strategy's ``config``, ``parallel_state`` and groups."""

    config: TensorPipeConfig
    parallel_state: ParallelState
    _groups: ProcessGroups
    _restored_sharded: bool
    _async_saver: Optional[AsyncSaver]  # async_save=True: the save in flight

    def _gather_stages(self, obj: Any) -> Optional[list[Any]]:
        """Every pipeline stage's ``obj`` on the first stage's rank of this pp group (None elsewhere)."""
        coords = self.dims.coords(self.global_rank)
        dst = self.dims.rank_of(dp=coords["dp"], pp=0, tp=coords["tp"], cp=coords.get("cp", 0))
        out: Optional[list[Any]] = [None] * self.dims.pp if self.global_rank == dst else None
        dist.gather_object(obj, out, dst=dst, group=self._groups.pp)
        return out

    @property
    @override  # type: ignore[misc]
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # load into the parallel layout: shards are cut from whole tensors, or read by DCP

    @property
    @override  # type: ignore[misc]
    def lightning_restore_optimizer(self) -> bool:
        return not self._restored_sharded  # a sharded checkpoint's optimizer state is loaded with the model

    @override  # type: ignore[misc]
    def lightning_module_state_dict(self) -> dict[str, Any]:
        if self.config.save_distributed_checkpoint:
            return {}  # written by save_checkpoint, shard by shard
        return self.whole_model_state()

    def whole_model_state(self) -> dict[str, Any]:
        """The single-device ``state_dict`` (on the first stage's ranks; collective over tp and pp)."""
        assert self.lightning_module is not None
        state = full_state_dict(self.lightning_module, self._groups.tp, self.parallel_state.shards)
        if self.config.pp == 1:
            return state
        stages = self._gather_stages({k: v.cpu() for k, v in state.items()})
        return {k: v for stage in stages for k, v in stage.items()} if stages is not None else state

    @override  # type: ignore[misc]
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        assert self.lightning_module is not None
        if "state_dict" not in checkpoint:
            return  # a sharded checkpoint, loaded in load_checkpoint
        state = checkpoint["state_dict"]
        if self.config.pp > 1:  # this stage's entries; the other stages' keys are not "unexpected" here
            own = self.lightning_module.state_dict().keys()
            state = {k: v for k, v in state.items() if k in own}
        load_full_state_dict(self.lightning_module, state, self._groups.tp, self.parallel_state.shards, strict=strict)

    @override  # type: ignore[misc]
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """The ordinary single-device ``optimizer.state_dict()`` (whole tensors, indices in the single-device
        model's parameter order), whatever the layout: resumable in any layout and without a strategy."""
        assert self.lightning_module is not None
        if self.config.save_distributed_checkpoint:
            return {}
        optimizer = torch_optimizer(optimizer)
        named = named_optimizer_state(optimizer, self.lightning_module, self.parallel_state.names, self._groups.tp,
                                      self.parallel_state.shards)
        if self.config.pp > 1:
            stages = self._gather_stages(named)
            if stages is None:
                return {}
            named = merge_named(stages)
        return indexed_optimizer_state(named, self.parallel_state.names)

    @override  # type: ignore[misc]
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        assert self.lightning_module is not None
        for optimizer, state in zip(self.optimizers, checkpoint.get("optimizer_states", [])):
            optimizer = torch_optimizer(optimizer)
            load_indexed_optimizer_state(optimizer, self.lightning_module, state, self.parallel_state.names, self._groups.tp,
                                         self.parallel_state.shards)
            optimizer_to_device(optimizer, self.root_device)

    @override  # type: ignore[misc]
    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any, storage_options: Optional[Any] = None
                        ) -> None:
        """Rank 0 writes the whole-model checkpoint aside and then renames it into place (local paths); every rank's
        RNG states travel with it."""
        path: Optional[Path] = None
        if self._async_saver is not None:  # one collective: the save in flight waited for (its failure raised on
            # every rank), every rank's RNG states, rank 0's path; rank 0 clears the folder this save writes to
            own = Path(str(filepath))
            shared = self._async_saver.wait(self.world_size, (rng_state(), str(own)),
                                            then=(lambda: clear_partial(own)) if self.is_global_zero else None)
            rng, path = [r for r, _ in shared], Path(shared[0][1])
        else:
            rng = [None] * self.world_size
            dist.all_gather_object(rng, rng_state())
        checkpoint["tpp_rng_states"] = rng
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        checkpoint[elastic.KEY] = elastic.world_record(  # what a resume in another world size keeps
            dp=self.dims.dp, accumulate=trainer.accumulate_grad_batches if trainer is not None else 1,
            world_size=self.world_size, loader=trainer.train_dataloader if trainer is not None else None)
        if self.config.save_distributed_checkpoint:
            return self._save_sharded_checkpoint(checkpoint, path or Path(self.broadcast(str(filepath))))
        if not self.is_global_zero:
            return
        if storage_options is not None or "://" in str(filepath):
            return self.checkpoint_io.save_checkpoint(checkpoint, filepath, storage_options=storage_options)
        atomic_save(checkpoint, Path(filepath))

    def _layout(self) -> Layout:
        state = self.parallel_state
        if state.dp is not None and self._groups.tp.size > 1 and getattr(self, "_tp_dp_mesh", None) is None:
            self._tp_dp_mesh = tp_dp_mesh(self._groups.mesh)  # column-parallel shards split again over dp
        return Layout(self._groups.mesh, self._groups.tp, state.shards, getattr(self, "_tp_dp_mesh", None))

    def _save_sharded_checkpoint(self, checkpoint: dict[str, Any], path: Path) -> None:
        assert self.lightning_module is not None
        module, optimizers = self.lightning_module, [torch_optimizer(o) for o in self.optimizers]
        groups = named_param_groups(optimizers, module, self.parallel_state.names)
        if self.config.pp > 1:  # every stage's parameter names in each group
            stages = self._gather_stages(groups)
            if stages is not None:
                groups = merge_param_groups(stages)
        saver = self._async_saver  # the save in flight was waited for by save_checkpoint
        if saver is None or not self._in_fit_loop():
            save_sharded(path, checkpoint, module, optimizers, self.parallel_state.names, self._layout(),
                         is_global_zero=self.is_global_zero, param_groups=groups)
            return
        layout = self._layout()
        entries = sharded_entries(module, optimizers, self.parallel_state.names, layout)
        meta = sharded_meta(checkpoint, self.parallel_state.names, groups) if self.is_global_zero else None
        saver.save(entries, partial_path(path), path, meta, layout)  # partial_path cleared by rank 0 before
        # save_checkpoint's collective

    def _in_fit_loop(self) -> bool:
        """A save in the training loop goes to the background; one after ``fit`` (nothing to overlap) is written
        before ``save_checkpoint`` returns."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        return trainer is not None and trainer.state.fn == TrainerFn.FITTING \
            and trainer.state.status == TrainerStatus.RUNNING

    def wait_for_checkpoint(self) -> None:
        """Block until the checkpoint saved in the background (``async_save=True``) is published, and raise its
        failure on every rank; nothing happens without ``async_save``. Collective: call it on every rank (the next
        save and the teardown do)."""
        if self._async_saver is not None:
            self._async_saver.wait(self.world_size)

    def finish_async_saves(self, *, failed: bool) -> None:
        """At teardown: wait for the save in flight and raise its failure on every rank (collective); after a
        failure of some rank, do not wait for peers that may be gone."""
        if self._async_saver is None or not dist.is_initialized():
            return  # nothing saved yet: the process group never started
        if failed:
            self._async_saver.settle()
        else:
            self.wait_for_checkpoint()

    @override  # type: ignore[misc]
    def process_dataloader(self, dataloader: Any) -> Any:
        """The training loader of an epoch resumed in its middle continues after the samples already read (in any
        world size: :mod:`lightning_tpp.reliability.elastic`)."""
        trainer = self.lightning_module.trainer if self.lightning_module is not None else None
        if trainer is None or not trainer.training:
            return dataloader
        return elastic.resume_data_position(dataloader, trainer)

    @override  # type: ignore[misc]
    def remove_checkpoint(self, filepath: Any) -> None:
        """``ModelCheckpoint`` dropping an older checkpoint: with a save in flight, only once that one is published
        (the step does not wait; a crash meanwhile still finds the older one)."""
        remove = super().remove_checkpoint  # type: ignore[misc]
        if self._async_saver is not None:
            self._async_saver.after_publish(lambda: remove(filepath))
        else:
            remove(filepath)

    @override  # type: ignore[misc]
    def load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool] = None) -> dict[str, Any]:
        if weights_only is None:
            weights_only = requested_weights_only()
        checkpoint = self._load_checkpoint(checkpoint_path, weights_only)
        if self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING:
            elastic.keep_global_batch(checkpoint, self.lightning_module.trainer, dp=self.dims.dp,
                                      world_size=self.world_size)
        rng = checkpoint.get("tpp_rng_states")
        if isinstance(rng, list) and len(rng) == self.world_size:  # same number of ranks: each resumes its streams
            set_rng_state(rng[self.global_rank])
        return checkpoint

    def _load_checkpoint(self, checkpoint_path: Any, weights_only: Optional[bool]) -> dict[str, Any]:
        path = self.broadcast(str(checkpoint_path))
        self._restored_sharded = is_sharded_checkpoint(path)
        if self._restored_sharded:
            assert self.lightning_module is not None
            return load_sharded(Path(path), self.lightning_module,
                                [torch_optimizer(o) for o in self.optimizers], self.parallel_state.names,
                                self._layout(), lambda p: self._load_file(p, weights_only),
                                strict=self.lightning_module.strict_loading, weights_only=weights_only)
        return self._load_file(checkpoint_path, weights_only)

    def _load_file(self, path: Any, weights_only: Optional[bool]) -> dict[str, Any]:
        """A torch-saved file through the Trainer's ``CheckpointIO``, as safely as plain Lightning loads it (the
        user's ``weights_only``; torch's default, True, when unset)."""
        return load_or_explain(lambda p: self.checkpoint_io.load_checkpoint(p, weights_only=weights_only), path)
