"""Mixtures of experts: find the routed layers of an unmodified model (``detect``) and cut their experts
(``tensor_parallel``: each expert's intermediate features over tp)."""

from lightning_tpp.experts.detect import ExpertBank, MoELayer, active_parameters, expert_bank, find_experts, top_k
from lightning_tpp.experts.tensor_parallel import ExpertParallelConfigError, shard_banks, verify_bank

__all__ = ["ExpertBank", "ExpertParallelConfigError", "MoELayer", "active_parameters", "expert_bank", "find_experts",
           "shard_banks", "top_k", "verify_bank"]
