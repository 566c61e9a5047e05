"""Ranks of a run whose mixture-of-experts model is built on the meta device (``configure_model``) at ep=2 over dp
(2: each expert on one rank; 4: on two replicas, FSDP2 sharding it over them), its weights from a Hugging Face
safetensors file (each rank reading its own part of its experts) or, with ``-`` for the file, initialised by the
strategy. Records saved per rank, with what each read filled (entries, bytes), the share of every bank's elements
the rank holds, and the most expert bytes it held after any setup step."""

from __future__ import annotations

import os
import sys
from dataclasses import asdict
from pathlib import Path

import torch

import lightning_tpp.steps as steps
from lightning_tpp import TensorPipeStrategy
from lightning_tpp.core.dp_shard import local
from lightning_tpp.experts.expert_parallel import expert_parameters
from parity import train


def expert_bytes(module: torch.nn.Module) -> int:
    return sum(local(p).numel() * p.element_size() for p in expert_parameters(module) if not p.is_meta)


def watch_steps() -> list[int]:
    """The expert bytes allocated on this rank after each setup step (the steps wrapped, in order)."""
    seen: list[int] = []

    def watched(run):
        def step(s):
            run(s)
            seen.append(expert_bytes(s.module))
        return step

    steps.STEPS = tuple(step._replace(run=watched(step.run)) for step in steps.STEPS)
    return seen


def main() -> None:
    out, weights, dp, name = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3]), sys.argv[4]
    seen = watch_steps()
    strategy = TensorPipeStrategy(ep=2, dp=dp, weights=None if weights == "-" else weights, print_plan=False)
    record = train(name, strategy=strategy, devices=dp, dp=dp, steps=2, meta=True)
    state = strategy.parallel_state
    experts = expert_parameters(strategy.lightning_module)
    saved = asdict(record)
    saved["reads"] = [(read.loaded, read.bytes) for read in state.loaded]
    saved["held"] = sum(local(p).numel() * p.element_size() for p in experts)
    saved["whole"] = sum(state.shards.full_numel(p) * p.element_size() for p in experts)
    saved["most"] = max(seen)
    torch.save(saved, out / f"weights.rank{os.environ['LOCAL_RANK']}.pt")


if __name__ == "__main__":
    main()
