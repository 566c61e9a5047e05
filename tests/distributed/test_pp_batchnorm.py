"""Batch statistics under micro-batching, two pipeline ranks (gloo) against one process, one launch: a small ResNet
(BatchNorm2d in every residual block and after the stem, an InstanceNorm tracking running statistics) trained with
microbatches=1, then microbatches=2."""

from __future__ import annotations

import functools
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.nn.functional as F

from launch import ROOT, run_ranks
from lightning_tpp.pipeline.batchnorm import DeferredStatistics
from models import LitLM, token_dataset
from parity import RUNNING_STATS, Record, assert_parity, assert_same_buffers, load_record, merge_stages, train

WARNING = "normalise with batch statistics in training"


@functools.lru_cache(maxsize=None)
def reference():
    return train("resnet", steps=3)


def micro_batched_first_step(batch_size: int = 4, microbatches: int = 2) -> Record:
    """What the pipeline computes in its first step, in one process: the model ``parity.train`` builds, its first
    batch cut as ``split_batch`` cuts it, each micro-batch normalised by its own statistics, the running statistics
    deferred and committed once. Its loss (share-weighted) and the running statistics after it."""
    L.seed_everything(0, verbose=False)
    torch.manual_seed(0)
    module = LitLM("resnet").train()
    data = token_dataset()
    x, y = data[torch.randperm(len(data), generator=torch.Generator().manual_seed(0))[:batch_size]]
    stats = DeferredStatistics.install(module, pp=2, microbatches=microbatches, warn=[])
    assert stats is not None
    stats.begin(batch_size, microbatches)
    with torch.no_grad():
        loss = sum(F.cross_entropy(module(xs), ys[:, 0]) * len(xs) / batch_size
                   for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)))
    stats.commit()
    return Record(losses=[float(loss)], buffers=[{n: b.double() for n, b in module.named_buffers()
                                                  if n.rpartition(".")[2] in RUNNING_STATS}])


def test_pp2_batchnorm(tmp_path: Path) -> None:
    """microbatches=1: every layer sees the whole batch, as in one process: losses, gradients, parameters and the
    running statistics after each step match. microbatches=2: each BatchNorm normalises a micro-batch of 2 samples by
    its own statistics, so the losses differ from one process's (the first step's already, from the same weights);
    rank 0 says so once, naming the layers. The running statistics are committed once over the whole batch: the
    first layers' (the InstanceNorm and the BatchNorm after it, whose inputs do not depend on how the batch is cut)
    equal one process's after the first step; the later layers see
    the earlier ones' micro-batch-normalised outputs, so theirs equal what one process gets from those outputs
    (``micro_batched_first_step``), as does the first step's loss."""
    args = ["--models", "resnet", "--pp", "2", "--schedule", "gpipe", "--microbatches", "1,2", "--steps", "3",
            "--out", str(tmp_path)]
    outputs = run_ranks(ROOT / "tests" / "parity.py", 2, args, timeout=300).check().outputs
    ref = reference()
    whole = merge_stages([load_record(tmp_path / f"resnet.m1.rank{r}.pt") for r in range(2)])
    assert_parity(whole, ref, where="resnet pp=2 microbatches=1")
    assert len(whole.buffers[0]) == 3 * 10  # 9 BatchNorm2d and the InstanceNorm, three buffers each: all compared
    micro = merge_stages([load_record(tmp_path / f"resnet.m2.rank{r}.pt") for r in range(2)])
    assert micro.losses[0] != pytest.approx(ref.losses[0], rel=1e-3), "micro-batches normalised by the whole batch?"
    first = lambda r: Record(buffers=[{n: b for n, b in r.buffers[0].items()  # noqa: E731
                                       if n.startswith(("model.norm.", "model.bn."))}])
    assert_same_buffers(first(micro), first(ref), steps=1, where="resnet pp=2 microbatches=2, the first layers")
    replay = micro_batched_first_step()
    assert micro.losses[0] == pytest.approx(replay.losses[0], rel=1e-5)
    assert_same_buffers(micro, replay, steps=1, where="resnet pp=2 microbatches=2 vs one process, micro-batched")
    assert outputs[0].count(WARNING) == 1 and WARNING not in outputs[1]
    said = outputs[0][outputs[0].index("pp=2 with microbatches=2"):]
    assert "9 layer(s)" in said and "BatchNorm2d: model.bn, model.blocks.0.bn1" in said
    assert "micro-batches of 2 samples" in said and "microbatches=1" in said
