"""Models built on the meta device (``configure_model``): each rank allocates only its own shards, and one seed gives
the same weights — hence the same training — in every layout as in one process."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import ROOT, run_ranks
from parity import assert_parity, load_record, merge_stages, train

MODELS = ["llama", "hf_llama", "encoder", "hf_gpt2"]  # hand-written (reset_parameters), HF (_init_weights), torch
# layers (MultiheadAttention's _reset_parameters), a tied embedding/head (initialised once, then shared)


def _reference(name: str, dp: int = 1):
    """One process with the strategy (it builds on meta too). Lightning leaves the one-rank process group it starts;
    it is destroyed so that later tests in this process find none."""
    import torch.distributed as dist

    from lightning_tpp import TensorPipeStrategy

    try:
        return train(name, strategy=TensorPipeStrategy(print_plan=False), meta=True, steps=3, dp=dp)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.parametrize(("tp", "pp"), [(2, 1), (2, 2)], ids=["tp2", "tp2xpp2"])
def test_meta_built_parity(tmp_path: Path, tp: int, pp: int) -> None:
    args = ["--models", ",".join(MODELS), "--tp", str(tp), "--pp", str(pp), "--meta", "--steps", "3",
            "--out", str(tmp_path)]
    run_ranks(ROOT / "tests" / "parity.py", tp * pp, args, timeout=400).check()
    for name in MODELS:
        ref = _reference(name)
        records = [load_record(tmp_path / f"{name}.rank{r}.pt") for r in range(tp * pp)]
        for tp_rank in range(tp):  # each tp rank's pipeline holds the whole model between its stages
            got = merge_stages([records[pp_rank * tp + tp_rank] for pp_rank in range(pp)])
            assert_parity(got, ref, where=f"meta-built {name} tp={tp} pp={pp} tp rank {tp_rank}")


@pytest.mark.slow
def test_meta_built_parity_tp2_pp2_dp2_sharded_with_activation_checkpointing(tmp_path: Path) -> None:
    """8 ranks: built on meta, each rank initialises its tp shard of its stage, FSDP2 cuts it over dp; blocks
    recomputed in backward. Llama (rotary side inputs) and GPT-2 (tied embedding/head on the first and last stage)."""
    models = ["llama", "hf_gpt2"]
    args = ["--models", ",".join(models), "--tp", "2", "--pp", "2", "--dp", "2", "--meta", "--steps", "3",
            "--activation-checkpointing", "--out", str(tmp_path)]
    run_ranks(ROOT / "tests" / "parity.py", 8, args, timeout=500).check()
    for name in models:
        ref = _reference(name, dp=2)
        records = [load_record(tmp_path / f"{name}.rank{r}.pt") for r in range(8)]
        for dp_rank in range(2):
            for tp_rank in range(2):
                got = merge_stages([records[(dp_rank * 2 + pp_rank) * 2 + tp_rank] for pp_rank in range(2)])
                assert_parity(got, ref, where=f"meta-built {name} tp2 x pp2 x dp2 dp rank {dp_rank} tp rank {tp_rank}")


def test_setup_allocates_only_the_share(tmp_path: Path) -> None:
    """tp2 x pp2 of a ~150 MB Llama: every rank's peak resident memory grows by well under half the whole model while
    the strategy cuts it and materialises its shards (eagerly it holds the whole model at least once: 1.0 x; measured
    here: ~0.40 x, the rank's quarter plus process-group buffers and one module at full size). The peak is the
    rank's own (``VmHWM``): ``ru_maxrss`` carries the parent's high-water mark through (v)fork + exec, and grew with
    the pytest process (55 MiB alone, 80 MiB after other tests). The ranks run with ``MALLOC_MMAP_THRESHOLD_=65536``,
    the setting docs/memory.md gives CPU users who want resident memory to follow what tensors hold (glibc's dynamic
    threshold keeps freed large blocks in the heap)."""
    run_ranks(Path(__file__).parent / "worker_meta_memory.py", 4, [str(tmp_path), "2", "2"], timeout=300,
              fresh=True, env={"MALLOC_MMAP_THRESHOLD_": "65536"}).check()
    import transformers
    import torch

    cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                                   num_attention_heads=8, num_key_value_heads=8)
    with torch.device("meta"):
        whole = sum(p.numel() * p.element_size() for p in transformers.LlamaForCausalLM(cfg).parameters())
    for rank in range(4):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        assert got["held"] < 0.3 * whole, f"rank {rank} holds {got['held']} of {whole} bytes"
        assert got["growth"] < 0.5 * whole, (f"rank {rank}'s resident memory grew by {got['growth'] / 2**20:.0f} MiB "
                                             f"during setup; the whole model is {whole / 2**20:.0f} MiB")


def test_module_without_initializer_is_named() -> None:
    """nanoGPT's causal-mask buffer is made in __init__ and nothing can remake it: a clear error, not garbage."""
    from lightning_tpp.core.materialize import UninitializedParametersError

    with pytest.raises(UninitializedParametersError, match=r"attn \(CausalSelfAttention: bias\).*reset_parameters"):
        _reference("nanogpt")
