"""``checkpoint.pieces``: a tensor held in several pieces per rank (a fused ``[q | k | v]`` cut over tp) written by
DCP one chunk per piece, and read back whole or in any other cut."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp

from lightning_tpp.checkpoint.pieces import Pieces, PiecesPlanner
from lightning_tpp.core.sharding import ShardSpec

FUSED = ShardSpec(dim=0, parts=(4, 2, 2))  # q of 4 rows, k and v of 2 (grouped-query), over tp=2


def _rank_pieces(whole: torch.Tensor, rank: int) -> Pieces:
    pieces = FUSED.pieces(whole.shape[0], rank, 2)
    local = torch.cat([whole.narrow(0, start, n) for start, n in pieces])
    return Pieces(local, whole.shape, 0, pieces)


def test_each_ranks_pieces_tile_the_whole_tensor() -> None:
    whole = torch.arange(24.0).reshape(8, 3)
    covered = torch.zeros(8, 3)
    for rank in range(2):
        held = _rank_pieces(whole, rank)
        for item in held.__create_write_items__("w", held):
            chunk = item.tensor_data.chunk
            assert item.tensor_data.size == whole.shape
            got = held.piece(chunk.offsets)
            torch.testing.assert_close(got, whole[chunk.offsets[0]:chunk.offsets[0] + chunk.sizes[0]])
            covered[chunk.offsets[0]:chunk.offsets[0] + chunk.sizes[0]] += 1
    assert torch.equal(covered, torch.ones(8, 3))  # every row written once, by the rank that holds it


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_pieces_saved_by_dcp_load_whole(tmp_path: Path) -> None:
    """One process holding every piece, in an order other than the whole tensor's: DCP writes one chunk per piece
    at its offset, and reading the entry whole (or as a plain tensor of another cut) gives the original."""
    whole = torch.randn(8, 3)
    pieces = FUSED.pieces(8, 0, 2) + FUSED.pieces(8, 1, 2)  # [q0 k0 v0 q1 k1 v1]
    local = torch.cat([whole.narrow(0, start, n) for start, n in pieces])
    dcp.save({"w": Pieces(local, whole.shape, 0, pieces), "b": torch.ones(2)}, checkpoint_id=tmp_path,
             planner=PiecesPlanner(), no_dist=True)
    got = {"w": torch.empty(8, 3), "b": torch.empty(2)}
    dcp.load(got, checkpoint_id=tmp_path, no_dist=True)
    torch.testing.assert_close(got["w"], whole)
    torch.testing.assert_close(got["b"], torch.ones(2))
    stored = dcp.FileSystemReader(tmp_path).read_metadata().state_dict_metadata["w"]
    assert sorted(c.offsets[0] for c in stored.chunks) == [0, 2, 4, 5, 6, 7]


def test_pieces_that_do_not_fit_are_refused() -> None:
    with pytest.raises(ValueError, match=r"pieces \[\(0, 2\), \(4, 2\)\] along dim 0 do not add up to the local "
                                         r"shape \(3, 3\)"):
        Pieces(torch.zeros(3, 3), (8, 3), 0, [(0, 2), (4, 2)])
    held = _rank_pieces(torch.zeros(8, 3), 0)
    with pytest.raises(ValueError, match=r"no piece at offsets \(1, 0\): this rank holds \[\(0, 2\), \(4, 1\), "
                                         r"\(6, 1\)\] along dim 0 of \(8, 3\)"):
        held.piece((1, 0))
