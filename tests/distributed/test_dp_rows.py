"""Vocabulary matrices cut by rows over dp (``data_parallel.rows``): outputs, input gradients and weight gradients
against the whole layer, in 3 processes; and the tensor-parallel all-gather of a large tensor, received in pieces."""

from __future__ import annotations

import json

import pytest

from launch import ROOT, run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("dp_rows")
    run_ranks(ROOT / "tests" / "distributed" / "worker_dp_rows.py", 3, [str(out)], timeout=200).check()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


@pytest.mark.parametrize("layer", ["embedding", "scaled", "linear"])
def test_rows_over_dp_match_the_whole_layer(results: list[dict], layer: str) -> None:
    for rank, got in enumerate(results):
        checks = {k: v for k, v in got[layer].items() if not k.endswith(".rows")}
        assert all(checks.values()), f"rank {rank}: {layer} differs: {checks}"


def test_large_gather_along_the_last_dim_is_exact(results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert got["gather"] == {"out": True, "grad": True, "pieces_needed": True}, rank


def test_uneven_rows(results: list[dict]) -> None:
    assert [r["embedding"]["weight.rows"] for r in results] == [3, 3, 1]
    assert [r["scaled"]["weight.rows"] for r in results] == [1, 1, 0]
    assert [r["linear"]["bias.rows"] for r in results] == [3, 3, 1]


def test_other_use_of_the_weight_is_named(results: list[dict]) -> None:
    assert "layer: its forward uses its weight in" in results[0]["misuse"]
    assert "vocab_exchange=False" in results[0]["misuse"]
    assert "layer: F.linear on its dp-row-sharded weight with a bias that is not its own (shape (6,))" in \
        results[0]["foreign_bias"]
    assert "layer: F.embedding with max_norm, scale_grad_by_freq or sparse" in results[0]["max_norm"]
    assert all("vocab_exchange=False" in r[k] for r in results for k in ("foreign_bias", "max_norm"))


def test_row_counts_follow_dtensor() -> None:
    import torch
    from torch.distributed.tensor.placement_types import Shard

    from lightning_tpp.data_parallel.rows import row_counts

    for rows in (0, 1, 2, 7, 16, 17):
        for parts in (1, 2, 3, 4):
            want = [Shard(0)._local_shard_size_and_offset(rows, parts, r)[0] for r in range(parts)]
            assert row_counts(rows, parts) == want, (rows, parts)
            assert sum(row_counts(rows, parts)) == rows
    del torch
