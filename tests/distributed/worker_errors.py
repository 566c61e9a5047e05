"""A rank of a run that must fail with a clear error on every rank (scenario in argv[1])."""

from __future__ import annotations

import sys

import lightning as L
import torch
from torch import nn

from lightning_tpp import TensorPipeStrategy
from models import LitLM, token_dataset


class CenteredMLP(nn.Module):
    """fc1 -> subtract the mean over the hidden features -> fc2: looks like an MLP, is not elementwise in between."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h - h.mean(-1, keepdim=True))


class Scenario(LitLM):
    def __init__(self, scenario: str) -> None:
        super().__init__("nanogpt" if scenario != "heads" else "llama")
        if scenario == "heads":
            self.model = type(self.model)(n_heads=3, n_kv_heads=3, dim=48)
        if scenario == "mismatch":
            self.model.transformer.h[0].mlp = CenteredMLP()


def main() -> None:
    scenario, devices, tp = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=TensorPipeStrategy(tp=tp), max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(Scenario(scenario), torch.utils.data.DataLoader(token_dataset(16), batch_size=4))


if __name__ == "__main__":
    main()
