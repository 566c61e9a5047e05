"""``AsyncSaver`` in one process (a gloo group of one): what the step does at an asynchronous save, save after save.
The checkpoints' content, the kill matrix and failures on other ranks are in tests/distributed/test_async_save.py and
test_checkpoint_safety.py."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import SavePlanner
from torch.distributed.tensor import DTensor, Shard

from lightning_tpp.checkpoint.async_save import AsyncSaver, host_copy


@pytest.fixture
def mesh(tmp_path: Path) -> Iterator[Any]:
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


def _state(mesh: Any, scale: float) -> dict[str, Any]:
    w = torch.arange(12.0).reshape(3, 4) * scale
    return {"model.w": DTensor.from_local(w, mesh, [Shard(0)], run_check=False, shape=w.shape, stride=w.stride()),
            "model.b": torch.full((4,), scale), "optim0.w.step": torch.tensor(scale)}


def _read(path: Path) -> dict[str, torch.Tensor]:
    out = {"model.w": torch.empty(3, 4), "model.b": torch.empty(4), "optim0.w.step": torch.empty(())}
    dcp.load(out, checkpoint_id=path)
    return out


def test_host_copy_reuses_buffers_and_wrappers(mesh: Any) -> None:
    """The second save copies into the first one's buffers and hands DCP the same DTensor wrappers (no new
    allocation, no new wrapping); a tensor whose shape changed gets a new buffer, a dropped one is let go."""
    buffers: dict[str, Any] = {}
    first = host_copy(_state(mesh, 1.0), buffers)
    second = host_copy(_state(mesh, 2.0), buffers)
    assert all(second[k] is first[k] for k in first)
    assert isinstance(second["model.w"], DTensor) and not isinstance(second["model.b"], DTensor)
    torch.testing.assert_close(second["model.w"].to_local(), torch.arange(12.0).reshape(3, 4) * 2)
    grown = _state(mesh, 3.0)
    grown["model.b"] = torch.ones(5)
    del grown["optim0.w.step"]
    third = host_copy(grown, buffers)
    assert third["model.b"] is not first["model.b"] and third["model.w"] is first["model.w"]
    assert sorted(buffers) == ["model.b", "model.w"]


def test_entries_are_wrapped_at_the_first_save_only(mesh: Any) -> None:
    """Handed the entries (tensor, cut, whole shape) and the layout, a save after the first copies each plain
    tensor into its buffer and hands DCP the wrapper made then; a tensor whose shape changed is wrapped again."""

    class Counting:  # what host_copy reads of a Layout
        full_mesh = mesh
        calls = 0

        def save_form(self, t: torch.Tensor, spec: Any, full: tuple[int, ...]) -> Any:
            self.calls += 1
            return DTensor.from_local(t.contiguous(), mesh, [Shard(0)], run_check=False, shape=torch.Size(full),
                                      stride=t.contiguous().stride())

    layout, buffers = Counting(), {}
    first = host_copy({"w": (torch.ones(2, 3), None, (2, 3)), "b": (torch.ones(3), None, (3,))}, buffers, layout)
    second = host_copy({"w": (torch.full((2, 3), 2.0), None, (2, 3)), "b": (torch.ones(4), None, (4,))}, buffers,
                       layout)
    assert layout.calls == 3 and second["w"] is first["w"] and second["b"] is not first["b"]
    torch.testing.assert_close(second["w"].to_local(), torch.full((2, 3), 2.0))
    assert tuple(second["b"].shape) == (4,)


def test_saves_reuse_their_plans_and_write_each_state(mesh: Any, tmp_path: Path) -> None:
    """Later saves skip DCP's planning (cached under this saver's own key) and still write what was staged at
    each save, not what the tensors hold later; the cache is dropped with the saver."""
    saver = AsyncSaver(timedelta(seconds=30))
    key = saver._plans
    metadata = []
    for step, scale in ((1, 1.0), (2, 2.0), (3, 3.0)):
        state = _state(mesh, scale)
        path = tmp_path / f"step{step}.ckpt"
        saver.save(state, tmp_path / f".step{step}.ckpt.partial", path, {"step": step})
        state["model.w"].to_local().zero_()  # the step goes on: the save holds its own copy
        published: list[bool] = []
        assert saver.wait(1, share=("rng", step), then=lambda: published.append(path.is_dir())) == [("rng", step)]
        assert published == [True]  # ``then`` runs once this rank's part of the save is over
        got = _read(path)
        torch.testing.assert_close(got["model.w"], torch.arange(12.0).reshape(3, 4) * scale)
        torch.testing.assert_close(got["model.b"], torch.full((4,), scale))
        assert torch.load(path / "meta.pt", weights_only=True) == {"step": step}
        metadata.append(SavePlanner._cached_metadata[key])
    assert metadata[2] is metadata[1] is metadata[0]  # planned once: the later saves found their plans unchanged
    other = AsyncSaver(timedelta(seconds=30))
    assert other._plans != key  # two strategies in one process do not share (merge) plans
    del saver
    import gc

    gc.collect()
    assert key not in SavePlanner._cached_all_plans and key not in SavePlanner._cached_save_plan
