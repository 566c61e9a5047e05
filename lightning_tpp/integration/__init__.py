"""Lightning integration: the strategy's checkpoint hooks (``checkpointing``) and a ModelSummary that counts whole
parameters (``summary``). Only this layer and ``strategy.py`` build on ``lightning.pytorch``'s extension points."""

from lightning_tpp.integration.checkpointing import CheckpointMixin
from lightning_tpp.integration.summary import ShardedModelSummary

__all__ = ["CheckpointMixin", "ShardedModelSummary"]
