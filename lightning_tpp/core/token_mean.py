"""Losses averaged over tokens, exact when a batch runs as micro-batches (and, if asked, over dp replicas).

One process averages ``F.cross_entropy(..., reduction="mean")`` over every counted target of the batch: targets
other than ``ignore_index``, each weighted by ``weight[target]`` where a class weight is given. A pipeline runs the
user's step once per micro-batch and weights each micro-batch's loss by its share of the samples, which is the same
only when every sample has as many counted targets: a masked LM, an SFT batch whose prompt tokens are -100, padding
and Hugging Face's own ``.loss`` are the mean of micro-batch means instead (issue #44: 5.5666 for 5.5658, 4.9e-3 off
by step 6). So, per step::

    count_tokens     each micro-batch's step runs once more with every pipeline unit a stand-in (zeros, no compute)
                     and each mean-reduced cross-entropy / NLL replaced by the count it divides by: N[k][i] for the
                     k-th such call of micro-batch i (no collective: any rank can count, on its own)
    in the schedule  the k-th call of micro-batch i returns  sum_i / (N_k * share_i),  N_k = sum_i N[k][i]

Weighted by ``share_i`` and summed, the micro-batches give ``sum / N_k``: the batch's mean, its gradients and its
logged value; the other terms of a loss (a load-balancing loss, a regulariser) keep their share weights::

    micro-batch  share  counted  returned             x share
        0         1/4     15     S0 / (59 / 4)        S0 / 59
        1         1/4     13     S1 / (59 / 4)        S1 / 59      sum: (S0 + S1 + S2 + S3) / 59
        2 ...

``loss_normalization="global"`` divides by the count over every dp replica instead (``N_k`` summed over dp, then
over dp: dp averages gradients, so each replica divides by ``N_global / dp``), as torchtitan normalises by the
global token count. A reduction the strategy cannot see (``reduction="none"`` or ``"sum"`` and the user's own
division) is named in a warning when its counted targets differ between micro-batches.
"""

from __future__ import annotations

import inspect
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Optional

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

LossNormalization = Literal["batch", "global", "microbatch"]
NORMALIZATIONS = ("batch", "global", "microbatch")
LOSSES: dict[Callable[..., Tensor], inspect.Signature] = {f: inspect.signature(f) for f in (F.cross_entropy,
                                                                                            F.nll_loss)}


def check_normalization(value: Any) -> LossNormalization:
    if value not in NORMALIZATIONS:
        raise ValueError(f"loss_normalization={value!r} must be one of {', '.join(map(repr, NORMALIZATIONS))}: "
                         f"'batch' (a token mean over each replica's batch, as one process computes it), 'global' "
                         f"(over every replica's tokens) or 'microbatch' (each micro-batch's mean weighted by its "
                         f"share of the samples)")
    return value


def _bound(func: Callable[..., Tensor], args: tuple, kwargs: dict) -> Optional[inspect.BoundArguments]:
    """The call's arguments by name with their defaults, or None for the legacy ``size_average``/``reduce``."""
    bound = LOSSES[func].bind(*args, **kwargs)
    bound.apply_defaults()
    if bound.arguments["size_average"] is not None or bound.arguments["reduce"] is not None:
        return None
    return bound


def counted(bound: inspect.BoundArguments) -> Tensor:
    """What ``reduction="mean"`` divides the summed loss by: the targets other than ``ignore_index`` (weighted by
    ``weight[target]`` where given); the rows for class probabilities (``cross_entropy`` with a floating target)."""
    input, target, weight = bound.arguments["input"], bound.arguments["target"], bound.arguments["weight"]
    if target.is_floating_point():
        return torch.tensor(float(input.numel() // input.shape[1] if input.dim() > 1 else 1), dtype=torch.float64)
    valid = target != bound.arguments["ignore_index"]
    if weight is None:
        return valid.sum().double()
    return weight.double()[target[valid]].sum()


def _reduction(bound: Optional[inspect.BoundArguments]) -> Optional[str]:
    return None if bound is None else bound.arguments["reduction"]


@dataclass
class Counts:
    """One step's counts: per micro-batch, what each mean-reduced loss call divides by, in call order; and, for the
    calls reduced with ``"none"``/``"sum"`` (the user's own mean), their counted targets."""

    means: list[list[float]] = field(default_factory=list)
    own: list[list[float]] = field(default_factory=list)

    def totals(self) -> list[float]:
        """Per call, its count over the whole batch (a call some micro-batches skip counts where it ran)."""
        calls = max((len(m) for m in self.means), default=0)
        return [sum(m[k] for m in self.means if k < len(m)) for k in range(calls)]

    def uneven_own(self, shares: list[float]) -> bool:
        """Whether a user-reduced loss counts a different number of targets per sample in some micro-batch."""
        per_sample = [sum(own) / share for own, share in zip(self.own, shares) if own]
        return len(per_sample) > 1 and max(per_sample) - min(per_sample) > 1e-9 * max(per_sample)


class _Count(TorchFunctionMode):
    """Inside a stand-in run of the step: a mean-reduced loss is counted instead of computed (a zero comes back)."""

    def __init__(self) -> None:
        super().__init__()
        self.means: list[float] = []
        self.own: list[float] = []

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func in LOSSES:
            bound = _bound(func, args, kwargs)
            if _reduction(bound) == "mean":
                self.means.append(float(counted(bound)))
                return torch.zeros((), dtype=bound.arguments["input"].dtype, device=bound.arguments["input"].device)
            if bound is not None and not bound.arguments["target"].is_floating_point():
                self.own.append(float(counted(bound)))
        return func(*args, **kwargs)


def count_tokens(run: Callable[[int], Any], microbatches: int) -> Counts:
    """``run(i)`` runs the step on micro-batch ``i`` with the units as stand-ins; returns what each counted."""
    counts = Counts()
    for i in range(microbatches):
        with _Count() as mode:
            run(i)
        counts.means.append(mode.means)
        counts.own.append(mode.own)
    return counts


def global_totals(totals: list[float], group: Optional[dist.ProcessGroup], size: int, device: torch.device
                  ) -> list[float]:
    """``loss_normalization="global"``: each call's count summed over the dp replicas, divided by their number
    (dp averages the gradients). Two all-reduces: the most calls any replica made, then the counts."""
    if size == 1 or not dist.is_initialized():
        return totals
    calls = torch.tensor([len(totals)], dtype=torch.int64, device=device)
    dist.all_reduce(calls, op=dist.ReduceOp.MAX, group=group)
    counts = torch.zeros(int(calls.item()), dtype=torch.float64, device=device)
    counts[:len(totals)] = torch.tensor(totals, dtype=torch.float64)
    dist.all_reduce(counts, group=group)
    return [c / size for c in counts.tolist()]


class TokenMean(TorchFunctionMode):
    """In one micro-batch's step: the ``k``-th mean-reduced loss returns ``sum / (totals[k] * share)``. A call the
    count did not see (more calls than counted, or another count: targets computed from the model's outputs) keeps
    its own mean and is reported through ``mismatch``."""

    def __init__(self, totals: list[float], mine: list[float], share: float,
                 mismatch: Callable[[str], None]) -> None:
        super().__init__()
        self.totals, self.mine, self.share, self.mismatch = totals, mine, share, mismatch
        self.calls = 0

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func not in LOSSES:
            return func(*args, **kwargs)
        bound = _bound(func, args, kwargs)
        if _reduction(bound) != "mean":
            return func(*args, **kwargs)
        k, self.calls = self.calls, self.calls + 1
        if k >= len(self.mine) or not self.totals[k]:
            self.mismatch(f"{func.__name__} call {k} of the step was not seen when its tokens were counted (the "
                          f"step ran {len(self.mine)} mean-reduced loss calls on stand-ins)")
            return func(*args, **kwargs)
        n = float(counted(bound))
        if n != self.mine[k]:
            self.mismatch(f"{func.__name__} call {k} counts {n:g} targets, {self.mine[k]:g} when counted on "
                          f"stand-ins (its targets depend on the model's outputs)")
            return func(*args, **kwargs)
        bound.arguments["reduction"] = "sum"
        return func(*bound.args, **bound.kwargs) / (self.totals[k] * self.share)


class GlobalTokenMean(TorchFunctionMode):
    """Without micro-batches, ``loss_normalization="global"``: each mean-reduced loss call divides its sum by the
    count over every dp replica (one all-reduce per call; every replica makes the same calls)."""

    def __init__(self, group: Optional[dist.ProcessGroup], size: int, device: torch.device) -> None:
        super().__init__()
        self.group, self.size, self.device = group, size, device

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        bound = _bound(func, args, kwargs) if func in LOSSES else None
        if _reduction(bound) != "mean":
            return func(*args, **kwargs)
        n = counted(bound).to(self.device)
        dist.all_reduce(n, group=self.group)
        bound.arguments["reduction"] = "sum"
        return func(*bound.args, **bound.kwargs) / (n / self.size).to(bound.arguments["input"].dtype)


class TokenWarnings:
    """What the strategy says, once each: a loss reduced by the user (the first training step, global rank 0) and a
    mean-reduced call it could not count (on the rank that computes the loss)."""

    def __init__(self) -> None:
        self.pending = True  # the first training step's check is still to come
        self._mismatched = self._uncounted = False

    def first_step(self, counts: Optional[Counts], shares: list[float]) -> None:
        self.pending = False
        if counts is not None and counts.uneven_own(shares) and (not dist.is_initialized() or dist.get_rank() == 0):
            warnings.warn(
                "training_step reduces a cross-entropy / NLL loss itself (reduction='none' or 'sum'), and the micro-"
                f"batches of this step count {[sum(own) for own in counts.own]} targets for shares {shares} of the "
                "samples: under pipeline parallelism each micro-batch's loss is weighted by its share of the samples, "
                "so a mean over a varying number of tokens differs from one process's. Reduce with "
                "reduction='mean' (ignore_index or weight marking what not to count): the strategy then combines the "
                "micro-batches by their token counts, exactly", stacklevel=2)

    def uncounted(self, kind: str, err: Exception) -> None:
        """The step raised while its tokens were counted on stand-ins (zeros in place of the layers' outputs)."""
        if not self._uncounted:
            self._uncounted = True
            warnings.warn(f"loss_normalization: {kind} could not be run on stand-ins to count its tokens "
                          f"({type(err).__name__}: {err}); where that happens, each micro-batch's mean loss is weighted "
                          f"by its share of the samples", stacklevel=2)

    def mismatch(self, what: str) -> None:
        if not self._mismatched:
            self._mismatched = True
            warnings.warn(f"loss_normalization: {what}; that loss stays a mean over its micro-batch, weighted by the "
                          f"micro-batch's share of the samples (not exact when micro-batches count different "
                          f"numbers of tokens)", stacklevel=2)
