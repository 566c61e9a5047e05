"""Weight gradients put off until the schedule asks for them: the ``I``/``W`` split of the zero-bubble schedule.

Zero-bubble splits a stage's backward into ``I`` (the gradients of the stage's inputs, sent upstream at once) and
``W`` (the weight gradients, run later where the stage would otherwise wait). Nearly all weight-gradient work is in
products with a weight matrix: ``F.linear`` (``nn.Linear``, the tensor-parallel layers), ``torch.addmm`` and
``torch.matmul`` with a 2-d parameter (Hugging Face ``Conv1D``). While a stage's forward runs under
:class:`DeferWeightGrads`, those products go through :class:`_Product`, whose backward computes the input gradient
and files the weight-gradient product in the micro-batch's list for ``W`` (the ZB paper's weight-gradient store).
Other parameters (norms, embeddings, parameters used in other ops) get their gradients in ``I`` as in any backward:
only the products wait. Gradient hooks on a parameter do not see the filed part (it is added to ``.grad`` directly,
as torch's own split does).

torch.distributed.pipelining's split (``stage_backward_input``/``stage_backward_weight``) walks the autograd graph in
Python and re-enters it per parameter group; on the benchmark's last stage (4 GPT blocks and the head, one CPU
thread) ``I`` then ``W`` cost 22-24% more than one backward, with this split 9-10% (the weight products run on
operands no longer in cache).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.overrides import TorchFunctionMode

_CASTABLE = (torch.float32, torch.float16, torch.bfloat16)  # what autocast casts


def _accumulate(param: Tensor, grad: Tensor) -> None:
    grad = grad.to(param.dtype)
    if param.grad is None:
        param.grad = grad
    elif param.grad.is_contiguous():
        param.grad.add_(grad)
    else:  # an expanded gradient autograd left there cannot be added to in place
        param.grad = param.grad + grad


class WeightGrads(list):
    """The weight-gradient products a backward filed. A product's autograd node refers to it weakly: its entries hold
    the products' inputs, and through them the graph, which must not keep the list alive in turn."""

    @torch.no_grad()  # the operands require grad: products made with grad enabled would chain every step's history
    def run(self) -> None:
        """Accumulate every filed gradient into ``.grad``, releasing each one's operands as it goes."""
        while self:
            self.pop(0)()


class _Product(torch.autograd.Function):
    """``x @ W.T + b`` (``transposed=False``: ``F.linear``) or ``x @ W + b`` (``transposed=True``: ``addmm``,
    ``matmul``), computed as the op would be; its backward returns the input gradient and files the weight and bias
    gradients in ``into``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Optional[Tensor], transposed: bool,
                into: WeightGrads) -> Tensor:
        ctx.params, ctx.transposed, ctx.into = (weight, bias), transposed, weakref.ref(into)
        device = x.device.type
        if torch.is_autocast_enabled(device):  # multiply what autocast would, and keep those for the backward
            dtype = torch.get_autocast_dtype(device)
            x, weight, bias = (t.to(dtype) if t is not None and t.dtype in _CASTABLE else t for t in (x, weight, bias))
        with torch.autocast(device, enabled=False):
            if transposed:
                out = x @ weight if bias is None else torch.addmm(bias, x, weight)
            else:
                out = F.linear(x, weight, bias)
        ctx.save_for_backward(x, weight)
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Optional[Tensor], ...]:
        x, weight = ctx.saved_tensors
        param, bias = ctx.params
        transposed = ctx.transposed
        want_w, want_b = ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]

        def weight_grads() -> tuple[Optional[Tensor], Optional[Tensor]]:
            g2, x2 = grad.reshape(-1, grad.shape[-1]), x.reshape(-1, x.shape[-1])
            return ((x2.t().mm(g2) if transposed else g2.t().mm(x2)) if want_w else None,
                    g2.sum(0) if want_b else None)

        def accumulate() -> None:
            for p, g in zip((param, bias), weight_grads()):
                if g is not None:
                    _accumulate(p, g)

        dx = grad @ (weight.t() if transposed else weight) if ctx.needs_input_grad[0] else None
        into = ctx.into()
        if into is None:  # the micro-batch's list is gone (its step was abandoned): nothing will run W
            return (dx, *weight_grads(), None, None)
        into.append(accumulate)
        return dx, None, None, None, None


def _deferrable(weight: Any, bias: Any = None) -> bool:
    """A plain 2-d parameter that needs a gradient (not a DTensor or another subclass: their ops have rules of their
    own), and a bias that is a parameter too or needs no gradient."""
    return (type(weight) is nn.Parameter and weight.dim() == 2 and weight.requires_grad
            and (bias is None or type(bias) is nn.Parameter or (type(bias) is Tensor and not bias.requires_grad)))


_LINEAR_ARGS = ("input", "weight", "bias")


class DeferWeightGrads(TorchFunctionMode):
    """Products with a weight matrix made in this block file their weight gradients in ``into`` when backward runs
    (see the module docstring); ``into.run()`` accumulates them into ``.grad``."""

    def __init__(self, into: WeightGrads) -> None:
        super().__init__()
        self.into = into

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        product = deferred_product(func, args, kwargs) if torch.is_grad_enabled() else None
        if product is not None:
            return _Product.apply(*product, self.into)
        return func(*args, **kwargs)


def deferred_product(func: Any, args: tuple, kwargs: dict) -> Optional[tuple[Tensor, Tensor, Any, bool]]:
    """``(x, weight, bias, transposed)`` where :class:`DeferWeightGrads` puts off the weight gradient of this call
    (``memory.estimate_memory`` counts what such products hold until ``W``), else ``None``."""
    if func is F.linear and len(args) <= 3 and set(kwargs) <= set(_LINEAR_ARGS[len(args):]):
        given = {**dict(zip(_LINEAR_ARGS, args)), **kwargs}
        x, weight, bias = given["input"], given["weight"], given.get("bias")
        if type(x) is Tensor and _deferrable(weight, bias):
            return x, weight, bias, False
    elif func is torch.addmm and not kwargs and len(args) == 3:
        bias, x, weight = args
        if type(x) is Tensor and x.dim() == 2 and _deferrable(weight, bias) and bias.dim() == 1:
            return x, weight, bias, True
    elif func in (torch.matmul, Tensor.matmul, Tensor.__matmul__) and not kwargs and len(args) == 2:
        x, weight = args
        if type(x) is Tensor and x.dim() >= 2 and _deferrable(weight):
            return x, weight, None, True
    return None
