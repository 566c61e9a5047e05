"""Weights from files into a parallel model, each rank reading only the slices it holds.

Sources (``open_source`` tells them apart by their files)::

    model.safetensors                          Hugging Face, one file
    folder/ model.safetensors.index.json       Hugging Face, sharded: only the files that hold this rank's tensors
    run.ckpt                                   a consolidated Lightning checkpoint ("state_dict"), memory-mapped
    run.ckpt/ .metadata  __0_0.distcp ...      lightning_tpp's sharded checkpoint (model entries only)

Every rank decides the same thing from the same data — the file's keys and shapes (headers and metadata, never tensor
data) and the whole model's single-device names and shapes (``ParamNames``, recorded before a pipeline drops other
stages' modules) — so a file that does not fit raises the same :class:`WeightsMismatchError` on every rank, before
any rank waits in a collective. Then each rank fills its own tensors in place, box by box::

    whole tensor (file), fused [ q | k | v ] rows, tp = 2, rank 1      this rank's shard
      rows 0..7    q0 |                                                 q1   <- narrow(q rows 8..15)
      rows 8..15   q1 |  -> read only the boxes of rank 1 ->            k1   <- narrow(k rows 20..23)
      ...                                                               v1   <- narrow(v rows 28..31)

Peak memory beyond the model's own shards is one box (safetensors, ``.ckpt`` pages touched) or one stored chunk
(sharded checkpoints).
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Optional, Protocol, Sequence, Union

import torch
from torch import Tensor, nn

from lightning_tpp.checkpoint.dcp import Box, is_sharded_checkpoint, model_entry_shapes, read_model_boxes
from lightning_tpp.checkpoint.hf_experts import stack_experts
from lightning_tpp.checkpoint.safe_load import CheckpointMismatchError, load_or_explain
from lightning_tpp.core.optional import require
from lightning_tpp.core.params import ParamNames, ShardIndex
from lightning_tpp.core.sharding import ShardSpec

PathLike = Union[str, "os.PathLike[str]"]
SAFETENSORS_INDEX = "model.safetensors.index.json"


class WeightsMismatchError(ValueError):
    """A weights file does not fit the model: missing, unexpected or mis-shaped keys, or no name prefix fits."""


@dataclass(frozen=True)
class LoadedWeights:
    """What :func:`load_weights` did on this rank."""

    source: str  # the kind of source
    path: str
    prefix: str  # the module prefix put before each of the file's keys
    loaded: int  # this rank's state_dict entries filled (each alias of a tied weight counts)
    files: tuple[str, ...]  # the files whose tensor data this rank read
    bytes: int = 0  # the bytes read into this rank's tensors (at their dtypes)

    def describe(self) -> str:
        return (f"weights from {self.path} ({self.source}) under prefix {self.prefix!r}: {self.loaded} entries on "
                f"this rank ({self.bytes / 2 ** 20:.1f} MiB), read from {len(self.files)} file(s)")


# ---- where each rank's slice lies in the whole tensor ------------------------------------------------------------

def boxes(dest: Tensor, spec: Optional[ShardSpec], full_shape: Sequence[int], rank: int, world: int,
          window: Optional[tuple[int, int]] = None) -> list[Box]:
    """The boxes of the whole tensor that ``rank`` holds (as :func:`~lightning_tpp.core.sharding.shard_tensor` cuts
    it: one per segment of ``spec.parts``), each with the view of ``dest`` it goes to. ``window`` (dim, start):
    ``dest`` is only the part of this rank's shard from ``start`` along ``dim`` (what FSDP2 left this rank of it)."""
    full = tuple(full_shape)
    if spec is not None:
        rank, world = spec.placed(rank, world)
    if not full:
        return [((), (), dest)]
    if spec is None or world == 1:  # this rank holds it whole: one piece, along the window's dim
        cut = window[0] if window is not None else 0
        pieces = [(0, full[cut])]
    else:
        cut, pieces = spec.dim, spec.pieces(full[spec.dim], rank, world)
    wdim, wstart = window if window is not None else (cut, 0)
    wlen = dest.shape[wdim]
    out, local = [], 0
    for start, step in pieces:
        lo, hi = (max(local, wstart), min(local + step, wstart + wlen)) if wdim == cut else (local, local + step)
        if lo < hi:
            offsets = [start + lo - local if d == cut else 0 for d in range(len(full))]
            sizes = [hi - lo if d == cut else n for d, n in enumerate(full)]
            if wdim != cut:
                offsets[wdim], sizes[wdim] = wstart, wlen
            out.append((tuple(offsets), tuple(sizes), dest.narrow(cut, lo - (wstart if wdim == cut else 0), hi - lo)))
        local += step
    return out


def _index(offsets: Sequence[int], sizes: Sequence[int]) -> tuple[slice, ...]:
    return tuple(slice(o, o + n) for o, n in zip(offsets, sizes))


# ---- sources: keys and shapes without reading data; then the boxes ----------------------------------------------

class Source(Protocol):
    kind: str
    shapes: dict[str, tuple[int, ...]]  # every tensor of the source, by its own key

    def read(self, wanted: Mapping[str, Sequence[Box]]) -> tuple[str, ...]:
        """Copy each box from the tensor under that key; returns the files read."""


def _safetensors_header(path: Path) -> dict[str, tuple[int, ...]]:
    """Keys and shapes from a safetensors header (8 bytes of length, then JSON): the tensor data is not touched."""
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise CheckpointMismatchError(f"{path} is not a safetensors file (shorter than its header)")
        (n,) = struct.unpack("<Q", raw)
        try:
            header = json.loads(f.read(n))
        except ValueError as err:
            raise CheckpointMismatchError(f"{path} is not a safetensors file ({err})") from err
    return {k: tuple(v["shape"]) for k, v in header.items() if k != "__metadata__"}


class SafetensorsSource:
    kind = "safetensors"

    def __init__(self, files: Mapping[str, Path]) -> None:
        self.files = dict(files)  # key -> file
        self.shapes: dict[str, tuple[int, ...]] = {}
        for path in sorted(set(self.files.values())):
            header = _safetensors_header(path)
            self.shapes.update({k: v for k, v in header.items() if self.files.get(k) == path})

    @classmethod
    def file(cls, path: Path) -> "SafetensorsSource":
        return cls({k: path for k in _safetensors_header(path)})

    @classmethod
    def index(cls, path: Path) -> "SafetensorsSource":
        try:
            weight_map = json.loads(path.read_text())["weight_map"]
        except (ValueError, KeyError, TypeError) as err:
            raise CheckpointMismatchError(f"{path} is not a safetensors index (no weight_map: {err})") from err
        source = cls({k: path.parent / f for k, f in weight_map.items()})
        source.kind = "safetensors, sharded"
        return source

    def read(self, wanted: Mapping[str, Sequence[Box]]) -> tuple[str, ...]:
        safe_open = require("safetensors", "reading safetensors weights").safe_open

        by_file: dict[Path, list[str]] = {}
        for key in wanted:
            by_file.setdefault(self.files[key], []).append(key)
        for path, keys in sorted(by_file.items()):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for key in keys:
                    piece = f.get_slice(key)
                    for offsets, sizes, dest in wanted[key]:
                        dest.copy_(piece[_index(offsets, sizes)] if offsets else f.get_tensor(key))
        return tuple(str(p) for p in sorted(by_file))


class CkptSource:
    """A consolidated Lightning checkpoint (or a plain saved ``state_dict``), memory-mapped and loaded
    ``weights_only``: a box read touches only its pages."""

    kind = "Lightning checkpoint"

    def __init__(self, path: Path) -> None:
        self.path = path
        loaded = load_or_explain(lambda p: torch.load(p, map_location="cpu", mmap=True, weights_only=True), path)
        state = loaded.get("state_dict", loaded) if isinstance(loaded, dict) else None
        if not isinstance(state, dict):
            raise CheckpointMismatchError(f"{path} holds no state_dict (a {type(loaded).__name__})")
        self.state = {k: v for k, v in state.items() if isinstance(v, Tensor)}
        self.shapes = {k: tuple(v.shape) for k, v in self.state.items()}

    def read(self, wanted: Mapping[str, Sequence[Box]]) -> tuple[str, ...]:
        for key, key_boxes in wanted.items():
            for offsets, sizes, dest in key_boxes:
                dest.copy_(self.state[key][_index(offsets, sizes)])
        return (str(self.path),) if wanted else ()


class ShardedCheckpointSource:
    """lightning_tpp's sharded checkpoint folder: model entries only, through the restricted DCP reader."""

    kind = "sharded checkpoint"

    def __init__(self, path: Path) -> None:
        self.path = path
        self.shapes = model_entry_shapes(path)

    def read(self, wanted: Mapping[str, Sequence[Box]]) -> tuple[str, ...]:
        if wanted:
            read_model_boxes(self.path, wanted)
        return (str(self.path),) if wanted else ()


def open_source(path: PathLike) -> Source:
    p = Path(path)
    if p.is_dir():
        if is_sharded_checkpoint(p):
            return ShardedCheckpointSource(p)
        if (p / SAFETENSORS_INDEX).is_file():
            return SafetensorsSource.index(p / SAFETENSORS_INDEX)
        if (p / "model.safetensors").is_file():
            return SafetensorsSource.file(p / "model.safetensors")
        raise FileNotFoundError(f"weights folder {p} holds neither model.safetensors, {SAFETENSORS_INDEX} nor a "
                                f"sharded checkpoint (.metadata)")
    if not p.is_file():
        raise FileNotFoundError(f"weights file {p} does not exist")
    if p.name.endswith(".index.json"):
        return SafetensorsSource.index(p)
    if p.suffix == ".safetensors":
        return SafetensorsSource.file(p)
    return CkptSource(p)


# ---- the file's keys against the whole model's names -------------------------------------------------------------

def choose_prefix(file_keys: Sequence[str], model_names: Sequence[str]) -> tuple[str, int]:
    """The module prefix under which most of the file's keys are model names (the shortest among equals), and how
    many match: Hugging Face's ``model.layers.0.mlp.up_proj.weight`` is ``model.model.layers.0.mlp.up_proj.weight``
    in a LightningModule holding the Hugging Face model as ``self.model``."""
    keys = set(file_keys)
    counts: dict[str, int] = {}
    for name in model_names:
        cuts = [0] + [i + 1 for i, c in enumerate(name) if c == "."]
        for cut in cuts:
            if name[cut:] in keys:
                counts[name[:cut]] = counts.get(name[:cut], 0) + 1
    if not counts:
        return "", 0
    best = max(counts.values())
    return min((p for p, n in counts.items() if n == best), key=len), best


@dataclass
class KeyMatch:
    """The file's keys matched to the whole model's names (under ``prefix``)."""

    prefix: str
    key_of: dict[str, str]  # model name (every alias) -> the file key it is read from
    missing: list[str]  # canonical names of model entries no file key holds
    unexpected: list[str]  # file keys that are no model entry
    misshaped: list[str]  # "name: file (a, b) vs model (c, d)"


def match_keys(file_shapes: Mapping[str, tuple[int, ...]], names: ParamNames, prefix: str) -> KeyMatch:
    """Pure: the same answer on every rank (the whole model's names and the file's metadata only)."""
    model = names.shapes
    unexpected = sorted(k for k in file_shapes if prefix + k not in model and prefix + k not in names.transient)
    aliases: dict[str, list[str]] = {}
    for name in model:
        aliases.setdefault(names.canonical.get(name, name), []).append(name)
    key_of, missing = {}, []
    for canonical, group in aliases.items():
        held = [n[len(prefix):] for n in group if n.startswith(prefix) and n[len(prefix):] in file_shapes]
        if not held:
            missing.append(canonical)
            continue
        for n in group:  # its own key where the file holds it, else another alias's (a tied weight saved once)
            own = n[len(prefix):] if n.startswith(prefix) else None
            key_of[n] = own if own in file_shapes else held[0]
    misshaped = sorted(f"{prefix + k}: file {tuple(s)} vs model {tuple(model[prefix + k])}"
                       for k, s in file_shapes.items() if prefix + k in model and tuple(s) != model[prefix + k])
    return KeyMatch(prefix, key_of, sorted(missing), unexpected, misshaped)


def _mismatch_message(path: PathLike, match: KeyMatch, how: str, strict: bool) -> str:
    parts = [f"{label} ({len(keys)}): {keys}" for label, keys in
             (("missing", match.missing if strict else []), ("unexpected", match.unexpected if strict else []),
              ("mis-shaped", match.misshaped)) if keys]
    fixes = []
    if match.misshaped:
        fixes.append("build the model with the configuration the weights were saved from")
    if strict and (match.missing or match.unexpected):
        fixes.append("pass the prefix that makes the file's keys the model's names (weights_prefix=...) if they "
                     "are offset, or set the LightningModule's strict_loading = False to load what matches and keep "
                     "the rest as initialised")
    return (f"weights {path} do not fit the model under prefix {match.prefix!r} ({how}): " + "; ".join(parts)
            + ". Model names are the single-device LightningModule's; file keys get the prefix put before them. Fix: "
            + "; or ".join(fixes))


def _resolve_prefix(source: Source, path: PathLike, names: ParamNames, prefix: str) -> tuple[str, str]:
    if prefix != "auto":  # a module path: "model" means "model."
        return (prefix if not prefix or prefix.endswith(".") else prefix + "."), "given"
    if not source.shapes:
        raise WeightsMismatchError(f"weights {path} hold no tensors")
    chosen, count = choose_prefix(list(source.shapes), list(names.shapes))
    if count == 0:
        raise WeightsMismatchError(
            f"weights {path}: no module prefix makes any of the file's {len(source.shapes)} keys a model name "
            f"(file keys like {sorted(source.shapes)[:3]}, model names like {sorted(names.shapes)[:3]}); pass "
            f"weights_prefix=... (the module path under which the file's keys are the model's names)")
    return chosen, f"chosen automatically: {count} of the file's {len(source.shapes)} keys are model names under it"


def covered_names(source: PathLike, *, names: ParamNames, prefix: str = "auto",
                  module: Optional[nn.Module] = None) -> frozenset[str]:
    """The single-device names (every alias) that ``source`` holds a tensor for: a model built on the meta device
    only initialises what the file will not fill. Reads the files' headers only (Hugging Face per-expert tensors
    seen as ``module``'s banks)."""
    opened = open_source(source) if module is None else stack_experts(open_source(source), module)
    return frozenset(match_keys(opened.shapes, names, _resolve_prefix(opened, source, names, prefix)[0]).key_of)


def load_weights(module: nn.Module, source: PathLike, *, names: ParamNames, shards: ShardIndex, tp_rank: int,
                 tp_size: int, prefix: str = "auto", strict: bool = True,
                 select: Callable[[str], bool] = lambda name: True) -> LoadedWeights:
    """Fill this rank's parameters and persistent buffers (in place, cast to their dtypes) from ``source``: a
    safetensors file, a folder with ``model.safetensors`` or ``model.safetensors.index.json`` (or the index), a
    consolidated Lightning ``.ckpt``, or a sharded lightning_tpp checkpoint folder.

    ``module`` is this rank's part of the model (its pipeline stage, tensor-parallel shards as ``shards`` records;
    a parameter FSDP2 already sharded, a ``DTensor`` over one mesh dimension, gets only its local part);
    ``names`` the whole single-device model's. ``prefix`` is put before each file key to make the model name
    (``"auto"``: the prefix under which most keys match). With ``strict=False`` missing and unexpected keys are
    skipped; mis-shaped keys always raise :class:`WeightsMismatchError` — on every rank alike. ``select``: the
    entries (``module``'s state-dict names) filled now; the file is matched against all of them.
    """
    opened = stack_experts(open_source(source), module)  # Hugging Face's per-expert tensors as the model's banks
    names = names if names.shapes else _names_of_local(module, names, shards)
    chosen, how = _resolve_prefix(opened, source, names, prefix)
    match = match_keys(opened.shapes, names, chosen)
    if match.misshaped or (strict and (match.missing or match.unexpected)):
        raise WeightsMismatchError(_mismatch_message(source, match, how, strict))
    wanted: dict[str, list[Box]] = {}
    filled = 0
    for name, tensor in module.state_dict(keep_vars=True).items():
        key = match.key_of.get(name)
        if key is None or not isinstance(tensor, Tensor) or not select(name):
            continue
        filled += 1
        spec, full = shards.spec(tensor), shards.full_shape(tensor)
        dest, window = _local_part(name, tensor)
        wanted.setdefault(key, []).extend(boxes(dest, spec, full, tp_rank, tp_size, window))
    with torch.no_grad():
        files = opened.read(wanted)
    read = sum(dest.numel() * dest.element_size() for parts in wanted.values() for *_, dest in parts)
    return LoadedWeights(opened.kind, str(source), chosen, filled, files, read)


def fill_from_whole(name: str, tensor: Tensor, whole: Tensor, spec: Optional[ShardSpec], tp_rank: int,
                    tp_size: int) -> None:
    """This rank's part of ``tensor`` (cut by ``spec``, and by FSDP2 where it is a ``DTensor``) copied from the
    single-device tensor ``whole``: what reading it from a file would put there."""
    dest, window = _local_part(name, tensor)
    with torch.no_grad():
        for offsets, sizes, view in boxes(dest, spec, tuple(whole.shape), tp_rank, tp_size, window):
            view.copy_(whole[_index(offsets, sizes)])


def _local_part(name: str, tensor: Tensor) -> tuple[Tensor, Optional[tuple[int, int]]]:
    """Where a tensor's values go: itself, or for a ``DTensor`` sharded over one mesh dimension (FSDP2: its shard
    is a ``torch.chunk`` of the rank's tensor along the placement's dim) its local part and where that starts."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(tensor, DTensor):
        return tensor.detach(), None
    placement = tensor.placements[0] if len(tensor.placements) == 1 else None
    if type(placement) is not Shard:  # a _StridedShard or a 2-d mesh: its part is not one window
        raise WeightsMismatchError(f"{name}: a DTensor placed {tensor.placements} cannot be filled from a file "
                                   f"(only one Shard(dim) over one mesh dimension, as FSDP2 shards, is known)")
    dim, size = placement.dim, tensor.shape[placement.dim]
    chunk = -(-size // tensor.device_mesh.size())
    return tensor.to_local().detach(), (dim, min(tensor.device_mesh.get_local_rank() * chunk, size))


def _names_of_local(module: nn.Module, names: ParamNames, shards: ShardIndex) -> ParamNames:
    """Names recorded without shapes (an older state): this rank's entries at their whole shapes."""
    state = module.state_dict(keep_vars=True)
    shapes = {k: tuple(shards.full_shape(v)) for k, v in state.items() if isinstance(v, Tensor)}
    transient = frozenset(n for n, _ in module.named_buffers(remove_duplicate=False) if n not in shapes)
    return ParamNames(names.order, names.canonical, shapes, transient)
