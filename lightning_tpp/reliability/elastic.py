"""Resuming in another world size (a lost node; ``torchrun --max-restarts --nnodes=MIN:MAX``): the global batch and
the data position carry over.

A global step reads ``G = dp x accumulate_grad_batches x batch_size`` samples. With Lightning's
``DistributedSampler`` (rank ``r`` of ``dp`` takes positions ``r, r + dp, ...`` of the epoch's permutation) the
step ``s`` of an epoch reads exactly the positions ``[s*G, (s+1)*G)`` of that permutation, whatever ``dp`` and
``accumulate_grad_batches`` are, as long as ``G`` is the same::

    dp=2, accumulate=1, batch=4     rank 0: p0 p2 p4 p6   rank 1: p1 p3 p5 p7          step s reads p[8s : 8s+8]
    dp=1, accumulate=2, batch=4     rank 0: p0 p1 p2 p3 | p4 p5 p6 p7 (two micro-batches)

So a checkpoint records ``dp`` and ``accumulate_grad_batches``; resumed with another ``dp``, the Trainer's
``accumulate_grad_batches`` is set to keep ``G`` (as Lightning's ``GradientAccumulationScheduler`` sets it), the
loop's batch counters of the epoch are counted in the new per-rank batches, and the sampler of the epoch in progress
starts after the ``s * G`` samples already read (Lightning restarts a plain ``DataLoader`` at the epoch's start).
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import BatchSampler, DistributedSampler, Sampler

KEY = "tpp_world"  # in every checkpoint: {"dp": ..., "accumulate_grad_batches": ..., "world_size": ...}


class ElasticResumeError(ValueError):
    """A checkpoint's global batch cannot be kept in this world size."""


def world_record(*, dp: int, accumulate: int, world_size: int, loader: Any = None) -> dict[str, Any]:
    """What a checkpoint records; ``sharded_data``: the training sampler shares the data out over the dp ranks (a
    step then reads ``dp`` times the per-rank batch: the global batch depends on ``dp``)."""
    return {"dp": dp, "accumulate_grad_batches": accumulate, "world_size": world_size,
            "sharded_data": _distributed_sampler(loader) is not None}


def _distributed_sampler(loader: Any) -> Optional[DistributedSampler]:
    """The ``DistributedSampler`` (Lightning's, for training) behind a loader, or None."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    sampler = getattr(batch_sampler, "sampler", None) or getattr(loader, "sampler", None)
    if isinstance(sampler, _ResumedSampler):
        sampler = sampler.inner
    return sampler if isinstance(sampler, DistributedSampler) else None


def keep_global_batch(checkpoint: dict[str, Any], trainer: Any, *, dp: int, world_size: int) -> None:
    """Resumed with another ``dp``: set the Trainer's accumulation so that an optimizer step reads as many samples
    as when the checkpoint was saved, and count the epoch's batches in this world's per-rank batches."""
    saved = checkpoint.get(KEY)
    if not isinstance(saved, dict) or saved.get("dp") == dp or not saved.get("sharded_data"):
        return  # the same dp, or every dp rank read the same batches (use_distributed_sampler=False)
    per_step = saved["dp"] * saved["accumulate_grad_batches"]  # per-rank batches of one optimizer step, all ranks
    if per_step % dp:
        choices = sorted(d for d in range(1, per_step + 1) if per_step % d == 0)
        raise ElasticResumeError(
            f"the checkpoint was saved with dp={saved['dp']} x accumulate_grad_batches="
            f"{saved['accumulate_grad_batches']} = {per_step} batches per optimizer step (world size "
            f"{saved['world_size']}); here dp={dp} (world size {world_size}) cannot read the same global batch. "
            f"Run with a world size whose dp is one of {choices}, or start a new run from these weights "
            f"(TensorPipeStrategy(weights=...)) to change the global batch")
    accumulate = per_step // dp
    if trainer.accumulate_grad_batches != accumulate:
        rank_zero_warn(f"resuming a checkpoint of dp={saved['dp']} (accumulate_grad_batches="
                       f"{saved['accumulate_grad_batches']}) with dp={dp}: accumulate_grad_batches="
                       f"{trainer.accumulate_grad_batches} -> {accumulate}, keeping {per_step} batches per optimizer "
                       f"step", category=UserWarning)
        trainer.accumulate_grad_batches = accumulate
    _recount_batches(checkpoint, old_dp=saved["dp"], dp=dp)


def _recount_batches(checkpoint: dict[str, Any], *, old_dp: int, dp: int) -> None:
    """The epoch's batch counters in this world's per-rank batches (``old * old_dp / dp``). A checkpoint saved in
    ``on_train_batch_end`` counts its last batch as processed, not yet completed; that one-batch lag is how
    Lightning recognises it on restart, so it is kept as it is."""
    progress = checkpoint.get("loops", {}).get("fit_loop", {}).get("epoch_loop.batch_progress")
    if not isinstance(progress, dict):
        return
    current, total = progress["current"], progress["total"]
    processed = current["processed"]
    if (processed * old_dp) % dp:
        raise ElasticResumeError(
            f"the checkpoint was saved after {processed} batches of its epoch at dp={old_dp}, inside an "
            f"accumulation window: with dp={dp} that is not a whole number of batches. Resume from a checkpoint "
            f"saved at an optimizer step (ModelCheckpoint's every_n_train_steps)")
    delta = processed * old_dp // dp - processed
    for counts in (current, total):
        for key in ("ready", "started", "processed", "completed"):
            counts[key] += delta


def resume_data_position(dataloader: Any, trainer: Any) -> Any:
    """The training loader of an epoch resumed in its middle: its sampler starts after the samples already read."""
    batches = trainer.fit_loop.epoch_loop.batch_progress.current.processed  # completed lags in on_train_batch_end
    batch_sampler = getattr(dataloader, "batch_sampler", None)
    if batches == 0 or not isinstance(batch_sampler, BatchSampler) or batches >= len(batch_sampler):
        return dataloader  # at an epoch's start or end (the next epoch starts afresh), or no batch sampler
    sampler = _distributed_sampler(dataloader)
    if sampler is None:
        rank_zero_warn("resuming in the middle of an epoch with a sampler that is not Lightning's DistributedSampler: "
                       "the epoch's samples are read again from its start", category=UserWarning)
        return dataloader
    skip = batches * batch_sampler.batch_size * sampler.num_replicas
    batch_sampler.sampler = _ResumedSampler(sampler, epoch=trainer.current_epoch, skip=skip)
    return dataloader


class _ResumedSampler(Sampler[int]):
    """``inner`` (a ``DistributedSampler``), but in epoch ``epoch`` the first ``skip`` positions of the epoch's
    permutation (read before the checkpoint, by every rank together) are left out before it is shared out."""

    def __init__(self, inner: DistributedSampler, *, epoch: int, skip: int) -> None:
        self.inner, self.epoch, self.skip = inner, epoch, skip

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __len__(self) -> int:
        return len(self.inner)  # the epoch's length as Lightning counts it (its counters continue from the checkpoint)

    def __iter__(self) -> Iterator[int]:
        inner = self.inner
        if inner.epoch != self.epoch:
            return iter(inner)
        order = _permutation(inner)[self.skip:]
        replicas = inner.num_replicas
        if inner.drop_last:
            order = order[:len(order) - len(order) % replicas]
        elif order and len(order) % replicas:
            order += (order * replicas)[:replicas - len(order) % replicas]
        return iter(order[inner.rank::replicas])


def _permutation(sampler: DistributedSampler) -> list[int]:
    """The epoch's order of the whole dataset, as ``DistributedSampler`` draws it."""
    import torch

    n = len(sampler.dataset)  # type: ignore[arg-type]
    if not sampler.shuffle:
        return list(range(n))
    g = torch.Generator()
    g.manual_seed(sampler.seed + sampler.epoch)
    return torch.randperm(n, generator=g).tolist()

