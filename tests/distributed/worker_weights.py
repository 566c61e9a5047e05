"""Ranks of runs whose model starts from a Hugging Face safetensors file (``TensorPipeStrategy(weights=...)``): the
tiny Hugging Face Llama, 2 steps at tp2 x dp2 (which also saves a sharded checkpoint, tp-sharded entries stored as
one chunk per tp rank, for the one-process test to load back), then at tp2 x pp2 in the same processes (process
start-up dominates on 2 cores); the tp2 x pp2 model is built in ``configure_model`` (on the meta device), so its
rotary tables (not in the file) are initialised and everything else comes from the file. Records saved per layout and
rank."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_tpp import TensorPipeStrategy
from parity import train


def main() -> None:
    out, weights = Path(sys.argv[1]), sys.argv[2]
    rank = int(os.environ["LOCAL_RANK"])
    for tp, pp, dp in ((2, 1, 2), (2, 2, 1)):
        strategy = TensorPipeStrategy(tp=tp, pp=pp, dp=dp, weights=weights, print_plan=False)
        save = (lambda trainer: trainer.save_checkpoint(out / "run.ckpt")) if pp == 1 else None
        record = train("hf_llama", strategy=strategy, devices=4, dp=dp, steps=2, after_fit=save,
                       meta=pp > 1)  # tp2 x pp2 builds on meta: only allocated where the file fills it
        torch.save(asdict(record), out / f"tp{tp}pp{pp}dp{dp}.rank{rank}.pt")


if __name__ == "__main__":
    main()
