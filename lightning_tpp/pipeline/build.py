"""Turn a whole model into this rank's pipeline stage(s) and build the engine (the only part of the pipeline that
creates process groups).

Two steps, with tensor parallelism applied in between (so the dispatchers sit outermost)::

    prepare_stages:  partition -> units (blocks, embeddings, norms, heads) with meta twins -> other stages' units
                     replaced (parameters freed)
    finish_stages:   dispatchers on this rank's units -> tied-weight groups -> PipelineEngine
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import ProcessGroup

from lightning.pytorch.utilities.rank_zero import rank_zero_info

from lightning_tpp._compat import tree_flatten
from lightning_tpp.core.mesh import MeshDims, reused
from lightning_tpp.pipeline.engine import PipelineEngine
from lightning_tpp.pipeline.partition import (
    BlockSequence,
    Partition,
    PipelinePartitionError,
    ancestor_parameters,
    forward_modules,
    minor_stack,
    plan_partition,
)
from lightning_tpp.pipeline.captured import hook_twins
from lightning_tpp.pipeline.stage import StageRuntime, Unit, _set_module, mark_dispatch, meta_twin, remote_module


@dataclass
class PreparedStages:
    partition: Partition
    runtime: StageRuntime
    local_stages: list[int]
    twins: dict[str, nn.Module]
    ancestor_params: tuple[str, ...]  # parameters owned by ancestors of the blocks (first stage)
    total_params: int
    trainable_params: int
    # weights that several stages hold, in the whole model's order: the same on every rank, so that their gradient
    # all-reduces pair up. By name, not by object: tensor parallelism replaces the parameters after this is computed
    tied: list[TiedWeight] = field(default_factory=list)

    @property
    def tied_stages(self) -> list[tuple[int, ...]]:
        """The stage sets that share a weight (e.g. embedding and tied LM head), in the same order on every rank."""
        return sorted({w.stages for w in self.tied})

    def remote_names(self) -> frozenset[str]:
        """The units other pipeline ranks hold (stand-ins here)."""
        return frozenset(u.name for u in self.runtime.units if u.stage not in self.local_stages)

    def remote_twins(self) -> dict[str, nn.Module]:
        """Meta twins of the units other pipeline ranks hold, by name; inside an embedding, norm or head unit also its
        submodules (a head unit that is a prediction module holding its decoder: BERT's ``cls.predictions``), so that
        tensor parallelism pairs an embedding with its head across stages. Not inside blocks."""
        out: dict[str, nn.Module] = {}
        for u in self.runtime.units:
            if u.stage not in self.local_stages:
                twin = self.twins[u.name]
                out.update(twin.named_modules(prefix=u.name) if u.kind != "block" else [(u.name, twin)])
        return out

    def tied_params(self, module: nn.Module, *, stages: Optional[tuple[int, ...]] = None,
                    secondary: Optional[bool] = None) -> list[nn.Parameter]:
        """This rank's copies of the tied weights (of one stage set, or only those counted on another rank)."""
        params = dict(module.named_parameters(remove_duplicate=False))
        local = set(self.local_stages)
        out = []
        for w in self.tied:
            wanted = stages is None or w.stages == stages
            if wanted and (secondary is None or (min(w.stages) not in local) == secondary):
                out += [params[n] for n in w.names if n in params][:1]
        return out


@dataclass(frozen=True)
class TiedWeight:
    names: tuple[str, ...]  # every alias in the whole model
    stages: tuple[int, ...]  # the stages whose modules use it


def _units(module: nn.Module, partition: Partition) -> list[Unit]:
    """Every module with a dispatcher, with its stage."""
    modules = dict(module.named_modules())
    owners = partition.owners()
    units = [Unit(n, owners[n], "pre") for n in partition.pre]
    for i, members in enumerate(partition.members):
        units += [Unit(n, partition.stage_of_block(i)) for m in members for n in forward_modules(modules[m], m)]
    units += [Unit(n, owners[n], "middle") for n, _ in partition.middle]
    units += [Unit(n, owners[n], "post") for n in partition.post]
    return units


def measure_block_costs(module: nn.Module, members: Sequence[Sequence[str]], example: Any, repeats: int = 3
                        ) -> list[float]:
    """Forward + backward seconds of each block (its member modules) on ``example`` (the module's
    ``example_input_array``): its fastest of ``repeats`` runs, so that another process taking the core for a moment
    does not make a cheap block look expensive."""
    modules = dict(module.named_modules())
    stamps: dict[int, list[float]] = {i: [] for i in range(len(members))}
    starts: dict[str, float] = {}
    handles = []
    for i, block in enumerate(members):
        for n in (n for m in block for n in forward_modules(modules[m], m)):
            handles.append(modules[n].register_forward_pre_hook(
                lambda m, a, n=n: starts.__setitem__(n, time.perf_counter())))
            handles.append(modules[n].register_forward_hook(
                lambda m, a, o, n=n, i=i: stamps[i].append(time.perf_counter() - starts[n])))
    per_repeat: list[list[float]] = []
    try:
        for _ in range(repeats):
            for v in stamps.values():
                v.clear()
            out = module(*example) if isinstance(example, (tuple, list)) else module(example)
            loss = sum(t.float().sum() for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)
                       and t.requires_grad)
            if isinstance(loss, torch.Tensor):
                loss.backward()
            module.zero_grad(set_to_none=True)
            per_repeat.append([sum(v) for v in stamps.values()])
    finally:
        for h in handles:
            h.remove()
    # the fastest repeat of each block: what it costs when nothing else runs (a preempted repeat only adds time)
    return [3.0 * min(r[i] for r in per_repeat) for i in range(len(members))]  # backward ~ 2x forward


def prepare_stages(module: nn.Module, sequence: BlockSequence, *, dims: MeshDims, pp_rank: int, virtual: int,
                   device: torch.device, balance: Union[str, Sequence[int]], split_points: Optional[Sequence[str]],
                   found: bool = True, weight: Optional[Callable[[nn.Module], float]] = None) -> PreparedStages:
    """This rank's stages of ``module`` cut along ``sequence`` (its block sequence, :func:`block_sequence`; ``found``:
    by the partitioner, not named with ``blocks=``), the other stages' units stood in for; ``weight`` a module's cost
    when stages are balanced by it (default: its parameters)."""
    stages = dims.pp * virtual
    containers = sequence.containers
    costs = None
    if balance == "time":
        example = getattr(module, "example_input_array", None)
        if example is None:
            raise PipelinePartitionError("balance='time' measures each block on the LightningModule's "
                                         "example_input_array; set self.example_input_array, or use "
                                         "balance='params'")
        if any(p.is_meta for p in module.parameters()):
            raise PipelinePartitionError("balance='time' measures each block by running it, but the model is on the "
                                         "meta device (built in configure_model or with empty_init=True); use "
                                         "balance='params' or blocks per stage, e.g. balance=[3, 5]")
        costs = torch.tensor(measure_block_costs(module, sequence.members, example), device=device)
        dist.broadcast(costs, src=0)  # every rank must cut at the same places
        costs = costs.tolist()
    if found and (note := minor_stack(module, containers)) is not None:
        rank_zero_info(note)
    partition = plan_partition(module, stages, sequence=sequence,
                               balance_by=balance if not isinstance(balance, str) else "params",
                               split_points=split_points, block_costs=costs,
                               **({"weight": weight} if weight is not None else {}))
    local = [c * dims.pp + pp_rank for c in range(virtual)]
    owners = partition.owners()
    modules = dict(module.named_modules())
    # weights used by modules of several stages (tied embedding/head): every owner keeps a copy, grads are summed
    holders: dict[int, tuple[nn.Parameter, set[int]]] = {}
    for name, stage in owners.items():
        for p in modules[name].parameters():
            holders.setdefault(id(p), (p, set()))[1].add(stage)
    aliases: dict[int, list[str]] = {}
    for n, p in module.named_parameters(remove_duplicate=False):
        if len(holders.get(id(p), (None, ()))[1]) > 1:
            aliases.setdefault(id(p), []).append(n)
    tied = [TiedWeight(tuple(names), tuple(sorted(holders[i][1]))) for i, names in aliases.items()]
    params = list(module.parameters())
    runtime = StageRuntime(device)
    runtime.units = _units(module, partition)
    prepared = PreparedStages(partition, runtime, local, {}, ancestor_parameters(module, containers),
                              sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad), tied)
    if 0 not in local:  # other stages compute with zeros in their place; not saved, no gradient
        for fqn in prepared.ancestor_params:
            owner_name, _, attr = fqn.rpartition(".")
            owner = module.get_submodule(owner_name)
            held = getattr(owner, attr)
            zeros = torch.zeros(held.shape, dtype=held.dtype, device=device)  # real also when the model is on meta
            delattr(owner, attr)  # the parameter, replaced by a buffer of zeros
            owner.register_buffer(attr, zeros, persistent=False)
    for unit in runtime.units:
        prepared.twins[unit.name] = meta_twin(modules[unit.name])
    hook_twins(module, prepared.twins)  # what the units' layers record (router logits) shows on their twins
    for i, unit in enumerate(runtime.units):
        if unit.stage not in local:
            _set_module(module, unit.name, remote_module(prepared.twins[unit.name], runtime, unit=i))
    return prepared


def finish_stages(module: nn.Module, prepared: PreparedStages, *, dims: MeshDims, coords: dict[str, int],
                  virtual: int, schedule: str, microbatches: int, pp_group: Optional[ProcessGroup]) -> PipelineEngine:
    partition, runtime, local = prepared.partition, prepared.runtime, prepared.local_stages
    modules = dict(module.named_modules())
    for i, unit in enumerate(runtime.units):
        if unit.stage in local:
            mark_dispatch(modules[unit.name], runtime, unit=i, twin=prepared.twins[unit.name])
    chunk_params: list[list[nn.Parameter]] = []
    for g in local:
        seen: dict[int, nn.Parameter] = {}
        for unit in runtime.units:
            if unit.stage == g:
                for p in modules[unit.name].parameters():
                    if p.requires_grad:
                        seen.setdefault(id(p), p)
        if g == 0:
            for fqn in prepared.ancestor_params:
                p = module.get_parameter(fqn)
                if p.requires_grad:
                    seen.setdefault(id(p), p)
        chunk_params.append(list(seen.values()))
    tied = _tied_groups(module, prepared, dims, coords)
    stage_rank = lambda pp_rank: dims.rank_of(dp=coords["dp"], pp=pp_rank, tp=coords["tp"],  # noqa: E731
                                              cp=coords.get("cp", 0))
    return PipelineEngine(module, partition, runtime, rank=coords["pp"], pp=dims.pp, virtual=virtual,
                          schedule=schedule, microbatches=microbatches, group=pp_group, stage_rank=stage_rank,
                          chunk_params=chunk_params, tied=tied, ancestor_params=prepared.ancestor_params)


def _tied_groups(module: nn.Module, prepared: PreparedStages, dims: MeshDims, coords: dict[str, int]
                 ) -> list[tuple[nn.Parameter, Any]]:
    """A process group per tied stage set and (dp, cp, tp) coordinate; every rank creates every group (collective)."""
    groups: dict[tuple[int, ...], Any] = {}
    for stages in prepared.tied_stages:
        for dp in range(dims.dp):
            for cp in range(dims.cp):
                for tp in range(dims.tp):
                    ranks = sorted({dims.rank_of(dp=dp, pp=s % dims.pp, tp=tp, cp=cp) for s in stages})
                    group = reused(("tied", tuple(ranks)), lambda: dist.new_group(ranks)) if len(ranks) > 1 else None
                    if (dp, cp, tp) == (coords["dp"], coords.get("cp", 0), coords["tp"]):
                        groups[stages] = group
    return [(p, group) for stages, group in groups.items() if group is not None
            for p in prepared.tied_params(module, stages=stages)]


def format_partition(partition: Partition, pp: int) -> str:
    label = ", ".join(partition.blocks) if partition.blocks != ("",) else "<root>"
    lines = [f"Pipeline partition of {label} ({len(partition.members)} blocks) into {partition.stages} stages:"]
    owners = partition.owners()
    for g, (a, b) in enumerate(partition.bounds):
        extra = [n for n in (*partition.pre, *(n for n, _ in partition.middle), *partition.post) if owners[n] == g]
        names = f"{partition.names[a]}..{partition.names[b - 1]}" if b - a > 1 else partition.names[a]
        lines.append(f"  stage {g} (pp rank {g % pp}): blocks {a}..{b - 1} ({names})"
                     f"{' + ' + ', '.join(extra) if extra else ''}")
    return "\n".join(lines)

