"""The lowest layer: the device mesh, shard layouts, tensor-parallel collectives, gradient reductions, parameter
names and class swaps. Everything else builds on these; they import nothing else of lightning_tpp."""

from lightning_tpp.core.comm import TPGroup, TPScope, gather_with_spec
from lightning_tpp.core.mesh import AXES, MeshDims, build_mesh, resolve_dims
from lightning_tpp.core.params import ParamNames, ShardIndex, ShardInfo, params_by_index
from lightning_tpp.core.sharding import ShardSpec, shard_tensor, unshard_tensor
from lightning_tpp.core.swap import parallel_class, swap_class

__all__ = ["AXES", "MeshDims", "ParamNames", "ShardIndex", "ShardInfo", "ShardSpec", "TPGroup", "TPScope", "build_mesh",
           "gather_with_spec", "parallel_class", "params_by_index", "resolve_dims", "shard_tensor", "swap_class",
           "unshard_tensor"]
