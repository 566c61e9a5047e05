"""Nothing a user saved is lost: a save killed midway leaves the previous checkpoint loadable; truncated files and
checkpoints of another model fail with errors that say what is wrong."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import ROOT, run_ranks
from lightning_tpp import CheckpointMismatchError
from lightning_tpp._checkpoint import load_full_state_dict, load_or_explain
from lightning_tpp._comm import TPGroup
from models import LitLM


def test_killed_save_leaves_previous_checkpoint(tmp_path: Path) -> None:
    path = tmp_path / "last.ckpt"
    result = run_ranks(ROOT / "tests" / "distributed" / "worker_save_kill.py", 2, [str(path)], timeout=120)
    assert result.returncodes[0] != 0  # rank 0 died while writing
    state = torch.load(path, map_location="cpu", weights_only=False)
    assert state["global_step"] == 2
    model = LitLM.load_from_checkpoint(path, map_location="cpu")  # whole model, one process
    assert model.model.transformer.wte.weight.shape == (64, 32)
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == ["last.ckpt"]


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
        load_full_state_dict(gpt, llama.state_dict(), TPGroup(None, 0, 1))
    state = gpt.state_dict()
    state["model.lm_head.weight"] = torch.zeros(3, 3)
    with pytest.raises(CheckpointMismatchError, match=r"shape mismatch: \['model\.lm_head\.weight: checkpoint \(3, 3\)"
                                                      r" vs model \(64, 32\)'\]"):
        load_full_state_dict(gpt, state, TPGroup(None, 0, 1))
