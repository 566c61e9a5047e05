"""A rank of the pipeline observability runs (see test_pipeline_metrics.py).

``schedules OUT [--pp P --microbatches M --seconds T]``: stages of controlled cost, made of sleeps so that other
work on the machine does not change them: per micro-batch and pipeline rank the forward takes T, the input gradient
T and the weight gradient T (a backward 2T), whatever the schedule; each schedule trains a few steps with a
CSVLogger and a PipelineTimeline, and rank 0 writes the costs each step gave the simulator for
``pipeline/bubble_theory`` to ``OUT/SCHEDULE/simulator_costs.json``. Then ``hang``: rank 1 stops for a few
seconds before a send and sends SIGUSR1 to rank 0, which must report where it waits; then ``stop``: rank 1 raises
there, and the failure watch stops rank 0, which reports the same. ``tp2pp2 OUT``: a GPT at tp=2 x pp=2 with a
CSVLogger and a PipelineTimeline.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import time
from datetime import timedelta
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.loggers import CSVLogger
from torch import nn

from lightning_tpp import PipelineTimeline, TensorPipeStrategy
from lightning_tpp.pipeline import metrics, wgrad

RANK = int(os.environ.get("LOCAL_RANK", "0"))
WIDTH = 4
STATE = {"step": -1, "scenario": "", "done": False}  # the current global step, and the fault scenario running

# The weight gradient of a product deferred to W is accumulated by wgrad._accumulate: a marked weight sleeps there,
# so that W takes a controlled time; in a whole backward its gradient hook sleeps as long.
_accumulate = wgrad._accumulate


def _sleepy_accumulate(param: torch.Tensor, grad: torch.Tensor) -> None:
    time.sleep(getattr(param, "sleep_in_w", 0.0))
    _accumulate(param, grad)


wgrad._accumulate = _sleepy_accumulate

# The costs each logging step hands the simulator for pipeline/bubble_theory (relative to a forward, from every
# rank's measured actions), kept so that the test can run the simulator on them itself.
COSTS: list[dict[str, float]] = []
_simulator_costs = metrics.simulator_costs


def _recorded_simulator_costs(rows: list[list[float]]) -> dict[str, float]:
    costs = _simulator_costs(rows)
    COSTS.append(dict(costs))
    return costs


metrics.simulator_costs = _recorded_simulator_costs


def _sleep_if(condition: bool, seconds: float) -> None:
    if condition:
        time.sleep(seconds)


class Sleep(torch.autograd.Function):
    """Identity whose forward and input gradient each sleep ``seconds``."""

    @staticmethod
    def forward(ctx, x, seconds):  # type: ignore[override]
        ctx.seconds = seconds
        time.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        time.sleep(ctx.seconds)
        return grad, None


class Block(nn.Module):
    def __init__(self, index: int, seconds: float) -> None:
        super().__init__()
        self.index, self.seconds = index, seconds
        self.weight = nn.Parameter(torch.eye(WIDTH))
        self.weight.sleep_in_w = seconds
        self.weight.register_hook(lambda g: _sleep_if(g is not None, seconds))  # None: a deferred weight gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 2 and RANK == 1 and STATE["step"] == 1 and not STATE["done"]:
            self._fault()
        return Sleep.apply(x, self.seconds) + 0.0 * F.linear(x, self.weight)

    @staticmethod
    def _fault() -> None:
        """Rank 1, before its first send of step 1 (the forward of micro-batch 0 on stage 1), while rank 0 waits for
        the gradients of that micro-batch."""
        if STATE["scenario"] == "hang":
            STATE["done"] = True
            time.sleep(2.0)
            os.kill(int(Path(os.environ["TPP_PID0"]).read_text()), signal.SIGUSR1)
            time.sleep(3.0)
        elif STATE["scenario"] == "stop":
            time.sleep(1.0)
            raise RuntimeError("injected failure before a send")


class Blocks(L.LightningModule):
    def __init__(self, n: int, seconds: float) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Block(i, seconds) for i in range(n)])
        self.scale = nn.Parameter(torch.ones(()))  # so that the first block's input needs a gradient too

    def training_step(self, batch, batch_idx):
        x = batch[0] * self.scale
        for block in self.blocks:
            x = block(x)
        loss = F.mse_loss(x, torch.zeros_like(x))
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.0)


class Step(L.Callback):
    def on_train_batch_start(self, trainer, *args) -> None:
        STATE["step"] = trainer.global_step


def fit(model: L.LightningModule, strategy: TensorPipeStrategy, data, out: Path, name: str, *, devices: int,
        steps: int, timeline: list[int], batch_size: int, png: bool = True) -> None:
    callbacks = [Step(), PipelineTimeline(out / name, steps=timeline, png=png)] if timeline else [Step()]
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps,
                        logger=CSVLogger(out, name=name, version=0), log_every_n_steps=1,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks)
    trainer.fit(model, torch.utils.data.DataLoader(data, batch_size=batch_size))


def schedules(args: argparse.Namespace) -> None:
    m, pp = args.microbatches, args.pp
    data = torch.utils.data.TensorDataset(torch.randn(m * 8, WIDTH))
    for schedule in args.schedules.split(","):
        STATE["scenario"] = ""
        virtual = 2 if schedule == "interleaved-1f1b" else 1
        strategy = TensorPipeStrategy(pp=pp, microbatches=m, schedule=schedule, virtual_stages=virtual,
                                      print_plan=False)
        COSTS.clear()
        # two blocks per rank, each taking half of the rank's time per micro-batch
        fit(Blocks(2 * pp, args.seconds / 2), strategy, data, args.out, schedule, devices=pp, steps=args.steps,
            timeline=[args.steps - 1], batch_size=m, png=args.png or schedule == "1f1b")
        if RANK == 0:
            (args.out / schedule / "simulator_costs.json").write_text(json.dumps(COSTS))
    if pp != 2 or not args.faults:
        return
    for scenario in ("hang", "stop"):  # the last one ends the processes; no timeline (rank 0 must be in step 1)
        STATE.update(scenario=scenario, done=False)
        strategy = TensorPipeStrategy(pp=2, microbatches=m, schedule="1f1b", print_plan=False,
                                      timeout=timedelta(seconds=20))
        fit(Blocks(4, args.seconds / 2), strategy, data, args.out, scenario, devices=2, steps=2, timeline=[],
            batch_size=m)


def tp2pp2(args: argparse.Namespace) -> None:
    from models import LitLM, token_dataset

    strategy = TensorPipeStrategy(tp=2, pp=2, microbatches=4, schedule="1f1b", print_plan=False)
    fit(LitLM("nanogpt"), strategy, token_dataset(32), args.out, "tp2pp2", devices=4, steps=args.steps,
        timeline=[args.steps - 1], batch_size=8)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["schedules", "tp2pp2"])
    parser.add_argument("out", type=Path)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=4)
    parser.add_argument("--seconds", type=float, default=0.1, help="forward time per micro-batch and rank")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--schedules", default="gpipe,1f1b,interleaved-1f1b,zero-bubble,zb-drain,zb-lead")
    parser.add_argument("--faults", action="store_true", help="then the hang and stop scenarios")
    parser.add_argument("--png", action="store_true", help="timeline.png for every schedule (else 1f1b's only)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    args.out.mkdir(parents=True, exist_ok=True)  # every rank: none may fail alone before the process group forms
    if RANK == 0:
        Path(os.environ.get("TPP_PID0", args.out / "pid0")).write_text(str(os.getpid()))
    schedules(args) if args.mode == "schedules" else tp2pp2(args)


if __name__ == "__main__":
    main()
