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


class Record(L.Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.losses.append(float(trainer.strategy.reduce(outputs["loss"].detach(), reduce_op="mean")))


def fit(steps: int, schedule: str = "1f1b", virtual: int = 1, *, resume: Path | None = None,
        save: Path | None = None) -> tuple[Dropping, list[float]]:
    from lightning_tpp import TensorPipeStrategy

    L.seed_everything(0, verbose=False)
    module, record = Dropping(), Record()
    strategy = TensorPipeStrategy(pp=2, schedule=schedule, virtual_stages=virtual, microbatches=4, print_plan=False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=steps, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[record])
    # Lightning's loop, resumed from a checkpoint saved when max_steps ended the fit, starts its iterators at other
    # batches and times than the uninterrupted run: two equal batches an epoch, and the loader's own generator (an
    # iterator's start draws a seed from the global one otherwise), leave only the random draws to compare
    x, y = token_dataset(8, SEQ).tensors
    data = torch.utils.data.TensorDataset(torch.cat([x, x]), torch.cat([y, y]))
    loader = torch.utils.data.DataLoader(data, batch_size=8, generator=torch.Generator())
    trainer.fit(module, loader, ckpt_path=resume)
    if save is not None:
        trainer.save_checkpoint(save)
    return module, record.losses


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["LOCAL_RANK"])
    results = {}
    for schedule, virtual in SCHEDULES:
        module, losses = fit(3, schedule, virtual)
        results[schedule] = {"losses": losses, "draws": [d.tolist() for d in module.draws]}
    # across a resume: steps 3-4 of a run saved after step 2 and resumed draw what the uninterrupted run drew
    results["whole"] = fit(4)[1]
    fit(2, save=out / "rng.ckpt")
    results["resumed"] = fit(4, resume=out / "rng.ckpt")[1]
    torch.save(results, out / f"rng.rank{rank}.pt")


if __name__ == "__main__":
    main()
