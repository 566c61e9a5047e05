"""Tensor-parallel benchmark (not a test): step time of the automatic plan against a hand-written one, side by side.

    python benchmarks/tensor_parallel.py            # 3 rounds, about 8 minutes on 2 cores
    python benchmarks/tensor_parallel.py --quick    # one round, fewer steps

Per model, in rounds of three runs one after the other (each ratio compares runs a minute apart at most; the median
over rounds damps this machine's drift), each process with one thread:

- ``TensorPipeStrategy(tp=2)`` under the Trainer: the plan found automatically (2 processes);
- Lightning's ``ModelParallelStrategy(tensor_parallel_size=2)`` with a hand-written DTensor plan applied in
  ``configure_model`` (column-parallel q/k/v/up(/gate), row-parallel o/down; embedding and head replicated), the
  way its documentation shows (2 processes);
- one process under the Trainer, no strategy.

Models: a hand-written GPT whose blocks hold their projections as direct children (``view(B, S, -1, head_dim)``;
D=256, 8 layers, 8 heads, T=128, batch 16, AdamW), and a Hugging Face ``LlamaForCausalLM`` of the same width. Step
time is the median over the steps after warm-up of the slowest rank. Also printed: the collectives per step that
each tensor-parallel run issues (Megatron's: 2 all-reduces per block forward and 2 backward).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pipeline import _launch as launch  # the benchmarks' one way to start ranks (this folder is on sys.path)

STEPS, WARMUP = 10, 3
VOCAB, DIM, HEADS, LAYERS, SEQ, BATCH = 1024, 256, 8, 8, 128, 16
LLAMA = dict(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=4 * DIM, num_hidden_layers=LAYERS,
             num_attention_heads=HEADS, num_key_value_heads=HEADS // 2, max_position_embeddings=SEQ)


class FlatBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.head_dim = DIM // HEADS
        self.ln1, self.ln2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x: Tensor) -> Tensor:
        B, S, _ = x.shape
        h = self.ln1(x)
        q = self.q(h).view(B, S, -1, self.head_dim).transpose(1, 2)
        k = self.k(h).view(B, S, -1, self.head_dim).transpose(1, 2)
        v = self.v(h).view(B, S, -1, self.head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(y.transpose(1, 2).reshape(B, S, -1))
        return x + self.down(F.gelu(self.up(self.ln2(x))))


class FlatGPT(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, DIM), nn.Embedding(SEQ, DIM)
        self.blocks = nn.ModuleList([FlatBlock() for _ in range(LAYERS)])
        self.ln_f, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, idx: Tensor) -> Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def _hf_llama() -> nn.Module:
    import transformers

    config = transformers.LlamaConfig(**LLAMA, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    return transformers.LlamaForCausalLM(config)


class LM(L.LightningModule):
    """An ordinary LightningModule; ``hand_plan`` applies the hand-written DTensor plan in ``configure_model``
    (``ModelParallelStrategy``'s way)."""

    def __init__(self, name: str, hand_plan: bool = False) -> None:
        super().__init__()
        self.name, self.hand_plan = name, hand_plan
        self.model = FlatGPT() if name == "flat_gpt" else _hf_llama()

    def configure_model(self) -> None:
        if not self.hand_plan:
            return
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        mesh = self.device_mesh["tensor_parallel"]
        if self.name == "flat_gpt":
            blocks = self.model.blocks
            plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "o": RowwiseParallel(),
                    "up": ColwiseParallel(), "down": RowwiseParallel()}
        else:
            blocks = self.model.model.layers
            plan = {f"self_attn.{n}_proj": ColwiseParallel() for n in "qkv"}
            plan.update({f"mlp.{n}_proj": ColwiseParallel() for n in ("gate", "up")})
            plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
        for block in blocks:
            parallelize_module(block, mesh, plan)

    def forward(self, idx: Tensor) -> Tensor:
        out = self.model(idx)
        return out if isinstance(out, Tensor) else out.logits

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        x, y = batch
        return F.cross_entropy(self(x).reshape(-1, VOCAB), y.reshape(-1))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=1e-3)


class _Collectives:
    """Counts the process-group collectives a step issues (all-reduce, all-gather, ...), by name."""

    NAMES = ("all_reduce", "all_gather", "all_gather_single", "reduce_scatter_single", "broadcast")

    def __init__(self) -> None:
        import torch.distributed as dist

        self.counts: dict[str, int] = {}
        self.active = False
        for name in self.NAMES:
            original = getattr(dist, name)

            def counted(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                if self.active:
                    self.counts[_name] = self.counts.get(_name, 0) + 1
                return _original(*args, **kwargs)

            setattr(dist, name, counted)
        # DTensor's redistributions go through the functional collectives
        import torch.distributed._functional_collectives as fc

        for name in ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor"):
            original = getattr(fc, name)

            def counted_fc(*args: Any, _name: str = name, _original: Any = original, **kwargs: Any) -> Any:
                if self.active:
                    self.counts[_name] = self.counts.get(_name, 0) + 1
                return _original(*args, **kwargs)

            setattr(fc, name, counted_fc)


def run_role(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    collectives = _Collectives() if args.role != "single" else None
    L.seed_everything(0, verbose=False)
    module = LM(args.model, hand_plan=args.role == "manual")
    times: list[float] = []
    counts: list[dict[str, int]] = []

    class Timer(L.Callback):
        def on_train_batch_start(self, *a: Any) -> None:
            if collectives is not None:
                collectives.counts, collectives.active = {}, True
            self.start = time.perf_counter()

        def on_train_batch_end(self, *a: Any) -> None:
            times.append(time.perf_counter() - self.start)
            if collectives is not None:
                collectives.active = False
                counts.append(dict(collectives.counts))

    if args.role == "ours":
        from lightning_tpp import TensorPipeStrategy

        strategy: Any = TensorPipeStrategy(tp=2, print_plan=False)
    elif args.role == "manual":
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=1, tensor_parallel_size=2)
    else:
        strategy = "auto"
    g = torch.Generator().manual_seed(0)
    data = torch.randint(0, VOCAB, (BATCH * args.steps, SEQ + 1), generator=g)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data[:, :-1], data[:, 1:]), batch_size=BATCH)
    trainer = L.Trainer(accelerator="cpu", devices=1 if args.role == "single" else 2, strategy=strategy,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=[Timer()])
    trainer.fit(module, loader)
    rank = trainer.global_rank
    (Path(args.out) / f"{args.role}.{rank}.json").write_text(json.dumps({"step": times, "counts": counts[-1:]}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", default="main", choices=("main", "ours", "manual", "single"))
    parser.add_argument("--model", default="flat_gpt")
    parser.add_argument("--models", default="flat_gpt,hf_llama")
    parser.add_argument("--out", default=None)
    parser.add_argument("--steps", type=int, default=STEPS)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.role != "main":
        return run_role(args)
    steps, warm = (6, 2) if args.quick else (args.steps, WARMUP)
    rounds = 1 if args.quick else args.rounds
    out = Path(tempfile.mkdtemp(prefix="tpp-tp-bench-"))
    med = lambda runs: max(statistics.median(r["step"][warm:]) for r in runs)  # noqa: E731 - slowest rank
    print(f"batch {BATCH} x {SEQ} tokens, D={DIM}, {LAYERS} layers, {HEADS} heads, vocab {VOCAB}, AdamW, "
          f"one thread per process; tp=2 runs use 2 processes")
    for model in args.models.split(","):
        rows = []
        counts: dict[str, Any] = {}
        for r in range(rounds):
            row = {}
            for role, n in (("ours", 2), ("manual", 2), ("single", 1)):
                runs = launch(role, n, out, ["--model", model, "--steps", str(steps)], script=__file__,
                              timeout=900)
                row[role] = med(runs)
                counts[role] = runs[0]["counts"]
            rows.append(row)
            print(f"  {model} round {r}: " + "  ".join(f"{k} {v * 1000:.1f} ms" for k, v in row.items()), flush=True)
        ratio = [r["ours"] / r["manual"] for r in rows]
        print(f"{model}:")
        for role, label in (("ours", "TensorPipeStrategy(tp=2), automatic plan"),
                            ("manual", "ModelParallelStrategy(tp=2), hand-written plan"),
                            ("single", "one process")):
            print(f"  {label:48s} {statistics.median(r[role] for r in rows) * 1000:8.1f} ms")
        print(f"  ours / hand-written = {statistics.median(ratio):.3f}   (goal <= 0.95; per round "
              f"{[round(x, 3) for x in ratio]})")
        print(f"  one process / ours  = {statistics.median(r['single'] / r['ours'] for r in rows):.3f}")
        print(f"  collectives per step: ours {counts.get('ours')}, hand-written {counts.get('manual')}")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONWARNINGS", "ignore")
    main()
