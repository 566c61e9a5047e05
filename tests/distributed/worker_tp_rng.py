"""Dropout under tensor parallelism (see test_tp_rng.py): masks recorded on every tp rank, with and without
activation checkpointing, and with sequence parallelism.

    python worker_tp_rng.py OUT
"""

from __future__ import annotations

import hashlib
import math
import os
import sys
from pathlib import Path

import lightning as L
import torch
import torch.nn.functional as F
from torch import nn

from models import SEQ, VOCAB, token_dataset


class DropBlock(nn.Module):
    """nanoGPT's block with its three dropouts: attention probabilities and the MLP hidden (sharded under tp), the
    residual branches (replicated after the row-parallel layers)."""

    def __init__(self, dim: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head, self.n_embd = n_head, dim
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_drop, self.resid_drop = nn.Dropout(0.3), nn.Dropout(0.3)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.3), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1))
        att = self.attn_drop(att.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf")).softmax(-1))
        x = x + self.resid_drop(self.o((att @ v).transpose(1, 2).reshape(B, T, C)))
        return x + self.resid_drop(self.mlp(self.ln2(x)))


class Attention(nn.Module):
    def __init__(self, dim: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head, self.n_embd, self.qkv, self.o = n_head, dim, nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in self.qkv(x).split(self.n_embd, dim=2))
        return self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, C))


class SequenceDropBlock(nn.Module):
    """Attention and MLP as submodules, the residual dropouts in the block: under sequence parallelism they drop
    this rank's part of the sequence."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.ln1, self.ln2, self.attn = nn.LayerNorm(dim), nn.LayerNorm(dim), Attention(dim)
        self.attn_drop = nn.Dropout(0.3)  # unused: the masks dict wants every kind
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.3), nn.Linear(4 * dim, dim))
        self.resid_drop = nn.Dropout(0.3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.resid_drop(self.attn(self.ln1(x)))
        return x + self.resid_drop(self.mlp(self.ln2(x)))


class Lit(L.LightningModule):
    def __init__(self, block: type = DropBlock) -> None:
        super().__init__()
        self.emb, self.pos = nn.Embedding(VOCAB, 32), nn.Embedding(SEQ, 32)
        self.blocks = nn.ModuleList([block() for _ in range(2)])
        self.head = nn.Linear(32, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.emb(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(x)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1), y.flatten())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def digest() -> str:
    """Where the user's CPU generator stands."""
    return hashlib.sha256(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]


def one_process_rng(sequence: bool) -> list[str]:
    """The user's generator after each step in one process without the strategy, the dropouts that tensor
    parallelism draws over shards (from the strategy's own stream) set to p=0: what the global stream must show."""
    L.seed_everything(0, verbose=False)
    module = Lit(SequenceDropBlock if sequence else DropBlock)
    for block in module.blocks:  # the residual dropout is over sequence shards only under sequence parallelism
        for drop in (block.attn_drop, block.mlp[2], *((block.resid_drop,) if sequence else ())):
            drop.p = 0.0
    states: list[str] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            states.append(digest())

    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[Record()])
    trainer.fit(module, torch.utils.data.DataLoader(token_dataset(24, SEQ), batch_size=4))
    return states


class SdpaDropBlock(nn.Module):
    """GPT-2's block as Hugging Face runs it with SDPA: the attention dropout inside
    ``scaled_dot_product_attention`` (over this rank's heads under tp), the MLP's output dropout (replicated)."""

    def __init__(self, dim: int = 32, n_head: int = 4) -> None:
        super().__init__()
        self.n_head, self.n_embd = n_head, dim
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.o = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.attn_drop, self.resid_drop = nn.Dropout(0.3), nn.Dropout(0.3)  # attn_drop: its p, given to SDPA
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Dropout(0.0), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        qkv = self.qkv(self.ln1(x)).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in qkv)
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0,
                                           is_causal=True)
        x = x + self.resid_drop(self.o(a.transpose(1, 2).reshape(B, T, C)))
        return x + self.resid_drop(self.mlp(self.ln2(x)))


class QKNormDropBlock(SdpaDropBlock):
    """OLMo-2's attention: an RMSNorm over every head's features of q and of k (run whole under tp, on gathered
    columns, then cut back to this rank's), then SDPA with dropout over this rank's heads."""

    def __init__(self, dim: int = 32, n_head: int = 4) -> None:
        super().__init__(dim, n_head)
        self.q_norm, self.k_norm = nn.RMSNorm(dim), nn.RMSNorm(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(self.n_embd, dim=2)
        q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in (q, k, v))
        a = F.scaled_dot_product_attention(q, k, v, dropout_p=self.attn_drop.p if self.training else 0.0,
                                           is_causal=True)
        x = x + self.resid_drop(self.o(a.transpose(1, 2).reshape(B, T, C)))
        return x + self.resid_drop(self.mlp(self.ln2(x)))


def train(block: type, recompute: bool, sequence: bool, compiled: bool) -> dict:
    """Three steps at tp=2: the losses, gradients and the user's generator after each step; the masks of the eager
    training forwards; under ``compile=`` (aot_eager: the graphs run eager's kernels, so eager's numbers) dynamo's
    graph breaks and the recompiles after the first compiled step."""
    from lightning_tpp import TensorPipeStrategy
    from lightning_tpp.integration.compile_metrics import dynamo_counts

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    L.seed_everything(0, verbose=False)
    module = Lit(block)
    masks: dict[str, list[torch.Tensor]] = {"attn": [], "hidden": [], "resid": []}
    for b in module.blocks if not compiled else ():  # training forwards only: not the check's nor a recomputation
        for name, drop in (("attn", b.attn_drop), ("hidden", b.mlp[2]), ("resid", b.resid_drop)):
            drop.register_forward_hook(lambda m, a, o, n=name: masks[n].append((o == 0).clone())
                                       if m.training and torch._C._current_graph_task_id() == -1 else None)
    losses: list[float] = []
    grads: list[dict[str, torch.Tensor]] = []
    rng: list[str] = []

    class Record(L.Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
            losses.append(float(outputs["loss"]))
            rng.append(digest())

        def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
            grads.append({n: p.grad.clone() for n, p in pl_module.named_parameters()})

    strategy = TensorPipeStrategy(tp=2, activation_checkpointing=recompute, sequence_parallel=sequence,
                                  print_plan=False, compile={"backend": "aot_eager"} if compiled else False)
    trainer = L.Trainer(accelerator="cpu", devices=2, strategy=strategy, max_steps=3, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        use_distributed_sampler=False, callbacks=[Record()])
    trainer.fit(module, torch.utils.data.DataLoader(token_dataset(24, SEQ), batch_size=4))
    result = {"masks": masks, "losses": losses, "grads": grads, "rng": rng,
              "recomputed": len(strategy.parallel_state.recomputed)}
    if compiled:
        result["breaks"] = dynamo_counts()[1]
        result["recompiles"] = strategy._compiled.recompiles
    return result


def main() -> None:
    out, rank = Path(sys.argv[1]), int(os.environ["LOCAL_RANK"])
    results = {}
    for recompute, sequence in ((False, False), (True, False), (False, True), (True, True)):
        block = SequenceDropBlock if sequence else DropBlock
        results[(recompute, sequence)] = train(block, recompute, sequence, compiled=False)
        results[("compiled", recompute, sequence)] = train(block, recompute, sequence, compiled=True)
    results[("sdpa", False)] = train(SdpaDropBlock, False, False, compiled=False)
    for recompute in (False, True):
        results[("sdpa compiled", recompute)] = train(SdpaDropBlock, recompute, False, compiled=True)
    results[("qknorm", False)] = train(QKNormDropBlock, False, False, compiled=False)
    results[("qknorm compiled", False)] = train(QKNormDropBlock, False, False, compiled=True)
    torch.save(results, out / f"tp_rng.rank{rank}.pt")


if __name__ == "__main__":
    main()
