"""The default process group of a job that ``torchrun --max-restarts`` restarted in the same world.

torchrun's agent keeps its store across restarts and hands it to the restarted workers (``MASTER_ADDR``/``PORT``,
``TORCHELASTIC_USE_AGENT_STORE``). ``init_process_group`` then reads the keys the dead attempt's workers wrote there:
with gloo (torch 2.13) the new workers wait in ``connectFullMesh`` for addresses that no longer answer (issue #44:
over three minutes, no error), or are refused by them at once. Under a prefix per restart attempt
(``TORCHELASTIC_RESTART_COUNT``) each attempt meets only its own workers: the group re-forms in 0.1 s. Outside
torchrun nothing changes (Lightning's own ``_init_dist_connection``).
"""

from __future__ import annotations

import os
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist

from lightning_tpp._compat import init_dist_connection


def init_processes(cluster_environment: Any, backend: str, timeout: Optional[timedelta], **kwargs: Any) -> None:
    """The default process group, under a store prefix of this restart attempt when torchrun started the process;
    its creation waits at most ``timeout`` and names what it waited for."""
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if dist.is_initialized():
        return
    if attempt is None:
        init_dist_connection(cluster_environment, backend, timeout=timeout, **kwargs)
        return
    rank, world = cluster_environment.global_rank(), cluster_environment.world_size()
    address, port = cluster_environment.main_address, int(cluster_environment.main_port)
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = address, str(port)
    wait = timeout if timeout is not None else timedelta(minutes=30)
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"  # the agent hosts the store, else rank 0
    try:
        store = dist.TCPStore(address, port, world_size=world, is_master=not agent and rank == 0, timeout=wait,
                              multi_tenant=not agent)
        dist.init_process_group(backend, store=dist.PrefixStore(f"lightning_tpp/attempt{attempt}/", store),
                                rank=rank, world_size=world, timeout=wait, **kwargs)
    except Exception as err:
        raise RuntimeError(
            f"rank {rank} of {world} could not form the process group of torchrun's restart attempt {attempt} "
            f"within {wait} (store at {address}:{port}, backend {backend}): waited for the other {world - 1} "
            f"workers of this attempt. Raise TensorPipeStrategy(timeout=...) if they start slowly: {err}") from err
