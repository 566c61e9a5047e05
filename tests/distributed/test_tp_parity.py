"""Parity: tensor (x data) parallel training against one process, same weights and batches.

Each launch trains several models in one set of processes (process start-up dominates on 2 cores); the single
process references run here, in the test process.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import pytest

from launch import ROOT, run_ranks
from parity import assert_parity, load_record, train

ALL = ["nanogpt", "llama", "fused_gqa", "encoder", "seq2seq", "hf_gpt2", "hf_llama", "flat_gpt", "split_gpt",
       "hf_gemma", "hf_bert", "litgpt", "mlp", "hf_vit", "dit_noisy",
       "mqa_llama", "mqa_fused", "hf_falcon", "hf_falcon_new", "hf_llama_mqa",  # fewer K/V heads than tp (#30)
       "hf_t5",  # a per-head position bias made whole, read by this rank's heads
       "hf_qwen3",  # per-head query/key norms: replicated weights used on this rank's heads, gradients summed over tp
       "hf_olmo2",  # query/key norms over every head's features: run whole on the gathered columns, summed over tp
       "wide_qk_norm",  # the same as LayerNorms written by hand, beside a norm of the attention's own whole input
       "dit"]  # adaLN-Zero blocks: forward(x, c), modulation cut by columns and gathered


@functools.lru_cache(maxsize=None)
def reference(name: str, dp: int, **kwargs):
    return train(name, dp=dp, **kwargs)


def _run(tmp: Path, models: list[str], tp: int, dp: int, extra: list[str] = ()) -> None:
    args = ["--models", ",".join(models), "--tp", str(tp), "--dp", str(dp), "--out", str(tmp), *extra]
    run_ranks(ROOT / "tests" / "parity.py", tp * dp, args, timeout=400).check()


@pytest.mark.parametrize(("tp", "dp", "models"),
                         [(2, 1, ALL), pytest.param(2, 2, ["nanogpt", "llama", "encoder", "hf_gpt2", "conditioned"],
                                                    marks=pytest.mark.slow)],  # tp2 x dp2: clipping_accumulation
                         ids=["tp2", "tp2xdp2"])
def test_parity_fp32(tmp_path: Path, tp: int, dp: int, models: list[str]) -> None:
    _run(tmp_path, models, tp, dp)
    for name in models:
        ref = reference(name, dp)
        for rank in range(tp * dp):
            record = load_record(tmp_path / f"{name}.rank{rank}.pt")
            assert_parity(record, ref, where=f"{name} tp={tp} dp={dp} rank {rank}")
            # the user's generator where one process's stands after every step (dit_noisy draws in its step, and
            # drops over replicated values inside its blocks: the strategy neither reseeds nor draws from it)
            assert record.rng == ref.rng, f"{name} rank {rank}: the user's random stream moved differently"
            if dp == 1:  # sharded, not run whole on every rank
                assert record.local_fraction <= 0.65, (name, record.local_fraction)


def test_parity_no_verify_declared_partials(tmp_path: Path) -> None:
    """verify=False turns the gradient check off, the one that finds Qwen3's per-head q_norm / k_norm (each rank's
    gradient a part). Hugging Face's plan marks them ``replicated_with_grad_allreduce``, so they are summed over tp
    without the check: training stays at parity with one process (before, each rank stepped its own part). T5's
    position-bias table, read on this rank's heads and declared by no plan, is named by the verify=False warning.
    OLMo-2's whole-width q_norm / k_norm are summed over tp from their first call on gathered columns; a norm of the
    same size that meets the attention's whole input (``wide_qk_norm``'s ``pre``) is not: its gradient is whole."""
    args = ["--models", "hf_qwen3,hf_t5,hf_olmo2,wide_qk_norm", "--tp", "2", "--out", str(tmp_path), "--no-verify"]
    result = run_ranks(ROOT / "tests" / "parity.py", 2, args, timeout=400).check()
    for rank in range(2):
        for name in ("hf_qwen3", "hf_olmo2", "wide_qk_norm"):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), reference(name, 1),
                          where=f"{name} verify=False rank {rank}")
    warned = re.findall(r"verify=False: the gradient check is off.*?train as if every rank's gradient were whole: "
                        r"(\[.*?\])", " ".join(result.outputs[0].split()))
    assert len(warned) == 1 and "relative_attention_bias.weight" in warned[0], warned
    assert "norm" not in warned[0], warned  # Qwen3's norms were declared: not listed


SEQUENCE_PARALLEL = ["nanogpt", "llama", "hf_llama", "hf_gpt2", "flat_gpt", "split_gpt", "encoder", "seq2seq",
                     "hf_gemma", "hf_bert", "litgpt", "hf_phi3", "hf_neox", "conditioned", "nested_lists", "hf_qwen3",
                     "post_norm", "hf_mixtral_labels", "hf_jamba", "cp_hf_llama_hidden", "hf_olmo2",
                     "wide_qk_norm", "hf_deepseek_v3_labels", "hf_qwen2_moe_labels"]


def test_parity_sequence_parallel(tmp_path: Path) -> None:
    """sequence_parallel=True at tp=2: blocks whose attention and MLP are submodules (the stream between them on
    sequence shards, norms' and row biases' gradients summed over tp), blocks that hold their projections
    (gathered whole at entry), nn.MultiheadAttention, an encoder-decoder (two stacks), Hugging Face families
    (Phi-3's gathered fused qkv runs its layer whole), a conditioning vector read by every block (its gradient
    summed over the shards), a list of [attention, feed-forward] lists unpacked by the model's loop, Qwen3's per-head
    query/key norms and a norm after an MLP's row layer (each rank's gradient a part, found by the gradient check and
    summed over tp), expert banks cut over tp inside a block on sequence shards (Mixtral with its router's auxiliary
    loss, whose logits each rank records for its own tokens; Jamba's Mamba and attention layers): the bank runs on
    every rank's tokens and reduce-scatters, the router logits are gathered as one process records them;
    DeepSeek-V3's MLA attention cut by heads (its low-rank projections whole, the shared rope key's gradient summed
    over tp); Qwen2-MoE's tensor-parallel shared expert, handed the block's tokens flattened (gathered and cut back
    along the tokens, dim 0)."""
    _run(tmp_path, SEQUENCE_PARALLEL, 2, 1, ["--sequence-parallel"])
    for name in SEQUENCE_PARALLEL:
        ref = reference(name, 1)
        for rank in range(2):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, where=f"{name} sp rank {rank}")


def test_parity_sequence_parallel_fsdp_checkpointing(tmp_path: Path) -> None:
    """sequence_parallel with FSDP2 over dp (each block a unit: its first-call check copies it without FSDP2's
    hooks), activation checkpointing (the recomputed forward cuts and gathers again), global-norm clipping (the
    summed partial gradients counted once) and 2 accumulated micro-batches (summed once, at the step). AdamW
    tolerance as in test_parity_clipping_accumulation."""
    opts = dict(accumulate=2, clip=0.1, optimizer="adamw", steps=3, lr=0.01)
    models = ["llama", "hf_qwen3"]  # Qwen3: the gradient check finds its per-head norms under the checkpoint too
    _run(tmp_path, models, 2, 2, ["--sequence-parallel", "--activation-checkpointing", "--accumulate", "2",
                                  "--clip", "0.1", "--optimizer", "adamw", "--steps", "3", "--lr", "0.01"])
    for name in models:
        ref = train(name, dp=2, **opts)
        for rank in range(4):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, param_atol=1e-4,
                          where=f"{name} rank {rank}")


def test_parity_sequence_parallel_fsdp(tmp_path: Path) -> None:
    """sequence_parallel with FSDP2 over dp, without activation checkpointing: each block's first-call gradient check
    runs on FSDP2's gathered parameters (inside the unit's forward) and leaves their gradients alone; a conditioning
    vector whose gradient is summed over the shards. vocab_exchange=False: FSDP2 gathers the embedding and the head
    too (whose cross-entropy is then computed from the whole logits)."""
    _run(tmp_path, ["conditioned"], 2, 2, ["--sequence-parallel", "--no-vocab-exchange"])
    for rank in range(4):
        assert_parity(load_record(tmp_path / f"conditioned.rank{rank}.pt"), reference("conditioned", 2),
                      where=f"conditioned sp tp2 x dp2 rank {rank}")


@pytest.mark.parametrize(("models", "optimizer", "lr", "param_atol", "dp_sharding"),
                         [(["nanogpt", "llama", "mqa_llama"], "sgd", 0.1, None, "no_shard"),
                          (["llama"], "adamw", 0.01, 1e-4, "full_shard")])
def test_parity_clipping_accumulation(tmp_path: Path, models: list[str], optimizer: str, lr: float,
                                      param_atol: float | None, dp_sharding: str) -> None:
    """Global-norm clipping over shards and replicas, 2 micro-batches accumulated (a K/V head held by both tp ranks
    counted once, its gradient summed over them per micro-batch); AdamW keeps state per shard (and,
    sharded over dp by FSDP2, per dp part); SGD with replicas over dp (dp_sharding='no_shard').

    AdamW: losses and gradients keep the fp32 tolerance, updated parameters get atol 1e-4 (= lr / 100). Adam's step
    m / (sqrt(v) + eps) has size ~lr whatever the gradient's size, so an element whose gradient is at rounding level
    (~1e-9, e.g. an attention key bias, zero in exact arithmetic) moves by a rounding-dependent amount. It runs on the
    bias-free Llama to keep such elements few."""
    opts = dict(accumulate=2, clip=0.1, optimizer=optimizer, steps=3, lr=lr)
    _run(tmp_path, models, 2, 2, ["--accumulate", "2", "--clip", "0.1", "--optimizer", optimizer, "--steps", "3",
                                  "--lr", str(lr), "--dp-sharding", dp_sharding])
    for name in models:
        ref = train(name, dp=2, **opts)
        assert len(ref.grads) == 3 and len(ref.losses) == 6
        norm = sum(float(g.norm()) ** 2 for g in ref.grads[0].values()) ** 0.5
        assert norm > 0.1, f"gradient norm {norm} must exceed the clip value for clipping to be exercised"
        for rank in range(4):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, param_atol=param_atol,
                          where=f"{name} {optimizer} rank {rank}")


def test_ranks_seeded_differently_train_rank_0s_weights(tmp_path: Path) -> None:
    """Each rank builds its model from its own torch seed (as ranks of a script that does not seed do): the strategy
    gives every rank rank 0's weights before cutting them, so tp shards and dp replicas start from one model."""
    _run(tmp_path, ["nanogpt", "llama"], 2, 2, ["--seed-by-rank", "--steps", "3"])
    for name in ("nanogpt", "llama"):
        ref = train(name, dp=2, steps=3)  # rank 0's seed
        for rank in range(4):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, where=f"{name} rank {rank}")


def test_parity_bf16_mixed(tmp_path: Path) -> None:
    """bf16 autocast against a bf16 single-process reference. Tolerance: bf16 keeps 8 bits of mantissa (relative
    step 2^-8 ~ 4e-3); TP changes the summation order of each matmul, so values differ by a few bf16 ulps."""
    _run(tmp_path, ["nanogpt"], 2, 1, ["--precision", "bf16-mixed", "--steps", "3"])
    ref = train("nanogpt", precision="bf16-mixed", steps=3)
    before_last = train("nanogpt", precision="bf16-mixed", steps=2)  # what a skipped last step would leave
    for rank in range(2):
        got = load_record(tmp_path / f"nanogpt.rank{rank}.pt")
        assert_parity(got, ref, rtol=2e-2, atol=2e-2, where=f"bf16 rank {rank}")
        # the tolerance above is looser than one SGD step: each parameter must also sit within a tenth of its last
        # update of the reference (measured: 1/75 to 1/120), which a skipped or doubled step cannot
        for name, want in ref.params.items():
            step = float((want - before_last.params[name]).abs().max())
            error = float((got.params[name] - want).abs().max())
            assert error <= 0.1 * step, f"bf16 rank {rank} {name}: off by {error:.2e}, its last update {step:.2e}"


def test_kv_heads_fewer_than_tp4(tmp_path: Path) -> None:
    """Grouped-query attention with two K/V heads at tp=4 (Llama-3-70B's case at tp=16): each K/V head whole on the
    two ranks whose query heads read it, its gradient summed over them. And T5 at one head per rank (4 heads, a
    batch of 4 sequences): its relative position bias cut to the rank's head where it meets the scores, the batch
    left alone."""
    _run(tmp_path, ["gqa8_kv2", "hf_t5"], 4, 1)
    for name in ("gqa8_kv2", "hf_t5"):
        ref = reference(name, 1)
        for rank in range(4):
            assert_parity(load_record(tmp_path / f"{name}.rank{rank}.pt"), ref, where=f"{name} tp=4 rank {rank}")
