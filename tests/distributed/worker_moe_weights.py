"""Ranks of a run whose mixture-of-experts model starts from a Hugging Face safetensors file at ep=2 over dp=2: built
on the meta device (``configure_model``), each rank reading its own experts from the file. Records saved per rank."""

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
    strategy = TensorPipeStrategy(ep=2, dp=2, weights=weights, print_plan=False)
    record = train("hf_mixtral_labels", strategy=strategy, devices=2, dp=2, steps=2, meta=True)
    torch.save(asdict(record), out / f"weights.rank{os.environ['LOCAL_RANK']}.pt")


if __name__ == "__main__":
    main()
