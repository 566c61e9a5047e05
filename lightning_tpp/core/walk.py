"""Walking a call's arguments for the tensors inside them, and the flag that marks a tensor-parallel block's
numerical check (its extra forwards are not part of the model's run)."""

from __future__ import annotations

import contextvars
from typing import Any, Iterator

from torch import Tensor, nn

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

# True while a block is being verified: its extra forwards are not part of the model's run (a pipeline's dispatchers
# pass them straight to the real modules instead of counting them as the step's calls)
VERIFYING: contextvars.ContextVar[bool] = contextvars.ContextVar("lightning_tpp_verifying", default=False)
