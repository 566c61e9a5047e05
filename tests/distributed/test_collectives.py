"""Megatron's communication volume: a transformer block costs 2 all-reduces forward and 2 backward, nothing else.

Sibling projections that read the same tensor (q, k, v; gate, up; MultiheadAttention's query/key/value) must share
one backward all-reduce, not one each."""

from __future__ import annotations

import json

import pytest

from launch import ROOT, run_ranks


@pytest.fixture(scope="module")
def counts(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("collectives")
    run_ranks(ROOT / "tests" / "distributed" / "worker_collectives.py", 2, [str(out)], timeout=200).check()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.parametrize("block", ["nanogpt_block", "llama_block", "encoder_layer"])
def test_two_all_reduces_each_way(counts: list[dict], block: str) -> None:
    for rank_counts in counts:
        assert rank_counts[block] == {"forward_all_reduce": 2, "forward_all_gather": 0,
                                      "backward_all_reduce": 2, "backward_all_gather": 0}, block
