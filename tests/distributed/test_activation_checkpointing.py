"""Activation checkpointing (``activation_checkpointing=True``: every block recomputed in backward) at parity with
one process: tensor parallelism (the blocks' first-call check and tp scopes under recomputation, a Hugging Face
KV cache updated in the forward), every pipeline schedule (zero-bubble's weight-gradient split on recomputed
products), and tp x pp. The one-process references are the plain runs: recomputation must not change a number."""

from __future__ import annotations

import functools
from pathlib import Path

from launch import ROOT, run_ranks
from parity import assert_parity, load_record, merge_stages, train

SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zb-drain"]
# fewer steps than the other parity tests (the second runs on updated weights): start-up and 4 ranks on 2 cores dominate
STEPS = 2


@functools.lru_cache(maxsize=None)
def reference(name: str):
    return train(name, steps=STEPS)


def _launch(tmp: Path, models: list[str], *, tp: int, pp: int, extra: tuple = ()) -> None:
    args = ["--models", ",".join(models), "--tp", str(tp), "--pp", str(pp), "--out", str(tmp),
            "--activation-checkpointing", "--steps", str(STEPS), *extra]
    run_ranks(ROOT / "tests" / "parity.py", tp * pp, args, timeout=400).check()


def _compare(tmp: Path, name: str, stem: str, *, tp: int, pp: int) -> None:
    for t in range(tp):
        ranks = [s * tp + t for s in range(pp)]
        got = merge_stages([load_record(tmp / f"{stem}.rank{r}.pt") for r in ranks])
        assert_parity(got, reference(name), where=f"{stem} activation checkpointing tp={tp} pp={pp} ranks {ranks}")


def test_tp2(tmp_path: Path) -> None:
    """nanoGPT (fused qkv, views sized from the input) and Hugging Face Llama (a DynamicCache each layer appends to:
    recomputed on a copy)."""
    models = ["nanogpt", "hf_llama", "hf_qwen3"]  # Qwen3: its blocks' gradient check runs outside the checkpoint
    _launch(tmp_path, models, tp=2, pp=1)
    for name in models:
        _compare(tmp_path, name, name, tp=2, pp=1)


def test_pp2_every_schedule(tmp_path: Path) -> None:
    """One launch, each schedule in turn (interleaved with 2 chunks per rank: 4 blocks)."""
    _launch(tmp_path, ["nanogpt4"], tp=1, pp=2, extra=("--schedule", ",".join(SCHEDULES), "--virtual", "2"))
    for schedule in SCHEDULES:
        _compare(tmp_path, "nanogpt4", f"nanogpt4.{schedule}", tp=1, pp=2)


def test_tp2_pp2_zero_bubble(tmp_path: Path) -> None:
    """Llama (rotary side inputs, GQA) over 4 ranks: tensor-parallel blocks recomputed inside pipeline units whose
    backward is split into I and W. A block with its layers inline (``flat_gpt``) is itself the tensor-parallel
    block, the recomputed block and the pipeline unit: its first-call gradient check used to run through the unit's
    checkpoint and stop the first step with a ``CheckpointError`` (another shape recomputed)."""
    models = ["llama", "flat_gpt"]
    _launch(tmp_path, models, tp=2, pp=2, extra=("--schedule", "zero-bubble"))
    for name in models:
        _compare(tmp_path, name, name, tp=2, pp=2)
