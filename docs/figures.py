"""Draw the documentation's pictures from the project's own code: the rank layout from ``MeshDims``, stages and units
from ``plan_partition``, each schedule's timeline from its per-rank action lists (``pipeline.schedule.actions``)
timed as ``pipeline.schedule.simulate`` times them, and the measured ratios of ``docs/benchmarks.md``.

    pip install -e ".[plots]" && python docs/figures.py            # writes docs/img/*.png
    python docs/figures.py --out /tmp/img                            # somewhere else

The PNGs are committed, so that ``mkdocs build`` needs neither matplotlib nor this script.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.patches import Rectangle  # noqa: E402
from torch import nn  # noqa: E402

from lightning_tpp import MeshDims  # noqa: E402
from lightning_tpp.pipeline.partition import plan_partition  # noqa: E402
from lightning_tpp.pipeline.schedule import actions, simulate, theoretical_bubble  # noqa: E402

STAGE_COLORS = ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860")
KIND_COLORS = {"F": "#4c72b0", "B": "#c44e52", "I": "#dd8452", "W": "#55a868"}
SCHEDULES = (("gpipe", 1), ("1f1b", 1), ("interleaved-1f1b", 2), ("zero-bubble", 1), ("zb-drain", 1), ("zb-lead", 1))
PNG = {"metadata": {"Software": None}, "dpi": 110}  # no version stamp: the same figure gives the same bytes


def _save(fig: plt.Figure, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, **PNG)
    plt.close(fig)
    return path


def mesh(out: Path, dims: MeshDims = MeshDims(dp=2, pp=2, tp=2)) -> Path:
    """Every global rank at its (dp, pp, tp) position; tp innermost, so a tensor-parallel group is adjacent ranks."""
    fig, ax = plt.subplots(figsize=(8, 3.2))
    for rank in range(dims.world_size):
        c = dims.coords(rank)
        x, y = c["dp"] * (dims.tp + 0.8) + c["tp"], dims.pp - 1 - c["pp"]
        ax.add_patch(Rectangle((x + 0.05, y + 0.1), 0.9, 0.8, color=STAGE_COLORS[c["pp"] % len(STAGE_COLORS)]))
        ax.text(x + 0.5, y + 0.5, f"rank {rank}\ntp {c['tp']}", ha="center", va="center", color="white", fontsize=9)
    for d in range(dims.dp):
        x0 = d * (dims.tp + 0.8)
        ax.add_patch(Rectangle((x0 - 0.05, -0.05), dims.tp + 0.1, dims.pp + 0.1, fill=False, ls="--", lw=1.2))
        ax.text(x0 + dims.tp / 2, dims.pp + 0.15, f"dp replica {d}", ha="center", fontsize=10)
    for s in range(dims.pp):
        ax.text(-0.15, dims.pp - 1 - s + 0.5, f"pp stage {s}", ha="right", va="center", fontsize=10)
    ax.set_xlim(-1.6, dims.dp * (dims.tp + 0.8))
    ax.set_ylim(-0.3, dims.pp + 0.6)
    ax.set_axis_off()
    ax.set_title(f"dp={dims.dp} x pp={dims.pp} x tp={dims.tp}: {dims.world_size} ranks; each tp group shares a stage's "
                 f"layers, cut in {dims.tp}", fontsize=10)
    return _save(fig, out / "mesh.png")


class _Block(nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.attn, self.mlp = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x):
        return x + self.mlp(self.attn(x))


class _LM(nn.Module):
    """The shape the partitioner looks for: an embedding, a list of same-class blocks, a norm and a head."""

    def __init__(self, n: int = 8, d: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, d)
        self.layers = nn.ModuleList(_Block(d) for _ in range(n))
        self.norm, self.head = nn.LayerNorm(d), nn.Linear(d, 16)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def stages(out: Path) -> Path:
    """Which rank holds which unit: pp=2 (two stages) and pp=2 with virtual_stages=2 (four chunks, two per rank)."""
    model = _LM()
    fig, axes = plt.subplots(2, 1, figsize=(9, 3.4))
    for ax, (pp, virtual) in zip(axes, ((2, 1), (2, 2))):
        part = plan_partition(model, pp * virtual)
        owners = part.owners()
        units = [*part.pre, *(m[0] for m in part.members), *part.post]
        for i, name in enumerate(units):
            stage = owners[name]
            rank = stage % pp
            ax.add_patch(Rectangle((i + 0.05, 0.1), 0.9, 0.8, color=STAGE_COLORS[rank]))
            label = name.replace("layers.", "block ")
            ax.text(i + 0.5, 0.5, f"{label}\nstage {stage}", ha="center", va="center", color="white", fontsize=7.5)
        ax.set_xlim(-0.1, len(units) + 0.1)
        ax.set_ylim(0, 1)
        ax.set_axis_off()
        what = f"pp={pp}" + (f", virtual_stages={virtual}: stage s runs on rank s mod pp" if virtual > 1 else "")
        ax.set_title(f"{what} (colour = pipeline rank)", fontsize=9.5)
    return _save(fig, out / "stages.png")


def timeline(schedule: str, pp: int, m: int, virtual: int = 1, *, f: float = 1.0, b: float = 2.0,
             w_share: float = 0.5) -> list[list[tuple[str, int, int, float, float]]]:
    """Each rank's ``(kind, microbatch, chunk, start, end)``: the schedule's own action lists, each action started as
    soon as its rank is free and its inputs have arrived, with ``simulate``'s costs and dependencies (checked: the
    same makespan and busy times as ``simulate``)."""
    orders = [actions(schedule, r, pp, m, virtual) for r in range(pp)]
    cost = {"F": f, "B": b, "I": (1 - w_share) * b, "W": w_share * b}
    done: dict[tuple[str, int, int], float] = {}
    clock, pos = [0.0] * pp, [0] * pp
    rows: list[list[tuple[str, int, int, float, float]]] = [[] for _ in range(pp)]
    last = pp * virtual - 1

    def ready(rank: int, kind: str, mb: int, chunk: int) -> Optional[float]:
        g = chunk * pp + rank
        deps = [("F", mb, g - 1)] if kind == "F" and g > 0 else []
        if kind in ("B", "I"):
            deps.append(("F", mb, g))
            if g < last:
                deps.append(("B", mb, g + 1) if ("B", mb, g + 1) in done else ("I", mb, g + 1))
        if kind == "W":
            deps.append(("I", mb, g))
        return None if any(d not in done for d in deps) else max((done[d] for d in deps), default=0.0)

    while any(pos[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, mb, chunk = orders[r][pos[r]]
                t = ready(r, kind, mb, chunk)
                if t is None:
                    break
                start = max(clock[r], t)
                clock[r] = start + cost[kind]
                done[(kind, mb, chunk * pp + r)] = clock[r]
                rows[r].append((kind, mb, chunk, start, clock[r]))
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"{schedule} deadlocks at pp={pp}, m={m}, v={virtual}")
    sim = simulate(schedule, pp, m, virtual, f=f, b=b, w_share=w_share)
    busy = [sum(e - s for *_, s, e in row) for row in rows]
    if abs(max(clock) - sim.makespan) > 1e-9 or any(abs(x - y) > 1e-9 for x, y in zip(busy, sim.busy)):
        raise RuntimeError(f"{schedule}: the drawn timeline ({max(clock)}) differs from simulate ({sim.makespan})")
    return rows


def schedule_timeline(out: Path, schedule: str, virtual: int, pp: int = 4, m: int = 8) -> Path:
    rows = timeline(schedule, pp, m, virtual)
    makespan = max(row[-1][4] for row in rows)
    fig, ax = plt.subplots(figsize=(11, 0.55 * pp + 1.1))
    for r, row in enumerate(rows):
        for kind, mb, chunk, start, end in row:
            y = pp - 1 - r
            alpha = 1.0 if chunk == 0 else 0.6
            ax.add_patch(Rectangle((start, y + 0.08), end - start, 0.84, color=KIND_COLORS[kind], alpha=alpha,
                                   ec="white", lw=0.6))
            ax.text((start + end) / 2, y + 0.5, f"{kind}{mb}" + ("'" * chunk), ha="center", va="center",
                    color="white", fontsize=7)
    ax.set_yticks([pp - 1 - r + 0.5 for r in range(pp)], [f"rank {r}" for r in range(pp)])
    ax.set_xlim(0, makespan)
    ax.set_ylim(0, pp)
    ax.set_xlabel("time (forward = 1, backward = 2; I and W = 1 each)")
    bubble = sum(1 - sum(e - s for *_, s, e in row) / makespan for row in rows) / pp
    extra = f", virtual_stages={virtual} (' = second chunk)" if virtual > 1 else ""
    ax.set_title(f"schedule={schedule!r}, pp={pp}, microbatches={m}{extra}: step {makespan:g}, "
                 f"idle fraction {bubble:.2f}", fontsize=10)
    for side in ("top", "right"):
        ax.spines[side].set_visible(False)
    return _save(fig, out / f"schedule_{schedule}.png")


def bubbles(out: Path, pp: int = 4) -> Path:
    """Idle fraction against the micro-batch count for every schedule (simulator) and the (p-1)/(m*v+p-1) formula."""
    ms = [m for m in range(pp, 8 * pp + 1, pp)]
    fig, ax = plt.subplots(figsize=(7, 3.6))
    for name, virtual in SCHEDULES:
        values = [sum(simulate(name, pp, m, virtual).bubble) / pp for m in ms]
        ax.plot(ms, values, marker="o", label=f"{name}" + (f" (v={virtual})" if virtual > 1 else ""))
    ax.plot(ms, [theoretical_bubble(pp, m) for m in ms], ls=":", color="grey", label="(p-1)/(m+p-1)")
    ax.set_xlabel(f"microbatches (pp={pp})")
    ax.set_ylabel("idle fraction of the step")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return _save(fig, out / "bubbles.png")


# measured ratios, as recorded in docs/tensor_parallel.md, docs/pipeline.md and docs/memory.md (2-core CPU machine)
MEASURED = (
    ("tp=2 step time: ours / hand-written DTensor plan, GPT", 0.85, "tensor_parallel.md"),
    ("tp=2 step time: ours / hand-written DTensor plan, HF Llama", 0.84, "tensor_parallel.md"),
    ("pp=2 1F1B step time: ours / hand-written torch pipelining", 1.007, "pipeline.md"),
    ("pp=2 1F1B step time: DeepSpeed / ours", 0.996, "pipeline.md"),
    ("pp=2 zb-drain step time: DeepSpeed / ours", 1.070, "pipeline.md"),
    ("pp=2 speedup over one process: 1F1B", 1.71, "pipeline.md"),
    ("pp=2 speedup over one process: zb-drain", 1.81, "pipeline.md"),
    ("pp=2 speedup over one process: hand-written 1F1B", 1.76, "pipeline.md"),
    ("memory states / ideal share, tp2 x pp2 (x dp2)", 1.00, "memory.md"),
    ("memory peak / ideal share, tp2 x pp2", 1.22, "memory.md"),
    ("memory peak / ideal share, tp2 x pp2 x dp2, act. ckpt", 1.55, "memory.md"),
)


def benchmarks(out: Path) -> Path:
    fig, ax = plt.subplots(figsize=(9, 4.6))
    labels = [m[0] for m in MEASURED][::-1]
    values = [m[1] for m in MEASURED][::-1]
    ax.barh(labels, values, color=["#55a868" if "memory" in n else "#4c72b0" for n in labels])
    for i, v in enumerate(values):
        ax.text(v + 0.02, i, f"{v:g}", va="center", fontsize=8)
    ax.axvline(1.0, color="grey", lw=0.8, ls="--")
    ax.set_xlabel("ratio (1.0 = parity)")
    ax.tick_params(axis="y", labelsize=8)
    ax.set_xlim(0, max(values) + 0.3)
    ax.set_title("Measured ratios (docs/benchmarks.md)", fontsize=10)
    return _save(fig, out / "benchmarks.png")


def main(argv: Optional[list[str]] = None) -> list[Path]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "img")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    written = [mesh(args.out), stages(args.out), bubbles(args.out), benchmarks(args.out)]
    written += [schedule_timeline(args.out, name, virtual) for name, virtual in SCHEDULES]
    for path in written:
        print(f"wrote {path}")
    return written


if __name__ == "__main__":
    main()
