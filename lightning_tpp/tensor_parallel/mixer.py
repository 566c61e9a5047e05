"""State-space mixers (Mamba, Mamba-2) under tensor parallelism, cut by channels and heads as Megatron-Core cuts its
hybrid models: each rank runs the scan on its own channels, exactly; only the projections in and out communicate.

Recognised by shape (a depthwise ``nn.Conv1d`` child and the widths of the linear children), whatever the names::

    Mamba (Jamba, Falcon-Mamba, HF / mamba_ssm Mamba), I channels, width D; without x_proj and dt_proj, a gated
    (or plain) depthwise-convolution mixer (H3-like blocks written by hand) is cut the same way
        in_proj   D -> [x | z]  (I, I)      columns, each part cut
        conv1d    depthwise over x (I)      channels cut with x
        x_proj    I -> [dt | B | C]         rows: partial sums all-reduced; its gradient, a part on each rank (every
                                            rank's channels read dt, B and C), all-reduced too
        dt_proj   dt -> I                   channels cut (read as a weight or called: local either way)
        A_log (I, N), D (I)                 channels cut
        out_proj  I -> D                    rows

    Mamba-2 (Bamba, Zamba2, Nemotron-H, Falcon-H1, mamba_ssm Mamba2), H heads of I / H channels, G groups of B, C
        in_proj   D -> [z | x | B | C | dt]  (I, I, G N, G N, H)   each part cut: H / tp heads, G / tp groups a rank
        conv1d    depthwise over [x | B | C]                         cut alike
        A_log, D, dt_bias (H)               heads cut
        norm      gated RMSNorm over I, in G groups                  weight cut (whole groups on each rank)
        out_proj  I -> D                    rows

Parameters and buffers of other sizes stay whole (a Mamba mixer's norms of dt, B and C: each rank's gradient of
them is a part, summed over tp as the gradient check finds); a non-persistent buffer of a cut size (Falcon-H1's
``mup_vector`` over the input projection's output) is cut alike. The mixer's own counts (``intermediate_size``, ``num_heads``, ``n_groups``, ``conv_dim``, and the convolution's
``groups`` / channels) are made local. Every rank of a Mamba-2 mixer must hold whole groups (tp divides G, as
Megatron-Core requires); otherwise, or with anything else the layout does not explain, the mixer stays whole with the
reason. The block is checked numerically at its first call (outputs and gradients) like every other.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from torch import nn

from lightning_tpp.core.sharding import ShardSpec
from lightning_tpp.tensor_parallel.layers import is_transposed_linear, linear_dims
from lightning_tpp.tensor_parallel.plan_types import BlockInfo
from lightning_tpp.tensor_parallel.trace import input_names, trace_flow

INNER_NAMES = ("intermediate_size", "d_inner", "d_ssm", "inner_size", "ssm_size", "expand_dim")
HEAD_NAMES = ("num_heads", "nheads", "n_heads", "mamba_n_heads")
GROUP_NAMES = ("n_groups", "ngroups", "num_groups", "n_group", "mamba_n_groups")
STATE_NAMES = ("ssm_state_size", "d_state", "state_size", "n_state")
CONV_NAMES = ("conv_dim", "d_conv_in", "conv_channels")


def _ints(module: nn.Module, names: tuple[str, ...]) -> list[tuple[str, int]]:
    return [(n, v) for n in names if isinstance(v := getattr(module, n, None), int) and not isinstance(v, bool)]


def _depthwise(module: nn.Module) -> list[tuple[str, nn.Conv1d]]:
    return [(n, c) for n, c in module.named_children()
            if isinstance(c, nn.Conv1d) and c.groups == c.in_channels == c.out_channels > 1]


def mixer(fqn: str, module: nn.Module, tp: int, whole: dict[str, str]) -> Optional[BlockInfo]:
    """The tensor-parallel layout of a Mamba / Mamba-2 mixer (see the module docstring), or None when ``module`` is
    not one. ``whole`` receives why a mixer stays whole."""
    convs = _depthwise(module)
    lins = [(n, c) for n, c in module.named_children() if isinstance(c, nn.Linear) or is_transposed_linear(c)]
    if len(convs) != 1 or len(lins) < 2:
        return None
    conv_name, conv = convs[0]
    channels = conv.in_channels
    dims = {n: linear_dims(c) for n, c in lins}
    at = lambda n: f"{fqn}.{n}" if fqn else n  # noqa: E731
    # in_proj reads the width D; out_proj returns to it from the mixer's channels (I)
    pairs = [(i, o) for i in dims for o in dims if i != o and dims[i][0] == dims[o][1] and dims[i][1] >= channels]
    if len(pairs) != 1:
        return None
    in_proj, out_proj = pairs[0]
    width, proj = dims[in_proj]
    inner = dims[out_proj][0]
    rest = [n for n in dims if n not in (in_proj, out_proj)]
    in_dim = 1 if is_transposed_linear(module.get_submodule(in_proj)) else 0
    owned = {f"{conv_name}.weight": ShardSpec(0), f"{conv_name}.bias": ShardSpec(0)}
    if inner == channels and proj in (channels, 2 * channels) and len(rest) in (0, 2):  # Mamba, or a gated conv
        x_proj = next((n for n in rest if dims[n][0] == channels), None)
        dt_proj = next((n for n in rest if dims[n][1] == channels and n != x_proj), None)
        if rest and (x_proj is None or dt_proj is None or dims[dt_proj][0] >= dims[x_proj][1]):
            return None
        if channels % tp:
            whole[fqn] = f"a state-space / convolution mixer with {channels} channels: tp={tp} must divide them"
            return None
        in_spec, sizes = ShardSpec(in_dim, (channels,) * (proj // channels)), {"mixer channels": channels}
        per_channel = {channels: ShardSpec(0)}
        layers, rows, rejoin, local = [in_proj, out_proj], [out_proj], [], {}
        if x_proj is not None and dt_proj is not None:  # Mamba: x_proj's rows, dt_proj's channels
            dt_dim = 1 if is_transposed_linear(module.get_submodule(dt_proj)) else 0
            owned.update({f"{dt_proj}.weight": ShardSpec(dt_dim), f"{dt_proj}.bias": ShardSpec(0)})
            layers, rows, rejoin = [in_proj, x_proj, out_proj], [x_proj, out_proj], [x_proj]
            local = {f"{dt_proj}.{'out_features' if dt_dim == 0 else 'nf'}": channels // tp}
        counts = {INNER_NAMES: channels, CONV_NAMES: channels}
    elif rest:
        return None
    else:  # Mamba-2: [z | x | B | C | dt]
        heads, bc = proj - inner - channels, channels - inner
        groups = next((v for _, v in _ints(module, GROUP_NAMES)), None)
        if heads <= 0 or bc <= 0 or bc % 2 or inner % heads:
            return None
        if groups is None or (bc // 2) % groups:
            whole[fqn] = (f"a Mamba-2 mixer whose number of groups of B and C was not found (no attribute "
                          f"{'/'.join(GROUP_NAMES)})")
            return None
        if groups % tp or heads % tp:
            whole[fqn] = (f"a Mamba-2 mixer with {groups} group(s) of B/C and {heads} heads: tp={tp} must divide both "
                          f"(each rank holds whole groups, as Megatron-Core requires)")
            return None
        gn = bc // 2
        in_spec = ShardSpec(in_dim, (inner, inner, gn, gn, heads))
        owned = {f"{conv_name}.weight": ShardSpec(0, (inner, gn, gn)), f"{conv_name}.bias": ShardSpec(0, (inner, gn, gn))}
        per_channel = {heads: ShardSpec(0), inner: ShardSpec(0)}
        sizes = {"mixer heads": heads, "mixer groups": groups, "mixer channels": inner}
        layers, rows, rejoin = [in_proj, out_proj], [out_proj], []
        counts = {INNER_NAMES: inner, HEAD_NAMES: heads, GROUP_NAMES: groups, CONV_NAMES: channels}
        local = {}
    # the mixer's own parameters and buffers, and those of its other children (a gated norm's weight), of a cut size
    # and met by what the input projection computed (an input norm of the width stays whole, whatever its size)
    by_size = {proj: dataclasses.replace(in_spec, dim=0), channels: owned[f"{conv_name}.weight"], **per_channel}
    sized = {n: t for n, t in (*module.named_parameters(), *module.named_buffers())
             if n.rpartition(".")[0] not in (*dims, conv_name) and any(s in by_size for s in t.shape)}
    try:
        calls, flow = trace_flow(module, lins, sized, width)
    except Exception as err:  # noqa: BLE001 - any forward may refuse a made-up input
        whole[fqn] = (f"a state-space / convolution mixer whose forward could not be traced with made-up inputs "
                      f"{input_names(module)}, to tell which of its tensors go with its channels "
                      f"({type(err).__name__}: {str(err)[:120]})")
        return None
    called = [n for n, _ in calls]
    if any(called.count(n) != 1 for n in layers):  # read as a weight (``F.linear(h, self.out_proj.weight)``)
        whole[fqn] = (f"a state-space / convolution mixer whose projections {layers} are not each called once in its "
                      f"forward ({called} called): a weight read directly cannot be made parallel")
        return None
    met = flow.met
    kept = []
    for name, t in sized.items():
        if in_proj not in met.get(name, ()):
            continue  # applied before the input projection (a norm of the width), or not at all
        owner, _, attr = name.rpartition(".")
        holder = module.get_submodule(owner) if owner else module
        if attr in holder._buffers and attr not in holder._non_persistent_buffers_set:
            kept.append(name)  # saved with the model: a checkpoint would hold this rank's part
        if isinstance(t, nn.Parameter) and not t.requires_grad:
            kept.append(name)
        dim = next(d for d in reversed(range(t.dim())) if t.shape[d] in by_size)
        owned[name] = dataclasses.replace(by_size[t.shape[dim]], dim=dim)
    if kept:
        whole[fqn] = f"a state-space mixer with per-channel tensors saved whole or frozen ({kept})"
        return None
    for names, size in counts.items():
        local.update({n: v // tp for n, v in _ints(module, names) if v == size})
    local.update({f"{conv_name}.{a}": channels // tp for a in ("in_channels", "out_channels", "groups")})
    return BlockInfo("mixer", [at(n) for n in layers], fused={at(in_proj): [in_spec]}, sizes=sizes,
                     rows=[at(n) for n in rows], rejoin=[at(n) for n in rejoin],
                     cut={at(n): s for n, s in owned.items() if _has(module, n)},
                     local_attrs={at(n): v for n, v in local.items()})


def _has(module: nn.Module, name: str) -> bool:
    owner, _, attr = name.rpartition(".")
    return getattr(module.get_submodule(owner) if owner else module, attr, None) is not None
