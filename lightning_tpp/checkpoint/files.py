"""Writing checkpoint files and folders so that a save killed at any moment leaves a whole checkpoint at its path."""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch

def atomic_save(obj: Any, path: Path) -> None:
    """Write aside, then publish: a save killed midway leaves the previous file at ``path`` untouched and only a
    hidden ``.NAME.partial-PID`` file behind, which nothing loads."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.partial-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        publish(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def publish(tmp: Path, path: Path) -> None:
    """Put the written file or folder ``tmp`` at ``path`` in one step: whoever looks at ``path`` (a reader, a
    resume after a crash) finds the previous checkpoint or the new one, never neither and never a mix.

    A file replaces a file atomically (``rename``). Folders are swapped with ``renameat2(RENAME_EXCHANGE)`` (Linux)
    and the previous one, now at ``tmp``, is removed afterwards; where the exchange is not available the previous
    folder is moved aside first, which leaves a window in which ``path`` is missing (its copy then sits at
    ``.NAME.old``)."""
    if not (tmp.is_dir() or path.is_dir()) or not os.path.lexists(path):
        os.replace(tmp, path)
    elif _exchange(tmp, path):
        _remove(tmp)  # the previous checkpoint
    else:
        old = path.with_name(f".{path.name}.old")
        _remove(old)
        os.rename(path, old)
        os.rename(tmp, path)
        _remove(old)
    _fsync_dir(path.parent)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths atomically; False where the OS or file system cannot."""
    if not sys.platform.startswith("linux"):
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"cannot publish {a} as {b}: {os.strerror(err)}")


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif os.path.lexists(path):
        path.unlink()


def _fsync_dir(folder: Path) -> None:
    """Make a rename durable (a power loss after it must not bring the old name back)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return  # not possible on this platform (Windows)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
