"""A pipeline stage keeps the user's real modules and runs the model's *own* forward, unchanged.

Every block (and every module with parameters before the blocks) gets a dispatcher. During the run of stage ``g``,
which holds blocks ``[start, end)``::

    block < start - 1   -> zeros shaped like its output (the shape comes from a meta-device twin; no parameters)
    block == start - 1  -> the activation received from stage g - 1 (what that block returned there)
    start <= block < end -> the real block
    block == end - 1    -> and then stop the forward (StageOutput), unless this is the last stage

so embeddings, masks, rotary tables and whatever the forward computes between blocks need no annotation, and the
loss is the user's own ``training_step`` on the last stage. Modules of other stages are replaced by
:class:`_RemoteModule` (no parameters: its ``state_dict`` keys are gone, a subset of the single-device keys remains).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn
from torch.utils._pytree import tree_map

from lightning_tpp._tp_layers import swap_class


class StageOutput(BaseException):
    """Raised by the last block of a non-final stage to end the forward; carries that block's output."""

    def __init__(self, value: Any) -> None:
        super().__init__()
        self.value = value


@dataclass
class RunContext:
    stage: int
    start: int
    end: int
    first: bool
    last: bool
    receive: Callable[[Any], Any]  # meta-shaped output of block start-1 -> the received output


def meta_twin(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no memory, shapes only)."""
    memo: dict[int, Any] = {}
    for p in module.parameters():
        memo[id(p)] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    for b in module.buffers():
        memo[id(b)] = torch.empty_like(b, device="meta")
    return copy.deepcopy(module, memo)


def _signature(obj: Any, depth: int = 0) -> Any:
    if isinstance(obj, Tensor):
        return ("T", tuple(obj.shape), obj.dtype)
    if depth > 4:
        return type(obj).__name__
    if isinstance(obj, (list, tuple)):
        return tuple(_signature(v, depth + 1) for v in obj)
    if isinstance(obj, dict):
        return tuple((k, _signature(v, depth + 1)) for k, v in obj.items())
    if obj is None or isinstance(obj, (bool, int, float, str)):
        return obj
    return type(obj).__name__


def _to_meta(args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    from lightning_tpp._tp_apply import _tensors

    memo = {id(t): torch.empty_like(t.detach(), device="meta") for t in _tensors((args, kwargs), set())}
    return copy.deepcopy((args, kwargs), memo)


class StageRuntime:
    """The state the dispatchers consult: the current run, and a cache of output shapes per input signature."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.ctx: Optional[RunContext] = None
        self._shapes: dict[tuple, Any] = {}

    def meta_output(self, twin: nn.Module, args: tuple, kwargs: dict) -> Any:
        key = (id(twin), _signature(args), _signature(kwargs))
        if key not in self._shapes:
            margs, mkwargs = _to_meta(args, kwargs)
            with torch.no_grad():
                self._shapes[key] = twin(*margs, **mkwargs)
        return self._shapes[key]

    def zeros(self, meta: Any) -> Any:
        return tree_map(lambda t: torch.zeros(t.shape, dtype=t.dtype, device=self.device)
                        if isinstance(t, Tensor) else t, meta)

    def dispatch(self, module: nn.Module, args: tuple, kwargs: dict, real: Optional[Callable[[], Any]]) -> Any:
        kind, index = module.__dict__["_tpp_kind"], module.__dict__["_tpp_index"]
        ctx = self.ctx
        if ctx is None:
            if real is None:
                raise RuntimeError(f"{module.__dict__['_tpp_name']} lives on another pipeline stage: run the model "
                                   f"through the Trainer (fit/validate/test/predict)")
            return real()
        if kind == "pre":
            return real() if ctx.first and real is not None else self.zeros(
                self.meta_output(module.__dict__["_tpp_twin"], args, kwargs))
        if kind == "post":
            if real is None:
                raise RuntimeError(f"{module.__dict__['_tpp_name']} ran on stage {ctx.stage}, which does not hold it")
            return real()
        if ctx.start <= index < ctx.end:
            out = real()  # type: ignore[misc]
            if index == ctx.end - 1 and not ctx.last:
                raise StageOutput(out)
            return out
        meta = self.meta_output(module.__dict__["_tpp_twin"], args, kwargs)
        return ctx.receive(meta) if index == ctx.start - 1 else self.zeros(meta)


class _PipelineDispatch:
    """Mixin for this rank's blocks and pre-block modules: ask the runtime whether to run."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        real = lambda: super(_PipelineDispatch, self).forward(*args, **kwargs)  # noqa: E731
        return self.__dict__["_tpp_runtime"].dispatch(self, args, kwargs, real)


class _RemoteModule(nn.Module):
    """Stands in for a module held by another stage: no parameters; attributes read through to a meta twin."""

    def __init__(self, twin: nn.Module, runtime: StageRuntime, *, kind: str, index: int, name: str) -> None:
        super().__init__()
        self.__dict__.update(_tpp_twin=twin, _tpp_runtime=runtime, _tpp_kind=kind, _tpp_index=index, _tpp_name=name)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.__dict__["_tpp_runtime"].dispatch(self, args, kwargs, None)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.__dict__["_tpp_twin"], name)

    def extra_repr(self) -> str:
        return f"remote {self.__dict__['_tpp_kind']} {self.__dict__['_tpp_name']}"


def _set_module(root: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    parent = root.get_submodule(parent_name) if parent_name else root
    setattr(parent, child, new)


def mark_dispatch(module: nn.Module, runtime: StageRuntime, *, kind: str, index: int, name: str,
                  twin: nn.Module) -> None:
    module.__dict__.update(_tpp_twin=twin, _tpp_runtime=runtime, _tpp_kind=kind, _tpp_index=index, _tpp_name=name)
    swap_class(module, _PipelineDispatch)
