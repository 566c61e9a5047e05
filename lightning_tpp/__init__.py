"""lightning_tpp: tensor x pipeline x data parallelism for unmodified LightningModules.

``import lightning_tpp`` also registers the strategy name, so ``Trainer(strategy="tensor_pipe")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_tpp.checkpoint import (
    AsyncCheckpointError,
    CheckpointMismatchError,
    OptimizerStateLayoutError,
    UnsafeCheckpointError,
    WeightsMismatchError,
    consolidate,
)
from lightning_tpp.core.mesh import MeshDims
from lightning_tpp.incidents import SpikeGuard, TooManyIncidentsError
from lightning_tpp.memory import MemoryReport, RankMemory, estimate_memory
from lightning_tpp.parallel_state import ParallelState
from lightning_tpp.pipeline import Schedule, register_schedule
from lightning_tpp.pipeline.timeline import PipelineTimeline
from lightning_tpp.strategy import TensorPipeStrategy
from lightning_tpp.tensor_parallel import (
    SequenceParallelError,
    TensorParallelConfigError,
    TensorParallelMismatchError,
    TPPlan,
)

if TensorPipeStrategy.strategy_name not in StrategyRegistry:
    TensorPipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "AsyncCheckpointError",
    "CheckpointMismatchError",
    "MemoryReport",
    "MeshDims",
    "OptimizerStateLayoutError",
    "ParallelState",
    "PipelineTimeline",
    "RankMemory",
    "Schedule",
    "SequenceParallelError",
    "SpikeGuard",
    "TPPlan",
    "TensorParallelConfigError",
    "TensorParallelMismatchError",
    "TensorPipeStrategy",
    "TooManyIncidentsError",
    "UnsafeCheckpointError",
    "WeightsMismatchError",
    "consolidate",
    "estimate_memory",
    "register_schedule",
]
__version__ = "0.1.0"
