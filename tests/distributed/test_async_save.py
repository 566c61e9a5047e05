"""``async_save=True``: a checkpoint written in the background while training goes on resumes exactly (the shards
were copied at the save, not read later), the next save and the teardown wait for it, and a failed background
write is raised on every rank. The kill matrix during an async write is in test_checkpoint_safety.py."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch import ROOT, run_ranks
from lightning_tpp import TensorPipeStrategy, consolidate

SCRIPT = ROOT / "tests" / "distributed" / "worker_async_save.py"


def test_async_save_needs_sharded_checkpoints() -> None:
    with pytest.raises(ValueError, match=r"async_save=True writes sharded checkpoints .* "
                                         r"save_distributed_checkpoint=False .* Set save_distributed_checkpoint=True"):
        TensorPipeStrategy(tp=2, async_save=True, save_distributed_checkpoint=False)
    with pytest.raises(TypeError, match=r"async_save='yes' must be True or False"):
        TensorPipeStrategy(tp=2, async_save="yes")  # type: ignore[arg-type]


def _whole(folder: Path, out: Path) -> dict:
    consolidate(folder, out)
    return torch.load(out, map_location="cpu", weights_only=True)


def _assert_same(got: object, ref: object, where: str) -> None:
    """Nested checkpoint contents equal (tensors within fp32 tolerance), naming the first entry that differs."""
    if isinstance(ref, dict):
        assert isinstance(got, dict) and got.keys() == ref.keys(), f"{where}: keys {list(got)} vs {list(ref)}"
        for key in ref:
            _assert_same(got[key], ref[key], f"{where}.{key}")
    elif isinstance(ref, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(ref), where
        for i, (a, b) in enumerate(zip(got, ref)):
            _assert_same(a, b, f"{where}[{i}]")
    elif isinstance(ref, torch.Tensor):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=where)
    elif where.endswith(("time", "_time")):  # wall-clock entries (e.g. a timer callback) are not state
        return
    else:
        assert got == ref, f"{where}: {got!r} vs {ref!r}"


@pytest.mark.parametrize("layout", ["tp2", "dp2"])
def test_async_checkpoints_equal_synchronous_ones_and_resume_the_same(tmp_path: Path, layout: str) -> None:
    """Saved in the background while the next epoch trains (tp2, or dp2 with FSDP2-sharded parameters and state),
    the checkpoints hold what a synchronous save at the same step holds (the shards were copied at the save), and a
    run resumed from them trains the same."""
    run_ranks(SCRIPT, 2, [str(tmp_path), "parity", layout], timeout=300).check()
    for name in ("async", "sync"):  # ModelCheckpoint published both saves; the teardown waited for the last one
        assert sorted(p.name for p in (tmp_path / name).iterdir()) == ["step3.ckpt", "step6.ckpt"], name
    for step in (3, 6):
        got = _whole(tmp_path / "async" / f"step{step}.ckpt", tmp_path / f"async{step}.whole.ckpt")
        ref = _whole(tmp_path / "sync" / f"step{step}.ckpt", tmp_path / f"sync{step}.whole.ckpt")
        assert got["global_step"] == step
        for key in ("state_dict", "optimizer_states", "loops", "global_step", "epoch"):
            _assert_same(got[key], ref[key], f"step {step} {key}")
    for rank in range(2):
        losses = torch.load(tmp_path / f"losses.rank{rank}.pt", weights_only=True)
        assert len(losses["async"]) == 6 and len(losses["async-resumed"]) == 3
        for run in ("", "-resumed"):
            torch.testing.assert_close(torch.tensor(losses[f"async{run}"]), torch.tensor(losses[f"sync{run}"]),
                                       rtol=1e-5, atol=1e-6, msg=f"rank {rank} losses{run}")


def test_failed_background_write_is_raised_on_every_rank(tmp_path: Path) -> None:
    run_ranks(SCRIPT, 2, [str(tmp_path), "error"], timeout=120).check()
    assert [(tmp_path / f"error0.rank{r}.txt").read_text() for r in range(2)] == ["no error"] * 2
    messages = [(tmp_path / f"error1.rank{r}.txt").read_text() for r in range(2)]
    assert messages[0] == messages[1], messages
    assert "the asynchronous checkpoint save of" in messages[0]
    assert ("run.ckpt failed on rank(s) [1]: rank 1: OSError: [Errno 28] No space left on device (injected)"
            in messages[0])
    assert "Nothing was published" in messages[0] and "async_save=False" in messages[0]
    # the older checkpoint ModelCheckpoint would drop goes once the new one is published, and stays when it failed
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix in (".ckpt", ".removed")) == \
        ["older1.removed", "older2.ckpt", "run.ckpt"]
    assert (tmp_path / "run.ckpt" / "meta.pt").is_file()  # the first save, published
