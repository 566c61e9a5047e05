"""Notebook-style launch: one Python process, the strategy spawns the ranks; whole weights come back."""

from __future__ import annotations

import sys

import lightning as L
import torch

from lightning_tpp import TensorPipeStrategy
from models import LitLM, token_dataset


def main() -> None:
    L.seed_everything(0, verbose=False)
    model = LitLM("nanogpt")
    shapes = {n: p.shape for n, p in model.state_dict().items()}
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TensorPipeStrategy(tp=2, start_method=sys.argv[1]),
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(model, torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    after = {n: p.shape for n, p in model.state_dict().items()}
    assert after == shapes, {n: (shapes[n], after[n]) for n in shapes if shapes[n] != after[n]}
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    plan = trainer.strategy.plan  # rank 0's plan, handed back to this process (a notebook reads it here)
    assert plan.styles.get("model.lm_head") == "colwise_gather" and plan.blocks, plan
    print("SPAWN-OK", float(trainer.callback_metrics["train_loss"]))


if __name__ == "__main__":
    main()
