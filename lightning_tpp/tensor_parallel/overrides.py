"""Plans laid over the automatic one: ``tp_plan=`` entries (module-name globs -> styles) and a Hugging Face model's
own ``base_model_tp_plan`` / ``_tp_plan``, its style names read as ours."""

from __future__ import annotations

import fnmatch
import warnings
from typing import Collection, Mapping, Optional, Sequence

from torch import nn

from lightning_tpp.tensor_parallel.layers import is_linear
from lightning_tpp.tensor_parallel.plan_types import STYLES, BlockInfo, TensorParallelConfigError, TPPlan

# Hugging Face tp-plan style names -> ours (per module type where it differs).
_HF_STYLES = {"colwise": "colwise", "local_colwise": "colwise", "rowwise": "rowwise", "local_rowwise": "rowwise",
              "colwise_rep": "colwise_gather", "colwise_gather_output": "colwise_gather", "rowwise_rep": "rowwise",
              "embedding_rowwise": "vocab", "replicated_with_grad_allreduce": "replicate"}


def hf_plan(model: nn.Module) -> dict[str, str]:
    """Styles from Hugging Face models' own tp plans (``config.base_model_tp_plan`` and the class's ``_tp_plan``)."""
    out: dict[str, str] = {}
    for fqn, m in model.named_modules():
        config = getattr(m, "config", None)
        if not hasattr(m, "base_model_prefix") or config is None:
            continue
        prefix = f"{fqn}." if fqn else ""
        base = getattr(m, m.base_model_prefix, None)
        base_prefix = f"{prefix}{m.base_model_prefix}." if isinstance(base, nn.Module) else prefix
        for pattern, style in (getattr(config, "base_model_tp_plan", None) or {}).items():
            out[base_prefix + pattern] = style
        for pattern, style in (getattr(type(m), "_tp_plan", None) or {}).items():
            out[prefix + pattern] = style
    return out


def overlay(model: nn.Module, plan: TPPlan, overrides: Mapping[str, str], *, source: str, strict: bool,
            whole_model: Optional[Sequence[str]] = None, remote: Collection[str] = ()) -> None:
    """Lay ``overrides`` (module-name glob -> style) over ``plan`` in place.

    ``strict`` (user plans): unknown styles and globs that match nothing raise. Hugging Face plans use styles we do not
    model (sequence parallel, packed experts); those entries are skipped with a note. Under pipeline parallelism
    ``whole_model`` lists the module names of all stages: a glob may match modules that other stages hold.
    """
    modules = dict(model.named_modules())
    names = list(whole_model) if whole_model is not None else list(modules)
    entries: list[tuple[str, str, Optional[str]]] = []  # (module, style given, our style or None)
    for pattern, raw in overrides.items():
        if strict and not any(fnmatch.fnmatchcase(n, pattern) for n in names):
            raise TensorParallelConfigError(f"{source} entry {pattern!r} matches no module; module names look like "
                                            f"{[n for n in names if n][:5]}")
        for name in modules:
            if fnmatch.fnmatchcase(name, pattern) and name not in remote:
                tail = _rope_columns(modules, name) if raw == "mla_kv_a_proj" and not strict else None
                if tail is not None:  # whole on every rank, its rope columns' gradient summed over tp
                    plan.summed_tail[name] = tail
                    plan.notes.append(f"{name}: Hugging Face style 'mla_kv_a_proj': whole on every rank, the "
                                      f"gradient of its last {tail} columns (the rope key every head reads) summed "
                                      f"over tp")
                    continue
                style = raw if strict else _HF_STYLES.get(raw)  # (a module held by another stage is skipped)
                if style == "rowwise" and isinstance(modules[name], nn.Embedding):
                    style = "vocab"
                if style not in STYLES:
                    if strict:
                        raise TensorParallelConfigError(f"{source} style {raw!r} for {name!r} is not one of "
                                                        f"{STYLES}")
                    style = None
                entries.append((name, raw, style))
                if raw == "replicated_with_grad_allreduce" and not strict and name not in plan.grad_allreduce:
                    plan.grad_allreduce.append(name)
    # a block with one style we do not model keeps the automatic plan (checked numerically at its first call) for
    # all its layers: half of a foreign plan (a gathered qkv with our row-parallel output) would not fit together.
    # A layer of no planned block goes with the module holding it, unless that holds blocks (a model): DeepSeek-V3's
    # attention (transformers 5.25) has q_b_proj / kv_b_proj colwise and o_proj rowwise around kv_a_proj_with_mqa's
    # "mla_kv_a_proj"; the three alone leave the rope key's gradient summed over one rank's heads only
    def unit(name: str) -> str:
        block = plan.block_of(name)
        if block is not None:
            return block
        parent = name.rpartition(".")[0]
        holder = modules.get(parent)
        holds = holder is None or any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in holder.modules())
        return name if holds else parent

    foreign = {unit(n) for n, _, style in entries if style is None}
    for name, raw, style in entries:
        if style is None:
            plan.notes.append(f"{name}: Hugging Face style {raw!r} is not supported here; left as planned")
            continue
        split = style in ("colwise", "rowwise") or plan.block_of(name) is not None  # a layer whole on its own
        if split and unit(name) in foreign:  # (a gathered output, a vocabulary) is applied as before
            plan.notes.append(f"{name}: Hugging Face style {raw!r} not applied: a layer of {unit(name)} has a style "
                              f"not supported here, and half of a plan does not fit together; left as planned")
            continue
        _set_style(plan, name, modules[name], style, source)


def _rope_columns(modules: Mapping[str, nn.Module], name: str) -> Optional[int]:
    """The rope key's width of an MLA attention (``qk_rope_head_dim`` on the attention holding ``name``, or on its
    config): the last columns of ``kv_a_proj_with_mqa``'s output, which bypass ``kv_b_proj`` and reach every head."""
    owner = modules.get(name.rpartition(".")[0])
    for where in (owner, getattr(owner, "config", None)):
        value = getattr(where, "qk_rope_head_dim", None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def _set_style(plan: TPPlan, name: str, m: nn.Module, style: str, source: str) -> None:
    if style == "replicate":
        plan.styles.pop(name, None)
        block = plan.blocks.pop(name, None)
        for layer in block.layers if block else []:
            plan.styles.pop(layer, None)
        owner = plan.block_of(name)
        if owner is not None and owner != name:  # one layer of a block out: the whole block stays replicated
            warnings.warn(f"{source}: replicating {name} replicates its whole block {owner}", stacklevel=3)
            _set_style(plan, owner, m, "replicate", source)
        return
    want = {"colwise": is_linear, "rowwise": is_linear, "colwise_gather": is_linear,
            "vocab": lambda x: isinstance(x, nn.Embedding), "mha": lambda x: isinstance(x, nn.MultiheadAttention)}
    if not want[style](m):
        raise TensorParallelConfigError(f"{source} style {style!r} does not fit {name!r} ({type(m).__name__})")
    plan.styles[name] = style
    if plan.block_of(name) is None and style in ("colwise", "rowwise"):
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        block = plan.blocks.setdefault(parent, BlockInfo("custom"))
        block.layers.append(name)
