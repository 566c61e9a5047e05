"""A tensor-parallel plan as data (no detection, no process groups): what :mod:`~lightning_tpp.tensor_parallel.plan`
finds, :mod:`~lightning_tpp.tensor_parallel.overrides` lays ``tp_plan=`` and Hugging Face plans over, and
:mod:`~lightning_tpp.tensor_parallel.apply` applies; and the attribute names a block's head counts and widths go by."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from lightning_tpp.core.sharding import ShardSpec

STYLES = ("colwise", "rowwise", "colwise_gather", "vocab", "mha", "replicate")

HEAD_NAMES = ("n_head", "n_heads", "num_heads", "num_attention_heads", "nhead", "heads", "nheads", "num_head",
              "n_attn_heads", "num_q_heads", "n_heads_q")
KV_NAMES = ("n_kv_head", "n_kv_heads", "num_key_value_heads", "num_kv_heads", "kv_heads", "n_query_groups",
            "num_kv_head", "n_kv", "nkv")
# query heads per K/V head (Hugging Face's repeat_kv count): local too when K/V heads are fewer than tp
GROUP_NAMES = ("num_key_value_groups", "n_rep", "num_kv_groups", "kv_groups", "q_per_kv", "num_queries_per_kv")
HEAD_DIM_NAMES = ("head_dim", "head_size", "d_head", "dim_head", "attention_head_size", "d_k", "kv_channels",
                  "key_value_proj_dim", "hd")
WIDTH_HINTS = ("embd", "embed", "dim", "hidden", "width", "d_model", "inner", "all_head", "split", "n_state")


class TensorParallelConfigError(ValueError):
    """A model/tp combination that cannot be tensor-parallelised as asked."""


@dataclass
class BlockInfo:
    """A group of layers parallelised together (one ``copy_to_tp`` scope, one numerical check)."""

    kind: str  # "attention" | "mlp" | "mha" | "custom"
    layers: list[str] = field(default_factory=list)  # FQNs of the parallel layers inside
    heads: int = 0
    kv_heads: int = 0
    head_dim: int = 0
    fused: dict[str, list[ShardSpec]] = field(default_factory=dict)  # layer FQN -> candidate layouts, first = default
    sizes: dict[str, int] = field(default_factory=dict)  # what tp must divide, e.g. {"num_heads": 16}
    rows: list[str] = field(default_factory=list)  # the row-parallel layers (default: the last one of ``layers``)
    # row layers whose all-reduced output only this rank's channels read (a Mamba mixer's x_proj): the gradient of
    # that output is a part on each rank, all-reduced too
    rejoin: list[str] = field(default_factory=list)
    cut: dict[str, ShardSpec] = field(default_factory=dict)  # other parameters cut with the channels (FQN -> layout):
    # a depthwise convolution, per-head A / D (:mod:`~lightning_tpp.tensor_parallel.mixer`)
    local_attrs: dict[str, int] = field(default_factory=dict)  # attributes (FQN) set to their per-rank value
    # an attention's parameters read per head (gpt-oss's sinks), cut with the heads (in ``cut``): FQN -> whether a
    # traced forward saw them meet the scores (False: found by size only, confirmed by the first-call check)
    per_head: dict[str, bool] = field(default_factory=dict)

    def row_layers(self) -> list[str]:
        return self.rows or self.layers[-1:]


@dataclass
class TPPlan:
    """``styles`` (module FQN -> style) is the plan; ``blocks`` says how layers group; ``notes`` what fell back."""

    styles: dict[str, str] = field(default_factory=dict)
    blocks: dict[str, BlockInfo] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    whole: dict[str, str] = field(default_factory=dict)  # module with linear layers left whole -> why
    # modules a Hugging Face plan marks "replicated_with_grad_allreduce" (Qwen3's per-head q_norm / k_norm): whole on
    # every rank, each rank's gradient a part (its heads), summed over tp inside a planned block
    grad_allreduce: list[str] = field(default_factory=list)
    # a layer inside a planned block whose output's last n columns every head reads (MLA's shared rope key:
    # DeepSeek's kv_a_proj_with_mqa, Hugging Face's "mla_kv_a_proj"): their gradient is summed over tp
    summed_tail: dict[str, int] = field(default_factory=dict)

    def to_apply(self) -> TPPlan:
        """A copy of what applying the plan reads (not the notes of how it was found), for another copy of the
        model that applies it by name."""
        return TPPlan(dict(self.styles), dict(self.blocks), grad_allreduce=list(self.grad_allreduce),
                      summed_tail=dict(self.summed_tail))

    def block_of(self, layer: str) -> Optional[str]:
        for name, block in self.blocks.items():
            if layer in block.layers or layer == name:
                return name
        return None
