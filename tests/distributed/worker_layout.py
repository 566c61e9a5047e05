"""A rank of ``TensorPipeStrategy(layout="auto")`` training a tiny model through the parity helper: records what it
trained (for the parity check), the layout rank 0 chose and, on rank 0, the ranked table's figures."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

import functools

import torch

from models import MODELS, SEQ, TinyLlama
from parity import train

# four blocks: a pipeline over the 4 processes (the naive layout) exists; kv heads 2 leave tp in {1, 2}
MODELS.setdefault("llama4", functools.partial(TinyLlama, n_layers=4))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device-memory", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from lightning_tpp import TensorPipeStrategy

    rank = int(os.environ["LOCAL_RANK"])
    strategy = TensorPipeStrategy(layout="auto", device_memory=args.device_memory, print_plan=False)

    def prepare(module: torch.nn.Module) -> None:
        module.example_input_array = torch.zeros(args.batch_size, SEQ, dtype=torch.long)

    record = train(args.model, strategy=strategy, devices=int(os.environ["WORLD_SIZE"]), steps=args.steps,
                   batch_size=args.batch_size, prepare=prepare)
    out = Path(args.out)
    torch.save(asdict(record), out / f"{args.model}.rank{rank}.pt")
    chosen = strategy.parallel_state.layout
    info = {"layout": asdict(chosen), "dims": [strategy.dims.dp, strategy.dims.pp, strategy.dims.tp]}
    if strategy.layout_ranking is not None:
        best = strategy.layout_ranking.best
        info.update(memory=best.memory.total, candidates=len(strategy.layout_ranking.ranked),
                    dropped=[d.reason for d in strategy.layout_ranking.dropped])
    (out / f"layout.rank{rank}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
