"""Which modules become FSDP2 units (``data_parallel.fsdp.fsdp_units``), which are computed over dp by rows instead
(``data_parallel.rows.candidates``), and the dp_sharding argument."""

from __future__ import annotations

import pytest
from torch import nn

from lightning_tpp.data_parallel import candidates, fsdp_units, normalize_sharding


class TiedLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed = nn.Embedding(10, 4)
        self.model.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.model.norm = nn.LayerNorm(4)
        self.head = nn.Linear(4, 10, bias=False)


def test_blocks_and_holders_are_units_children_first() -> None:
    m = TiedLM()
    units, replicated = fsdp_units(m, ["model.layers.0", "model.layers.1"])
    assert units == ["model.layers.0", "model.layers.1", "model.embed", "model.norm", "head"]
    assert replicated == []


def test_a_tied_weight_is_grouped_by_the_module_holding_both_ends() -> None:
    m = TiedLM()
    m.model.head = nn.Linear(4, 10, bias=False)
    m.model.head.weight = m.model.embed.weight  # tied inside model: model is their unit
    del m.head
    units, replicated = fsdp_units(m, ["model.layers.0", "model.layers.1"])
    assert units == ["model.layers.0", "model.layers.1", "model.norm", "model"]
    assert replicated == []


def test_parameters_of_the_root_and_weights_tied_across_it_stay_replicated() -> None:
    m = TiedLM()
    m.head.weight = m.model.embed.weight  # ends under the root only: the LightningModule's forward may never run
    m.pos = nn.Parameter(m.model.norm.weight.detach().clone())
    units, replicated = fsdp_units(m, ["model.layers.0", "model.layers.1"])
    assert "model.embed" not in units and "head" not in units
    assert sorted(replicated) == ["model.embed.weight", "pos"]


def test_no_blocks_each_holder_is_a_unit() -> None:
    units, _ = fsdp_units(nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 2)), [])
    assert units == ["0", "2"]


BLOCKS = ["model.layers.0", "model.layers.1"]


def test_vocabulary_matrices_are_computed_over_dp() -> None:
    m = TiedLM()
    m.wide = nn.Linear(10, 4)  # more columns than rows: not a vocabulary matrix
    m.renormed = nn.Embedding(10, 4, max_norm=1.0)  # renormalises rows in place: its own table needed whole
    assert candidates(m, BLOCKS) == ["model.embed", "head"]
    assert candidates(m, []) == []  # no block sequence: FSDP2's units


def test_a_weight_tied_across_the_root_is_computed_over_dp_not_replicated() -> None:
    m = TiedLM()
    m.head.weight = m.model.embed.weight
    rows = candidates(m, BLOCKS)
    assert rows == ["model.embed", "head"]
    units, replicated = fsdp_units(m, BLOCKS, skip={id(m.head.weight)})
    assert units == ["model.layers.0", "model.layers.1", "model.norm"] and replicated == []


def test_a_weight_also_held_by_another_kind_of_module_stays_with_fsdp() -> None:
    m = TiedLM()
    m.scale = nn.LayerNorm(4)
    m.head = nn.Linear(4, 4, bias=False)
    m.scale.weight = m.head.weight  # the norm computes with it too: not only F.linear / F.embedding
    assert candidates(m, BLOCKS) == ["model.embed"]


def test_sharding_names() -> None:
    assert normalize_sharding("FULL_SHARD") == "full_shard"
    assert normalize_sharding("shard_grad_op") == "shard_grad_op"
    with pytest.raises(ValueError, match=r"dp_sharding='zero3' must be one of .*'full_shard'"):
        normalize_sharding("zero3")


def test_shard_index_follows_a_stand_in_to_the_parameter_it_stands_for() -> None:
    """FSDP2 swaps a gathered copy in for forward: the index finds the sharded parameter's entry through ``resolve``."""
    import torch

    from lightning_tpp.core.params import ShardIndex, ShardInfo
    from lightning_tpp.core.sharding import ShardSpec

    sharded, gathered, other = (nn.Parameter(torch.ones(4, 2)) for _ in range(3))
    index = ShardIndex()
    index.add(sharded, ShardInfo(ShardSpec(0), (8, 2)))
    assert index.stored(gathered) is gathered and index.get(gathered) is None
    index.resolve = lambda p: sharded if p is gathered else None
    assert index.stored(gathered) is sharded and index.stored(other) is other and index.stored(sharded) is sharded
    assert index.spec(sharded) == ShardSpec(0) and index.get(other) is None
