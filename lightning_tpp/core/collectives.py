"""FSDP2's collectives over gloo (CPU processes), sent point to point.

gloo's all-gather and reduce-scatter walk a ring: ``k - 1`` steps, each waiting for the rank before it. With several
processes sharing a CPU's cores, each step also waits for that rank to be scheduled. Sending each rank its part
directly (every send posted at once, the receives taken in turn) moves the same bytes per rank as the ring and waits
once. Measured on this machine (2 cores, ``benchmarks/collectives.py``, median of 8 alternating rounds), direct over
gloo's: all-gather 0.37-0.84x and reduce-scatter 0.43-0.90x at 0.5-24 MB over 2 and 4 processes, against what
FSDP2 used here before (gloo's all-reduce in place plus a copy: gloo's own reduce-scatter clones its input and is
slower still). gloo's all-reduce is not replaced: sent this way (a reduce-scatter, then an all-gather) it took
1.0-1.3x gloo's at 2-24 MB and 2.4x at 0.5 MB over 2 processes.

Used by FSDP2's units over gloo (``_compat.gloo_all_gather`` / ``gloo_reduce_scatter``, set in
``data_parallel.fsdp``) and timed by ``layout.links.measure_link``. Any other backend (NCCL) gets torch's
collectives. Activations (tensor, sequence and context parallelism) keep torch's, which ``torch.compile`` traces.

Each rank sums its own part in a fixed order (its own chunk, then the ranks before it), so a result is the same from
run to run. Memory: the reduce-scatter receives into its output, the all-gather into its output; nothing else.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed import ProcessGroup


def direct(group: Optional[ProcessGroup]) -> bool:
    """Whether ``group``'s collectives are sent point to point here: gloo, more than one rank."""
    return dist.get_world_size(group) > 1 and dist.get_backend(group) == "gloo"


def _sum_own_chunk(chunks: tuple[Tensor, ...], group: Optional[ProcessGroup], received: Tensor) -> None:
    """This rank's chunk of ``chunks`` summed in place over ``group``: each other rank's chunk sent to it, every send
    posted first; the receives (into ``received``, the chunk's size) added in the order of the ranks before."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    sends = [dist.isend(chunks[(r + k) % n], group=group, group_dst=(r + k) % n) for k in range(1, n)]
    for k in range(1, n):
        dist.recv(received, group=group, group_src=(r - k) % n)
        chunks[r].add_(received)
    for work in sends:
        work.wait()


def _share_own_chunk(chunks: tuple[Tensor, ...], group: Optional[ProcessGroup]) -> None:
    """Every rank's chunk of ``chunks`` filled with what that rank holds in it."""
    n, r = dist.get_world_size(group), dist.get_rank(group)
    works = [dist.isend(chunks[r], group=group, group_dst=(r + k) % n) for k in range(1, n)]
    works += [dist.irecv(chunks[(r - k) % n], group=group, group_src=(r - k) % n) for k in range(1, n)]
    for work in works:
        work.wait()


def _chunks(whole: Tensor, part: Tensor, group: Optional[ProcessGroup], what: str) -> tuple[tuple[Tensor, ...], int]:
    """``whole`` cut into one chunk per rank of ``group`` (each ``part``'s size), and this rank's index."""
    n = dist.get_world_size(group)
    if whole.numel() != n * part.numel():
        raise ValueError(f"{what}: {whole.numel()} elements are not {n} ranks x {part.numel()}")
    if not (whole.is_contiguous() and part.is_contiguous()):
        raise ValueError(f"{what}: contiguous tensors are needed")
    return whole.view(-1).chunk(n), dist.get_rank(group)


def reduce_scatter_into(out: Tensor, inp: Tensor, group: Optional[ProcessGroup]) -> None:
    """``out`` = the sum over ``group`` of this rank's ``1 / k`` of ``inp`` (``inp.numel() == k * out.numel()``).
    Over gloo ``inp`` is the scratch: its chunk of this rank ends up holding the sum (``out`` receives, no buffer of
    its own)."""
    if not direct(group):
        dist.reduce_scatter_single(out, inp, group=group)
        return
    chunks, r = _chunks(inp, out, group, "reduce_scatter_into")
    _sum_own_chunk(chunks, group, out.view(-1))
    out.view(-1).copy_(chunks[r])


def all_gather_into(out: Tensor, inp: Tensor, group: Optional[ProcessGroup]) -> None:
    """``out`` = every rank's ``inp`` in rank order (``out.numel() == k * inp.numel()``)."""
    if not direct(group):
        dist.all_gather_single(out, inp, group=group)
        return
    chunks, r = _chunks(out, inp, group, "all_gather_into")
    chunks[r].copy_(inp.view(-1))
    _share_own_chunk(chunks, group)
