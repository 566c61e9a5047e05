"""Save a checkpoint, or resume from one that may have been tampered with; see test_checkpoint_security.py.

    python worker_security.py save   CKPT TP PP sharded|whole [configured]
    python worker_security.py resume CKPT TP PP default|trust [configured]   # raises if the checkpoint is refused
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch

from lightning_tpp import TensorPipeStrategy
from models import LitLM, token_dataset


@dataclass
class RunConfig:
    """A hyper-parameter of the user's own class: weights_only loading does not know it."""

    width: int = 32


class Configured(LitLM):
    def __init__(self, config: RunConfig) -> None:
        super().__init__("nanogpt4")
        self.save_hyperparameters()


def main() -> None:
    mode, ckpt, tp, pp, how = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]
    configured = len(sys.argv) > 6
    L.seed_everything(0, verbose=False)
    module = Configured(RunConfig()) if configured else LitLM("nanogpt4")
    trainer = L.Trainer(accelerator="cpu", devices=tp * pp, max_steps=2 if mode == "save" else 3, logger=False,
                        strategy=TensorPipeStrategy(tp=tp, pp=pp, microbatches=2, print_plan=False,
                                                    timeout=timedelta(seconds=20),
                                                    save_distributed_checkpoint=how == "sharded"),
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    loader = torch.utils.data.DataLoader(token_dataset(12), batch_size=4)
    if mode == "save":
        trainer.fit(module, loader)
        trainer.save_checkpoint(ckpt)
    else:
        trainer.fit(module, loader, ckpt_path=ckpt, weights_only=False if how == "trust" else None)
        print(f"resumed at step {trainer.global_step}")


if __name__ == "__main__":
    main()
