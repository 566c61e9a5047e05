"""A rank of the Lightning-plumbing run: logging, metrics, callbacks, validate/test/predict, checkpoints."""

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


class PlumbingLM(LitLM):
    def __init__(self) -> None:
        super().__init__("nanogpt")
        self.seen = torchmetrics.SumMetric()

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))
        self.log("val_loss", loss, sync_dist=True)
        self.seen.update(torch.tensor(float(x.shape[0])))
        self.log("val_samples", self.seen, on_step=False, on_epoch=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1)), sync_dist=True)

    def on_train_start(self) -> None:
        self.gathered = self.all_gather(torch.tensor([float(self.global_rank)]))


def summary_rows(callback: ModelSummary, trainer: L.Trainer, model: L.LightningModule) -> dict[int, list]:
    """(name, type, parameters) of each row of the user's summary callback, at depth 1 and at every depth."""
    rows = {}
    for depth in (1, -1):
        callback._max_depth = depth
        s = callback._summary(trainer, model)
        rows[depth] = list(zip(s.layer_names, s.layer_types, s.param_nums))
    callback._max_depth = 1
    return rows


def main() -> None:
    out = Path(sys.argv[1])
    rank = int(os.environ["LOCAL_RANK"])
    L.seed_everything(0, verbose=False)
    model = PlumbingLM()
    train = torch.utils.data.DataLoader(token_dataset(32), batch_size=4)
    val = torch.utils.data.DataLoader(token_dataset(24, seed=1), batch_size=4)
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", monitor="val_loss", save_last=True)
    summary = ModelSummary()
    trainer = L.Trainer(accelerator="cpu", devices=4, strategy=TensorPipeStrategy(tp=2), max_steps=4,
                        val_check_interval=2, num_sanity_val_steps=1, logger=False, enable_progress_bar=False,
                        callbacks=[ckpt, summary, EarlyStopping(monitor="val_loss", patience=100)])
    trainer.fit(model, train, val)
    fit_metrics = {k: float(v) for k, v in trainer.callback_metrics.items()}
    val_res = trainer.validate(model, val, verbose=False)
    test_res = trainer.test(model, val, verbose=False)
    preds = trainer.predict(model, val)
    result = {
        "fit_metrics": fit_metrics,
        "validate": val_res,
        "test": test_res,
        "pred0": preds[0],
        "n_preds": len(preds),
        "gathered": model.gathered,
        "summary_total": summary._summary(trainer, model).total_parameters,
        "summary_rows": summary_rows(summary, trainer, model),
        "best": ckpt.best_model_path,
        "tied": model.model.transformer.wte.weight is model.model.lm_head.weight,
        "wte_local_shape": tuple(model.model.transformer.wte.weight.shape),
        "last": ckpt.last_model_path,
        "strategy_registered": type(L.Trainer(strategy="tensor_pipe", accelerator="cpu", devices=1,
                                              logger=False).strategy).__name__,
    }
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
