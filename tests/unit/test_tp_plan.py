"""Single-process tests of plan detection (``lightning_tpp.tensor_parallel.plan``) and overlays (``.overrides``), no
process groups."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from models import MODELS, EncoderLM, FusedGQAModel, HFCausalLM, HFCausalLMFamily, NanoGPT, TinyLlama
from torch import nn

from lightning_tpp.core.sharding import ShardSpec
from lightning_tpp.tensor_parallel import STYLES, TensorParallelConfigError, TPPlan, detect, hf_plan, overlay


@pytest.fixture(scope="module")
def hf_llama() -> nn.Module:
    return HFCausalLM("llama")


@pytest.fixture(scope="module")
def hf_gpt2() -> nn.Module:
    return HFCausalLM("gpt2")


# ---- NanoGPT: fused c_attn, tied wte / lm_head -------------------------------------------------------------------
def test_nanogpt_blocks_and_styles() -> None:
    plan = detect(NanoGPT(), 2)
    for i in (0, 1):
        attn = plan.blocks[f"transformer.h.{i}.attn"]
        assert attn.kind == "attention"
        assert attn.layers == [f"transformer.h.{i}.attn.c_attn", f"transformer.h.{i}.attn.c_proj"]
        assert (attn.heads, attn.kv_heads, attn.head_dim) == (4, 4, 8)
        assert attn.fused[f"transformer.h.{i}.attn.c_attn"] == [ShardSpec(0, (32, 32, 32)), ShardSpec(0)]
        assert plan.styles[f"transformer.h.{i}.attn.c_attn"] == "colwise"
        assert plan.styles[f"transformer.h.{i}.attn.c_proj"] == "rowwise"

        mlp = plan.blocks[f"transformer.h.{i}.mlp"]
        assert mlp.kind == "mlp"
        assert mlp.layers == [f"transformer.h.{i}.mlp.c_fc", f"transformer.h.{i}.mlp.c_proj"]
        assert plan.styles[f"transformer.h.{i}.mlp.c_fc"] == "colwise"
        assert plan.styles[f"transformer.h.{i}.mlp.c_proj"] == "rowwise"
    assert set(plan.blocks) == {"transformer.h.0.attn", "transformer.h.0.mlp", "transformer.h.1.attn",
                                "transformer.h.1.mlp"}
    assert plan.notes == []


def test_nanogpt_vocab_tied() -> None:
    plan = detect(NanoGPT(), 2)
    assert plan.styles["transformer.wte"] == "vocab"
    assert plan.styles["lm_head"] == "colwise_gather"
    assert "transformer.wpe" not in plan.styles  # position embedding has no matching head
    assert all(not k.startswith(("transformer.ln_f", "transformer.h.0.ln")) for k in plan.styles)


def test_plan_is_in_module_order() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    order = [n for n, _ in model.named_modules()]
    assert list(plan.styles) == sorted(plan.styles, key=order.index)
    assert list(plan.blocks) == sorted(plan.blocks, key=order.index)


def test_block_of() -> None:
    plan = detect(NanoGPT(), 2)
    assert plan.block_of("transformer.h.1.attn.c_proj") == "transformer.h.1.attn"
    assert plan.block_of("transformer.h.0.mlp") == "transformer.h.0.mlp"
    assert plan.block_of("lm_head") is None


# ---- TinyLlama: GQA, SwiGLU, untied head ---------------------------------------------------------------------------
def test_tinyllama() -> None:
    plan = detect(TinyLlama(), 2)
    for i in (0, 1):
        a = f"layers.{i}.attention"
        attn = plan.blocks[a]
        assert attn.kind == "attention"
        assert (attn.heads, attn.kv_heads, attn.head_dim) == (4, 2, 8)
        assert attn.layers == [f"{a}.wq", f"{a}.wk", f"{a}.wv", f"{a}.wo"]
        assert attn.fused == {}
        assert [plan.styles[n] for n in attn.layers] == ["colwise", "colwise", "colwise", "rowwise"]

        f = f"layers.{i}.feed_forward"
        mlp = plan.blocks[f]
        assert mlp.kind == "mlp"
        assert mlp.layers == [f"{f}.w1", f"{f}.w3", f"{f}.w2"]
        assert plan.styles[f"{f}.w1"] == plan.styles[f"{f}.w3"] == "colwise"
        assert plan.styles[f"{f}.w2"] == "rowwise"
    assert plan.styles["tok_embeddings"] == "vocab"
    assert plan.styles["output"] == "colwise_gather"
    assert len(plan.blocks) == 4


def test_tinyllama_kv_heads_limit_tp() -> None:
    """K/V heads that neither tp divides nor divide tp (3 of them at tp=2) cannot be given out whole or cut."""
    with pytest.raises(TensorParallelConfigError, match=r"tp=2 must divide num_kv_heads=3 of layers\.\d\.attention "
                                                        r"\(heads=6, kv_heads=3\); choose tp in \[1, 3, 6\]"):
        detect(TinyLlama(dim=48, n_heads=6, n_kv_heads=3), 2)


# ---- fewer K/V heads than tp (issue 30): each rank keeps the K/V heads its query heads read, whole ----------------
@pytest.mark.parametrize("name", ["mqa_llama", "mqa_fused", "hf_falcon"])
def test_kv_heads_fewer_than_tp_are_replicated(name: str) -> None:
    """Multi-query (separate k/v of one head, a fused [q | k | v], Falcon's fused query_key_value) at tp=2: query
    heads cut, the K/V rows held whole by both ranks (shares=2), not refused."""
    plan = detect(MODELS[name](), 2)
    attn = [b for b in plan.blocks.values() if b.kind == "attention"]
    assert len(attn) == 2 and all((b.heads, b.kv_heads) == (4, 1) for b in attn)
    for b in attn:
        specs = [s[0] for s in b.fused.values()]
        assert specs and all(s.replicated for s in specs), b.fused
        if len(b.layers) == 2:  # fused: q split, k and v shared
            assert specs[0].shares == (1, 2, 2) and specs[0].parts == (32, 8, 8)


def test_grouped_query_kv_fewer_than_tp_per_group_layout() -> None:
    """8 query heads over 2 K/V heads at tp=4: rank r holds query heads 2r, 2r+1 and K/V head r // 2, for a
    [q | k | v] layout and for one interleaved per group ([q_g... k_g v_g] per group, Falcon's new architecture)."""
    from lightning_tpp.core.sharding import shard_tensor, unshard_tensor
    from lightning_tpp.tensor_parallel.kv_share import shared_specs

    split, grouped = shared_specs([ShardSpec(0, (8, 2, 2)), ShardSpec(0)], heads=8, kv_heads=2, head_dim=1, tp=4)
    rows = torch.arange(12.0)
    q, k, v = rows[:8], rows[8:10], rows[10:]
    for r in range(4):
        assert shard_tensor(rows, split, r, 4).tolist() == [*q[2 * r:2 * r + 2], k[r // 2], v[r // 2]]
    assert unshard_tensor([shard_tensor(rows, split, r, 4) for r in range(4)], split).equal(rows)
    per_group = torch.arange(12.0)  # [q0 q1 q2 q3 k0 v0 | q4 q5 q6 q7 k1 v1]
    got = [shard_tensor(per_group, grouped, r, 4).tolist() for r in range(4)]
    assert got == [[0, 1, 4, 5], [2, 3, 4, 5], [6, 7, 10, 11], [8, 9, 10, 11]]
    assert unshard_tensor([torch.tensor(g) for g in got], grouped).equal(per_group)
    # a global gradient norm counts a shared K/V row on the first of its holders only
    owned = [torch.cat(split.owned(shard_tensor(rows, split, r, 4), 12, r, 4)).tolist() for r in range(4)]
    assert owned == [[0, 1, 8, 10], [2, 3], [4, 5, 9, 11], [6, 7]]


# ---- fused grouped-query qkv ---------------------------------------------------------------------------------------
def test_fused_gqa() -> None:
    plan = detect(FusedGQAModel(), 2)
    for i in (0, 1):
        attn = plan.blocks[f"attns.{i}"]
        assert attn.kind == "attention"
        assert (attn.heads, attn.kv_heads, attn.head_dim) == (4, 2, 8)
        candidates = attn.fused[f"attns.{i}.qkv"]
        assert candidates[0].parts == (32, 16, 16)
        assert candidates[0].dim == 0
        assert candidates == [ShardSpec(0, (32, 16, 16)), ShardSpec(0)]
        assert plan.styles[f"attns.{i}.qkv"] == "colwise"
        assert plan.styles[f"attns.{i}.proj"] == "rowwise"
        # nn.Sequential MLP: Linear, ReLU, Linear
        assert plan.blocks[f"mlps.{i}"].layers == [f"mlps.{i}.0", f"mlps.{i}.2"]
        assert plan.styles[f"mlps.{i}.0"] == "colwise" and plan.styles[f"mlps.{i}.2"] == "rowwise"
    assert plan.styles["emb"] == "vocab"
    assert plan.styles["head"] == "colwise_gather"


# ---- nn.TransformerEncoder ----------------------------------------------------------------------------------------
def test_encoder_mha() -> None:
    plan = detect(EncoderLM(), 2)
    for i in (0, 1):
        layer = f"encoder.layers.{i}"
        attn = f"{layer}.self_attn"
        assert plan.styles[attn] == "mha"
        assert plan.styles[f"{attn}.out_proj"] == "rowwise"
        mha = plan.blocks[attn]
        assert mha.kind == "mha"
        assert mha.layers == [attn, f"{attn}.out_proj"]
        assert (mha.heads, mha.kv_heads, mha.head_dim) == (4, 4, 8)
        assert mha.fused == {attn: [ShardSpec(0, (32, 32, 32))]}

        mlp = plan.blocks[layer]
        assert mlp.kind == "mlp"
        assert mlp.layers == [f"{layer}.linear1", f"{layer}.linear2"]
        assert plan.styles[f"{layer}.linear1"] == "colwise"
        assert plan.styles[f"{layer}.linear2"] == "rowwise"
    assert plan.styles["embed"] == "vocab"
    assert plan.styles["head"] == "colwise_gather"


def test_encoder_mha_heads_not_divisible() -> None:
    with pytest.raises(TensorParallelConfigError,
                       match=r"tp=8 must divide num_heads=4 of encoder\.layers\.\d\.self_attn"):
        detect(EncoderLM(), 8)


def test_mha_with_kdim_stays_replicated() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = nn.MultiheadAttention(32, 4, kdim=16, vdim=16)

    plan = detect(M(), 2)
    assert "attn" not in plan.styles and "attn" not in plan.blocks
    assert any(n.startswith("attn: nn.MultiheadAttention with kdim/vdim") for n in plan.notes)


# ---- Hugging Face --------------------------------------------------------------------------------------------------
def test_hf_llama_detect(hf_llama: nn.Module) -> None:
    plan = detect(hf_llama, 2)
    for i in (0, 1):
        a = f"model.model.layers.{i}.self_attn"
        attn = plan.blocks[a]
        assert attn.kind == "attention"
        assert (attn.heads, attn.kv_heads, attn.head_dim) == (4, 2, 8)
        assert [plan.styles[f"{a}.{p}"] for p in ("q_proj", "k_proj", "v_proj", "o_proj")] == \
            ["colwise", "colwise", "colwise", "rowwise"]
        m = f"model.model.layers.{i}.mlp"
        assert plan.blocks[m].kind == "mlp"
        assert [plan.styles[f"{m}.{p}"] for p in ("gate_proj", "up_proj", "down_proj")] == \
            ["colwise", "colwise", "rowwise"]
    assert plan.styles["model.model.embed_tokens"] == "vocab"
    assert plan.styles["model.lm_head"] == "colwise_gather"


def test_hf_llama_own_plan(hf_llama: nn.Module) -> None:
    own = hf_plan(hf_llama)
    assert own, "LlamaForCausalLM ships a tp plan"
    prefix = "model.model.layers."
    assert own[prefix + "*.self_attn.q_proj"] == "colwise"
    assert own[prefix + "*.self_attn.o_proj"] == "rowwise"
    assert own[prefix + "*.mlp.down_proj"] == "rowwise"
    assert "model.lm_head" in own
    modules = dict(hf_llama.named_modules())
    # fully qualified: every key is anchored at the wrapper's root and matches real modules
    for key in own:
        assert key.startswith(("model.model.", "model.lm_head")), key
        assert any(re.fullmatch(re.escape(key).replace(r"\*", ".*"), n) for n in modules), key


def test_hf_llama_own_plan_overlay_agrees_with_detect(hf_llama: nn.Module) -> None:
    plan = detect(hf_llama, 2)
    before = dict(plan.styles)
    overlay(hf_llama, plan, hf_plan(hf_llama), source="Hugging Face tp plan", strict=False)
    assert plan.styles == before
    # ... and it is not agreeing by doing nothing: laid over an empty plan, it sets most of the same styles
    alone = TPPlan()
    overlay(hf_llama, alone, hf_plan(hf_llama), source="Hugging Face tp plan", strict=False)
    assert len(alone.styles) >= 14, alone.styles  # q, k, v, o, gate, up, down of both layers at least
    assert {n: before.get(n) for n in alone.styles} == alone.styles


def test_hf_gpt2_detect(hf_gpt2: nn.Module) -> None:
    plan = detect(hf_gpt2, 2)
    for i in (0, 1):
        a = f"model.transformer.h.{i}.attn"
        attn = plan.blocks[a]
        assert attn.kind == "attention"
        assert (attn.heads, attn.kv_heads, attn.head_dim) == (4, 4, 8)
        # Conv1D keeps its weight as (in, out): the fused qkv is split along dim 1
        assert attn.fused[f"{a}.c_attn"][0] == ShardSpec(1, (32, 32, 32))
        assert plan.styles[f"{a}.c_attn"] == "colwise" and plan.styles[f"{a}.c_proj"] == "rowwise"
        m = f"model.transformer.h.{i}.mlp"
        assert plan.blocks[m].kind == "mlp"
        assert plan.styles[f"{m}.c_fc"] == "colwise" and plan.styles[f"{m}.c_proj"] == "rowwise"
    assert plan.styles["model.transformer.wte"] == "vocab"
    assert plan.styles["model.lm_head"] == "colwise_gather"
    assert "model.transformer.wpe" not in plan.styles


def test_hf_gpt2_own_plan(hf_gpt2: nn.Module) -> None:
    # GPT-2 ships no tp plan (transformers 5.25): the automatic plan alone decides (test_hf_gpt2_detect); the Llama
    # tests check that a shipped plan's keys are qualified from the wrapper's root
    assert hf_plan(hf_gpt2) == {}


def test_hf_plan_plain_model_is_empty() -> None:
    assert hf_plan(NanoGPT()) == {}


# ---- tp == 1 -------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("factory", [NanoGPT, TinyLlama, FusedGQAModel, EncoderLM])
def test_tp1_empty(factory: type) -> None:
    plan = detect(factory(), 1)
    assert plan.styles == {} and plan.blocks == {} and plan.notes == []


def test_tp1_empty_hf(hf_llama: nn.Module, hf_gpt2: nn.Module) -> None:
    assert detect(hf_llama, 1).styles == {}
    assert detect(hf_gpt2, 1).styles == {}


def test_tp1_never_raises() -> None:
    detect(NanoGPT(vocab=65, n_embd=24, n_head=3), 1)  # nothing to check at tp=1


# ---- errors ---------------------------------------------------------------------------------------------------------
def test_heads_not_divisible() -> None:
    # n_embd=24: MLP hidden 96 is divisible by 3, so the attention heads (4) are what fails
    with pytest.raises(TensorParallelConfigError,
                       match=r"tp=3 must divide num_heads=4 of transformer\.h\.\d\.attn \(heads=4, kv_heads=4\); "
                             r"choose tp in \[1, 2, 4\], or pass tp_plan=\{'transformer\.h\.\d\.attn': 'replicate'\}"):
        detect(NanoGPT(n_embd=24), 3)


def test_heads_not_divisible_default_nanogpt() -> None:
    # default NanoGPT (4 heads, MLP hidden 128): the first block in model order is named, and the choices suit
    # every block (not just the MLP, whose 128 would allow tp=8)
    with pytest.raises(TensorParallelConfigError,
                       match=r"tp=3 must divide num_heads=4 of transformer\.h\.0\.attn .*choose tp in \[1, 2, 4\]"):
        detect(NanoGPT(), 3)
    with pytest.raises(TensorParallelConfigError,
                       match=r"tp=8 must divide num_heads=4 of transformer\.h\.\d\.attn .*choose tp in \[1, 2, 4\]"):
        detect(NanoGPT(), 8)


def test_mlp_hidden_not_divisible() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.ff = nn.Sequential(nn.Linear(8, 6), nn.GELU(), nn.Linear(6, 8))

    with pytest.raises(TensorParallelConfigError,
                       match=r"tp=4 must divide the hidden size 6 of MLP ff; choose tp in \[1, 2, 3, 6\], "
                             r"or pass tp_plan=\{'ff': 'replicate'\}"):
        detect(Net(), 4)
    assert detect(Net(), 2).blocks["ff"].layers == ["ff.0", "ff.2"]


def test_overlay_strict_glob_matches_nothing() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    with pytest.raises(TensorParallelConfigError, match=r"tp_plan entry 'nothing\.\*' matches no module; module names"):
        overlay(model, plan, {"nothing.*": "colwise"}, source="tp_plan", strict=True)


def test_overlay_non_strict_glob_matches_nothing() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    before = dict(plan.styles)
    overlay(model, plan, {"nothing.*": "colwise"}, source="hf", strict=False)
    assert plan.styles == before


def test_overlay_unknown_style() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    with pytest.raises(TensorParallelConfigError,
                       match=re.escape(f"tp_plan style 'sequence_parallel' for 'lm_head' is not one of {STYLES}")):
        overlay(model, plan, {"lm_head": "sequence_parallel"}, source="tp_plan", strict=True)


def test_overlay_unknown_hf_style_is_a_note() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    overlay(model, plan, {"transformer.ln_f": "sequence_parallel"}, source="hf", strict=False)
    assert "transformer.ln_f" not in plan.styles
    assert any("transformer.ln_f: Hugging Face style 'sequence_parallel' is not supported" in n for n in plan.notes)


def test_overlay_vocab_on_linear() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    with pytest.raises(TensorParallelConfigError, match=r"tp_plan style 'vocab' does not fit 'lm_head' \(Linear\)"):
        overlay(model, plan, {"lm_head": "vocab"}, source="tp_plan", strict=True)


def test_overlay_colwise_on_norm() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    with pytest.raises(TensorParallelConfigError,
                       match=r"tp_plan style 'colwise' does not fit 'transformer\.ln_f' \(LayerNorm\)"):
        overlay(model, plan, {"transformer.ln_f": "colwise"}, source="tp_plan", strict=True)


# ---- overlays ----------------------------------------------------------------------------------------------------
def test_overlay_replicate_attention() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    overlay(model, plan, {"*.attn": "replicate"}, source="tp_plan", strict=True)
    assert not any(".attn" in k for k in plan.styles)
    assert set(plan.blocks) == {"transformer.h.0.mlp", "transformer.h.1.mlp"}
    assert plan.styles["transformer.h.0.mlp.c_fc"] == "colwise"
    assert plan.styles["lm_head"] == "colwise_gather"


def test_overlay_replicate_one_layer_replicates_block() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    with pytest.warns(UserWarning, match=r"tp_plan: replicating transformer\.h\.0\.attn\.c_proj replicates its whole "
                                         r"block transformer\.h\.0\.attn"):
        overlay(model, plan, {"transformer.h.0.attn.c_proj": "replicate"}, source="tp_plan", strict=True)
    assert "transformer.h.0.attn" not in plan.blocks
    assert "transformer.h.0.attn.c_attn" not in plan.styles
    assert "transformer.h.0.attn.c_proj" not in plan.styles
    # the rest is untouched
    assert "transformer.h.1.attn" in plan.blocks and "transformer.h.0.mlp" in plan.blocks
    assert plan.styles["transformer.h.1.attn.c_attn"] == "colwise"


def test_overlay_replicate_mha_out_proj() -> None:
    model = EncoderLM()
    plan = detect(model, 2)
    with pytest.warns(UserWarning, match="replicates its whole block encoder.layers.0.self_attn"):
        overlay(model, plan, {"encoder.layers.0.self_attn.out_proj": "replicate"}, source="tp_plan", strict=True)
    assert "encoder.layers.0.self_attn" not in plan.styles
    assert "encoder.layers.0.self_attn" not in plan.blocks
    assert plan.styles["encoder.layers.1.self_attn"] == "mha"
    assert plan.styles["encoder.layers.0.linear1"] == "colwise"


def test_overlay_replicate_vocab() -> None:
    model = NanoGPT()
    plan = detect(model, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not in a block: no warning
        overlay(model, plan, {"lm_head": "replicate", "transformer.wte": "replicate"}, source="tp_plan", strict=True)
    assert "lm_head" not in plan.styles and "transformer.wte" not in plan.styles


def test_overlay_adds_custom_block() -> None:
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = nn.Linear(8, 8)

    model = Net()
    plan = TPPlan()
    overlay(model, plan, {"proj": "colwise"}, source="tp_plan", strict=True)
    assert plan.styles == {"proj": "colwise"}
    assert plan.blocks[""].kind == "custom" and plan.blocks[""].layers == ["proj"]


def test_overlay_rowwise_on_embedding_becomes_vocab() -> None:
    model = NanoGPT(vocab=65)
    plan = detect(model, 2)
    overlay(model, plan, {"transformer.wpe": "rowwise"}, source="tp_plan", strict=True)
    assert plan.styles["transformer.wpe"] == "vocab"


def test_overlay_hf_style_names_are_translated() -> None:
    model = TinyLlama()
    plan = TPPlan()
    overlay(model, plan, {"layers.*.attention.wq": "local_colwise", "output": "colwise_rep",
                          "tok_embeddings": "embedding_rowwise"}, source="hf", strict=False)
    assert plan.styles["layers.0.attention.wq"] == "colwise"
    assert plan.styles["layers.1.attention.wq"] == "colwise"
    assert plan.styles["output"] == "colwise_gather"
    assert plan.styles["tok_embeddings"] == "vocab"


# ---- vocab fallback -------------------------------------------------------------------------------------------------
def test_vocab_not_divisible() -> None:
    plan = detect(NanoGPT(vocab=65), 2)
    assert "transformer.wte" not in plan.styles
    assert "lm_head" not in plan.styles
    assert len(plan.notes) == 1
    assert plan.notes[0].startswith("transformer.wte: vocab 65 not divisible by tp=2")
    assert "stay replicated" in plan.notes[0]
    assert plan.styles["transformer.h.0.attn.c_attn"] == "colwise"  # the rest is still planned


def test_untied_head_found() -> None:
    plan = detect(FusedGQAModel(vocab=48), 2)
    assert plan.styles["emb"] == "vocab" and plan.styles["head"] == "colwise_gather"


def test_replicating_the_offending_blocks_lifts_the_divisibility_error() -> None:
    from lightning_tpp.tensor_parallel.plan import check_divisible

    model = NanoGPT()
    plan = detect(model, 8, check=False)
    overlay(model, plan, {"*.attn": "replicate"}, source="tp_plan", strict=True)
    check_divisible(plan, 8)  # MLP hidden 128 divides by 8
    assert all(b.kind == "mlp" for b in plan.blocks.values())


def test_gated_mlp_beside_an_attention_child_is_an_mlp() -> None:
    """A block holding its own gated MLP next to an attention child: the child's head count belongs to the child."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.n_head = 4
            self.qkv, self.proj = nn.Linear(32, 96), nn.Linear(32, 32)

    class Blk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.attn = Attn()
            self.w1, self.w3, self.w2 = nn.Linear(32, 64), nn.Linear(32, 64), nn.Linear(64, 32)

    plan = detect(Blk(), 2)
    assert plan.blocks["attn"].kind == "attention"
    assert plan.blocks[""].kind == "mlp" and plan.blocks[""].layers == ["w1", "w3", "w2"]
    assert not plan.blocks[""].fused


class _Elsewhere(nn.Module):
    """What a pipeline stage holds in place of another stage's module (named in ``remote=``)."""


def test_plans_skip_modules_held_by_other_pipeline_stages() -> None:
    """Stage 0 of a pipeline: the last layer and the head live on stage 1. A user glob that matches them only in the
    whole model is not an error; the Hugging Face style for the head is skipped; no block contains a stand-in."""
    model = TinyLlama()
    whole = [n for n, _ in model.named_modules()]
    model.layers[1], model.output = _Elsewhere(), _Elsewhere()
    remote = {"layers.1", "output"}
    plan = detect(model, 2, remote=remote)
    assert plan.blocks and all(not b.startswith("layers.1") for b in plan.blocks)
    overlay(model, plan, {"layers.1.attention": "replicate"}, source="tp_plan", strict=True, whole_model=whole,
            remote=remote)
    overlay(model, plan, {"output": "colwise_gather"}, source="Hugging Face tp plan", strict=False, remote=remote)
    assert "output" not in plan.styles
    with pytest.raises(TensorParallelConfigError, match="'layers.9.attention' matches no module"):
        overlay(model, plan, {"layers.9.attention": "replicate"}, source="tp_plan", strict=True, whole_model=whole)


def test_a_block_containing_another_stages_module_stays_replicated() -> None:
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    assert detect(nn.Sequential(nn.Linear(8, 8), mlp), 2).blocks
    mlp[0] = _Elsewhere()
    assert not detect(nn.Sequential(nn.Linear(8, 8), mlp), 2, remote={"1.0"}).blocks


def test_an_output_projection_registered_first_is_not_read_as_an_mlp() -> None:
    """Phi-3's attention registers o_proj (d -> d) before qkv_proj (d -> 3d): not an MLP (d -> h -> d)."""

    class Attn(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.o_proj = nn.Linear(16, 16)
            self.qkv_proj = nn.Linear(16, 48)

    assert not detect(nn.Sequential(Attn()), 2).blocks


@pytest.mark.parametrize("here", ["first", "last"])
def test_vocab_pair_split_across_pipeline_stages(here: str) -> None:
    """Under a pipeline the embedding (stage 0) and the head (last stage) are on different ranks: each stage cuts its
    half of the pair (given the other stage's units as meta copies), so a tied weight's shards match in size."""
    import copy

    model = TinyLlama()
    remote_name = "output" if here == "first" else "tok_embeddings"
    twin = copy.deepcopy(getattr(model, remote_name)).to("meta")
    setattr(model, remote_name, nn.Identity())  # the stand-in a pipeline leaves
    plan = detect(model, 2, remote={remote_name: twin})
    local_name, style = ("tok_embeddings", "vocab") if here == "first" else ("output", "colwise_gather")
    assert plan.styles[local_name] == style
    assert remote_name not in plan.styles
    # without the other stage's units the pair is not seen: the half stays whole (what happened before)
    assert local_name not in detect(model, 2, remote=[remote_name]).styles


def test_embeddings_sharing_a_weight_are_cut_alike() -> None:
    """BART's shared, encoder and decoder token embeddings are one weight: all become vocab parallel, or the weight
    would be split into a shard and a whole copy."""
    model = TinyLlama()
    second = nn.Embedding(*model.tok_embeddings.weight.shape)
    second.weight = model.tok_embeddings.weight
    model.add_module("second_embeddings", second)
    plan = detect(model, 2)
    assert plan.styles["tok_embeddings"] == plan.styles["second_embeddings"] == "vocab"


# ---- blocks found from the forward's dataflow ------------------------------------------------------------------
def test_projections_that_are_direct_children_of_the_block() -> None:
    """q, k, v, o, up, down as the block's own children; heads only in ``view(B, S, -1, head_dim)``."""
    plan = detect(MODELS["flat_gpt"](), 2)
    for i in (0, 1):
        b = f"blocks.{i}"
        info = plan.blocks[b]
        assert (info.kind, info.heads, info.kv_heads, info.head_dim) == ("attention", 4, 4, 8)
        assert info.layers == [f"{b}.{n}" for n in ("q", "k", "v", "o", "up", "down")]
        assert info.row_layers() == [f"{b}.o", f"{b}.down"]
        assert {n: plan.styles[f"{b}.{n}"] for n in ("q", "k", "v", "o", "up", "down")} == {
            "q": "colwise", "k": "colwise", "v": "colwise", "o": "rowwise", "up": "colwise", "down": "rowwise"}
        assert info.sizes == {"num_heads": 4, "num_kv_heads": 4, "hidden": 128}


def test_attention_spread_over_sibling_modules() -> None:
    """q/k/v in one child (which alone looks like a d -> d -> d MLP), the maths in another, the output projection
    and the MLP at the block: one block, grouped by what feeds what."""
    plan = detect(MODELS["split_gpt"](), 2)
    assert set(plan.blocks) == {"blocks.0", "blocks.1"}  # not the q/k/v child, not the ModuleList
    info = plan.blocks["blocks.0"]
    assert info.row_layers() == ["blocks.0.proj", "blocks.0.fc_out"]
    assert [plan.styles[n] for n in info.layers] == ["colwise"] * 3 + ["rowwise", "colwise", "rowwise"]
    assert info.heads == 4


def test_a_module_list_is_never_a_block() -> None:
    """A list has no forward: layers grouped under it would never be checked numerically."""
    plan = detect(MODELS["split_gpt"](), 2)
    assert not any(isinstance(dict(MODELS["split_gpt"]().named_modules())[b], nn.ModuleList) for b in plan.blocks)


def test_dataflow_trace_leaves_no_trace() -> None:
    model = MODELS["flat_gpt"]()
    model.train()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    torch.manual_seed(123)
    expected = torch.rand(1)
    torch.manual_seed(123)
    detect(model, 2)
    assert torch.rand(1) == expected  # the global random state is untouched
    assert all(m.training for m in model.modules())
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


def test_dataflow_on_the_meta_device() -> None:
    with torch.device("meta"):
        model = MODELS["flat_gpt"]()
    assert detect(model, 2).styles == detect(MODELS["flat_gpt"](), 2).styles


class _MaskedFlatBlock(nn.Module):
    """Projections as direct children, and a forward that needs a mask: neither a layout nor a trace finds it."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, S, D = x.shape
        q, k, v = (f(x).view(B, S, 4, D // 4).transpose(1, 2) for f in (self.q, self.k, self.v))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(B, S, D))
        return x + self.fc2(F.gelu(self.fc1(x)))


def test_warning_when_less_than_half_of_the_blocks_is_sharded() -> None:
    from lightning_tpp.core.params import ShardIndex
    from lightning_tpp.tensor_parallel import coverage_warning

    model = nn.Module()
    model.blocks = nn.ModuleList([_MaskedFlatBlock() for _ in range(3)])
    plan = detect(model, 2)
    assert not plan.blocks
    message = coverage_warning(model, plan, 2, ShardIndex(), ["blocks.0", "blocks.1", "blocks.2"])
    assert message is not None
    assert "shards only 0% of the block parameters" in message and "3 of 3 blocks" in message
    assert "blocks.0: no known layout, and its forward could not be traced" in message and "mask" in message
    assert ("{'blocks.*.q': 'colwise', 'blocks.*.k': 'colwise', 'blocks.*.v': 'colwise', 'blocks.*.o': 'rowwise', "
            "'blocks.*.fc1': 'colwise', 'blocks.*.fc2': 'rowwise'}") in message


def test_no_warning_when_the_blocks_are_sharded() -> None:
    from lightning_tpp.core.params import ShardIndex, ShardInfo
    from lightning_tpp.tensor_parallel import coverage_warning

    model = MODELS["flat_gpt"]()
    plan = detect(model, 2)
    shards = ShardIndex()
    for name in plan.styles:
        for p in dict(model.named_modules())[name].parameters(recurse=False):
            shards.add(p, ShardInfo(ShardSpec(0), tuple(p.shape)))
    assert coverage_warning(model, plan, 2, shards, ["blocks.0", "blocks.1"]) is None


class _CenteredMLP(nn.Module):
    """fc1 -> subtract the mean over the hidden features -> fc2: two linears, not an MLP that can be cut by features."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h - h.mean(-1, keepdim=True))


def test_hidden_features_that_meet_in_a_reduction_stay_whole() -> None:
    model = nn.Sequential(_CenteredMLP(), nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 32)))
    plan = detect(model, 2)
    assert not plan.blocks and not plan.styles
    assert "meet in a norm or reduction" in plan.whole["0 (fc2)"]



def test_a_parameter_registered_twice_follows_its_shard() -> None:
    """BERT registers its decoder's bias on the decoder and on its parent (``cls.predictions.bias``): both names must
    hold the shard, or the tie breaks silently (the parent's name keeps the whole tensor, never updated)."""
    from lightning_tpp.core.comm import TPGroup
    from lightning_tpp.tensor_parallel import apply_plan

    class Head(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.decoder = nn.Linear(32, 64)
            self.bias = self.decoder.bias

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.decoder(x)

    model = nn.Sequential(nn.Embedding(64, 32), Head())
    plan = TPPlan(styles={"0": "vocab", "1.decoder": "colwise_gather"})
    shards = apply_plan(model, plan, TPGroup(None, 0, 1), verify=False)
    assert model[1].bias is model[1].decoder.bias and model[1].bias in shards


def test_sequential_linear_pairs_of_any_width() -> None:
    """Consecutive Linear layers of an nn.Sequential with only element-wise layers between them are column/row pairs,
    whatever their widths; a layer that mixes features (a norm) breaks the chain, a pair whose hidden width tp does
    not divide is left whole, and a Sequential subclass with its own forward is not read by its children."""
    model = nn.Sequential(nn.Embedding(64, 8), nn.Flatten(), nn.Linear(128, 96), nn.ReLU(), nn.Dropout(0.1),
                          nn.Linear(96, 48), nn.GELU(), nn.Linear(48, 10), nn.LayerNorm(10), nn.Linear(10, 6))
    plan = detect(model, 2)
    assert plan.styles == {"2": "colwise", "5": "rowwise"}  # 48 -> 10 then a norm: alone; the last one alone
    assert plan.blocks[""].row_layers() == ["5"]
    assert detect(nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 6), nn.Linear(6, 8), nn.Tanh(),
                                nn.Linear(8, 4)), 4).styles == {"0": "colwise", "2": "rowwise", "3": "colwise",
                                                                 "5": "rowwise"}
    # 6 % 4: the first layer stays whole and the pair starts at the second
    assert detect(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 4)),
                  4).styles == {"2": "colwise", "4": "rowwise"}
    with pytest.raises(TensorParallelConfigError, match="tp=8 must divide the hidden size 12"):  # no pair divides
        detect(nn.Sequential(nn.Linear(8, 12), nn.ReLU(), nn.Linear(12, 8)), 8)

    class Residual(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x + super().forward(x)

    assert detect(Residual(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8)), 2).styles  # an MLP by its dataflow


def test_head_inside_a_prediction_module_on_another_stage() -> None:
    """BERT's decoder sits inside the head unit (``cls.predictions``) that the last stage holds: given that unit's
    submodules as meta copies, the first stage cuts its embedding to match the decoder there."""
    import copy

    class Predictions(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transform, self.decoder = nn.Linear(16, 16), nn.Linear(16, 64)

    model = nn.Module()
    model.emb, model.cls = nn.Embedding(64, 16), Predictions()
    twin = copy.deepcopy(model.cls).to("meta")
    model.cls = nn.Identity()
    assert "emb" not in detect(model, 2, remote={"cls": twin}).styles
    plan = detect(model, 2, remote=dict(twin.named_modules(prefix="cls")))
    assert plan.styles == {"emb": "vocab"}


class _PartlyCutBlock(nn.Module):
    """Attention that the plan shards beside a bank of experts held as one 3-D parameter that it does not."""

    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(dim, 4, batch_first=True)
        self.experts = nn.Parameter(torch.zeros(8, dim, 4 * dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(x, x, x, need_weights=False)[0] + (x @ self.experts.sum(0)).sum(-1, keepdim=True)


def test_warning_when_every_block_is_partly_sharded() -> None:
    """No block entirely whole, less than half of the parameters sharded: the report explains the least sharded
    block (it used to index an empty list of whole blocks)."""
    from lightning_tpp.core.params import ShardIndex, ShardInfo
    from lightning_tpp.tensor_parallel import coverage_warning

    model = nn.Module()
    model.blocks = nn.ModuleList([_PartlyCutBlock() for _ in range(2)])
    plan = detect(model, 2)
    shards = ShardIndex()
    for name in plan.styles:
        for p in dict(model.named_modules())[name].parameters(recurse=False):
            shards.add(p, ShardInfo(ShardSpec(0), tuple(p.shape)))
    message = coverage_warning(model, plan, 2, shards, ["blocks.0", "blocks.1"])
    assert message is not None
    assert "every block is only partly sharded" in message and "for blocks.0 (_PartlyCutBlock)" in message
    assert "blocks.0: 8.2 K parameters left whole" in message


# --- the newcomer's view: the plan table of the whole model under a pipeline (issue #30, item 6) ---

def test_plan_table_lists_every_pp_rank_with_the_models_total() -> None:
    """Under pp each rank knows only its stage: the table holds every pp rank's modules (a ``pp rank`` column) and
    compares what each holds with the whole model's parameters, not with stage 0's."""
    from lightning_tpp.tensor_parallel.report import PlanRows, format_plan

    first = PlanRows((("wte", "Embedding", "vocab", "4.1 K", "8.2 K"),), 111_000, 214_000, 7, 14, ("b.0", "b.1"), ("a note",))
    last = PlanRows((("lm_head", "Linear", "colwise", "4.1 K", "8.2 K"),), 105_000, 207_000, 7, 12, ("b.0", "b.1"), ("a note",))
    table = format_plan([first, last], 2, model_params=413_000)
    assert re.search(r"^pp rank\s+module\s+type", table, re.M)
    assert re.search(r"^0\s+wte\s+Embedding\s+vocab", table, re.M) and re.search(r"^1\s+lm_head\s+Linear", table, re.M)
    assert "2 blocks, 14 of 26 parameter tensors sharded" in table
    assert table.count("note: a note") == 1
    assert "parameters per rank: 111 K on pp rank 0, 105 K on pp rank 1, of 413 K in the model (26.9% at most)" in table
    one = format_plan([first], 2)
    assert "pp rank" not in one and "parameters per rank: 111 K of 214 K (51.9%)" in one


# ---- per-head side tensors (issue 30): a whole (1, heads, S, S) bias meets this rank's (B, heads / tp, S, S) ------
@pytest.mark.parametrize("rank", [0, 1])
def test_whole_per_head_bias_is_cut_to_the_ranks_heads(rank: int) -> None:
    """T5's relative position bias (made whole by the first layer, passed to the others) added to the scores of
    this rank's heads, and given to scaled_dot_product_attention as its mask: cut to heads [2 rank, 2 rank + 2);
    a (B, 1, S, S) mask (an ordinary broadcast) is left alone."""
    from lightning_tpp.core.comm import TPGroup
    from lightning_tpp.tensor_parallel.heads import to_local_heads

    group = TPGroup(None, rank, 2)
    scores, bias, mask = torch.zeros(3, 2, 5, 5), torch.randn(1, 4, 5, 5), torch.zeros(3, 1, 5, 5)
    with torch.no_grad():
        args, _ = to_local_heads(torch.add, (scores, bias), {}, 4, group)
        assert args[1].equal(bias[:, 2 * rank:2 * rank + 2])
        args, kwargs = to_local_heads(F.scaled_dot_product_attention, (scores[..., :3],) * 3, {"attn_mask": bias},
                                      4, group)
        assert kwargs["attn_mask"].equal(bias[:, 2 * rank:2 * rank + 2])
        assert to_local_heads(torch.add, (scores, mask), {}, 4, group)[0][1] is mask


# ---- conditioned blocks (issue 30): DiT's adaLN-Zero block, forward(x, c) ----------------------------------------
def test_dit_blocks_are_recognised_and_modulation_cut() -> None:
    """The block's forward takes (x, c): it is traced with a made-up conditioning vector, so its fused qkv attention
    and its MLP are cut as in any block; each block's Linear(d, 6d) modulation is cut by columns and gathered; the patch
    embedding (pixels -> d) and the 16-row label embedding stay whole."""
    plan = detect(MODELS["dit"](), 2)
    for i in (0, 1):
        assert plan.blocks[f"blocks.{i}"].kind == "attention"
        assert plan.blocks[f"blocks.{i}"].rows == [f"blocks.{i}.proj", f"blocks.{i}.fc2"]
        assert plan.styles[f"blocks.{i}.adaLN_modulation.1"] == "colwise_gather"
    assert "final_modulation.1" not in plan.styles  # outside the blocks (an LM head would be too): whole
    assert "x_embedder" not in plan.styles and "y_embedder" not in plan.styles and "final" not in plan.styles
    assert any("y_embedder: 16 rows" in n for n in plan.notes)


def test_small_embedding_is_not_a_vocabulary() -> None:
    """An embedding of fewer than 32 rows with a matching d -> rows linear stays whole; 64 rows are still cut."""
    class Tiny(nn.Module):
        def __init__(self, rows: int) -> None:
            super().__init__()
            self.emb, self.head = nn.Embedding(rows, 8), nn.Linear(8, rows)

    assert "emb" not in detect(Tiny(16), 2).styles
    assert detect(Tiny(64), 2).styles == {"emb": "vocab", "head": "colwise_gather"}


class _MLA(nn.Module):
    """DeepSeek-V3's attention shape: a shared low-rank key/value projection whose rope part every head uses."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.q_b_proj = nn.Linear(dim, dim)
        self.kv_a_proj_with_mqa = nn.Linear(dim, 8 + 4)
        self.kv_b_proj = nn.Linear(8, 2 * dim)
        self.o_proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kv, k_pe = self.kv_a_proj_with_mqa(x).split([8, 4], dim=-1)
        q = self.q_b_proj(x)
        k, v = self.kv_b_proj(kv).chunk(2, dim=-1)
        return self.o_proj(torch.softmax((q + k) * k_pe.sum(-1, keepdim=True), dim=-1) * v)


class _MLAModel(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.layers = nn.ModuleList([nn.ModuleDict({"self_attn": _MLA()}) for _ in range(2)])
        self.norm = nn.LayerNorm(16)
        self.head = nn.Linear(16, 32)


def test_a_foreign_style_keeps_its_siblings_out_where_no_block_is_planned() -> None:
    """transformers 5.25's DeepSeek-V3 plan: q_b_proj / kv_b_proj colwise and o_proj rowwise around
    kv_a_proj_with_mqa's 'mla_kv_a_proj'. Applied without it, the rope key's gradient would be one rank's heads' only:
    none of them is applied (a note for each); an unsupported style on a module of the model itself (a norm's sequence
    parallelism) does not keep the model's other entries out."""
    model = _MLAModel()
    plan = TPPlan()
    overlay(model, plan, {"layers.*.self_attn.q_b_proj": "colwise", "layers.*.self_attn.kv_b_proj": "colwise",
                          "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
                          "layers.*.self_attn.o_proj": "rowwise", "norm": "sequence_parallel", "head": "colwise"},
            source="Hugging Face tp plan", strict=False)
    assert not any("self_attn" in name for name in plan.styles)
    assert plan.styles.get("head") == "colwise"
    assert sum("not applied: a layer of layers.0.self_attn" in note for note in plan.notes) == 3


def test_a_gathered_layer_beside_an_unsupported_sibling_is_applied_on_its_own() -> None:
    """Phi-3's plan: qkv_proj colwise_gather_output beside o_proj rowwise_split_input. A gathered output is whole on
    its own (sequence parallelism needs the attention planned): applied; the unsupported one is left out."""
    model = _MLAModel()
    plan = TPPlan()
    overlay(model, plan, {"layers.*.self_attn.q_b_proj": "colwise_gather_output",
                          "layers.*.self_attn.o_proj": "rowwise_split_input"}, source="Hugging Face tp plan", strict=False)
    assert plan.styles.get("layers.0.self_attn.q_b_proj") == "colwise_gather"
    assert "layers.0.self_attn.o_proj" not in plan.styles


# ---- replicated parameters used on this rank's heads (Qwen3's q_norm / k_norm) -----------------------------------
def _applied(model: nn.Module, with_hf_plan: bool) -> tuple[nn.Module, TPPlan]:
    from lightning_tpp.core.comm import TPGroup
    from lightning_tpp.tensor_parallel.apply import apply_plan

    plan = detect(model, 2)
    if with_hf_plan:
        overlay(model, plan, hf_plan(model), source="Hugging Face tp plan", strict=False)
    apply_plan(model, plan, TPGroup(None, 0, 2), verify=False)
    return model, plan


def test_hf_grad_allreduce_declared_partial_without_the_check() -> None:
    """Hugging Face's ``replicated_with_grad_allreduce`` (Qwen3's per-head norms) puts those parameters in their
    attention block's ``partial`` at apply time, so they are summed over tp with verify=False too, and nothing is
    left for the verify=False warning."""
    from lightning_tpp.tensor_parallel.apply import block_states, unchecked_replicated

    model, plan = _applied(HFCausalLMFamily("qwen3"), with_hf_plan=True)
    assert "model.model.layers.0.self_attn.q_norm" in plan.grad_allreduce
    named = {id(q): n for n, q in model.named_parameters()}
    partial = sorted(named[id(getattr(m, a))] for st in block_states(model) for m, a in st.partial)
    layers = sorted({n.split(".")[3] for n in partial})
    assert layers == ["0", "1"] and len(partial) == 4, partial
    assert all(n.endswith(("q_norm.weight", "k_norm.weight")) for n in partial), partial
    assert unchecked_replicated(model) == []


def test_unchecked_replicated_names_undeclared_per_head_parameters() -> None:
    """Without a plan that declares them, the same norms are what a verify=False run cannot classify: listed by name
    (the strategy warns with them); the parallel layers' own parameters are not."""
    from lightning_tpp.tensor_parallel.apply import unchecked_replicated

    model, _ = _applied(HFCausalLMFamily("qwen3"), with_hf_plan=False)
    names = unchecked_replicated(model)
    assert sorted(names) == sorted(f"model.model.layers.{i}.self_attn.{n}_norm.weight" for i in (0, 1)
                                   for n in ("q", "k")), names
    llama, _ = _applied(TinyLlama(), with_hf_plan=False)  # attention of projections only (its rotary table a buffer)
    assert unchecked_replicated(llama) == []


# ---- fused gated MLPs, features meeting other parameters, kinds left whole (issue #44 item 4) -----------------------
class _FusedGLU(nn.Module):
    def __init__(self, split: str) -> None:
        super().__init__()
        self.wi, self.wo, self.split = nn.Linear(8, 32), nn.Linear(16, 8), split

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.wi(x)
        a, g = h.chunk(2, dim=-1) if self.split == "chunk" else h.split(16, dim=-1) if self.split == "split" \
            else (h[..., :16], h[..., 16:])
        return self.wo(F.gelu(a) * g)


@pytest.mark.parametrize("split", ["chunk", "split", "slice"])
def test_fused_gate_and_up_are_cut_part_by_part(split: str) -> None:
    plan = detect(_FusedGLU(split), 2)
    info = plan.blocks[""]
    assert info.kind == "mlp" and info.layers == ["wi", "wo"] and info.sizes == {"hidden": 16}
    assert info.fused["wi"] == [ShardSpec(0, (16, 16)), ShardSpec(0)]  # each rank: its slice of a and of g


class _ScaledHidden(nn.Module):
    """in -> a learned scale per hidden feature -> out: the scale would need cutting with the features. (A depthwise
    convolution over them is a mixer, cut with its channels: ``tests/unit/test_tp_mixer.py``.)"""

    def __init__(self) -> None:
        super().__init__()
        self.inp, self.out = nn.Linear(8, 16), nn.Linear(16, 8)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.inp(x) * self.scale)


def test_features_meeting_another_parameter_stay_whole_with_the_reason() -> None:
    plan = detect(_ScaledHidden(), 2)
    assert plan.blocks == {}
    assert "meet another parameter of the module (mul on inp's output" in plan.whole[" (out)"]


def test_kinds_left_whole_are_named_with_their_share() -> None:
    from lightning_tpp.core.params import ShardIndex
    from lightning_tpp.tensor_parallel.report import whole_kinds

    class Stack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([_ScaledHidden(), _ScaledHidden()])
            self.small = nn.Linear(2, 2)

    model = Stack()
    plan = detect(model, 2)
    note = whole_kinds(model, plan, 2, ShardIndex(), ["blocks.0", "blocks.1"])
    assert note is not None and note.startswith("tensor parallelism (tp=2) keeps these kinds of layers whole")
    assert re.search(r"_ScaledHidden: 2 modules, 99% of the parameters: its hidden features meet another parameter", note)
    assert whole_kinds(model, plan, 2, ShardIndex(), ["blocks.0"], least=0.6) is None  # one holds 49%
