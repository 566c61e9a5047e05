"""Context parallelism (``cp=``): the blocks of an unmodified model run on ``1/cp`` of each sequence's positions,
every attention on the whole sequence's keys (``docs/context_parallel.md``)."""

from lightning_tpp.context_parallel.attention import ContextAttention, Traffic
from lightning_tpp.context_parallel.blocks import (
    ContextParallelError,
    ContextState,
    apply_context_parallel,
    mixing_layers,
)
from lightning_tpp.context_parallel.head import cut_heads, vocab_heads
from lightning_tpp.context_parallel.split import SeqLayout, gather_positions, local_positions

__all__ = ["ContextAttention", "ContextParallelError", "ContextState", "SeqLayout", "Traffic",
           "apply_context_parallel", "cut_heads", "gather_positions", "local_positions", "mixing_layers",
           "vocab_heads"]
