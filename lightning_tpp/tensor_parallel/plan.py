"""Find what to tensor-parallelise in an unmodified model, and return it as data (no process groups here).

Recognised, bottom-up over the module tree (a module's linear layers are claimed by the first block that uses them):

* attention: a module (or its child, or its ``config``) carries a head count; its linear layers are
  ``q, k, v, o`` (grouped-query too), ``qkv, o`` (one fused projection) or ``q, kv, o``. The output projection
  is the last one, its input width is ``heads * head_dim``.  -> q/k/v column parallel, o row parallel.
* ``nn.MultiheadAttention`` (fused ``in_proj_weight``)  -> swapped for a head-parallel version.
* MLP: linear layers ``D->F, [D->F,] F->D'`` (plain or gated, e.g. SwiGLU), with no head count  -> columns + row.
* token embedding / LM head: an ``nn.Embedding(V, D)`` and a linear ``D->V`` (tied or not)  -> vocab parallel.

Everything else stays replicated. A :class:`~lightning_tpp.tensor_parallel.plan_types.TPPlan` maps module names to
styles; ``tp_plan=`` entries (globs) and a Hugging Face model's own plans are laid over it
(:mod:`~lightning_tpp.tensor_parallel.overrides`).
"""

from __future__ import annotations

from typing import Any, Collection, Mapping, Optional, Union

from torch import nn

from lightning_tpp.core.sharding import ShardSpec
from lightning_tpp.tensor_parallel.heads import per_head_parameters
from lightning_tpp.tensor_parallel.kv_share import plain_kv_spec, shared_specs
from lightning_tpp.tensor_parallel.layers import is_linear, is_transposed_linear, linear_dims
from lightning_tpp.tensor_parallel.mixer import mixer
from lightning_tpp.tensor_parallel.plan_types import (
    HEAD_DIM_NAMES,
    HEAD_NAMES,
    KV_NAMES,
    BlockInfo,
    TensorParallelConfigError,
    TPPlan,
)
from lightning_tpp.tensor_parallel.trace import input_names, trace_flow

SMALL_VOCAB = 32  # an embedding with fewer rows (a label table) is kept whole: a vocabulary split saves nothing


def _int_attr(obj: Any, names: tuple[str, ...]) -> Optional[int]:
    for n in names:
        v = getattr(obj, n, None) if obj is not None else None
        if isinstance(v, int) and not isinstance(v, bool) and v > 0:
            return v
    return None


def _find_int(module: nn.Module, names: tuple[str, ...], blocks: frozenset[int] = frozenset()) -> Optional[int]:
    """An int attribute on the module or a direct child that is not a block already (BERT keeps heads on ``self``);
    the module's ``config`` counts only for a module that looks like attention (a shared config also reaches MLPs)."""
    for obj in (module, *(c for c in module.children() if id(c) not in blocks)):
        v = None if isinstance(obj, nn.Linear) else _int_attr(obj, names)
        if v is not None:
            return v
    looks_like_attention = "att" in type(module).__name__.lower() or _int_attr(module, HEAD_DIM_NAMES) is not None
    return _int_attr(getattr(module, "config", None), names) if looks_like_attention else None


def _child_linears(module: nn.Module, prefix: str, claimed: set[str], depth: int = 2) -> list[tuple[str, nn.Module]]:
    """Unclaimed linear layers at most ``depth`` levels below ``module``, in registration order."""
    out: list[tuple[str, nn.Module]] = []
    for name, child in module.named_children():
        fqn = f"{prefix}.{name}" if prefix else name
        if isinstance(child, nn.MultiheadAttention):
            continue
        if is_linear(child):
            if fqn not in claimed:
                out.append((fqn, child))
        elif depth > 1:
            out.extend(_child_linears(child, fqn, claimed, depth - 1))
    return out


def _fits(label: str, size: int, tp: int) -> bool:
    """``tp`` divides ``size``; K/V heads may also be fewer than ranks, if they divide tp (each then replicated)."""
    return size % tp == 0 or label == "num_kv_heads" and tp % size == 0


def _divisible_choices(sizes: list[tuple[str, int]]) -> list[int]:
    top = min(v for label, v in sizes if label != "num_kv_heads")
    return [d for d in range(1, top + 1) if all(_fits(label, v, d) for label, v in sizes)]


def check_divisible(plan: TPPlan, tp: int) -> None:
    """Raise for the first block (in model order) whose heads / hidden size ``tp`` does not divide, listing the tp
    values that suit every block of the plan."""
    every = [(label, v) for b in plan.blocks.values() for label, v in b.sizes.items()]
    for fqn, b in plan.blocks.items():
        for label, v in b.sizes.items():
            if _fits(label, v, tp):
                continue
            what = f"the hidden size {v} of MLP {fqn or '<root>'}" if b.kind == "mlp" else \
                f"{label}={v} of {fqn} (heads={b.heads}, kv_heads={b.kv_heads})"
            raise TensorParallelConfigError(f"tp={tp} must divide {what}; choose tp in {_divisible_choices(every)}, "
                                            f"or pass tp_plan={{'{fqn}': 'replicate'}}")


def _attention(fqn: str, module: nn.Module, lins: list[tuple[str, nn.Module]], blocks: frozenset[int],
               traced: Optional[tuple[int, Optional[int]]] = None) -> Optional[BlockInfo]:
    """``traced``: (heads, kv heads) seen in the forward, used when no attribute holds them."""
    heads = _find_int(module, HEAD_NAMES, blocks) or (traced[0] if traced else None)
    if heads is None or len(lins) < 2:
        return None
    kv_heads = _find_int(module, KV_NAMES, blocks) or (traced[1] if traced else None)
    (_, out), inputs = lins[-1], lins[:-1]
    q_width, _ = linear_dims(out)
    if q_width % heads:
        return None
    head_dim = q_width // heads
    in_dims = [linear_dims(m) for _, m in inputs]
    if len({d[0] for d in in_dims}) > 2:
        return None
    fused: dict[str, list[ShardSpec]] = {}
    dim_of = lambda m: 1 if is_transposed_linear(m) else 0  # noqa: E731 - output dim of the weight
    if len(inputs) == 1:
        total = in_dims[0][1]
        kv_width, rem = divmod(total - q_width, 2)
        if rem or kv_width <= 0 or kv_width % head_dim:
            return None
        name, m = inputs[0]
        fused[name] = [ShardSpec(dim_of(m), (q_width, kv_width, kv_width)), ShardSpec(dim_of(m))]
    elif len(inputs) == 2:
        kv_width, rem = divmod(in_dims[1][1], 2)
        if in_dims[0][1] != q_width or rem or kv_width % head_dim:
            return None
        name, m = inputs[1]
        fused[name] = [ShardSpec(dim_of(m), (kv_width, kv_width)), ShardSpec(dim_of(m))]
    elif len(inputs) == 3:
        kv_width = in_dims[1][1]
        if in_dims[0][1] != q_width or in_dims[2][1] != kv_width or kv_width % head_dim:
            return None
    else:
        return None
    derived_kv = kv_width // head_dim
    if kv_heads is not None and kv_heads != derived_kv:
        return None
    return BlockInfo("attention", [n for n, _ in lins], heads, derived_kv, head_dim, fused,
                     {"num_heads": heads, "num_kv_heads": derived_kv})


def _share_kv(info: BlockInfo, modules: Mapping[str, nn.Module], tp: int) -> None:
    """Attention with fewer K/V heads than ranks (``kv_heads`` divides ``tp``): K/V layouts that give each rank the
    K/V heads its query heads read, whole (see :mod:`~lightning_tpp.tensor_parallel.kv_share`)."""
    if info.kind != "attention" or not info.kv_heads or info.kv_heads >= tp or tp % info.kv_heads:
        return
    kv_width = info.kv_heads * info.head_dim
    for name in info.layers:
        if name in info.row_layers():
            continue
        m = modules[name]
        if name in info.fused:
            info.fused[name] = shared_specs(info.fused[name], info.heads, info.kv_heads, info.head_dim, tp)
        elif linear_dims(m)[1] == kv_width:  # a K or a V projection of its own
            info.fused[name] = [plain_kv_spec(1 if is_transposed_linear(m) else 0, kv_width, info.kv_heads, tp)]


def _mlp(fqn: str, module: nn.Module, lins: list[tuple[str, nn.Module]]) -> Optional[BlockInfo]:
    if len(lins) < 2 or _int_attr(module, HEAD_NAMES) is not None:
        return None
    dims = [linear_dims(m) for _, m in lins]
    first, last = dims[0], dims[-1]
    if any(d != first for d in dims[:-1]) or last[0] != first[1] or last[1] != first[0] or len(lins) > 3:
        return None  # an MLP returns to the width it came from (d -> h -> d)
    if isinstance(module, nn.Sequential):  # only parameter-free layers (activations, dropout) between
        between = list(module)[list(module).index(lins[0][1]) + 1: list(module).index(lins[-1][1])]
        if any(any(True for _ in m.parameters()) for m in between if not is_linear(m)):
            return None
    return BlockInfo("mlp", [n for n, _ in lins], sizes={"hidden": first[1]})


# modules that act on each feature alone: a column-parallel layer's output may pass through them unchanged in layout
_ELEMENTWISE = (nn.ReLU, nn.ReLU6, nn.GELU, nn.SiLU, nn.Mish, nn.Tanh, nn.Sigmoid, nn.LeakyReLU, nn.ELU, nn.SELU,
                nn.CELU, nn.Hardswish, nn.Hardsigmoid, nn.Hardtanh, nn.Softplus, nn.Softsign, nn.Tanhshrink,
                nn.LogSigmoid, nn.Dropout, nn.AlphaDropout, nn.Identity)


def _sequential_pairs(fqn: str, module: nn.Module, claimed: set[str], tp: int) -> Optional[BlockInfo]:
    """An ``nn.Sequential`` (run as one: no forward of its own) whose ``Linear`` layers follow one another with only
    element-wise layers between them: each two in a row are a column/row pair, whatever their widths (an MLP
    classifier ``Linear(768, 512), ReLU, Linear(512, 256), ReLU, Linear(256, 10)`` shards the first two). A pair
    whose hidden width ``tp`` does not divide is left whole."""
    if not isinstance(module, nn.Sequential) or type(module).forward is not nn.Sequential.forward:
        return None
    layers, rows, sizes = [], [], {}
    pending: Optional[tuple[str, nn.Module]] = None
    for name, child in module.named_children():
        child_fqn = f"{fqn}.{name}" if fqn else name
        if is_linear(child) and child_fqn not in claimed:
            if pending is None:
                pending = (child_fqn, child)
                continue
            hidden = linear_dims(pending[1])[1]
            if hidden % tp == 0:
                layers += [pending[0], child_fqn]
                rows.append(child_fqn)
                sizes[f"hidden of {pending[0]}"] = hidden
                pending = None
            else:
                pending = (child_fqn, child)
        elif type(child) not in _ELEMENTWISE:
            pending = None
    return BlockInfo("mlp", layers, sizes=sizes, rows=rows) if layers else None


_UNTRACED = BlockInfo("untraced")  # what _traced returns when the module's forward could not run


def _traced(fqn: str, module: nn.Module, lins: list[tuple[str, nn.Module]], blocks: frozenset[int],
            whole: dict[str, str]) -> Optional[BlockInfo]:
    """Group ``lins`` (unclaimed linear layers at most two levels below ``module``: an attention's or MLP's own
    projections, projections that are a block's direct children, or spread over sibling modules) by the module's
    dataflow, whatever their names, order or nesting: a row-parallel layer is one whose input was computed from
    exactly the outputs of some not yet grouped layers (its columns), which feed no other layer. Columns whose
    outputs meet in a matrix product are attention (heads from an attribute or the forward's
    ``view(..., heads, head_dim)``); the others an MLP, if their features meet in no norm or reduction before the
    row layer. The block is checked numerically at its first call like any other. ``whole``
    receives why a module stays whole. Returns ``_UNTRACED`` when the forward does not run on made-up inputs
    (e.g. it needs a mask or rotary tables): the caller falls back to recognising the layout."""
    names = [n for n, _ in lins]
    skip = _not_per_head(module, lins, blocks)
    watch = {n: p for n, p in module.named_parameters() if p.dim() and not _under(n, module, skip)}
    try:
        calls, flow = trace_flow(module, lins, watch)
    except Exception as err:  # noqa: BLE001 - any forward may refuse a made-up input
        whole[fqn] = (f"no known layout, and its forward could not be traced with made-up inputs "
                      f"{input_names(module)} ({type(err).__name__}: {str(err)[:120]})")
        return _UNTRACED
    called = [n for n, _ in calls]
    if any(called.count(n) > 1 for n in names):
        whole[fqn] = f"a linear layer runs more than once in its forward ({[n for n in names if called.count(n) > 1]})"
        return None
    inputs = dict(calls)
    used: set[str] = set()
    groups: list[tuple[list[str], str]] = []
    for row, src in calls:
        cols = [n for n in called if n in src]
        if not cols or src - set(cols) or used & {row, *cols}:
            continue
        if any(src & t for n, t in inputs.items() if n != row):
            continue  # a column's output also feeds another layer: it must stay whole
        groups.append((cols, row))
        used.update({row, *cols})
    if not groups:
        whole[fqn] = (f"no linear layer's input comes only from other linear layers' outputs in its forward "
                      f"({', '.join(n.rpartition('.')[2] for n in called)} traced)")
        return None
    layers: list[str] = []
    rows: list[str] = []
    attn: Optional[BlockInfo] = None
    sizes: dict[str, int] = {}
    fused: dict[str, list[ShardSpec]] = {}
    for cols, row in groups:
        if flow.mixed & set(cols):
            info = _attention(fqn, module, [(n, dict(lins)[n]) for n in (*cols, row)], blocks,
                              _head_split(cols, flow.heads))
            if info is None or attn is not None:
                whole[f"{fqn} ({row.rpartition('.')[2]})"] = (
                    "attention whose head count was not found (no head-count attribute, no view into heads)"
                    if info is None else "a second attention in one module")
                continue
            attn = info
            sizes.update(info.sizes)
            _cut_per_head(fqn, module, info, skip, flow.scored)
        else:
            hidden = linear_dims(dict(lins)[row])[0]
            gated = _fused_gate(cols, dict(lins), hidden)
            touched = [f"{flow.touched[n]} on {n.rpartition('.')[2]}'s output" for n in cols if n in flow.touched]
            if touched:
                whole[f"{fqn} ({row.rpartition('.')[2]})"] = (
                    f"its hidden features meet another parameter of the module ({', '.join(touched)}: a depthwise "
                    f"convolution, a per-feature scale), which would have to be cut with them")
                continue
            if flow.across & set(cols) or (gated is None and any(linear_dims(dict(lins)[n])[1] != hidden
                                                                 for n in cols)):
                whole[f"{fqn} ({row.rpartition('.')[2]})"] = ("its hidden features meet in a norm or reduction, or "
                                                              "come from layers of different widths")
                continue  # not an MLP that can be cut by features
            fused.update(gated or {})
            sizes["hidden" if "hidden" not in sizes else f"hidden of {row}"] = hidden
        layers.extend((*cols, row))
        rows.append(row)
    if not layers:
        return None
    info = attn or BlockInfo("mlp")
    info.layers, info.rows, info.sizes = sorted(layers, key=names.index), rows, sizes
    info.fused.update(fused)
    return info


def _not_per_head(module: nn.Module, lins: list[tuple[str, nn.Module]], blocks: frozenset[int]) -> set[int]:
    """Ids of the modules inside ``module`` whose parameters are never per-head ones: linear layers, blocks."""
    return {id(m) for _, m in lins} | {id(m) for m in module.modules() if id(m) in blocks or is_linear(m)}


def _under(name: str, module: nn.Module, skip: set[int]) -> bool:
    """Whether parameter ``name`` of ``module`` belongs to a module of ``skip`` or one inside it."""
    m = module
    for part in name.split(".")[:-1]:
        m = getattr(m, part)
        if id(m) in skip:
            return True
    return False


def _cut_per_head(fqn: str, module: nn.Module, info: BlockInfo, skip: set[int],
                  scored: Optional[set[str]] = None) -> None:
    """The attention's parameters read per head (:func:`~lightning_tpp.tensor_parallel.heads.per_head_parameters`)
    cut with its heads: contiguous along the leading dimension, as the q projection's columns are."""
    at = lambda n: f"{fqn}.{n}" if fqn else n  # noqa: E731
    found = per_head_parameters(module, info.heads, info.head_dim, skip, scored)
    info.per_head = {at(n): seen for n, seen in found.items()}
    info.cut.update({at(n): ShardSpec(0) for n in found})


def _fused_gate(cols: list[str], lins: Mapping[str, nn.Module], hidden: int) -> Optional[dict[str, list[ShardSpec]]]:
    """One column layer ``k`` times as wide as the row layer's input (k = 2 or 3): a fused gated MLP whose forward
    splits the output into its parts (``chunk``, ``split``, slicing: ModernBERT's ``Wi``, Phi-3's ``gate_up_proj``)
    and combines them feature by feature. Each rank holds its slice of every part (as a fused qkv); an interleaved
    layout (gate and up alternating by feature blocks) is the plain split, tried second by the first-call check."""
    if len(cols) != 1:
        return None
    m = lins[cols[0]]
    k, rem = divmod(linear_dims(m)[1], hidden)
    if rem or k not in (2, 3):
        return None
    dim = 1 if is_transposed_linear(m) else 0
    return {cols[0]: [ShardSpec(dim, (hidden,) * k), ShardSpec(dim)]}


def _head_split(cols: list[str], heads: Mapping[str, tuple[int, int]]) -> Optional[tuple[int, Optional[int]]]:
    """(heads, kv heads) from how the forward viewed the columns' outputs, when it did."""
    seen = [heads[n] for n in cols if n in heads]
    if not seen:
        return None
    q = seen[0][0]
    kv = seen[1][0] if len(seen) > 1 else None
    return q, kv


def _mha(fqn: str, m: nn.MultiheadAttention, notes: list[str]) -> Optional[BlockInfo]:
    if m.kdim != m.embed_dim or m.vdim != m.embed_dim or m.bias_k is not None or m.add_zero_attn:
        notes.append(f"{fqn}: nn.MultiheadAttention with kdim/vdim, bias_k/bias_v or add_zero_attn stays replicated")
        return None
    e = m.embed_dim
    return BlockInfo("mha", [fqn, f"{fqn}.out_proj"], m.num_heads, m.num_heads, e // m.num_heads,
                     {fqn: [ShardSpec(0, (e, e, e))]}, {"num_heads": m.num_heads})


def _vocab(model: nn.Module, claimed: set[str], tp: int, plan: TPPlan,
           elsewhere: Mapping[str, nn.Module]) -> None:
    """Pair each token embedding with its LM head (a linear ``D -> V``), also when a pipeline puts one of them on
    another stage (``elsewhere``: that stage's modules, as meta copies): both stages must cut the pair the same way,
    or a tied weight's gradient sum would meet shards of different sizes."""
    local = list(model.named_modules())
    remote = list(elsewhere.items())  # the units themselves (an embedding, a head), not layers inside remote blocks
    embeddings = {n: m for n, m in local + remote if isinstance(m, nn.Embedding)}
    here = {n for n, _ in local if n not in elsewhere}
    for e_name, emb in embeddings.items():
        if e_name in claimed:
            continue
        heads = [(n, m) for n, m in local + remote if n not in claimed and is_linear(m)
                 and linear_dims(m) == (emb.embedding_dim, emb.num_embeddings)]
        tied = [(n, m) for n, m in heads if m.weight is emb.weight]
        if not heads:
            continue
        vocab = emb.num_embeddings
        if vocab < SMALL_VOCAB:
            plan.notes.append(f"{e_name}: {vocab} rows (fewer than {SMALL_VOCAB}) are not worth a vocabulary split; "
                              f"embedding and its matching linear stay whole")
            continue
        if vocab % tp or emb.max_norm is not None or emb.sparse or emb.scale_grad_by_freq:
            plan.notes.append(f"{e_name}: vocab {vocab} not divisible by tp={tp} (or max_norm/sparse set); "
                              f"embedding and LM head stay replicated")
            continue
        h_name, _ = (tied or heads)[-1]
        if any(m.weight is emb.weight for n, m in heads if n != h_name) or not {e_name, h_name} & here:
            continue
        # embeddings that share this weight (BART's shared / encoder / decoder token embeddings) are cut alike
        aliases = [n for n, m in embeddings.items() if n != e_name and m.weight is emb.weight]
        for n, style in ((e_name, "vocab"), (h_name, "colwise_gather"), *((a, "vocab") for a in aliases)):
            if n in here:
                plan.styles[n] = style
        claimed.update({e_name, h_name, *aliases})


def _widening(model: nn.Module, claimed: set[str], tp: int, plan: TPPlan, remote: Collection[str]) -> None:
    """Linear layers of the repeated blocks (in a ``ModuleList``: never an LM head, which a pipeline must pair with
    its embedding on another stage) left whole that read the model's width and widen it (adaLN / FiLM modulation:
    ``Linear(d, 6d)`` of a conditioning vector, whose shift / scale / gate chunks are read element-wise), unless
    small (under 0.1% of the model): cut by columns, their output gathered (exact whatever reads it; a modulation's
    output is one vector per sample). A patch embedding (pixels -> d) does not read the model's width; a layer of a
    module left whole for a reason (``plan.whole``: an attention not understood) stays whole with it."""
    total = sum(p.numel() for p in model.parameters())
    widths = [linear_dims(m)[0] for _, m in model.named_modules() if is_linear(m)]
    width = max(set(widths), key=widths.count) if widths else 0
    entries = {f"{n}.{c}" if n else c for n, m in model.named_modules() if isinstance(m, nn.ModuleList)
               for c, _ in m.named_children()}
    for name, m in model.named_modules():
        if name in claimed or name in remote or not is_linear(m) or plan.styles.get(name):
            continue
        d_in, d_out = linear_dims(m)
        parent = name.rpartition(".")[0]
        left = any(w == parent or w.startswith(f"{parent} (") for w in plan.whole)  # its module was left whole
        in_blocks = any(name.startswith(f"{entry}.") for entry in entries)  # an LM head or a classifier never is
        if (in_blocks and d_in == width and d_out >= 2 * d_in and d_out % tp == 0
                and m.weight.numel() * 1000 >= total and not left):
            plan.styles[name] = "colwise_gather"
            claimed.add(name)


def detect(model: nn.Module, tp: int, *, check: bool = True,
           remote: Union[Collection[str], Mapping[str, nn.Module]] = ()) -> TPPlan:
    """The automatic plan for ``model`` at tensor-parallel size ``tp`` (empty when ``tp == 1``).

    ``remote``: modules another pipeline stage holds (this rank has stand-ins); no block contains one. Given as a
    mapping to meta copies of them, an embedding here is paired with its head there (and the reverse).
    ``check=False`` leaves the divisibility check (:func:`check_divisible`) to the caller, who may first lay a
    ``tp_plan`` over the result (e.g. replicate the block that does not divide)."""
    plan = TPPlan()
    if tp == 1:
        return plan
    claimed: set[str] = set()
    modules = dict(model.named_modules())
    # modules another pipeline stage holds (``remote``), and their ancestors: no block may span stages
    spanning = {".".join(parts[:i]) for n in remote for parts in [n.split(".") if n else []]
                for i in range(len(parts) + 1)}
    for fqn, module in reversed(list(modules.items())):  # children before parents
        if any(fqn.startswith(b + ".") for b, info in plan.blocks.items() if info.kind == "mha"):
            continue
        if isinstance(module, nn.MultiheadAttention):
            info = _mha(fqn, module, plan.notes)
            if info is not None:
                plan.blocks[fqn] = info
                plan.styles[fqn] = "mha"
                plan.styles[f"{fqn}.out_proj"] = "rowwise"
                claimed.update(info.layers)
            continue
        if fqn in spanning:
            continue  # spans pipeline stages: part of it runs elsewhere, so it cannot be one parallel block here
        if isinstance(module, (nn.ModuleList, nn.ModuleDict)):
            continue  # no forward of its own: never a block (its layers would never be checked)
        lins = _child_linears(module, fqn, claimed)
        if len(lins) < 2:
            continue
        info = mixer(fqn, module, tp, plan.whole)
        if info is None and fqn in plan.whole:  # a mixer that stays whole, and why: no parent cuts its layers
            claimed.update(n for n, _ in lins)
            continue
        if info is None:
            info = _sequential_pairs(fqn, module, claimed, tp)
        if info is None:
            blocks = frozenset(id(modules[b]) for b in plan.blocks)
            info = _traced(fqn, module, lins, blocks, plan.whole)
        if info is _UNTRACED:  # its forward needs more than one input: the layout decides, unless it holds blocks
            holds = any(isinstance(m, (nn.ModuleList, nn.ModuleDict)) for m in module.modules())  # a model
            info = None if holds else _attention(fqn, module, lins, blocks) or _mlp(fqn, module, lins)
            if info is not None and info.kind == "attention":
                _cut_per_head(fqn, module, info, _not_per_head(module, lins, blocks))
        if info is None:
            continue
        plan.whole.pop(fqn, None)
        plan.blocks[fqn] = info
        rows = info.row_layers()
        for name in info.layers:
            plan.styles[name] = "rowwise" if name in rows else "colwise"
        claimed.update(info.layers)
        claimed.update(n.rpartition(".")[0] for n in info.cut)
    for info in plan.blocks.values():
        _share_kv(info, modules, tp)
    _vocab(model, claimed, tp, plan, remote if isinstance(remote, Mapping) else {})
    _widening(model, claimed, tp, plan, remote)
    plan = _ordered(plan, model)
    if check:
        check_divisible(plan, tp)
    return plan


def _ordered(plan: TPPlan, model: nn.Module) -> TPPlan:
    order = {n: i for i, (n, _) in enumerate(model.named_modules())}
    plan.styles = dict(sorted(plan.styles.items(), key=lambda kv: order.get(kv[0], 0)))
    plan.blocks = dict(sorted(plan.blocks.items(), key=lambda kv: order.get(kv[0], 0)))
    return plan
