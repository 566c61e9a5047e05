"""A rank of test_compile's epoch run: ``OUT TP``: Hugging Face Llama at tp=``TP``, trained for two epochs of three
batches (6, 6 and a short last batch of 3 samples) with a validation pass of two batches (6, 3) after each, then
``predict`` over the validation set: once eagerly, once with ``compile=`` (aot_eager). Writes to ``OUT/rank{r}.json``
each run's per-batch losses, validation losses and predictions' digest, and, compiled, the graphs dynamo compiled in
each batch of each phase."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import lightning as L
import torch

from lightning_tpp import TensorPipeStrategy
from lightning_tpp.integration.compile_metrics import dynamo_counts
from models import LitLM, token_dataset

out, tp = sys.argv[1], int(sys.argv[2])


class Counts(L.Callback):
    """Graphs compiled in each batch, by phase (``train``, ``val``, ``predict``) and epoch; the losses."""

    def __init__(self) -> None:
        self.graphs: list[tuple[str, int, int, int]] = []  # (phase, epoch, batch, graphs compiled in it)
        self.losses: list[float] = []
        self.val: list[float] = []
        self._at = 0

    def _start(self) -> None:
        self._at = dynamo_counts()[0]

    def _end(self, phase: str, trainer: L.Trainer, batch_idx: int) -> None:
        self.graphs.append((phase, trainer.current_epoch, batch_idx, dynamo_counts()[0] - self._at))

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:
        self._end("train", trainer, batch_idx)
        self.losses.append(float(outputs["loss"]))

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start()

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                                batch_idx: int, dataloader_idx: int = 0) -> None:
        self._end("val", trainer, batch_idx)

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.val.append(float(trainer.callback_metrics["val_loss"]))

    def on_predict_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        self._start()

    def on_predict_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any,
                             batch_idx: int, dataloader_idx: int = 0) -> None:
        self._end("predict", trainer, batch_idx)


def run(compile_: bool) -> dict:
    L.seed_everything(0, verbose=False)
    module = LitLM("hf_llama")
    counts = Counts()
    strategy = TensorPipeStrategy(tp=tp, compile={"backend": "aot_eager"} if compile_ else False, print_plan=False)
    trainer = L.Trainer(accelerator="cpu", devices=tp, strategy=strategy, max_epochs=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=[counts], use_distributed_sampler=False)
    train = torch.utils.data.DataLoader(token_dataset(15), batch_size=6)
    val = torch.utils.data.DataLoader(token_dataset(9, seed=1), batch_size=6)
    trainer.fit(module, train, val)
    predicted = trainer.predict(module, val)
    return {"losses": counts.losses, "val": counts.val, "graphs": counts.graphs,
            "predicted": [p.tolist() for p in predicted],
            "recompiles": strategy._compiled.recompiles if strategy._compiled is not None else None}


record = {"eager": run(False), "compiled": run(True)}
with open(os.path.join(out, f"rank{int(os.environ['LOCAL_RANK'])}.json"), "w") as f:
    json.dump(record, f)
