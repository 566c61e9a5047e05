"""`lightning-tpp consolidate` and `lightning-tpp export-hf` on a sharded checkpoint written at tp=2."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import torch

from launch import ROOT, run_ranks
from models import LitLM


def test_consolidate_and_export_hf(tmp_path: Path) -> None:
    import transformers

    ckpt = tmp_path / "hf.ckpt"
    run_ranks(ROOT / "tests" / "distributed" / "worker_export.py", 2, [str(ckpt)], timeout=200).check()
    assert (ckpt / ".metadata").is_file()
    env_path = f"{ROOT}:{ROOT / 'tests'}"
    cli = [sys.executable, "-m", "lightning_tpp"]
    subprocess.run([*cli, "consolidate", str(ckpt), str(tmp_path / "one.ckpt")], check=True, timeout=120,
                   env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    lit = LitLM.load_from_checkpoint(tmp_path / "one.ckpt", map_location="cpu").eval()
    subprocess.run([*cli, "export-hf", str(ckpt), str(tmp_path / "hf"), "--module", "models.LitLM"], check=True,
                   timeout=120, env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"})
    hf = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf").eval()
    x = torch.randint(0, 64, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(hf(input_ids=x).logits, lit(x), rtol=1e-5, atol=1e-5)
    import lightning as L

    L.seed_everything(0, verbose=False)  # the initial weights of the run: the checkpoint holds trained ones
    initial = LitLM("hf_llama").model.model.model.layers[0].self_attn.q_proj.weight
    assert not torch.equal(lit.model.model.model.layers[0].self_attn.q_proj.weight, initial)
