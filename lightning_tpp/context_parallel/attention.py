"""Attention over the whole sequence from this rank's query rows (``cp_mode="allgather"``).

Inside a block that runs on this rank's positions, every call of ``torch.nn.functional.scaled_dot_product_attention``
(the hand-written model's own call, or Hugging Face's ``sdpa`` attention interface) whose queries are this rank's
rows is taken over by :class:`ContextAttention`, a ``TorchFunctionMode``:

- keys and values of this rank's positions are all-gathered over cp and put in natural order (their gradients
  reduce-scattered in backward); keys of another length (cross-attention to a stack that was not cut) are left.
  In training the gather is done again in backward: kept, the whole sequence's keys and values would cost every rank
  ``cp`` times its own part in every layer. The attention is recomputed there too (``torch.utils.checkpoint``),
  except on CPU under ``is_causal`` (below);
- ``is_causal=True`` runs per chunk: the head chunk at positions ``[a, a + c)`` attends the first ``a + c`` keys
  under a lower-right causal bias (``torch.nn.attention.bias.causal_lower_right``: no mask is materialised where the
  kernel supports it), the tail chunk likewise, so each rank computes only the causal half of its rows. On CPU
  (:class:`_CausalJoined`) a chunk is two calls of the kernel SDPA runs, which also return each row's log-sum-exp:
  the keys before the chunk without a mask, the chunk's own with ``is_causal``, joined by their log-sum-exps; the
  output and log-sum-exp are saved and backward runs the kernel's backward on the gathered keys, recomputing
  nothing (CPU's lower-right bias is a materialised mask, and the recompute a third forward);
- any other mask is the model's own, cut to this rank's rows where it has one per query (its columns are every
  key's), and the padded keys are dropped, so sliding windows, padding, packed documents, bidirectional and
  relative-position biases stay exactly what the model built.

The model's own call does the rest (its scale, dropout, GQA), so the result is what one process computes for these
rows. ``nn.MultiheadAttention`` (``F.multi_head_attention_forward``, which projects keys and values itself) gets the
whole sequence's inputs for its keys and values instead. A Hugging Face model whose attention is ``eager`` (matmul
-> softmax -> matmul) is routed through transformers' own attention-interface registry to
:meth:`ContextAttention.eager` (``hf.py``): its own eager function on the whole sequence's keys. Other attention
written as ``matmul -> softmax -> matmul`` (BLOOM's, research code) has its products' keys and values gathered
(:meth:`ContextAttention.product`, told by their shapes); a mask it builds from its input's length is found by the
block's first-call check, which names it.

Under ``compile=`` these calls run eagerly between the block's graphs (``torch.compiler.disable``): torch's causal
bias and the attention's checkpoint cannot be traced, and a graph break inside the checkpoint made dynamo run the
whole attention frame eagerly anyway.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.bias import causal_lower_right
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

from lightning_tpp._compat import attention_with_lse, attention_with_lse_backward, function_modes
from lightning_tpp.context_parallel.split import SeqLayout, gather_positions, local_positions, pad_to
from lightning_tpp.core.comm import TPGroup, all_to_all_swap
from lightning_tpp.core.walk import CONTEXT_ATTENTION, Scoped

_SDPA = F.scaled_dot_product_attention
_MHA = F.multi_head_attention_forward
# the products attention written by hand is made of, and their parameters' names (the last two: the factors)
_PRODUCTS: dict[Callable, tuple[str, ...]] = {
    torch.matmul: ("input", "other"), Tensor.matmul: ("input", "other"), Tensor.__matmul__: ("input", "other"),
    torch.bmm: ("input", "mat2"), Tensor.bmm: ("input", "mat2"),
    torch.baddbmm: ("input", "batch1", "batch2"), Tensor.baddbmm: ("input", "batch1", "batch2"),
}
ACTIVE: Scoped[Optional["ContextAttention"]] = CONTEXT_ATTENTION


@dataclass
class Traffic:
    """What the context-parallel exchanges cost since the last read (``cp/`` metrics)."""

    bytes: int = 0  # sent by this rank (all-gathers of keys and values, or the all-to-alls of cp_mode="a2a")
    attention_seconds: float = 0.0  # wall time in the attention calls taken over (exchange included)
    calls: int = 0
    a2a_calls: int = 0  # of them, those that exchanged positions for heads (cp_mode="a2a")

    def take(self) -> dict[str, float]:
        out = {"bytes": float(self.bytes), "attention_seconds": self.attention_seconds, "calls": float(self.calls),
               "a2a_calls": float(self.a2a_calls)}
        self.bytes, self.attention_seconds, self.calls, self.a2a_calls = 0, 0.0, 0, 0
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


class _CausalJoined(torch.autograd.Function):
    """``is_causal`` over the whole sequence's keys for this rank's two chunks, on CPU (see the module docstring):
    saved are this rank's queries, keys and values, the output and its log-sum-exp; backward gathers the keys and
    values again and runs the kernel's backward on each part, with the joined output and log-sum-exp."""

    @staticmethod
    def forward(ctx: Any, mode: "ContextAttention", query: Tensor, key: Tensor, value: Tensor,
                scale: Optional[float]) -> Tensor:
        whole_key, whole_value = mode._whole_keys(key, value, query.shape[1])
        batch, heads, rows, _ = query.shape
        # stored as (batch, rows, heads, features), as SDPA's kernels store theirs: the model's usual
        # transpose(1, 2).contiguous() is then no copy, and what the next projection saves is this storage
        out = query.new_empty(batch, rows, heads, value.shape[-1]).transpose(1, 2)
        lse = query.new_empty(batch, heads, rows, dtype=torch.float32)
        for part, keys, causal in mode._causal_parts():
            o, l = attention_with_lse(query[:, :, part], whole_key[:, :, keys], whole_value[:, :, keys], causal,
                                      scale)
            if causal:
                out[:, :, part], lse[:, :, part] = o, l
            else:  # the earlier keys' part, joined to the chunk's own (written first) by their log-sum-exps
                joined = torch.logaddexp(lse[:, :, part], l)
                out[:, :, part] = (out[:, :, part].float() * (lse[:, :, part] - joined).exp().unsqueeze(-1)
                                   + o.float() * (l - joined).exp().unsqueeze(-1)).to(out.dtype)
                lse[:, :, part] = joined
        ctx.mode, ctx.scale = mode, scale
        ctx.save_for_backward(query, key, value, out, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple:
        query, key, value, out, lse = ctx.saved_tensors
        mode = ctx.mode
        with torch.enable_grad():  # the gather (and the heads' repeat) again, its backward the reduce-scatter
            key_in, value_in = key.detach().requires_grad_(), value.detach().requires_grad_()
            whole_key, whole_value = mode._whole_keys(key_in, value_in, query.shape[1])
        d_query = torch.zeros_like(query)
        d_key, d_value = torch.zeros_like(whole_key), torch.zeros_like(whole_value)
        for part, keys, causal in mode._causal_parts():
            dq, dk, dv = attention_with_lse_backward(
                grad[:, :, part].contiguous(), query[:, :, part], whole_key[:, :, keys], whole_value[:, :, keys],
                out[:, :, part].contiguous(), lse[:, :, part].contiguous(), causal, ctx.scale)
            d_query[:, :, part] += dq
            d_key[:, :, keys] += dk
            d_value[:, :, keys] += dv
        d_key, d_value = torch.autograd.grad((whole_key, whole_value), (key_in, value_in), (d_key, d_value))
        return None, d_query, d_key, d_value, None


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

    def __init__(self, group: TPGroup, layout: SeqLayout, traffic: Traffic, a2a: bool = False,
                 wholes: Optional[Callable[[Tensor], Optional[Tensor]]] = None) -> None:
        super().__init__()
        self.group, self.layout, self.traffic, self.taken = group, layout, traffic, 0
        self.a2a = a2a  # cp_mode="a2a": SDPA calls exchange positions for heads (Ulysses) instead of gathering keys
        self.products = 0  # of ``taken``, products of attention written as matmul -> softmax -> matmul
        self._wholes = wholes  # the whole-sequence tensor a block input was cut from (a mask's rows), if it was
        self._tokens: list[Any] = []  # entered again inside a first-call check (outside_function_modes)

    def __enter__(self) -> "ContextAttention":
        self._tokens.append(ACTIVE.set(self))
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        ACTIVE.reset(self._tokens.pop())
        return super().__exit__(*exc)

    @torch.compiler.disable  # compile=: between the block's graphs (see the module docstring)
    def eager(self, attend: Callable[..., Any], module: Any, query: Tensor, key: Tensor, value: Tensor,
              mask: Optional[Tensor], options: dict) -> Any:
        """A Hugging Face eager attention (the model's own ``eager_attention_forward``: matmul, its mask, softmax,
        sinks or soft-capping as it has them) on this rank's query rows and the whole sequence's keys and values,
        the mask's rows this rank's (hf.py routes it here)."""
        layout, n = self.layout, self.layout.local
        if query.shape[-2] != n or key.shape[-2] != n:
            return attend(module, query, key, value, mask, **options)
        self.taken += 1
        if self.a2a:
            _fell_back("Hugging Face eager attention (its own function reads the module's head counts)")
        start = time.perf_counter()
        self.traffic.bytes += (key.numel() + value.numel()) * key.element_size() * (layout.cp - 1)

        def run(q: Tensor, k: Tensor, v: Tensor, m: Optional[Tensor]) -> Any:
            k = gather_positions(k, -2, layout, self.group)  # the padded keys dropped: the mask's columns are real
            v = gather_positions(v, -2, layout, self.group)
            return attend(module, q, k, v, self._mask_rows(m, k.shape[-2]) if m is not None else None, **options)

        if torch.is_grad_enabled() and not query.is_meta and (query.requires_grad or key.requires_grad):
            out = checkpoint(run, query, key, value, mask, use_reentrant=False,
                             preserve_rng_state=bool(options.get("dropout")), **_replayed_modes())
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
        if func in _PRODUCTS:
            return self.product(func, args, kwargs)
        return func(*args, **kwargs)

    @torch.compiler.disable  # compile=: between the block's graphs (see the module docstring)
    def product(self, func: Callable, args: tuple, kwargs: dict) -> Any:
        """Attention written as ``matmul -> softmax -> matmul`` (``@``, ``matmul``, ``bmm``, ``baddbmm``, as BLOOM's
        ALiBi attention): a product of this rank's rows with the transposed keys of its own positions (two
        per-position tensors of 3 dimensions or more, neither a parameter, contracted over 2 or more features) gets the
        whole sequence's keys; a product of rows over every key (scores or probabilities) with values of this rank's
        positions gets the whole sequence's values. A ``baddbmm``'s added bias with a column per local key gets
        every key's. The gather runs again in backward (a checkpoint around it and the product), so no rank keeps the
        whole sequence's keys or values. Other products pass through."""
        names = _PRODUCTS[func]
        bound = dict(zip(names, args), **kwargs)
        a, b = bound.get(names[-2]), bound.get(names[-1])
        layout, n = self.layout, self.layout.local
        if not (_per_position(a) and _per_position(b)) or a.shape[-2] != n:
            return func(*args, **kwargs)
        whole = (layout.length, layout.padded)
        if b.shape[-1] == n and a.shape[-1] == b.shape[-2] and a.shape[-1] not in whole and a.shape[-1] > 1:
            dim = -1  # scores: rows x this rank's keys (transposed), contracted over features (not positions; not
            # an outer product, as rotary frequencies times positions are)
        elif b.shape[-2] == n and a.shape[-1] in whole:
            dim = -2  # rows over every key x this rank's values
        else:
            return func(*args, **kwargs)
        self.taken += 1
        self.products += 1
        if self.a2a:
            _fell_back("attention written as matmul -> softmax -> matmul")
        start = time.perf_counter()
        self.traffic.bytes += b.numel() * b.element_size() * (layout.cp - 1)
        trim = dim == -1 or a.shape[-1] == layout.length
        rest = {k: v for k, v in bound.items() if k not in names}  # beta, alpha, out
        first = [bound[k] for k in names[:-2]]  # baddbmm's added bias
        if first and isinstance(first[0], Tensor) and first[0].dim() >= 1 and first[0].shape[-1] == n:
            first[0] = gather_positions(first[0], -1, layout, self.group)  # a column per local key: every key's

        def run(a: Tensor, b: Tensor) -> Tensor:
            return func(*first, a, gather_positions(b, dim, layout, self.group, trim=trim), **rest)

        if torch.is_grad_enabled() and (a.requires_grad or b.requires_grad):
            out = checkpoint(run, a, b, use_reentrant=False, **_replayed_modes())
        else:
            out = run(a, b)
        self.traffic.attention_seconds += time.perf_counter() - start
        self.traffic.calls += 1
        return out

    @torch.compiler.disable  # compile=: between the block's graphs (see the module docstring)
    def multi_head(self, query: Tensor, key: Tensor, value: Tensor, *args: Any, **kwargs: Any) -> Any:
        """``nn.MultiheadAttention`` (and the ``nn.Transformer`` layers): its inputs are gathered instead of its keys
        and values, which it projects inside (``(sequence, batch, features)``; each rank projects every position's
        keys and values), so that its mask of this rank's rows against every key is the shape it checks for."""
        layout, n = self.layout, self.layout.local
        if query.dim() < 2 or query.shape[0] != n or key.shape[0] != n:
            return _MHA(query, key, value, *args, **kwargs)
        self.taken += 1
        if self.a2a:
            _fell_back("nn.MultiheadAttention (it projects its keys and values inside)")
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

    @torch.compiler.disable  # compile=: between the block's graphs (see the module docstring)
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
        if gathered and self.a2a:
            reason = _no_heads_exchange(query, key, layout.cp)
            if reason is None:
                out = self._ulysses(query, key, value, attn_mask, dropout_p, is_causal, options)
                self.traffic.attention_seconds += time.perf_counter() - start
                self.traffic.calls += 1
                self.traffic.a2a_calls += 1
                return out
            _fell_back(reason)
        if gathered:
            self.traffic.bytes += (key.numel() + value.numel()) * key.element_size() * (layout.cp - 1)
        if gathered and query.is_meta and torch.is_grad_enabled():  # the memory planner: what the recompute keeps
            out = _KeptLocal.apply(self, query, key, value, attn_mask, dropout_p, is_causal, options)
        elif gathered and _joins_on_cpu(query, key, value, attn_mask, dropout_p, is_causal, options):
            out = _CausalJoined.apply(self, query, key, value, options.get("scale"))
        elif gathered and torch.is_grad_enabled() and (query.requires_grad or key.requires_grad):
            # backward gathers the keys and values again and recomputes this attention: what it keeps is this
            # rank's part (the whole sequence's keys and values, kept, would be cp times a block's own)
            out = checkpoint(self._attend, query, key, value, attn_mask, dropout_p, is_causal, gathered, options,
                             use_reentrant=False, preserve_rng_state=dropout_p > 0, **_replayed_modes())
        else:
            out = self._attend(query, key, value, attn_mask, dropout_p, is_causal, gathered, options)
        self.traffic.attention_seconds += time.perf_counter() - start
        self.traffic.calls += 1
        return out

    def _ulysses(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                 is_causal: bool, options: dict) -> Tensor:
        """``cp_mode="a2a"``: queries, keys and values of this rank's positions and every head exchanged for
        ``1/cp`` of the heads over the whole sequence (all-to-all), the model's own call run on them in natural
        order with its whole mask (``is_causal`` as it is: no per-chunk calls), and the output exchanged back.
        Keys and values with fewer heads than cp divides are repeated first (each rank gets the key/value heads its
        query heads read, as ``enable_gqa`` or broadcasting maps them). Nothing is recomputed in backward: what
        the call keeps is ``1/cp`` of the heads over the whole sequence, the bytes of every head over this rank's
        positions."""
        layout, group, cp = self.layout, self.group, self.layout.cp
        heads = query.shape[1]
        if key.shape[1] % cp:  # e.g. 2 key/value heads at cp4: each repeated twice, 1 per rank
            repeat = cp // math.gcd(key.shape[1], cp)
            key, value = key.repeat_interleave(repeat, dim=1), value.repeat_interleave(repeat, dim=1)
        self.traffic.bytes += sum(t.numel() * t.element_size() for t in (query, key, value)) * (cp - 1) // cp
        natural = layout.natural(query.device)
        q, k, v = (all_to_all_swap(t, group, 1, 2).index_select(2, natural) for t in (query, key, value))
        if is_causal:  # padded positions come after every real one: no real row reads them
            if attn_mask is not None:
                raise ValueError("scaled_dot_product_attention: attn_mask and is_causal=True together")
            out = _SDPA(q, k, v, dropout_p=dropout_p, is_causal=True, **options)
        else:
            length = layout.length
            if layout.padded != length:  # padded keys are never read; padded rows are zeros
                q, k, v = (t.narrow(2, 0, length) for t in (q, k, v))
            mask = self._whole_mask(attn_mask, heads) if attn_mask is not None else None
            out = pad_to(_SDPA(q, k, v, attn_mask=mask, dropout_p=dropout_p, **options), 2, layout.padded, 0)
        self.traffic.bytes += out.numel() * out.element_size() * (cp - 1) // cp
        return all_to_all_swap(out.index_select(2, layout.order(out.device)), group, 2, 1)

    def _whole_mask(self, mask: Tensor, heads: int) -> Tensor:
        """The model's mask for every row (``cp_mode="a2a"``) and this rank's heads: a mask whose rows were cut at
        the block's entry is the one it was cut from (or its rows gathered back when the block made it from a cut
        one); a per-head mask keeps this rank's heads."""
        layout, group = self.layout, self.group
        if mask.dim() >= 2 and mask.shape[-2] == layout.local and layout.local != layout.length:
            whole = self._wholes(mask) if self._wholes is not None else None
            if whole is None:
                rows = gather_positions(mask.to(torch.uint8) if mask.dtype == torch.bool else mask, -2, layout, group)
                whole = rows.bool() if mask.dtype == torch.bool else rows
            mask = whole
        for dim in (-2, -1):
            if mask.shape[dim] == layout.padded != layout.length:
                mask = mask.narrow(dim, 0, layout.length)
        if mask.dim() == 4 and mask.shape[1] == heads and heads > 1:
            mask = mask.narrow(1, group.rank * heads // layout.cp, heads // layout.cp)
        return mask

    def _attend(self, query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                is_causal: bool, gathered: bool, options: dict) -> Tensor:
        layout = self.layout
        if gathered:
            key, value = self._whole_keys(key, value)
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

    def _whole_keys(self, key: Tensor, value: Tensor, heads: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """The whole (padded) sequence's keys and values; with ``heads``, their heads repeated to the queries'
        (``enable_gqa``)."""
        key = gather_positions(key, -2, self.layout, self.group, trim=False)
        value = gather_positions(value, -2, self.layout, self.group, trim=False)
        if heads is not None and key.shape[1] != heads:
            key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
        return key, value

    def _causal_parts(self) -> list[tuple[slice, slice, bool]]:
        """(this rank's rows, the keys, causal) of each call of a causal attention: a chunk's own positions
        (``is_causal``, top-left), then the positions before it (every key)."""
        c = self.layout.chunk
        parts = []
        for j, a in enumerate(self.layout.starts()):
            rows = slice(j * c, (j + 1) * c)
            parts.append((rows, slice(a, a + c), True))
            if a:
                parts.append((rows, slice(0, a), False))
        return parts

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
            mask = local_positions(mask, -2, layout)
        if mask.shape[-1] != keys and mask.shape[-1] == layout.padded:
            mask = mask.narrow(-1, 0, keys)
        return mask


def _replayed_modes() -> dict[str, Any]:
    """``checkpoint``'s ``context_fn``, where one is needed: the recompute in backward runs under the function modes
    of the forward that say ``replay_in_recompute`` (tensor parallelism's, which cuts a whole per-head bias to this
    rank's heads where the attention reads it); torch's checkpoint replays none. (Never traced: the attention calls
    run eagerly under ``compile=``, and dynamo could not trace a checkpoint's context function.)"""
    modes = [m for m in function_modes() if getattr(m, "replay_in_recompute", False)]
    if not modes:
        return {}

    @contextlib.contextmanager
    def replay() -> Any:
        with contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            yield

    return {"context_fn": lambda: (contextlib.nullcontext(), replay())}


def _per_position(t: Any) -> bool:
    """A tensor a block computed per position (3 dimensions or more: batch first), not a weight."""
    return isinstance(t, Tensor) and t.dim() >= 3 and not isinstance(t, nn.Parameter)


def _joins_on_cpu(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
                  is_causal: bool, options: dict) -> bool:
    """Whether a causal call runs as :class:`_CausalJoined`: on CPU, a call :func:`joinable`."""
    return query.device.type == "cpu" and joinable(query, key, value, attn_mask, dropout_p, is_causal, options)


def joinable(query: Tensor, key: Tensor, value: Tensor, attn_mask: Optional[Tensor], dropout_p: float,
             is_causal: bool, options: dict) -> bool:
    """Whether CPU's kernel takes a causal call as it is (no dropout, no mask, queries and values of one width, heads
    as SDPA itself would accept them; ``options``: its other keyword arguments), on any device (the layout search's
    meta run asks it of the calls it records)."""
    if not is_causal or attn_mask is not None or dropout_p:
        return False
    if set(options) - {"scale", "enable_gqa"} or query.dim() != 4 or key.dim() != 4:
        return False
    same_heads = key.shape[1] == query.shape[1] or (options.get("enable_gqa") and query.shape[1] % key.shape[1] == 0)
    return bool(same_heads) and query.shape[-1] == value.shape[-1] and query.dtype == key.dtype == value.dtype


def _no_heads_exchange(query: Tensor, key: Tensor, cp: int) -> Optional[str]:
    """Why an SDPA call cannot exchange positions for heads (``cp_mode="a2a"``), or None."""
    if query.dim() != 4 or key.dim() != 4:
        return (f"an attention call on {query.dim()}-d queries (the heads exchange needs (batch, heads, positions, "
                f"features))")
    if query.shape[1] % cp:
        return (f"an attention with {query.shape[1]} query heads per rank, which cp={cp} does not divide (heads per "
                f"tp rank must divide by cp)")
    if query.shape[1] % key.shape[1]:
        return f"an attention with {query.shape[1]} query heads and {key.shape[1]} key/value heads"
    return None


_FELL_BACK: set[str] = set()


def _fell_back(what: str) -> None:
    """Once per reason: this attention ran as ``cp_mode="allgather"`` (exact; only the exchange differs)."""
    if what not in _FELL_BACK:
        _FELL_BACK.add(what)
        warnings.warn(f"cp_mode='a2a': {what} runs as cp_mode='allgather' instead (keys and values all-gathered; the "
                      f"result is the same)", stacklevel=3)
