"""Ranks of a run whose mixture-of-experts model starts from a Hugging Face safetensors file at ep=2 over dp (2: each
expert on one rank; 4: on two replicas, FSDP2 sharding it over them): built on the meta device (``configure_model``),
each rank reading its own part of its experts from the file. Records saved per rank, with what each read filled
(entries, bytes) and the share of every bank's elements the rank holds."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

from lightning_tpp import TensorPipeStrategy
from lightning_tpp.core.dp_shard import local
from lightning_tpp.experts.expert_parallel import expert_parameters
from parity import train


def main() -> None:
    out, weights, dp, name = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    strategy = TensorPipeStrategy(ep=2, dp=dp, weights=weights, print_plan=False)
    record = train(name, strategy=strategy, devices=dp, dp=dp, steps=2, meta=True)
    state = strategy.parallel_state
    experts = expert_parameters(strategy.lightning_module)
    saved = asdict(record)
    saved["reads"] = [(read.loaded, read.bytes) for read in state.loaded]
    saved["held"] = sum(local(p).numel() * p.element_size() for p in experts)
    saved["whole"] = sum(state.shards.full_numel(p) * p.element_size() for p in experts)
    torch.save(saved, out / f"weights.rank{os.environ['LOCAL_RANK']}.pt")


if __name__ == "__main__":
    main()
