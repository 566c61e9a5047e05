"""Random draws under a pipeline (see test_rng.py): a step that draws before and after its forward, blocks with
dropout; every schedule in one launch.

    python worker_rng.py OUT
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from models import SEQ, VOCAB, token_dataset

SCHEDULES = [("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1)]


class Dropping(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.5)) for _ in range(4)])
        self.head = nn.Linear(32, VOCAB)
        self.draws: list[torch.Tensor] = []

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx)
        for block in self.blocks:
            x = x + block(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        # a BERT-style mask drawn in the step: it hides input tokens (first stage) and selects the loss (last stage)
        masked = torch.rand(y.shape) < 0.25
        self.draws.append(masked.flatten().float())  # every stage runs the step up to its own last layer
        logits = self(x.masked_fill(masked, 0))
        noise = 0.01 * torch.rand(())  # drawn after the forward (the last stage): after other stages' dropout ran
        per_token = F.cross_entropy(logits.flatten(0, 1), y.flatten(), reduction="none")
        return (per_token * masked.flatten()).sum() / masked.sum() + noise

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def main() -> None:
    from lightning_tpp import TensorPipeStrategy

    out, rank = Path(sys.argv[1]), int(os.environ["LOCAL_RANK"])
    results = {}
    for schedule, virtual in SCHEDULES:
        L.seed_everything(0, verbose=False)
        module = Dropping()
        losses: list[float] = []

        class Record(L.Callback):
            def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
                losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))

        strategy = TensorPipeStrategy(pp=2, schedule=schedule, virtual_stages=virtual, microbatches=4,
                                      print_plan=False)
        trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                            use_distributed_sampler=False, callbacks=[Record()])
        trainer.fit(module, torch.utils.data.DataLoader(token_dataset(24, SEQ), batch_size=8))
        results[schedule] = {"losses": losses, "draws": [d.tolist() for d in module.draws]}
    torch.save(results, out / f"rng.rank{rank}.pt")


if __name__ == "__main__":
    main()
