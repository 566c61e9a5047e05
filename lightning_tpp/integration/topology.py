"""Where this rank sits: the process group, the ``(dp, pp, [cp,] tp)`` mesh and its groups, devices, the sampler's
replica index, and the failure watch started with the processes."""

from __future__ import annotations

import atexit
import functools
from typing import Any, Optional

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup
from typing_extensions import override

from lightning_tpp._compat import default_store, set_rank_zero
from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.mesh import MeshDims, build_mesh, replica_mesh, resolve_dims
from lightning_tpp.core.seeding import agree_with_rank0
from lightning_tpp.config import TensorPipeConfig
from lightning_tpp.experts.expert_parallel import check_ep, expert_group
from lightning_tpp.parallel_state import ProcessGroups
from lightning_tpp.reliability.restart import init_processes
from lightning_tpp.reliability.watch import FailureWatch, SignalReport, job_store, rank_report


@functools.lru_cache(maxsize=None)
def _destroy_process_group_at_exit() -> None:
    """Destroy the process group before the interpreter tears down: gloo's threads otherwise may abort the process
    ("terminate called without an active exception") after all work is done. Registered once per process."""
    atexit.register(lambda: dist.destroy_process_group() if dist.is_initialized() else None)


class MeshTopology:
    """Strategy mixin: the process group, the mesh and this rank's groups (``setup_environment``), from the strategy's
    ``config``; Lightning's ``parallel_devices``, ``cluster_environment``, ranks and ``world_size``."""

    config: TensorPipeConfig
    _groups: ProcessGroups
    _dims: Optional[MeshDims]
    _watch: Optional[FailureWatch]
    _signal_report: Optional[SignalReport]
    _process_group_backend: Optional[str]
    _num_nodes: int
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
        return self._groups.mesh

    @property
    def tp_group(self) -> TPGroup:
        return self._groups.tp

    @property
    def dp_group(self) -> Optional[ProcessGroup]:
        return self._groups.dp

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
        self._dims = resolve_dims(self.world_size, self.config.tp, self.config.pp, self.config.dp, self.config.cp)
        mesh = build_mesh(self._dims, self.root_device.type)
        coords = self._dims.coords(self.global_rank)
        ep = None
        if self.config.ep > 1:
            check_ep(self.config.ep, dp=self._dims.dp, tp=self._dims.tp, cp=self._dims.cp)
            ep = expert_group(mesh, self.config.ep, rank=self.global_rank, dp=self._dims.dp * self._dims.cp)
        cp = replicas = None
        if self._dims.cp > 1:
            cp = TPGroup(mesh.get_group("cp"), coords.get("cp", 0), self._dims.cp)
            replicas = replica_mesh(mesh, self._dims).get_group()
        self._groups = ProcessGroups(mesh, TPGroup(mesh.get_group("tp"), coords["tp"], self._dims.tp),
                                     mesh.get_group("pp"), mesh.get_group("dp"), ep, cp, replicas)
        if self._watch is None and self.world_size > 1:
            seconds = self.config.timeout.total_seconds() if self.config.timeout is not None else 1800.0
            self._watch = FailureWatch(job_store(default_store()), self.global_rank, self.world_size,
                                       timeout=min(seconds, 60.0))
            self._watch.start()

    def _watch_describes(self, label: str, engine: Any) -> None:
        """The hang report (on SIGUSR1, and when the failure watch stops this rank): this rank's ``label`` and what
        its pipeline ``engine`` (if any) is doing."""
        if self._watch is None:
            return
        self._watch.describe = lambda: rank_report(label, engine.describe_activity if engine else None)
        if self._signal_report is None:
            self._signal_report = SignalReport(self._watch.describe)
            self._signal_report.install()

    def _stop_watch(self) -> None:
        if self._signal_report is not None:
            self._signal_report.uninstall()
            self._signal_report = None
        if self._watch is not None:
            self._watch.stop()
            if not self._watch.reported:  # no rank exits (taking the store with it) while another still uses it
                self.barrier("lightning_tpp-teardown")  # type: ignore[attr-defined]
            self._watch = None

    def _before_mesh(self) -> None:
        """Processes exist, the mesh does not yet: where a searched layout decides its degrees."""

    def _set_world_ranks(self) -> None:
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        set_rank_zero(self.global_rank)
