"""A batch cut into micro-batches, and their results put back together as the whole batch's.

Training splits every batch (``split_batch``: each micro-batch's share weights its loss). Evaluation splits where the
step's result can be put back together (``combinable``, from probes of a whole batch and a micro-batch) and puts it
together (``combine``): ``"cat"`` along the batch dimension, a share-weighted ``"mean"`` of a scalar.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import Tensor

from lightning_tpp._compat import tree_flatten, tree_unflatten
from lightning_tpp.pipeline.errors import PipelineError


def split_batch(batch: Any, n: int) -> tuple[list[Any], list[float]]:
    """``n`` micro-batches (every tensor leaf cut along dim 0, other leaves repeated) and each one's share of the
    batch. A batch size that ``n`` does not divide (an epoch's last batch) gives sizes that differ by one; the shares
    weight each micro-batch's loss so that the step still optimises the mean over the whole batch."""
    leaves, spec = tree_flatten(batch)
    sizes = {t.shape[0] for t in leaves if isinstance(t, Tensor) and t.dim() > 0}
    if not sizes:
        raise PipelineError("the batch holds no tensor with a batch dimension to split into micro-batches")
    if len(sizes) > 1:
        raise PipelineError(f"batch tensors disagree on the batch size (dim 0): {sorted(sizes)}")
    size = sizes.pop()
    if size < n:
        raise PipelineError(f"batch size {size} is smaller than microbatches={n}: every micro-batch needs a sample. "
                            f"Use batches of at least {n} samples (drop_last=True drops a short last batch) or fewer "
                            f"microbatches")
    chunks = [t.tensor_split(n) if isinstance(t, Tensor) and t.dim() > 0 else [t] * n for t in leaves]
    shares = [len(range(size)[i::n]) / size for i in range(n)]  # tensor_split sizes, as fractions
    return [tree_unflatten([c[i] for c in chunks], spec) for i in range(n)], shares


def batch_size(batch: Any) -> int:
    sizes = [t.shape[0] for t in tree_flatten(batch)[0] if isinstance(t, Tensor) and t.dim() > 0]
    return min(sizes) if sizes else 1


def combinable(kind: str, whole: Any, micro: Any, size: int, micro_size: int) -> Optional[tuple[str, ...]]:
    """How each leaf of the step's result is put together from the micro-batches' so that it equals the whole
    batch's (from probes of both): ``"cat"`` along dim 0 (a tensor whose dim 0 is the batch's), ``"mean"`` weighted
    by share (a 0-dim floating tensor, e.g. a loss, except from ``predict_step``), ``"none"`` (``None``); ``None``
    when a leaf is none of these (then the batch runs whole)."""
    leaves, spec = tree_flatten(whole)
    micro_leaves, micro_spec = tree_flatten(micro)
    if spec != micro_spec:
        return None
    modes = []
    for w, m in zip(leaves, micro_leaves):
        if w is None and m is None:  # nothing returned (a validation_step that only logs)
            modes.append("none")
            continue
        if not (isinstance(w, Tensor) and isinstance(m, Tensor) and w.dtype == m.dtype and w.dim() == m.dim()):
            return None
        if w.dim() > 0 and w.shape[0] == size and m.shape[0] == micro_size and w.shape[1:] == m.shape[1:]:
            modes.append("cat")
        elif w.dim() == 0 and w.is_floating_point() and kind != "predict_step":
            modes.append("mean")
        else:
            return None
    return tuple(modes)


def combine(kind: str, results: list[Any], shares: list[float], modes: tuple[str, ...]) -> Any:
    """The micro-batches' results put together (``modes`` from ``combinable``), checked against what the probe
    promised: a result that changes its structure between micro-batches cannot be combined and fails loudly."""
    fits = {"none": lambda t: t is None, "cat": lambda t: isinstance(t, Tensor) and t.dim() > 0,
            "mean": lambda t: isinstance(t, Tensor) and t.dim() == 0}
    flat = [tree_flatten(r) for r in results]
    spec = flat[0][1]
    if any(s != spec or len(leaves) != len(modes) or not all(fits[mode](t) for t, mode in zip(leaves, modes))
           for leaves, s in flat):
        raise PipelineError(f"{kind} returned results of different structures for the micro-batches of one batch, "
                            f"or unlike its earlier batches of this loop, under pipeline parallelism; they cannot be "
                            f"put together. Return the same structure for every batch of a dataloader, or evaluate "
                            f"whole batches with TPP_EVAL_WHOLE_BATCH=1")
    leaves = []
    for i, mode in enumerate(modes):
        column = [leaves_[i] for leaves_, _ in flat]
        if mode == "none":
            leaves.append(None)
        elif mode == "cat":
            leaves.append(torch.cat(column))
        else:
            leaves.append(sum(t.double() * s for t, s in zip(column, shares)).to(column[0].dtype))
    return tree_unflatten(leaves, spec)
