"""lightning_tpp: tensor x pipeline x data parallelism for unmodified LightningModules.

``import lightning_tpp`` also registers the strategy name, so ``Trainer(strategy="tensor_pipe")`` works.
"""

from lightning.pytorch.strategies import StrategyRegistry

from lightning_tpp._checkpoint import OptimizerStateLayoutError
from lightning_tpp._dcp import consolidate
from lightning_tpp._mesh import MeshDims
from lightning_tpp._safe_load import CheckpointMismatchError, UnsafeCheckpointError
from lightning_tpp._tp_apply import TensorParallelMismatchError
from lightning_tpp._tp_plan import TensorParallelConfigError, TPPlan
from lightning_tpp.strategy import TensorPipeStrategy

if TensorPipeStrategy.strategy_name not in StrategyRegistry:
    TensorPipeStrategy.register_strategies(StrategyRegistry)

__all__ = [
    "CheckpointMismatchError",
    "MeshDims",
    "OptimizerStateLayoutError",
    "TPPlan",
    "TensorParallelConfigError",
    "TensorParallelMismatchError",
    "TensorPipeStrategy",
    "UnsafeCheckpointError",
    "consolidate",
]
__version__ = "0.1.0"
