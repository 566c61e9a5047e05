"""The data-parallel gradient reduction (``core.grads``) in 3 processes: values equal the average computed from
every rank's gradients, bit for bit; a gradient missing on some ranks counts as zeros there and one missing
everywhere stays ``None``; one all-reduce per flat bucket (the presence of each gradient rides in the bucket)."""

from __future__ import annotations

import json

import pytest

from launch import ROOT, run_ranks


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("grad_reduce")
    run_ranks(ROOT / "tests" / "distributed" / "worker_grad_reduce.py", 3, [str(out)], timeout=120).check()
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(3)]


def test_average_equals_the_mean_of_every_ranks_gradient(results: list[dict]) -> None:
    for rank, got in enumerate(results):
        assert got["values"] == {"every": True, "only_first": True, "strided": True, "double": True}, rank
        assert got["strided_layout"], rank


def test_a_gradient_missing_everywhere_stays_none(results: list[dict]) -> None:
    assert all(got["nowhere_none"] for got in results)


def test_one_all_reduce_per_bucket_and_nothing_else(results: list[dict]) -> None:
    for got in results:
        assert got["calls"] == ["all_reduce", "all_reduce"]  # float32 and float64 buckets


def test_sum_divided_by_a_given_divisor(results: list[dict]) -> None:
    for got in results:
        assert got["divisor"] == [3.0, 3.0, 3.0]  # (1 + 2 + 3) / 2
