"""GPU paths (NCCL, device placement, fp16/bf16 autocast): parity at tp=2 on two GPUs. Skipped without them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import ROOT, run_ranks
from parity import assert_parity, load_record, train

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")]


@pytest.mark.parametrize(("precision", "tol"), [("32-true", 1e-4), ("bf16-mixed", 2e-2), ("16-mixed", 1e-2)])
def test_tp2_parity_nccl(tmp_path: Path, precision: str, tol: float) -> None:
    """fp32 tolerance 1e-4: cuBLAS picks different kernels (and TF32 may be on) for the split matmuls."""
    models = ["nanogpt", "llama", "encoder"]
    run_ranks(ROOT / "tests" / "parity.py", 2, ["--models", ",".join(models), "--tp", "2", "--out", str(tmp_path),
                                                "--accelerator", "gpu", "--precision", precision,
                                                "--steps", "3"], timeout=400).check()
    for name in models:
        ref = train(name, accelerator="gpu", precision=precision, steps=3)
        for rank in range(2):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, rtol=tol, atol=tol,
                          where=f"{name} {precision} rank {rank}")


def test_tp1_pp2_parity_nccl(tmp_path: Path) -> None:
    """Pipeline P2P over NCCL (1F1B, zero-bubble, zb-drain: weight gradients filed on the GPU and run in W; zb-lead:
    three forwards sent before the first gradient comes back), tied embeddings, device placement of received
    tensors."""
    from parity import merge_stages

    for schedule in ("1f1b", "zero-bubble", "zb-drain", "zb-lead"):
        out = tmp_path / schedule
        out.mkdir()
        run_ranks(ROOT / "tests" / "parity.py", 2, ["--models", "nanogpt,llama", "--pp", "2", "--out", str(out),
                                                    "--accelerator", "gpu", "--schedule", schedule, "--steps", "3"],
                  timeout=400).check()
        for name in ("nanogpt", "llama"):
            ref = train(name, accelerator="gpu", steps=3)
            got = merge_stages([load_record(out / f"{name}.rank{r}.pt") for r in range(2)])
            assert_parity(got, ref, rtol=1e-4, atol=1e-4, where=f"{name} {schedule}")


def test_dp2_vocab_exchange_nccl(tmp_path: Path) -> None:
    """FSDP2 over dp on NCCL with the embedding and head computed over dp (``data_parallel.rows``: all-gather of the
    tokens, all-to-all of the logits on the GPUs), a tied embedding/head included."""
    models = ["nanogpt", "hf_gpt2"]
    run_ranks(ROOT / "tests" / "parity.py", 2, ["--models", ",".join(models), "--dp", "2", "--out", str(tmp_path),
                                                "--accelerator", "gpu", "--steps", "3"], timeout=400).check()
    for name in models:
        ref = train(name, accelerator="gpu", steps=3, dp=2)
        for rank in range(2):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, rtol=1e-4, atol=1e-4,
                          where=f"{name} dp2 rank {rank}")
