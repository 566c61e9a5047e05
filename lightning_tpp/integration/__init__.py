"""Lightning integration through its extension points, one strategy mixin per concern: the mesh and groups
(``topology``), Lightning's collectives over data-parallel replicas (``collectives``), step hooks under a pipeline
(``pipeline_steps``), global-norm clipping in the Trainer's precision plugin (``precision``), checkpoint hooks
(``checkpointing``), whole-parameter counts in the user's ModelSummary (``summary``) and the spawn/fork launcher
(``launchers``). Only this layer and ``strategy.py`` build on ``lightning.pytorch``'s strategy API; private
Lightning names come through ``lightning_tpp._compat``."""

from lightning_tpp.integration.checkpointing import CheckpointMixin
from lightning_tpp.integration.collectives import ReplicaCollectives
from lightning_tpp.integration.pipeline_steps import PipelineSteps
from lightning_tpp.integration.precision import GlobalNormClippingStrategy
from lightning_tpp.integration.summary import ShardedModelSummary
from lightning_tpp.integration.topology import MeshTopology

__all__ = ["CheckpointMixin", "GlobalNormClippingStrategy", "MeshTopology", "PipelineSteps", "ReplicaCollectives",
           "ShardedModelSummary"]
