"""Before the first step: ranks started with different arguments, seeds or models are refused, naming what differs."""

from __future__ import annotations

from typing import Any


class RankDisagreementError(ValueError):
    """Ranks started with different configurations, models or seeds."""


def model_structure(module: Any) -> str:
    """A digest of the parameter and buffer names, shapes and dtypes (not values: rank 0's are broadcast)."""
    import hashlib

    items = [f"{n}:{tuple(t.shape)}:{t.dtype}" for n, t in module.state_dict(keep_vars=True).items()]
    return hashlib.sha256("\n".join(items).encode()).hexdigest()[:16] + f" ({len(items)} tensors)"


def check_agreement(fingerprint: dict[str, Any]) -> None:
    """Every rank's configuration, model structure and seed, compared with rank 0's: the same error on every rank,
    naming the ranks and what differs."""
    import torch.distributed as dist

    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, fingerprint)
    differences = []
    for rank, other in enumerate(everyone):
        for field, value in other.items():
            if value != everyone[0][field]:
                differences.append(f"rank {rank} {field} {value!r} != rank 0's {everyone[0][field]!r}")
    if differences:
        raise RankDisagreementError("ranks disagree (different code, arguments or seed on some node): "
                                    + "; ".join(differences[:8]))
