"""What exact token means cost (not a test): pp=2, 8 micro-batches, a Hugging Face Llama fine-tuned with -100 prompts
and padding (its own ``.loss``), ``loss_normalization="batch"`` (each step counts every micro-batch's tokens on
stand-ins first) against ``"microbatch"`` (no count), alternated step by step in one run so that both see the same
machine; one thread per process.

    python benchmarks/token_mean.py            # about a minute on 2 cores
    python benchmarks/token_mean.py --steps 60
"""

from __future__ import annotations

import argparse
import statistics
import time

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_tpp import TensorPipeStrategy

VOCAB, DIM, LAYERS, SEQ, BATCH = 8192, 256, 4, 256, 16


class SFT(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        import transformers

        cfg = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=4 * DIM,
                                       num_hidden_layers=LAYERS, num_attention_heads=8, num_key_value_heads=4,
                                       max_position_embeddings=SEQ)
        cfg._attn_implementation = "sdpa"
        self.model = transformers.LlamaForCausalLM(cfg)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        ids, prompt = batch
        positions = torch.arange(SEQ)
        length = SEQ // 2 + prompt * 3  # prompt and padding differ per sample
        mask = (positions < length[:, None]).long()
        labels = ids.masked_fill((positions < prompt[:, None]) | (mask == 0), -100)
        return self.model(input_ids=ids, attention_mask=mask, labels=labels).loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class Alternate(L.Callback):
    """Even steps 'batch', odd 'microbatch'; the first two of each warm up."""

    def __init__(self) -> None:
        self.times: dict[str, list[float]] = {"batch": [], "microbatch": []}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        self.mode = "batch" if batch_idx % 2 == 0 else "microbatch"
        trainer.strategy._engine.executor.normalization = self.mode
        self.start = time.perf_counter()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:  # type: ignore[no-untyped-def]
        if batch_idx >= 4:
            self.times[self.mode].append(time.perf_counter() - self.start)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=24)
    args = parser.parse_args()
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randint(0, VOCAB, (BATCH * args.steps, SEQ), generator=g),
                         torch.randint(1, SEQ // 6, (BATCH * args.steps,), generator=g))
    alternate = Alternate()
    trainer = L.Trainer(accelerator="cpu", devices=2, max_steps=args.steps, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, callbacks=[alternate],
                        strategy=TensorPipeStrategy(pp=2, microbatches=8, schedule="1f1b", print_plan=False))
    trainer.fit(SFT(), DataLoader(data, batch_size=BATCH))
    if trainer.global_rank in (0, 1):
        b, m = (statistics.median(alternate.times[k]) for k in ("batch", "microbatch"))
        print(f"rank {trainer.global_rank}: step median, batch (counted) {1e3 * b:.1f} ms, microbatch {1e3 * m:.1f} "
              f"ms: ratio {b / m:.3f} over {len(alternate.times['batch'])} + {len(alternate.times['microbatch'])} "
              f"steps", flush=True)


if __name__ == "__main__":
    main()
