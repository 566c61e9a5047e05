"""Losses averaged over a varying number of tokens under micro-batching (issue #44 item 1): Hugging Face's own
``.loss`` of a masked LM, a causal LM fine-tuned with -100 prompts and padding, and an encoder-decoder with padded
labels, each micro-batch (one sample) counting a different number of tokens, against one process on the batch."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import ROOT, run_ranks
from parity import compare_layout

TOKEN_MODELS = ["hf_mlm_tokens", "hf_sft_tokens", "hf_s2s_tokens"]


def _compare(tmp: Path, models: list[str], *, tp: int = 1, pp: int = 2, dp: int = 1, extra: tuple = ()) -> None:
    compare_layout(tmp, models, tp=tp, pp=pp, dp=dp, steps=4, extra=extra)


def test_token_means_pp2(tmp_path: Path) -> None:
    """Four micro-batches of one sample each, 1F1B: micro-batch 0's backward runs before micro-batch 3's forward,
    so the batch's count must be known before any loss is."""
    _compare(tmp_path, TOKEN_MODELS)


def test_token_means_tp2_pp2(tmp_path: Path) -> None:
    """With the vocabulary-parallel cross-entropy under tp (the sum reduced from the shards)."""
    _compare(tmp_path, TOKEN_MODELS, tp=2)


def test_microbatch_means_differ(tmp_path: Path) -> None:
    """loss_normalization='microbatch' (the mean of micro-batch means) is not one process's: what the other tests
    check can fail."""
    with pytest.raises(AssertionError, match="losses"):
        _compare(tmp_path, ["hf_sft_tokens"], extra=("--loss-normalization", "microbatch"))


@pytest.mark.parametrize(("pp", "microbatches"), [(1, "4"), (2, "4"), (2, "1")])
def test_global_token_mean_dp2(tmp_path: Path, pp: int, microbatches: str) -> None:
    """loss_normalization='global': one process's mean over both replicas' tokens (FSDP2 averaging over dp). pp=1:
    each loss call counts in the forward and all-reduces its count; pp=2: the counted totals are all-reduced once
    before the schedule, also for a batch run as one micro-batch."""
    _compare(tmp_path, ["hf_sft_tokens"], pp=pp, dp=2, extra=("--loss-normalization", "global", "--microbatches",
                                                               microbatches, "--schedule", "gpipe"))


def test_validation_loss_pp2(tmp_path: Path) -> None:
    """Evaluation splits batches as training does: the logged validation loss is the token mean of each batch."""
    script = ROOT / "tests" / "distributed" / "worker_token_eval.py"
    (tmp_path / "pipe").mkdir()
    (tmp_path / "single").mkdir()
    run_ranks(script, 2, [str(tmp_path / "pipe"), "2"], timeout=300).check()
    run_ranks(script, 1, [str(tmp_path / "single"), "1"], timeout=300).check()
    got = torch.load(tmp_path / "pipe" / "rank0.pt")[0]["val_loss"]
    ref = torch.load(tmp_path / "single" / "rank0.pt")[0]["val_loss"]
    assert got == pytest.approx(ref, rel=1e-6), (got, ref)
