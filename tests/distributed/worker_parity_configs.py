"""A rank of a launch that trains several parity configurations one after the other (see test_parity_configs.py).

``python worker_parity_configs.py OUT NAME[,NAME...]``: each NAME of ``CONFIGS`` (all of one launch's world size)
trains its models with ``parity.train`` and writes ``OUT/<NAME>.<model>.rank<R>.pt`` (the parity record) and
``.json`` (what the record cannot show: the dtypes the linear layers computed in, and how much of the model this
rank holds)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch import nn


@dataclass(frozen=True)
class Config:
    models: tuple[str, ...]
    strategy: dict[str, Any]  # TensorPipeStrategy's arguments besides print_plan
    train: dict[str, Any] = field(default_factory=dict)  # parity.train's, also given to the one-process reference

    @property
    def world(self) -> int:
        s = self.strategy
        return s.get("tp", 1) * s.get("pp", 1) * s.get("dp", 1)


STEPS = dict(steps=3)
BF16 = dict(precision="bf16-mixed", steps=3)
CONFIGS = {
    # launch of 2 ranks
    "dp2": Config(("nanogpt",), dict(dp=2), STEPS),  # FSDP2 (full_shard), the default
    "dp2_no_shard": Config(("nanogpt",), dict(dp=2, dp_sharding="no_shard"), STEPS),  # replicas, all-reduced
    "dp2_bf16": Config(("nanogpt",), dict(dp=2), BF16),
    # BERT's head bias is its decoder's bias, held by both modules: FSDP2 keeps the tie (the decoder not cut in rows)
    "dp2_tied_bias": Config(("cp_hf_bert",), dict(dp=2), dict(steps=3, seq=32)),
    "pp2_bf16": Config(("nanogpt",), dict(pp=2, schedule="1f1b"), BF16),
    # four blocks, cut 1 + 3 and 3 + 1 (by parameters it is 2 + 2)
    "pp2_balance": Config(("nanogpt4",), dict(pp=2, schedule="1f1b", balance=[1, 3]), STEPS),
    "pp2_split_points": Config(("nanogpt4",), dict(pp=2, schedule="1f1b", split_points=["model.transformer.h.3"]),
                               STEPS),
    # launch of 3 ranks: 3 micro-batches of 2 samples; by parameters four blocks are cut 1 + 2 + 1
    "pp3": Config(("nanogpt4",), dict(pp=3, schedule="1f1b", microbatches=3), dict(batch_size=6, **STEPS)),
    "pp3_split_points": Config(("llama4",), dict(pp=3, schedule="1f1b", microbatches=3,
                                                 split_points=["model.layers.2", "model.layers.3"]),
                               dict(batch_size=6, **STEPS)),
    # launch of 8 ranks: the fewest with every axis above 1
    "tp2pp2dp2": Config(("nanogpt",), dict(tp=2, pp=2, dp=2, schedule="1f1b"), STEPS),
}


class Dtypes(L.Callback):
    """The dtypes of the outputs of the nn.Linear layers inside nanoGPT's blocks that this rank ran in training
    (autocast in effect or not). Blocks only: where a unit another stage holds is called, the pipeline returns a
    stand-in of its meta twin's output (float32 under autocast, e.g. the head's on the first stage)."""

    def __init__(self) -> None:
        self.seen: set[str] = set()
        self.handles: list[Any] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name, m in pl_module.named_modules():
            if isinstance(m, nn.Linear) and name.startswith("model.transformer.h."):
                self.handles.append(m.register_forward_hook(lambda mod, args, out: self.seen.add(str(out.dtype))))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for h in self.handles:
            h.remove()


def held_fraction(module: nn.Module) -> float:
    """This rank's parameter elements (its dp shard where FSDP2 cut them) over the parameters it holds whole."""
    from torch.distributed.tensor import DTensor

    params = list(module.parameters())
    local = sum(p.to_local().numel() if isinstance(p, DTensor) else p.numel() for p in params)
    return local / max(sum(p.numel() for p in params), 1)


def main() -> None:
    from lightning_tpp import TensorPipeStrategy
    from parity import train

    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    rank = int(os.environ["LOCAL_RANK"])
    for name in names:
        config = CONFIGS[name]
        for model in config.models:
            strategy = TensorPipeStrategy(**config.strategy, print_plan=False)
            dtypes = Dtypes()
            record = train(model, strategy=strategy, devices=config.world, dp=config.strategy.get("dp", 1),
                           callbacks=[dtypes], **config.train)
            stem = f"{name}.{model}.rank{rank}"
            torch.save(asdict(record), out / f"{stem}.pt")
            (out / f"{stem}.json").write_text(json.dumps({
                "dtypes": sorted(dtypes.seen), "held_fraction": held_fraction(strategy.lightning_module)}))


if __name__ == "__main__":
    main()
