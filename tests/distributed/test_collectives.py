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
        assert rank_counts[block] == {"forward_all_reduce": 2, "forward_all_gather": 0, "forward_reduce_scatter": 0,
                                      "backward_all_reduce": 2, "backward_all_gather": 0,
                                      "backward_reduce_scatter": 0}, block


@pytest.mark.parametrize("block", ["nanogpt_block", "llama_block"])
def test_sequence_parallel_replaces_each_all_reduce(counts: list[dict], block: str) -> None:
    """Megatron-SP: each all-reduce becomes an all-gather before the attention/MLP and a reduce-scatter after it
    (backward: the reduce-scatter of the column layers' input gradients, the all-gather of the row outputs' and,
    as Megatron, a second all-gather of the attention/MLP input, which is saved for the weight gradients as a
    shard)."""
    for rank_counts in counts:
        assert rank_counts[f"{block}_sp"] == {"forward_all_reduce": 0, "forward_all_gather": 2,
                                              "forward_reduce_scatter": 2, "backward_all_reduce": 0,
                                              "backward_all_gather": 4, "backward_reduce_scatter": 2}, block


def test_sequence_parallel_flat_block(counts: list[dict]) -> None:
    """A block that holds its projections (nn.TransformerEncoderLayer's linear1/linear2) is gathered whole at its
    entry and cut at its exit: one all-gather more each way than tensor parallelism alone."""
    for rank_counts in counts:
        assert rank_counts["encoder_layer_sp"] == {"forward_all_reduce": 2, "forward_all_gather": 1,
                                                   "forward_reduce_scatter": 0, "backward_all_reduce": 2,
                                                   "backward_all_gather": 1, "backward_reduce_scatter": 0}


def test_context_parallel_head_with_a_vocabulary_cp_does_not_divide(counts: list[dict]) -> None:
    """cp's LM head (``context_parallel.head``) over 2 ranks, vocabulary 7: 4 and 3 columns; the loss from the columns
    (label smoothing, an ignored target), the gathered logits, the input's gradient and the weight's and bias's
    (averaged over the ranks, as the strategy does) are one process's."""
    for rank, rank_counts in enumerate(counts):
        got = dict(rank_counts["uneven_head"])
        assert got.pop("columns") == (4, 3)[rank]
        assert all(v < 1e-6 for v in got.values()), got
