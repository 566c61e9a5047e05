"""estimate_memory and ``lightning-tpp plan``: bytes per rank from the strategy's own cut, on the meta device."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

from lightning_tpp import estimate_memory
from lightning_tpp.__main__ import main, parse_bytes
from lightning_tpp.pipeline.schedule import actions
from models import HFCausalLM, NanoGPT, TinyLlama

MB, SEQ = 8, 16


def _meta(factory):  # type: ignore[no-untyped-def]
    with torch.device("meta"):
        return factory()


def _count(model: nn.Module) -> int:
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def _norm_params(model: nn.Module) -> int:
    return sum(p.numel() for n, p in model.named_parameters() if "norm" in n)


def test_pipeline_ranks_add_up_to_the_model() -> None:
    llama = _meta(lambda: TinyLlama(n_layers=4))
    report = estimate_memory(llama, tp=1, pp=2, batch_size=MB, seq_len=SEQ)
    assert [r.pp_rank for r in report.ranks] == [0, 1]
    assert sum(r.param_count for r in report.ranks) == _count(llama)
    assert all(0 < r.param_count < _count(llama) for r in report.ranks)
    assert all(r.params == 4 * r.param_count == r.grads for r in report.ranks)


def test_tied_weight_counted_on_each_stage_that_holds_it() -> None:
    gpt = _meta(lambda: NanoGPT(n_layer=4))
    report = estimate_memory(gpt, tp=1, pp=2, batch_size=MB, seq_len=SEQ)
    assert sum(r.param_count for r in report.ranks) == _count(gpt) + gpt.transformer.wte.weight.numel()


def test_tensor_parallelism_halves_the_sharded_parameters() -> None:
    llama = _meta(lambda: TinyLlama(n_layers=4))
    report = estimate_memory(llama, tp=2, pp=1, batch_size=MB, seq_len=SEQ)
    norms = _norm_params(llama)  # replicated; everything else (blocks, vocab-parallel embedding and head) is cut
    assert [(r.pp_rank, r.tp_rank) for r in report.ranks] == [(0, 0), (0, 1)]
    assert all(r.param_count == (_count(llama) - norms) // 2 + norms for r in report.ranks)


@pytest.mark.parametrize("kv_heads, tp", [(1, 2), (2, 4)])
def test_tensor_parallelism_beyond_the_key_value_heads(kv_heads: int, tp: int) -> None:
    """More tp ranks than key/value heads (multi-query attention at tp=2, Llama-3-8B's 8 at tp=16): the tp ranks
    that share a head sum its gradient in backward. On the planner's meta copy there is nothing to sum, and the
    plan used to stop there, asking for a process group."""
    report = estimate_memory(HFCausalLM("llama", kv_heads=kv_heads), tp=tp, pp=1, batch_size=MB, seq_len=SEQ)
    assert len(report.ranks) == tp and all(r.activations > 0 for r in report.ranks)


def test_auto_schedule_counts_the_most_it_may_run() -> None:
    """schedule="auto" (the default) measures with zb-drain and may choose any candidate: each rank gets the most of
    them; where the layout decides (FSDP2 over dp: 1F1B; fewer micro-batches than stages: GPipe), that one."""
    llama = _meta(lambda: TinyLlama(n_layers=4))
    kw = dict(tp=1, pp=2, batch_size=MB, seq_len=SEQ)
    auto = estimate_memory(llama, **kw)
    fixed = {s: estimate_memory(llama, schedule=s, **kw) for s in ("1f1b", "zb-drain", "zero-bubble", "zb-lead")}
    assert auto.schedule == "auto (the most of zb-drain, 1f1b, zero-bubble, zb-lead)"
    for r, rank in enumerate(auto.ranks):
        assert rank.total == max(f.ranks[r].total for f in fixed.values())
    assert auto.ranks[1].total > fixed["1f1b"].ranks[1].total  # the last rank's split backward holds more
    # zb-lead: the first rank holds one micro-batch of activations more than zb-drain, the last the same
    lead, drain = fixed["zb-lead"].ranks, fixed["zb-drain"].ranks
    assert lead[0].in_flight == drain[0].in_flight + 1 and lead[1].in_flight == drain[1].in_flight
    assert lead[0].activations > drain[0].activations and lead[1].total == drain[1].total
    sharded = estimate_memory(llama, dp=2, **{**kw, "batch_size": 2 * MB})
    assert sharded.schedule == "1f1b"
    assert sharded.ranks == estimate_memory(llama, dp=2, schedule="1f1b", **{**kw, "batch_size": 2 * MB}).ranks
    assert estimate_memory(llama, microbatches=1, **kw).schedule == "gpipe"


def test_split_backward_keeps_the_weight_operands_until_w() -> None:
    """A split backward holds a micro-batch whole from F to I, then only what its weight products need until W."""
    from lightning_tpp.memory.estimate import _held

    # zero-bubble at pp=2, m=2 on the last rank: F0 I0 F1 I1 W0 W1 (the order the schedule gives)
    order = [kind for kind, _, _ in actions("zero-bubble", 1, 2, 2)]
    assert order == ["F", "I", "F", "I", "W", "W"]
    assert _held("zero-bubble", 1, 2, 2, 1, [10]) == (2, 20)  # without what W keeps: all of it until W
    assert _held("zero-bubble", 1, 2, 2, 1, [10], [3]) == (2, 13)  # F1 (10) beside micro-batch 0's operands (3)
    assert _held("1f1b", 1, 2, 2, 1, [10], [3]) == (1, 10)
    llama = _meta(lambda: TinyLlama(n_layers=4))
    kw = dict(tp=1, pp=2, batch_size=MB, seq_len=SEQ)
    one, zb = (estimate_memory(llama, schedule=s, **kw).ranks[1].activations for s in ("1f1b", "zb-drain"))
    assert one < zb < 2 * one  # the last rank's operands of a micro-batch waiting for W: some, not all


def test_first_stage_follows_the_strategy_cut() -> None:
    """As the strategy cuts: under a pipeline the first stage's embedding is paired with the head on the last stage
    and halved like the blocks' linear layers; norms stay replicated."""
    hf = _meta(lambda: HFCausalLM("llama"))
    whole = estimate_memory(hf, tp=1, pp=2, batch_size=MB, seq_len=SEQ).ranks[0]
    cut = estimate_memory(hf, tp=2, pp=2, batch_size=MB, seq_len=SEQ).ranks[0]
    norms = sum(p.numel() for n, p in hf.named_parameters() if n.startswith("model.model.layers.0.") and "norm" in n)
    assert cut.param_count == (whole.param_count - norms) // 2 + norms


def test_dp_sharding_divides_the_states() -> None:
    llama = _meta(lambda: TinyLlama(vocab=1024, n_layers=4))  # a vocabulary matrix larger than a block
    kw = dict(tp=2, pp=2, batch_size=2 * MB, seq_len=SEQ, schedule="1f1b")
    replicated = estimate_memory(llama, dp=2, dp_shard=False, **kw)
    sharded = estimate_memory(llama, dp=2, **kw)
    for a, b in zip(replicated.ranks, sharded.ranks):
        assert b.param_count == pytest.approx(a.param_count / 2, rel=0.02)  # dim 0 padded to a multiple of dp
        assert b.activations == a.activations
        assert a.gathered == 0
    assert "FSDP2" in str(sharded)
    # FSDP2 holds the largest unit's gathered parameters and unsharded gradient, beside the unit before's
    # reduce-scatter input and the next unit prefetched, each at most a block (this rank's tp shard); then its own
    # input, its last (here only) gradient and its output, 1 / dp of it; zero-bubble keeps the stage's parameters and
    # gradients whole
    block = sum(p.numel() * 4 for p in llama.layers[0].parameters()) / 2  # fp32, (nearly) every weight cut by tp=2
    embed = llama.tok_embeddings.weight.numel() * 4 / 2  # vocab-parallel on the first stage
    assert embed > block  # the vocabulary matrix is FSDP2's largest unit when it gathers it
    fsdp = estimate_memory(llama, dp=2, vocab_exchange=False, **kw).ranks[0]
    assert fsdp.gathered == pytest.approx(2 * embed + block + max(block, embed / 2), rel=0.05)
    # over gloo, the gradient is freed after its copy-in and nothing is prefetched
    gloo = estimate_memory(llama, dp=2, backend="gloo", vocab_exchange=False, **kw).ranks[0]
    assert gloo.gathered == pytest.approx(2 * embed, rel=0.05)
    with pytest.raises(ValueError, match="backend='mpi' is not one of"):
        estimate_memory(llama, dp=2, backend="mpi", **kw)
    zb = estimate_memory(llama, dp=2, vocab_exchange=False, **{**kw, "schedule": "zero-bubble"}).ranks[0]
    assert zb.gathered == 2 * zb.param_count * 2 * 4  # the stage's tp shard (twice its dp part), params + grads
    # by default the embedding is computed over dp (data_parallel.rows): never gathered; its exchange holds the lookup
    # of every dp rank's tokens (tokens x hidden), less than a block here
    rank = sharded.ranks[0]
    assert rank.gathered == pytest.approx(4 * block, rel=0.05)
    zb = estimate_memory(llama, dp=2, **{**kw, "schedule": "zero-bubble"}).ranks[0]
    assert zb.gathered == pytest.approx(2 * 2 * (zb.param_count * 4 - embed / 2), rel=1e-6)  # the rest, whole
    assert rank.total == rank.states + max(rank.activations + rank.gathered, rank.step)
    assert rank.step == rank.params  # AdamW's foreach temporary at the optimizer step


def test_optimizer_step_can_set_the_total() -> None:
    """AdamW's temporary (the size of the parameters) is the peak when activations are small: one short sequence."""
    llama = _meta(lambda: TinyLlama(n_layers=4))
    rank = estimate_memory(llama, tp=1, pp=1, batch_size=1, seq_len=2).ranks[0]
    assert rank.step == rank.params > rank.activations + rank.gathered
    assert rank.total == rank.states + rank.params
    assert "* set by the optimizer step" in str(estimate_memory(llama, tp=1, pp=1, batch_size=1, seq_len=2))
    assert estimate_memory(llama, tp=1, pp=1, batch_size=1, seq_len=2, optimizer="sgd").ranks[0].step == 0


@pytest.mark.parametrize(("optimizer", "states"), [("adamw", 2), ("sgd-momentum", 1), ("sgd", 0)])
def test_optimizer_state(optimizer: str, states: int) -> None:
    llama = _meta(lambda: TinyLlama(n_layers=2))
    rank = estimate_memory(llama, tp=1, pp=1, batch_size=MB, seq_len=SEQ, optimizer=optimizer).ranks[0]
    steps = 4 * len(list(llama.parameters())) if optimizer == "adamw" else 0  # AdamW's fp32 step per parameter
    assert rank.optimizer == states * rank.params + steps


def test_bfloat16_parameters_halve_the_states() -> None:
    llama = _meta(lambda: HFCausalLM("llama"))
    fp32 = estimate_memory(llama, tp=1, pp=1, batch_size=MB, seq_len=SEQ).ranks[0]
    bf16 = estimate_memory(llama, tp=1, pp=1, batch_size=MB, seq_len=SEQ, param_dtype=torch.bfloat16).ranks[0]
    assert bf16.params * 2 == fp32.params and bf16.activations < fp32.activations


@pytest.mark.parametrize(("schedule", "expected"), [("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1])])
def test_micro_batches_held_by_the_schedule(schedule: str, expected: list[int]) -> None:
    llama = _meta(lambda: TinyLlama(n_layers=4))
    report = estimate_memory(llama, tp=1, pp=4, microbatches=8, batch_size=8, seq_len=SEQ, schedule=schedule)
    assert [r.in_flight for r in report.ranks] == expected  # 1f1b: min(pp - stage, m)
    one = estimate_memory(llama, tp=1, pp=4, microbatches=8, batch_size=8, seq_len=SEQ, schedule="gpipe")
    per_microbatch = [(r.activations - r.transient) / 8 for r in one.ranks]
    assert [r.activations - r.transient for r in report.ranks] == \
        pytest.approx([n * a for n, a in zip(expected, per_microbatch)])
    # the loss's backward, once (one micro-batch's gradients in flight), on the last stage only
    assert [r.transient for r in report.ranks] == [r.transient for r in one.ranks]
    assert [r.transient > 0 for r in report.ranks] == [False, False, False, True]


def test_zero_bubble_holds_at_least_what_1f1b_holds() -> None:
    llama = _meta(lambda: TinyLlama(n_layers=4))
    kw = dict(tp=1, pp=4, microbatches=8, batch_size=8, seq_len=SEQ)
    zb = estimate_memory(llama, schedule="zero-bubble", **kw)
    ofob = estimate_memory(llama, schedule="1f1b", **kw)
    assert all(a.in_flight >= b.in_flight for a, b in zip(zb.ranks, ofob.ranks))


def test_activation_checkpointing_holds_less() -> None:
    llama = _meta(lambda: TinyLlama(n_layers=4, dim=64))
    kw = dict(tp=2, pp=2, batch_size=MB, seq_len=SEQ)
    full = estimate_memory(llama, **kw)
    ckpt = estimate_memory(llama, activation_checkpointing=True, **kw)
    for a, b in zip(full.ranks, ckpt.ranks):
        assert 0 < b.activations < a.activations and a.states == b.states


def test_activations_grow_with_the_micro_batch() -> None:
    llama = _meta(lambda: TinyLlama(n_layers=2))
    small = estimate_memory(llama, tp=1, pp=1, batch_size=2, seq_len=SEQ).ranks[0].activations
    large = estimate_memory(llama, tp=1, pp=1, batch_size=4, seq_len=SEQ).ranks[0].activations
    assert large == pytest.approx(2 * small, rel=0.05)


def test_nothing_is_allocated_or_changed() -> None:
    meta = _meta(lambda: NanoGPT(n_layer=4))
    before = [(n, type(m)) for n, m in meta.named_modules()]
    estimate_memory(meta, tp=2, pp=2, batch_size=MB, seq_len=SEQ, activation_checkpointing=True)
    assert all(p.is_meta for p in meta.parameters())
    assert [(n, type(m)) for n, m in meta.named_modules()] == before
    real = NanoGPT(n_layer=4)
    ptrs = [p.data_ptr() for p in real.parameters()]
    report = estimate_memory(real, tp=2, pp=2, batch_size=MB, seq_len=SEQ)
    assert [p.data_ptr() for p in real.parameters()] == ptrs and "forward" not in vars(real.transformer.h[0])
    assert report.ranks[0].param_count < _count(real)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(batch_size=6), r"batch_size=6 must be divisible by dp \* microbatches = 1 \* 4"),
    (dict(balance="time"), r"balance='time' is not supported here"),
    (dict(optimizer="lion"), r"optimizer='lion' is not one of"),
    (dict(microbatches=1, schedule="1f1b"), r"needs microbatches >= pp"),
])
def test_errors(kwargs: dict, message: str) -> None:
    llama = _meta(lambda: TinyLlama(n_layers=4))
    with pytest.raises(ValueError, match=message):
        estimate_memory(llama, **{**dict(tp=1, pp=2, batch_size=MB, seq_len=SEQ), **kwargs})


def test_report_table() -> None:
    report = estimate_memory(_meta(lambda: TinyLlama(n_layers=4)), tp=2, pp=2, batch_size=MB, seq_len=SEQ)
    text = str(report)
    assert "params" in text and "activations" in text and "0-1" in text
    assert report.partition is not None and report.partition.stages == 2
    assert report.largest.total == max(r.total for r in report.ranks)


def test_parse_bytes() -> None:
    assert parse_bytes("80GB") == 80e9 and parse_bytes("80GiB") == 80 * 2 ** 30 and parse_bytes("512") == 512
    with pytest.raises(ValueError, match="must look like 80GB"):
        parse_bytes("lots")


def test_cli_plan_hugging_face_config(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = dict(model_type="llama", vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                  num_attention_heads=4, num_key_value_heads=2)
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert main(["plan", str(tmp_path / "config.json"), "--tp", "2", "--pp", "2", "--batch-size", "8",
                 "--seq-len", "32", "--device-memory", "1MB"]) == 0
    out = capsys.readouterr().out
    assert "stage 1 (pp rank 1): blocks 2..3" in out and "lm_head" in out
    assert "does not fit" in out and "activation checkpointing on" in out


def test_cli_plan_lightning_module(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "models.LitLM", "--arg", "name=llama4", "--init-args", '{"optimizer": "adamw"}',
                 "--tp", "2", "--pp", "2", "--dp", "2", "--batch-size", "8", "--seq-len", "16",
                 "--no-dp-shard", "--activation-checkpointing"]) == 0
    out = capsys.readouterr().out
    assert "model.tok_embeddings" in out and "replicated over dp" in out and "fits" in out
    assert math.isfinite(parse_bytes("80GB"))


def test_fused_attention_keeps_no_probabilities() -> None:
    """sdpa counted as the fused kernels of real devices run it: activations grow linearly with the sequence."""
    llama = _meta(lambda: TinyLlama(n_layers=2))
    short = estimate_memory(llama, tp=1, pp=1, batch_size=1, seq_len=256).ranks[0].activations
    long = estimate_memory(llama, tp=1, pp=1, batch_size=1, seq_len=512).ranks[0].activations
    assert long == pytest.approx(2 * short, rel=0.05)


def test_cli_plan_without_transformers_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    """A Hugging Face config.json on a machine without transformers: the install command, no traceback."""
    import sys

    (tmp_path / "config.json").write_text(json.dumps(dict(model_type="llama")))
    monkeypatch.setitem(sys.modules, "transformers", None)  # `import transformers` now fails
    assert main(["plan", str(tmp_path / "config.json"), "--batch-size", "8", "--seq-len", "32"]) == 1
    err = capsys.readouterr().err
    assert "needs transformers, which is not installed: pip install transformers" in err
    assert "Traceback" not in err


class _WideHead(torch.nn.Module):
    """An embedding and a head over a large vocabulary, nothing between: the loss's backward is its peak."""

    def __init__(self, vocab: int = 4096, dim: int = 8) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.head = torch.nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(ids))


def test_the_loss_backward_counts_its_gradients_in_flight() -> None:
    """The cross-entropy's backward holds the gradient of its log-softmax output and of the logits (fp32, each the
    size of the logits) beside the saved log-softmax: seen on an H200, a 128 K-vocabulary Llama peaked 5.8 GB over
    the saved tensors and the states. Parameter gradients are counted apart, not again here; the count grows with
    the micro-batch."""
    vocab, tokens = 4096, 2 * SEQ
    model = _meta(lambda: _WideHead(vocab))
    one, two = (estimate_memory(model, tp=1, pp=1, batch_size=b, seq_len=SEQ).ranks[0] for b in (2, 4))
    logits = tokens * vocab * 4
    assert one.transient == pytest.approx(2 * logits, rel=0.01)
    assert two.transient == pytest.approx(2 * one.transient, rel=0.01)
    assert one.total == one.states + one.activations and one.activations >= one.transient + logits  # the saved


class _NoBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError("no backward here")


class _HeadWithoutBackward(_WideHead):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(_NoBackward.apply(self.embed(ids)))


def test_a_backward_that_fails_on_meta_is_warned_about() -> None:
    """The loss's and the head's backward ran before the failing function: what they held is counted."""
    model = _meta(lambda: _HeadWithoutBackward())
    with pytest.warns(UserWarning, match=r"could not run _HeadWithoutBackward's backward on the meta device "
                                         r"\(NotImplementedError: no backward here\): the bytes its backward holds "
                                         r"beside the saved tensors \(the loss's gradients\) are counted only as far "
                                         r"as it ran"):
        rank = estimate_memory(model, tp=1, pp=1, batch_size=2, seq_len=SEQ).ranks[0]
    assert rank.transient == pytest.approx(2 * 2 * SEQ * 4096 * 4, rel=0.01)
