"""Asynchronous sharded saves: the training step goes on while the shards are written.

A save in the step only copies this rank's shards to host memory (into buffers kept from save to save); the files
are written by a background thread with ``torch.distributed.checkpoint.save``, and rank 0 publishes the folder when
every rank's shards are on disk::

    main thread   save k: [wait for save k-1; one all_gather: its outcome, RNG states, path] host copy -> return
    background            DCP plan (cached after the first save) and write of .NAME.partial/ (own gloo group)
                          -> rank 0: meta.pt, publish(NAME)

The publish is the same as a synchronous save's (``files.publish``): until it happens, ``NAME`` is the previous
complete checkpoint, so a process killed while the background write runs loses only the save in flight.

One save is in flight at a time: the next save, a removal of a checkpoint and the strategy's teardown wait for it.
Its errors (a full disk, a permission, a rank's write that failed) are gathered from every rank at that point and
raised on every rank as one :class:`AsyncCheckpointError`, so no rank goes on while another stops.

The background DCP collectives run on a process group of their own (gloo): two threads issuing collectives on one
group could interleave them in a different order on different ranks. DCP's plans (which rank writes which chunk,
and the global ``.metadata``) are built at the first save and reused while every rank's tensors keep their shapes
and shards (``DefaultSavePlanner(enable_plan_caching=True)``; a rank whose plan changed sends it again): the
writer's thread then spends its time writing, not planning beside the training step.

The thread is this saver's own rather than ``dcp.async_save``'s, which is the same ``dcp.save`` in a thread but
first wraps every entry of the state in a logging decorator in the caller's thread (``_stateful_to_state_dict``):
a few hundred entries cost tens of milliseconds of the step. Its other mode, a checkpoint process
(``AsyncCheckpointerType.PROCESS``), would take the writer off this process's GIL but sends the staged tensors
through a pipe into shared memory and leaves a writer that outlives a killed rank.
"""

from __future__ import annotations

import copy
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, NamedTuple, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import Tensor
from torch.distributed.checkpoint import CheckpointException
from torch.distributed.tensor import DTensor

from lightning_tpp._compat import caching_save_planner, drop_save_plan_cache
from lightning_tpp.checkpoint.dcp import META, Layout
from lightning_tpp.checkpoint.files import atomic_save, publish
from lightning_tpp.checkpoint.pieces import Pieces, PiecesPlanner


class AsyncCheckpointError(OSError):
    """A checkpoint written in the background failed; raised on every rank at the next save or at teardown."""


def check_async_save(async_save: Any, *, sharded: bool) -> bool:
    """The ``async_save`` argument, validated against the checkpoint format."""
    if not isinstance(async_save, bool):
        raise TypeError(f"async_save={async_save!r} must be True or False")
    if async_save and not sharded:
        raise ValueError("async_save=True writes sharded checkpoints in the background "
                         "(torch.distributed.checkpoint in a thread), but save_distributed_checkpoint=False asks for "
                         "one whole-model file written by rank 0. Set save_distributed_checkpoint=True (the default) "
                         "or async_save=False")
    return async_save


class AsyncSaver:
    """At most one sharded save in flight; the strategy holds one (no global state)."""

    def __init__(self, timeout: Optional[timedelta]) -> None:
        self._timeout = timeout
        self._group: Optional[dist.ProcessGroup] = None
        self._job: Optional[Future] = None
        self._writer: Optional[ThreadPoolExecutor] = None  # one thread, kept from save to save
        self._path: Optional[Path] = None
        self._buffers: dict[str, _Kept] = {}  # host copies of the shards, reused save after save
        self._mesh: Any = None  # the mesh the kept wrappers were made on
        # DCP's plans of the first save, reused while the tensors keep their shapes and shards (every rank's
        # saver lives as long as its strategy, so the caches of all ranks are filled and dropped together)
        self._plans = f"lightning_tpp.AsyncSaver.{uuid.uuid4().hex}"
        weakref.finalize(self, drop_save_plan_cache, self._plans)
        self._deferred: list[Callable[[], None]] = []  # removals of older checkpoints, once the new one is published

    @property
    def pending(self) -> Optional[Path]:
        """The path of the save in flight (None when none is)."""
        return self._path

    def save(self, state: dict[str, Any], tmp: Path, path: Path, meta: Optional[dict[str, Any]],
             layout: Optional[Layout] = None) -> None:
        """Stage ``state`` (copied to host memory, so the step may change the tensors) and write it to ``tmp`` in
        the background; the rank that passes ``meta`` (rank 0) writes ``meta.pt`` last and publishes ``tmp`` at
        ``path``. With ``layout``, ``state`` holds :func:`~.dcp.sharded_entries` (``layout.save_form`` makes each
        what DCP writes). Collective: every rank calls it, after :meth:`wait`."""
        if self._job is not None:
            raise RuntimeError("AsyncSaver.save called with a save in flight: call wait() first")
        if self._group is None:  # collective, on every rank at its first save
            self._group = dist.new_group(backend="gloo", timeout=self._timeout)
        if self._writer is None:
            self._writer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lightning_tpp-checkpoint")
        meta = copy.deepcopy(meta)  # as it is now: the loop moves on while the shards are written
        if layout is not None and layout.full_mesh is not self._mesh:  # set up again: new meshes, new wrappers
            self._buffers, self._mesh = {}, layout.full_mesh
        staged = host_copy(state, self._buffers, layout)
        self._job = self._writer.submit(self._write, staged, tmp, path, meta)
        self._path = path

    def _write(self, staged: dict[str, Any], tmp: Path, path: Path, meta: Optional[dict[str, Any]]) -> None:
        """The writer's thread: DCP's save of the host copies, then (rank 0) ``meta.pt`` and the publish."""
        dcp.save(staged, checkpoint_id=tmp, process_group=self._group,
                 planner=caching_save_planner(self._plans, PiecesPlanner))
        if meta is not None:
            _publish(meta, tmp, path)

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

    def wait(self, world_size: int, share: Any = None, then: Optional[Callable[[], None]] = None) -> list[Any]:
        """Wait for the save in flight and raise its failure, from any rank, on every rank (collective); returns
        every rank's ``share``, gathered by the same collective (a save's other exchanges ride on it). ``then``
        runs once this rank's part of the save in flight is over, before the collective: on rank 0, whose part
        ends after every rank's shards are written, it may clear the folder the next save writes to."""
        path = self._path
        failures = self.settle()
        if then is not None:
            then()
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, (failures, str(path) if path is not None else None, share))
        failed = {rank: e for errors, _, _ in gathered for rank, e in errors.items()}
        if failed:
            where = next(p for _, p, _ in gathered if p is not None)
            raise AsyncCheckpointError(
                f"the asynchronous checkpoint save of {where} failed on rank(s) {sorted(failed)}: "
                + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
                + f". Nothing was published: {where} still holds the checkpoint saved before it (if any). Fix the "
                  f"cause (free space, permissions of the folder), or pass async_save=False to write in the step")
        return [shared for _, _, shared in gathered]

    def after_publish(self, remove: Callable[[], None]) -> None:
        """Remove an older checkpoint (``ModelCheckpoint`` keeping its top k) only once the save in flight is
        published, at the next :meth:`wait`, and not at all if it fails: until then the older one is what a crash
        leaves. Without a save in flight, now."""
        if self._job is None:
            remove()
        else:
            self._deferred.append(remove)


class _Kept(NamedTuple):
    """A host buffer kept from save to save, what DCP is handed (the buffer, wrapped as the tensor was), and, for a
    plain tensor of this rank, what it was (shape, dtype, cut, whole shape): the same again reuses the wrapper as is."""

    buf: Tensor
    wrapped: Any
    entry: Optional[tuple[Any, ...]]


def host_copy(state: dict[str, Any], buffers: dict[str, _Kept], layout: Optional[Layout] = None) -> dict[str, Any]:
    """Each tensor's (each DTensor's local shard's, each :class:`Pieces`' local pieces') copy in host memory,
    wrapped as it was (with ``layout``: as ``layout.save_form`` wraps each entry). The copies go into ``buffers``
    kept from the previous save (written by then), with their wrappers: a fresh allocation each save costs its page
    faults, about as much as the copy, and wrapping hundreds of tensors again costs about half as much. DCP's
    default stager deep-copies each tensor through ``__deepcopy__`` instead, at about twice the cost for a few
    hundred small tensors."""
    out: dict[str, Any] = {}
    for key, value in state.items():
        kept = buffers.get(key)
        entry = _plain_entry(value) if layout is not None else None
        if kept is not None and entry is not None and kept.entry == entry:  # the wrapper made at an earlier save
            kept.buf.copy_(value[0].detach())
            out[key] = kept.wrapped
            continue
        if layout is not None:
            value = layout.save_form(*value)  # collective where a dp shard is gathered (DTensor entries only)
        local = value.to_local() if isinstance(value, DTensor) else value.local if isinstance(value, Pieces) \
            else value
        if not isinstance(local, Tensor):
            out[key] = copy.deepcopy(value)
            continue
        if kept is None or not _fits(kept, value, local):
            buf = torch.empty(local.shape, dtype=local.dtype, device="cpu")
            kept = _Kept(buf, _wrapped_like(value, buf), None)
        buffers[key] = kept = kept._replace(entry=entry)
        kept.buf.copy_(local.detach())
        out[key] = kept.wrapped
    for key in set(buffers) - set(state):
        del buffers[key]
    return out


def _plain_entry(entry: tuple[Any, Any, Any]) -> Optional[tuple[Any, ...]]:
    """What decides the wrapper of a plain tensor entry (its data is the tensor's whatever ``Layout.save_form``
    makes of it); None for a DTensor (sharded over dp: its wrapper is rebuilt each save) or a non-tensor."""
    t, spec, full = entry
    if not isinstance(t, Tensor) or isinstance(t, DTensor):
        return None
    return tuple(t.shape), t.dtype, spec, tuple(full)


def _wrapped_like(value: Any, buf: Tensor) -> Any:
    """``buf`` (a host copy of ``value``'s local data) wrapped as ``value`` is."""
    if isinstance(value, DTensor):
        return DTensor.from_local(buf, value.device_mesh, value.placements, run_check=False, shape=value.shape,
                                  stride=value.stride())
    return value.like(buf) if isinstance(value, Pieces) else buf


def _fits(kept: _Kept, value: Any, local: Tensor) -> bool:
    """The buffer (and its wrapper) kept from the previous save holds ``value`` as it is now."""
    buf, wrapped, _ = kept
    if buf.shape != local.shape or buf.dtype != local.dtype or type(wrapped) is not type(value):
        return False
    if isinstance(value, Pieces):
        return value.same_layout(wrapped)
    return not isinstance(value, DTensor) or (
        wrapped.shape == value.shape and wrapped.stride() == value.stride()
        and wrapped.placements == value.placements and wrapped.device_mesh == value.device_mesh)


def _describe(err: BaseException) -> str:
    return f"{type(err).__name__}: {str(err)[:300]}"


def _publish(meta: dict[str, Any], tmp: Path, path: Path) -> None:
    atomic_save(meta, tmp / META)  # written last: a folder without it is an unfinished save
    publish(tmp, path)
