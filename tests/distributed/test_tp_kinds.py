"""Block kinds under tensor parallelism (issue #44 item 4), at parity with one process and sharded: a gated MLP
whose gate and up projections are one layer split by ``chunk`` or slicing (hand-written, and ModernBERT's ``Wi``
in a masked LM); state-space mixers cut by channels and heads (a hand-written Mamba-2, Hugging Face's Bamba with
Mamba-2 mixers of two groups, Hugging Face's Mamba with x_proj / dt_proj): at most 0.6 of the parameters per rank."""

from __future__ import annotations

from pathlib import Path

from launch import ROOT, run_ranks
from parity import assert_parity, load_record, train


def _tp2(tmp_path: Path, models: list[str]) -> None:
    args = ["--models", ",".join(models), "--tp", "2", "--out", str(tmp_path), "--steps", "3"]
    run_ranks(ROOT / "tests" / "parity.py", 2, args, timeout=300).check()
    for name in models:
        ref = train(name, steps=3)
        for rank in range(2):
            record = load_record(tmp_path / f"{name}.rank{rank}.pt")
            assert_parity(record, ref, where=f"{name} tp=2 rank {rank}")
            assert record.local_fraction <= 0.6, (name, record.local_fraction)


def test_fused_gated_mlps_tp2(tmp_path: Path) -> None:
    _tp2(tmp_path, ["fused_glu", "hf_mlm_tokens"])


def test_mamba_mixers_tp2(tmp_path: Path) -> None:
    _tp2(tmp_path, ["mamba2", "hf_bamba", "hf_mamba"])
