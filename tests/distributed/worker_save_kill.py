"""Save a checkpoint, then die (SIGKILL) at one point of writing the next one to the same path; see
test_checkpoint_safety.py.

    python worker_save_kill.py PATH file           # whole-model file, the writer killed halfway through the file
    python worker_save_kill.py PATH POINT          # sharded (DCP folder); POINT is where a rank dies:
        shards        rank 0 while the shards are written (after its first tensor)
        shards-rank1  rank 1, likewise
        written       rank 0 after every shard and .metadata are written, before meta.pt
        meta          rank 0 after meta.pt, before the folder is published
        publish       rank 0 during publishing: after the swap, while the previous folder is removed
    python worker_save_kill.py PATH async-POINT    # async_save=True: saves at steps 2 and 3 of a 4-step fit; the
                                                   # step-3 save dies at POINT in its background write while step 4
                                                   # trains (written: before meta.pt; meta: before the publish)
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_filesystem

import lightning_tpp.checkpoint.async_save as async_module
import lightning_tpp.checkpoint.dcp as dcp_module
import lightning_tpp.checkpoint.files as files_module
from lightning_tpp import TensorPipeStrategy
from models import LitLM, token_dataset

RANK = int(os.environ.get("LOCAL_RANK", "0"))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def inject(point: str) -> None:
    if point.startswith("async-"):
        point = point[len("async-"):]
        if point == "written" and RANK == 0:
            async_module.atomic_save = lambda *args: die()
            return
        if point == "meta" and RANK == 0:
            async_module.publish = lambda *args: die()
            return
    if point == "file":
        real_save = torch.save

        def dying_save(obj, f, *args, **kwargs):
            real_save(obj, f, *args, **kwargs)
            f.truncate(f.tell() // 2)  # half written ...
            f.flush()
            die()  # ... and the writer is gone

        files_module.torch.save = dying_save  # type: ignore[attr-defined]
    elif point in ("shards", "shards-rank1") and RANK == (1 if point == "shards-rank1" else 0):
        real_write = dcp_filesystem._write_item

        def dying_write(*args, **kwargs):
            out = real_write(*args, **kwargs)
            die()
            return out

        dcp_filesystem._write_item = dying_write
    elif point == "written" and RANK == 0:
        real_dcp_save = dcp.save

        def save_then_die(*args, **kwargs):
            real_dcp_save(*args, **kwargs)
            die()

        dcp.save = save_then_die
    elif point == "meta" and RANK == 0:
        dcp_module.publish = lambda *args: die()
    elif point == "publish" and RANK == 0:
        real_remove = files_module._remove

        def remove_then_die(path: Path) -> None:
            for child in list(path.iterdir())[:2]:  # half removed ...
                real_remove(child)
            die()

        files_module._remove = remove_then_die


class SaveThenDie(L.Callback):
    """Saves at step 2 (complete), then at step 3 with the fault planted; step 4 trains during the write."""

    def __init__(self, path: Path, point: str) -> None:
        self.path, self.point = path, point

    def on_train_batch_end(self, trainer: L.Trainer, *args) -> None:
        if trainer.global_step == 2:
            trainer.save_checkpoint(self.path)
        elif trainer.global_step == 3:
            trainer.strategy.wait_for_checkpoint()  # the step-2 save is published before the fault is planted
            inject(self.point)
            trainer.save_checkpoint(self.path)


def main_async(path: Path, point: str) -> None:
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TensorPipeStrategy(
        tp=2, timeout=timedelta(seconds=20), async_save=True, print_plan=False), max_steps=4, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, callbacks=[SaveThenDie(path, point)])
    trainer.fit(LitLM("nanogpt"), torch.utils.data.DataLoader(token_dataset(16), batch_size=4))


def main() -> None:
    path, point = Path(sys.argv[1]), sys.argv[2]
    if point.startswith("async-"):
        return main_async(path, point)
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TensorPipeStrategy(
        tp=2, timeout=timedelta(seconds=20), save_distributed_checkpoint=point != "file", print_plan=False),
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    model = LitLM("nanogpt")
    trainer.fit(model, torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    trainer.save_checkpoint(path)  # complete, 2 batches stepped
    inject(point)
    trainer.fit_loop.epoch_loop._batches_that_stepped = 99  # the next checkpoint would differ
    trainer.save_checkpoint(path)


if __name__ == "__main__":
    main()
