"""Walking a call's arguments for the tensors inside them (and the residual stream of a block's call: its first tensor
argument), tracing which tagged tensors a value was computed from, and the flag that marks a tensor-parallel block's
numerical check (its extra forwards are not part of the model's run)."""

from __future__ import annotations

from typing import Any, Callable, Generic, Iterator, Optional, TypeVar

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode

from lightning_tpp._compat import tree_flatten, tree_unflatten


def tensors_in(obj: Any, seen: set[int], depth: int = 0) -> Iterator[Tensor]:
    if id(obj) in seen or depth > 6:
        return
    seen.add(id(obj))
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from tensors_in(v, seen, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from tensors_in(v, seen, depth + 1)
    elif hasattr(obj, "__dict__") and not isinstance(obj, (nn.Module, type)):
        for v in vars(obj).values():
            yield from tensors_in(v, seen, depth + 1)


Where = tuple[str, Any]  # ("arg", index) or ("kw", name)


def ancestors(name: str) -> list[str]:
    """The module names above ``name`` (``"a.b.c"`` -> ``["", "a", "a.b"]``)."""
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(len(parts))]


def stream_index(args: tuple, kwargs: dict) -> Optional[Where]:
    """Where the residual stream is in a block's call: its first tensor argument (positional, else keyword)."""
    for i, a in enumerate(args):
        if isinstance(a, Tensor):
            return ("arg", i)
    for k, v in kwargs.items():
        if isinstance(v, Tensor):
            return ("kw", k)
    return None


def replace_arg(args: tuple, kwargs: dict, where: Where, value: Any) -> tuple[tuple, dict]:
    if where[0] == "arg":
        return args[:where[1]] + (value,) + args[where[1] + 1:], kwargs
    return args, {**kwargs, where[1]: value}


def get_arg(args: tuple, kwargs: dict, where: Where) -> Any:
    return args[where[1]] if where[0] == "arg" else kwargs[where[1]]


def map_first_tensor(out: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``fn`` on a block output's hidden state: the output itself, or the first tensor of a tuple/list/dict."""
    if isinstance(out, Tensor):
        return fn(out)
    leaves, spec = tree_flatten(out)
    for i, leaf in enumerate(leaves):
        if isinstance(leaf, Tensor):
            leaves[i] = fn(leaf)
            return tree_unflatten(leaves, spec)
    return out


class Taint(TorchFunctionMode):
    """Tags each tensor with the sources it was computed from: what the caller tagged (a pipeline unit's outputs,
    a linear layer's output), carried through every torch function (in-place ones tag their first argument)."""

    def __init__(self) -> None:
        super().__init__()
        self.tags: dict[int, tuple[Tensor, frozenset]] = {}
        self.paused = False

    def tag(self, t: Tensor, tags: frozenset) -> None:
        old = self.tags.get(id(t))
        self.tags[id(t)] = (t, tags | old[1] if old is not None and old[0] is t else tags)

    def of(self, obj: Any) -> frozenset:
        out: set = set()
        for t in tensors_in(obj, set()):
            entry = self.tags.get(id(t))
            if entry is not None and entry[0] is t:
                out |= entry[1]
        return frozenset(out)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if not self.paused:
            tags = self.of((args, kwargs))
            if tags:
                for t in tensors_in(out, set()):
                    self.tag(t, tags)
                if args and isinstance(args[0], Tensor) and (out is None or getattr(func, "__name__", "")[-1:] == "_"):
                    self.tag(args[0], tags)  # in place (x[i] = y, x.add_(y))
        return out


T = TypeVar("T")


class Scoped(Generic[T]):
    """A value set for the extent of a call, with ``contextvars.ContextVar``'s ``get`` / ``set`` / ``reset``, held as
    a plain attribute: ``torch.compile`` traces its reads inside a compiled block, where ``ContextVar.get`` is a graph
    break (every one the strategy's tensor-parallel layers made). One value per process, not per thread: a model's
    forward and backward run on one thread at a time (a backward thread of autograd's sees the value its forward's
    caller left, as it would see the default of a ContextVar it did not set)."""

    __slots__ = ("name", "value")

    def __init__(self, name: str, default: T) -> None:
        self.name, self.value = name, default

    def get(self) -> T:
        return self.value

    def set(self, value: T) -> tuple[T]:
        token = (self.value,)
        self.value = value
        return token

    def reset(self, token: tuple[T]) -> None:
        self.value = token[0]


# the context-parallel attention (a function mode) while a block runs on this rank's positions: it takes every
# scaled_dot_product_attention call (in core: tensor parallelism's dropout over shards must leave those calls to it)
CONTEXT_ATTENTION: Scoped[Optional[Any]] = Scoped("tpp_cp_attention", None)

# True while a block is being verified: its extra forwards are not part of the model's run (a pipeline's dispatchers
# pass them straight to the real modules instead of counting them as the step's calls)
VERIFYING: Scoped[bool] = Scoped("lightning_tpp_verifying", False)
