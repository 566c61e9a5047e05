"""Pipelines under the Trainer: logged values (tensors, torchmetrics, reduce_fx) reach every rank identically;
validation (with the sanity check first), test and predict run through the pipeline; checkpoints hold the whole
model and load in one process; ModelSummary counts the whole model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.utilities.model_summary import summarize

from launch import ROOT, run_ranks
from models import token_dataset


@pytest.fixture(scope="module", params=[(1, 2, 2), (2, 2, 1)], ids=["pp2xdp2", "tp2xpp2"])
def pp_run(request, tmp_path_factory: pytest.TempPathFactory) -> tuple[tuple[int, int, int], list[dict]]:
    tp, pp, dp = request.param
    out = tmp_path_factory.mktemp("pp_plumbing")
    run = run_ranks(ROOT / "tests" / "distributed" / "worker_pp_plumbing.py", tp * pp * dp,
                    [str(out), str(tp), str(pp), str(dp)], timeout=400).check()
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(tp * pp * dp)]
    ranks[0]["output"] = run.outputs[0]
    return request.param, ranks


def test_logged_values_identical_on_every_stage(pp_run) -> None:
    (tp, pp, dp), ranks = pp_run
    for r in ranks:
        assert {"train_loss", "train_acc", "tokens", "val_loss", "val_samples"} <= set(r["fit_metrics"])
        assert r["fit_metrics"]["tokens"] == 64.0  # reduce_fx="sum" over the micro-batches of a 4 x 16 batch
        assert r["validate"][0]["val_samples"] == 24.0  # torchmetrics state copied, replicas counted once
        for key in ("val_loss", "val_samples", "train_acc"):
            assert r["fit_metrics"][key] == ranks[0]["fit_metrics"][key], key
    per_replica = tp * pp
    for replica in range(dp):
        group = ranks[replica * per_replica:(replica + 1) * per_replica]
        assert len({r["fit_metrics"]["train_loss"] for r in group}) == 1


def test_predict_and_checkpoint(pp_run, tmp_path: Path) -> None:
    from lightning_tpp import consolidate
    from worker_pp_plumbing import PipeLM

    (tp, pp, dp), ranks = pp_run
    consolidate(Path(ranks[0]["last"]), tmp_path / "one.ckpt")
    model = PipeLM.load_from_checkpoint(tmp_path / "one.ckpt", map_location="cpu")
    model.eval()
    val = token_dataset(24, seed=1)
    for rank, r in enumerate(ranks):
        replica = rank // (tp * pp)
        assert len(r["preds"]) == (3 if dp == 2 else 6)
        x = torch.stack([val[i][0] for i in range(replica, 8 * dp, dp)][:4])
        with torch.no_grad():
            torch.testing.assert_close(r["preds"][0], model(x), rtol=1e-5, atol=1e-5)


def test_summary_and_stage_state_dicts(pp_run) -> None:
    from worker_pp_plumbing import PipeLM

    (tp, pp, dp), ranks = pp_run
    full = PipeLM()
    expected_keys = set(full.state_dict())
    assert all(r["summary_total"] == sum(p.numel() for p in full.parameters()) for r in ranks)
    for depth in (1, -1):  # the model's own classes and whole counts on every row, other stages' modules included
        s = summarize(full, max_depth=depth)
        rows = list(zip(s.layer_names, s.layer_types, s.param_nums))
        for rank, r in enumerate(ranks):
            assert r["summary_rows"][depth] == rows, (depth, rank, set(r["summary_rows"][depth]) ^ set(rows))
    union = set()
    for r in ranks:
        assert set(r["state_keys"]) <= expected_keys  # a stage's keys keep the single-device names
        assert len(r["state_keys"]) < len(expected_keys)  # and other stages' parameters are gone
        union |= set(r["state_keys"])
    assert union == expected_keys


def test_plan_table_is_the_whole_models(pp_run) -> None:
    """Under tp x pp rank 0's plan table lists both pipeline ranks' modules and compares with the model's total."""
    from lightning.pytorch.utilities.model_summary.model_summary import get_human_readable_count
    from worker_pp_plumbing import PipeLM

    (tp, pp, dp), ranks = pp_run
    if tp == 1:
        pytest.skip("no tensor-parallel plan at tp=1")
    table = ranks[0]["output"].split("Tensor-parallel plan")[1].split("Pipeline partition")[0]
    assert "\n0  " in table and "\n1  " in table, table  # rows of pp rank 0 and of pp rank 1
    total = get_human_readable_count(sum(p.numel() for p in PipeLM().parameters()))
    assert f"of {total} in the model" in table, table
