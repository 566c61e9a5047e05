"""What SpikeGuard costs, in one process on CPU (not a test): the host snapshot's bytes and the time to take and to
restore it, and the guard's per-step overhead (one all-gather of two numbers, the global norm, the verdict).

    python benchmarks/incidents.py                 # GPT of examples/gpt.py, n_embd 512, 8 layers, AdamW
    python benchmarks/incidents.py --steps 20      # fewer steps

Prints JSON: parameters, snapshot bytes, take/restore seconds (median of 5), median step seconds with and without
the guard (``action="rollback"``, a snapshot every 10 steps, so the median step is a step without a snapshot).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "examples")]  # this checkout's lightning_tpp, and the example model
from gpt import GPT  # noqa: E402

from lightning_tpp import SpikeGuard  # noqa: E402
from lightning_tpp.incidents import restore_snapshot, take_snapshot  # noqa: E402


class StepTimes(L.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def step_time(guard: bool, steps: int, model_args: dict[str, int]) -> float:
    L.seed_everything(0, verbose=False)
    module = GPT(**model_args)
    data = torch.utils.data.TensorDataset(torch.randint(0, 64, (steps * 8, 64)), torch.randint(0, 64, (steps * 8, 64)))
    timer = StepTimes()
    callbacks: list[L.Callback] = [timer] + ([SpikeGuard(action="rollback", snapshot_every_n_steps=10)] if guard
                                             else [])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=callbacks)
    trainer.fit(module, torch.utils.data.DataLoader(data, batch_size=8))
    return statistics.median(timer.times[2:])


def snapshot_cost(model_args: dict[str, int]) -> dict[str, float]:
    module = GPT(**model_args)
    opt = module.configure_optimizers()
    module(torch.randint(0, 64, (2, 64))).sum().backward()
    opt.step()
    takes, restores = [], []
    for _ in range(5):
        start = time.perf_counter()
        snap = take_snapshot(module, [opt], [], step=0, counters={})
        takes.append(time.perf_counter() - start)
        start = time.perf_counter()
        restore_snapshot(snap, module, [opt], [])
        restores.append(time.perf_counter() - start)
    return {"parameters": sum(p.numel() for p in module.parameters()), "snapshot_bytes": snap.nbytes,
            "take_s": statistics.median(takes), "restore_s": statistics.median(restores)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--n-embd", type=int, default=512)
    parser.add_argument("--n-layer", type=int, default=8)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model_args = dict(n_embd=args.n_embd, n_layer=args.n_layer, n_head=8)
    out = snapshot_cost(model_args)
    out["step_s_without_guard"] = step_time(False, args.steps, model_args)
    out["step_s_with_guard"] = step_time(True, args.steps, model_args)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
