"""Materialise a model built on the meta device: each rank allocates only its own shards, and one seed gives the same
weights in every (tp, pp, dp) layout.

    for each module that owns meta tensors (children before parents, as constructors run):
        full-size scratch tensors for its own parameters and buffers        (one module at a time at full size)
        the module's own initialiser on them (HF ``_init_weights`` / ``reset_parameters``), under a seed derived from
          the run's seed and the module's single-device name (so no rank runs another rank's initialisation)
        this rank's slice of each (``shard_tensor``) swapped into the meta tensor (``torch.utils.swap_tensors``: the
          parameter object stays the same, so plans, shard indexes and tied aliases keep pointing at it)

Every float tensor starts as NaN and every integer one as its minimum before the initialiser runs: what it leaves
unwritten is found and named instead of training on uninitialised memory.
"""

from __future__ import annotations

import hashlib
from itertools import chain
from typing import Collection, Mapping, Optional, Sequence

import torch
from torch import Tensor, nn

from lightning_tpp._compat import is_hf_pretrained, module_initializer
from lightning_tpp.core.params import ParamNames, ShardIndex
from lightning_tpp.core.seeding import seeded
from lightning_tpp.core.sharding import shard_tensor
from lightning_tpp.core.swap import original_attrs, original_class


class UninitializedParametersError(ValueError):
    """A module built on the meta device has no initialiser, or its initialiser left tensors unwritten."""


def has_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in chain(module.parameters(), module.buffers()))


def move_real(module: nn.Module, device: torch.device) -> None:
    """``module.to(device)`` for the tensors that exist; meta tensors stay (they are materialised later, in place)."""
    for m in module.modules():
        for _, p in m.named_parameters(recurse=False):
            if not p.is_meta and p.device != device:
                p.data = p.data.to(device)
        for name, b in list(m.named_buffers(recurse=False)):
            if not b.is_meta and b.device != device:
                setattr(m, name, b.to(device))


def module_seed(base_seed: int, name: str) -> int:
    """A seed for the module called ``name`` in the single-device model: the same in every layout and on every rank."""
    digest = hashlib.sha256(f"{base_seed}:{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") % (2 ** 63)


def _sentinel(t: Tensor) -> Optional[float]:
    if t.is_floating_point() or t.is_complex():
        return float("nan")
    if t.dtype == torch.bool:
        return None
    return torch.iinfo(t.dtype).min


def _unwritten(t: Tensor, sentinel: Optional[float]) -> bool:
    if sentinel is None or t.numel() == 0:
        return False
    return bool(torch.isnan(t).any()) if sentinel != sentinel else bool((t == sentinel).any())


def _scratch_view(module: nn.Module, full: dict[str, Tensor]) -> nn.Module:
    """A stand-in for ``module`` with its original class and attributes (before tensor parallelism made them local)
    whose own tensors named in ``full`` are the given full-size ones; children are shared."""
    view = object.__new__(original_class(module))
    state = dict(module.__dict__)
    for key in ("_parameters", "_buffers", "_modules"):
        state[key] = dict(state[key])
    state.update(original_attrs(module))
    view.__dict__.update(state)
    for name, t in full.items():
        bucket = "_parameters" if name in module.__dict__["_parameters"] else "_buffers"
        view.__dict__[bucket][name] = nn.Parameter(t, requires_grad=False) if bucket == "_parameters" else t
    return view


def _hf_roots(module: nn.Module) -> dict[str, nn.Module]:
    """Each module's nearest Hugging Face ``PreTrainedModel`` (itself included), by name."""
    roots: dict[str, nn.Module] = {}
    for name, m in module.named_modules():
        parent = name.rpartition(".")[0] if name else None
        if is_hf_pretrained(m):
            roots[name] = m
        elif parent is not None and parent in roots:
            roots[name] = roots[parent]
    return roots


def _initialise(m: nn.Module, name: str, full: dict[str, Tensor], root: Optional[nn.Module], base_seed: int,
                device: torch.device) -> Optional[str]:
    """``m``'s own initialiser run on the full-size tensors ``full`` (by attribute), under the seed of its
    single-device ``name``. Returns None, "none" (no initialiser) or the attributes it left unwritten."""
    view = _scratch_view(m, full)
    init = module_initializer(view, root)
    if init is None:
        return "none"
    sentinels = {n: _sentinel(t) for n, t in full.items()}
    for n, t in full.items():
        if sentinels[n] is not None:
            t.fill_(sentinels[n])
    with seeded(module_seed(base_seed, name), device), torch.no_grad():
        init()
    left = [n for n, t in full.items() if _unwritten(t, sentinels[n])]
    return ", ".join(left) if left else None


def _what(m: nn.Module, name: str, problem: str, full: Mapping[str, Tensor]) -> str:
    return f"{name or '<root>'} ({type(m).__name__}: {', '.join(full) if problem == 'none' else problem})"


def _raise_if(no_initializer: Sequence[str], unwritten: Sequence[str]) -> None:
    if not no_initializer and not unwritten:
        return
    parts = []
    if no_initializer:
        parts.append("these modules own tensors built on the meta device but define no reset_parameters() to "
                     "initialise them: " + "; ".join(no_initializer))
    if unwritten:
        parts.append("these modules' initialisers left tensors (partly) unwritten: " + "; ".join(unwritten))
    raise UninitializedParametersError(
        "cannot initialise the model built on the meta device: " + ". ".join(parts) + ". Give each such module a "
        "reset_parameters() that fills all its own parameters and buffers in place (as torch.nn layers do), or "
        "build it outside the meta device (outside configure_model / init_module(empty_init=True)), or pass "
        "weights= to load them from a file")


def initialise_whole(module: nn.Module, name: str, like: Mapping[str, tuple[Sequence[int], torch.dtype]], *,
                     base_seed: int, device: torch.device) -> dict[str, Tensor]:
    """The submodule ``name``'s own tensors (attribute -> single-device shape, dtype) initialised at full size as
    :func:`materialize` initialises them (the same seed, so the same values), for a caller that keeps a part of
    each: a module left on the meta device (``materialize(leave=)``) and sharded since."""
    m = module.get_submodule(name)
    full = {n: torch.empty(tuple(shape), dtype=dtype, device=device) for n, (shape, dtype) in like.items()}
    problem = _initialise(m, name, full, _hf_roots(module).get(name), base_seed, device)
    if problem == "none":
        _raise_if([_what(m, name, problem, full)], [])
    elif problem is not None:
        _raise_if([], [_what(m, name, problem, full)])
    return full


def materialize(module: nn.Module, *, device: torch.device, names: ParamNames, shards: ShardIndex, tp_rank: int,
                tp_size: int, base_seed: int, initialize: bool = True, loaded: Collection[str] = (),
                leave: Collection[str] = ()) -> list[str]:
    """Allocate (and unless ``initialize=False``, initialise) every meta tensor of ``module`` in place; returns the
    names of the modules materialised. A module whose own tensors are all ``loaded`` (single-device names a weights
    file fills afterwards) is only allocated; the modules named in ``leave`` stay on the meta device. A weight
    several modules share is initialised by the module of its single-device (first) name when that module is here,
    else by the first one met."""
    modules = list(module.named_modules())
    owner_of: dict[int, str] = {}
    for name, m in modules:
        for pname, p in m.named_parameters(recurse=False):
            canonical = names.canonical.get(f"{name}.{pname}" if name else pname, "")
            if canonical.rpartition(".")[0] == name:
                owner_of[id(p)] = name
    roots = _hf_roots(module) if initialize else {}
    done: list[str] = []
    no_initializer, unwritten = [], []
    for name, m in reversed(modules):  # children before parents, as constructors run
        own = [(n, t) for n, t in chain(m.named_parameters(recurse=False), m.named_buffers(recurse=False))
               if t.is_meta and owner_of.get(id(t), name) == name]
        if not own or name in leave:
            continue
        prefix = f"{name}." if name else ""
        init_here = initialize and not all(prefix + n in loaded for n, _ in own)
        shape = (lambda t: shards.full_shape(t)) if init_here else (lambda t: tuple(t.shape))
        full = {n: torch.empty(shape(t), dtype=t.dtype, device=device) for n, t in own}
        if init_here:
            problem = _initialise(m, name, full, roots.get(name), base_seed, device)
            if problem == "none":
                no_initializer.append(_what(m, name, problem, full))
                continue
            if problem is not None:
                unwritten.append(_what(m, name, problem, full))
        for n, t in own:
            spec = shards.spec(t)
            local = full[n] if spec is None or not init_here else shard_tensor(full[n], spec, tp_rank, tp_size)
            torch.utils.swap_tensors(t, nn.Parameter(local, requires_grad=t.requires_grad)
                                     if isinstance(t, nn.Parameter) else local)
        del full
        done.append(name)
    _raise_if(no_initializer, unwritten)
    return done
