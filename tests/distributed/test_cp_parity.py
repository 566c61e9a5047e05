"""Context parallelism (issue #46): one-process parity of every family ``models_cp`` trains, at cp2, cp4, cp2 x tp2,
cp2 x pp2 and cp2 x dp2, and a sequence length that needs padding, in both modes (``cp_mode="allgather"``, ``"a2a"``).

Each launch (2 and 4 ranks) trains several configurations one after the other (``worker_cp.py``) once per test run
(a module fixture); each configuration is its own test, comparing per-step losses, per-parameter gradients and
updated parameters by original name with one process from the same weights and batches (``parity.assert_parity``),
on every rank (each pipeline's stages joined). The refusals are in ``test_errors.py`` (``cp_eager``, ``cp_block_aux``) and ``unit/test_cp_layout.py`` (a scan)."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest

from launch import run_ranks
from models import VOCAB
from parity import Record, assert_parity, load_record, merge_stages, train
from worker_cp import CONFIGS

SCRIPT = Path(__file__).parent / "worker_cp.py"
LAUNCHES = {2: ["cp2", "cp2_families", "cp2_padded", "cp2_dropout", "cp2_a2a", "cp2_a2a_padded", "cp2_ep2",
                "cp2_hidden", "cp2_compiled", "cp2_compiled_recomputed"],
            4: ["cp2tp2", "cp2pp2", "cp2dp2", "cp2tp2_a2a", "cp2tp2_t5"],
            # slow (python -m pytest -m slow): cp4, activation checkpointing, bf16, sequence parallelism inside, more
            # families, a2a at cp4 and under a pipeline, a2a's fallback
            "2 slow": ["cp2_recompute", "cp2_bf16", "cp2_families_slow", "cp2_a2a_fallback", "cp2_sdpa_families",
                       "cp2_a2a_families", "cp2_moe", "cp2_hf_more"],
            "4 slow": ["cp4", "cp2tp2sp", "cp2pp2_hf", "cp4_a2a", "cp2pp2_a2a", "cp2tp2_ep4", "cp2pp2_interleaved",
                       "cp2pp2_zb", "cp2pp2_t5", "cp2tp2_hf_more"]}


@functools.lru_cache(maxsize=None)
def reference(model: str, dp: int, steps: int, seq: int, precision: str = "32-true") -> Record:
    return train(model, dp=dp, steps=steps, seq=seq, precision=precision)


def _launch(tmp_path_factory: pytest.TempPathFactory, launch: int | str) -> Path:
    world = int(str(launch).split()[0])
    out = tmp_path_factory.mktemp(f"cp_{str(launch).replace(' ', '_')}")
    assert all(CONFIGS[n].world == world for n in LAUNCHES[launch])
    run_ranks(SCRIPT, world, [str(out), ",".join(LAUNCHES[launch])], timeout=500).check()
    return out


@pytest.fixture(scope="module")
def two(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory, 4)


@pytest.fixture(scope="module")
def two_slow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory, "2 slow")


@pytest.fixture(scope="module")
def four_slow(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _launch(tmp_path_factory, "4 slow")


def _ranks(name: str) -> list[tuple[int, ...]]:
    """Each pipeline's ranks (its stages, in order), for every (dp, cp, tp) position."""
    s = CONFIGS[name].strategy
    tp, pp, dp, cp = s.get("tp", 1), s.get("pp", 1), s.get("dp", 1), s.get("cp", 1)
    return [tuple(((d * pp + st) * cp + c) * tp + t for st in range(pp))
            for d in range(dp) for c in range(cp) for t in range(tp)]


def check_parity(out: Path, name: str, **tolerance: float) -> None:
    config = CONFIGS[name]
    for model in config.models:
        ref = reference(model, config.strategy.get("dp", 1), config.train["steps"], config.train["seq"],
                        config.train.get("precision", "32-true"))
        for ranks in _ranks(name):
            got = merge_stages([load_record(out / f"{name}.{model}.rank{r}.pt") for r in ranks])
            assert_parity(got, ref, **tolerance, where=f"{name} {model} ranks {ranks}")
            for r in ranks:  # the blocks ran on this rank's part of each sequence (parity alone holds at cp=1 too)
                seen = _extra(out, name, model, r)
                padded = -(-config.train["seq"] // (2 * config.strategy["cp"])) * 2 * config.strategy["cp"]
                assert (seen["length"], seen["padded"], seen["local"]) == (
                    config.train["seq"], padded, padded // config.strategy["cp"]), (name, model, r, seen)
            # the LM head computed this rank's columns only: 1 / (cp x tp) of the vocabulary, the logits never whole
            # (under a pipeline, in its route trace on zeros too)
            heads = [h for r in ranks for calls in _extra(out, name, model, r)["heads"].values() for h in calls]
            assert heads, (name, model, "no LM head was cut")
            columns = VOCAB // (config.strategy["cp"] * config.strategy.get("tp", 1))
            assert all(h == ["VocabCut", columns, VOCAB] for h in heads), (name, model, heads)


def _extra(out: Path, name: str, model: str, rank: int) -> dict:
    return json.loads((out / f"{name}.{model}.rank{rank}.json").read_text())


def test_cp2_parity(two: Path) -> None:
    """Hand-written Llama (SDPA is_causal, rotary tables), HF Llama (GQA), Mistral (sliding window 8 < 32), BERT
    (bidirectional, padded samples), packed documents (position ids restarting: a block-diagonal mask)."""
    check_parity(two, "cp2")


def test_cp2_attention_not_sdpa(two: Path) -> None:
    """Hugging Face eager attention (routed through transformers' attention registry to its own eager function on
    the whole sequence's keys); nn.Transformer: nn.MultiheadAttention (its inputs gathered for its keys and values,
    the causal hint made its mask) in an encoder stack, a decoder stack and cross-attention to the encoder's output."""
    check_parity(two, "cp2_families")


@pytest.mark.slow
def test_cp2_more_families(two_slow: Path) -> None:
    """nn.TransformerEncoder with a causal mask and is_causal, a conditioned block with nn.MultiheadAttention and a
    mask, BART's two stacks, Gemma (eager, tied and scaled embeddings), GPT-NeoX (partial rotary, parallel residual),
    Phi-3 (fused qkv), Qwen3 (per-head q/k norms), GPT-2 (eager, learned positions), litgpt."""
    check_parity(two_slow, "cp2_families_slow")


def test_cp2_length_that_needs_padding(two: Path) -> None:
    """30 positions over 2 * cp = 4 chunks: padded to 32 inside the block stack, exact for causal and padded-mask
    attention alike, and for T5 (encoder and decoder stacks cut): its relative position bias computed inside its
    first blocks' attention for this rank's rows (padded ones included) against every key, its decoder's
    cross-attention reading the whole encoder output."""
    check_parity(two, "cp2_padded")


def test_cp2_traffic_counted(two: Path) -> None:
    """What cp/ logs (no logger in these runs: nothing was taken): the hand-written Llama's 2 layers gather keys and
    values of (4 samples, 4 heads, 16 positions, 8 features) in float32 from the other rank, in 3 training forwards
    and the first-call check's own forward."""
    for rank in range(2):
        traffic = _extra(two, "cp2", "cp_llama", rank)["traffic"]
        per_layer = 2 * 4 * 4 * 16 * 8 * 4  # keys and values, bytes from the one other rank
        assert traffic["calls"] == 2 * 4 and traffic["bytes"] == per_layer * 2 * 4, traffic
        assert traffic["attention_seconds"] > 0, traffic


def test_cp2_dropout_drawn_per_rank(two: Path) -> None:
    """Every cp rank enters a block from the same random state: unless drawn per rank, dropout would zero the same
    elements of every rank's positions (masks correlated along the sequence)."""
    masks = [_extra(two, "cp2_dropout", "cp_hf_bert_dropout", r)["dropout_masks"] for r in range(2)]
    assert len(masks[0]) == len(masks[1]) >= 2, masks
    assert all(a != b for a, b in zip(*masks)), masks


def test_cp2_divides_block_activations(two: Path) -> None:
    """The bytes the block stack saves for backward per rank at cp=2, against one process at the same length (the
    same hook in a one-process run): at most 1.10 / 2, plus the keys and values each attention gathers."""
    cp = [_extra(two, "cp2", "cp_llama", r)["saved"] for r in range(2)]
    from worker_cp import BlockActivations  # the same measurement in one process

    one = BlockActivations(blocks=("model.layers.0", "model.layers.1"))
    train("cp_llama", steps=1, seq=32, callbacks=[one])
    assert one.saved > 0
    assert max(cp) <= 1.10 / 2 * one.saved, (cp, one.saved)
    print(f"block activations per rank at cp=2: {max(cp) / one.saved:.3f} of one process")


@pytest.mark.slow
def test_cp2_activation_checkpointing(two_slow: Path) -> None:
    """Each block recomputed in backward: the keys and values gathered again, in the same order on every rank."""
    check_parity(two_slow, "cp2_recompute")


@pytest.mark.slow
def test_cp2_bf16(two_slow: Path) -> None:
    """bf16 autocast against a bf16 one-process reference at rtol = atol = 2e-2 (as test_parity_configs' bf16
    checks: a gather of keys in another order changes the order of sums by a few bf16 ulps)."""
    check_parity(two_slow, "cp2_bf16", rtol=2e-2, atol=2e-2)


@pytest.mark.slow
def test_cp2_tp2_sequence_parallel(four_slow: Path) -> None:
    """cp outside, sequence parallelism inside: each rank's part of the sequence cut again over tp."""
    check_parity(four_slow, "cp2tp2sp")


@pytest.mark.slow
def test_cp2_pp2_hugging_face(four_slow: Path) -> None:
    check_parity(four_slow, "cp2pp2_hf")


@pytest.mark.slow
def test_cp4_parity(four_slow: Path) -> None:
    check_parity(four_slow, "cp4")


def _a2a_calls(out: Path, name: str) -> list[tuple[int, int]]:
    """(attention calls taken over, of them exchanged for heads) of every model on every rank."""
    config = CONFIGS[name]
    traffic = [_extra(out, name, model, r)["traffic"] for model in config.models for r in range(config.world)]
    return [(t["calls"], t["a2a_calls"]) for t in traffic]


def test_cp2_a2a_parity(two: Path) -> None:
    """cp_mode="a2a" (Ulysses) on the same families as test_cp2_parity: causal, sliding window, padding mask, packed
    documents; every attention call exchanged positions for heads."""
    check_parity(two, "cp2_a2a")
    calls = _a2a_calls(two, "cp2_a2a")
    assert all(n > 0 and a2a == n for n, a2a in calls), calls


def test_cp2_a2a_length_that_needs_padding(two: Path) -> None:
    check_parity(two, "cp2_a2a_padded")
    assert all(n > 0 and a2a == n for n, a2a in _a2a_calls(two, "cp2_a2a_padded"))


def test_cp2_tp2_a2a(four: Path) -> None:
    """tp cuts HF Llama's 2 key/value heads to 1 per tp rank; a2a repeats it for the 2 cp ranks' query heads."""
    check_parity(four, "cp2tp2_a2a")
    assert all(n > 0 and a2a == n for n, a2a in _a2a_calls(four, "cp2tp2_a2a"))


@pytest.mark.slow
def test_cp4_a2a(four_slow: Path) -> None:
    """2 key/value heads repeated for 4 cp ranks (1 query head each); Mistral's sliding window, packed documents."""
    check_parity(four_slow, "cp4_a2a")
    assert all(n > 0 and a2a == n for n, a2a in _a2a_calls(four_slow, "cp4_a2a"))


@pytest.mark.slow
def test_cp2_pp2_a2a(four_slow: Path) -> None:
    check_parity(four_slow, "cp2pp2_a2a")


@pytest.mark.slow
def test_cp2_a2a_falls_back(two_slow: Path) -> None:
    """Hugging Face eager attention and nn.MultiheadAttention are not SDPA calls: under cp_mode="a2a" they run as
    "allgather" (exact; a warning says so)."""
    check_parity(two_slow, "cp2_a2a_fallback")
    assert all(n > 0 and a2a == 0 for n, a2a in _a2a_calls(two_slow, "cp2_a2a_fallback"))


def test_cp2_tp2_parity(four: Path) -> None:
    check_parity(four, "cp2tp2")


def test_cp2_pp2_parity(four: Path) -> None:
    check_parity(four, "cp2pp2")


def test_cp2_dp2_parity(four: Path) -> None:
    """FSDP2 over dp x cp: the cp ranks of a replica read the same batch and hold a shard of the same weights."""
    check_parity(four, "cp2dp2")


@pytest.mark.slow
def test_cp2_more_sdpa_families(two_slow: Path) -> None:
    """Hugging Face families with SDPA that cp's other tests do not train: Qwen3's per-head query/key norms, Phi-3's
    fused qkv, GPT-NeoX's per-head fused qkv and partial rotary, Gemma 3's sliding (window 8 of 32) and full layers
    alternating."""
    check_parity(two_slow, "cp2_sdpa_families")


@pytest.mark.slow
def test_cp2_a2a_more_families(two_slow: Path) -> None:
    """The same families with cp_mode="a2a": every attention call exchanged heads."""
    check_parity(two_slow, "cp2_a2a_families")
    calls = _a2a_calls(two_slow, "cp2_a2a_families")
    assert all(n > 0 and a2a == n for n, a2a in calls), calls


def test_cp2_mixture_of_experts_over_ep(two: Path) -> None:
    """Mixtral with its load-balancing loss on, the experts split over ep drawn from the two cp ranks: each rank's
    tokens (its positions) travel to the experts' rank; the routers' logits the model records for its loss are
    gathered over cp, so the loss is one process's, as are the experts' gradients (summed over their replicas,
    divided by dp x cp)."""
    check_parity(two, "cp2_ep2")


def test_cp2_hidden_states_read_by_the_loss(two: Path) -> None:
    """Hugging Face Llama with ``output_hidden_states=True`` and a loss that reads every layer's hidden state (as a
    distillation does): transformers records a layer's output by a hook after the layer returns, this rank's
    positions under cp; each record is gathered at the next block's entry, so the loss is one process's."""
    check_parity(two, "cp2_hidden")


@pytest.mark.parametrize("name", ["cp2_compiled", "cp2_compiled_recomputed"])
def test_cp2_compiled(two: Path, name: str) -> None:
    """``compile=`` (aot_eager) on Hugging Face Llama and a hand-written Llama at cp2, compiled after the first step,
    at parity: each block's own forward is compiled, what the block does around it on this rank's positions stays
    eager, and its attention calls (keys and values gathered over cp) run eagerly between its graphs. The only graph
    breaks are those calls, no recompile after the first compiled step (before: 55 breaks of 6 kinds for two blocks,
    and 2 recompiles). With activation checkpointing too (Hugging Face Llama): compiled at the start of the second
    step, not before the first one's backward, whose recomputation then ran the compiled forward where the forward
    had run eagerly (``CheckpointError``: another number of tensors saved)."""
    check_parity(two, name)
    for model in CONFIGS[name].models:
        for rank in range(2):
            info = json.loads((two / f"{name}.{model}.rank{rank}.compile.json").read_text())
            assert info["blocks"] and info["graphs"] > 0 and info["recompiles"] == 0, info
            assert set(info["reasons"]) == {"Skip inlining `torch.compiler.disable()`d function"}, info


@pytest.mark.slow
def test_cp2_mixture_of_experts_families(two_slow: Path) -> None:
    """Mixtral, Qwen2-MoE (a gated shared expert), DeepSeek-V3 (MLA, a dense first layer, group-limited routing) and
    gpt-oss (attention sinks, transposed banks), the experts whole on each cp rank."""
    check_parity(two_slow, "cp2_moe")


@pytest.mark.slow
def test_cp2_tp2_ep4(four_slow: Path) -> None:
    """ep over cp x tp: the experts' tokens come from both cp ranks (each tp rank sending its slice); with every token
    routed to one expert, three of the four ranks receive none and still join every exchange."""
    check_parity(four_slow, "cp2tp2_ep4")


@pytest.mark.slow
def test_cp2_pp2_other_schedules(four_slow: Path) -> None:
    """Interleaved 1F1B (two virtual stages per rank, each cut block run on its positions) and zero-bubble (the input
    gradients first, the weights' deferred: the attention's recompute and its exchanges run in the input step)."""
    check_parity(four_slow, "cp2pp2_interleaved")
    check_parity(four_slow, "cp2pp2_zb")


def test_cp2_tp2_t5(four: Path) -> None:
    """T5 with its heads over tp: the bias of this rank's rows made whole over the heads and cut to this tp rank's
    where its eager attention reads it, in the forward and in the attention's recompute in backward (tensor
    parallelism's function mode replayed there); its masks made by the model's own config (tensor parallelism gives
    the attention a copy with its heads), routed to the eager attention too."""
    check_parity(four, "cp2tp2_t5")


@pytest.mark.slow
def test_cp2_pp2_t5(four_slow: Path) -> None:
    """T5 over two stages: each stack's relative position bias made for this rank's rows in its first block and
    passed on to the others, the encoder's output crossing to the decoder's cross-attention."""
    check_parity(four_slow, "cp2pp2_t5")


@pytest.mark.slow
def test_cp2_and_cp2_tp2_more_hugging_face_families(two_slow: Path, four_slow: Path) -> None:
    """Gemma 2 (eager attention with logit soft-capping, a sliding window of 8 on alternate layers), Falcon's new
    architecture (2 key/value heads), GPT-BigCode (multi-query: one key/value head, held whole by both tp ranks), at
    cp2 and cp2 x tp2."""
    check_parity(two_slow, "cp2_hf_more")
    check_parity(four_slow, "cp2tp2_hf_more")
