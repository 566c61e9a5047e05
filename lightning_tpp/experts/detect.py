"""Find the mixture-of-experts layers of an unmodified model, as data (no process groups here).

Two shapes of expert storage are recognised, whatever the names::

    bank:  one module holding every expert's weights as 3-D parameters indexed by expert (transformers 5, torchtitan)
             up   (E, X, H)  or transposed (E, H, X)     X = I, or 2I for gate and up packed in one tensor
             down (E, H, I)  or transposed (E, I, H)
             optional biases (E, X) and (E, H)
    list:  an ``nn.ModuleList`` of E modules of one class, each an MLP (older Hugging Face code, litgpt, hand-written)

The layer that routes is the bank's (or list's) parent; its router is a projection to E per-expert logits (an
``nn.Linear(H, E)`` or a module with an ``(E, H)`` weight); its other children with parameters are shared experts or
their gates. Hugging Face's own flags (``is_transposed``, ``is_concatenated``, ``has_gate``) are read where present.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from torch import nn

from lightning_tpp.core.sharding import ShardSpec

_DOWN_HINTS = ("down", "w2", "wo", "out", "proj_out", "fc2")


@dataclass
class ExpertBank:
    """A module holding all experts' weights as 3-D parameters, and how each is cut for expert tensor parallelism
    (every expert's intermediate features over tp: up by columns, down by rows)."""

    experts: int
    hidden: int
    intermediate: int
    up: list[str]  # (E, X, H) or transposed: the projections that read the tokens (gate and up, packed or not)
    down: str
    transposed: bool
    packed: bool  # gate and up in one tensor of width 2I
    concatenated: bool = True  # packed as [gate | up] (else interleaved gate/up pairs)
    up_biases: list[str] = field(default_factory=list)  # (E, X): cut like their projection's output
    down_biases: list[str] = field(default_factory=list)  # (E, H): added after the rows, kept whole

    def specs(self) -> dict[str, ShardSpec]:
        """Parameter attribute -> how it is cut over tp."""
        parts = (self.intermediate, self.intermediate) if self.packed and self.concatenated else None
        up_dim, down_dim = (2, 1) if self.transposed else (1, 2)
        out = {n: ShardSpec(up_dim, parts) for n in self.up}
        out.update({n: ShardSpec(1, parts) for n in self.up_biases})
        out[self.down] = ShardSpec(down_dim)
        return out


@dataclass
class MoELayer:
    """A routed layer: where its experts are and what routes them."""

    name: str  # the module whose forward routes (the experts' parent)
    experts: str  # the bank module, or the ModuleList
    kind: Literal["bank", "list"]
    count: int
    router: Optional[str] = None
    shared: list[str] = field(default_factory=list)  # the parent's other children with parameters
    bank: Optional[ExpertBank] = None


def _flag(module: nn.Module, name: str) -> Optional[bool]:
    value = getattr(module, name, None)
    return value if isinstance(value, bool) else None


def expert_bank(module: nn.Module) -> Optional[ExpertBank]:
    """The bank layout of ``module``'s own parameters, or None when they are not one."""
    own = {n: p for n, p in module._parameters.items() if p is not None}
    cubes = {n: p for n, p in own.items() if p.dim() == 3}
    counts = {p.shape[0] for p in cubes.values()}
    if len(cubes) < 2 or len(counts) != 1 or next(iter(counts)) < 2:
        return None
    downs = [n for n in cubes if any(h in n.lower() for h in _DOWN_HINTS)]
    down = downs[0] if len(downs) == 1 else list(cubes)[-1]
    ups = [n for n in cubes if n != down]
    d = tuple(cubes[down].shape)
    for transposed in ((True,) if _flag(module, "is_transposed") else (False,) if _flag(module, "is_transposed")
                       is False else (False, True)):
        hidden, inter = (d[2], d[1]) if transposed else (d[1], d[2])
        widths = {cubes[n].shape[2] if transposed else cubes[n].shape[1] for n in ups}
        reads = {cubes[n].shape[1] if transposed else cubes[n].shape[2] for n in ups}
        if reads != {hidden} or len(widths) != 1 or next(iter(widths)) not in (inter, 2 * inter):
            continue
        width = next(iter(widths))
        packed = width == 2 * inter and _flag(module, "has_gate") is not False
        bank = ExpertBank(d[0], hidden, inter, ups, down, transposed, packed,
                          concatenated=_flag(module, "is_concatenated") is not False)
        for n, p in own.items():
            if p.dim() == 2 and p.shape[0] == d[0]:
                is_down = p.shape[1] == hidden and (p.shape[1] != width or any(h in n.lower() for h in _DOWN_HINTS))
                (bank.down_biases if is_down else bank.up_biases).append(n)
        return bank
    return None


def _is_expert_list(module: nn.Module) -> bool:
    kids = list(module.children())
    return (isinstance(module, nn.ModuleList) and len(kids) >= 2 and len({type(k) for k in kids}) == 1
            and all(any(True for _ in k.parameters()) for k in kids)
            and len({tuple(p.shape for p in k.parameters()) for k in kids}) == 1
            and any(isinstance(m, nn.Linear) for m in kids[0].modules()))


def _router(parent: nn.Module, prefix: str, skip: str, count: int) -> Optional[str]:
    """The parent's child that maps the tokens to one logit per expert."""
    for name, child in parent.named_children():
        if name == skip:
            continue
        weight = getattr(child, "weight", None)
        if isinstance(weight, nn.Parameter) and weight.dim() == 2 and weight.shape[0] == count:
            return f"{prefix}{name}"
    return None


def find_experts(model: nn.Module) -> list[MoELayer]:
    """Every mixture-of-experts layer of ``model``, in module order. A list of same-class modules counts as experts
    only when its parent also holds a router for that many experts (a model's list of blocks has none)."""
    layers: list[MoELayer] = []
    modules = dict(model.named_modules())
    for name, module in modules.items():
        bank = expert_bank(module)
        if bank is None and not _is_expert_list(module):
            continue
        parent_name, _, attr = name.rpartition(".")
        parent = modules[parent_name] if name else None
        count = bank.experts if bank is not None else len(module)
        router = _router(parent, f"{parent_name}." if parent_name else "", attr, count) if parent is not None else None
        if bank is None and router is None:
            continue  # a list of layers, not of experts
        prefix = f"{parent_name}." if parent_name else ""
        shared = [f"{prefix}{n}" for n, c in (parent.named_children() if parent is not None else ())
                  if n != attr and f"{prefix}{n}" != router and any(True for _ in c.parameters())]
        layers.append(MoELayer(parent_name, name, "bank" if bank is not None else "list", count, router, shared,
                               bank))
    return layers


_TOP_K_NAMES = ("top_k", "num_experts_per_tok", "topk", "n_activated_experts")


def top_k(model: nn.Module, layer: MoELayer) -> Optional[int]:
    """How many experts each token runs through: the router's or the routing layer's own attribute (or its
    configuration's), else None."""
    holders = [model.get_submodule(n) for n in (layer.router, layer.name) if n is not None]
    holders += [c for c in (getattr(h, "config", None) for h in holders) if c is not None]
    for holder in holders:
        for name in _TOP_K_NAMES:
            value = getattr(holder, name, None)
            if isinstance(value, int) and not isinstance(value, bool) and 0 < value <= layer.count:
                return value
    return None


def active_parameters(module: nn.Module) -> float:
    """``module``'s parameters as a token runs through them: the experts of each routed layer count top-k / E of
    theirs (a block's cost when pipeline stages are balanced; a layer whose top-k is unknown counts whole)."""
    total = float(sum(p.numel() for p in module.parameters()))
    for layer in find_experts(module):
        k = top_k(module, layer)
        if k is not None and layer.experts:
            bank = sum(p.numel() for p in module.get_submodule(layer.experts).parameters())
            total -= bank * (1 - k / layer.count)
    return total
