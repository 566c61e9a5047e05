"""Layout-free checkpoints: state under the single-device names (``state``), sharded folders with DCP (``dcp``),
files that survive a killed save (``files``), saves written in the background (``async_save``), loading that runs no
planted code (``safe_load``), RNG states (``rng``), weights from files into any layout (``weights``)."""

from lightning_tpp.checkpoint.async_save import AsyncCheckpointError
from lightning_tpp.checkpoint.dcp import consolidate, is_sharded_checkpoint
from lightning_tpp.checkpoint.files import atomic_save, publish
from lightning_tpp.checkpoint.safe_load import CheckpointMismatchError, SafeFileSystemReader, UnsafeCheckpointError
from lightning_tpp.checkpoint.state import OptimizerStateLayoutError
from lightning_tpp.checkpoint.weights import LoadedWeights, WeightsMismatchError, load_weights

__all__ = ["AsyncCheckpointError", "CheckpointMismatchError", "LoadedWeights", "OptimizerStateLayoutError", "SafeFileSystemReader",
           "UnsafeCheckpointError", "WeightsMismatchError", "atomic_save", "consolidate", "is_sharded_checkpoint",
           "load_weights", "publish"]
