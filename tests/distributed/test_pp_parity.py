"""Pipeline parity: each schedule, and pipelines composed with tp and dp, against one process.

A pipeline rank records only its stages' parameters; ``merge_stages`` joins the ranks of one pipeline (and checks
that every rank reported the same per-step losses) before comparing with the reference."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest

from launch import ROOT, run_ranks
from parity import assert_parity, load_record, merge_stages, train

# litgpt registers its head before its blocks: placed by the forward's order. mlp: an nn.Sequential of mixed layers;
# hf_vit: a vision transformer (patch convolution, CLS token, classifier); seq_in_module / seq_nested: a Sequential of
# mixed layers held as `net` beside an output norm, and as `encoder.layers` inside an encoder module between an
# embedding and a head (its children are the blocks)
PP2_MODELS = ["nanogpt", "llama", "encoder", "hf_gpt2", "hf_llama", "hf_llama_labels", "sequential", "llama_varlen",
              "litgpt", "mlp", "hf_vit", "seq_in_module", "seq_nested", "mask_gpt"]


@functools.lru_cache(maxsize=None)
def reference(name: str, dp: int = 1, **kwargs):
    return train(name, dp=dp, **kwargs)


def run_and_compare(tmp: Path, models: list[str], *, tp: int = 1, pp: int = 2, dp: int = 1, extra: tuple = (),
                    train_kwargs: dict | None = None, schedules: tuple[str, ...] = ()) -> list[str]:
    """``schedules``: several schedules run in one launch (records named ``<model>.<schedule>``). Returns each
    rank's output."""
    args = ["--models", ",".join(models), "--tp", str(tp), "--pp", str(pp), "--dp", str(dp), "--out", str(tmp),
            *extra, *(("--schedule", ",".join(schedules)) if schedules else ())]
    outputs = run_ranks(ROOT / "tests" / "parity.py", tp * pp * dp, args, timeout=400).check().outputs
    for name in models:
        ref = reference(name, dp, **(train_kwargs or {}))
        for stem in [f"{name}.{s}" for s in schedules] or [name]:
            for d in range(dp):
                for t in range(tp):
                    ranks = [(d * pp + s) * tp + t for s in range(pp)]
                    got = merge_stages([load_record(tmp / f"{stem}.rank{r}.pt") for r in ranks])
                    assert_parity(got, ref, where=f"{stem} tp={tp} pp={pp} dp={dp} ranks {ranks}")
    return outputs


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "zero-bubble", "zb-drain", "zb-lead"])
def test_pp2_every_schedule(tmp_path: Path, schedule: str) -> None:
    """Tied embeddings (nanoGPT, GPT-2), rotary side inputs (Llama), nn.TransformerEncoder, HF ModelOutput and a
    loss computed inside the HF forward, a plain nn.Sequential (the model, or held inside a module), a sequence
    length that changes between steps, and a block that makes its causal mask without naming a device (mask_gpt:
    its shapes are inferred on meta on the stage that does not hold it)."""
    run_and_compare(tmp_path, PP2_MODELS if schedule == "1f1b" else ["nanogpt", "llama", "hf_gpt2"],
                    extra=("--schedule", schedule))


def test_pp2_user_action_lists(tmp_path: Path) -> None:
    """schedule= given as per-rank (kind, microbatch, chunk) lists, equal to 1F1B's: the engine runs them as it runs
    schedule='1f1b' (the strategy reads microbatches=4 from the lists)."""
    run_and_compare(tmp_path, ["nanogpt"], extra=("--schedule", "lists:1f1b"))


CROSSING_MODELS = ["seq2seq", "hf_t5", "hf_bart", "conditioned", "nested_lists", "fused_gqa", "root_param"]


def test_pp2_values_crossing_stages(tmp_path: Path) -> None:
    """Values other than the previous block's output cross stages: nn.Transformer and Hugging Face T5 (the encoder's
    output read by every decoder block, the decoder's embedded input computed on the first stage, T5's shared
    embedding and position bias), a conditioning vector read by every block, [attention, feed-forward] lists
    unpacked in the loop, sibling lists zipped in one loop, and a parameter of the model itself (pos_embed) used
    before the blocks."""
    run_and_compare(tmp_path, CROSSING_MODELS)


@pytest.mark.slow
def test_tp2_pp2_values_crossing_stages(tmp_path: Path) -> None:
    # T5: its position bias, made whole by the first layer, crosses stages and is cut to each rank's heads where
    # read; Falcon: one K/V head, held whole by both tp ranks; a DiT's conditioning vector (issue 30)
    run_and_compare(tmp_path, ["seq2seq", "hf_bart", "conditioned", "nested_lists", "hf_t5", "hf_falcon", "dit"],
                    tp=2)


def test_pp4_values_skip_stages(tmp_path: Path) -> None:
    """Four stages, one block each: the conditioning vector goes from stage 0 to stages 1, 2 and 3; in nn.Transformer
    the embedded target goes from stage 0 to stage 2 (past the encoder's second stage) and the encoder's output from
    stage 1 to stages 2 and 3. Gradients flow back along the same edges and are summed at the sender. Hugging Face's
    BART: the decoder's embedding norm, registered after the decoder's layers and called before them, goes with the
    encoder's last stage (the meta forward that orders the modules asks whether the decoder's padding mask is all
    ones; it stopped there and placed the norm on the last stage, after the decoder layer that reads it)."""
    run_and_compare(tmp_path, ["conditioned4", "seq2seq", "hf_bart"], pp=4)


def test_pp2_receives_in_posting_order(tmp_path: Path) -> None:
    """The NCCL path: no receive posted ahead (NCCL matches a pair's messages in posting order, not by tag)."""
    run_and_compare(tmp_path, ["nanogpt", "seq2seq"], extra=("--in-order-receives",))


def test_pp2_interleaved(tmp_path: Path) -> None:
    run_and_compare(tmp_path, ["nanogpt4", "llama4"], extra=("--schedule", "interleaved-1f1b", "--virtual", "2"))


def test_tp2_pp2(tmp_path: Path) -> None:
    """Also: an nn.Sequential whose MLP pair straddles the stage boundary (kept replicated), zipped lists, a Hugging
    Face tp plan naming a head that the other stage holds, a loss computed inside the HF forward, GPT-NeoX
    (per-head fused qkv), Phi-3 (fused qkv and gate/up, o_proj registered first), Qwen2 (GQA, qkv biases), and a
    block whose projections are its direct children (found by tracing the block on its stage); tied embedding and
    head on two stages cut alike (Gemma's scaled embedding; BERT's decoder inside its prediction head), and litgpt's
    head registered before its blocks."""
    run_and_compare(tmp_path, ["nanogpt", "llama", "hf_gpt2", "sequential", "fused_gqa", "hf_llama", "encoder",
                               "hf_llama_labels", "hf_neox", "hf_phi3", "hf_qwen2", "flat_gpt", "hf_gemma", "hf_bert",
                               "litgpt", "hf_vit"], tp=2)


def test_tp2_pp2_zero_bubble(tmp_path: Path) -> None:
    """Weight gradients filed by the products and computed in W: tensor-parallel column (F.linear) and row-parallel
    (F.linear, and GPT-2's Conv1D through matmul) layers, Conv1D's addmm, a tied head."""
    run_and_compare(tmp_path, ["nanogpt", "llama", "hf_gpt2"], tp=2, extra=("--schedule", "zero-bubble"))


def test_pp4_zb_drain(tmp_path: Path) -> None:
    """Four stages: rank r splits its first r backwards and its last, deferring up to r + 1 weight-gradient sets;
    zb-lead the same with every rank but the last one forward ahead (one more micro-batch in flight)."""
    run_and_compare(tmp_path, ["nanogpt4", "conditioned4"], pp=4, schedules=("zb-drain", "zb-lead"))


def test_pp2_zero_bubble_short_batch(tmp_path: Path) -> None:
    """A batch with fewer samples than zero-bubble needs runs GPipe, whose B computes the filed weight gradients."""
    run_and_compare(tmp_path, ["nanogpt"], extra=("--schedule", "zero-bubble", "--microbatches", "4", "--batch-size",
                                                  "1"), train_kwargs=dict(batch_size=1))


def test_pp2_dp2(tmp_path: Path) -> None:
    """dp_sharding='shard_grad_op': parameters kept gathered from forward to backward (every schedule runs the
    default 'full_shard' below); vocab_exchange=False: FSDP2 gathers the embedding and head too."""
    run_and_compare(tmp_path, ["nanogpt", "llama"], dp=2, extra=("--dp-sharding", "shard_grad_op",
                                                                 "--no-vocab-exchange"))


@pytest.mark.slow
def test_pp2_dp2_sharded_every_schedule(tmp_path: Path) -> None:
    """Parameters, gradients and optimizer state sharded over dp (FSDP2, the default) under every schedule: gradients
    reduce-scattered after each backward (GPipe, 1F1B, interleaved) or once after the schedule, where zero-bubble
    adds weight gradients after their backward. nanoGPT with 4 blocks and its tied embedding/head. "auto" (the
    default) takes 1F1B here without measuring, and says why."""
    outputs = run_and_compare(tmp_path, ["nanogpt4"], dp=2, extra=("--virtual", "2"),
                              schedules=("gpipe", "1f1b", "interleaved-1f1b", "zero-bubble", "zb-drain", "auto"))
    assert "schedule='auto': chose '1f1b' (parameters sharded over dp=2 (full_shard, FSDP2)" in outputs[0]


def test_tp2_pp2_accumulation_and_clipping(tmp_path: Path) -> None:
    """Global-norm clipping over tp and pp (the tied embedding counted once), 2 batches accumulated."""
    kwargs = dict(accumulate=2, clip=0.1, steps=3)
    run_and_compare(tmp_path, ["nanogpt", "llama"], tp=2, extra=("--accumulate", "2", "--clip", "0.1", "--steps", "3"),
                    train_kwargs=kwargs)


@pytest.mark.parametrize(("microbatches", "batch_size"), [(4, 6), (8, 6), (4, 1)],
                         ids=["uneven", "short-batch", "short-batch-gpipe"])
def test_pp2_batch_not_divisible_by_microbatches(tmp_path: Path, microbatches: int, batch_size: int) -> None:
    """Batch 6 in 4 micro-batches (2, 2, 1, 1 samples): losses, and the loss the step logs, weighted by share. A
    batch with fewer samples than micro-batches (an epoch's last) runs one micro-batch per sample, with GPipe if 1F1B
    needs more than it has."""
    run_and_compare(tmp_path, ["nanogpt"], extra=("--microbatches", str(microbatches), "--batch-size",
                                                  str(batch_size)), train_kwargs=dict(batch_size=batch_size))
    want = reference("nanogpt", batch_size=batch_size).logged["train_loss"]
    for rank in range(2):
        logged = load_record(tmp_path / f"nanogpt.rank{rank}.pt").logged["train_loss"]
        assert logged == pytest.approx(want, rel=1e-5), (rank, logged, want)


def test_tp2_pp2_sequence_parallel(tmp_path: Path) -> None:
    """Sequence parallelism across stages: each tp rank sends its part of the sequence to its peer on the next stage
    (the other stage's blocks are meta twins with the region's shapes); 1F1B, and zero-bubble whose weight gradients
    of the column layers read the gathered stream."""
    run_and_compare(tmp_path, ["nanogpt", "hf_llama", "flat_gpt", "litgpt"], tp=2, extra=("--sequence-parallel",),
                    schedules=("1f1b", "zero-bubble"))
