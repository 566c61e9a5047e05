"""A rank of a run that must fail with a clear error on every rank (scenario in argv[1])."""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch import nn

from lightning_tpp import TensorPipeStrategy
import models_cp  # noqa: F401 - registers the context-parallel families
from models import LitLM, token_dataset


def _off_by_a_little(gm: torch.fx.GraphModule, example_inputs: list) -> Any:
    """A torch.compile backend whose graphs are wrong (a compiler's bug): the first floating output off by 1e-2."""
    def run(*args: Any) -> Any:
        out = gm(*args)
        outs = list(out) if isinstance(out, (tuple, list)) else [out]
        i = next(i for i, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.is_floating_point())
        outs[i] = outs[i] + 1e-2
        return type(out)(outs) if isinstance(out, (tuple, list)) else outs[0]

    return run


class ShuffledMLP(nn.Module):
    """fc1 -> a fixed permutation of the hidden features (an index, which no trace tells from a gather of rows) -> fc2:
    looks like an MLP, is not element-wise in between."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)
        self.register_buffer("order", torch.arange(2 * dim).flip(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h[..., self.order[: h.shape[-1]]])


class HookedMLP(nn.Module):
    """fc1 -> GELU -> fc2, with a gradient hook on fc1's output that reads its width (a user's rescaling): under tp
    the forward is the original's, the backward is not. The forward check cannot see that; the gradient check must."""

    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        if h.requires_grad:
            h.register_hook(lambda g, width=h.shape[-1]: g * width / 64)
        return self.fc2(nn.functional.gelu(h))


class MeanShiftedEmbedding(nn.Embedding):
    """An embedding subclass whose forward reads its whole table beyond the lookup (the mean over the vocabulary)."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) - self.weight.mean(0)


class EncoderDecoder(LitLM):
    """The embedding is assigned after the transformer (so after its blocks) but used before them, and the forward
    reads its input's values as a Python list, so it cannot be run on the meta device to see the order in which it
    calls its layers (placement then follows registration). (A condition on the values, ``if (idx >= 0).all():``, is
    taken as true on the meta device and no longer stops it.)"""

    def __init__(self) -> None:
        super().__init__("nanogpt")
        self.model = nn.Transformer(d_model=32, nhead=4, num_encoder_layers=2, num_decoder_layers=2,
                                    dim_feedforward=64, batch_first=True)
        self.embed = nn.Embedding(64, 32)
        self.head = nn.Linear(32, 64)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if min(idx.flatten().tolist()) < 0:
            raise ValueError("negative token ids")
        h = self.embed(idx)
        return self.head(self.model(h, h))


class Sampling(LitLM):
    """A step that samples from the model's output distribution (cannot run on zeros)."""

    def training_step(self, batch, batch_idx):
        logits = self(batch[0])
        probs = torch.softmax(logits, -1) * (logits != 0)  # zero where the logits are exactly zero
        picked = torch.multinomial(probs.flatten(0, 1), 1)
        return -torch.log_softmax(logits, -1).flatten(0, 1).gather(1, picked).mean()


class Manual(LitLM):
    def __init__(self) -> None:
        super().__init__("nanogpt")
        self.automatic_optimization = False


class PositionalBias(nn.Module):
    """A block that adds a learned bias per position to its output: on a shard of the sequence it would add the
    first positions' bias (silently wrong under sequence parallelism unless checked)."""

    def __init__(self, block: nn.Module, seq: int = 16, dim: int = 32) -> None:
        super().__init__()
        self.block, self.pos = block, nn.Parameter(torch.randn(seq, dim) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.block(x) + self.pos[: x.shape[1]]


class Pair(nn.Module):
    def __init__(self, dim: int = 32) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))


class BypassLM(nn.Module):
    """A loop that calls each block's submodules itself, never the block: the block cannot cut the stream, and its
    norm's gradient must not be summed over tp as if it had seen a shard (silently doubled)."""

    def __init__(self, vocab: int = 64, dim: int = 32) -> None:
        super().__init__()
        self.embed, self.blocks, self.head = nn.Embedding(vocab, dim), nn.ModuleList([Pair(dim), Pair(dim)]), \
            nn.Linear(dim, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.embed(idx)
        for block in self.blocks:
            x = x + block.mlp(block.norm(x))
        return self.head(x)


class Scenario(LitLM):
    def __init__(self, scenario: str) -> None:
        super().__init__("llama" if scenario in ("heads", "embedding") else "nanogpt")
        if scenario == "heads":
            self.model = type(self.model)(n_heads=3, n_kv_heads=3, dim=48)
        if scenario == "mismatch":
            self.model.transformer.h[0].mlp = ShuffledMLP()
        if scenario == "backward":
            self.model.transformer.h[0].mlp = HookedMLP()
        if scenario == "embedding":
            self.model.tok_embeddings = MeanShiftedEmbedding(64, 32)
        if scenario == "sp_bypassed":
            self.model = BypassLM()
        if scenario == "sp_positions":
            h = self.model.transformer.h
            for i in range(len(h)):
                h[i] = PositionalBias(h[i])


SCENARIOS = {  # name -> (module, strategy kwargs, batch size)
    "heads": (lambda: Scenario("heads"), dict(tp=2), 4),
    "mismatch": (lambda: Scenario("mismatch"), dict(tp=2), 4),
    "embedding": (lambda: Scenario("embedding"), dict(tp=2), 4),
    "backward": (lambda: Scenario("backward"), dict(tp=2), 4),
    "world": (lambda: Scenario("world"), dict(tp=2), 4),
    "sp_positions": (lambda: Scenario("sp_positions"), dict(tp=2, sequence_parallel=True), 4),
    "sp_bypassed": (lambda: Scenario("sp_bypassed"), dict(tp=2, sequence_parallel=True), 4),
    "sp_odd_length": (lambda: LitLM("hf_vit"), dict(tp=2, sequence_parallel=True), 4),
    "pp_stages": (lambda: LitLM("nanogpt"), dict(pp=2, virtual_stages=2, schedule="interleaved-1f1b",
                                                  microbatches=2), 4),
    "pp_encdec": (EncoderDecoder, dict(pp=2), 4),
    "pp_manual": (Manual, dict(pp=2), 4),
    "pp_trace": (Sampling, dict(pp=2), 4),
    # the tied embedding (stage 0) vocab-parallel, the head sharing its weight (stage 1) replicated by the user
    "pp_tied_cut": (lambda: LitLM("nanogpt"), dict(tp=2, pp=2, tp_plan={"model.lm_head": "replicate"}), 4),
    # context parallelism: attention written as matmul -> softmax -> matmul (nanoGPT's), found at the first call
    "cp_eager": (lambda: LitLM("cp_nanogpt"), dict(cp=2), 4),
    # ... and a load-balancing loss computed over a block's positions, returned beside its stream
    "cp_block_aux": (lambda: LitLM("cp_aux_moe"), dict(cp=2), 4),
    # compile=: a schedule that splits backward cannot split a compiled block's backward
    "compile_zero_bubble": (lambda: LitLM("llama4"), dict(pp=2, schedule="zero-bubble",
                                                          compile={"backend": "aot_eager"}), 4),
    # ... and a compiled block that computes something else than its eager forward (checked on its first call)
    "compile_wrong": (lambda: LitLM("hf_llama"), dict(tp=2, compile={"backend": _off_by_a_little}), 4),
    "compile_wrong_pp": (lambda: LitLM("hf_llama"), dict(pp=2, schedule="1f1b", compile={"backend": _off_by_a_little}),
                         4),
    "pp_fp16": (lambda: LitLM("nanogpt"), dict(pp=2, precision_plugin=MixedPrecision(
        "16-mixed", "cpu", torch.amp.GradScaler("cpu"))), 4),
}


def main() -> None:
    scenario, devices = sys.argv[1], int(sys.argv[2])
    make, kwargs, batch_size = SCENARIOS[scenario]
    L.seed_everything(0, verbose=False)
    trainer = L.Trainer(accelerator="cpu", devices=devices, strategy=TensorPipeStrategy(**kwargs), max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False)
    trainer.fit(make(), torch.utils.data.DataLoader(token_dataset(24), batch_size=batch_size))


if __name__ == "__main__":
    main()
