"""Single-process tests of ``lightning_tpp.core.sharding`` (shard / unshard of plain and fused parameters)."""

from __future__ import annotations

import re

import pytest
import torch

from lightning_tpp.core.sharding import ShardSpec, shard_tensor, unshard_tensor


def _arange(*shape: int) -> torch.Tensor:
    return torch.arange(int(torch.tensor(shape).prod()), dtype=torch.float32).reshape(shape)


# ---- plain specs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_plain_round_trip(dim: int, world: int) -> None:
    full = _arange(8, 12)
    spec = ShardSpec(dim)
    shards = [shard_tensor(full, spec, r, world) for r in range(world)]
    for r, s in enumerate(shards):
        expected_shape = list(full.shape)
        expected_shape[dim] //= world
        assert list(s.shape) == expected_shape
        assert s.is_contiguous()
        # plain: contiguous block r of the dimension
        assert torch.equal(s, full.narrow(dim, r * expected_shape[dim], expected_shape[dim]))
    assert torch.equal(unshard_tensor(shards, spec), full)


def test_plain_exact_values_dim0() -> None:
    full = _arange(4, 2)  # rows [0 1] [2 3] [4 5] [6 7]
    spec = ShardSpec(0)
    assert shard_tensor(full, spec, 0, 2).tolist() == [[0, 1], [2, 3]]
    assert shard_tensor(full, spec, 1, 2).tolist() == [[4, 5], [6, 7]]


def test_plain_exact_values_dim1() -> None:
    full = _arange(2, 4)
    spec = ShardSpec(1)
    assert shard_tensor(full, spec, 0, 2).tolist() == [[0, 1], [4, 5]]
    assert shard_tensor(full, spec, 1, 2).tolist() == [[2, 3], [6, 7]]


def test_plain_1d_bias_round_trip() -> None:
    full = _arange(12)
    shards = [shard_tensor(full, ShardSpec(0), r, 3) for r in range(3)]
    assert [s.tolist() for s in shards] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert torch.equal(unshard_tensor(shards, ShardSpec(0)), full)


def test_shard_is_a_copy() -> None:
    full = _arange(4, 4)
    s = shard_tensor(full, ShardSpec(0), 0, 2)
    s.zero_()
    assert full[0, 1] == 1  # the original is untouched


# ---- fused specs --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("parts", [(8, 8, 8), (8, 4, 4), (4, 4), (16, 8, 8)])
@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("dim", [0, 1])
def test_fused_round_trip(parts: tuple[int, ...], world: int, dim: int) -> None:
    total = sum(parts)
    full = _arange(total, 6) if dim == 0 else _arange(6, total)
    spec = ShardSpec(dim, parts)
    spec.check(total, world, "w")
    shards = [shard_tensor(full, spec, r, world) for r in range(world)]
    for s in shards:
        assert s.shape[dim] == total // world
        assert s.shape[1 - dim] == 6
    assert torch.equal(unshard_tensor(shards, spec), full)


@pytest.mark.parametrize("parts", [(8, 8, 8), (8, 4, 4)])
@pytest.mark.parametrize("dim", [0, 1])
def test_fused_rank_holds_own_slice_of_each_segment(parts: tuple[int, ...], dim: int) -> None:
    world = 2
    total = sum(parts)
    full = _arange(total, 3) if dim == 0 else _arange(3, total)
    spec = ShardSpec(dim, parts)
    starts = [sum(parts[:i]) for i in range(len(parts))]
    for r in range(world):
        shard = shard_tensor(full, spec, r, world)
        expected = torch.cat([full.narrow(dim, start + r * (p // world), p // world)
                              for start, p in zip(starts, parts)], dim=dim)
        assert torch.equal(shard, expected)
        # and it is not what a plain (contiguous) split would give
        assert not torch.equal(shard, shard_tensor(full, ShardSpec(dim), r, world))


def test_fused_qkv_exact_values() -> None:
    # 1-d "weight" with q = 0..7, k = 8..15, v = 16..23; tp = 2
    full = torch.arange(24)
    spec = ShardSpec(0, (8, 8, 8))
    assert shard_tensor(full, spec, 0, 2).tolist() == [0, 1, 2, 3, 8, 9, 10, 11, 16, 17, 18, 19]
    assert shard_tensor(full, spec, 1, 2).tolist() == [4, 5, 6, 7, 12, 13, 14, 15, 20, 21, 22, 23]


def test_fused_grouped_exact_values() -> None:
    # q = 0..7, k = 8..11, v = 12..15 (grouped-query: kv narrower than q); tp = 2
    full = torch.arange(16)
    spec = ShardSpec(0, (8, 4, 4))
    assert shard_tensor(full, spec, 0, 2).tolist() == [0, 1, 2, 3, 8, 9, 12, 13]
    assert shard_tensor(full, spec, 1, 2).tolist() == [4, 5, 6, 7, 10, 11, 14, 15]
    shards = [shard_tensor(full, spec, r, 4) for r in range(4)]
    assert shards[3].tolist() == [6, 7, 11, 15]
    assert torch.equal(unshard_tensor(shards, spec), full)


def test_fused_transposed_weight_dim1_exact_values() -> None:
    # GPT-2 Conv1D layout: weight (in, out), fused along dim 1
    full = _arange(2, 12)  # row 0: 0..11, row 1: 12..23; parts q=4, k=4, v=4
    spec = ShardSpec(1, (4, 4, 4))
    assert shard_tensor(full, spec, 0, 2).tolist() == [[0, 1, 4, 5, 8, 9], [12, 13, 16, 17, 20, 21]]
    assert shard_tensor(full, spec, 1, 2).tolist() == [[2, 3, 6, 7, 10, 11], [14, 15, 18, 19, 22, 23]]


def test_fused_single_part_equals_plain() -> None:
    full = _arange(8, 3)
    for r in range(4):
        assert torch.equal(shard_tensor(full, ShardSpec(0, (8,)), r, 4), shard_tensor(full, ShardSpec(0), r, 4))


def test_round_trip_keeps_dtype() -> None:
    full = _arange(8, 4).to(torch.bfloat16)
    spec = ShardSpec(0, (4, 2, 2))
    shards = [shard_tensor(full, spec, r, 2) for r in range(2)]
    assert all(s.dtype == torch.bfloat16 for s in shards)
    assert torch.equal(unshard_tensor(shards, spec), full)


# ---- ShardSpec.check ------------------------------------------------------------------------------------------------
def test_check_passes() -> None:
    ShardSpec(0).check(8, 2, "w")
    ShardSpec(0).check(8, 8, "w")
    ShardSpec(1, (8, 4, 4)).check(16, 4, "w")
    ShardSpec(0, (8, 8, 8)).check(24, 1, "w")


def test_check_parts_do_not_add_up() -> None:
    with pytest.raises(ValueError, match=re.escape("qkv.weight: parts (8, 4, 4) do not add up to size 24 of dim 0")):
        ShardSpec(0, (8, 4, 4)).check(24, 2, "qkv.weight")


def test_check_parts_do_not_add_up_dim1() -> None:
    with pytest.raises(ValueError, match=re.escape("c_attn: parts (8, 8) do not add up to size 24 of dim 1")):
        ShardSpec(1, (8, 8)).check(24, 2, "c_attn")


def test_check_segment_not_divisible() -> None:
    msg = "qkv.weight: segment sizes (8, 4, 4) along dim 0 are not divisible by tp=8"
    with pytest.raises(ValueError, match=re.escape(msg)):
        ShardSpec(0, (8, 4, 4)).check(16, 8, "qkv.weight")


def test_check_segment_not_divisible_even_if_total_is() -> None:
    # total 12 is divisible by 4 but the segments (6, 3, 3) are not
    with pytest.raises(ValueError, match=re.escape("segment sizes (6, 3, 3) along dim 0 are not divisible by tp=4")):
        ShardSpec(0, (6, 3, 3)).check(12, 4, "w")


def test_check_plain_not_divisible() -> None:
    with pytest.raises(ValueError, match=re.escape("Linear.weight: segment sizes (10,) along dim 1 are not divisible "
                                                   "by tp=4")):
        ShardSpec(1).check(10, 4, "Linear.weight")
