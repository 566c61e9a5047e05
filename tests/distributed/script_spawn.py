"""Notebook-style launch: one Python process, the strategy spawns the ranks; whole weights come back, equal to what
one process trains from the same weights and batches (not only their shapes)."""

from __future__ import annotations

import copy
import sys

import lightning as L
import torch

from lightning_tpp import TensorPipeStrategy
from models import LitLM, token_dataset


def main() -> None:
    L.seed_everything(0, verbose=False)
    model = LitLM("nanogpt")
    before = {n: t.clone() for n, t in model.state_dict().items()}
    reference = copy.deepcopy(model)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TensorPipeStrategy(tp=2, start_method=sys.argv[1]),
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        use_distributed_sampler=False)  # dp=1: both ranks read the batches one process reads
    trainer.fit(model, torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    after = model.state_dict()
    shapes = {n: (before[n].shape, after[n].shape) for n in before if before[n].shape != after[n].shape}
    assert not shapes and after.keys() == before.keys(), shapes
    assert any(not torch.equal(before[n], after[n]) for n in before), "the weights that came back never trained"
    L.seed_everything(0, verbose=False)
    L.Trainer(accelerator="cpu", devices=1, max_steps=2, logger=False, enable_checkpointing=False,
              enable_progress_bar=False, enable_model_summary=False).fit(
        reference, torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    for name, want in reference.state_dict().items():
        torch.testing.assert_close(after[name], want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    assert torch.isfinite(trainer.callback_metrics["train_loss"])
    plan = trainer.strategy.plan  # rank 0's plan, handed back to this process (a notebook reads it here)
    assert plan.styles.get("model.lm_head") == "colwise_gather" and plan.blocks, plan
    print("SPAWN-OK", float(trainer.callback_metrics["train_loss"]))


if __name__ == "__main__":
    main()
