"""Dropout under tensor parallelism (Megatron's RNG contract): independent masks across tp ranks over sharded
activations (attention probabilities of each rank's heads, the MLP hidden), the same mask over replicated ones (the
residual branches, so replicas stay equal); activation checkpointing recomputes the same masks."""

from __future__ import annotations

from pathlib import Path

import torch

from launch import ROOT, run_ranks


def test_dropout_masks_per_tp_rank(tmp_path: Path) -> None:
    run_ranks(ROOT / "tests" / "distributed" / "worker_tp_rng.py", 2, [str(tmp_path)], timeout=300).check()
    ranks = [torch.load(tmp_path / f"tp_rng.rank{r}.pt") for r in range(2)]
    plain = [r[False] for r in ranks]
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
    recomputed = [r[True] for r in ranks]
    for rank in range(2):
        assert recomputed[rank]["recomputed"] == 2
        for kind in ("attn", "hidden", "resid"):
            assert all(torch.equal(x, y) for x, y in zip(recomputed[rank]["masks"][kind], plain[rank]["masks"][kind]))
        assert recomputed[rank]["losses"] == plain[rank]["losses"]
        for got, want in zip(recomputed[rank]["grads"], plain[rank]["grads"]):
            for name in want:
                torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-7, msg=name)
