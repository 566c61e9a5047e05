"""A layout as data: the degrees of each parallel axis and how a step runs, the thing ``layout="auto"`` chooses.

Degrees are kept together (:attr:`Layout.degrees`); expert parallelism (``ep``) is drawn from the dp and tp ranks
of a stage as Megatron-Core and torchtitan draw it, so it adds no devices::

    world = tp x pp x cp x dp   ep divides dp x tp (experts spread over ep of a stage's ranks; 1 without experts)

Context parallelism (``cp``) adds devices: each holds ``1/cp`` of every sequence's positions in the blocks, and the
cp ranks of a replica hold the same weights (FSDP2 shards them over ``dp x cp``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Sharding = Literal["full_shard", "shard_grad_op", "no_shard"]
SHARDINGS: tuple[Sharding, ...] = ("full_shard", "shard_grad_op", "no_shard")


@dataclass(frozen=True)
class Layout:
    """One way to run a step on ``tp * pp * cp * dp`` devices.

    ``microbatches`` is what the pipeline cuts the per-process batch into (1 without a pipeline); ``accumulate`` the
    optimizer's gradient accumulation (set by ``global_batch``); ``dp_sharding`` is FSDP2's mode over dp (only
    meaningful with dp > 1)."""

    tp: int
    pp: int
    dp: int
    microbatches: int = 1
    schedule: str = "1f1b"
    activation_checkpointing: bool = False
    dp_sharding: Sharding = "full_shard"
    accumulate: int = 1
    ep: int = 1  # expert parallelism: ranks of a stage's dp x tp that split the experts (1: none)
    cp: int = 1  # context parallelism: ranks that split each sequence's positions in the blocks (1: none)
    cp_mode: str = "allgather"  # the strategy's cp_mode= (what the cost model charges an attention under cp)

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.cp * self.dp

    @property
    def degrees(self) -> dict[str, int]:
        """The axes' sizes by name (``ep`` and ``cp`` included), as the mesh and the logs name them."""
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp, "ep": self.ep, "cp": self.cp}

    @property
    def replicas(self) -> int:
        """The ranks that hold the same weights: dp x cp (FSDP2 shards over them, gradients are averaged over them)."""
        return self.dp * self.cp

    @property
    def expert_replicas(self) -> int:
        """The ranks that hold the same experts under ep > 1 (FSDP2 shards them over these): dp x cp x tp / ep."""
        return self.dp * self.cp * self.tp // self.ep if self.ep > 1 else 1

    @property
    def sharded(self) -> bool:
        """Whether FSDP2 shards parameters, gradients and optimizer state over dp x cp."""
        return self.replicas > 1 and self.dp_sharding != "no_shard"

    def describe(self) -> str:
        """``tp=2 pp=2 dp=1 m=4 1f1b ac=off`` (``cp=2`` after pp, ``cp=2 a2a`` in that mode, ``ep=2`` after dp
        when used) as the ranked table prints it."""
        cp = [f"cp={self.cp}"] + (["a2a"] if self.cp_mode == "a2a" else []) if self.cp > 1 else []
        parts = [f"tp={self.tp}", f"pp={self.pp}"] + cp + \
            [f"dp={self.dp}"] + ([f"ep={self.ep}"] if self.ep > 1 else [])
        if self.pp > 1:
            parts += [f"m={self.microbatches}", self.schedule]
        if self.replicas > 1:
            parts.append(self.dp_sharding)
        parts.append(f"ac={'on' if self.activation_checkpointing else 'off'}")
        if self.accumulate > 1:
            parts.append(f"accum={self.accumulate}")
        return " ".join(parts)
