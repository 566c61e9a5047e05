"""Asynchronous sharded saves: the training step goes on while the shards are written.

A save in the step only copies this rank's shards to host memory (DCP's stager); the files are written by a
background thread, and rank 0 publishes the folder when every rank's shards are on disk::

    main thread   save k: [wait for save k-1; every rank agrees on its outcome] stage -> return   step k+1 ...
    background            DCP write of .NAME.partial/ (own gloo group) -> rank 0: meta.pt, publish(NAME)

The publish is the same as a synchronous save's (``files.publish``): until it happens, ``NAME`` is the previous
complete checkpoint, so a process killed while the background write runs loses only the save in flight.

One save is in flight at a time: the next save, a removal of a checkpoint and the strategy's teardown wait for it.
Its errors (a full disk, a permission, a rank's write that failed) are gathered from every rank at that point and
raised on every rank as one :class:`AsyncCheckpointError`, so no rank goes on while another stops.

The background DCP collectives run on a process group of their own (gloo): two threads issuing collectives on one
group could interleave them in a different order on different ranks.
"""

from __future__ import annotations

import copy
from concurrent.futures import Future
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.tensor import DTensor

from lightning_tpp.checkpoint.dcp import META
from lightning_tpp.checkpoint.files import atomic_save, publish


class AsyncCheckpointError(OSError):
    """A checkpoint written in the background failed; raised on every rank at the next save or at teardown."""


def check_async_save(async_save: Any, *, sharded: bool) -> bool:
    """The ``async_save`` argument, validated against the checkpoint format."""
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save={async_save!r} must be True or False")
    if async_save and not sharded:
        raise ValueError("async_save=True writes sharded checkpoints in the background "
                         "(torch.distributed.checkpoint.async_save), but save_distributed_checkpoint=False asks for "
                         "one whole-model file written by rank 0. Set save_distributed_checkpoint=True (the default) "
                         "or async_save=False")
    return async_save


class AsyncSaver:
    """At most one sharded save in flight; the strategy holds one (no global state)."""

    def __init__(self, timeout: Optional[timedelta]) -> None:
        self._timeout = timeout
        self._group: Optional[dist.ProcessGroup] = None
        self._job: Optional[Future] = None
        self._path: Optional[Path] = None
        self._buffers: dict[str, Tensor] = {}  # host copies of the shards, reused save after save
        self._deferred: list[Callable[[], None]] = []  # removals of older checkpoints, once the new one is published

    @property
    def pending(self) -> Optional[Path]:
        """The path of the save in flight (None when none is)."""
        return self._path

    def save(self, state: dict[str, Any], tmp: Path, path: Path, meta: Optional[dict[str, Any]]) -> None:
        """Stage ``state`` (copied to host memory, so the step may change the tensors) and write it to ``tmp`` in
        the background; the rank that passes ``meta`` (rank 0) writes ``meta.pt`` last and publishes ``tmp`` at
        ``path``. Collective: every rank calls it, after :meth:`wait`."""
        if self._job is not None:
            raise RuntimeError("AsyncSaver.save called with a save in flight: call wait() first")
        if self._group is None:  # collective, on every rank at its first save
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        meta = copy.deepcopy(meta)  # as it is now: the loop moves on while the shards are written
        upload = dcp.async_save(host_copy(state, self._buffers), checkpoint_id=tmp, process_group=self._group,
                                async_stager=_Staged())
        finish = None if meta is None else lambda: _publish(meta, tmp, path)
        self._job, self._path = _then(upload, finish), path

    def settle(self) -> dict[int, str]:
        """Wait for this rank's part of the save in flight (no collective); what failed, by rank (DCP hands every
        rank the failures of all ranks), empty when nothing did."""
        job, deferred = self._job, self._deferred
        self._job, self._path, self._deferred = None, None, []
        if job is None:
            return {}
        try:
            job.result()
        except CheckpointException as err:  # the older checkpoints stay: nothing replaced them
            return {rank: _describe(f[0] if isinstance(f, tuple) else f) for rank, f in err.failures.items()}
        except BaseException as err:  # noqa: BLE001 - reported to every rank by wait()
            return {dist.get_rank(): _describe(err)}
        for remove in deferred:
            remove()
        return {}

    def wait(self, world_size: int) -> None:
        """Wait for the save in flight and raise its failure, from any rank, on every rank (collective)."""
        path = self._path
        failures = self.settle()
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (failures, str(path) if path is not None else None))
        failed = {rank: e for errors, _ in gathered for rank, e in errors.items()}
        if failed:
            where = next(p for _, p in gathered if p is not None)
            raise AsyncCheckpointError(
                f"the asynchronous checkpoint save of {where} failed on rank(s) {sorted(failed)}: "
                + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
                + f". Nothing was published: {where} still holds the checkpoint saved before it (if any). Fix the "
                  f"cause (free space, permissions of the folder), or pass async_save=False to write in the step")

    def after_publish(self, remove: Callable[[], None]) -> None:
        """Remove an older checkpoint (``ModelCheckpoint`` keeping its top k) only once the save in flight is
        published, at the next :meth:`wait`, and not at all if it fails: until then the older one is what a crash
        leaves. Without a save in flight, now."""
        if self._job is None:
            remove()
        else:
            self._deferred.append(remove)


def host_copy(state: dict[str, Any], buffers: dict[str, Tensor]) -> dict[str, Any]:
    """Each tensor's (each DTensor's local shard's) copy in host memory, wrapped as it was. The copies go into
    ``buffers`` kept from the previous save (written by then): a fresh allocation each save costs its page faults,
    about as much as the copy. DCP's default stager deep-copies each tensor through ``__deepcopy__`` instead, at
    about twice the cost for a few hundred small tensors."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        local = value.to_local() if isinstance(value, DTensor) else value
        if not isinstance(local, Tensor):
            out[key] = copy.deepcopy(value)
            continue
        buf = buffers.get(key)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            buf = buffers[key] = torch.empty(local.shape, dtype=local.dtype, device="cpu")
        buf.copy_(local.detach())
        out[key] = DTensor.from_local(buf, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                      stride=value.stride()) if isinstance(value, DTensor) else buf
    for key in set(buffers) - set(state):
        del buffers[key]
    return out


class _Staged(AsyncStager):
    """The state handed to DCP is already a host copy (:func:`host_copy`): nothing more to stage."""

    _synchronize_after_execute = False

    def stage(self, state_dict: Any) -> Any:
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def _publish(meta: dict[str, Any], tmp: Path, path: Path) -> None:
    atomic_save(meta, tmp / META)  # written last: a folder without it is an unfinished save
    publish(tmp, path)


def _then(upload: Future, finish: Optional[Callable[[], None]]) -> Future:
    """A future that completes when ``upload`` has and ``finish`` (run in the writer's thread) has returned."""
    done: Future = Future()

    def on_upload(f: Future) -> None:
        try:
            f.result()
            if finish is not None:
                finish()
            done.set_result(None)
        except BaseException as err:  # noqa: BLE001 - handed to whoever waits
            done.set_exception(err)

    upload.add_done_callback(on_upload)
    return done
