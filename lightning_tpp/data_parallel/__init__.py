"""Data parallelism, one peer of ``tensor_parallel/``, ``pipeline/`` and ``experts/``: parameters, gradients and
optimizer state sharded over the dp ranks with FSDP2 (``fsdp``), the vocabulary matrices cut by rows over dp and
computed where they lie (``rows``), where the forward reads each parameter, so that a unit encloses its reads
(``reads``), and ``Trainer(sync_batchnorm=True)`` over the dp group only (``sync_batchnorm``).

The parameter utilities for a tensor that may be sharded over dp (``local``, ``gather_dp``, ``shard_dp_like``,
``is_dp_sharded``) stay in ``core.dp_shard``: the lower layers and the peers read them."""

from lightning_tpp.data_parallel.fsdp import (
    SHARDINGS,
    DPShards,
    DPSharding,
    DPUnitsMismatchError,
    ExpertShards,
    called_where_read,
    fsdp_units,
    normalize_sharding,
    shard_over_dp,
    sharded_numel,
)
from lightning_tpp.data_parallel.reads import ShardedReadError, find_reads, guard_reads
from lightning_tpp.data_parallel.rows import RowsOverDP, candidates, shard_rows_over_dp
from lightning_tpp.data_parallel.sync_batchnorm import SyncBatchNormDeviceError, sync_batchnorm_over_dp

__all__ = ["SHARDINGS", "DPShards", "DPSharding", "DPUnitsMismatchError", "ExpertShards", "RowsOverDP", "ShardedReadError",
           "SyncBatchNormDeviceError", "called_where_read", "candidates", "find_reads", "fsdp_units", "guard_reads",
           "normalize_sharding", "shard_over_dp", "shard_rows_over_dp", "sharded_numel", "sync_batchnorm_over_dp"]
