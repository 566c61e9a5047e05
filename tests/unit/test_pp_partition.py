"""Unit tests of ``lightning_tpp.pipeline.partition``: finding, describing and cutting the block sequence."""

from __future__ import annotations

import itertools
import random
import re

import pytest
import torch
from torch import nn

from lightning_tpp.pipeline.partition import (
    Partition,
    PipelinePartitionError,
    balance,
    bounds_from_counts,
    bounds_from_split_points,
    describe,
    find_block_sequences,
    plan_partition,
)
from models import VOCAB, EncoderLM, FusedGQAModel, HFT5, LitLM, NanoGPT, NestedListLM, Seq2Seq, TinyLlama


def _mlp() -> nn.Sequential:
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))


class _Wrapper(nn.Module):
    """What a LightningModule holding a plain Sequential looks like to the partitioner."""

    def __init__(self) -> None:
        super().__init__()
        self.net = _mlp()


class _BigEmbedding(nn.Module):
    """An embedding far heavier than a block, a light head: the first stage should get fewer blocks."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 8)  # 8000 parameters
        self.layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])  # 72 each
        self.head = nn.Linear(8, 2)


# ---- find_block_sequences -------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "factory, expected",
    [
        (NanoGPT, "transformer.h"),
        (TinyLlama, "layers"),
        (EncoderLM, "encoder.layers"),
        (lambda: LitLM("llama"), "model.layers"),
        (lambda: LitLM("hf_llama"), "model.model.model.layers"),
        (_mlp, ""),
        (_Wrapper, "net"),
    ],
    ids=["nanogpt", "llama", "encoder", "lit_llama", "lit_hf_llama", "sequential_root", "wrapped_sequential"],
)
def test_find_block_sequence(factory, expected):
    assert find_block_sequences(factory()) == (expected,)


def test_find_block_sequence_ignores_lists_nested_in_blocks():
    class Blk(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])  # a list inside each block
            self.proj = nn.Linear(32, 8)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = nn.Embedding(16, 8)
            self.blocks = nn.ModuleList([Blk() for _ in range(3)])

    model = M()
    assert find_block_sequences(model) == ("blocks",)
    members, pre, post, middle = describe(model, "blocks")
    assert members == (("blocks.0",), ("blocks.1",), ("blocks.2",)) and pre == ("emb",) and post == ()
    assert middle == ()


def test_encoder_decoder_stacks_follow_one_another():
    """nn.Transformer: the encoder's layers, then the decoder's; the encoder's final norm sits between them and goes
    with the last encoder block."""
    model = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=3, dim_feedforward=32,
                           batch_first=True)
    assert find_block_sequences(model) == ("encoder.layers", "decoder.layers")
    part = plan_partition(model, 2, balance_by=[2, 3])
    assert part.names == ("encoder.layers.0", "encoder.layers.1", "decoder.layers.0", "decoder.layers.1",
                          "decoder.layers.2")
    assert part.middle == (("encoder.norm", 2),) and part.post == ("decoder.norm",) and part.pre == ()
    assert part.owners()["encoder.norm"] == 0 and part.owners()["decoder.norm"] == 1


def test_encoder_decoder_in_a_lightning_module():
    """Embeddings registered before the transformer go with stage 0, the head with the last stage; the default cut
    balances parameters over the 4 blocks (decoder layers are heavier: cross-attention)."""
    part = plan_partition(Seq2Seq(), 2)
    assert part.blocks == ("transformer.encoder.layers", "transformer.decoder.layers")
    assert part.pre == ("src_embed", "tgt_embed") and part.post == ("transformer.decoder.norm", "out")
    assert part.bounds == ((0, 2), (2, 4))


def test_hugging_face_t5_stacks():
    part = plan_partition(HFT5(), 2)
    assert part.blocks == ("model.encoder.block", "model.decoder.block")
    assert [n for n, _ in part.middle] == ["model.encoder.final_layer_norm", "model.decoder.embed_tokens"]


def test_sibling_lists_are_zipped():
    """Lists zipped in one loop (norms/attns/mlps): block i is made of their i-th entries; lists far smaller than
    the largest (the norms here) are not blocks, and go with the stage of the first block like embeddings."""
    model = FusedGQAModel()
    assert find_block_sequences(model) == ("attns", "mlps")
    part = plan_partition(model, 2)
    assert part.members == (("attns.0", "mlps.0"), ("attns.1", "mlps.1"))
    assert part.bounds == ((0, 1), (1, 2))


def test_sibling_encoder_and_decoder_lists_are_not_zipped():
    class Flat(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.enc_layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
            self.dec_layers = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])

    assert plan_partition(Flat(), 2).members == (("enc_layers.0",), ("enc_layers.1",), ("dec_layers.0",),
                                                  ("dec_layers.1",))


def test_explicit_containers_run_one_after_the_other():
    part = plan_partition(FusedGQAModel(), 2, blocks=["attns", "mlps"])
    assert part.members == (("attns.0",), ("attns.1",), ("mlps.0",), ("mlps.1",))


def test_nested_lists_are_blocks():
    part = plan_partition(NestedListLM(), 2)
    assert part.names == ("layers.0", "layers.1") and part.post == ("norm", "to_logits")


@pytest.mark.parametrize("model", [nn.Linear(3, 3), nn.Sequential(nn.Linear(3, 3))], ids=["linear", "seq_of_one"])
def test_find_block_sequence_no_blocks_raises(model):
    with pytest.raises(PipelinePartitionError, match=r"no repeated block sequence .*Pass blocks="):
        find_block_sequences(model)


def test_find_block_sequence_skips_parameter_free_lists():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.acts = nn.ModuleList([nn.ReLU() for _ in range(8)])  # no parameters: not a block sequence
            self.blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(3)])

    assert find_block_sequences(M()) == ("blocks",)


# ---- describe -------------------------------------------------------------------------------------------------------
def test_describe_nanogpt():
    members, pre, post, _ = describe(NanoGPT(n_layer=3), "transformer.h")
    assert members == (("transformer.h.0",), ("transformer.h.1",), ("transformer.h.2",))
    assert pre == ("transformer.wte", "transformer.wpe")
    assert post == ("transformer.ln_f", "lm_head")


def test_describe_llama_and_root_sequential():
    members, pre, post, _ = describe(TinyLlama(n_layers=3), "layers")
    assert members == (("layers.0",), ("layers.1",), ("layers.2",))
    assert pre == ("tok_embeddings",) and post == ("norm", "output")
    members, pre, post, _ = describe(_mlp(), "")  # an activation goes with the layer before it
    assert members == (("0", "1"), ("2", "3"), ("4",)) and pre == () and post == ()
    members, pre, post, _ = describe(_Wrapper(), "net")
    assert members == (("net.0", "net.1"), ("net.2", "net.3"), ("net.4",)) and pre == () and post == ()


def test_describe_unknown_container_raises():
    with pytest.raises(PipelinePartitionError, match=r"blocks='nope' is not a module of the model"):
        describe(TinyLlama(), "nope")


# ---- balance (pure) -------------------------------------------------------------------------------------------------
def _stage_costs(costs, bounds, first_extra=0.0, last_extra=0.0):
    out = [sum(costs[a:b]) for a, b in bounds]
    out[0] += first_extra
    out[-1] += last_extra
    return out


def _assert_valid(bounds, n, stages):
    assert len(bounds) == stages
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (a, b), (c, _) in zip(bounds, bounds[1:]):
        assert b == c  # contiguous
    assert all(b > a for a, b in bounds)  # non-empty


@pytest.mark.parametrize(
    "costs, stages, kwargs, expected",
    [
        ([1, 1, 1, 1], 2, {}, [(0, 2), (2, 4)]),
        ([4, 1, 1, 1, 1], 2, {}, [(0, 1), (1, 5)]),
        ([1, 1, 1, 1, 4], 2, {}, [(0, 4), (4, 5)]),
        ([1, 2, 3, 4, 5, 6], 3, {}, [(0, 3), (3, 5), (5, 6)]),
        ([1, 1, 1, 1], 4, {}, [(0, 1), (1, 2), (2, 3), (3, 4)]),
        ([3, 1, 2], 1, {}, [(0, 3)]),
        ([1, 1, 1, 1, 1, 1], 2, {"last_extra": 2}, [(0, 4), (4, 6)]),
    ],
)
def test_balance_known_answers(costs, stages, kwargs, expected):
    assert balance(costs, stages, **kwargs) == expected


def test_balance_first_extra_gives_first_stage_fewer_blocks():
    costs = [1, 1, 1, 1, 1, 1]
    bounds = balance(costs, 2, first_extra=3)
    _assert_valid(bounds, 6, 2)
    (a0, b0), (a1, b1) = bounds
    assert b0 - a0 < b1 - a1
    assert max(_stage_costs(costs, bounds, first_extra=3)) == 5  # the optimum: 1 + 3 | 5, or 2 + 3 | 4


def test_balance_against_brute_force():
    rng = random.Random(1234)
    for _ in range(150):
        n = rng.randint(1, 8)
        stages = rng.randint(1, n)
        costs = [rng.choice([rng.randint(1, 20), round(rng.uniform(0.1, 10.0), 3)]) for _ in range(n)]
        first = rng.choice([0.0, 0.0, float(rng.randint(1, 30))])
        last = rng.choice([0.0, 0.0, float(rng.randint(1, 30))])
        bounds = balance(costs, stages, first_extra=first, last_extra=last)
        _assert_valid(bounds, n, stages)
        got = max(_stage_costs(costs, bounds, first, last))
        best = min(
            max(_stage_costs(costs, list(zip((0, *cuts), (*cuts, n))), first, last))
            for cuts in itertools.combinations(range(1, n), stages - 1)
        )
        assert got == pytest.approx(best, abs=1e-9), (costs, stages, first, last, bounds)


def test_balance_more_stages_than_blocks_raises():
    with pytest.raises(PipelinePartitionError, match=r"3 stages but only 2 blocks; use at most 2 stages"):
        balance([1.0, 1.0], 3)


# ---- explicit counts / split points ---------------------------------------------------------------------------------
def test_bounds_from_counts():
    assert bounds_from_counts([1, 3], 4) == [(0, 1), (1, 4)]
    assert bounds_from_counts([2, 1, 1], 4) == [(0, 2), (2, 3), (3, 4)]


@pytest.mark.parametrize("counts", [[1, 2], [2, 3], [0, 4], [-1, 5]], ids=["short", "long", "zero", "negative"])
def test_bounds_from_counts_errors(counts):
    msg = re.escape(f"balance={counts} must give every stage at least one block and add up to the 4 blocks")
    with pytest.raises(PipelinePartitionError, match=msg):
        bounds_from_counts(counts, 4)


NAMES = ("layers.0", "layers.1", "layers.2", "layers.3")


def test_bounds_from_split_points():
    assert bounds_from_split_points(["layers.1"], [(n,) for n in NAMES], 2) == [(0, 1), (1, 4)]
    assert bounds_from_split_points(["layers.2"], [(n,) for n in NAMES], 2) == [(0, 2), (2, 4)]
    assert bounds_from_split_points(["layers.1", "layers.3"], [(n,) for n in NAMES], 3) == [(0, 1), (1, 3), (3, 4)]
    assert bounds_from_split_points([], [(n,) for n in NAMES], 1) == [(0, 4)]


@pytest.mark.parametrize(
    "points, stages, match",
    [
        (["layers.9"], 2, r"split point 'layers\.9' is not a block; blocks are \['layers\.0'"),
        (["layers.2", "layers.1"], 3, r"must be in increasing block order and skip the first block 'layers\.0'"),
        (["layers.1", "layers.1"], 3, r"must be in increasing block order"),
        (["layers.0"], 2, r"skip the first block 'layers\.0'"),
        (["layers.1"], 3,
         r"split_points=\['layers\.1'\] must name 2 blocks \(where stages 1\.\.2 start\) for 3 stages"),
        (["layers.1", "layers.2"], 2, r"must name 1 blocks .* for 2 stages"),
        ([], 2, r"split_points=\[\] must name 1 blocks"),
    ],
    ids=["unknown", "wrong_order", "repeated", "first_block", "too_few", "too_many", "empty"],
)
def test_bounds_from_split_points_errors(points, stages, match):
    with pytest.raises(PipelinePartitionError, match=match):
        bounds_from_split_points(points, [(n,) for n in NAMES], stages)


# ---- plan_partition -------------------------------------------------------------------------------------------------
def _param_count(m: nn.Module) -> float:
    return float(sum(p.numel() for p in m.parameters()))


def test_plan_partition_default_balances_params():
    model = TinyLlama(n_layers=4)
    part = plan_partition(model, 2)
    assert isinstance(part, Partition)
    assert part.blocks == ("layers",)
    assert part.names == NAMES
    assert part.pre == ("tok_embeddings",) and part.post == ("norm", "output")
    assert part.bounds == ((0, 2), (2, 4))
    assert part.stages == 2
    assert [part.stage_of_block(i) for i in range(4)] == [0, 0, 1, 1]
    # the same as balancing the parameter counts by hand, pre/post included
    mods = dict(model.named_modules())
    costs = [_param_count(mods[n]) for n in part.names]
    first = sum(_param_count(mods[n]) for n in part.pre)
    last = sum(_param_count(mods[n]) for n in part.post)
    assert list(part.bounds) == balance(costs, 2, first_extra=first, last_extra=last)


def test_plan_partition_counts_pre_and_post_params():
    part = plan_partition(_BigEmbedding(), 2)
    assert part.pre == ("emb",) and part.post == ("head",)
    assert part.bounds == ((0, 1), (1, 4))


def test_plan_partition_explicit_counts():
    part = plan_partition(TinyLlama(n_layers=4), 2, balance_by=[1, 3])
    assert part.bounds == ((0, 1), (1, 4))
    assert [part.stage_of_block(i) for i in range(4)] == [0, 1, 1, 1]


def test_plan_partition_explicit_counts_errors():
    model = TinyLlama(n_layers=4)
    with pytest.raises(PipelinePartitionError, match=re.escape("balance=[1, 1, 2] has 3 entries for 2 stages")):
        plan_partition(model, 2, balance_by=[1, 1, 2])
    with pytest.raises(PipelinePartitionError, match=re.escape("balance=[2, 3] must give every stage")):
        plan_partition(model, 2, balance_by=[2, 3])


def test_plan_partition_split_points():
    part = plan_partition(TinyLlama(n_layers=4), 2, split_points=["layers.1"])
    assert part.bounds == ((0, 1), (1, 4))
    # split points win over balance counts
    part = plan_partition(TinyLlama(n_layers=4), 2, split_points=["layers.3"], balance_by=[2, 2])
    assert part.bounds == ((0, 3), (3, 4))


def test_plan_partition_block_costs_override():
    model = TinyLlama(n_layers=4)
    assert plan_partition(model, 2, block_costs=[3.0, 1.0, 1.0, 1.0]).bounds == ((0, 1), (1, 4))
    assert plan_partition(model, 2, block_costs=[1.0, 1.0, 1.0, 3.0]).bounds == ((0, 3), (3, 4))
    assert plan_partition(model, 4, block_costs=[1.0, 1.0, 1.0, 1.0]).bounds == ((0, 1), (1, 2), (2, 3), (3, 4))


def test_plan_partition_explicit_blocks():
    model = nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=4, dim_feedforward=32,
                           batch_first=True)
    part = plan_partition(model, 2, blocks="decoder.layers", block_costs=[1.0] * 4)
    assert part.blocks == ("decoder.layers",)
    assert part.names == tuple(f"decoder.layers.{i}" for i in range(4))
    assert part.bounds == ((0, 2), (2, 4))


def test_plan_partition_too_many_stages_raises():
    with pytest.raises(PipelinePartitionError, match=r"pp=3 stages .*'layers' has only 2 blocks; use at most 2 stages"):
        plan_partition(TinyLlama(n_layers=2), 3)


# ---- edge cases ------------------------------------------------------------------------------------------------------
def test_find_block_sequence_root_sequential_of_containers():
    model = nn.Sequential(*[nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)) for _ in range(3)])
    assert find_block_sequences(model) == ("",)


def test_plan_partition_root_owned_parameter():
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.pos = nn.Parameter(torch.zeros(4))
            self.emb = nn.Embedding(10, 4)
            self.layers = nn.ModuleList([nn.Linear(4, 4) for _ in range(4)])
            self.head = nn.Linear(4, 10)

    part = plan_partition(M(), 2)
    assert "" not in part.pre
    assert part.bounds == ((0, 2), (2, 4))
    from lightning_tpp.pipeline.partition import ancestor_parameters

    assert ancestor_parameters(M(), "layers") == ("pos",)


@pytest.mark.parametrize("costs", [[1.0, 1.0], [1.0] * 6], ids=["short", "long"])
def test_plan_partition_block_costs_wrong_length(costs):
    with pytest.raises(PipelinePartitionError, match=rf"{len(costs)} block costs for the 4 blocks of 'layers'"):
        plan_partition(TinyLlama(n_layers=4), 2, block_costs=costs)


def test_measured_block_costs_follow_the_work() -> None:
    """balance='time': a block doing 4x the work measures as the most expensive, and the cut isolates it."""
    from lightning_tpp.pipeline.partition import balance
    from lightning_tpp.pipeline.build import measure_block_costs

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList([nn.Sequential(nn.Linear(256, 256 * w), nn.Linear(256 * w, 256))
                                         for w in (1, 1, 1, 8)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    torch.manual_seed(0)
    net, x = Net(), torch.randn(64, 256)
    # up to three measurements: a narrow block slowed once by another process on busy cores (0.025 s against the
    # wide one's 0.004 in one CI run) does not fail it; costs that did not follow the work would fail all three
    for _ in range(3):
        costs = measure_block_costs(net, [(f"layers.{i}",) for i in range(4)], x, repeats=5)
        assert len(costs) == 4
        if max(costs) == costs[3]:
            break
    assert max(costs) == costs[3], costs
    assert balance(costs, 2) == [(0, 3), (3, 4)]


class _HeadFirstGPT(nn.Module):
    """litgpt's layout: the head registered before the module holding the embedding, the blocks and the final norm."""

    def __init__(self, n_layers: int = 4) -> None:
        super().__init__()
        self.lm_head = nn.Linear(8, VOCAB, bias=False)
        self.transformer = nn.ModuleDict(dict(wte=nn.Embedding(VOCAB, 8),
                                              h=nn.ModuleList([nn.Linear(8, 8) for _ in range(n_layers)]),
                                              ln_f=nn.LayerNorm(8)))

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.transformer.wte(idx)
        for block in self.transformer.h:
            x = torch.relu(block(x))
        return self.lm_head(self.transformer.ln_f(x))


def test_a_head_registered_before_the_blocks_goes_with_the_last_stage() -> None:
    """Placed by when the forward first calls it (one forward of a meta copy), not by registration order; the model
    and the random generators are untouched."""
    model = _HeadFirstGPT()
    before = {n: t.clone() for n, t in model.state_dict().items()}
    rng = torch.get_rng_state()
    part = plan_partition(model, 2)
    assert part.pre == ("transformer.wte",) and set(part.post) == {"lm_head", "transformer.ln_f"}
    assert part.owners()["lm_head"] == 1
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(t, before[n]) and t.device.type == "cpu" for n, t in model.state_dict().items())
    assert not any(m._forward_pre_hooks for m in model.modules())


def test_a_lightning_module_is_run_on_its_example_input() -> None:
    class Lit(LitLM):
        def __init__(self) -> None:
            super().__init__("nanogpt")
            self.model = _HeadFirstGPT()
            self.example_input_array = torch.zeros(2, 8, dtype=torch.long)

    part = plan_partition(Lit(), 2)
    assert part.owners()["model.lm_head"] == 1


def test_a_forward_that_cannot_be_run_keeps_registration_order() -> None:
    """A forward that needs more than token ids: placed by registration, as before (the stage trace then explains)."""
    class TwoInputs(_HeadFirstGPT):
        def forward(self, idx: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(idx) * mask

    part = plan_partition(TwoInputs(), 2)
    assert part.owners()["lm_head"] == 0 and part.owners()["transformer.ln_f"] == 1


def test_an_embedding_registered_after_the_blocks_goes_with_the_first_stage() -> None:
    class EmbeddingLast(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(4)])
            self.head, self.emb = nn.Linear(8, VOCAB), nn.Embedding(VOCAB, 8)

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.emb(idx)
            for block in self.blocks:
                x = block(x)
            return self.head(x)

    part = plan_partition(EmbeddingLast(), 2)
    assert part.pre == ("emb",) and part.post == ("head",)


# ---- a plain nn.Sequential of mixed layers, wherever it sits (issue #30 item 5) ----------------------------------
class _SeqBesideOthers(nn.Module):
    """A LightningModule's way: the MLP as ``self.net`` beside a loss module and a small head."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Embedding(VOCAB, 8), nn.Flatten(), nn.Linear(16 * 8, 96), nn.ReLU(),
                                 nn.Linear(96, 96), nn.ReLU(), nn.Linear(96, 10))
        self.loss = nn.CrossEntropyLoss()
        self.head = nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.net(x))


def _nested(inner_kids: int = 3) -> nn.Sequential:
    """An outer Sequential of four layers with parameters, the second a Sequential holding most of them."""
    inner = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), *[nn.Linear(64, 64) for _ in range(inner_kids - 2)],
                          nn.Linear(64, 16))
    return nn.Sequential(nn.Linear(16, 16), inner, nn.Linear(16, 16), nn.Linear(16, 16))


def test_a_sequential_beside_other_modules_is_the_block_sequence() -> None:
    model = _SeqBesideOthers()
    assert find_block_sequences(model) == ("net",)
    part = plan_partition(model, 2)
    assert part.members == (("net.0", "net.1"), ("net.2", "net.3"), ("net.4", "net.5"), ("net.6",))
    assert part.pre == () and part.post == ("head",)
    assert part.bounds == ((0, 2), (2, 4))  # 512 + 12384 against 9312 + 970 + 110


@pytest.mark.parametrize(("name", "container"), [("seq_in_module", "model.net"),
                                                  ("seq_nested", "model.encoder.layers")])
def test_a_sequential_inside_a_module_is_the_block_sequence(name: str, container: str) -> None:
    """Held by a module that is not a Sequential, which calls it in its forward; what is outside runs as embeddings
    and heads do (placed by when the forward calls it)."""
    part = plan_partition(LitLM(name), 2)
    assert part.blocks == (container,)
    if name == "seq_nested":  # the encoder's final norm and the head after the layers, the embedding before them
        assert part.pre == ("model.embed",) and part.post == ("model.encoder.norm", "model.head")
        assert part.members[1] == ("model.encoder.layers.1", "model.encoder.layers.2")  # Linear + GELU
    else:
        assert part.pre == () and part.post == ("model.norm",)


def test_the_deepest_sequential_with_enough_children_is_taken() -> None:
    """The inner Sequential holds most parameters: its children are the blocks while it has one per stage, else the
    outer one's are."""
    assert find_block_sequences(_nested(), stages=2) == ("1",)
    assert find_block_sequences(_nested(), stages=3) == ("1",)
    assert find_block_sequences(_nested(), stages=4) == ("",)
    part = plan_partition(_nested(), 4)
    assert part.blocks == ("",) and len(part.members) == 4
    part = plan_partition(_nested(), 2)
    assert part.pre == ("0",) and part.post == ("2", "3") and part.members[0] == ("1.0", "1.1")


def test_a_sequential_cut_by_balance_split_points_and_measured_costs() -> None:
    model = LitLM("seq_in_module")  # blocks: net.0 | net.1 net.2 | net.3 | net.4 net.5 | net.6
    assert plan_partition(model, 2, balance_by=[1, 4]).bounds == ((0, 1), (1, 5))
    assert plan_partition(model, 2, split_points=["model.net.4"]).bounds == ((0, 3), (3, 5))
    assert plan_partition(model, 2, block_costs=[1.0, 1.0, 1.0, 1.0, 9.0]).bounds == ((0, 4), (4, 5))
    with pytest.raises(PipelinePartitionError, match=r"split point 'model.net.9' is not a block"):
        plan_partition(model, 2, split_points=["model.net.9"])
    with pytest.raises(PipelinePartitionError, match=r"split point 'model.net.5' has no parameters and runs in the "
                                                     r"block of 'model.net.4'; name a block, e.g. 'model.net.4'"):
        plan_partition(model, 2, split_points=["model.net.5"])


def test_parameter_free_children_join_a_neighbour() -> None:
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 4), nn.ReLU(), nn.Dropout(0.0), nn.Linear(4, 4), nn.Tanh())
    assert describe(model, "")[0] == (("0", "1", "2", "3"), ("4", "5"))
    assert plan_partition(model, 2).bounds == ((0, 1), (1, 2))


class _OwnForward(nn.Sequential):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return self[1](self[0](x))


class _SmallSequential(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(1000, 8)
        self.net = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))


@pytest.mark.parametrize(("factory", "stages", "why"), [
    (_SmallSequential, 2, r"'net' holds 144 of the 8144 parameters, not more than half\. .*blocks='net' takes its "
                          r"children; what lies outside it runs as embeddings and heads do\), then balance="),
    (lambda: LitLM("seq_in_module"), 6, r"'model.net' has 5 children with parameters, fewer than the 6 stages\. "
                                        r"Pass blocks=.*\(use at most 5 stages .*split_points="),
    (lambda: _OwnForward(nn.Linear(4, 4), nn.LayerNorm(4)), 2,
     r"the model itself \(_OwnForward\) has its own forward, which need not run its children in order\. .*"
     r"blocks='' takes its children if its forward calls them one after the other"),
    (lambda: nn.Sequential(nn.Linear(4, 4), nn.ReLU()), 2, r"the model itself has 1 child with parameters, fewer "
                                                         r"than the 2 stages"),
    (lambda: nn.Linear(4, 4), 2, r"and the model has no nn.Sequential\. Pass blocks='<module name>'"),
], ids=["under_half", "fewer_children_than_stages", "own_forward", "one_child", "no_sequential"])
def test_nothing_to_pipeline_names_the_largest_sequential_and_why(factory, stages: int, why: str) -> None:
    with pytest.raises(PipelinePartitionError, match=r"no repeated block sequence in \w+: .*" + why):
        plan_partition(factory(), stages)


# ---- stacks of several classes, dicts, and what is not a stack (issue #44 item 2) -----------------------------------
class _Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv, self.proj = nn.Conv1d(8, 8, 3, groups=8), nn.Linear(8, 8)


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv, self.out = nn.Linear(8, 24), nn.Linear(8, 8)


def test_layers_of_several_classes_in_one_list_are_the_stack():
    """A hybrid's list (Mamba-like mixers and attention): the stack, not a small same-class list inside a layer."""
    class Hybrid(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.layers = nn.ModuleList([_Mixer(), _Mixer(), _Attn(), _Mixer()])
            self.layers[2].heads = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])  # a small list inside a layer
            self.head = nn.Linear(8, 16)

    model = Hybrid()
    assert find_block_sequences(model) == ("layers",)
    part = plan_partition(model, 2)
    assert part.names == ("layers.0", "layers.1", "layers.2", "layers.3") and part.pre == ("embed",)


def test_blocks_in_a_module_dict():
    class DictStack(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(16, 8)
            self.blocks = nn.ModuleDict({"first": _Attn(), "second": _Attn(), "third": _Attn()})

    part = plan_partition(DictStack(), 3)
    assert part.blocks == ("blocks",) and part.names == ("blocks.first", "blocks.second", "blocks.third")


def test_a_namespace_dict_around_a_stack_is_not_a_stack():
    """nanoGPT's ``transformer`` dict (wte, wpe, h, ln_f), and a dict of plain layers of several classes."""
    class Namespaced(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.parts = nn.ModuleDict({"embed": nn.Embedding(16, 8), "norm": nn.LayerNorm(8),
                                        "h": nn.ModuleList([_Attn() for _ in range(3)])})
            self.io = nn.ModuleDict({"inp": nn.Linear(8, 8), "out": nn.Conv1d(8, 8, 1)})  # leaves: not layers

    assert find_block_sequences(Namespaced()) == ("parts.h",)


def test_stand_ins_keep_the_class_of_the_unit():
    """Code that finds layers by class (Hugging Face's output_hidden_states hooks) finds a stand-in too; it has no
    parameters and reads attributes through its meta twin."""
    from lightning_tpp.pipeline.stage import StageRuntime, _RemoteModule, meta_twin, remote_module

    layer = _Attn()
    remote = remote_module(meta_twin(layer), StageRuntime(torch.device("cpu")), unit=0)
    assert isinstance(remote, _Attn) and isinstance(remote, _RemoteModule)
    assert list(remote.parameters()) == [] and remote.qkv.weight.is_meta


def test_a_stack_holding_less_than_half_is_named_with_the_others():
    class Small(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(512, 32)  # most of the parameters
            self.blocks = nn.ModuleList([_Attn() for _ in range(3)])
            self.side = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])

    from lightning_tpp.pipeline.partition import minor_stack

    note = minor_stack(Small(), find_block_sequences(Small()))
    assert note is not None and note.startswith("pipeline stages cut 'blocks', which holds 5% of the 17288 parameters")
    assert "other stacks: 'side' (0%)" in note and "Pass blocks=" in note
    assert minor_stack(nn.Transformer(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
                                      dim_feedforward=32), ("encoder.layers", "decoder.layers")) is None
