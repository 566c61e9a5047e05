"""Single-process tests of the pure mesh arithmetic in ``lightning_tpp.core.mesh``, and of its reuse of process groups."""

from __future__ import annotations

import ast
import re

import pytest

from lightning_tpp.core.mesh import AXES, MeshDims, resolve_dims


# ---- resolve_dims ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world", "tp", "pp", "expected"),
    [(1, 1, 1, MeshDims(1, 1, 1)), (8, 2, 2, MeshDims(2, 2, 2)), (8, 8, 1, MeshDims(1, 1, 8)),
     (8, 1, 8, MeshDims(1, 8, 1)), (12, 2, 3, MeshDims(2, 3, 2)), (16, 4, 1, MeshDims(4, 1, 4))],
)
def test_resolve_dims_auto_dp(world: int, tp: int, pp: int, expected: MeshDims) -> None:
    dims = resolve_dims(world, tp=tp, pp=pp)
    assert dims == expected
    assert dims.world_size == world
    assert resolve_dims(world, tp=tp, pp=pp, dp="auto") == expected


def test_resolve_dims_explicit_dp() -> None:
    assert resolve_dims(8, tp=2, pp=2, dp=2) == MeshDims(dp=2, pp=2, tp=2)
    assert resolve_dims(8, tp=1, pp=1, dp=8) == MeshDims(dp=8, pp=1, tp=1)
    assert resolve_dims(6, tp=3, pp=1, dp=2) == MeshDims(dp=2, pp=1, tp=3)


def test_resolve_dims_world_not_divisible() -> None:
    valid = [(1, 1), (1, 2), (1, 4), (1, 8), (2, 1), (2, 2), (2, 4), (4, 1), (4, 2), (8, 1)]
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by tp\*pp = 3\*1 = 3") as exc:
        resolve_dims(8, tp=3, pp=1)
    assert f"choose (tp, pp) from {valid}" in str(exc.value)
    assert "with 8 processes" in str(exc.value)


def test_resolve_dims_world_not_divisible_by_pp() -> None:
    with pytest.raises(ValueError, match=re.escape("world size 6 is not divisible by tp*pp = 2*2 = 4")) as exc:
        resolve_dims(6, tp=2, pp=2, dp="auto")
    # every listed pair really divides the world size, and the list is complete
    listed = ast.literal_eval(str(exc.value).split("choose (tp, pp) from ")[1].split(", or change")[0])
    assert listed == [(t, p) for t in range(1, 7) for p in range(1, 7) if 6 % (t * p) == 0]


def test_resolve_dims_world_not_divisible_checked_before_explicit_dp() -> None:
    with pytest.raises(ValueError, match=r"world size 8 is not divisible by tp\*pp = 3\*1"):
        resolve_dims(8, tp=3, pp=1, dp=2)


@pytest.mark.parametrize(("dp", "right"), [(1, 2), (4, 2), (3, 2)])
def test_resolve_dims_explicit_dp_mismatch(dp: int, right: int) -> None:
    msg = (rf"dp\*pp\*tp = {dp}\*2\*2 = {dp * 4} does not match world size 8; "
           rf"with tp=2, pp=2 use dp={right} or dp='auto'")
    with pytest.raises(ValueError, match=msg):
        resolve_dims(8, tp=2, pp=2, dp=dp)


@pytest.mark.parametrize("name", ["tp", "pp"])
@pytest.mark.parametrize("value", [0, -1, 1.0, 2.5, "2", None, True])
def test_resolve_dims_bad_tp_pp(name: str, value: object) -> None:
    kwargs = {"tp": 1, "pp": 1, name: value}
    with pytest.raises(ValueError, match=rf"^{name}={re.escape(repr(value))} must be a positive integer$"):
        resolve_dims(4, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("value", [0, -2, 1.0, "two", None, False, "Auto"])
def test_resolve_dims_bad_dp(value: object) -> None:
    with pytest.raises(ValueError, match=rf"^dp={re.escape(repr(value))} must be a positive integer or 'auto'$"):
        resolve_dims(4, tp=1, pp=1, dp=value)  # type: ignore[arg-type]


# ---- MeshDims -----------------------------------------------------------------------------------------------------
def test_world_size() -> None:
    assert MeshDims(dp=2, pp=3, tp=4).world_size == 24


def test_coords_tp_innermost() -> None:
    dims = MeshDims(dp=2, pp=2, tp=2)
    assert dims.coords(5) == {"dp": 1, "pp": 0, "tp": 1}  # no cp axis: named as before cp existed
    assert dims.coords(0) == {"dp": 0, "pp": 0, "tp": 0}
    assert dims.coords(1) == {"dp": 0, "pp": 0, "tp": 1}
    assert dims.coords(2) == {"dp": 0, "pp": 1, "tp": 0}
    assert dims.coords(7) == {"dp": 1, "pp": 1, "tp": 1}


def test_coords_cp_next_to_tp() -> None:
    """cp sits outside tp and inside pp: the ranks exchanging keys and values in every attention are neighbours."""
    dims = MeshDims(dp=2, pp=2, tp=2, cp=2)
    assert dims.world_size == 16
    assert dims.coords(0) == {"dp": 0, "pp": 0, "cp": 0, "tp": 0}
    assert dims.coords(2) == {"dp": 0, "pp": 0, "cp": 1, "tp": 0}
    assert dims.coords(4) == {"dp": 0, "pp": 1, "cp": 0, "tp": 0}
    assert dims.coords(13) == {"dp": 1, "pp": 1, "cp": 0, "tp": 1}
    assert dims.rank_of(dp=1, pp=1, cp=1, tp=1) == 15
    seen = [tuple(dims.coords(r).values()) for r in range(16)]
    assert seen == sorted(seen) and len(set(seen)) == 16  # (dp, pp, cp, tp), tp fastest
    assert all(dims.rank_of(**dims.coords(r)) == r for r in range(16))


def test_resolve_dims_with_cp() -> None:
    assert resolve_dims(8, tp=2, pp=1, cp=2) == MeshDims(dp=2, pp=1, tp=2, cp=2)
    assert resolve_dims(4, tp=1, pp=1, dp=1, cp=4) == MeshDims(dp=1, pp=1, tp=1, cp=4)
    with pytest.raises(ValueError, match=r"not divisible by tp\*pp\*cp = 2\*1\*4 = 8"):
        resolve_dims(4, tp=2, pp=1, cp=4)
    with pytest.raises(ValueError, match=r"dp\*pp\*cp\*tp = 2\*1\*2\*1 = 4 does not match world size 2"):
        resolve_dims(2, tp=1, pp=1, dp=2, cp=2)
    with pytest.raises(ValueError, match=r"cp=0 must be a positive integer"):
        resolve_dims(2, tp=1, pp=1, cp=0)


@pytest.mark.parametrize("dims", [MeshDims(2, 2, 2), MeshDims(1, 1, 1), MeshDims(3, 2, 4), MeshDims(1, 4, 1),
                                  MeshDims(5, 1, 1), MeshDims(2, 3, 1)])
def test_rank_of_inverts_coords(dims: MeshDims) -> None:
    seen = []
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        assert 0 <= c["dp"] < dims.dp and 0 <= c["pp"] < dims.pp and 0 <= c["tp"] < dims.tp
        assert dims.rank_of(**c) == rank
        seen.append((c["dp"], c["pp"], c["tp"]))
    assert len(set(seen)) == dims.world_size
    assert seen == sorted(seen)  # lexicographic (dp, pp, tp): tp varies fastest


def test_rank_of_keyword_only() -> None:
    dims = MeshDims(dp=2, pp=2, tp=2)
    assert dims.rank_of(dp=1, pp=0, tp=1) == 5
    assert dims.rank_of(dp=0, pp=1, tp=0) == 2
    with pytest.raises(TypeError):
        dims.rank_of(1, 0, 1)  # type: ignore[misc]


def _group_ranks(dims: MeshDims, axis: str, rank: int) -> list[int]:
    """The ranks that share every coordinate of ``rank`` but ``axis`` (the picture in core/mesh.py's docstring)."""
    c = dims.coords(rank)
    return [dims.rank_of(**{**c, axis: i}) for i in range(getattr(dims, axis))]


def test_group_ranks_example() -> None:
    dims = MeshDims(dp=2, pp=2, tp=2)
    assert _group_ranks(dims, "tp", 5) == [4, 5]
    assert _group_ranks(dims, "pp", 5) == [5, 7]
    assert _group_ranks(dims, "dp", 5) == [1, 5]
    assert _group_ranks(dims, "tp", 2) == [2, 3]
    assert _group_ranks(dims, "pp", 0) == [0, 2]
    assert _group_ranks(dims, "dp", 6) == [2, 6]


@pytest.mark.parametrize("dims", [MeshDims(2, 2, 2), MeshDims(3, 2, 4), MeshDims(1, 1, 8), MeshDims(4, 1, 1)])
def test_group_ranks_partition_world(dims: MeshDims) -> None:
    for axis in AXES:
        size = getattr(dims, axis)
        groups = {tuple(_group_ranks(dims, axis, r)) for r in range(dims.world_size)}
        assert len(groups) == dims.world_size // size
        assert sorted(r for g in groups for r in g) == list(range(dims.world_size))
        for rank in range(dims.world_size):
            group = _group_ranks(dims, axis, rank)
            assert len(group) == size and rank in group
            assert group == sorted(group)
            # members differ from rank only along ``axis``
            for other in group:
                c, o = dims.coords(rank), dims.coords(other)
                assert all(c[a] == o[a] for a in AXES if a != axis)
    # tp groups are contiguous blocks of ranks
    for rank in range(dims.world_size):
        start = rank - rank % dims.tp
        assert _group_ranks(dims, "tp", rank) == list(range(start, start + dims.tp))


def test_meshdims_frozen() -> None:
    dims = MeshDims(1, 1, 2)
    with pytest.raises(AttributeError):
        dims.tp = 4  # type: ignore[misc]


def test_groups_are_built_once_per_default_process_group(tmp_path) -> None:
    """``reused``: what a collective built for a key is returned again while the default process group is the same
    one (a second fit, validate or test of the layout); a new default group builds again."""
    import torch.distributed as dist
    from lightning_tpp.core.mesh import reused

    built: list[object] = []

    def build() -> object:
        built.append(object())
        return built[-1]

    firsts = []
    for run in ("a", "b"):
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / run}", rank=0, world_size=1)
        try:
            first = reused(("layout", 2), build)
            assert reused(("layout", 2), build) is first and reused(("other",), build) is not first
            firsts.append(first)
        finally:
            dist.destroy_process_group()
    assert len(built) == 4 and firsts[0] is not firsts[1]
