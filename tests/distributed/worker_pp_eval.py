"""A rank of the micro-batched evaluation runs (see test_pp_eval.py): validate, test and predict of one model from
the same initial weights, either through a pipeline (``pipe``) or in one process (``single``, the reference).

``OUT MODE TP PP VIRTUAL MICROBATCHES``: writes ``OUT/rank{r}.pt`` with what validate/test/predict returned, the
outputs of every step (as Lightning's batch-end hooks see them), the micro-batches each evaluation step ran in, and
the CSVLogger's rows. Then two that the pipeline must run whole: a predict_step whose result cannot be put
together from micro-batches, and a test_step that logs a torchmetrics object on_step. Batches of 8, 8 and 2
samples: 8 is not divisible by 3 micro-batches, 2 is fewer than 3.
"""

from __future__ import annotations

import csv
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
import torchmetrics
from lightning.pytorch.loggers import CSVLogger

from models import VOCAB, LitLM, token_dataset

SAMPLES, BATCH = 18, 8


class EvalLM(LitLM):
    def __init__(self) -> None:
        super().__init__("nanogpt4")
        self.val_mean = torchmetrics.MeanMetric()
        self.test_acc = torchmetrics.classification.MulticlassAccuracy(num_classes=VOCAB, average="micro")

    def _losses(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = batch
        logits = self(x)
        return logits, F.cross_entropy(logits.reshape(-1, VOCAB), y.reshape(-1), reduction="none").view(y.shape)

    def validation_step(self, batch, batch_idx):
        _, losses = self._losses(batch)
        loss = losses.mean()
        self.log("val_loss", loss, sync_dist=True)
        self.log("val_loss_step", loss, on_step=True, on_epoch=False)
        self.log("val_worst", losses.max(), reduce_fx="max", on_step=True, on_epoch=True)
        self.log("val_tokens", float(batch[0].numel()), reduce_fx="sum", on_step=True, on_epoch=False)
        self.val_mean.update(losses.mean(dim=1))
        self.log("val_mean", self.val_mean, on_step=False, on_epoch=True)

    def test_step(self, batch, batch_idx):
        logits, losses = self._losses(batch)
        self.test_acc(logits.argmax(-1), batch[1])  # forward: its value is the step's (on_step)
        step_metric = os.environ.get("STEP_METRIC") == "1"  # its step value: the batch's (runs whole)
        self.log("test_acc" + "_s" * step_metric, self.test_acc, on_step=step_metric, on_epoch=True)
        self.log("test_loss", losses.mean(), on_step=True, on_epoch=True)
        return {"loss": losses.mean(), "per_sample": losses.mean(dim=1), "logits": logits}

    def predict_step(self, batch, batch_idx):
        if os.environ.get("PREDICT") == "odd":  # a 0-dim tensor and a string: cannot be put together
            return {"total": self(batch[0]).sum(), "name": "odd"}
        logits = self(batch[0])
        return {"logits": logits, "top": [logits.argmax(-1), logits.amax(-1)]}


class Record(L.Callback):
    """Every evaluation step's outputs and the micro-batches it ran in (0: no pipeline)."""

    def __init__(self) -> None:
        self.outputs: dict[str, list] = {"validation": [], "test": [], "predict": []}
        self.micro: dict[str, list[int]] = {"validation": [], "test": [], "predict": []}
        self.early: set = set()  # whether receives were posted ahead

    def _record(self, kind: str, trainer, outputs) -> None:
        engine = getattr(trainer.strategy, "_engine", None)
        self.micro[kind].append(engine.executor.eval_microbatches if engine is not None else 0)
        self.early.add(engine.transport.early if engine is not None else None)
        self.outputs[kind].append(outputs)

    @staticmethod
    def _in_order(trainer) -> None:
        if os.environ.get("IN_ORDER") == "1":  # NCCL's way (receives posted when needed, in order), on gloo
            trainer.strategy._engine.transport.early = False

    def on_validation_start(self, trainer, pl_module) -> None:
        self._in_order(trainer)

    def on_test_start(self, trainer, pl_module) -> None:
        self._in_order(trainer)

    def on_predict_start(self, trainer, pl_module) -> None:
        self._in_order(trainer)

    def on_validation_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        if not trainer.sanity_checking:
            self._record("validation", trainer, outputs)

    def on_test_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        self._record("test", trainer, outputs)

    def on_predict_batch_end(self, trainer, pl_module, outputs, *args) -> None:
        self._record("predict", trainer, outputs)


def _rows(path: Path) -> list[dict[str, float]]:
    with open(path / "metrics.csv") as f:
        return [{k: float(v) for k, v in r.items() if v != ""} for r in csv.DictReader(f)]


def main() -> None:
    out, mode = Path(sys.argv[1]), sys.argv[2]
    tp, pp, virtual, microbatches = (int(a) for a in sys.argv[3:7])
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = EvalLM()
    strategy, devices = "auto", 1
    if mode == "pipe":
        from lightning_tpp import TensorPipeStrategy

        strategy = TensorPipeStrategy(tp=tp, pp=pp, microbatches=microbatches, virtual_stages=virtual,
                                      schedule="interleaved-1f1b" if virtual > 1 else "1f1b", print_plan=False)
        devices = tp * pp
    record = Record()
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, logger=CSVLogger(out, name="csv"),
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[record])
    loader = torch.utils.data.DataLoader(token_dataset(SAMPLES, seed=1), batch_size=BATCH)
    result = {"validate": trainer.validate(model, loader, verbose=False),
              "test": trainer.test(model, loader, verbose=False),
              "predict": trainer.predict(model, loader)}
    os.environ["PREDICT"] = "odd"
    result["predict_odd"] = trainer.predict(model, loader)
    result["micro_odd"] = record.micro["predict"][len(result["predict"]):]
    os.environ["STEP_METRIC"] = "1"
    tests = len(record.micro["test"])
    result["test_step_metric"] = trainer.test(model, loader, verbose=False)
    result["micro_step_metric"] = record.micro["test"][tests:]
    result["rows"] = _rows(Path(trainer.logger.log_dir)) if rank == 0 else []  # the logger writes on rank 0
    result["outputs"], result["micro"], result["early"] = record.outputs, record.micro, record.early
    torch.save(result, out / f"rank{rank}.pt")


if __name__ == "__main__":
    main()
