"""Hugging Face attention under context parallelism: models whose ``attn_implementation`` is ``eager``.

transformers 5 looks a model's attention function up by the config's ``_attn_implementation`` in its public
registries (``AttentionInterface`` for the attention, ``AttentionMaskInterface`` for the mask). An eager model is
given one more name, registered once: its mask is eager's (a 4-d mask, cut to this rank's rows at each block), its
attention the model's own ``eager_attention_forward`` (from the module that defines its attention class), run on the
whole sequence's keys and values while a block runs on this rank's positions (``ContextAttention.eager``) and
exactly as eager elsewhere (so the model keeps working in any other use: ``_attn_implementation`` is internal to the
config, not written by ``save_pretrained``)."""

from __future__ import annotations

import sys
from typing import Any, Callable, Optional

from torch import nn

from lightning_tpp.context_parallel.attention import ACTIVE

NAME = "lightning_tpp_cp_eager"
_REGISTERED: list[bool] = []


def _eager_of(module: nn.Module) -> Optional[Callable[..., Any]]:
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def _attention(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any, **options: Any) -> Any:
    eager = _eager_of(module)
    if eager is None:
        raise RuntimeError(f"context parallelism: {type(module).__name__} has no eager_attention_forward in "
                           f"{type(module).__module__}; load the model with attn_implementation='sdpa'")
    mode = ACTIVE.get()
    if mode is None:
        return eager(module, query, key, value, attention_mask, **options)
    return mode.eager(eager, module, query, key, value, attention_mask, options)


def _register() -> bool:
    if _REGISTERED:
        return True
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
    except ImportError:  # transformers absent or older than its attention registries
        return False
    AttentionInterface.register(NAME, _attention)
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    _REGISTERED.append(True)
    return True


def route_eager(module: nn.Module, blocks: list[str]) -> list[Any]:
    """The configs of the eager Hugging Face attention modules inside ``blocks`` switched to the registered name;
    returns them."""
    configs: dict[int, Any] = {}
    for block in blocks:
        for m in module.get_submodule(block).modules():
            config = getattr(m, "config", None)
            if getattr(config, "_attn_implementation", None) == "eager" and _eager_of(m) is not None:
                configs[id(config)] = config
    if not configs or not _register():
        return []
    for config in configs.values():
        config._attn_implementation = NAME
    return list(configs.values())
