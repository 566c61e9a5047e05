"""Checkpoint files load without running code planted in them; errors say whether the file or the machine failed."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata

from lightning_tpp import CheckpointMismatchError, UnsafeCheckpointError, consolidate
from lightning_tpp.checkpoint.files import publish
from lightning_tpp.checkpoint.safe_load import SafeFileSystemReader, load_or_explain, torch_load


class Payload:
    """What an attacker plants: unpickling it runs a shell command that creates ``marker``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return os.system, (f"touch {self.marker}",)


def _dcp_folder(path: Path) -> Path:
    state = {"model.w": torch.randn(4, 3), "model.b": torch.zeros(3), "optim0.w.step": torch.tensor(2.0)}
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)
    torch.save({"tpp": {"param_order": ["w", "b"], "param_groups": []}, "global_step": 2}, path / "meta.pt")
    return path


def test_planted_global_in_a_torch_file_is_refused_and_not_run(tmp_path: Path) -> None:
    marker = tmp_path / "ran"
    torch.save({"hyper_parameters": Payload(marker)}, tmp_path / "meta.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"meta\.pt holds the global posix\.system, which loading it would "
                                                    r"run: refused, nothing of it was run.*weights_only=False"):
        torch_load(tmp_path / "meta.pt")
    assert not marker.exists()


def test_a_users_own_class_gets_the_allowlist_advice(tmp_path: Path) -> None:
    torch.save({"hyper_parameters": {"config": CheckpointMismatchError("x")}}, tmp_path / "h.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"h\.pt holds the global lightning_tpp\.checkpoint\.safe_load\."
                                                    r"CheckpointMismatchError.*torch\.serialization\.add_safe_globals"):
        torch_load(tmp_path / "h.pt")
    assert torch_load(tmp_path / "h.pt", weights_only=False)["hyper_parameters"]["config"].args == ("x",)


def test_real_dcp_metadata_passes_the_restricted_reader(tmp_path: Path) -> None:
    """Fails loudly if a torch upgrade adds a class to DCP's metadata pickle: extend the allowlist then."""
    folder = _dcp_folder(tmp_path / "ok")
    md = SafeFileSystemReader(folder).read_metadata()
    assert sorted(md.state_dict_metadata) == ["model.b", "model.w", "optim0.w.step"]
    assert md.state_dict_metadata["model.w"].properties.dtype == torch.float32


def test_planted_dcp_metadata_is_refused_and_not_run(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    (folder / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata holds the global posix\.system"):
        SafeFileSystemReader(folder).read_metadata()
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata holds the global posix\.system"):
        consolidate(folder, tmp_path / "one.ckpt")
    assert not marker.exists() and not (tmp_path / "one.ckpt").exists()


def test_pickled_entries_and_paths_outside_the_folder_are_refused(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path / "ckpt")
    md = SafeFileSystemReader(folder).read_metadata()
    md.state_dict_metadata["model.extra"] = BytesStorageMetadata()
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match=r"pickled object entries \['model\.extra'\]"):
        SafeFileSystemReader(folder).read_metadata()
    del md.state_dict_metadata["model.extra"]
    next(iter(md.storage_data.values())).relative_path = "../../etc/passwd"
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(CheckpointMismatchError, match=r"points outside its checkpoint folder \('\.\./\.\./etc/passwd'"):
        SafeFileSystemReader(folder).read_metadata()


def test_planted_shard_is_refused_and_not_run(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    md = SafeFileSystemReader(folder).read_metadata()
    index, info = next((i, s) for i, s in md.storage_data.items() if i.fqn == "model.w")
    shard = folder / info.relative_path
    torch_bytes = tmp_path / "payload.pt"
    torch.save(Payload(marker), torch_bytes)  # a torch file whose object is the payload
    data = torch_bytes.read_bytes()
    shard.write_bytes(data + shard.read_bytes())
    for i, s in md.storage_data.items():
        s.offset = 0 if i == index else s.offset + len(data)
    info.length = len(data)
    (folder / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(UnsafeCheckpointError, match=r"holds the global posix\.system"):
        consolidate(folder, tmp_path / "one.ckpt")
    assert not marker.exists()


def test_consolidate_refuses_a_planted_meta_file(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path / "ckpt")
    marker = tmp_path / "ran"
    torch.save({"tpp": {}, "hyper_parameters": Payload(marker)}, folder / "meta.pt")
    with pytest.raises(UnsafeCheckpointError, match=r"meta\.pt holds the global posix\.system"):
        consolidate(folder, tmp_path / "one.ckpt")
    assert not marker.exists()


def test_an_unfinished_sharded_save_is_not_taken_for_a_checkpoint(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path / "ckpt")
    (folder / "meta.pt").unlink()
    with pytest.raises(CheckpointMismatchError, match=r"ckpt is incomplete \(no meta\.pt: its save did not finish\)"):
        consolidate(folder, tmp_path / "one.ckpt")


def test_truncated_shard_is_reported_as_damage(tmp_path: Path) -> None:
    folder = _dcp_folder(tmp_path / "ckpt")
    shard = next(folder.glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointMismatchError, match=r"is incomplete or corrupt and cannot be loaded"):
        consolidate(folder, tmp_path / "one.ckpt")


@pytest.mark.parametrize("error", [PermissionError(13, "Permission denied"), MemoryError(),
                                   torch.OutOfMemoryError("CUDA out of memory"), OSError(5, "Input/output error"),
                                   FileNotFoundError(2, "No such file")],
                         ids=["permission", "memory", "cuda-oom", "io-error", "missing"])
def test_machine_errors_are_reported_as_themselves(error: BaseException) -> None:
    def load(path: str) -> None:
        raise error

    with pytest.raises(type(error)) as info:
        load_or_explain(load, "x.ckpt")
    assert info.value is error


def test_damaged_file_is_reported_as_damage(tmp_path: Path) -> None:
    (tmp_path / "cut.ckpt").write_bytes(b"PK\x03\x04 not a whole zip")
    with pytest.raises(CheckpointMismatchError, match=r"cut\.ckpt is incomplete or corrupt"):
        torch_load(tmp_path / "cut.ckpt")


def test_publish_swaps_folders_in_one_step(tmp_path: Path) -> None:
    path, new = tmp_path / "last.ckpt", tmp_path / ".last.ckpt.partial"
    path.mkdir()
    (path / "old").write_text("previous")
    new.mkdir()
    (new / "new").write_text("next")
    publish(new, path)
    assert [p.name for p in path.iterdir()] == ["new"] and not new.exists()
    file_new = tmp_path / ".f.partial"
    file_new.write_text("2")
    (tmp_path / "f").write_text("1")
    publish(file_new, tmp_path / "f")
    assert (tmp_path / "f").read_text() == "2" and not file_new.exists()
    publish(path, tmp_path / "fresh.ckpt")  # nothing there yet: a plain rename
    assert (tmp_path / "fresh.ckpt" / "new").is_file()
