"""Sharded checkpoints with ``torch.distributed.checkpoint`` (DCP), under the single-device names, and their
conversion to one ordinary Lightning checkpoint.

A checkpoint is a folder::

    run.ckpt/
      .metadata, __*_*.distcp    DCP: "model.<name>" and "optim<i>.<name>.<state key>", each rank writing its shards
      meta.pt                    everything else Lightning saves (loops, callbacks, schedulers, hyper-parameters),
                                 the optimizers' parameter groups (by name) and the single-device parameter order

Plain column/row/vocab shards are saved as DTensors (``Shard(dim)`` of the tp mesh), so DCP reshards them into any
layout on load; fused projections (qkv) as one chunk per piece of the whole tensor (``pieces``), each written by the
rank that holds it; replicated tensors whole. The folder is written aside and
renamed into place, so a save that dies midway leaves the previous checkpoint intact.
"""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import ChunkStorageMetadata, CheckpointException, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.device_mesh import DeviceMesh

from lightning_tpp.checkpoint.files import atomic_save, publish
from lightning_tpp.checkpoint.pieces import Pieces, PiecesPlanner
from lightning_tpp.checkpoint.safe_load import CheckpointMismatchError, SafeFileSystemReader, classify, torch_load
from lightning_tpp.checkpoint.state import check_state_layout, cut_like_param, indexed_optimizer_state
from lightning_tpp.core.comm import TPGroup, gather_with_spec
from lightning_tpp.core.dp_shard import gather_dp, shard_dp_like
from lightning_tpp.core.mesh import reused
from lightning_tpp.core.params import ParamNames, ShardIndex, params_by_index
from lightning_tpp.core.sharding import ShardSpec, shard_tensor

META = "meta.pt"


def is_sharded_checkpoint(path: Any) -> bool:
    return Path(path).is_dir() and (Path(path) / ".metadata").is_file()


def _require_complete(path: Path) -> None:
    """``meta.pt`` is written last, after every shard and DCP's ``.metadata``: without it the save did not finish."""
    if not (path / META).is_file():
        raise CheckpointMismatchError(f"checkpoint {path} is incomplete (no {META}: its save did not finish) and "
                                      f"cannot be loaded; use the previous checkpoint")


def _dcp_load(state: dict[str, Any], path: Path, weights_only: Optional[bool], **kwargs: Any) -> None:
    """``dcp.load`` through the restricted reader; a failure on any rank is reported as what it is, on every rank."""
    try:
        dcp.load(state, storage_reader=SafeFileSystemReader(path, weights_only=weights_only), **kwargs)
    except CheckpointException as err:  # DCP gathers every rank's failure and raises it on every rank
        first = next(iter(err.failures.values()))
        raise classify(first[0] if isinstance(first, tuple) else first, f"{path} (a shard or its .metadata)") from err


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= n
    return tuple(reversed(stride))


class Layout:
    """How this rank's tensors map to whole tensors (the mesh, the tp group, and which parameters are cut how): wrap
    for DCP, and unwrap what DCP loaded.

    Experts cut over ep are ``Shard(0)`` over ep and ``Replicate()`` over their replicas, or, sharded over these too,
    ``Shard(0)`` over ep then FSDP2's ``Shard(0)`` or ``Shard(1)`` over the replicas (on the ``(ep, edp)`` mesh).
    A tensor also sharded over dp (FSDP2: ``Shard(0)`` of this rank's tp shard) is saved as what it is, a box of the
    whole tensor: ``Shard(0)`` over dp alone when tp did not cut it; ``Shard(dim)`` over tp and ``Shard(0)`` over dp
    (on the ``(dp, tp)`` mesh) for a row-parallel shard; dim 0 split by tp, then each tp part split by dp (two
    ``Shard(0)`` on the ``(tp, dp)`` mesh, tp outermost) for a column-parallel or vocab shard."""

    def __init__(self, mesh: Optional[DeviceMesh], group: TPGroup, shards: ShardIndex,
                 tp_dp_mesh: Optional[DeviceMesh] = None) -> None:
        self.full_mesh, self.group, self.shards, self.tp_dp_mesh = mesh, group, shards, tp_dp_mesh
        self.mesh = mesh["tp"] if mesh is not None else None

    def wrap(self, t: Tensor, spec: Optional[ShardSpec], full_shape: tuple[int, ...]) -> Any:
        if spec is not None and spec.over is not None:  # experts: cut over ep, the same on their replicas
            if isinstance(t, DTensor):  # ... or sharded over them (FSDP2: Shard(0) or Shard(1) of the ep part)
                return DTensor.from_local(t.to_local(), spec.over.ep_edp, [Shard(spec.dim), t.placements[0]],
                                          run_check=False, shape=torch.Size(full_shape),
                                          stride=_contiguous_stride(full_shape))
            return DTensor.from_local(t.contiguous(), spec.over.mesh, [Replicate(), Shard(spec.dim)], run_check=False,
                                      shape=torch.Size(full_shape), stride=_contiguous_stride(full_shape))
        if isinstance(t, DTensor):  # sharded over dp
            if spec is None or self.group.size == 1:
                return t
            if spec.parts is None:
                assert self.full_mesh is not None
                mesh = self.tp_dp_mesh if spec.dim == 0 else self.full_mesh["dp", "tp"]
                placements = [Shard(0), Shard(0)] if spec.dim == 0 else [Shard(0), Shard(spec.dim)]
                return DTensor.from_local(t.to_local(), mesh, placements, run_check=False,
                                          shape=torch.Size(full_shape), stride=_contiguous_stride(full_shape))
            t = gather_dp(t)
        if spec is None or self.group.size == 1:
            return t
        if spec.parts is None:
            return DTensor.from_local(t.contiguous(), self.mesh, [Shard(spec.dim)], run_check=False,
                                      shape=torch.Size(full_shape), stride=_contiguous_stride(full_shape))
        return gather_with_spec(t, spec, self.group)

    def save_form(self, t: Tensor, spec: Optional[ShardSpec], full_shape: tuple[int, ...]) -> Any:
        """What a save writes of ``t``: :meth:`wrap`'s, except that a tensor cut in several pieces per rank (a
        fused projection) is written piece by piece where it lies instead of gathered (:mod:`.pieces`)."""
        if spec is None or spec.over is not None or spec.parts is None or self.group.size == 1:
            return self.wrap(t, spec, full_shape)
        if isinstance(t, DTensor):  # sharded over dp as well: whole on this tp rank first
            t = gather_dp(t)
        pieces = spec.pieces(full_shape[spec.dim], self.group.rank, self.group.size)
        return Pieces(t.detach().contiguous(), full_shape, spec.dim, pieces)

    def unwrap(self, loaded: Any, spec: Optional[ShardSpec], like: Tensor) -> Tensor:
        """This rank's part of what was loaded into ``wrap``'s result, shaped as ``like`` (what was wrapped)."""
        if isinstance(loaded, DTensor):  # this rank's box of the whole tensor
            return _as_part(loaded.to_local(), like) if isinstance(like, DTensor) else loaded.to_local()
        if spec is not None and self.group.size > 1:
            loaded = shard_tensor(loaded, spec, self.group.rank, self.group.size)
        return shard_dp_like(loaded, like) if isinstance(like, DTensor) else loaded


def tp_dp_mesh(mesh: DeviceMesh) -> DeviceMesh:
    """The ``(tp, dp)`` mesh (tp outermost) of this rank's pipeline stage: a ``("dp", "pp", "tp")`` mesh cannot be
    sliced out of order, so a ``("pp", "tp", "dp")`` one is built over the same ranks (collective: every rank calls)."""
    order = [mesh.mesh_dim_names.index(a) for a in ("pp", "tp", "dp")]
    grid = mesh.mesh.permute(*order)
    return reused(("pp-tp-dp", mesh.device_type, tuple(grid.shape), tuple(grid.flatten().tolist())),
                  lambda: DeviceMesh(mesh.device_type, grid, mesh_dim_names=("pp", "tp", "dp")))["tp", "dp"]


def _as_part(part: Tensor, like: Tensor) -> Tensor:
    """A loaded box of this rank (plain) as the dp-sharded tensor it belongs to."""
    assert isinstance(like, DTensor)
    return DTensor.from_local(part.to(like.dtype), like.device_mesh, like.placements, run_check=False,
                              shape=like.shape, stride=like.stride())


def _model_entries(module: nn.Module, shards: ShardIndex) -> dict[str, tuple[Tensor, Optional[ShardSpec],
                                                                             tuple[int, ...]]]:
    out = {}
    for name, value in module.state_dict(keep_vars=True).items():
        out[name] = (value, shards.spec(value), shards.full_shape(value))
    return out


def _optimizer_entries(optimizers: list[Any], module: nn.Module, names: ParamNames, layout: Layout
                       ) -> dict[str, tuple[Tensor, Optional[ShardSpec], tuple[int, ...]]]:
    local = names.local(module)
    out = {}
    for i, opt in enumerate(optimizers):
        check_state_layout(opt, local, layout.shards, layout.group.size)
        params = params_by_index(opt)
        for idx, per_param in opt.state_dict()["state"].items():
            p = params[idx]
            spec, full = layout.shards.spec(p), layout.shards.full_shape(p)
            for key, value in per_param.items():
                if isinstance(value, Tensor):
                    sharded = value.shape == p.shape
                    out[f"optim{i}.{local[id(p)]}.{key}"] = (value, spec if sharded else None,
                                                             full if sharded else tuple(value.shape))
    return out


Entry = tuple[Any, Optional[ShardSpec], tuple[int, ...]]  # this rank's tensor, how it is cut, the whole shape


def sharded_entries(module: nn.Module, optimizers: list[Any], names: ParamNames, layout: Layout
                    ) -> dict[str, Entry]:
    """Model and optimizer entries under single-device names, each as this rank holds it."""
    entries = {f"model.{k}": v for k, v in _model_entries(module, layout.shards).items()}
    entries.update(_optimizer_entries(optimizers, module, names, layout))
    return entries


def sharded_state(module: nn.Module, optimizers: list[Any], names: ParamNames, layout: Layout) -> dict[str, Any]:
    """What DCP writes: :func:`sharded_entries` wrapped for resharding (collective over dp where a fused tensor is
    also sharded over dp and gathered on each tp rank). Write it with :class:`PiecesPlanner`."""
    return {k: layout.save_form(*v) for k, v in sharded_entries(module, optimizers, names, layout).items()}


def sharded_meta(checkpoint: dict[str, Any], names: ParamNames, param_groups: list[Any]) -> dict[str, Any]:
    """What ``meta.pt`` holds: everything Lightning saves but the tensors, and how to name the optimizer state."""
    meta = {k: v for k, v in checkpoint.items() if k not in ("state_dict", "optimizer_states")}
    meta["tpp"] = {"param_order": list(names.order), "param_groups": param_groups}
    return meta


def partial_path(path: Path) -> Path:
    """The hidden folder a save writes into before it is published at ``path``."""
    return path.with_name(f".{path.name}.partial")


def clear_partial(path: Path) -> Path:
    """:func:`partial_path`, emptied of an earlier failed save (rank 0, while no rank writes there)."""
    tmp = partial_path(path)
    if tmp.exists():
        shutil.rmtree(tmp)
    return tmp


def partial_dir(path: Path, *, is_global_zero: bool) -> Path:
    """:func:`partial_path`, emptied of an earlier failed save (collective: every rank waits until it is empty)."""
    tmp = clear_partial(path) if is_global_zero else partial_path(path)
    dist.barrier()
    return tmp


def save_sharded(path: Path, checkpoint: dict[str, Any], module: nn.Module, optimizers: list[Any],
                 names: ParamNames, layout: Layout, *, is_global_zero: bool, param_groups: list[Any]) -> None:
    """Every rank calls this (DCP's save is collective)."""
    state = sharded_state(module, optimizers, names, layout)
    tmp = partial_dir(path, is_global_zero=is_global_zero)
    dcp.save(state, checkpoint_id=tmp, planner=PiecesPlanner())
    if is_global_zero:
        atomic_save(sharded_meta(checkpoint, names, param_groups), tmp / META)  # last: without it, unfinished
        publish(tmp, path)
    dist.barrier()


def merge_param_groups(stages: list[list[list[dict[str, Any]]]]) -> list[list[dict[str, Any]]]:
    """Each optimizer's named parameter groups from every pipeline stage, joined group by group."""
    merged = [[{**g, "params": list(g["params"])} for g in groups] for groups in stages[0]]
    for stage in stages[1:]:
        for opt_groups, stage_groups in zip(merged, stage):
            for g, h in zip(opt_groups, stage_groups):
                g["params"] += [n for n in h["params"] if n not in g["params"]]
    return merged


def named_param_groups(optimizers: list[Any], module: nn.Module, names: ParamNames) -> list[list[dict[str, Any]]]:
    local = names.local(module)
    out = []
    for opt in optimizers:
        params = params_by_index(opt)
        sd = opt.state_dict()
        out.append([{**{k: v for k, v in g.items() if k != "params"},
                     "params": [local[id(params[i])] for i in g["params"]]} for g in sd["param_groups"]])
    return out


def load_sharded(path: Path, module: nn.Module, optimizers: list[Any], names: ParamNames, layout: Layout,
                 load_meta: Any, *, strict: bool, weights_only: Optional[bool] = True) -> dict[str, Any]:
    """Load model (and optimizer state, where optimizers exist) in this rank's layout; returns the rest."""
    _require_complete(path)
    meta = load_meta(path / META)
    stored = SafeFileSystemReader(path, weights_only=weights_only).read_metadata().state_dict_metadata
    entries = {f"model.{k}": v for k, v in _model_entries(module, layout.shards).items()}
    missing = sorted(k[6:] for k in entries if k not in stored)
    if missing and strict:
        raise CheckpointMismatchError(f"checkpoint {path} lacks model entries {missing}")
    targets = {k: layout.wrap(*v) for k, v in entries.items() if k in stored}
    opt_entries = _expected_optimizer_entries(optimizers, module, names, stored, layout)
    targets.update({k: layout.wrap(*v) for k, v in opt_entries.items()})
    _dcp_load(targets, path, weights_only)
    with torch.no_grad():
        for key, (value, spec, _) in entries.items():
            if key in targets:
                value.copy_(layout.unwrap(targets[key], spec, value))
    _restore_optimizers(optimizers, module, names, meta["tpp"]["param_groups"],
                        {k: layout.unwrap(targets[k], v[1], v[0]) for k, v in opt_entries.items()})
    return meta


def _expected_optimizer_entries(optimizers: list[Any], module: nn.Module, names: ParamNames, stored: Any,
                                layout: Layout) -> dict[str, tuple[Tensor, Optional[ShardSpec], tuple[int, ...]]]:
    """Buffers for the optimizer state the checkpoint holds for this rank's parameters (state is created lazily)."""
    local = names.local(module)
    out = {}
    for i, opt in enumerate(optimizers):
        for p in params_by_index(opt):
            prefix = f"optim{i}.{local[id(p)]}."
            info = layout.shards.get(p)
            full, spec = layout.shards.full_shape(p), layout.shards.spec(p)
            for key, md in stored.items():
                if key.startswith(prefix) and "." not in key[len(prefix):]:
                    shape = tuple(md.size) if hasattr(md, "size") else ()
                    sharded = cut_like_param(info, local[id(p)], key[len(prefix):], shape, layout.group.size) \
                        if info is not None else shape == tuple(full)
                    local_shape = tuple(p.shape) if sharded else shape
                    dtype = md.properties.dtype if hasattr(md, "properties") else torch.float32
                    buf = torch.empty_like(p, dtype=dtype) if sharded and isinstance(p, DTensor) else \
                        torch.empty(local_shape, dtype=dtype, device=p.device if sharded else "cpu")
                    out[key] = (buf, spec if sharded else None, full if sharded else shape)
    return out


def _restore_optimizers(optimizers: list[Any], module: nn.Module, names: ParamNames, groups: list[Any],
                        loaded: dict[str, Tensor]) -> None:
    local = names.local(module)
    for i, opt in enumerate(optimizers):
        params = params_by_index(opt)
        state: dict[int, dict[str, Any]] = {}
        for idx, p in enumerate(params):
            prefix = f"optim{i}.{local[id(p)]}."
            per = {k[len(prefix):]: v for k, v in loaded.items() if k.startswith(prefix)}
            if per:
                state[idx] = per
        saved = groups[i] if i < len(groups) else [{}] * len(opt.param_groups)
        new_groups, start = [], 0
        for g_saved, g_now in zip(saved, opt.param_groups):
            n = len(g_now["params"])
            new_groups.append({**{k: v for k, v in g_saved.items() if k != "params"},
                               "params": list(range(start, start + n))})
            start += n
        opt.load_state_dict({"state": state, "param_groups": new_groups})


def consolidate(path: Path, out: Path, *, weights_only: Optional[bool] = True) -> None:
    """One ordinary Lightning checkpoint from a sharded one, in one process without ``torch.distributed``.

    Every file is read as ``weights_only`` loading would (see :mod:`lightning_tpp.checkpoint.safe_load`); pass
    ``weights_only=False`` only for a checkpoint you trust."""
    if not is_sharded_checkpoint(path):
        raise CheckpointMismatchError(f"{path} is not a sharded lightning_tpp checkpoint (no .metadata inside)")
    _require_complete(path)
    meta = torch_load(path / META, weights_only=weights_only)
    stored = SafeFileSystemReader(path, weights_only=weights_only).read_metadata().state_dict_metadata
    flat = {k: torch.empty(tuple(md.size), dtype=md.properties.dtype)
            for k, md in stored.items() if hasattr(md, "size")}
    _dcp_load(flat, path, weights_only, no_dist=True)
    tpp = meta.pop("tpp")
    order = ParamNames(tuple(tpp["param_order"]), {})
    checkpoint = dict(meta)
    checkpoint["state_dict"] = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
    checkpoint["optimizer_states"] = []
    for i, groups in enumerate(tpp["param_groups"]):
        named: dict[str, Any] = {"state": {}, "param_groups": groups}
        prefix = f"optim{i}."
        for key, value in flat.items():
            if key.startswith(prefix):
                name, _, state_key = key[len(prefix):].rpartition(".")
                named["state"].setdefault(name, {})[state_key] = value
        checkpoint["optimizer_states"].append(indexed_optimizer_state(named, order))
    atomic_save(checkpoint, out)


Box = tuple[tuple[int, ...], tuple[int, ...], Tensor]  # offsets and sizes in the whole tensor; where the box goes


def model_entry_shapes(path: Path) -> dict[str, tuple[int, ...]]:
    """The model's tensors in a sharded checkpoint (single-device names and shapes), from its ``.metadata`` only."""
    _require_complete(path)
    stored = SafeFileSystemReader(path).read_metadata().state_dict_metadata
    return {k[len("model."):]: tuple(md.size) for k, md in stored.items()
            if k.startswith("model.") and hasattr(md, "size")}


class _BoxPlanner(LoadPlanner):
    """Reads boxes of whole tensors straight into the tensors (views) that hold them: DCP's own resharding (the
    overlap of each box with the stored chunks), with no DTensor and no process group."""

    def __init__(self, boxes: dict[str, Sequence[Box]]) -> None:
        self.boxes = boxes

    def set_up_planner(self, state_dict: Any, metadata: Any = None, is_coordinator: bool = False) -> None:
        self.metadata = metadata

    def create_local_plan(self) -> LoadPlan:
        items: list[ReadItem] = []
        for fqn, boxes in self.boxes.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(s)) for o, s, _ in boxes]
            items += create_read_items_for_chunk_list(fqn, self.metadata.state_dict_metadata[fqn], chunks)
        return LoadPlan(items)

    def create_global_plan(self, global_plan: list[LoadPlan]) -> list[LoadPlan]:
        return global_plan

    def finish_plan(self, central_plan: LoadPlan) -> LoadPlan:
        return central_plan

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise CheckpointMismatchError(f"{read_item.dest_index.fqn} is stored as bytes, not as a tensor")

    def resolve_tensor(self, read_item: ReadItem) -> Tensor:
        dest = self.boxes[read_item.dest_index.fqn][read_item.dest_index.index][2]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: Tensor) -> None:
        pass  # resolve_tensor handed out a view of the destination: the data is in place


def read_model_boxes(path: Path, boxes: dict[str, Sequence[Box]]) -> None:
    """Fill each box (a view of this rank's tensor, any dtype) from the model entries of a sharded checkpoint, in one
    process (no collective). DCP reads each stored chunk that overlaps a box (the saving rank's shard, or the whole
    tensor where it was saved whole) and copies the overlap: memory beyond the destinations is one stored chunk."""
    planner = _BoxPlanner({f"model.{k}": v for k, v in boxes.items()})
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load in a single process")
        _dcp_load({k: b[0][2] for k, b in planner.boxes.items()}, path, True, planner=planner, no_dist=True)
