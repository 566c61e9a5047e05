"""Save a checkpoint, then die (SIGKILL) at one point of writing the next one to the same path; see
test_checkpoint_safety.py.

    python worker_save_kill.py PATH file           # whole-model file, the writer killed halfway through the file
    python worker_save_kill.py PATH POINT          # sharded (DCP folder); POINT is where a rank dies:
        shards        rank 0 while the shards are written (after its first tensor)
        shards-rank1  rank 1, likewise
        written       rank 0 after every shard and .metadata are written, before meta.pt
        meta          rank 0 after meta.pt, before the folder is published
        publish       rank 0 during publishing: after the swap, while the previous folder is removed
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

import lightning_tpp.checkpoint.dcp as dcp_module
import lightning_tpp.checkpoint.files as files_module
from lightning_tpp import TensorPipeStrategy
from models import LitLM, token_dataset

RANK = int(os.environ.get("LOCAL_RANK", "0"))


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def inject(point: str) -> None:
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


def main() -> None:
    path, point = Path(sys.argv[1]), sys.argv[2]
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
