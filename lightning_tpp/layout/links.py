"""What the hardware offers the cost model: a device's compute and memory, and each link's bandwidth and latency.

Defaults for common GPUs and interconnects are data (:data:`DEVICES`), from the vendors' datasheets with the
fractions real kernels and NCCL reach (assumptions, stated per entry); on this machine the CPU processes' gloo link
is measured (:func:`measure_link`, two all-reduce sizes fitted to ``latency + bytes / bandwidth``)::

    within a node: tp (always), pp and dp while their groups fit in the node      -> DeviceSpec.intra
    across nodes:  pp / dp groups that span more than one node                   -> DeviceSpec.inter
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace
from typing import Callable, Optional

import torch
import torch.distributed as dist

from lightning_tpp.core.collectives import all_gather_into, reduce_scatter_into


class UnknownDeviceError(ValueError):
    """A device name the cost model has no figures for."""


@dataclass(frozen=True)
class Link:
    """A link as the collectives see it: ``bandwidth`` in bytes/s (NCCL's "bus bandwidth": what a ring moves per
    rank), ``latency`` in seconds per ring step."""

    bandwidth: float
    latency: float
    gather_factor: float = 1.0  # measured all-gather bandwidth term over the ring model's (gloo's is not a ring)
    scatter_factor: float = 1.0  # the same for reduce-scatter
    # the same for FSDP2's, which the strategy sends itself (``core.collectives``: on gloo point to point)
    param_gather_factor: float = 1.0
    grad_scatter_factor: float = 1.0

    def p2p(self, nbytes: float) -> float:
        """One send of ``nbytes`` (a pipeline activation or its gradient)."""
        return self.latency + nbytes / self.bandwidth

    def all_reduce(self, nbytes: float, ranks: int) -> float:
        """Ring all-reduce of a ``nbytes`` tensor over ``ranks``: 2 (k-1)/k of it crosses each link."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        return 2 * (ranks - 1) * self.latency + 2 * (ranks - 1) / ranks * nbytes / self.bandwidth

    def all_to_all(self, nbytes: float, ranks: int) -> float:
        """All-to-all of ``nbytes`` per rank, spread evenly: (k-1)/k of it leaves the rank, one latency per peer."""
        if ranks <= 1:
            return 0.0
        return (ranks - 1) * self.latency + (ranks - 1) / ranks * nbytes / self.bandwidth

    def gather(self, nbytes: float, ranks: int, factor: Optional[float] = None) -> float:
        """Ring all-gather whose whole result is ``nbytes``: (k-1)/k of it crosses each link (its bandwidth term
        times ``gather_factor``, measured)."""
        if ranks <= 1 or nbytes <= 0:
            return 0.0
        factor = self.gather_factor if factor is None else factor
        return (ranks - 1) * self.latency + factor * (ranks - 1) / ranks * nbytes / self.bandwidth

    def reduce_scatter(self, nbytes: float, ranks: int, factor: Optional[float] = None) -> float:
        """Reduce-scatter of a ``nbytes`` tensor: as an all-gather of it, times ``scatter_factor``."""
        return self.gather(nbytes, ranks, self.scatter_factor if factor is None else factor)


@dataclass(frozen=True)
class DeviceSpec:
    """A device and its links. ``flops``: dense bf16 peak (fp32 on CPU: unused, the block is timed instead);
    ``efficiency``: the fraction of it transformer blocks reach (the model's MFU assumption, used only where the
    block is not timed on the device itself); ``memory``: bytes per device; ``memory_bandwidth``: bytes/s (the
    optimizer step is bound by it); ``overlap``: the fraction of FSDP2's gathers and reduce-scatters and of the dp
    all-reduce hidden behind compute (NCCL on its own streams: most of it; gloo on CPU: none, the collectives run
    on the same cores)."""

    name: str
    flops: float
    efficiency: float
    memory: float
    memory_bandwidth: float
    intra: Link
    inter: Link
    devices_per_node: int = 8
    overlap: float = 0.0


GB = 1e9
# datasheet peaks; NVLink busbw is nccl-tests' all-reduce figure at large sizes (about 80% of the per-direction
# NVLink bandwidth), InfiniBand one 400 Gb/s (H100) or 200 Gb/s (A100) NIC per GPU at 80%
DEVICES: dict[str, DeviceSpec] = {
    "h100": DeviceSpec("h100", flops=989e12, efficiency=0.45, memory=80 * GB, memory_bandwidth=3.35e12,
                       intra=Link(360 * GB, 10e-6), inter=Link(40 * GB, 20e-6), overlap=0.8),
    "h200": DeviceSpec("h200", flops=989e12, efficiency=0.45, memory=141 * GB, memory_bandwidth=4.8e12,
                       intra=Link(360 * GB, 10e-6), inter=Link(40 * GB, 20e-6), overlap=0.8),
    "a100": DeviceSpec("a100", flops=312e12, efficiency=0.5, memory=80 * GB, memory_bandwidth=2.0e12,
                       intra=Link(230 * GB, 10e-6), inter=Link(20 * GB, 20e-6), overlap=0.8),
}


def device_spec(name: str, *, memory: Optional[float] = None, devices_per_node: Optional[int] = None
                ) -> DeviceSpec:
    """The table's entry for ``name`` (case-insensitive), with ``memory`` / ``devices_per_node`` overridden."""
    spec = DEVICES.get(name.lower())
    if spec is None:
        raise UnknownDeviceError(f"device={name!r} has no figures; choose one of {sorted(DEVICES)} or pass a "
                                 f"DeviceSpec (lightning_tpp.layout.DeviceSpec) with its flops, memory and links")
    return replace(spec, memory=spec.memory if memory is None else memory,
                   devices_per_node=spec.devices_per_node if devices_per_node is None else devices_per_node)


def cpu_memory_share(local_processes: int) -> float:
    """This process's share of the machine's memory: what ``device_memory`` defaults to on CPU."""
    pages, size = os.sysconf("SC_PHYS_PAGES"), os.sysconf("SC_PAGE_SIZE")
    return pages * size / max(local_processes, 1)


def measure_link(group: Optional[dist.ProcessGroup] = None, *, small: int = 1024, large: int = 1 << 20,
                 repeats: int = 5, device: Optional[torch.device] = None) -> Link:
    """Latency and bandwidth of the process group's all-reduce, fitted from the median of ``repeats`` all-reduces
    of ``small`` and ``large`` float32 elements (every rank of ``group`` must call it). ``device``: where the
    tensors live, by default the group's backend's (NCCL: this process's GPU, which it waits for; else the CPU)."""
    ranks = dist.get_world_size(group)
    device = device or backend_device(group)

    def done(run: Callable[[], object]) -> None:
        run()
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # NCCL returns once the collective is queued

    def timed(run: Callable[[], object]) -> float:
        done(run)  # warm the connection
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            done(run)
            samples.append(time.perf_counter() - start)
        return sorted(samples)[repeats // 2]

    times = []
    for n in (small, large):
        x = torch.ones(n, device=device)
        times.append(timed(lambda: dist.all_reduce(x, group=group)))
    factor = 2 * (ranks - 1) / ranks if ranks > 1 else 1.0
    per_byte = max((times[1] - times[0]) / ((large - small) * 4 * factor), 1e-12)
    latency = max(times[0] - small * 4 * factor * per_byte, 1e-7) / max(2 * (ranks - 1), 1)
    link = Link(bandwidth=1.0 / per_byte, latency=latency)
    if ranks <= 1:
        return link
    # FSDP2's collectives (what ``core.collectives`` sends: on gloo point to point, about half the time of gloo's
    # own) and torch's all-gather and reduce-scatter (activations: cp's keys and values, sequence parallelism), at
    # the large size: measured, not assumed to be the ring's (on this machine gloo's all-gather took 1.5x and its
    # reduce-scatter 2-3x the ring model's time at 4-16 MB)
    n = large // ranks * ranks
    whole, shard = torch.ones(n, device=device), torch.ones(n // ranks, device=device)
    ring = (ranks - 1) / ranks * n * 4 / link.bandwidth
    # (collective, lowest factor): torch's never taken as better than the ring; the direct ones can be (one wait
    # instead of k - 1)
    runs = {"gather_factor": (lambda: dist.all_gather_single(whole, shard, group=group), 1.0),
            "scatter_factor": (lambda: dist.reduce_scatter_single(shard, whole, group=group), 1.0),
            "param_gather_factor": (lambda: all_gather_into(whole, shard, group), 0.1),
            "grad_scatter_factor": (lambda: reduce_scatter_into(shard, whole, group), 0.1)}
    return replace(link, **{name: max(max(timed(run) - (ranks - 1) * latency, 0.0) / ring, lowest)
                            for name, (run, lowest) in runs.items()})


def backend_device(group: Optional[dist.ProcessGroup] = None) -> torch.device:
    """The device a collective of ``group`` takes its tensors on: this process's GPU under NCCL, else the CPU (gloo
    refuses CUDA tensors for some collectives, NCCL every CPU tensor)."""
    if "nccl" in str(dist.get_backend(group)).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def cpu_spec(link: Link, *, memory: float, processes: int) -> DeviceSpec:
    """This machine's CPU processes: the blocks are timed (``flops`` unused), memory bandwidth measured by one
    copy, and gloo's measured ``link`` within the node and across (one node)."""
    x = torch.empty(1 << 23)
    y = torch.empty_like(x)
    y.copy_(x)
    start = time.perf_counter()
    y.copy_(x)
    bandwidth = 2 * x.nbytes / max(time.perf_counter() - start, 1e-9)
    return DeviceSpec("cpu", flops=0.0, efficiency=1.0, memory=memory, memory_bandwidth=bandwidth, intra=link,
                      inter=link, devices_per_node=processes, overlap=0.0)
