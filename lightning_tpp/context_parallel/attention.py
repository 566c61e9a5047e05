"""Attention over the whole sequence from this rank's query rows (``cp_mode="allgather"``).

Inside a block that runs on this rank's positions, every call of ``torch.nn.functional.scaled_dot_product_attention``
(the hand-written model's own call, or Hugging Face's ``sdpa`` attention interface) whose queries are this rank's
rows is taken over by :class:`ContextAttention`, a ``TorchFunctionMode``:

- keys and values of this rank's positions are all-gathered over cp and put in natural order (their gradients
  reduce-scattered in backward); keys of another length (cross-attention to a stack that was not cut) are left.
  In training the gather and the attention are recomputed in backward (``torch.utils.checkpoint``): kept, the whole
  sequence's keys and values would cost every rank ``cp`` times its own part in every layer;
- ``is_causal=True`` runs per chunk: the head chunk at positions ``[a, a + c)`` attends the first ``a + c`` keys
  under a lower-right causal bias (``torch.nn.attention.bias.causal_lower_right``: no mask is materialised where the
  kernel supports it), the tail chunk likewise, so each rank computes only the causal half of its rows;
- any other mask is the model's own, cut to this rank's rows where it has one per query (its columns are every
  key's), and the padded keys are dropped, so sliding windows, padding, packed documents, bidirectional and
  relative-position biases stay exactly what the model built.

The model's own call does the rest (its scale, dropout, GQA), so the result is what one process computes for these
rows. ``nn.MultiheadAttention`` (``F.multi_head_attention_forward``, which projects keys and values itself) gets the whole
sequence's inputs for its keys and values instead. A Hugging Face model whose attention is ``eager`` (matmul ->
softmax -> matmul) is routed through
transformers' own attention-interface registry to :meth:`ContextAttention.eager` (``hf.py``): its own eager function
on the whole sequence's keys. Other attention written as ``matmul -> softmax -> matmul`` is not an SDPA call: the
block's first-call check finds it (its keys are this rank's only) and names it.
"""

from __future__ import annotations

import contextvars
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from lightning_tpp.core.comm import TPGroup
from lightning_tpp.context_parallel.split import SeqLayout, gather_positions, pad_fill

_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward
ACTIVE: contextvars.ContextVar[Optional["ContextAttention"]] = contextvars.ContextVar("tpp_cp_attention", default=None)


@dataclass
class Traffic:
    """What the context-parallel exchanges cost since the last read (``cp/`` metrics)."""

    bytes: int = 0  # sent by this rank (all-gathers of keys, values and block outputs)
    attention_seconds: float = 0.0  # wall time in the attention calls taken over (exchange included)
    calls: int = 0

    def take(self) -> dict[str, float]:
        out = {"bytes": float(self.bytes), "attention_seconds": self.attention_seconds, "calls": float(self.calls)}
        self.bytes, self.attention_seconds, self.calls = 0, 0.0, 0
        return out


class _KeptLocal(torch.autograd.Function):
    """On the meta device (the memory planner): the attention's output, with what its recompute keeps saved (this
    rank's queries, keys and values and the output); the backward is shapes only."""

    @staticmethod
    def forward(ctx: Any, mode: "ContextAttention", query: Tensor, key: Tensor, value: Tensor, mask: Any,
                dropout_p: float, is_causal: bool, options: dict) -> Tensor:
        with torch.no_grad():
            out = mode._attend(query, key, value, mask, dropout_p, is_causal, True, options)
        ctx.save_for_backward(query, key, value, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        query, key, value, _ = ctx.saved_tensors
        return None, torch.empty_like(query), torch.empty_like(key), torch.empty_like(value), None, None, None, None


def _lower_right(rows: int, keys: int, device: torch.device) -> Any:
    """Causal attention of the last ``rows`` positions of ``keys``: torch's ``CausalBias`` (no mask materialised where
    the kernel takes it: flash and memory-efficient attention), or the boolean mask it stands for where a tensor
    subclass cannot be made (the memory planner's meta forward)."""
    if device.type == "meta":
        return torch.ones(rows, keys, dtype=torch.bool, device=device).tril(keys - rows)
    return causal_lower_right(rows, keys)


class ContextAttention(TorchFunctionMode):
    """Active while a block runs on this rank's positions (see the module docstring); ``taken``: the attention calls
    it took over."""

    keep_in_checks = True  # a first-call check's reference must attend the same keys (_compat.outside_function_modes)

    def __init__(self, group: TPGroup, layout: SeqLayout, traffic: Traffic) -> None:
        super().__init__()
        self.group, self.layout, self.traffic, self.taken = group, layout, traffic, 0
        self._tokens: list[Any] = []  # entered again inside a first-call check (outside_function_modes)

    def __enter__(self) -> "ContextAttention":
        self._tokens.append(ACTIVE.set(self))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        ACTIVE.reset(self._tokens.pop())
        return super().__exit__(*exc)

    def eager(self, attend: Callable[..., Any], module: Any, query: Tensor, key: Tensor, value: Tensor,
              mask: Optional[Tensor], options: dict) -> Any:
        """A Hugging Face eager attention (the model's own ``eager_attention_forward``: matmul, its mask, softmax,
        sinks or soft-capping as it has them) on this rank's query rows and the whole sequence's keys and values,
        the mask's rows this rank's (hf.py routes it here)."""
        layout, n = self.layout, self.layout.local
        if query.shape[-2] != n or key.shape[-2] != n:
            return attend(module, query, key, value, mask, **options)
        self.taken += 1
        start = time.perf_counter()
        self.traffic.bytes += (key.numel() + value.numel()) * key.element_size() * (layout.cp - 1)

        def run(q: Tensor, k: Tensor, v: Tensor, m: Optional[Tensor]) -> Any:
            k = gather_positions(k, -2, layout, self.group)  # the padded keys dropped: the mask's columns are real
            v = gather_positions(v, -2, layout, self.group)
            return attend(module, q, k, v, self._mask_rows(m, k.shape[-2]) if m is not None else None, **options)

        if torch.is_grad_enabled() and not query.is_meta and (query.requires_grad or key.requires_grad):
            out = checkpoint(run, query, key, value, mask, use_reentrant=False,
                             preserve_rng_state=bool(options.get("dropout")))
        else:
            out = run(query, key, value, mask)
        self.traffic.attention_seconds += time.perf_counter() - start
        self.traffic.calls += 1
        return out

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func is _SDPA:
            return self.attention(*args, **kwargs)
        if func is _MHA:
            return self.multi_head(*args, **kwargs)
        return func(*args, **kwargs)

    def multi_head(self, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
        """``nn.MultiheadAttention`` (and the ``nn.Transformer`` layers): its inputs are gathered instead of its keys
        and values, which it projects inside (``(sequence, batch, features)``; each rank projects every position's
        keys and values), so that its mask of this rank's rows against every key is the shape it checks for."""
        layout, n = self.layout, self.layout.local
        if query.dim() < 2 or query.shape[0] != n or key.shape[0] != n:
            return _MHA(query, key, value, *args, **kwargs)
        self.taken += 1
        start = time.perf_counter()
        self.traffic.bytes += (key.numel() + (value.numel() if value is not key else 0)) * key.element_size() * (
            layout.cp - 1)
        if kwargs.get("is_causal") and kwargs.get("attn_mask") is not None:
            kwargs = {**kwargs, "is_causal": False}  # a hint that would become SDPA's top-left is_causal: the mask
        whole_key = gather_positions(key, 0, layout, self.group)
        whole_value = whole_key if value is key else gather_positions(value, 0, layout, self.group)
        out = _MHA(query, whole_key, whole_value, *args, **kwargs)
        self.traffic.attention_seconds += time.perf_counter() - start
        self.traffic.calls += 1
        return out

    def attention(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor] = None,
                  dropout_p: float = 0.0, is_causal: bool = False, **options: Any) -> Tensor:
        layout, n = self.layout, self.layout.local
        if query.dim() < 2 or query.shape[-2] != n:  # not over this rank's positions
            return _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal, **options)
        self.taken += 1
        start = time.perf_counter()
        device = query.device.type
        if device != "meta" and torch.is_autocast_enabled(device):  # what autocast does to an SDPA call, before the per-chunk calls
            dtype = torch.get_autocast_dtype(device)  # (torch's causal bias checks the dtypes before autocast would)
            query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
        gathered = key.shape[-2] == n  # this rank's keys: the whole sequence's, gathered
        if gathered:
            self.traffic.bytes += (key.numel() + value.numel()) * key.element_size() * (layout.cp - 1)
        if gathered and query.is_meta and torch.is_grad_enabled():  # the memory planner: what the recompute keeps
            out = _KeptLocal.apply(self, query, key, value, attn_mask, dropout_p, is_causal, options)
        elif gathered and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
            # backward gathers the keys and values again and recomputes this attention: what it keeps is this
            # rank's part (the whole sequence's keys and values, kept, would be cp times a block's own)
            out = checkpoint(self._attend, query, key, value, attn_mask, dropout_p, is_causal, gathered, options,
                             use_reentrant=False, preserve_rng_state=dropout_p > 0)
        else:
            out = self._attend(query, key, value, attn_mask, dropout_p, is_causal, gathered, options)
        self.traffic.attention_seconds += time.perf_counter() - start
        self.traffic.calls += 1
        return out

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                is_causal: bool, gathered: bool, options: dict) -> Tensor:
        layout = self.layout
        if gathered:
            key = gather_positions(key, -2, layout, self.group, trim=False)
            value = gather_positions(value, -2, layout, self.group, trim=False)
        if is_causal:
            if attn_mask is not None:
                raise ValueError("scaled_dot_product_attention: attn_mask and is_causal=True together")
            out = self._causal(query, key, value, dropout_p, options)
        else:
            if key.shape[-2] == layout.padded and layout.padded != layout.length:  # padded keys are never read
                key, value = key.narrow(-2, 0, layout.length), value.narrow(-2, 0, layout.length)
            if attn_mask is not None:
                attn_mask = self._mask_rows(attn_mask, key.shape[-2])
            out = _SDPA(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, **options)
        return out

    def _causal(self, query: Tensor, key: Tensor, value: Tensor, dropout_p: float, options: dict) -> Tensor:
        """Each chunk's rows against the keys up to its last position (padded keys sit after every real one, so a
        real row never reads them)."""
        layout, c = self.layout, self.layout.chunk
        if key.shape[-2] != layout.padded:
            raise ValueError(f"context parallelism: a causal attention over this rank's {layout.local} positions got "
                             f"{key.shape[-2]} keys (the sequence has {layout.length})")
        outs = []
        for j, a in enumerate(self.layout.starts()):
            q = query.narrow(-2, j * c, c)
            k, v = key.narrow(-2, 0, a + c), value.narrow(-2, 0, a + c)
            if a == 0:
                outs.append(_SDPA(q, k, v, dropout_p=dropout_p, is_causal=True, **options))
            else:
                outs.append(_SDPA(q, k, v, attn_mask=_lower_right(c, a + c, q.device), dropout_p=dropout_p,
                                  **options))
        return torch.cat(outs, dim=-2)

    def _mask_rows(self, mask: Tensor, keys: int) -> Tensor:
        """The model's mask for this rank's rows: one with a row per position of the sequence is cut to this rank's
        (padded rows attend everything), a broadcast row is kept; its columns are the keys'."""
        layout = self.layout
        if mask.dim() >= 2 and mask.shape[-2] == layout.length and layout.length != layout.local:
            rows = mask.dim() - 2
            whole = torch.cat([mask, mask.new_full((*mask.shape[:-2], layout.padded - layout.length, mask.shape[-1]),
                                                   pad_fill(mask))], dim=rows) if layout.padded > layout.length else mask
            mask = whole.index_select(rows, layout.index(mask.device))
        if mask.shape[-1] != keys and mask.shape[-1] == layout.padded:
            mask = mask.narrow(-1, 0, keys)
        return mask
