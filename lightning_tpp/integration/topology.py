"""Where this rank sits: the process group, the ``(dp, pp, tp)`` mesh and its groups, devices, the sampler's
replica index, and the failure watch started with the processes."""

from __future__ import annotations

import atexit
import functools
from datetime import timedelta
from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from lightning_tpp._compat import default_store, set_rank_zero
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.mesh import MeshDims, build_mesh, resolve_dims
from lightning_tpp.core.seeding import agree_with_rank0
from lightning_tpp.experts.expert_parallel import ExpertGroup, check_ep, expert_group
from lightning_tpp.reliability.restart import init_processes
from lightning_tpp.reliability.watch import FailureWatch, job_store


@functools.lru_cache(maxsize=None)
def _destroy_process_group_at_exit() -> None:
    """Destroy the process group before the interpreter tears down: gloo's threads otherwise may abort the process
    ("terminate called without an active exception") after all work is done. Registered once per process."""
    atexit.register(lambda: dist.destroy_process_group() if dist.is_initialized() else None)


class MeshTopology:
    """Strategy mixin. Expects the strategy's ``_tp``, ``_pp``, ``_dp_arg``, ``_timeout``, ``_process_group_backend``,
    ``_watch`` and Lightning's ``parallel_devices``, ``cluster_environment``, ranks and ``world_size``."""

    _tp: int
    _pp: int
    _dp_arg: Union[int, str]
    _timeout: Optional[timedelta]
    _process_group_backend: Optional[str]
    _watch: Optional[FailureWatch]
    _num_nodes: int
    _dims: Optional[MeshDims]
    _mesh: Optional[DeviceMesh]
    _tp_group: TPGroup
    _dp_group: Optional[ProcessGroup]
    _pp_group: Optional[ProcessGroup]
    _ep: int
    _ep_group: Optional[ExpertGroup]
    parallel_devices: Optional[list[torch.device]]
    cluster_environment: Any
    local_rank: int
    global_rank: int
    node_rank: int
    world_size: int

    @property
    def num_nodes(self) -> int:
        return self._num_nodes

    @num_nodes.setter
    def num_nodes(self, num_nodes: int) -> None:
        self._num_nodes = num_nodes

    @property
    def num_processes(self) -> int:
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        return True

    @property
    def dims(self) -> MeshDims:
        if self._dims is None:
            raise RuntimeError("the mesh exists once the Trainer has set up the processes (setup_environment)")
        return self._dims

    @property
    def device_mesh(self) -> Any:
        """The ``("dp", "pp", "tp")`` DeviceMesh."""
        self.dims  # noqa: B018 - raises before setup
        return self._mesh

    @property
    def tp_group(self) -> TPGroup:
        return self._tp_group

    @property
    def dp_group(self) -> Optional[ProcessGroup]:
        return self._dp_group

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        coords = self.dims.coords(self.global_rank)
        return {"num_replicas": self.dims.dp, "rank": coords["dp"]}

    @property
    def process_group_backend(self) -> Optional[str]:
        return self._process_group_backend

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self._set_world_ranks()
        self._process_group_backend = self._process_group_backend or dist.Backend.default_device_backend_map.get(
            self.root_device.type, "gloo")
        assert self.cluster_environment is not None
        kwargs: dict[str, Any] = {}
        if self.root_device.type != "cpu":
            kwargs["device_id"] = self.root_device
        init_processes(self.cluster_environment, self._process_group_backend, self.config.timeout, **kwargs)
        _destroy_process_group_at_exit()
        agree_with_rank0(self.root_device)  # the user's streams as rank 0 holds them (DDP reseeds them instead)
        self._before_mesh()  # layout="auto" sets tp, pp and dp here (lightning_tpp.layout.strategy)
        self._dims = resolve_dims(self.world_size, self.config.tp, self.config.pp, self.config.dp)
        self._mesh = build_mesh(self._dims, self.root_device.type)
        coords = self._dims.coords(self.global_rank)
        self._tp_group = TPGroup(self._mesh.get_group("tp"), coords["tp"], self._dims.tp)
        self._dp_group = self._mesh.get_group("dp")
        self._pp_group = self._mesh.get_group("pp")
        if self.config.ep > 1:
            check_ep(self.config.ep, dp=self._dims.dp, tp=self._dims.tp)
            self._ep_group = expert_group(self._mesh, self.config.ep, rank=self.global_rank, dp=self._dims.dp)
        if self._watch is None and self.world_size > 1:
            seconds = self.config.timeout.total_seconds() if self.config.timeout is not None else 1800.0
            self._watch = FailureWatch(job_store(default_store()), self.global_rank, self.world_size,
                                       timeout=min(seconds, 60.0))
            self._watch.start()

    def _before_mesh(self) -> None:
        """Processes exist, the mesh does not yet: where a searched layout decides its degrees."""

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        set_rank_zero(self.global_rank)
