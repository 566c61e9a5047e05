"""Train a small GPT on the Zen of Python with tensor and pipeline parallelism, on CPU processes.

    python examples/gpt.py                  # tp=2 x pp=2 on 4 CPU processes
    python examples/gpt.py --pp 1           # tp=2 on 2 processes
    python examples/gpt.py --pp 1 --dp 2    # tp=2 x dp=2 on 4 processes
    python examples/gpt.py --timeline out   # also out/timeline.json and out/timeline.png of step 100

The LightningModule below is written for one device and knows nothing about parallelism: the strategy finds the
attention and MLP blocks, splits them across the tensor-parallel ranks, cuts the block list into pipeline stages,
and leaves the loop to the Trainer.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import math

import lightning as L
import torch
import torch.nn.functional as F
from lightning.pytorch.callbacks import Callback
from torch import nn

from lightning_tpp import PipelineTimeline, TensorPipeStrategy

with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen; we only want its text
    import this
TEXT = codecs.decode(this.s, "rot13")
CHARS = sorted(set(TEXT))


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.n_head, self.n_embd = n_head, n_embd
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int) -> None:
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(L.LightningModule):
    def __init__(self, vocab: int = 64, block_size: int = 64, n_embd: int = 128, n_head: int = 4,
                 n_layer: int = 2, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.wte = nn.Embedding(vocab, n_embd)
        self.wpe = nn.Embedding(block_size, n_embd)
        self.blocks = nn.ModuleList([Block(n_embd, n_head) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab, bias=False)
        self.wte.weight = self.lm_head.weight  # tied

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.wte(idx) + self.wpe(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.cross_entropy(self(x).flatten(0, 1), y.flatten())
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def zen_dataset(block_size: int) -> torch.utils.data.TensorDataset:
    ids = torch.tensor([CHARS.index(c) for c in TEXT])
    starts = range(0, len(ids) - block_size - 1, 8)
    x = torch.stack([ids[s:s + block_size] for s in starts])
    y = torch.stack([ids[s + 1:s + block_size + 1] for s in starts])
    return torch.utils.data.TensorDataset(x, y)


class PrintLoss(Callback):
    def __init__(self, every: int) -> None:
        self.every = every

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        step = trainer.global_step
        if trainer.is_global_zero and (step == 1 or step % self.every == 0 or step == trainer.max_steps):
            loss = float(trainer.callback_metrics["train_loss"])
            print(f"step {step:4d}  loss {loss:.3f}  (perplexity {math.exp(loss):.1f})", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--dp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--timeline", metavar="DIR", help="record step 100 (or the last) of every rank's pipeline "
                        "into DIR/timeline.json (Chrome trace, opens in Perfetto) and DIR/timeline.png")
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = GPT(vocab=64)  # 45 characters, rounded up so the vocabulary splits evenly
    loader = torch.utils.data.DataLoader(zen_dataset(model.hparams.block_size), batch_size=16, shuffle=True)
    strategy = TensorPipeStrategy(tp=args.tp, pp=args.pp, microbatches=4 * args.pp)
    callbacks: list[Callback] = [PrintLoss(every=25)]
    if args.timeline:
        callbacks.append(PipelineTimeline(args.timeline, steps=[min(100, args.steps - 1)]))
    trainer = L.Trainer(accelerator="cpu", devices=args.tp * args.pp * args.dp, strategy=strategy,
                        max_steps=args.steps, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        callbacks=callbacks, gradient_clip_val=1.0)
    trainer.fit(model, loader)


if __name__ == "__main__":
    main()
