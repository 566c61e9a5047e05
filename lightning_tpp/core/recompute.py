"""Activation checkpointing per block: a block's forward keeps only its inputs; backward runs the block again.

``recompute_blocks(model, names)`` turns each named block into ``Recomputed[Block]`` (a class swap, see ``swap``):
identity, parameters and their single-device names unchanged (torch's ``CheckpointWrapper`` would add
``_checkpoint_wrapped_module`` to every name). Its forward runs under ``torch.utils.checkpoint`` (non-reentrant)::

    forward   block(x, ...) -> out             tensors saved inside the block are dropped (the inputs are kept)
    backward  first saved tensor needed  ->  block(x, ...) again, same RNG state and autocast  ->  gradients

On one module the swaps nest, outermost first: pipeline dispatcher (``_tpp_unit``: whether this stage runs the block)
-> recompute -> the user's forward, whose tensor-parallel blocks (``_tpp_block``) enter their scope and local-shape
mode on every run, recomputation included (their first-call check runs in the first forward only, without grad).

What the recomputation must reproduce besides the block's code:

- *Modes active around the forward.* A pipeline stage whose backward is split (zero-bubble) runs its forward under a
  mode that makes weight products file their weight gradients; the recomputed forward must save what those products
  saved. Such a caller wraps the forward in :func:`replay_on_recompute`, which re-enters a fresh context around every
  recomputation of the blocks run inside it.
- *State the forward changes in its arguments.* A Hugging Face layer appends its keys and values to the
  ``DynamicCache`` it is given; running it twice would append them twice. A call whose arguments hold objects other
  than tensors, modules and plain values is recomputed on a copy of them taken before the first run (tensors and
  modules shared), so that the real objects see the forward once.

Recomputation is skipped when gradients are off (evaluation, the pipeline's tracing run): there is no backward.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
from typing import Any, Callable, ContextManager, Iterator, Optional

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from lightning_tpp.core.swap import swap_class
from lightning_tpp.core.walk import Scoped

ContextFactory = Callable[[], ContextManager]

# contexts to re-enter around each recomputation of a block run in the current forward (see replay_on_recompute)
_REPLAY: Scoped[tuple[ContextFactory, ...]] = Scoped("lightning_tpp_replay", ())
_RECOMPUTING: Scoped[bool] = Scoped("lightning_tpp_recomputing", False)
_PLAIN = (bool, int, float, complex, str, bytes, type(None), torch.dtype, torch.device, torch.Size, slice)


@contextlib.contextmanager
def replay_on_recompute(factory: ContextFactory) -> Iterator[None]:
    """Blocks recomputed whose forward runs inside this ``with`` recompute inside ``factory()`` (a fresh context each
    time: the recomputation runs in backward, after this ``with`` has been left)."""
    token = _REPLAY.set(_REPLAY.get() + (factory,))
    try:
        yield
    finally:
        _REPLAY.reset(token)


class _Replayed:
    """The context of one recomputation: the factories registered when the forward ran, entered in order."""

    def __init__(self, factories: tuple[ContextFactory, ...]) -> None:
        self.factories, self.stack = factories, contextlib.ExitStack()

    def __enter__(self) -> None:
        for factory in self.factories:
            self.stack.enter_context(factory())

    def __exit__(self, *exc: Any) -> None:
        self.stack.close()


def _contexts() -> tuple[ContextManager, ContextManager]:  # torch.utils.checkpoint's context_fn, called in forward
    return contextlib.nullcontext(), _Replayed(_REPLAY.get())


def _stateful(obj: Any, depth: int = 0) -> bool:
    """Whether ``obj`` holds an object the forward may change (anything but tensors, modules, plain values and
    containers of them)."""
    if isinstance(obj, (Tensor, nn.Module, type) + _PLAIN) or inspect.isroutine(obj):
        return False
    if isinstance(obj, (list, tuple)) and depth < 6:
        return any(_stateful(v, depth + 1) for v in obj)
    if isinstance(obj, dict) and depth < 6:
        return any(_stateful(v, depth + 1) for v in obj.values())
    return True


def _shared(obj: Any, memo: dict[int, Any], depth: int = 0) -> None:
    """Tensors and modules reachable from ``obj``, to be shared (not copied) by a deep copy."""
    if id(obj) in memo or depth > 8 or isinstance(obj, _PLAIN):
        return
    if isinstance(obj, (Tensor, nn.Module)):
        memo[id(obj)] = obj
        return
    values = obj.values() if isinstance(obj, dict) else obj if isinstance(obj, (list, tuple)) else (
        vars(obj).values() if hasattr(obj, "__dict__") and not isinstance(obj, type) else ())
    for v in list(values):
        _shared(v, memo, depth + 1)


class _Call:
    """The block's forward as ``torch.utils.checkpoint`` calls it: the first time on the real arguments, then
    (recomputation) on a copy of them as they were before the first run, if they hold state (module docstring)."""

    def __init__(self, forward: Callable[..., Any], args: tuple, kwargs: dict, owner: nn.Module) -> None:
        self.forward, self.ran = forward, False
        self.before: Optional[tuple[tuple, dict]] = None
        if _stateful((args, kwargs)):
            self.before = _copy(args, kwargs, owner)

    def __call__(self, args: tuple, kwargs: dict) -> Any:
        if not self.ran:
            self.ran = True
            return self.forward(*args, **kwargs)
        if self.before is not None:
            args, kwargs = copy.deepcopy(self.before, _memo(self.before))
        token = _RECOMPUTING.set(True)
        try:
            return self.forward(*args, **kwargs)
        finally:
            _RECOMPUTING.reset(token)


def recomputing() -> bool:
    """Whether a block's forward is running again in backward (state a forward accumulates, such as batch
    statistics, must not count it twice)."""
    return _RECOMPUTING.get()


def _memo(obj: Any) -> dict[int, Any]:
    memo: dict[int, Any] = {}
    _shared(obj, memo)
    return memo


def _copy(args: tuple, kwargs: dict, owner: nn.Module) -> tuple[tuple, dict]:
    try:
        return copy.deepcopy((args, kwargs), _memo((args, kwargs)))
    except Exception as err:
        kinds = sorted({type(v).__name__ for v in (*args, *kwargs.values()) if _stateful(v)})
        raise TypeError(
            f"activation checkpointing recomputes {type(owner).__name__} on a copy of its arguments as they were "
            f"before its forward (they hold {', '.join(kinds)}, which the forward may change), and copying them "
            f"failed: {type(err).__name__}: {err}. Pass tensors and plain values to the block, or use "
            f"activation_checkpointing=False") from err


class _Recomputed:
    """Mixin for a block whose activations are recomputed in backward (see the module docstring)."""

    _tpp_compiled: Optional[Callable[..., Any]] = None  # compile=: the block's own forward compiled (compile_inside)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        forward = self._tpp_compiled or super().forward  # type: ignore[misc]
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        call = _Call(forward, args, kwargs, self)  # type: ignore[arg-type]
        # args and kwargs passed as two positional pytrees: torch finds the devices whose RNG state to keep there
        return checkpoint(call, args, kwargs, use_reentrant=False, context_fn=_contexts)


def compile_inside(module: nn.Module, compile_fn: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    """``compile=`` on a recomputed block: its own forward compiled, run by ``torch.utils.checkpoint`` in forward and
    again in backward, the checkpoint and the copy of its arguments kept outside the graph (dynamo cannot trace
    them: traced, the whole block ran eagerly)."""
    module._tpp_compiled = compile_fn(super(_Recomputed, module).forward)  # type: ignore[attr-defined]


def is_recomputed(module: nn.Module) -> bool:
    return isinstance(module, _Recomputed)


def recompute_blocks(model: nn.Module, names: list[str]) -> tuple[str, ...]:
    """Recompute the activations of the modules ``names`` of ``model`` in backward (in place; idempotent)."""
    modules = dict(model.named_modules())
    for name in names:
        if not is_recomputed(modules[name]):
            swap_class(modules[name], _Recomputed)
    return tuple(names)
