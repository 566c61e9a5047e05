"""Hugging Face attention under context parallelism: models whose ``attn_implementation`` is ``eager``.

transformers 5 looks a model's attention function up by the config's ``_attn_implementation`` in its public
registries (``AttentionInterface`` for the attention, ``AttentionMaskInterface`` for the mask). An eager model is
given one more name, registered once: its mask is eager's (a 4-d mask, cut to this rank's rows at each block), its
attention the model's own ``eager_attention_forward`` (from the module that defines its attention class), run on the
whole sequence's keys and values while a block runs on this rank's positions (``ContextAttention.eager``) and
exactly as eager elsewhere (so the model keeps working in any other use: ``_attn_implementation`` is internal to the
config, not written by ``save_pretrained``).

T5's family (in transformers 5: T5, mT5, UMT5, Switch Transformers, Pop2Piano, UDOP) computes a relative position bias
inside its attention, ``compute_bias(query_length, key_length, device, past_seen_tokens)``, from positions ``0 ..
length - 1``; the modules are found by that signature. Under cp they are swapped (:class:`_RelativeBias`): the bias
of this rank's rows is its own ``compute_bias`` once per chunk (the chunk's first position as ``past_seen_tokens``,
every key), never ``sequence x sequence``; an encoder's output read by a cross-attention is gathered whole, so that
the zero bias the module builds beside it has every key's columns. These models take the eager route whatever their
implementation: SDPA's route in transformers builds a causal mask around the bias from the rows' own count. Where
tensor parallelism gave an attention module a copy of its config (its heads), the model's own config is switched
too: the masks are made from it, before the blocks."""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Optional

import torch
from torch import Tensor, nn

from lightning_tpp.context_parallel.attention import ACTIVE
from lightning_tpp.context_parallel.split import gather_positions
from lightning_tpp.core.swap import original_attrs, original_class, swap_class

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


class _RelativeBias:
    """A T5-style attention module under cp (see the module docstring)."""

    def compute_bias(self, query_length: int, key_length: int, device: Any = None, past_seen_tokens: Any = 0
                     ) -> Tensor:
        mode = ACTIVE.get()
        layout = mode.layout if mode is not None else None
        if layout is None or layout.local == layout.length or query_length != layout.local \
                or key_length != layout.local:
            return super().compute_bias(query_length, key_length, device, past_seen_tokens)  # type: ignore[misc]
        compute = super().compute_bias  # type: ignore[misc]
        return torch.cat([compute(layout.chunk, layout.length, device, past_seen_tokens + start)
                          for start in layout.starts()], dim=-2)

    def forward(self, hidden_states: Tensor, *args: Any, **kwargs: Any) -> Any:
        mode = ACTIVE.get()
        at = _key_value_index(original_class(self))  # type: ignore[arg-type]
        source = kwargs.get("key_value_states", args[at] if len(args) > at else None)
        if mode is not None and isinstance(source, Tensor) and source.dim() >= 2 \
                and source.shape[1] == mode.layout.local != mode.layout.length:  # an encoder's output, cut
            whole = gather_positions(source, 1, mode.layout, mode.group)
            if "key_value_states" in kwargs:
                kwargs = {**kwargs, "key_value_states": whole}
            else:
                args = (*args[:at], whole, *args[at + 1:])
        return super().forward(hidden_states, *args, **kwargs)  # type: ignore[misc]


@functools.lru_cache(maxsize=None)
def _key_value_index(cls: type) -> int:
    """Where ``key_value_states`` is among the positional arguments of ``cls.forward`` after ``hidden_states``."""
    return list(inspect.signature(cls.forward).parameters)[2:].index("key_value_states")


def _relative_bias(m: nn.Module) -> bool:
    """Whether ``m`` computes T5's relative position bias (its ``compute_bias`` signature) and reads an encoder's
    output as ``key_value_states``."""
    cls = original_class(m)  # tensor parallelism's class of it takes any arguments
    compute, forward = getattr(cls, "compute_bias", None), getattr(cls, "forward", None)
    if compute is None or forward is None:
        return False
    try:
        bias, call = inspect.signature(compute).parameters, inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False
    return {"query_length", "key_length", "past_seen_tokens"} <= set(bias) and "key_value_states" in call


def route_eager(module: nn.Module, blocks: list[str]) -> list[Any]:
    """The configs of the eager Hugging Face attention modules inside ``blocks`` (and of T5-style ones, whatever
    their implementation, swapped to :class:`_RelativeBias`) switched to the registered name; returns them."""
    configs: dict[int, Any] = {}
    for block in blocks:
        for m in module.get_submodule(block).modules():
            config = getattr(m, "config", None)
            if config is None or _eager_of(m) is None:
                continue
            relative = _relative_bias(m)
            if relative and not isinstance(m, _RelativeBias):
                swap_class(m, _RelativeBias, kept=True)  # a tensor-parallel check's reference computes alike
            if relative or getattr(config, "_attn_implementation", None) == "eager":
                # and the model's own, where tensor parallelism gave the module a copy with its heads: the model's
                # masks are made from that one, before the blocks
                for c in (config, original_attrs(m).get("config")):
                    if c is not None:
                        configs[id(c)] = c
    if not configs or not _register():
        return []
    for config in configs.values():
        config._attn_implementation = NAME
    return list(configs.values())
