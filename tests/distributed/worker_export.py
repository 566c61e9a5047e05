"""Train a Hugging Face model 2 steps at tp=2 and save a (sharded) checkpoint."""

from __future__ import annotations

import sys

import lightning as L
import torch

from lightning_tpp import TensorPipeStrategy
from models import LitLM, token_dataset

if __name__ == "__main__":
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TensorPipeStrategy(tp=2), max_steps=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(LitLM("hf_llama"), torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    trainer.save_checkpoint(sys.argv[1])
