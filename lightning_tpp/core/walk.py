"""Walking a call's arguments for the tensors inside them, tracing which tagged tensors a value was computed from,
and the flag that marks a tensor-parallel block's numerical check (its extra forwards are not part of the model's
run)."""

from __future__ import annotations

import contextvars
from typing import Any, Iterator, Optional

from torch import Tensor, nn
from torch.overrides import TorchFunctionMode


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


# True while a block is being verified: its extra forwards are not part of the model's run (a pipeline's dispatchers
# pass them straight to the real modules instead of counting them as the step's calls)
VERIFYING: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_tpp_verifying", default=False)
