"""Mesh dimensions: validate ``dp x pp x cp x tp`` against the world size and build the process groups.

Rank layout (tp innermost, so that a tensor-parallel group sits on one node's fast links; the context-parallel ranks
of a layout, which exchange keys and values in every attention, next to it)::

    world = 8, dp = 2, pp = 2, tp = 2

    global rank:  0  1 | 2  3 || 4  5 | 6  7
    tp group:     [0 1]  [2 3]   [4 5]  [6 7]
    pp stage:       0      1       0      1
    dp replica:   ------ 0 -----  ------ 1 -----

With ``cp > 1`` each (dp, pp) position holds ``cp x tp`` ranks, cp outside tp: ``rank = ((dp*PP + pp)*CP + cp)*TP + tp``.

The pure part (:func:`resolve_dims`, :meth:`MeshDims.coords`, :meth:`MeshDims.rank_of`) takes plain integers and is
tested in one process; :func:`build_mesh` and :func:`reused` touch ``torch.distributed``.

Every ``fit``, ``validate``, ``test`` and ``predict`` sets the strategy up again; the process groups of a layout are
built once per process and default process group and reused (:func:`reused`): built anew each time, the earlier ones
were never destroyed (gloo keeps threads and sockets per group, NCCL a communicator and its device buffers), and a
process that ran many of them timed differently from a fresh one (docs/layout.md, fourth run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Hashable, Literal, TypeVar, Union

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

AXES = ("dp", "pp", "tp")
AXES_CP = ("dp", "pp", "cp", "tp")  # the mesh of a layout with cp > 1


@dataclass(frozen=True)
class MeshDims:
    """Sizes of the mesh axes; ``dp * pp * cp * tp == world_size`` (``cp``: context parallelism, 1 by default)."""

    dp: int
    pp: int
    tp: int
    cp: int = 1

    @property
    def world_size(self) -> int:
        return self.dp * self.pp * self.cp * self.tp

    def coords(self, rank: int) -> dict[str, int]:
        """Position of ``rank`` on each axis (tp varies fastest, then cp); ``cp`` only in a mesh with that axis (a
        layout without cp names its ranks as before: logs and reports read the same)."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is outside the mesh {self} of {self.world_size} ranks")
        inner = self.cp * self.tp
        if self.cp == 1:
            return {"dp": rank // (self.pp * inner), "pp": (rank // inner) % self.pp, "tp": rank % self.tp}
        return {"dp": rank // (self.pp * inner), "pp": (rank // inner) % self.pp, "cp": (rank // self.tp) % self.cp,
                "tp": rank % self.tp}

    def rank_of(self, *, dp: int, pp: int, tp: int, cp: int = 0) -> int:
        return ((dp * self.pp + pp) * self.cp + cp) * self.tp + tp



def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def resolve_dims(world_size: int, tp: int, pp: int, dp: Union[int, Literal["auto"]] = "auto", cp: int = 1
                 ) -> MeshDims:
    """Check the requested sizes against ``world_size``; ``dp="auto"`` takes what tp, pp and cp leave."""
    for name, value in (("tp", tp), ("pp", pp), ("cp", cp)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name}={value!r} must be a positive integer")
    if dp != "auto" and (not isinstance(dp, int) or isinstance(dp, bool) or dp < 1):
        raise ValueError(f"dp={dp!r} must be a positive integer or 'auto'")
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world size {world_size!r} must be a positive integer")
    if cp > 1 and world_size % (tp * pp * cp) != 0:
        raise ValueError(f"world size {world_size} is not divisible by tp*pp*cp = {tp}*{pp}*{cp} = {tp * pp * cp}; "
                         f"choose tp, pp and cp whose product divides {world_size}")
    if world_size % (tp * pp) != 0:
        valid = [(t, p) for t in _divisors(world_size) for p in _divisors(world_size // t)]
        raise ValueError(
            f"world size {world_size} is not divisible by tp*pp = {tp}*{pp} = {tp * pp}; "
            f"with {world_size} processes choose (tp, pp) from {valid}, or change the number of devices/nodes"
        )
    if dp == "auto":
        dp = world_size // (tp * pp * cp)
    if dp * tp * pp * cp != world_size:
        with_cp = f"*{cp}" if cp > 1 else ""
        raise ValueError(
            f"dp*pp*{'cp*' if cp > 1 else ''}tp = {dp}*{pp}{with_cp}*{tp} = {dp * pp * cp * tp} does not match world "
            f"size {world_size}; with tp={tp}, pp={pp}{f', cp={cp}' if cp > 1 else ''} use "
            f"dp={world_size // (tp * pp * cp)} or dp='auto'"
        )
    return MeshDims(dp=dp, pp=pp, tp=tp, cp=cp)


def build_mesh(dims: MeshDims, device_type: str) -> DeviceMesh:
    """Create the ``("dp", "pp", "tp")`` device mesh (``("dp", "pp", "cp", "tp")`` with ``cp > 1``); every rank must
    call this (it creates sub-groups)."""
    if not torch.distributed.is_initialized():
        raise RuntimeError("build_mesh needs an initialised torch.distributed process group")
    world = torch.distributed.get_world_size()
    if world != dims.world_size:
        raise ValueError(f"mesh {dims} needs {dims.world_size} processes but the process group has {world}")
    if dims.cp > 1:
        return reused(("mesh", dims, device_type),
                      lambda: init_device_mesh(device_type, (dims.dp, dims.pp, dims.cp, dims.tp), mesh_dim_names=AXES_CP))
    return reused(("mesh", dims, device_type),
                  lambda: init_device_mesh(device_type, (dims.dp, dims.pp, dims.tp), mesh_dim_names=AXES))


def replica_mesh(mesh: DeviceMesh, dims: MeshDims) -> DeviceMesh:
    """The 1-D mesh of the ranks holding the same weights: dp, or dp x cp flattened (the cp ranks of a replica hold
    the same weights and see other positions of the same samples), over which FSDP2 shards and gradients average."""
    if dims.cp == 1:
        return mesh["dp"]
    return reused(("replicas", dims, mesh.device_type), lambda: mesh["dp", "cp"]._flatten("dp_cp"))


T = TypeVar("T")
_BUILT: dict[Hashable, Any] = {}  # key -> process group or mesh, for the default group in _WORLD
_WORLD: list[Any] = [None]


def reused(key: Hashable, build: Callable[[], T]) -> T:
    """What ``build()`` (a collective that creates process groups: a mesh, ``new_group``) returned for ``key`` earlier
    in this process, while the default process group is still the one it was built under; else ``build()``. Every
    rank calls it with the same keys in the same order (as it would call ``build``), so they all build or all reuse."""
    world = torch.distributed.group.WORLD
    if _WORLD[0] is not world:  # a new default group (destroyed and initialised again): the old groups are gone
        _BUILT.clear()
        _WORLD[0] = world
    if key not in _BUILT:
        _BUILT[key] = build()
    return _BUILT[key]
