"""Resuming in another world size, in one process: the global batch kept or refused with what to set, the batch
counters recounted, and the resumed sampler reading exactly the global batches an uninterrupted run reads."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler

from lightning_tpp.reliability.elastic import (
    KEY,
    ElasticResumeError,
    _ResumedSampler,
    keep_global_batch,
    world_record,
)


def _checkpoint(dp: int, accumulate: int, processed: int, completed: int) -> dict:
    counts = {"ready": processed, "started": processed, "processed": processed, "completed": completed}
    loader = torch.utils.data.DataLoader(list(range(8)), sampler=DistributedSampler(list(range(8)), num_replicas=dp,
                                                                                 rank=0), batch_size=2)
    return {KEY: world_record(dp=dp, accumulate=accumulate, world_size=2 * dp, loader=loader),
            "loops": {"fit_loop": {"epoch_loop.batch_progress": {"current": dict(counts),
                                                                 "total": {k: v + 10 for k, v in counts.items()}}}}}


def test_smaller_world_accumulates_more_and_recounts_the_epoch() -> None:
    trainer = SimpleNamespace(accumulate_grad_batches=1)
    checkpoint = _checkpoint(dp=2, accumulate=1, processed=4, completed=3)  # saved in on_train_batch_end
    with pytest.warns(UserWarning, match=r"dp=2 \(accumulate_grad_batches=1\) with dp=1: accumulate_grad_batches=1 "
                                         r"-> 2, keeping 2 batches per optimizer step"):
        keep_global_batch(checkpoint, trainer, dp=1, world_size=2)
    assert trainer.accumulate_grad_batches == 2
    progress = checkpoint["loops"]["fit_loop"]["epoch_loop.batch_progress"]
    assert progress["current"] == {"ready": 8, "started": 8, "processed": 8, "completed": 7}  # the lag is kept
    assert progress["total"] == {"ready": 18, "started": 18, "processed": 18, "completed": 17}


def test_replicas_reading_the_same_batches_keep_their_accumulation() -> None:
    """use_distributed_sampler=False: every dp rank read every batch, so the global batch did not depend on dp."""
    trainer = SimpleNamespace(accumulate_grad_batches=1)
    checkpoint = _checkpoint(dp=2, accumulate=1, processed=4, completed=4)
    checkpoint[KEY] = world_record(dp=2, accumulate=1, world_size=4, loader=torch.utils.data.DataLoader(range(8)))
    before = copy.deepcopy(checkpoint)
    keep_global_batch(checkpoint, trainer, dp=1, world_size=2)
    assert trainer.accumulate_grad_batches == 1 and checkpoint == before


def test_same_dp_changes_nothing() -> None:
    trainer = SimpleNamespace(accumulate_grad_batches=3)
    checkpoint = _checkpoint(dp=2, accumulate=1, processed=4, completed=4)
    before = copy.deepcopy(checkpoint)
    keep_global_batch(checkpoint, trainer, dp=2, world_size=4)
    assert trainer.accumulate_grad_batches == 3 and checkpoint == before


def test_global_batch_that_cannot_be_kept_says_what_to_run() -> None:
    trainer = SimpleNamespace(accumulate_grad_batches=1)
    with pytest.raises(ElasticResumeError, match=r"saved with dp=2 x accumulate_grad_batches=1 = 2 batches per "
                                                 r"optimizer step \(world size 4\); here dp=3 \(world size 6\) cannot "
                                                 r"read the same global batch. Run with a world size whose dp is one "
                                                 r"of \[1, 2\]"):
        keep_global_batch(_checkpoint(dp=2, accumulate=1, processed=2, completed=2), trainer, dp=3, world_size=6)


def test_checkpoint_inside_an_accumulation_window_is_refused() -> None:
    trainer = SimpleNamespace(accumulate_grad_batches=1)
    with pytest.raises(ElasticResumeError, match=r"after 3 batches of its epoch at dp=1, inside an accumulation "
                                                 r"window: with dp=2 that is not a whole number of batches"):
        keep_global_batch(_checkpoint(dp=1, accumulate=2, processed=3, completed=3), trainer, dp=2, world_size=4)


@pytest.mark.parametrize(("old", "new"), [((2, 1), (1, 2)), ((1, 4), (4, 1)), ((2, 2), (4, 1)), ((4, 1), (2, 2))])
@pytest.mark.parametrize("shuffle", [True, False])
def test_resumed_sampler_reads_the_global_batches_of_an_uninterrupted_run(old: tuple[int, int], new: tuple[int, int],
                                                                          shuffle: bool) -> None:
    """Global step s reads positions [s*G, (s+1)*G) of the epoch's permutation in any (dp, accumulation) of the
    same G; resumed after `done` steps in another layout, the steps that follow read what the old layout would."""
    data, batch, done = list(range(64)), 2, 3

    def steps(dp: int, accumulate: int, skip: int = 0) -> list[set[int]]:
        per_rank = []
        for rank in range(dp):
            inner = DistributedSampler(data, num_replicas=dp, rank=rank, shuffle=shuffle, seed=7)
            inner.set_epoch(5)
            sampler = _ResumedSampler(inner, epoch=5, skip=skip) if skip else inner
            per_rank.append(list(BatchSampler(sampler, batch, drop_last=False)))
        count = len(per_rank[0]) // accumulate
        return [set().union(*(set(b) for r in per_rank for b in r[s * accumulate:(s + 1) * accumulate]))
                for s in range(count)]

    uninterrupted = steps(*old)
    global_batch = old[0] * old[1] * batch
    resumed = steps(*new, skip=done * global_batch)
    assert resumed == uninterrupted[done:]
    assert all(len(s) == global_batch for s in resumed)


def test_resumed_sampler_is_the_plain_one_in_later_epochs() -> None:
    inner = DistributedSampler(list(range(10)), num_replicas=2, rank=1, shuffle=True, seed=0)
    sampler = _ResumedSampler(inner, epoch=0, skip=4)
    sampler.set_epoch(1)
    assert list(sampler) == list(inner) and len(sampler) == len(inner)
    torch.manual_seed(0)  # the resumed order does not depend on the global random state
    sampler.set_epoch(0)
    first = list(sampler)
    torch.manual_seed(1)
    assert list(sampler) == first
