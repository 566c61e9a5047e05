"""The collectives Lightning calls on its strategy (``self.log(sync_dist=True)``, ``all_gather``, early stopping,
checkpoint paths), over the right axis: the tp and pp ranks of one replica hold the same values, so "every process"
means "every data-parallel replica"."""

from __future__ import annotations

from typing import Any, Optional, Union

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed import ProcessGroup, ReduceOp
from typing_extensions import override

from lightning_tpp._compat import all_gather_ddp_if_available, distributed_is_initialized, sync_ddp_if_available
from lightning_tpp.parallel_state import ProcessGroups


def metrics_over(module: nn.Module, group: Optional[ProcessGroup]) -> None:
    """torchmetrics sync over the world by default: the metrics of ``module`` that name no group sync over ``group``
    (the dp replicas; tp and pp ranks hold the same samples)."""
    try:
        from torchmetrics import Metric
    except ImportError:  # pragma: no cover - torchmetrics is a dependency
        return
    for m in module.modules():
        if isinstance(m, Metric) and m.process_group is None:
            m.process_group = group


class ReplicaCollectives:
    """Strategy mixin: collectives over the dp replicas (``_groups.dp``)."""

    _groups: ProcessGroups
    root_device: torch.device
    world_size: int

    @override
    def barrier(self, name: Optional[str] = None) -> None:
        if not distributed_is_initialized():
            return
        if dist.get_backend() == "nccl":
            dist.barrier(device_ids=[self.root_device.index])
        else:
            dist.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not distributed_is_initialized():
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src)
        return box[0]

    def _replica_group(self, group: Optional[ProcessGroup]) -> Optional[ProcessGroup]:
        """The world (Lightning's default) means "every replica": tp/pp ranks of one replica hold the same values,
        they are not more samples. An explicitly chosen sub-group is kept."""
        return self._groups.dp if group is None or group is dist.group.WORLD else group

    @override
    def reduce(self, tensor: Union[Tensor, Any], group: Optional[Any] = None,
               reduce_op: Optional[Union[ReduceOp, str]] = "mean") -> Union[Tensor, Any]:
        """Reduce over data-parallel replicas (``self.log(sync_dist=True)`` lands here)."""
        if isinstance(tensor, Tensor):
            return sync_ddp_if_available(tensor, self._replica_group(group), reduce_op)
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Optional[Any] = None, sync_grads: bool = False) -> Tensor:
        """Gather from every data-parallel replica: one entry per replica, not per process."""
        return all_gather_ddp_if_available(tensor, group=self._replica_group(group), sync_grads=sync_grads)

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        if not distributed_is_initialized():
            return decision
        t = torch.tensor(int(decision), device=self.root_device)
        dist.all_reduce(t, op=ReduceOp.SUM)
        return bool(t == self.world_size) if all else bool(t)
