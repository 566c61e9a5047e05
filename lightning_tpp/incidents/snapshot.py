"""The last good state, in host memory: each rank copies only what it holds (its tensor-parallel shards, its
pipeline stage, its FSDP2 part of each parameter and of the optimizer state), so a snapshot costs each rank the
bytes of its own parameters + buffers + optimizer state, and nothing is exchanged to take or restore it::

    rank (dp d, pp s, tp t)   device: p.to_local(), optimizer.state[p][k].to_local(), buffers
                                 |  copy (every ``every_n_steps`` steps, at a step boundary)
                                 v
                              host: the same tensors, plus LR schedulers, param_groups (lr...), RNG streams,
                                    the optimizer-step counter (``trainer.global_step``)

Restoring copies the host tensors back into the same device tensors, in place: DTensor placements, FSDP2's
sharded parameters and the optimizer's references stay what they were. The data position is not part of it: a
rollback keeps reading forward, which skips the batches between the snapshot and the spike.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_tpp.checkpoint.rng import rng_state, set_rng_state
from lightning_tpp.core.dp_shard import local


def _host(t: Tensor) -> Tensor:
    """A host copy of this rank's part of ``t`` (pinned where a device copies from it asynchronously)."""
    part = local(t.detach())
    out = torch.empty(part.shape, dtype=part.dtype, device="cpu", pin_memory=part.is_cuda)
    out.copy_(part, non_blocking=part.is_cuda)
    return out


def _copy_back(into: Tensor, saved: Tensor) -> None:
    local(into.detach()).copy_(saved, non_blocking=saved.is_pinned())


@dataclass
class HostSnapshot:
    """What one rank needs to go back to a step: see the module docstring."""

    step: int
    params: list[Tensor]
    buffers: list[Tensor]
    optimizers: list[dict[str, Any]]  # per optimizer: {"state": [{key: tensor or value} or None], "groups": [...]}
    schedulers: list[dict[str, Any]]
    rng: dict[str, Any]
    counters: dict[str, Any] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        """Host bytes of the tensors held."""
        tensors = self.params + self.buffers + [v for o in self.optimizers for s in o["state"] if s
                                                for v in s.values() if isinstance(v, Tensor)]
        return sum(t.numel() * t.element_size() for t in tensors)


def _params(module: nn.Module) -> list[nn.Parameter]:
    return list({id(p): p for p in module.parameters()}.values())  # a tied weight once


def take_snapshot(module: nn.Module, optimizers: Sequence[Optimizer], schedulers: Sequence[Any], *, step: int,
                  counters: dict[str, Any]) -> HostSnapshot:
    """Copy this rank's shards of ``module``, the optimizers' state, the schedulers and RNG streams to host."""
    params = [_host(p) for p in _params(module)]
    buffers = [_host(b) for b in module.buffers()]
    opts = []
    for opt in optimizers:
        state = []
        for group in opt.param_groups:
            for p in group["params"]:
                s = opt.state.get(p)
                state.append(None if not s else {k: _host(v) if isinstance(v, Tensor) else copy.deepcopy(v)
                                                 for k, v in s.items()})
        groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]
        opts.append({"state": state, "groups": groups})
    scheds = [copy.deepcopy(s.state_dict()) for s in schedulers]  # the device copies may still be in flight: the
    return HostSnapshot(step, params, buffers, opts, scheds, rng_state(), dict(counters))  # stream orders them


def restore_snapshot(snapshot: HostSnapshot, module: nn.Module, optimizers: Sequence[Optimizer],
                     schedulers: Sequence[Any]) -> None:
    """Put ``snapshot`` back in place (the counters are the caller's: they belong to the loop)."""
    params = _params(module)
    if len(params) != len(snapshot.params) or len(optimizers) != len(snapshot.optimizers):
        raise ValueError(f"the snapshot of step {snapshot.step} holds {len(snapshot.params)} parameters and "
                         f"{len(snapshot.optimizers)} optimizer(s), the model now {len(params)} and "
                         f"{len(optimizers)}: the model or its optimizers changed since; take a new snapshot")
    with torch.no_grad():
        for p, saved in zip(params, snapshot.params):
            _copy_back(p, saved)
        for b, saved in zip(module.buffers(), snapshot.buffers):
            _copy_back(b, saved)
        for opt, saved in zip(optimizers, snapshot.optimizers):
            _restore_optimizer(opt, saved)
    for sched, state in zip(schedulers, snapshot.schedulers):
        sched.load_state_dict(copy.deepcopy(state))
    set_rng_state(snapshot.rng)
    if any(p.is_cuda for p in params):
        torch.cuda.synchronize()


def _restore_optimizer(opt: Optimizer, saved: dict[str, Any]) -> None:
    flat = [p for g in opt.param_groups for p in g["params"]]
    for i, (p, s) in enumerate(zip(flat, saved["state"])):
        if s is None:  # no state yet at the snapshot (e.g. before the first step)
            opt.state.pop(p, None)
            continue
        current = opt.state.get(p)
        if not current:
            raise ValueError(f"{type(opt).__name__}'s state of parameter {i} (shape {tuple(p.shape)}, keys "
                             f"{sorted(s)} at the snapshot) is gone: the optimizer was replaced or its state "
                             f"cleared since; keep one optimizer for the whole fit")
        for k, v in s.items():
            if isinstance(v, Tensor) and isinstance(current.get(k), Tensor):
                _copy_back(current[k], v)
            else:
                current[k] = copy.deepcopy(v)
        for k in [k for k in current if k not in s]:
            del current[k]
    for group, values in zip(opt.param_groups, saved["groups"]):
        group.update(copy.deepcopy(values))
