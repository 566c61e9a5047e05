"""Lightning integration through its extension points: the strategy's checkpoint hooks (``checkpointing``), global-norm
clipping in the Trainer's precision plugin (``precision``), whole-parameter counts in the user's ModelSummary
(``summary``) and the spawn/fork launcher (``launchers``). Only this layer and ``strategy.py`` build on
``lightning.pytorch``; private Lightning names come through ``lightning_tpp._compat``."""

from lightning_tpp.integration.checkpointing import CheckpointMixin
from lightning_tpp.integration.summary import ShardedModelSummary

__all__ = ["CheckpointMixin", "ShardedModelSummary"]
