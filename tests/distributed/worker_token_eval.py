"""A rank of test_token_loss's evaluation run: ``OUT PP``: validate a model whose Hugging Face loss counts a different
number of tokens per sample, through a pipeline of ``PP`` stages (4 micro-batches) or in one process (``PP`` = 1),
and write what ``validate`` returned to ``OUT/rank{r}.pt``."""

from __future__ import annotations

import os
import sys

import lightning as L
import torch

from models import LitLM, token_dataset

out, pp = sys.argv[1], int(sys.argv[2])
L.seed_everything(0, verbose=False)
module = LitLM("hf_sft_tokens")
strategy = "auto"
if pp > 1:
    from lightning_tpp import TensorPipeStrategy

    strategy = TensorPipeStrategy(pp=pp, microbatches=4, print_plan=False)
trainer = L.Trainer(accelerator="cpu", devices=pp, strategy=strategy, logger=False, enable_progress_bar=False,
                    enable_model_summary=False, use_distributed_sampler=False)
loader = torch.utils.data.DataLoader(token_dataset(16), batch_size=8)
result = trainer.validate(module, loader, verbose=False)
torch.save(result, os.path.join(out, f"rank{trainer.global_rank}.pt"))
