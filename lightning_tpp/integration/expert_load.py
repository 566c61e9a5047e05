"""Tokens per expert through Lightning's loggers: how evenly each mixture-of-experts layer spreads its tokens.

Each rank counts, per MoE layer it holds, the tokens routed to each expert (a bank: the expert indices it is
called with; a list: the rows each expert module receives), in training forwards only (not a recomputation in
backward, not a numerical check). On a logging step (Lightning's rule: every ``log_every_n_steps`` optimizer steps)
one object all-gather gives every rank every layer's counts, summed over the data-parallel replicas (tensor-parallel
ranks see the same tokens: one of them counts), which each rank logs with the module's own ``self.log``::

    moe/imbalance                 the largest max / mean over the layers (1.0: perfectly even)
    moe/<layer>/imbalance         max / mean of the tokens its experts got since the last logging step
    moe/<layer>/idle_experts      experts that got no token
    moe/<layer>/expert<e>         tokens of expert e (layers of at most 16 experts)
    moe/all_to_all_MB, _ms        expert parallelism: what this rank's token exchanges sent to other ranks and the
                                  time spent in them, per training step (forward, backward and recomputation)

Other steps cost no communication.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_tpp.core.recompute import recomputing
from lightning_tpp.core.walk import VERIFYING
from lightning_tpp.experts import MoELayer
from lightning_tpp.experts.dispatch import Traffic
from lightning_tpp.pipeline.metrics import is_logging_step

PREFIX = "moe/"
_LISTED = 16  # experts per layer logged one by one


class ExpertLoad:
    def __init__(self, module: nn.Module, layers: list[MoELayer], *, counts: bool,
                 traffic: Optional[Traffic] = None) -> None:
        """``counts``: whether this rank contributes (tp rank 0; the other tp ranks see the same tokens);
        ``traffic``: this rank's token exchanges under expert parallelism."""
        self.counts = counts
        self.traffic = traffic
        self.steps = 0
        self.tokens: dict[str, Tensor] = {layer.name: torch.zeros(layer.count, dtype=torch.long) for layer in layers}
        self.handles = []
        for layer in layers:
            experts = module.get_submodule(layer.experts)
            if layer.kind == "bank":
                self.handles.append(experts.register_forward_pre_hook(self._bank_hook(layer), with_kwargs=True))
            else:
                for e, expert in enumerate(experts):
                    self.handles.append(expert.register_forward_pre_hook(self._expert_hook(layer, e),
                                                                         with_kwargs=True))

    @staticmethod
    def _counting(module: nn.Module) -> bool:
        return module.training and not recomputing() and not VERIFYING.get() and torch.is_grad_enabled()

    def _bank_hook(self, layer: MoELayer) -> Any:
        # traced inside a compiled block (compile=): the count stays on the device, in a tensor the graph adds to
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            index = next((t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)
                          and not t.is_floating_point() and not t.is_meta), None)
            if index is not None and self._counting(module):
                ids = index.flatten().long()
                # sentinels (an expert held elsewhere) go to a last bin that is dropped
                ids = torch.where((ids >= 0) & (ids < layer.count), ids, layer.count)
                counts = torch.zeros(layer.count + 1, dtype=torch.long, device=ids.device)
                counts.scatter_add_(0, ids, torch.ones_like(ids))
                self._tokens(layer.name, ids.device).add_(counts[:layer.count])
        return hook

    def _expert_hook(self, layer: MoELayer, e: int) -> Any:
        def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
            x = next((t for t in (*args, *kwargs.values()) if isinstance(t, Tensor)), None)
            if x is not None and not x.is_meta and self._counting(module):
                self._tokens(layer.name, x.device)[e] += x.numel() // max(x.shape[-1], 1) if x.dim() > 1 else x.numel()
        return hook

    def _tokens(self, name: str, device: torch.device) -> Tensor:
        """A layer's counts, on the device of the indices counted (no copy to the host per call)."""
        if self.tokens[name].device != device:
            self.tokens[name] = self.tokens[name].to(device)
        return self.tokens[name]

    def after_step(self, module: Any, batch_idx: Optional[int], group: Optional[dist.ProcessGroup] = None) -> None:
        """Called at the end of the strategy's ``training_step`` on every rank."""
        self.steps += 1
        if not is_logging_step(module.trainer, batch_idx):
            return
        mine = {n: t.tolist() for n, t in self.tokens.items()} if self.counts else {}
        every: list[Optional[dict]] = [None] * dist.get_world_size(group) if dist.is_initialized() else [mine]
        if dist.is_initialized():
            dist.all_gather_object(every, mine, group=group)
        for t in self.tokens.values():
            t.zero_()
        values = summarize(every)
        if self.traffic is not None:  # this rank's, per training step since the last logging step
            steps = max(self.steps, 1)
            values[f"{PREFIX}all_to_all_MB"] = self.traffic.bytes / 1e6 / steps
            values[f"{PREFIX}all_to_all_ms"] = self.traffic.seconds * 1e3 / steps
            self.traffic.reset()
        self.steps = 0
        module.log_dict(values, on_step=True, on_epoch=False, prog_bar=False, logger=True)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def summarize(every: list[Optional[dict]]) -> dict[str, float]:
    """Each layer's counts summed over the ranks that counted them, as the ``moe/`` values."""
    total: dict[str, Tensor] = {}
    for counts in every:
        for name, c in (counts or {}).items():
            total[name] = total.get(name, torch.zeros(len(c), dtype=torch.float64)) + torch.tensor(c, dtype=torch.float64)
    values: dict[str, float] = {}
    worst = 0.0
    for name in sorted(total):
        c = total[name]
        imbalance = float(c.max() / c.mean()) if c.sum() > 0 else 0.0
        worst = max(worst, imbalance)
        values[f"{PREFIX}{name}/imbalance"] = imbalance
        values[f"{PREFIX}{name}/idle_experts"] = float((c == 0).sum())
        if len(c) <= _LISTED:
            values.update({f"{PREFIX}{name}/expert{e}": float(v) for e, v in enumerate(c)})
    if total:
        values[f"{PREFIX}imbalance"] = worst
    return values
