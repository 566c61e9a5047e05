"""Block times on this device: one block of each kind, at full size, on the real micro-batch shape, never the
whole model.

The block's inputs are captured on a meta copy (the model's forward stops at the block: nothing before it is
computed for real), then the block alone is built on the device from the meta copy (its weights drawn at random:
the values do not change the time), and its forward and backward are timed. Results are cached per model shape,
micro-batch and device, so a second setup does not time again. An optimizer step is timed too
(:func:`time_optimizer`), on one block's parameter shapes."""

from __future__ import annotations

import copy
import math
import time
import warnings
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_tpp._compat import tree_flatten, tree_map
from lightning_tpp.core.meta_ops import DataDependentOnMeta
from lightning_tpp.layout.profile import ModelProfile
from lightning_tpp.memory.activations import ForwardFn, _default_forward, meta_copy

_CACHE: dict[tuple, tuple[float, float]] = {}  # (model shape, kind, micro-batch, device, dtype, ...) -> seconds


class _Captured(Exception):
    """Stops the meta forward once the block's inputs are known."""


def time_blocks(module: nn.Module, profile: ModelProfile, sizes: Sequence[int], *, device: torch.device,
                dtype: torch.dtype = torch.float32, forward: Optional[ForwardFn] = None, repeats: int = 5,
                together: bool = False, sync: Optional[Callable[[], None]] = None
                ) -> dict[tuple[str, int], tuple[float, float]]:
    """(forward, backward) seconds of one block of each kind per micro-batch of ``sizes`` sequences, for
    ``cost.BlockTimes``: the least of ``repeats`` after one warm-up; their median when every process of the
    machine times at once (``together``: the cores as a step shares them, see ``layout.strategy``). ``sync`` (a
    barrier of those processes) is called before each kind and size, on every rank the same number of times
    whatever fails or is cached, so that the processes time the same work at the same moment (unsynchronised, the
    first to finish leaves the cores to the others, as no step does) and their waits are measured
    (:class:`Meeting`)."""
    kinds = {b.kind: b for b in profile.blocks}
    shape = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    out: dict[tuple[str, int], tuple[float, float]] = {}
    failed: dict[str, str] = {}
    for kind, block in kinds.items():
        for mb in sizes:
            if sync is not None:
                sync()
            if kind in failed:
                continue
            key = (hash(shape), kind, mb, str(device), dtype, together)
            if key not in _CACHE:
                try:
                    _CACHE[key] = _time_one(module, block.name, mb, profile.seq_len, device, dtype, forward, repeats,
                                            together)
                except (RuntimeError, TypeError, ValueError) as err:
                    failed[kind] = f"{type(err).__name__}: {str(err)[:200]}"
                    continue
            out[(kind, mb)] = _CACHE[key]
    timed = [k for k in kinds if k not in failed]
    if not timed:
        raise ValueError(f"no block of the model could be timed alone on {device}: {failed}. Pass blocks='<container>' "
                         f"naming the blocks, or give tp/pp/dp")
    for kind, why in failed.items():  # scaled by FLOPs from a kind that ran
        ref = kinds[timed[0]]
        ratio = kinds[kind].flops.whole / ref.flops.whole if ref.flops.whole else 1.0
        warnings.warn(f"layout search: block {kinds[kind].name} could not run alone ({why}); its time is "
                      f"{ratio:.2f} x {ref.name}'s, by their FLOPs")
        for mb in sizes:
            f, b = out[(timed[0], mb)]
            out[(kind, mb)] = (f * ratio, b * ratio)
    return out


def time_ends(module: nn.Module, profile: ModelProfile, sizes: Sequence[int], *, device: torch.device,
              dtype: torch.dtype = torch.float32, forward: Optional[ForwardFn] = None, repeats: int = 5,
              together: bool = False, sync: Optional[Callable[[], None]] = None) -> dict[int, tuple[float, float]]:
    """(forward, backward) seconds of what lies outside the blocks (embeddings, head, loss, masks, final norms) per
    micro-batch of ``sizes`` sequences: the model's forward and backward on the device with each block of
    ``profile`` replaced by a stand-in (:class:`_StandIn`), its parameters only built there. Least of ``repeats``
    after a warm-up, or median ``together`` (as :func:`time_blocks`, whose ``sync`` it shares: called once, on every
    rank). Empty, with a warning, where the model does not run that way: the cost model then charges the ends at
    the blocks' FLOP rate."""
    if sync is not None:
        sync()
    shape = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    key = (hash(shape), "<ends>", tuple(sizes), str(device), dtype, together)
    if key in _CACHE:
        return dict(_CACHE[key])  # type: ignore[arg-type]
    try:
        twin = meta_copy(module, dtype).train()
        for block in profile.blocks:
            parent, _, leaf = block.name.rpartition(".")
            owner = twin.get_submodule(parent) if parent else twin
            setattr(owner, leaf, _StandIn(getattr(owner, leaf), device))
        twin = twin.to_empty(device=device)
        with torch.no_grad():
            for p in twin.parameters():
                p.normal_(0.0, 0.02) if p.is_floating_point() else p.zero_()
        out = {}
        for mb in sizes:
            ids = lambda: ((twin, torch.zeros(mb, profile.seq_len, dtype=torch.long, device=device)), {})  # noqa: E731
            out[mb] = _passes(forward or _default_forward, ids, device, repeats, together,
                              after=lambda: twin.zero_grad(set_to_none=True))
    except (RuntimeError, TypeError, ValueError, AttributeError, IndexError) as err:
        warnings.warn(f"layout search: the model did not run with its blocks standing in ({type(err).__name__}: "
                      f"{str(err)[:200]}); the time outside the blocks (embeddings, head, loss) is their FLOPs at "
                      f"the blocks' rate")
        return {}
    _CACHE[key] = tuple(out.items())  # type: ignore[assignment]
    return out


class _StandIn(nn.Module):
    """A block of the model while its ends are timed: no parameters and no compute. Its output has the structure the
    block's own returns (the block run once on meta per input shape), the input's hidden state passed through in
    the place of the block's (so that the head's gradient reaches the embeddings) and zeros elsewhere (a position
    bias, attention weights)."""

    def __init__(self, block: nn.Module, device: torch.device) -> None:
        super().__init__()
        object.__setattr__(self, "_block", block)  # on meta, not a submodule: nothing of it is built
        self._device = device
        self._outputs: dict[tuple, Any] = {}

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        flat = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, Tensor)]
        key = tuple((tuple(t.shape), t.dtype) for t in flat)
        if key not in self._outputs:
            on_meta = tree_map(lambda t: t.detach().to("meta") if isinstance(t, Tensor) else t, (args, kwargs))
            with torch.no_grad(), DataDependentOnMeta():
                self._outputs[key] = self._block(*on_meta[0], **on_meta[1])
        hidden = next((t for t in flat if t.is_floating_point()), None)
        passed = [False]

        def fill(t: Any) -> Any:
            if not isinstance(t, Tensor):
                return t
            if hidden is not None and not passed[0] and t.shape == hidden.shape and t.dtype == hidden.dtype:
                passed[0] = True
                return hidden.view_as(hidden)
            return torch.zeros(t.shape, dtype=t.dtype, device=self._device)

        return tree_map(fill, self._outputs[key])


def time_optimizer(module: nn.Module, profile: ModelProfile, *, device: torch.device,
                   dtype: torch.dtype = torch.float32, repeats: int = 10, together: bool = False,
                   sync: Optional[Callable[[], None]] = None) -> tuple[float, float]:
    """(seconds per parameter tensor, seconds per element) of an AdamW step (torch's default, foreach) on this
    device: timed on one block's parameters (real tensors of its shapes) and on one flat tensor of as many elements,
    the least of ``repeats`` after one warm-up each (the median, ``together``). A step is not only bytes at memory bandwidth: on a CPU thread
    its per-tensor work is most of it for small tensors."""
    block = profile.blocks[0]
    shapes = [tuple(p.shape) for p in meta_copy(module, dtype).get_submodule(block.name).parameters()]
    elements = sum(math.prod(s) for s in shapes)
    seconds = []
    for group in (shapes, [(elements,)]):
        if sync is not None:
            sync()  # as in time_blocks
        params = [torch.zeros(s, dtype=dtype, device=device, requires_grad=True) for s in group]
        for q in params:
            q.grad = torch.randn_like(q)
        optimizer = torch.optim.AdamW(params, lr=1e-4)
        samples = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            optimizer.step()
            _sync(device)
            samples.append(time.perf_counter() - start)
        seconds.append(_pick(samples[1:], together))
    per_element = seconds[1] / max(elements, 1)
    per_tensor = max(seconds[0] - seconds[1], 0.0) / max(len(shapes) - 1, 1)
    return per_tensor, per_element


class Meeting:
    """The barrier of processes that time together (``time_blocks``' ``sync``), which also records how long this
    process waited at it for the others to finish the same work: :attr:`straggle`, the wait beyond the barrier's own
    latency per second of work between meetings. A step of processes that share cores pays it at each of its
    synchronisation points (the slowest process sets the pace); measured here, on the work the cost model times."""

    def __init__(self, barrier: Optional[Callable[[], Any]] = None) -> None:
        import torch.distributed as dist
        self.barrier = barrier or dist.barrier  # the default group's
        self.waits: list[float] = []
        self.work: list[float] = []
        self._left: Optional[float] = None

    def __call__(self) -> None:
        arrived = time.perf_counter()
        self.barrier()
        left = time.perf_counter()
        if self._left is not None:  # the first meeting waits for whatever came before the timing
            self.work.append(arrived - self._left)
            self.waits.append(left - arrived)
        self._left = left

    @property
    def straggle(self) -> float:
        """Wait per second of work (the least wait, when this process came last, is the barrier itself)."""
        if not self.waits or sum(self.work) <= 0:
            return 0.0
        floor = min(self.waits)
        return sum(w - floor for w in self.waits) / sum(self.work)


def time_copy(elements: int, *, device: torch.device, dtype: torch.dtype = torch.float32, repeats: int = 10,
              together: bool = False, sync: Optional[Callable[[], None]] = None) -> float:
    """Seconds per byte of a copy of ``elements`` (read and written once): the host copies around the gradient
    reduction (``core.grads``) cost this per pass. Least of ``repeats``, or median ``together`` (as above)."""
    x = torch.ones(max(elements, 1), dtype=dtype, device=device)
    y = torch.empty_like(x)
    if sync is not None:
        sync()
    samples = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        y.copy_(x)
        _sync(device)
        samples.append(time.perf_counter() - start)
    return _pick(samples[1:], together) / (x.numel() * x.element_size())


def _time_one(module: nn.Module, name: str, mb: int, seq_len: int, device: torch.device, dtype: torch.dtype,
              forward: Optional[ForwardFn], repeats: int, together: bool = False) -> tuple[float, float]:
    twin = meta_copy(module, dtype).train()  # as in training: no key/value cache carried between calls
    block = twin.get_submodule(name)
    captured: list[Any] = []

    def grab(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        captured.append((args, kwargs))
        raise _Captured

    handle = block.register_forward_pre_hook(grab, with_kwargs=True)
    try:
        with DataDependentOnMeta():  # routed layers before the block: shapes only (core.meta_ops)
            (forward or _default_forward)(twin, torch.zeros(mb, seq_len, dtype=torch.long, device="meta"))
    except _Captured:
        pass
    finally:
        handle.remove()
    if not captured:
        raise ValueError(f"the model's forward never called block {name!r} on the meta device; its time cannot be "
                         f"measured. Pass blocks='<container>' naming the blocks it runs")
    real = copy.deepcopy(block).to_empty(device=device)
    with torch.no_grad():
        for p in real.parameters():
            p.normal_(0.0, 0.02) if p.is_floating_point() else p.zero_()
        for b in real.buffers():
            b.zero_()
    args, kwargs = captured[0]
    args = tuple(None if "Cache" in type(v).__name__ else v for v in args)
    kwargs = {k: None if "Cache" in type(v).__name__ else False if k == "use_cache" else v for k, v in kwargs.items()}
    captured[0] = (args, kwargs)  # a key/value cache (Hugging Face) would carry one run's graph into the next
    # fresh leaves each pass: nothing kept between runs
    return _passes(real, lambda: tree_map(lambda t: _real(t, device), captured[0]), device, repeats, together)


def _passes(run: Callable[..., Any], inputs: Callable[[], tuple[tuple, dict]], device: torch.device, repeats: int,
            together: bool, after: Optional[Callable[[], Any]] = None) -> tuple[float, float]:
    """(forward, backward) seconds of ``run(*args, **kwargs)`` on fresh ``inputs()`` and a backward of its floating
    outputs' sum: ``_pick`` of ``repeats`` after one warm-up; ``after`` runs between passes, untimed."""
    forwards, backwards = [], []
    for _ in range(repeats + 1):
        args, kwargs = inputs()
        start = time.perf_counter()
        result = run(*args, **kwargs)
        _sync(device)
        middle = time.perf_counter()
        loss = sum(t.float().sum() for t in _tensors(result) if t.requires_grad)
        if isinstance(loss, Tensor):
            loss.backward()
        _sync(device)
        forwards.append(middle - start)
        backwards.append(time.perf_counter() - middle)
        if after is not None:
            after()
    return _pick(forwards[1:], together), _pick(backwards[1:], together)


def _pick(samples: Sequence[float], together: bool) -> float:
    """The least sample (the work itself, timed alone), or the median (timed beside the other processes: the
    sharing is part of what is measured, the least would be a moment when the others were idle)."""
    ordered = sorted(samples)
    return ordered[len(ordered) // 2] if together else ordered[0]


def _real(t: Any, device: torch.device) -> Any:
    if not isinstance(t, Tensor):
        return t
    if t.is_floating_point():
        return torch.randn(t.shape, dtype=t.dtype, device=device).requires_grad_(t.requires_grad)
    if t.dtype == torch.bool:
        return torch.ones(t.shape, dtype=t.dtype, device=device)
    return torch.zeros(t.shape, dtype=t.dtype, device=device)


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value] if value.is_floating_point() else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors(v)]
    if isinstance(value, Mapping):
        return [t for v in value.values() for t in _tensors(v)]
    return [t for t in _tensors(getattr(value, "last_hidden_state", None))] if hasattr(value, "last_hidden_state") \
        else []


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
