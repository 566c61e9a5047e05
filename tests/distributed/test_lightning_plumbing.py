"""The Trainer keeps owning the loop under tp=2 x dp=2: logging, metrics, callbacks, evaluation, checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import ROOT, run_ranks
from models import token_dataset


@pytest.fixture(scope="module")
def plumbing(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict]]:
    out = tmp_path_factory.mktemp("plumbing")
    run_ranks(ROOT / "tests" / "distributed" / "worker_plumbing.py", 4, [str(out)], timeout=400).check()
    return out, [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(4)]


def test_metrics_reach_every_rank_and_count_replicas_once(plumbing) -> None:
    _, ranks = plumbing
    for r in ranks:
        assert {"train_loss", "val_loss", "val_samples"} <= set(r["fit_metrics"])
        assert r["fit_metrics"]["val_loss"] == ranks[0]["fit_metrics"]["val_loss"]  # sync_dist over dp
        # 24 validation samples: tp replicas see the same samples and must not be counted twice
        assert r["validate"][0]["val_samples"] == 24.0
        assert r["test"][0]["test_loss"] == ranks[0]["test"][0]["test_loss"]
    # without sync_dist each dp replica logs its own batch, and both tp ranks of a replica agree
    assert ranks[0]["fit_metrics"]["train_loss"] == ranks[1]["fit_metrics"]["train_loss"]
    assert ranks[2]["fit_metrics"]["train_loss"] == ranks[3]["fit_metrics"]["train_loss"]


def test_all_gather_returns_one_entry_per_replica(plumbing) -> None:
    _, ranks = plumbing
    # ranks 0,1 are replica 0 and ranks 2,3 replica 1: gathering over dp gives 2 entries, not 4
    assert ranks[0]["gathered"].flatten().tolist() == [0.0, 2.0]
    assert ranks[1]["gathered"].flatten().tolist() == [1.0, 3.0]


def test_model_summary_counts_whole_model(plumbing) -> None:
    from models import LitLM

    _, ranks = plumbing
    expected = sum(p.numel() for p in LitLM("nanogpt").parameters())
    assert all(r["summary_total"] == expected for r in ranks)
    from lightning.pytorch.utilities.model_summary import summarize
    from worker_plumbing import PlumbingLM

    for depth in (1, -1):  # the model's own classes (not the tensor-parallel swaps) and whole counts on every row
        s = summarize(PlumbingLM(), max_depth=depth)
        rows = list(zip(s.layer_names, s.layer_types, s.param_nums))
        for rank, r in enumerate(ranks):
            assert r["summary_rows"][depth] == rows, (depth, rank, set(r["summary_rows"][depth]) ^ set(rows))


def test_checkpoint_loads_in_one_process_and_predicts_the_same(plumbing, tmp_path: Path) -> None:
    """ModelCheckpoint writes sharded checkpoints (the default); consolidated, one process loads them."""
    from lightning_tpp import consolidate
    from worker_plumbing import PlumbingLM

    out, ranks = plumbing
    assert ranks[0]["best"] and (Path(ranks[0]["last"]) / ".metadata").is_file()
    consolidate(Path(ranks[0]["last"]), tmp_path / "one.ckpt")
    model = PlumbingLM.load_from_checkpoint(tmp_path / "one.ckpt", map_location="cpu")
    model.eval()
    # predict ran after fit on the same weights; replica 0 saw validation samples 0, 2, 4, ... (DistributedSampler)
    x = torch.stack([token_dataset(24, seed=1)[i][0] for i in range(0, 8, 2)])
    with torch.no_grad():
        expected = model(x)
    for r in (ranks[0], ranks[1]):
        torch.testing.assert_close(r["pred0"], expected, rtol=1e-5, atol=1e-5)
    assert ranks[0]["n_preds"] == 3


def test_strategy_name_is_registered(plumbing) -> None:
    _, ranks = plumbing
    assert ranks[0]["strategy_registered"] == "TensorPipeStrategy"


def test_tied_embedding_and_head_stay_one_vocab_parallel_parameter(plumbing) -> None:
    _, ranks = plumbing
    assert all(r["tied"] for r in ranks)
    assert all(r["wte_local_shape"] == (32, 32) for r in ranks)  # vocab 64 split over tp=2
