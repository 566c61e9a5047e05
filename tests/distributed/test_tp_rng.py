"""Dropout under tensor parallelism (Megatron's RNG contract): independent masks across tp ranks over sharded
activations (attention probabilities of each rank's heads, the MLP hidden), the same mask over replicated ones (the
residual branches, so replicas stay equal); activation checkpointing recomputes the same masks. The masks over shards
come from the strategy's own stream: the user's generator moves as in one process without them."""

from __future__ import annotations

import pytest
import torch

from launch import ROOT, run_ranks
from worker_tp_rng import one_process_rng


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out = tmp_path_factory.mktemp("tp_rng")
    run_ranks(ROOT / "tests" / "distributed" / "worker_tp_rng.py", 2, [str(out)], timeout=300).check()
    return [torch.load(out / f"tp_rng.rank{r}.pt") for r in range(2)]


def test_dropout_masks_per_tp_rank(ranks: list[dict]) -> None:
    plain = [r[(False, False)] for r in ranks]
    for kind in ("attn", "hidden", "resid"):
        a, b = plain[0]["masks"][kind], plain[1]["masks"][kind]
        assert len(a) == len(b) >= 4 and all(x.shape == y.shape for x, y in zip(a, b))
        if kind != "attn":  # (attention probabilities are also zero above the diagonal)
            assert all(0.2 < float(m.float().mean()) < 0.4 for m in a + b), kind  # p = 0.3 drawn
        if kind == "resid":
            assert all(torch.equal(x, y) for x, y in zip(a, b)), "replicated activations got different masks"
        else:
            assert not any(torch.equal(x, y) for x, y in zip(a, b)), f"{kind}: the tp ranks drew the same mask"
    assert plain[0]["losses"] == plain[1]["losses"]
    # recomputed in backward (activation checkpointing): the same masks, losses and gradients
    recomputed = [r[(True, False)] for r in ranks]
    for rank in range(2):
        assert recomputed[rank]["recomputed"] == 2
        for kind in ("attn", "hidden", "resid"):
            assert all(torch.equal(x, y) for x, y in zip(recomputed[rank]["masks"][kind], plain[rank]["masks"][kind]))
        assert recomputed[rank]["losses"] == plain[rank]["losses"]
        for got, want in zip(recomputed[rank]["grads"], plain[rank]["grads"]):
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)


def test_dropout_masks_on_sequence_shards(ranks: list[dict]) -> None:
    """sequence_parallel: a residual dropout outside the attention and MLP drops this rank's part of the sequence,
    with its own stream (Megatron forks the tensor-parallel RNG there), so the two halves of the sequence do not get
    one mask twice; the MLP hidden (tp-sharded) as before; recomputation draws the same masks."""
    plain = [r[(False, True)] for r in ranks]
    for kind in ("hidden", "resid"):
        a, b = plain[0]["masks"][kind], plain[1]["masks"][kind]
        assert len(a) == len(b) >= 4 and all(0.2 < float(m.float().mean()) < 0.4 for m in a + b), kind
        assert not any(torch.equal(x, y) for x, y in zip(a, b)), f"{kind}: the tp ranks drew the same mask"
    assert all(m.shape[1] == 8 for m in plain[0]["masks"]["resid"]), "the residual is not a sequence shard"
    assert plain[0]["losses"] == plain[1]["losses"]
    for rank in range(2):
        again = ranks[rank][(True, True)]
        for kind in ("hidden", "resid"):
            assert all(torch.equal(x, y) for x, y in zip(again["masks"][kind], plain[rank]["masks"][kind]))
        assert again["losses"] == plain[rank]["losses"]


@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "sequence_parallel"])
def test_masks_over_shards_leave_the_users_stream_alone(ranks: list[dict], sequence: bool) -> None:
    """After every step the user's generator stands where one process's does with the dropouts over shards off:
    the replicated ones draw from it as one process does, those over shards draw nothing from it (they used to take
    one draw each), recomputation included."""
    want = one_process_rng(sequence)
    assert len(want) == 3 and len(set(want)) == (1 if sequence else 3)  # sequence shards: every dropout on shards
    for rank in range(2):
        for recompute in (False, True):
            assert ranks[rank][(recompute, sequence)]["rng"] == want, (rank, recompute)


def _same_run(got: dict, want: dict, where: str) -> None:
    assert got["losses"] == want["losses"], where
    assert got["rng"] == want["rng"], f"{where}: the user's generator moved otherwise"
    assert len(got["grads"]) == len(want["grads"]) == 3
    for g, w in zip(got["grads"], want["grads"]):
        for name in w:
            torch.testing.assert_close(g[name], w[name], rtol=1e-6, atol=1e-7, msg=f"{where}: {name}")


@pytest.mark.parametrize("sequence", [False, True], ids=["tp", "sequence_parallel"])
@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recomputed"])
def test_compiled_blocks_draw_the_eager_masks_without_a_graph_break(ranks: list[dict], recompute: bool,
                                                                    sequence: bool) -> None:
    """compile= (aot_eager, whose graphs run eager's kernels): dropout over tp shards (attention probabilities, the
    MLP hidden; under sequence parallelism the residual too) is drawn inside the block's graph, from the same keys,
    so the run is the eager one (losses, gradients, the user's generator), with no graph break and no recompile
    after the first compiled step. Before, the stream's key broke the block's graph (the block fell back to eager
    with other masks), and a recomputed block stopped the step (AmbiguousRecomputationError: the compiled check's
    calls had been counted as the step's)."""
    for rank in range(2):
        got = ranks[rank][("compiled", recompute, sequence)]
        _same_run(got, ranks[rank][(recompute, sequence)], f"rank {rank}")
        assert (got["breaks"], got["recompiles"]) == (0, 0)


@pytest.mark.parametrize("recompute", [False, True], ids=["plain", "recomputed"])
def test_compiled_attention_dropout_over_heads(ranks: list[dict], recompute: bool) -> None:
    """``scaled_dot_product_attention(dropout_p=...)`` over this rank's heads (GPT-2 under SDPA), compiled: one
    operator drawn from the rank's seed, its backward the attention again from that seed; the same run as eager's
    (recomputed or not: the same masks), no graph break, no recompile."""
    for rank in range(2):
        got = ranks[rank][("sdpa compiled", recompute)]
        _same_run(got, ranks[rank][("sdpa", False)], f"rank {rank}")
        assert (got["breaks"], got["recompiles"]) == (0, 0)
    assert ranks[0][("sdpa", False)]["losses"] == ranks[1][("sdpa", False)]["losses"]


def test_compiled_attention_dropout_after_whole_width_norms(ranks: list[dict]) -> None:
    """OLMo-2's q/k norms run on gathered columns and are cut back to this rank's: their output is this rank's heads
    (marked so by the layer: inside a graph nothing made through the gather's Function is followed). Before, the
    compiled block drew that dropout from the global stream (one mask for every rank's heads, not eager's: this test
    fails), and where nothing else draws (Hugging Face OLMo-2 with attention dropout) the compiled check stopped the
    second step (CompiledMismatchError, 0.26 off)."""
    for rank in range(2):
        got = ranks[rank][("qknorm compiled", False)]
        _same_run(got, ranks[rank][("qknorm", False)], f"rank {rank}")
        assert (got["breaks"], got["recompiles"]) == (0, 0)
