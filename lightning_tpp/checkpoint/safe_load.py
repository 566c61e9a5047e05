"""Loading checkpoint files without running code planted in them, and telling a damaged file from a failing machine.

Every file of a checkpoint is read as plain Lightning reads an ordinary ``.ckpt`` (``torch.load`` with
``weights_only=True`` unless the user passes ``weights_only=False``), never weaker:

- torch-saved files (``meta.pt``, whole-model files): ``weights_only`` loading; a refusal names the file and the
  global it would have run.
- DCP's ``.metadata`` (which torch's ``FileSystemReader`` reads with plain ``pickle.load``): read by
  :class:`SafeFileSystemReader` through an unpickler that admits only the classes DCP metadata is made of. Entries
  stored as pickled objects (DCP's ``BytesStorageMetadata``, which torch loads with ``weights_only=False``) and
  storage paths outside the folder are refused: lightning_tpp never writes either.
- DCP shards: torch reads tensor data with ``weights_only=True`` already; its error is named here.
"""

from __future__ import annotations

import pathlib
import pickle
import re
import zipfile
from pathlib import Path, PurePath
from typing import Any, Optional

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint import metadata as dcp_metadata

from lightning_tpp._compat import StorageInfo as _StorageInfo
from lightning_tpp._compat import dcp_metadata_path, get_layout


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file holds something that loading it would run; nothing of it was run."""


class CheckpointMismatchError(KeyError):
    """A checkpoint is incomplete, corrupt, or its names or shapes do not fit the model."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


_TRUST_HINT = ("If you trust this file, load it with weights_only=False (trainer.fit/validate/test/predict("
               "ckpt_path=..., weights_only=False); consolidate/export-hf: --no-weights-only)")


def refused(path: Any, what: str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(f"checkpoint file {path} holds {what}, which loading it would run: refused, nothing "
                                 f"of it was run. {_TRUST_HINT}")


def explain_weights_only_error(err: BaseException, path: Any) -> Optional[UnsafeCheckpointError]:
    """torch's ``weights_only`` refusal as an :class:`UnsafeCheckpointError` naming the file (None for other errors).

    torch's advice for the user's own classes (``torch.serialization.add_safe_globals``) is kept."""
    text = str(err)
    if not isinstance(err, pickle.UnpicklingError) or "Weights only load failed" not in text:
        return None
    found = re.search(r"GLOBAL ([\w.]+)", text)
    what = f"the global {found.group(1)}" if found else "an object that weights_only loading does not allow"
    advice = re.search(r"Please use `torch\.serialization\.add_safe_globals\(\[[^\]]*\]\)`", text)
    error = refused(path, what)
    if advice:
        error.args = (f"{error.args[0]}; or, if it is your own class (hyper-parameters, say), {advice.group(0)[11:]} "
                      f"before loading",)
    return error


_OOM = (MemoryError, torch.OutOfMemoryError)


def is_damage(err: BaseException) -> bool:
    """True where an error while loading means the file is damaged (truncated, corrupt, not a checkpoint); False for
    what the machine or the file system did (no memory, no permission, no such file, a failing disk), which is
    reported as itself."""
    if isinstance(err, (*_OOM, OSError, UnsafeCheckpointError)):
        return False
    if "out of memory" in str(err).lower():
        return False
    return isinstance(err, (EOFError, pickle.UnpicklingError, zipfile.BadZipFile, RuntimeError, ValueError,
                            AssertionError))


def load_or_explain(load: Any, path: Any) -> Any:
    """``load(path)``; a planted global becomes :class:`UnsafeCheckpointError`, a damaged file
    :class:`CheckpointMismatchError`, both naming the file; other errors (memory, permission) pass as they are."""
    try:
        return load(path)
    except BaseException as err:
        raise classify(err, path) from err


def classify(err: BaseException, path: Any) -> BaseException:
    """The error to raise for ``err`` met while loading ``path``."""
    unsafe = err if isinstance(err, UnsafeCheckpointError) else explain_weights_only_error(err, path)
    if unsafe is not None:
        return unsafe
    if isinstance(err, CheckpointMismatchError) or not is_damage(err):
        return err
    return CheckpointMismatchError(f"checkpoint {path} is incomplete or corrupt and cannot be loaded "
                                   f"({str(err)[:300]}); use the previous checkpoint")


def torch_load(path: Path, *, weights_only: Optional[bool] = True) -> Any:
    """``torch.load`` of a checkpoint file on CPU, ``weights_only`` unless the user said otherwise."""
    return load_or_explain(lambda p: torch.load(p, map_location="cpu",
                                                weights_only=weights_only is not False), path)


def _dcp_metadata_classes() -> dict[tuple[str, str], Any]:
    names = ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
             "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")
    allowed: dict[tuple[str, str], Any] = {(dcp_metadata.__name__, n): getattr(dcp_metadata, n)
                                           for n in names if hasattr(dcp_metadata, n)}
    allowed[(_StorageInfo.__module__, "_StorageInfo")] = _StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = get_layout  # name -> torch.layout
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath, pathlib.PureWindowsPath):
        allowed[("pathlib", cls.__name__)] = allowed[(cls.__module__, cls.__name__)] = cls
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Admits only what DCP metadata is made of: its dataclasses, ``torch.Size``, dtypes, layouts, paths."""

    allowed = _dcp_metadata_classes()

    def __init__(self, file: Any, path: Any) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise refused(self.path, f"the global {module}.{name}")


def check_metadata(md: Any, path: Any) -> Any:
    """Refuse what lightning_tpp never writes and torch would act on unsafely."""
    if not isinstance(md, dcp_metadata.Metadata):
        raise CheckpointMismatchError(f"{path} is not DCP metadata (holds a {type(md).__name__})")
    pickled = sorted(k for k, v in md.state_dict_metadata.items() if isinstance(v, dcp_metadata.BytesStorageMetadata))
    if pickled:
        raise refused(path, f"pickled object entries {pickled[:5]} (torch loads them with weights_only=False)")
    for info in (md.storage_data or {}).values():
        rel = PurePath(getattr(info, "relative_path", ""))
        if rel.is_absolute() or len(rel.parts) != 1 or rel.name in ("", ".", ".."):
            raise CheckpointMismatchError(f"{path} points outside its checkpoint folder ({str(rel)!r}): refused")
    return md


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose ``.metadata`` is read by a restricted unpickler (``weights_only`` semantics);
    ``weights_only=False`` restores torch's own reading, for files the user trusts."""

    def __init__(self, path: Any, *, weights_only: Optional[bool] = True) -> None:
        super().__init__(path)
        self.weights_only = weights_only is not False

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        if not self.weights_only:
            return super().read_metadata(*args, **kwargs)
        path = dcp_metadata_path(self, kwargs.get("rank"))
        try:
            with self.fs.create_stream(path, "rb") as stream:
                md = _MetadataUnpickler(stream, path).load()
        except BaseException as err:
            raise classify(err, path) from err
        check_metadata(md, path)
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = dcp_metadata.StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md
