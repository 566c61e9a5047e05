"""Nothing a user saved is lost: a save killed midway leaves the previous checkpoint loadable; truncated files and
checkpoints of another model fail with errors that say what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import ROOT, run_ranks
from lightning_tpp import CheckpointMismatchError
from lightning_tpp.checkpoint.state import load_full_state_dict
from lightning_tpp.checkpoint.safe_load import load_or_explain
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.params import ShardIndex
from models import LitLM


def _batches_stepped(state: dict) -> int:
    return state["loops"]["fit_loop"]["epoch_loop.state_dict"]["_batches_that_stepped"]


def test_killed_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    result = run_ranks(ROOT / "tests" / "distributed" / "worker_save_kill.py", 2, [str(path), "file"], timeout=120)
    assert result.returncodes[0] != 0  # rank 0 died while writing
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert state["global_step"] == 2 and _batches_stepped(state) == 2
    model = LitLM.load_from_checkpoint(path, map_location="cpu")  # whole model, one process
    assert model.model.transformer.wte.weight.shape == (64, 32)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["last.ckpt"]


@pytest.mark.parametrize(("point", "survivor"), [("shards", "previous"), ("shards-rank1", "previous"),
                                                 ("written", "previous"), ("meta", "previous"), ("publish", "new"),
                                                 ("async-shards", "previous"), ("async-shards-rank1", "previous"),
                                                 ("async-written", "previous"), ("async-meta", "previous"),
                                                 ("async-publish", "new")])
def test_killed_sharded_save_leaves_a_whole_checkpoint(tmp_path: Path, point: str, survivor: str) -> None:
    """A rank killed at each point of a sharded save: the path holds a complete checkpoint at every moment (the
    previous one until the new one is published in one step), and nothing half-written is visible. ``async-*``: the
    same points in a save written in the background (async_save=True) while the next step trains; the previous
    checkpoint is of step 2, the new one of step 3."""
    from lightning_tpp import consolidate

    path = tmp_path / "last.ckpt"
    result = run_ranks(ROOT / "tests" / "distributed" / "worker_save_kill.py", 2, [str(path), point], timeout=120)
    assert not result.timed_out and any(result.returncodes), "a rank had to die"
    one = tmp_path / "one" / "whole.ckpt"
    consolidate(path, one)  # every shard and entry present, the files safe to load
    state = torch.load(one, map_location="cpu", weights_only=True)
    if point.startswith("async-"):  # saved in on_train_batch_end of steps 2 and 3
        assert state["global_step"] == (2 if survivor == "previous" else 3)
    else:
        assert _batches_stepped(state) == (2 if survivor == "previous" else 99)
    model = LitLM.load_from_checkpoint(one, map_location="cpu")
    assert model.model.transformer.wte.weight.shape == (64, 32)
    assert sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith(".")) == ["last.ckpt", "one"]


def test_truncated_checkpoint_is_reported(tmp_path: Path) -> None:
    path = tmp_path / "cut.ckpt"
    torch.save({"state_dict": LitLM("nanogpt").state_dict()}, path)
    path.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(CheckpointMismatchError, match=r"cut\.ckpt is incomplete or corrupt and cannot be loaded"):
        load_or_explain(lambda p: torch.load(p, weights_only=True), path)


def test_checkpoint_of_another_model_lists_the_names() -> None:
    llama, gpt = LitLM("llama"), LitLM("nanogpt")
    with pytest.raises(CheckpointMismatchError, match=r"checkpoint does not match the model: missing: \['model\.lm_head"
                                                      r"\.weight', .*unexpected: \['model\.layers\.0\.attention"):
        load_full_state_dict(gpt, llama.state_dict(), TPGroup(None, 0, 1), ShardIndex())
    state = gpt.state_dict()
    state["model.lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointMismatchError, match=r"shape mismatch: \['model\.lm_head\.weight: checkpoint \(3, 3\)"
                                                      r" vs model \(64, 32\)'\]"):
        load_full_state_dict(gpt, state, TPGroup(None, 0, 1), ShardIndex())
