"""Weights from a Hugging Face safetensors file (``TensorPipeStrategy(weights=...)``) at tp2 (x dp2) and tp2 x pp2
train exactly as one process whose model was loaded by ``from_pretrained``: losses, gradients and updated parameters
by single-device name. The file's weights differ from the module's own initialisation, so a load that did nothing
fails. The tp2 run's sharded checkpoint (tp-sharded entries stored in one chunk per rank) loads back in one process."""

from __future__ import annotations

from pathlib import Path

import torch

from launch import ROOT, run_ranks
from parity import assert_parity, load_record, merge_stages, train

SCRIPT = ROOT / "tests" / "distributed" / "worker_weights.py"


def test_safetensors_into_layouts_equals_one_process(tmp_path: Path) -> None:
    import transformers

    from lightning_tpp.checkpoint.weights import load_weights
    from lightning_tpp.core.params import ParamNames, ShardIndex
    from models import HFCausalLM, LitLM

    torch.manual_seed(123)  # not the seed the runs build their modules with
    HFCausalLM("llama").model.save_pretrained(tmp_path / "hf")
    run_ranks(SCRIPT, 4, [str(tmp_path), str(tmp_path / "hf" / "model.safetensors")], timeout=300).check()

    def from_pretrained(module: LitLM) -> None:
        module.model.model = transformers.LlamaForCausalLM.from_pretrained(tmp_path / "hf",
                                                                           attn_implementation="sdpa")

    for tp, pp, dp in ((2, 1, 2), (2, 2, 1)):
        reference = train("hf_llama", dp=dp, steps=2, prepare=from_pretrained)
        for d in range(dp):
            for t in range(tp):
                ranks = [(d * pp + s) * tp + t for s in range(pp)]
                records = [load_record(tmp_path / f"tp{tp}pp{pp}dp{dp}.rank{r}.pt") for r in ranks]
                assert pp == 1 or "model.model.lm_head.weight" not in records[0].params  # a stage holds its part
                got = merge_stages(records)
                assert_parity(got, reference, where=f"weights= at tp={tp} pp={pp} dp={dp}, ranks {ranks}")
        if pp == 1:  # the run's sharded checkpoint as weights, in one process
            module = LitLM("hf_llama")
            load_weights(module, tmp_path / "run.ckpt", names=ParamNames.of(module), shards=ShardIndex(),
                         tp_rank=0, tp_size=1)
            for name, p in module.named_parameters():
                torch.testing.assert_close(p, reference.params[name], rtol=1e-5, atol=1e-6, msg=name)
