"""A rank of the pipeline plumbing run (pp=2 x dp=2, or tp=2 x pp=2): logging, metrics, callbacks,
validate/test/predict and checkpoints through the pipeline."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint, ModelSummary

from lightning_tpp import TensorPipeStrategy
from models import VOCAB, LitLM, token_dataset
from worker_plumbing import summary_rows


class PipeLM(LitLM):
    def __init__(self) -> None:
        super().__init__("nanogpt4")
        self.train_acc = torchmetrics.MeanMetric()
        self.seen = torchmetrics.SumMetric()

    def training_step(self, batch, batch_idx):
        x, y = batch
        logits = self(x)
        loss = F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1))
        self.train_acc.update((logits.argmax(-1) == y).float().mean())
        self.log("train_loss", loss, prog_bar=True)
        self.log("train_acc", self.train_acc, on_step=True, on_epoch=True)
        self.log("tokens", float(x.numel()), reduce_fx="sum")
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)), sync_dist=True)
        self.seen.update(torch.tensor(float(x.shape[0])))
        self.log("val_samples", self.seen, on_step=False, on_epoch=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)), sync_dist=True)


def main() -> None:
    out, tp, pp, dp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    rank = int(os.environ["LOCAL_RANK"])
    L.seed_everything(0, verbose=False)
    model = PipeLM()
    train = torch.utils.data.DataLoader(token_dataset(32), batch_size=4)
    val = torch.utils.data.DataLoader(token_dataset(24, seed=1), batch_size=4)
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", save_last=True)
    summary = ModelSummary()
    strategy = TensorPipeStrategy(tp=tp, pp=pp, microbatches=2, schedule="1f1b")
    trainer = L.Trainer(accelerator="cpu", devices=tp * pp * dp, strategy=strategy, max_steps=4,
                        val_check_interval=2, num_sanity_val_steps=1, logger=False, enable_progress_bar=False,
                        callbacks=[ckpt, summary, EarlyStopping(monitor="val_loss", patience=100)])
    trainer.fit(model, train, val)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    result = {
        "fit_metrics": fit_metrics,
        "validate": trainer.validate(model, val, verbose=False),
        "test": trainer.test(model, val, verbose=False),
        "preds": trainer.predict(model, val),
        "summary_total": summary._summary(trainer, model).total_parameters,
        "summary_rows": summary_rows(summary, trainer, model),
        "last": ckpt.last_model_path,
        "state_keys": sorted(model.state_dict()),
    }
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
