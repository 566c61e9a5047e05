"""``TensorPipeStrategy(layout="auto")`` at 4 processes: it trains at parity with one process whatever it chose,
and with ``device_memory`` below what the naive layout (pp only, nothing sharded) needs, the choice fits the budget
(the memory planner's full estimate of the chosen layout, not only the search's arithmetic, and the tensor bytes
each rank measured at its peak: parameters, gradients, optimizer state and the activations saved for backward).
A mixture of experts with ``tp="auto"`` and ``ep=2``: the searched layout carries ep into the strategy's groups and
trains at parity (each replica's batch a batch of its own in the reference: the load-balancing loss is not a mean
over samples). At 2048 positions with a budget only cp=2 meets, ``layout="auto"`` chooses context parallelism and
trains at parity."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import worker_layout  # noqa: F401 - registers the model the ranks train
from launch import ROOT, run_ranks
from models import MODELS, SEQ
from parity import assert_parity, load_record, merge_stages, train

from lightning_tpp import estimate_memory
from lightning_tpp.layout import Layout, layout_memory, profile_model
from lightning_tpp.layout.search import enumerate_layouts

BATCH = 4


def test_layout_auto_trains_at_parity_and_fits_a_budget_the_naive_layout_does_not(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = MODELS["llama4"]()
    profile = profile_model(model, seq_len=SEQ)
    naive = layout_memory(profile, Layout(1, 4, 1, microbatches=BATCH, schedule="1f1b"), batch=BATCH,
                          backend="gloo").total  # the search assumes AdamW's states (it runs before
                                                               # configure_optimizers): conservative for SGD
    budget = 0.8 * naive * 1.1  # below the naive layout's need once the search's 10% margin is added
    args = ["--model", "llama4", "--out", str(tmp_path), "--device-memory", str(budget), "--batch-size", str(BATCH)]
    run_ranks(ROOT / "tests" / "distributed" / "worker_layout.py", 4, args, timeout=300).check()
    infos = [json.loads((tmp_path / f"layout.rank{r}.json").read_text()) for r in range(4)]
    assert all(i["layout"] == infos[0]["layout"] for i in infos), f"ranks chose differently: {infos}"
    chosen = Layout(**infos[0]["layout"])
    assert infos[0]["dims"] == [chosen.dp, chosen.pp, chosen.tp, chosen.cp]
    assert any("memory" in r for r in infos[0]["dropped"]), "the budget dropped nothing: it tests nothing"
    assert infos[0]["memory"] * 1.1 <= budget
    full = estimate_memory(model, tp=chosen.tp, pp=chosen.pp, dp=chosen.dp, microbatches=chosen.microbatches
                           if chosen.pp > 1 else None, batch_size=BATCH * chosen.dp, seq_len=SEQ,
                           schedule=chosen.schedule, backend="gloo",
                           activation_checkpointing=chosen.activation_checkpointing, dp_shard=chosen.sharded)
    assert full.largest.total <= budget / 1.1 * 1.15, (  # the search's arithmetic within 15% of the planner's
        f"{chosen.describe()}: the planner finds {full.largest.total} bytes, the budget is {budget}")
    peaks = [i["measured_peak"] for i in infos]
    print(f"chose {chosen.describe()} under a budget of {budget:.0f} bytes (naive layout: {naive:.0f}); "
          f"planned {infos[0]['memory']:.0f}, measured per rank {peaks}")
    assert all(0 < p <= budget for p in peaks), (  # measured: parameters, gradients, states, saved activations
        f"{chosen.describe()}: ranks hold {peaks} tensor bytes at their peak, the budget is {budget:.0f}")
    ref = train("llama4", dp=chosen.dp, steps=3, batch_size=BATCH)
    for d in range(chosen.dp):
        for t in range(chosen.tp):
            ranks = [(d * chosen.pp + s) * chosen.tp + t for s in range(chosen.pp)]
            got = merge_stages([load_record(tmp_path / f"llama4.rank{r}.pt") for r in ranks])
            assert_parity(got, ref, where=f"layout='auto' chose {chosen.describe()}, ranks {ranks}")


def _mixture_of_experts(tmp_path: Path, ep: str) -> tuple[Layout, list[dict]]:
    """Mixtral on 4 processes with ``--ep`` (worker_layout): the layout every rank took (the same), at parity with one
    process computing each replica's batch apart (the load-balancing loss is not a mean over samples)."""
    name = "hf_mixtral_labels"
    args = ["--model", name, "--out", str(tmp_path), "--batch-size", str(BATCH), "--ep", ep]
    run_ranks(ROOT / "tests" / "distributed" / "worker_layout.py", 4, args, timeout=300).check()
    infos = [json.loads((tmp_path / f"layout.rank{r}.json").read_text()) for r in range(4)]
    assert all(i["layout"] == infos[0]["layout"] for i in infos), f"ranks chose differently: {infos}"
    chosen = Layout(**infos[0]["layout"])
    assert all(i["ep_group"] == chosen.ep for i in infos), infos
    ref = train(name, dp=chosen.dp, replicas_apart=True, accumulate=chosen.dp, batch_size=BATCH, steps=3)
    ref.losses = torch.tensor(ref.losses).view(-1, chosen.dp).sum(dim=1).tolist()  # each replica's loss / dp
    ref.buffers = ref.buffers[chosen.dp - 1::chosen.dp]
    for r in range(4):
        assert_parity(load_record(tmp_path / f"{name}.rank{r}.pt"), ref,
                      where=f"--ep {ep} chose {chosen.describe()}, rank {r}")
    return chosen, infos


def test_tp_auto_with_ep_on_a_mixture_of_experts_trains_at_parity(tmp_path: Path) -> None:
    chosen, infos = _mixture_of_experts(tmp_path, "2")
    assert chosen.ep == 2 and chosen.pp == 1, chosen
    assert all(" ep=2 " in r for r in infos[0]["ranked"]) and len(infos[0]["ranked"]) > 1  # tp (and dp) searched


@pytest.mark.slow
def test_ep_auto_searches_ep_alone_and_trains_at_parity(tmp_path: Path) -> None:
    """``ep="auto"`` at tp=1 on 4 processes: only ep (and dp, micro-batches, schedule) searched, tp kept; the choice
    carried into the strategy's groups, at parity."""
    chosen, infos = _mixture_of_experts(tmp_path, "auto")
    assert chosen.tp == 1 and chosen.pp == 1, chosen
    assert {r.split(" ep=")[1].split()[0] if " ep=" in r else "1" for r in infos[0]["ranked"]} > {"1"}  # ep searched


def test_layout_auto_chooses_cp_where_only_cp_fits_and_trains_at_parity(tmp_path: Path) -> None:
    """2 processes, sequences of 2048 positions, one per process, a budget below every layout without cp (tp2, pp2,
    dp2: the search's arithmetic) but above cp2's: layout="auto" chooses cp=2 at setup, builds its groups, and
    trains at parity with one process; the tensor bytes each rank measured at its peak stay inside the budget. With
    cp_mode="auto" the search ranks both modes of each cp layout and the strategy runs the one it chose."""
    torch.manual_seed(0)
    model, seq, batch = MODELS["llama4"](), 2048, 1
    profile = profile_model(model, seq_len=seq)
    need = {lay.describe(): layout_memory(profile, lay, batch=batch, backend="gloo").total
            for lay in enumerate_layouts(profile, world=2, devices_per_node=2, batch=batch)}
    without = min(v for k, v in need.items() if " cp=" not in k)
    with_cp = min(v for k, v in need.items() if " cp=2 " in k)
    assert with_cp < 0.9 * without, need
    budget = (with_cp + without) / 2 * 1.1  # the search's 10% margin on top
    args = ["--model", "llama4", "--out", str(tmp_path), "--device-memory", str(budget), "--batch-size", str(batch),
            "--seq", str(seq), "--cp-mode", "auto"]
    run_ranks(ROOT / "tests" / "distributed" / "worker_layout.py", 2, args, timeout=300).check()
    infos = [json.loads((tmp_path / f"layout.rank{r}.json").read_text()) for r in range(2)]
    assert all(i["layout"] == infos[0]["layout"] for i in infos), f"ranks chose differently: {infos}"
    chosen = Layout(**infos[0]["layout"])
    assert chosen.cp == 2 and infos[0]["dims"] == [1, 1, 1, 2], infos[0]
    assert all(" cp=" in r for r in infos[0]["ranked"]), infos[0]["ranked"]  # nothing without cp fit
    assert any(" cp=2 a2a " in r for r in infos[0]["ranked"]) and any(" cp=2 dp" in r for r in infos[0]["ranked"])
    assert infos[0]["cp_mode"] == chosen.cp_mode in ("allgather", "a2a"), (infos[0]["cp_mode"], chosen)
    assert (infos[0]["a2a_calls"] > 0) == (chosen.cp_mode == "a2a"), infos[0]  # the mode chosen is the one run
    peaks = [i["measured_peak"] for i in infos]
    assert all(0 < p <= budget for p in peaks), f"{chosen.describe()}: peaks {peaks}, budget {budget:.0f}"
    ref = train("llama4", steps=3, batch_size=batch, seq=seq)
    for r in range(2):
        assert_parity(load_record(tmp_path / f"llama4.rank{r}.pt"), ref,
                      where=f"layout='auto' chose {chosen.describe()}, rank {r}")
