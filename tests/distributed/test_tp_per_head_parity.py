"""Per-head parameters and side tensors under tensor parallelism (issue #47 item 3), at parity with one process:
gpt-oss's attention sinks (one learned logit per head, joined to the scores) cut with the heads, in Hugging Face's
GptOss (its forward not traceable at setup: found by size, confirmed by the first-call check) and as users write it
(found by its forward meeting the scores), with grouped-query heads; BLOOM's ALiBi bias, built by the model outside
its attention blocks as ``(batch * heads, 1, S)``, cut to each rank's heads where ``baddbmm`` adds it; at tp=2 and
tp2 x pp2. A length-heads parameter that is not read per head, cut on its size because its forward could not be
traced, is refused by the first-call check, naming the parameter: trained last in the tp=2 launch (one launch)."""

from __future__ import annotations

from pathlib import Path

import pytest
from launch import ROOT, RunResult, run_ranks
from parity import assert_parity, compare_layout, load_record, train

MODELS = ["hf_gpt_oss_labels", "sink_attention", "hf_bloom"]


@pytest.fixture(scope="module")
def tp2(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, RunResult]:
    out = tmp_path_factory.mktemp("tp_heads")
    args = ["--models", ",".join([*MODELS, "sink_mixed_untraced"]), "--tp", "2", "--out", str(out), "--steps", "3"]
    return out, run_ranks(ROOT / "tests" / "parity.py", 2, args, timeout=300)


def test_per_head_parameters_tp2(tp2: tuple[Path, RunResult]) -> None:
    out, result = tp2
    for name in MODELS:
        assert (out / f"{name}.rank0.pt").exists(), result.outputs[0][-3000:]
        ref = train(name, steps=3)
        for rank in range(2):
            assert_parity(load_record(out / f"{name}.rank{rank}.pt"), ref, where=f"{name} tp=2 rank {rank}")


def test_length_heads_parameter_not_read_per_head_is_refused(tp2: tuple[Path, RunResult]) -> None:
    out, result = tp2
    assert all(result.returncodes) and not (out / "sink_mixed_untraced.rank0.pt").exists(), \
        "a wrong per-head cut trained silently"
    text = result.outputs[0]
    assert "TensorParallelMismatchError" in text and "'model.blocks.0.attn' (TPBlock[SinkAttention])" in text, \
        text[-3000:]
    assert "['model.blocks.0.attn.sinks'] (leading dimension num_heads=4) are not read per head" in text, text[-3000:]


@pytest.mark.slow
def test_per_head_parameters_tp2_pp2(tmp_path: Path) -> None:
    """One micro-batch: gpt-oss's load-balancing loss is a function of the batch it sees (as in test_moe_parity)."""
    compare_layout(tmp_path, ["hf_gpt_oss_labels", "sink_attention4", "hf_bloom"], tp=2, pp=2,
                   extra=("--schedule", "gpipe", "--microbatches", "1"))
