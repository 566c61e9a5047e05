"""Train the GPT of ``examples/gpt.py`` from a LightningCLI config: the strategy, its tensor/pipeline layout and the
schedule are configuration, the LightningModule is unchanged.

    python examples/cli.py fit --config examples/configs/gpt_tp2_pp2.yaml
    python examples/cli.py fit --config examples/configs/gpt_tp2_pp2.yaml --trainer.strategy.schedule=gpipe
    python examples/cli.py fit --config examples/configs/gpt_tp2_pp2.yaml --print_config > my.yaml

or without a file, ``--trainer.strategy=lightning_tpp.TensorPipeStrategy --trainer.strategy.tp=2 ...``.
"""

from __future__ import annotations

import lightning as L
import torch
from lightning.pytorch.cli import LightningCLI

from gpt import GPT, zen_dataset  # this folder is on sys.path when the script runs (and in every rank it starts)


class ZenData(L.LightningDataModule):
    """The Zen of Python as next-character windows."""

    def __init__(self, block_size: int = 64, batch_size: int = 16) -> None:
        super().__init__()
        self.save_hyperparameters()

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(zen_dataset(self.hparams.block_size), batch_size=self.hparams.batch_size,
                                           shuffle=True)


def main() -> None:
    torch.set_num_threads(1)
    # the resolved config is saved next to the run (trainer.default_root_dir), replaced by a rerun
    LightningCLI(GPT, ZenData, seed_everything_default=0, save_config_kwargs={"overwrite": True})


if __name__ == "__main__":
    main()
