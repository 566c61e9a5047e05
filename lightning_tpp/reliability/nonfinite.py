"""A NaN or infinite loss gets one decision on every rank (``on_nonfinite``): raise everywhere, skip the step
everywhere, or warn and go on — never some ranks stepping while others stop."""

from __future__ import annotations

from typing import Literal, Optional

import torch
import torch.distributed as dist
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch import Tensor

from lightning_tpp.core.mesh import MeshDims

Policy = Literal["raise", "skip", "warn"]


class NonFiniteLossError(FloatingPointError):
    """A NaN or infinite loss (raised on every rank at once)."""


def finite_everywhere(loss: Tensor, *, dims: MeshDims, rank: int, dp_group: Optional[dist.ProcessGroup],
                      policy: Policy, step: int, found: Optional[list[int]] = None) -> bool:
    """True to go on with the step. The ranks of one replica hold the same loss (tp computes it replicated, pp
    broadcasts it): only the other replicas are asked, and nobody when there are none (no synchronisation point
    added to the step). ``found`` (cleared, then filled) gets the dp replicas whose loss was not finite, for the
    incident record."""
    bad = torch.tensor([0.0 if bool(torch.isfinite(loss.detach()).all()) else 1.0], device=loss.device)
    coords = dims.coords(rank)
    replicas = [dims.rank_of(dp=d, pp=coords["pp"], tp=coords["tp"], cp=coords.get("cp", 0)) for d in range(dims.dp)]
    flags = [bad]
    if dims.dp > 1:
        flags = [torch.zeros_like(bad) for _ in replicas]
        dist.all_gather(flags, bad, group=dp_group)
    ranks = [r for r, f in zip(replicas, flags) if f.item()]
    if found is not None:
        found[:] = [d for d, f in enumerate(flags) if f.item()]
    if not ranks:
        return True
    message = f"non-finite loss at step {step} on ranks {ranks} (on_nonfinite={policy!r})"
    if policy == "raise":
        raise NonFiniteLossError(f"{message}; pass on_nonfinite='skip' to skip such steps, or lower the learning "
                                 f"rate / enable gradient clipping")
    rank_zero_warn(message + ("; skipping the step on every rank" if policy == "skip" else ""))
    return policy == "warn"
