"""A rank of a run into which a fault is injected (scenario in argv[1]); see test_faults.py."""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_tpp import TensorPipeStrategy
from lightning_tpp.core.dp_shard import gather_dp
from models import LitLM, token_dataset

RANK = int(os.environ.get("LOCAL_RANK", "0"))
OUT = Path(sys.argv[2]) if len(sys.argv) > 2 else Path(".")


class ParamSums(L.Callback):
    """This rank's sum of its parameters' absolute values after each training batch (which batch changed nothing)."""

    def __init__(self) -> None:
        self.sums: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        self.sums.append(sum(float(gather_dp(p.detach()).abs().sum()) for p in pl_module.parameters()))


class Faulty(LitLM):
    def __init__(self, scenario: str) -> None:
        super().__init__("nanogpt")
        self.scenario = scenario

    def training_step(self, batch, batch_idx):
        if batch_idx == 2 and self.scenario in ("raise_tp", "raise_pp", "kill", "kill_pp", "kill0"):
            (OUT / f"fault.rank{RANK}").write_text(repr(time.time()))  # when it struck: every rank must stop soon
        if batch_idx == 2 and RANK == 1:
            if self.scenario in ("raise_tp", "raise_pp"):
                raise RuntimeError("injected failure in training_step")
            if self.scenario in ("kill", "kill_pp"):
                os.kill(os.getpid(), signal.SIGKILL)
        if batch_idx == 2 and RANK == 0 and self.scenario == "kill0":  # the host of the rendezvous store
            os.kill(os.getpid(), signal.SIGKILL)
        loss = super().training_step(batch, batch_idx)
        if self.scenario.startswith("nan") and batch_idx == 2 and RANK == 1:
            loss = loss * float("nan")
        return loss


class ManualFaulty(Faulty):
    """Manual optimization: the NaN loss meets manual_backward before opt.step()."""

    def __init__(self, scenario: str) -> None:
        super().__init__(scenario)
        self.automatic_optimization = False

    def training_step(self, batch, batch_idx):
        opt = self.optimizers()
        loss = super().training_step(batch, batch_idx)
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return loss


def main() -> None:
    scenario, out = sys.argv[1], Path(sys.argv[2])
    kwargs = dict(timeout=timedelta(seconds=8))
    if scenario in ("raise_pp", "kill_pp"):
        kwargs.update(pp=2, microbatches=2)
    elif scenario in ("raise_tp", "kill", "kill0"):
        kwargs.update(tp=2)
    elif scenario.startswith("nan"):
        kwargs.update(on_nonfinite=scenario.split("_")[1])  # dp=2
        if scenario.endswith("_replicated"):
            kwargs.update(dp_sharding="no_shard")
    elif scenario == "disagree":
        kwargs.update(tp=2, tp_plan={"*.mlp": "replicate"} if RANK == 1 else "auto")
    L.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=out / "ckpt", save_last=True, every_n_train_steps=1)
    sums = ParamSums()
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=TensorPipeStrategy(**kwargs), max_steps=5,
                        logger=False, enable_progress_bar=False, callbacks=[ckpt, sums])
    model = ManualFaulty(scenario) if scenario.endswith("_manual") else Faulty(scenario)
    trainer.fit(model, torch.utils.data.DataLoader(token_dataset(40), batch_size=4))
    params = {n: gather_dp(p.detach()).clone() for n, p in model.named_parameters()}  # whole, if dp-sharded
    torch.save({"params": params, "step": trainer.global_step, "sums": sums.sums}, out / f"done.rank{RANK}.pt")


if __name__ == "__main__":
    main()
