"""Expert parallelism: each rank of an ep group holds ``experts / ep`` whole experts of every bank, and the tokens
travel to them (``experts.dispatch``).

The ep group is drawn from the data-parallel and tensor-parallel ranks of one pipeline stage, tp fastest, as in
Megatron-Core and torchtitan (so ``ep`` must divide ``dp * tp``)::

    dp = 2, tp = 2, ep = 2 (one stage)       flat (dp, tp):  d0t0  d0t1 | d1t0  d1t1
                                             ep groups:      [  0     1 ] [  0     1 ]   experts 0..E/2-1 | E/2..E-1
                                             replicas:       d0t0 + d1t0 hold the same experts, d0t1 + d1t1 too

    dp = 4, tp = 1, ep = 2                   ep groups: [d0 d1] [d2 d3]; replicas: [d0 d2], [d1 d3]

An expert's gradient is the sum of what every rank's tokens gave it: summed over the ranks that hold the same
experts (its replicas) and divided by dp, it is the data-parallel average that every other parameter gets. The
bank's parameters stay outside the dp units (their replicas are a subgroup of dp, not dp): where FSDP2 shards, each
bank is a unit of its own over its replicas (``data_parallel.fsdp.ExpertShards``), which reduce-scatters that sum.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from torch import Tensor, nn
from torch.distributed import ProcessGroup
from torch.distributed.device_mesh import DeviceMesh

from lightning_tpp.core.comm import TPGroup
from lightning_tpp.core.dp_shard import is_dp_sharded
from lightning_tpp.core.grads import reduce_gradients
from lightning_tpp.core.mesh import reused
from lightning_tpp.core.params import ShardIndex, ShardInfo
from lightning_tpp.core.reference import Mismatch, check_forward
from lightning_tpp.core.sharding import ShardSpec, shard_tensor
from lightning_tpp.core.swap import original_class, set_local_attr, swap_class
from lightning_tpp.core.walk import VERIFYING
from lightning_tpp.experts.detect import MoELayer
from lightning_tpp.experts.dispatch import Traffic, dispatch
from lightning_tpp.experts.tensor_parallel import ExpertParallelConfigError

_COUNT_NAMES = ("num_experts", "num_local_experts", "n_routed_experts", "num_routed_experts")


@dataclass(eq=False)
class ExpertGroup(TPGroup):
    """The ep group of this rank (tokens exchanged), the group of its replicas (same experts: gradients summed),
    the ``("edp", "ep")`` mesh of its stage (checkpoints) and the data-parallel degree (gradients averaged by)."""

    replicas: Optional[ProcessGroup] = None
    mesh: Optional[DeviceMesh] = field(default=None, repr=False)
    ep_edp: Optional[DeviceMesh] = field(default=None, repr=False)  # ("ep", "edp"): ep outermost (checkpoints)
    dp: int = 1
    traffic: Traffic = field(default_factory=Traffic, compare=False, repr=False)  # this rank's exchanges


def check_ep(ep: Any, *, dp: int, tp: int, cp: int = 1) -> None:
    """``ep`` against the data-parallel, context-parallel and tensor-parallel ranks it is drawn from."""
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep={ep!r} must be a positive integer")
    if (dp * cp * tp) % ep:
        ranks = dp * cp * tp
        valid = [d for d in range(1, ranks + 1) if ranks % d == 0]
        what, product = ("dp*cp*tp", f"{dp}*{cp}*{tp}") if cp > 1 else ("dp*tp", f"{dp}*{tp}")
        raise ValueError(f"ep={ep} must divide {what} = {product} = {ranks}: the ranks that exchange tokens are "
                         f"the data-parallel{', context-parallel' if cp > 1 else ''} and tensor-parallel ranks of one "
                         f"pipeline stage; choose ep in {valid} (or more devices)")


def ep_grid(ranks: Tensor, ep: int) -> Tensor:
    """The global ranks of a ``(dp, pp, tp)`` grid (``(dp, pp, cp, tp)`` with cp) as ``(pp, replicas, ep)``: along
    the last axis an ep group (tp fastest, then cp, then dp: the cp ranks hold other positions of the same sequences,
    whose tokens travel as another replica's do), along the middle one the ranks holding the same experts."""
    return ranks.movedim(1, 0).reshape(ranks.shape[1], -1, ep)


def expert_group(mesh: DeviceMesh, ep: int, *, rank: int, dp: int) -> ExpertGroup:
    """This rank's :class:`ExpertGroup` out of the ``("dp", "pp", "tp")`` mesh (``("dp", "pp", "cp", "tp")``:
    ``dp`` is then dp x cp, every rank's expert gradients being ``cp`` times its positions' part, see
    ``context_parallel.split``); collective: every rank calls it."""
    grid = ep_grid(mesh.mesh, ep)
    experts = reused(("experts", mesh.device_type, tuple(grid.shape), tuple(grid.flatten().tolist())),
                     lambda: DeviceMesh(mesh.device_type, grid, mesh_dim_names=("pp", "edp", "ep")))
    swapped = grid.transpose(1, 2)  # a mesh's dimensions cannot be sliced out of order: one built the other way round
    ep_edp = reused(("experts-ep-edp", mesh.device_type, tuple(swapped.shape), tuple(swapped.flatten().tolist())),
                    lambda: DeviceMesh(mesh.device_type, swapped, mesh_dim_names=("pp", "ep", "edp")))
    where = (grid == rank).nonzero()[0].tolist()
    return ExpertGroup(experts.get_group("ep"), where[2], ep, replicas=experts.get_group("edp"),
                       mesh=experts["edp", "ep"], ep_edp=ep_edp["ep", "edp"], dp=dp)


@dataclass
class EPBank:
    name: str
    experts: int
    group: TPGroup  # the ep group
    tp: TPGroup
    shards: ShardIndex
    verify_pending: bool


class _EPExperts:
    """Mixin for a bank module called as transformers 5 calls its experts: ``(hidden (T, H), index (T, k),
    weights (T, k))`` -> (T, H)."""

    _tpp_ep: EPBank

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        st = self._tpp_ep
        x, index, weight = _routed_call(st, args, kwargs)
        if st.verify_pending and not VERIFYING.get():
            st.verify_pending = False
            _verify(self, x, index, weight)  # type: ignore[arg-type]
        return self._ep_forward(x, index, weight)

    def _ep_forward(self, x: Tensor, index: Tensor, weight: Tensor) -> Tensor:
        st = self._tpp_ep
        params = [p for p in self._parameters.values() if p is not None]  # type: ignore[attr-defined]
        return dispatch(self._local_forward, x, index, weight, experts=st.experts, ep=st.group, tp=st.tp,
                        params=params, traffic=getattr(st.group, "traffic", None))

    def _local_forward(self, rows: Tensor, index: Tensor, weight: Tensor) -> Tensor:
        return super().forward(rows, index, weight)  # type: ignore[misc]


def _routed_call(st: EPBank, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, Tensor]:
    values = [*args, *kwargs.values()]
    ok = (len(values) == 3 and all(isinstance(v, Tensor) for v in values) and values[0].dim() == 2
          and values[1].dim() == 2 and not values[1].is_floating_point() and values[2].shape == values[1].shape
          and values[1].shape[0] == values[0].shape[0])
    if not ok:
        shapes = [tuple(v.shape) if isinstance(v, Tensor) else type(v).__name__ for v in values]
        raise ExpertParallelConfigError(
            f"ep={st.group.size}: the experts {st.name!r} were called with {shapes}; expert parallelism sends each "
            f"token to its experts' rank for banks called as transformers calls them, (hidden (T, H), expert index "
            f"(T, k), routing weights (T, k)). Cut these experts with tp instead (ep=1)")
    return values[0], values[1], values[2]


def split_experts(model: nn.Module, layers: list[MoELayer], group: TPGroup, tp: TPGroup, shards: ShardIndex, *,
                  verify: bool = True) -> list[str]:
    """Keep this rank's ``E / ep`` experts of every bank of ``layers`` (parameters recorded in ``shards``, cut over
    ``group``); returns the banks' names."""
    modules = dict(model.named_modules())
    done = []
    for layer in layers:
        if layer.kind != "bank":
            raise ExpertParallelConfigError(
                f"ep={group.size}: the experts of {layer.name} are a list of {layer.count} modules "
                f"({layer.experts}); expert parallelism exchanges tokens for experts held as 3-D banks (transformers "
                f"5's layout). Cut these experts with tp instead (ep=1), each expert an MLP")
        if layer.count % group.size:
            raise ExpertParallelConfigError(
                f"ep={group.size} must divide the {layer.count} experts of {layer.experts}; choose ep in "
                f"{[d for d in range(1, layer.count + 1) if layer.count % d == 0]}")
        module = modules[layer.experts]
        for attr, old in list(module._parameters.items()):
            if old is None:
                continue
            if old.dim() == 0 or old.shape[0] != layer.count:
                raise ExpertParallelConfigError(
                    f"ep={group.size}: {layer.experts}.{attr} of shape {tuple(old.shape)} is not indexed by expert "
                    f"(first dimension {layer.count}), so it cannot go with its experts; use tp instead (ep=1)")
            spec = ShardSpec(0, over=group)
            new = nn.Parameter(shard_tensor(old.data, spec, group.rank, group.size), requires_grad=old.requires_grad)
            shards.add(new, ShardInfo(spec, tuple(old.shape)))
            module._parameters[attr] = new
        for name in _COUNT_NAMES:
            if getattr(module, name, None) == layer.count:
                set_local_attr(module, name, layer.count // group.size)
        module._tpp_ep = EPBank(layer.experts, layer.count, group, tp, shards, verify)
        swap_class(module, _EPExperts)
        done.append(layer.experts)
    return done


def _verify(module: nn.Module, x: Tensor, index: Tensor, weight: Tensor) -> None:
    """The exchanged layer's output on this call's tokens against the original class with every expert (gathered
    over the ep group), once; every rank of the stage decides alike (over the ep group, then over its replicas: the
    other ep groups)."""
    st: EPBank = module._tpp_ep  # type: ignore[assignment]
    check_forward(module, (x, index, weight), {}, group=st.group, shards=st.shards, also=[_replicas(st.group)],
                  parallel=lambda a, k: module._ep_forward(*a),  # type: ignore[operator]
                  mismatch=Mismatch("expert parallelism of", st.name, original_class(module).__name__,
                                    "Its forward probably does something beyond computing each (token, expert) row "
                                    "on its own", fix="use tp for its experts instead (ep=1), or pass verify=False "
                                    "to skip this check", others="another rank differs"))


def _replicas(group: TPGroup) -> Optional[ProcessGroup]:
    return group.replicas if isinstance(group, ExpertGroup) else None


def is_split_bank(module: nn.Module) -> bool:
    return isinstance(module, _EPExperts)


def split_banks(model: nn.Module) -> list[str]:
    """The names of the banks expert parallelism split."""
    return [name for name, m in model.named_modules() if isinstance(m, _EPExperts)]


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of every bank that expert parallelism split (they are reduced by :func:`reduce_expert_grads`,
    not by data parallelism)."""
    return [p for m in model.modules() if isinstance(m, _EPExperts) for p in m.parameters(recurse=False)]


def reduce_expert_grads(params: list[nn.Parameter], group: ExpertGroup) -> None:
    """Each expert's gradient summed over its replicas and divided by dp: the average over every replica's batch,
    as the other parameters get. A bank whose parameter got no gradient on a rank (frozen, or no MoE call) gets
    zeros there when another rank has one. Banks sharded over their replicas (FSDP2, ``data_parallel.fsdp``) were
    reduced in backward."""
    reduce_gradients([p for p in params if p.requires_grad and not is_dp_sharded(p)], group.replicas,
                     divisor=group.dp)
