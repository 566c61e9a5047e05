"""Checkpoint state under the single-device names and shapes: gather shards to save, shard full tensors to load.

A checkpoint written by a tensor-parallel run is an ordinary Lightning checkpoint: ``MyModule.load_from_checkpoint``
loads it in one process, and a run at another ``tp`` (or a single-device checkpoint) loads into any layout.
"""

from __future__ import annotations

from typing import Any, Mapping

from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_tpp._comm import TPGroup
from lightning_tpp._sharding import shard_tensor
from lightning_tpp._tp_apply import gather_with_spec


class CheckpointMismatchError(KeyError):
    """A checkpoint's names or shapes do not fit the model."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0])


def _sharded_params(module: nn.Module) -> dict[str, nn.Parameter]:
    return {n: p for n, p in module.named_parameters(remove_duplicate=False) if hasattr(p, "_tpp_spec")}


def full_state_dict(module: nn.Module, group: TPGroup) -> dict[str, Tensor]:
    """``module.state_dict()`` with every shard replaced by the whole tensor (collective over the tp group)."""
    state = module.state_dict()
    for name, p in _sharded_params(module).items():
        if name in state:
            state[name] = gather_with_spec(p.detach(), p._tpp_spec, group)  # type: ignore[attr-defined]
    return state


def load_full_state_dict(module: nn.Module, state: Mapping[str, Any], group: TPGroup, strict: bool = True) -> None:
    """Load single-device tensors into a (possibly sharded) module; mismatches name every offending key."""
    sharded = _sharded_params(module)
    own = module.state_dict()
    local: dict[str, Any] = {}
    wrong_shape = []
    for name, value in state.items():
        p = sharded.get(name)
        if p is not None and isinstance(value, Tensor):
            if tuple(value.shape) != p._tpp_full_shape:  # type: ignore[attr-defined]
                wrong_shape.append(f"{name}: checkpoint {tuple(value.shape)} vs model {p._tpp_full_shape}")  # type: ignore[attr-defined]
                continue
            value = shard_tensor(value, p._tpp_spec, group.rank, group.size)  # type: ignore[attr-defined]
        elif name in own and isinstance(value, Tensor) and value.shape != own[name].shape:
            wrong_shape.append(f"{name}: checkpoint {tuple(value.shape)} vs model {tuple(own[name].shape)}")
            continue
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


def _params_by_index(optimizer: Optimizer) -> list[nn.Parameter]:
    return [p for g in optimizer.param_groups for p in g["params"]]


def full_optimizer_state(optimizer: Optimizer, group: TPGroup) -> dict[str, Any]:
    """``optimizer.state_dict()`` with per-parameter state tensors of sharded parameters gathered."""
    state = optimizer.state_dict()
    params = _params_by_index(optimizer)
    for idx, per_param in state["state"].items():
        p = params[idx]
        if not hasattr(p, "_tpp_spec"):
            continue
        for key, value in list(per_param.items()):
            if isinstance(value, Tensor) and value.shape == p.shape:
                per_param[key] = gather_with_spec(value, p._tpp_spec, group)  # type: ignore[attr-defined]
    return state


def load_full_optimizer_state(optimizer: Optimizer, state: Mapping[str, Any], group: TPGroup) -> None:
    """Inverse of :func:`full_optimizer_state`: shard the full state tensors, then ``load_state_dict``."""
    params = _params_by_index(optimizer)
    local_state = {}
    for idx, per_param in state["state"].items():
        p = params[int(idx)]
        local: dict[str, Any] = dict(per_param)
        if hasattr(p, "_tpp_spec"):
            for key, value in per_param.items():
                if isinstance(value, Tensor) and tuple(value.shape) == p._tpp_full_shape:  # type: ignore[attr-defined]
                    local[key] = shard_tensor(value, p._tpp_spec, group.rank, group.size)  # type: ignore[attr-defined]
        local_state[idx] = local
    optimizer.load_state_dict({"state": local_state, "param_groups": state["param_groups"]})
