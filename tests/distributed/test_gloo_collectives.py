"""The strategy's collectives over gloo, sent point to point (``core.collectives``), against sums computed from every
rank's input, and FSDP2 with them against FSDP2 with its own (4 ranks)."""

from __future__ import annotations

import json

from launch import ROOT, run_ranks


def test_point_to_point_collectives_and_fsdp2_with_them(tmp_path) -> None:
    run_ranks(ROOT / "tests" / "distributed" / "worker_gloo_collectives.py", 4, [str(tmp_path)], timeout=200).check()
    for rank in range(4):
        result = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert result["problems"] == [], (rank, result["problems"])
        # FSDP2's own: gloo's all-gather and reduce-scatter; the strategy's: neither of gloo's ring collectives
        assert result["ref_calls"]["all_gather_single"] > 0 and result["ref_calls"]["reduce_scatter_single"] > 0
        assert set(result["calls"].values()) == {0}, result
