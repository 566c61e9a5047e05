"""Checkpoint state under the single-device names and shapes: gather shards to save, shard full tensors to load.

A checkpoint written by a tensor-parallel run is an ordinary Lightning checkpoint: ``MyModule.load_from_checkpoint``
loads it in one process, and a run at another ``tp`` (or a single-device checkpoint) loads into any layout.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_tpp.checkpoint.safe_load import CheckpointMismatchError
from lightning_tpp.core.comm import TPGroup, gather_with_spec
from lightning_tpp.core.dp_shard import gather_dp, is_dp_sharded, shard_dp_like
from lightning_tpp.core.params import ParamNames, ShardIndex, ShardInfo, params_by_index
from lightning_tpp.core.sharding import shard_tensor


def _sharded_params(module: nn.Module, shards: ShardIndex) -> dict[str, ShardInfo]:
    return {n: info for n, p in module.named_parameters(remove_duplicate=False) if (info := shards.get(p)) is not None}


def full_state_dict(module: nn.Module, group: TPGroup, shards: ShardIndex) -> dict[str, Tensor]:
    """``module.state_dict()`` with every shard replaced by the whole tensor (collective over the tp group)."""
    state = {k: gather_dp(v) if isinstance(v, Tensor) else v for k, v in module.state_dict().items()}
    for name, info in _sharded_params(module, shards).items():
        if name in state:
            state[name] = gather_with_spec(state[name], info.spec, group)
    return state


def load_full_state_dict(module: nn.Module, state: Mapping[str, Any], group: TPGroup, shards: ShardIndex,
                         strict: bool = True) -> None:
    """Load single-device tensors into a (possibly sharded) module; mismatches name every offending key."""
    sharded = _sharded_params(module, shards)
    own = module.state_dict()
    local: dict[str, Any] = {}
    wrong_shape = []
    for name, value in state.items():
        info = sharded.get(name)
        if info is not None and isinstance(value, Tensor):
            if tuple(value.shape) != info.full_shape:
                wrong_shape.append(f"{name}: checkpoint {tuple(value.shape)} vs model {info.full_shape}")
                continue
            value = shard_tensor(value, info.spec, group.rank, group.size)
        elif name in own and isinstance(value, Tensor) and value.shape != own[name].shape:
            wrong_shape.append(f"{name}: checkpoint {tuple(value.shape)} vs model {tuple(own[name].shape)}")
            continue
        if name in own and isinstance(value, Tensor) and is_dp_sharded(own[name]):
            value = shard_dp_like(value, own[name])
        local[name] = value
    missing = sorted(set(own) - set(state))
    unexpected = sorted(set(state) - set(own))
    if wrong_shape or (strict and (missing or unexpected)):
        raise CheckpointMismatchError(
            "checkpoint does not match the model: "
            + "; ".join(f"{label}: {names}" for label, names in
                        (("missing", missing), ("unexpected", unexpected), ("shape mismatch", wrong_shape)) if names)
            + ". Load with strict_loading=False to skip missing/unexpected keys")
    module.load_state_dict(local, strict=False)


class OptimizerStateLayoutError(ValueError):
    """An optimizer keeps state that is not shaped like its (sharded) parameter, so a shard's state is not a slice of
    one device's state."""


def check_state_layout(optimizer: Optimizer, local: Mapping[int, str], shards: ShardIndex, tp: int) -> None:
    """Refuse optimizer state (``torch.optim.Adafactor``'s factored ``row_var``/``col_var``, say) of a tensor-parallel
    shard that is neither a scalar nor shaped like the shard: it holds statistics over the shard alone, which neither
    equal one device's nor can be saved layout-free."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            info = shards.get(p)
            if info is None:
                continue
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, Tensor) and value.dim() > 0 and value.shape != p.shape:
                    name = local.get(id(p), "?")
                    raise OptimizerStateLayoutError(
                        f"{type(optimizer).__name__} keeps state {key!r} of shape {tuple(value.shape)} for {name} "
                        f"(whole {info.full_shape}, this shard {tuple(p.shape)}): statistics over a tp={tp} shard "
                        f"are not one device's, so neither the update nor a checkpoint would be right. Use an "
                        f"element-wise optimizer (AdamW, SGD, ...), tp=1, or keep the parameter whole with "
                        f"tp_plan={{{name.rpartition('.')[0]!r}: 'replicate'}}")


def named_optimizer_state(optimizer: Optimizer, module: nn.Module, names: ParamNames, group: TPGroup,
                          shards: ShardIndex) -> dict[str, Any]:
    """This rank's optimizer state keyed by canonical parameter name, sharded state tensors gathered whole."""
    local = names.local(module)
    check_state_layout(optimizer, local, shards, group.size)
    sd = optimizer.state_dict()
    params = params_by_index(optimizer)
    state = {}
    for idx, per_param in sd["state"].items():
        p = params[idx]
        spec = shards.spec(p)
        per_param = {k: gather_dp(v) if isinstance(v, Tensor) else v for k, v in per_param.items()}
        state[local[id(p)]] = {k: gather_with_spec(v, spec, group) if spec is not None and isinstance(v, Tensor)
                               and v.shape == p.shape else v for k, v in per_param.items()}
    groups = [{**{k: v for k, v in g.items() if k != "params"}, "params": [local[id(params[i])] for i in g["params"]]}
              for g in sd["param_groups"]]
    return {"state": state, "param_groups": groups}


def merge_named(stages: list[dict[str, Any]]) -> dict[str, Any]:
    """One name-keyed optimizer state from every pipeline stage's (group ``i`` of each stage is group ``i``)."""
    merged: dict[str, Any] = {"state": {}, "param_groups": []}
    for st in stages:
        merged["state"].update(st["state"])
        for i, g in enumerate(st["param_groups"]):
            if i == len(merged["param_groups"]):
                merged["param_groups"].append({**g, "params": []})
            merged["param_groups"][i]["params"] += [n for n in g["params"]
                                                    if n not in merged["param_groups"][i]["params"]]
    return merged


def indexed_optimizer_state(named: dict[str, Any], names: ParamNames) -> dict[str, Any]:
    """The ordinary ``optimizer.state_dict()`` of the single-device model (indices in ``parameters()`` order)."""
    index = {n: i for i, n in enumerate(names.order)}
    return {"state": {index[n]: v for n, v in sorted(named["state"].items(), key=lambda kv: index[kv[0]])},
            "param_groups": [{**g, "params": sorted(index[n] for n in g["params"])} for g in named["param_groups"]]}


def load_indexed_optimizer_state(optimizer: Optimizer, module: nn.Module, state: Mapping[str, Any],
                                 names: ParamNames, group: TPGroup, shards: ShardIndex) -> None:
    """Load an ordinary (single-device, index-keyed) optimizer state into this rank's shards and stage."""
    params = params_by_index(optimizer)
    local = names.local(module)
    saved_groups = state["param_groups"]
    if len(saved_groups) != len(optimizer.param_groups):
        raise CheckpointMismatchError(f"the checkpoint's optimizer has {len(saved_groups)} parameter groups, this "
                                      f"one {len(optimizer.param_groups)}")
    by_index = {int(i): v for i, v in state["state"].items()}
    position = {n: i for i, n in enumerate(names.order)}
    local_state, missing = {}, []
    for i, p in enumerate(params):
        name = local[id(p)]
        saved = by_index.get(position.get(name, -1))
        if saved is None:
            if by_index and name not in position:
                missing.append(name)
            continue
        local_state[i] = {k: shard_dp_like(v, p) if is_dp_sharded(p) and isinstance(v, Tensor) and v.dim() > 0 else v
                          for k, v in ((k, shard_state(v, shards.get(p), name, k, group)) for k, v in saved.items())}
    if missing:
        raise CheckpointMismatchError(f"optimizer state for parameters the checkpoint does not know: {missing}")
    groups, start = [], 0
    for saved, current in zip(saved_groups, optimizer.param_groups):
        n = len(current["params"])
        groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": list(range(start, start + n))})
        start += n
    optimizer.load_state_dict({"state": local_state, "param_groups": groups})


def shard_state(value: Any, info: Optional[ShardInfo], name: str, key: str, group: TPGroup) -> Any:
    """One device's optimizer state ``value`` of a parameter cut as ``info`` says, cut like it; scalars and state of
    whole parameters as they are."""
    if info is None or not isinstance(value, Tensor) or not cut_like_param(info, name, key, tuple(value.shape),
                                                                           group.size):
        return value
    return shard_tensor(value, info.spec, group.rank, group.size)


def cut_like_param(info: ShardInfo, name: str, key: str, shape: tuple[int, ...], tp: int) -> bool:
    """Whether saved optimizer state of this shape is cut like the sharded parameter (False for scalars); state of
    another shape cannot be split (see :func:`check_state_layout`)."""
    if not shape:
        return False
    if shape != info.full_shape:
        raise OptimizerStateLayoutError(
            f"the checkpoint's optimizer state {key!r} of {name} has shape {shape}, not the parameter's "
            f"{info.full_shape}: it cannot be split over tp={tp} (an optimizer such as Adafactor); resume "
            f"with tp=1 or keep the parameter whole with tp_plan={{{name.rpartition('.')[0]!r}: 'replicate'}}")
    return True


