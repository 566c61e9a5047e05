"""Layout-free checkpoints: state under the single-device names (``state``), sharded folders with DCP (``dcp``),
files that survive a killed save (``files``), loading that runs no planted code (``safe_load``), RNG states
(``rng``)."""

from lightning_tpp.checkpoint.dcp import consolidate, is_sharded_checkpoint
from lightning_tpp.checkpoint.files import atomic_save, publish
from lightning_tpp.checkpoint.safe_load import CheckpointMismatchError, SafeFileSystemReader, UnsafeCheckpointError
from lightning_tpp.checkpoint.state import OptimizerStateLayoutError

__all__ = ["CheckpointMismatchError", "OptimizerStateLayoutError", "SafeFileSystemReader", "UnsafeCheckpointError",
           "atomic_save", "consolidate", "is_sharded_checkpoint", "publish"]
