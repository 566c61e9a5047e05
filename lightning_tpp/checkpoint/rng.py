"""Per-rank RNG states as plain values, so that they travel in ``weights_only`` checkpoints."""

from __future__ import annotations

from typing import Any

import torch

from lightning_tpp._compat import collect_rng_states as _collect_rng_states
from lightning_tpp._compat import set_rng_states as _set_rng_states


def rng_state() -> dict[str, Any]:
    """This process's RNG states as plain Python values (bytes, ints): picklable for ``all_gather_object`` and
    accepted by ``weights_only`` loading."""
    state = _collect_rng_states()
    out: dict[str, Any] = {"torch": bytes(state["torch"].numpy()), "python": state["python"]}
    if "numpy" in state:
        name, keys, pos, has_gauss, cached = state["numpy"]
        out["numpy"] = (name, [int(k) for k in keys], int(pos), int(has_gauss), float(cached))
    if state.get("torch.cuda"):
        out["torch.cuda"] = [bytes(t.cpu().numpy()) for t in state["torch.cuda"]]
    return out


def set_rng_state(state: dict[str, Any]) -> None:
    restored: dict[str, Any] = {"torch": torch.frombuffer(bytearray(state["torch"]), dtype=torch.uint8),
                                "python": state["python"]}
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        restored["numpy"] = (name, np.array(keys, dtype=np.uint32), pos, has_gauss, cached)
    if state.get("torch.cuda") and torch.cuda.is_available():
        restored["torch.cuda"] = [torch.frombuffer(bytearray(b), dtype=torch.uint8) for b in state["torch.cuda"]]
    _set_rng_states(restored)
