"""The dataflow of a module's forward, traced once on made-up inputs: which linear layers' outputs each linear
layer reads, which outputs meet in a matrix product (attention) or in a reduction over features, and how an output
is viewed as heads. :mod:`~lightning_tpp.tensor_parallel.plan` groups layers into blocks from it."""

from __future__ import annotations

import inspect
from typing import Any, Mapping, Optional

import torch
from torch import Tensor, nn

from lightning_tpp.core.walk import VERIFYING, Taint, tensors_in
from lightning_tpp.tensor_parallel.layers import linear_dims

# functions that combine two projections' outputs (attention scores, attention-weighted values)
MIXING = frozenset({"matmul", "__matmul__", "bmm", "baddbmm", "einsum", "scaled_dot_product_attention"})
RESHAPES = frozenset({"view", "reshape", "unflatten"})
# functions that combine the features of one value (not element-wise): an MLP whose hidden features pass through
# one cannot be cut by features (a norm over the hidden width, NormFormer's; a centring)
ACROSS = frozenset({"layer_norm", "rms_norm", "group_norm", "batch_norm", "instance_norm", "softmax", "log_softmax",
                     "mean", "sum", "var", "std", "var_mean", "std_mean", "norm", "amax", "amin", "max", "min",
                     "logsumexp", "cumsum", "cumprod", "sort", "topk", "flip", "roll", "argmax", "argmin",
                     "normalize"})

_SCORES = ("scores",)  # the tag of a matrix product of two projections' outputs and of what is computed from it


class LinearFlow(Taint):
    """Tags every value of a forward with the linear layers whose outputs it was computed from (the nearest ones: a
    layer's output carries only its own name), and notes which layers' outputs meet in a matrix product (attention)
    and how a layer's output is split into heads (``view(B, S, heads, head_dim)``)."""

    def __init__(self, widths: Mapping[str, int], own: frozenset[int] = frozenset(),
                 watch: Optional[Mapping[str, Tensor]] = None) -> None:
        super().__init__()
        self.widths, self.mixed, self.across, self.heads = widths, set(), set(), {}
        self.own = own  # ids of the traced linear layers' parameters
        self.touched: dict[str, str] = {}  # layer -> the op where its output met another parameter of the module
        # tensors of the module (a parameter, a buffer) followed by name, and the layers whose outputs each met
        # (directly or through what was computed from it: ``-exp(A_log)`` times a projection's output)
        self.watch, self.met = dict(watch or {}), {}
        # watched tensors whose values met a product of two projections' outputs or what was computed from it (an
        # attention's scores, probabilities or weighted values): read per head, where the heads are apart
        self.scored: set[str] = set()

    def start(self) -> None:
        self.tags.clear()
        for name, t in self.watch.items():
            self.tags[id(t)] = (t, frozenset([("watched", name)]))

    def layers_of(self, obj: Any) -> frozenset:
        """The linear layers whose outputs ``obj`` was computed from (not the watched tensors, not the scores)."""
        return frozenset(t for t in self.of(obj) if isinstance(t, str))

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        if self.watch:
            tags = self.of((args, kwargs or {}))
            layers = {t for t in tags if isinstance(t, str)}
            for tag in (t for t in tags if isinstance(t, tuple) and t[0] == "watched") if layers else ():
                self.met.setdefault(tag[1], set()).update(layers)
                if _SCORES in tags:
                    self.scored.add(tag[1])
        out = super().__torch_function__(func, types, args, kwargs)
        name = getattr(func, "__name__", "")
        operands = list(tensors_in((args, kwargs or {}), set()))
        if any(isinstance(t, nn.Parameter) and id(t) not in self.own for t in operands):
            # a depthwise convolution's or a per-feature scale's weight: it would need cutting with the features
            for t in operands:
                for layer in self.of(t):
                    self.touched.setdefault(layer, name)
        if name in MIXING:
            tags = [self.of(t) for t in tensors_in((args, kwargs or {}), set())]
            if sum(1 for t in tags if t) >= 2:
                self.mixed.update(*tags)
                for t in tensors_in(out, set()):
                    self.tag(t, frozenset([_SCORES]))
        elif name in ACROSS and args and isinstance(args[0], Tensor):
            self.across.update(self.of(args[0]))
        elif name in RESHAPES and args and isinstance(args[0], Tensor) and isinstance(out, Tensor):
            src = self.of(args[0])
            width = self.widths.get(next(iter(src))) if len(src) == 1 else None
            if (width and out.dim() > args[0].dim() and args[0].shape[-1] == width
                    and out.shape[-2] * out.shape[-1] == width):
                self.heads.setdefault(next(iter(src)), (out.shape[-2], out.shape[-1]))
        return out


def trace_flow(module: nn.Module, lins: list[tuple[str, nn.Module]], watch: Optional[Mapping[str, Tensor]] = None,
               width: Optional[int] = None) -> tuple[list[tuple[str, frozenset]], LinearFlow]:
    """Run ``module`` once on a small input (on its weights' device: the meta device computes nothing) and return
    ``(layer, layers its input came from)`` per linear call in order, and the flow. The input is ``(1, 8, width)``,
    width (unless given) the layers' most common input width; eval mode, no gradients, a private random generator (the run leaves
    no trace in the model or the global random state). ``watch``: tensors of the module to follow (``flow.met``)."""
    widths = [linear_dims(m)[0] for _, m in lins]
    width = width or max(set(widths), key=widths.count)
    weight = lins[0][1].weight
    own = frozenset(id(p) for _, m in lins for p in m.parameters())
    flow = LinearFlow({n: linear_dims(m)[1] for n, m in lins}, own, watch)
    calls: list[tuple[str, frozenset]] = []
    hooks = []
    for n, m in lins:
        hooks.append(m.register_forward_pre_hook(lambda _m, a, n=n: calls.append((n, flow.layers_of(a)))))
        hooks.append(m.register_forward_hook(  # a layer's output carries only its own name
            lambda _m, a, out, n=n: flow.tags.__setitem__(id(out), (out, frozenset([n])))))
    modes = {m: m.training for m in module.modules()}
    x = torch.randn(1, 8, width, generator=torch.Generator().manual_seed(0)).to(weight.device, weight.dtype)
    token = VERIFYING.set(True)  # a pipeline stage's dispatchers run the real modules
    try:
        module.eval()
        first: Optional[Exception] = None
        for args in made_up_inputs(module, x):
            calls.clear()
            flow.start()
            try:
                with torch.no_grad(), flow:
                    module(*args)
                break
            except Exception as err:  # noqa: BLE001 - the next convention may fit
                first = first or err
        else:
            assert first is not None
            raise first
    finally:
        VERIFYING.reset(token)
        for h in hooks:
            h.remove()
        for m, mode in modes.items():
            m.training = mode
    return calls, flow


def input_names(module: nn.Module) -> str:
    """``(x, mask)``: the forward's required inputs, as tried by :func:`made_up_inputs`."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return "(x)"
    return "(" + ", ".join(p.name for p in params if p.default is inspect.Parameter.empty
                            and p.kind not in (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)) + ")"


def made_up_inputs(module: nn.Module, x: Tensor) -> list[tuple[Tensor, ...]]:
    """The inputs tried in turn: ``x`` alone; with a forward that needs more (a conditioning vector ``c``, adaLN or
    FiLM), each further input as one vector per sample ``(1, width)``, then shaped as ``x``."""
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return [(x,)]
    kinds = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
    needed = sum(1 for p in params[1:] if p.kind in kinds and p.default is inspect.Parameter.empty)
    if not params or not needed:
        return [(x,)]
    return [(x, *[x[:, 0]] * needed), (x, *[x] * needed)]
