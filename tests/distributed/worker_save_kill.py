"""Save a whole-model checkpoint file, then die (SIGKILL) halfway through writing the next one to the same path."""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch

import lightning_tpp._checkpoint as ckpt_module
from lightning_tpp import TensorPipeStrategy
from models import LitLM, token_dataset


def main() -> None:
    path = Path(sys.argv[1])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TensorPipeStrategy(
        tp=2, timeout=timedelta(seconds=20), save_distributed_checkpoint=False),
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    model = LitLM("nanogpt")
    trainer.fit(model, torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    trainer.save_checkpoint(path)  # complete, global_step 2
    real_save = torch.save

    def dying_save(obj, f, *args, **kwargs):
        real_save(obj, f, *args, **kwargs)
        f.truncate(f.tell() // 2)  # half written ...
        f.flush()
        os.kill(os.getpid(), signal.SIGKILL)  # ... and the writer is gone

    ckpt_module.torch.save = dying_save  # type: ignore[attr-defined]
    trainer.fit_loop.epoch_loop._batches_that_stepped = 99  # the next checkpoint would differ
    trainer.save_checkpoint(path)


if __name__ == "__main__":
    main()
