"""Single-process tests of how state-space and convolution mixers are cut under tensor parallelism
(``lightning_tpp.tensor_parallel.mixer``): Mamba-2 by heads and groups, Mamba by channels with its x_proj's output
all-reduced both ways, a gated depthwise-convolution mixer; and the mixers that stay whole, each with its reason."""

from __future__ import annotations

import torch
from models import DIM, MODELS
from models_stacks import GatedConvBlock, Mamba2Mixer

from lightning_tpp.core.sharding import ShardSpec
from lightning_tpp.tensor_parallel.plan import detect


def test_mamba2_cut_by_heads_and_groups() -> None:
    plan = detect(Mamba2Mixer(), 2)  # d_inner 64, 8 heads of 8, 2 groups of B/C with 8 states
    info = plan.blocks[""]
    assert info.kind == "mixer" and info.layers == ["in_proj", "out_proj"] and info.row_layers() == ["out_proj"]
    assert info.fused["in_proj"] == [ShardSpec(0, (64, 64, 16, 16, 8))]  # [z | x | B | C | dt]
    assert info.cut["conv1d.weight"] == info.cut["conv1d.bias"] == ShardSpec(0, (64, 16, 16))  # over [x | B | C]
    assert {info.cut[n] for n in ("A_log", "D", "dt_bias", "norm_weight")} == {ShardSpec(0)}
    assert info.local_attrs == {"d_inner": 32, "nheads": 4, "ngroups": 1, "conv1d.in_channels": 48,
                                "conv1d.out_channels": 48, "conv1d.groups": 48}
    assert plan.styles == {"in_proj": "colwise", "out_proj": "rowwise"}


def test_hf_mamba_x_proj_rejoins_and_dt_proj_follows_the_channels() -> None:
    plan = detect(MODELS["hf_mamba"](), 2)
    name = "model.backbone.layers.0.mixer"
    info = plan.blocks[name]
    assert info.rows == [f"{name}.x_proj", f"{name}.out_proj"] and info.rejoin == [f"{name}.x_proj"]
    assert info.fused[f"{name}.in_proj"] == [ShardSpec(0, (64, 64))]  # [x | z]
    assert {n.removeprefix(f"{name}.") for n in info.cut} == {"conv1d.weight", "conv1d.bias", "dt_proj.weight",
                                                              "dt_proj.bias", "A_log", "D"}
    assert info.local_attrs[f"{name}.dt_proj.out_features"] == 32
    assert info.local_attrs[f"{name}.intermediate_size"] == 32
    assert f"{name}.dt_proj" not in plan.styles  # read as a weight by some mixers: cut, never swapped


def test_gated_conv_mixer_cut_and_its_input_norm_of_the_same_width_kept_whole() -> None:
    block = GatedConvBlock()  # LayerNorm(32) on the input, 32 conv channels: the same size, not the same role
    plan = detect(block, 2)
    info = plan.blocks[""]
    assert info.kind == "mixer" and set(info.cut) == {"conv.weight", "conv.bias"}
    assert info.fused["in_proj"] == [ShardSpec(0, (DIM, DIM))]


def test_groups_that_tp_does_not_divide_keep_the_mixer_whole_with_the_reason() -> None:
    plan = detect(Mamba2Mixer(ngroups=1), 2)
    assert plan.blocks == {} and plan.styles == {}  # no parent cuts its projections either
    assert "1 group(s) of B/C and 8 heads: tp=2 must divide both" in plan.whole[""]


def test_non_persistent_buffer_cut_persistent_one_keeps_the_mixer_whole() -> None:
    class Scaled(Mamba2Mixer):
        def __init__(self, persistent: bool) -> None:
            super().__init__()
            self.register_buffer("mup", torch.linspace(0.5, 1.5, self.in_proj.out_features), persistent=persistent)

    plan = detect(Scaled(persistent=False), 2)
    assert plan.blocks[""].cut["mup"] == ShardSpec(0, (64, 64, 16, 16, 8))
    plan = detect(Scaled(persistent=True), 2)
    assert plan.blocks == {} and "per-channel tensors saved whole or frozen (['mup'])" in plan.whole[""]


def test_a_mixer_whose_forward_cannot_be_traced_stays_whole_with_the_reason() -> None:
    class NeedsMask(Mamba2Mixer):
        def forward(self, u: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
            return super().forward(u * mask[..., None])

    plan = detect(NeedsMask(), 2)
    assert plan.blocks == {}
    assert "could not be traced with made-up inputs (u, mask)" in plan.whole[""]


def test_a_mixer_reading_its_output_projection_as_a_weight_stays_whole_with_the_reason() -> None:
    plan = detect(MODELS["functional_reads"](), 2)  # F.linear(h, self.out_proj.weight, ...): never called
    assert "mamba.mixer" not in plan.blocks and "mamba.mixer.out_proj" not in plan.styles
    assert "not each called once in its forward (['in_proj'] called)" in plan.whole["mamba.mixer"]
