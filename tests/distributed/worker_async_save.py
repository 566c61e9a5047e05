"""Asynchronous checkpoints at tp2 or dp2 (FSDP2-sharded; 2 ranks; every replica reads every batch); see
test_async_save.py.

    python worker_async_save.py OUT parity [tp2|dp2]
        6 steps, ModelCheckpoint at the end of epochs 1 and 2 (steps 3 and 6) with async_save (training goes on
        while the first is written), then the same with synchronous saves; each resumed from its step-3 save
    python worker_async_save.py OUT error
        AsyncSaver alone: rank 1's background write fails; every rank's wait() must raise the same
        AsyncCheckpointError
"""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.distributed as dist
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from lightning.pytorch.callbacks import ModelCheckpoint

RANK = int(os.environ.get("LOCAL_RANK", "0"))
REAL_WRITE = dcp_filesystem._write_item


class Losses(L.Callback):
    """Records the losses; ``advanced`` is set once training is two steps past the first save (step 3)."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.advanced = threading.Event()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.losses.append(float(outputs["loss"]))
        if trainer.global_step >= 5:
            self.advanced.set()


def hold_writes_until(advanced: threading.Event, held: list[bool]) -> None:
    """Background writes start only after the step has changed the parameters twice more (the test's point: the
    shards must have been copied at the save, not read from the live tensors when written)."""
    real_write = dcp_filesystem._write_item

    def held_write(*args, **kwargs):
        if not advanced.is_set():
            held.append(True)
            assert threading.current_thread() is not threading.main_thread(), "the write must be in the background"
            advanced.wait(timeout=120)
        return real_write(*args, **kwargs)

    dcp_filesystem._write_item = held_write


def _fit(out: Path, *, async_save: bool, steps: int, ckpt_path: Path | None, save: Optional[Path],
         layout: str) -> list[float]:
    from lightning_tpp import TensorPipeStrategy
    from models import LitLM, token_dataset

    L.seed_everything(0, verbose=False)
    losses = Losses()
    held: list[bool] = []
    if async_save and save is not None:
        hold_writes_until(losses.advanced, held)
    every_epoch = ModelCheckpoint(save, filename="step{step}", every_n_epochs=1, save_top_k=-1,
                                  save_on_train_epoch_end=True, auto_insert_metric_name=False)
    callbacks = [losses, every_epoch] if save is not None else [losses]
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TensorPipeStrategy(
        tp=2 if layout == "tp2" else 1, dp="auto", print_plan=False, async_save=async_save), max_steps=steps, logger=False, enable_checkpointing=save is not None,
        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks,
        use_distributed_sampler=False)
    trainer.fit(LitLM("nanogpt4", lr=0.05), torch.utils.data.DataLoader(token_dataset(12), batch_size=4),
                ckpt_path=ckpt_path)
    dcp_filesystem._write_item = REAL_WRITE
    if async_save and save is not None and not held:
        raise AssertionError("no background write waited for training to go on: the test would prove nothing")
    return losses.losses


def parity(out: Path, layout: str) -> None:
    """The same run with asynchronous and with synchronous saves; each resumed from its step-3 checkpoint."""
    losses = {}
    for name, async_save in (("async", True), ("sync", False)):
        losses[name] = _fit(out, async_save=async_save, steps=6, ckpt_path=None, save=out / name, layout=layout)
        losses[f"{name}-resumed"] = _fit(out, async_save=async_save, steps=6, ckpt_path=out / name / "step3.ckpt",
                                         save=None, layout=layout)
    torch.save(losses, out / f"losses.rank{RANK}.pt")


def error(out: Path, layout: str) -> None:
    """A save that succeeds removes the older checkpoint handed to after_publish once published; then rank 1's
    write fails: every rank raises the same error at wait(), and the older checkpoint is kept."""
    from datetime import timedelta

    from lightning_tpp import AsyncCheckpointError
    from lightning_tpp.checkpoint.async_save import AsyncSaver

    dist.init_process_group("gloo")
    saver = AsyncSaver(timedelta(seconds=30))
    path = out / "run.ckpt"
    tmp = path.with_name(".run.ckpt.partial")
    older = [out / "older1.ckpt", out / "older2.ckpt"]
    if RANK == 0:
        for folder in older:
            folder.mkdir()
    dist.barrier()
    def remove(folder: Path) -> None:  # as Strategy.remove_checkpoint: rank 0 removes (renamed here, to be seen)
        if RANK == 0:
            folder.rename(folder.with_suffix(".removed"))

    for attempt, folder in enumerate(older):
        if attempt == 1 and RANK == 1:
            def full_disk(*args, **kwargs):
                raise OSError(28, "No space left on device (injected)")

            dcp_filesystem._write_item = full_disk
        saver.save({f"w{RANK}": torch.ones(4)}, tmp, path, {"meta": attempt} if RANK == 0 else None)  # one entry
        # per rank: DCP writes a replicated entry once
        saver.after_publish(lambda: remove(folder))
        try:
            saver.wait(2)
            message = "no error"
        except AsyncCheckpointError as err:
            message = str(err)
        (out / f"error{attempt}.rank{RANK}.txt").write_text(message)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    {"parity": parity, "error": error}[sys.argv[2]](Path(sys.argv[1]), sys.argv[3] if len(sys.argv) > 3 else "tp2")
