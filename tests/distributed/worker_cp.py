"""A rank of a launch that trains several context-parallel configurations one after the other (see
test_cp_parity.py).

``python worker_cp.py OUT NAME[,NAME...]``: each NAME of ``CONFIGS`` trains its models with ``parity.train`` and writes
``OUT/<NAME>.<model>.rank<R>.pt`` (the parity record) and ``.json`` (the bytes the block stack saved for backward on this
rank in the first step, and the positions its blocks ran on)."""

from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch


@dataclass(frozen=True)
class Config:
    models: tuple[str, ...]
    strategy: dict[str, Any]  # TensorPipeStrategy's arguments besides print_plan
    train: dict[str, Any] = field(default_factory=dict)  # parity.train's, also given to the one-process reference

    @property
    def world(self) -> int:
        s = self.strategy
        return s.get("tp", 1) * s.get("pp", 1) * s.get("dp", 1) * s.get("cp", 1)


RUN = dict(steps=3, seq=32)
MOE_RUN = dict(steps=2, seq=16)
FAMILIES = ("cp_llama", "cp_hf_llama", "cp_hf_mistral", "cp_hf_bert", "cp_hf_packed")
CONFIGS = {
    # launch of 2 ranks
    "cp2": Config(FAMILIES, dict(cp=2), RUN),
    "cp2_dropout": Config(("cp_hf_bert_dropout",), dict(cp=2), dict(steps=1, seq=32)),  # masks per rank, no parity
    # attention other than a call of SDPA: Hugging Face eager (its own eager_attention_forward), nn.MultiheadAttention
    # (nn.TransformerEncoder with a causal mask; nn.Transformer's decoder with cross-attention; a conditioned block
    # with an explicit mask), BART's encoder and decoder stacks
    "cp2_families": Config(("cp_hf_llama_eager", "seq2seq", "cp_hf_bloom"), dict(cp=2), dict(steps=2, seq=16)),
    "cp2_families_slow": Config(("encoder", "conditioned", "hf_bart", "hf_gemma", "hf_neox", "hf_phi3", "hf_qwen3",
                                 "hf_gpt2", "litgpt"), dict(cp=2), dict(steps=2, seq=16)),
    # output_hidden_states=True, every layer's hidden state read by the loss: each recorded whole, as one process does
    "cp2_hidden": Config(("cp_hf_llama_hidden",), dict(cp=2), dict(steps=2, seq=32)),
    "cp2_padded": Config(("cp_llama", "cp_hf_bert", "hf_t5", "cp_matmul"), dict(cp=2),
                         dict(steps=3, seq=30)),  # 30 = 4 * 7 + 2
    "cp2_recompute": Config(("cp_llama", "cp_hf_mistral"), dict(cp=2, activation_checkpointing=True), RUN),
    "cp2_bf16": Config(("cp_hf_llama",), dict(cp=2), dict(RUN, precision="bf16-mixed")),
    # cp_mode="a2a" (Ulysses): positions exchanged for heads around each SDPA call
    "cp2_a2a": Config(FAMILIES, dict(cp=2, cp_mode="a2a"), RUN),
    "cp2_a2a_padded": Config(("cp_llama", "cp_hf_bert"), dict(cp=2, cp_mode="a2a"), dict(steps=3, seq=30)),
    "cp2_a2a_fallback": Config(("cp_hf_llama_eager", "seq2seq", "cp_matmul"), dict(cp=2, cp_mode="a2a"),
                               dict(steps=2, seq=16)),
    "cp2_sdpa_families": Config(("cp_hf_qwen3", "cp_hf_phi3", "cp_hf_neox", "cp_hf_gemma3"), dict(cp=2), RUN),
    "cp2_hf_more": Config(("cp_hf_gemma2", "cp_hf_falcon", "cp_hf_bigcode"), dict(cp=2), RUN),
    "cp2_a2a_families": Config(("cp_hf_qwen3", "cp_hf_phi3", "cp_hf_neox", "cp_hf_gemma3"), dict(cp=2, cp_mode="a2a"),
                               RUN),
    # mixtures of experts, the load-balancing loss on (the routers' recorded logits gathered over cp): the experts
    # whole on every rank, and split over ep drawn from the cp ranks
    "cp2_ep2": Config(("hf_mixtral_labels",), dict(cp=2, ep=2), MOE_RUN),
    "cp2_moe": Config(("hf_mixtral_labels", "hf_qwen2_moe_labels", "hf_deepseek_v3_labels", "hf_gpt_oss_labels"),
                      dict(cp=2), MOE_RUN),
    # compile=: the cp blocks compiled (aot_eager) after the first step
    "cp2_compiled": Config(("cp_hf_llama", "cp_llama"), dict(cp=2, compile={"backend": "aot_eager"}), RUN),
    "cp2_compiled_recomputed": Config(("cp_hf_llama",), dict(cp=2, compile={"backend": "aot_eager"},
                                                             activation_checkpointing=True), RUN),
    # launch of 4 ranks
    "cp4": Config(("cp_hf_mistral", "cp_hf_packed"), dict(cp=4), RUN),
    "cp2tp2": Config(("cp_hf_llama", "cp_hf_bert"), dict(cp=2, tp=2), RUN),
    "cp2tp2sp": Config(("cp_llama",), dict(cp=2, tp=2, sequence_parallel=True), RUN),
    "cp2pp2": Config(("cp_llama4",), dict(cp=2, pp=2, schedule="1f1b"), RUN),
    "cp2dp2": Config(("cp_hf_packed",), dict(cp=2, dp=2), RUN),
    # slow: more layouts of the same families
    "cp2pp2_hf": Config(("cp_hf_mistral", "cp_hf_bloom"), dict(cp=2, pp=2, schedule="1f1b"), RUN),
    # a2a: 1 key/value head per tp rank repeated for 2 cp ranks; 2 key/value heads repeated for 4 cp ranks
    "cp2tp2_a2a": Config(("cp_hf_llama",), dict(cp=2, tp=2, cp_mode="a2a"), RUN),
    "cp4_a2a": Config(("cp_hf_mistral", "cp_hf_packed"), dict(cp=4, cp_mode="a2a"), RUN),
    "cp2pp2_a2a": Config(("cp_llama4",), dict(cp=2, pp=2, schedule="1f1b", cp_mode="a2a"), RUN),
    # the other schedules: interleaved (2 virtual stages per rank), zero-bubble (the weights' gradients deferred)
    "cp2pp2_interleaved": Config(("cp_llama4",), dict(cp=2, pp=2, schedule="interleaved-1f1b", virtual_stages=2,
                                                      microbatches=2), RUN),
    "cp2pp2_zb": Config(("cp_llama4", "cp_hf_mistral"), dict(cp=2, pp=2, schedule="zero-bubble"), RUN),
    "cp2tp2_hf_more": Config(("cp_hf_gemma2", "cp_hf_falcon", "cp_hf_bigcode", "cp_hf_bloom"), dict(cp=2, tp=2), RUN),
    # T5 (relative position bias computed in its first blocks, two stacks, cross-attention) under tp and a pipeline
    "cp2tp2_t5": Config(("hf_t5",), dict(cp=2, tp=2), dict(steps=2, seq=16)),
    "cp2pp2_t5": Config(("hf_t5",), dict(cp=2, pp=2, schedule="1f1b"), dict(steps=2, seq=16)),
    # ep over cp x tp (the experts' tokens from both cp ranks, each tp rank sending its slice)
    "cp2tp2_ep4": Config(("hf_mixtral_labels", "hf_gpt_oss_one_expert"), dict(cp=2, tp=2, ep=4), MOE_RUN),
}


class BlockActivations(L.Callback):
    """The bytes the blocks of the model's stack saved for backward in the first training step (what context
    parallelism divides), counted by a saved-tensors hook around each block's forward."""

    def __init__(self, blocks: tuple[str, ...] = ()) -> None:
        self.blocks = blocks  # in one process (no strategy to name them)
        self.saved = 0
        self.positions: set[int] = set()
        self._handles: list[Any] = []
        self._step = 0

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        state = getattr(trainer.strategy, "parallel_state", None)
        for name in state.blocks if state is not None else self.blocks:
            block = pl_module.get_submodule(name)
            self._handles.append(block.register_forward_pre_hook(self._enter, with_kwargs=True))
            self._handles.append(block.register_forward_hook(self._leave))

    def _enter(self, module: Any, args: tuple, kwargs: dict) -> None:
        if self._step == 0 and torch.is_grad_enabled():
            self._ctx = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
            self._ctx.__enter__()

    def _leave(self, module: Any, args: tuple, out: Any) -> None:
        ctx = getattr(self, "_ctx", None)
        if ctx is not None:
            ctx.__exit__(None, None, None)
            self._ctx = None

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        if not isinstance(t, torch.nn.Parameter) and t.dim() >= 2:
            self.saved += t.numel() * t.element_size()
            self.positions.add(int(t.shape[1]) if t.dim() == 3 else -1)
        return t

    def on_train_batch_end(self, *args: Any) -> None:
        self._step += 1

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for h in self._handles:
            h.remove()


class DropoutMasks(L.Callback):
    """Which elements the dropout layers inside the blocks zeroed in the first training step, as digests."""

    def __init__(self) -> None:
        self.masks: list[str] = []
        self._handles: list[Any] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name in trainer.strategy.parallel_state.blocks:
            for m in pl_module.get_submodule(name).modules():
                if isinstance(m, torch.nn.Dropout) and m.p > 0:
                    self._handles.append(m.register_forward_hook(self._record))

    def _record(self, module: Any, args: tuple, out: torch.Tensor) -> None:
        if module.training and len(self.masks) < 8:
            self.masks.append(hashlib.sha256((out == 0).numpy().tobytes()).hexdigest()[:16])

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for h in self._handles:
            h.remove()


class HeadOutputs(L.Callback):
    """What the LM heads context parallelism cuts returned, each distinct (class, this rank's columns, the
    vocabulary) once."""

    def __init__(self) -> None:
        self.seen: dict[str, list[Any]] = {}
        self._handles: list[Any] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for name in trainer.strategy.parallel_state.context.heads:
            self._handles.append(pl_module.get_submodule(name).register_forward_hook(self._record(name)))

    def _record(self, name: str) -> Any:
        def hook(module: Any, args: tuple, out: torch.Tensor) -> None:
            # every call: a training step's, and a pipeline's route trace on zeros
            entry = [type(out).__name__, getattr(out, "_tpp_local", out).shape[-1], out.shape[-1]]
            if entry not in self.seen.setdefault(name, []):
                self.seen[name].append(entry)
        return hook

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        for h in self._handles:
            h.remove()


def main() -> None:
    from lightning_tpp import TensorPipeStrategy
    from parity import train

    out, names = Path(sys.argv[1]), sys.argv[2].split(",")
    rank = int(os.environ["LOCAL_RANK"])
    for name in names:
        config = CONFIGS[name]
        for model in config.models:
            stem = f"{name}.{model}.rank{rank}"
            strategy = TensorPipeStrategy(**config.strategy, print_plan=False)
            activations, masks, heads = BlockActivations(), DropoutMasks(), HeadOutputs()
            compiled = bool(config.strategy.get("compile"))  # no measuring hooks inside the compiled blocks
            record = train(model, strategy=strategy, devices=config.world, dp=config.strategy.get("dp", 1),
                           callbacks=[heads] if compiled else [activations, masks, heads], **config.train)
            torch.save(asdict(record), out / f"{stem}.pt")
            if compiled:
                from lightning_tpp.integration.compile_metrics import dynamo_counts

                graphs, breaks, reasons = dynamo_counts()
                (out / f"{stem}.compile.json").write_text(json.dumps({
                    "blocks": strategy.parallel_state.compiled, "graphs": graphs, "breaks": breaks,
                    "reasons": sorted(r.splitlines()[0] for r in reasons), "recompiles": strategy._compiled.recompiles}))
            layout = strategy.parallel_state.context.layout  # the last sequence the blocks ran on
            (out / f"{stem}.json").write_text(json.dumps({"saved": activations.saved, "local": layout.local,
                                                          "length": layout.length, "padded": layout.padded,
                                                          "dropout_masks": masks.masks, "heads": heads.seen,
                                                          "traffic": vars(strategy.parallel_state.context.traffic)}))


if __name__ == "__main__":
    main()
