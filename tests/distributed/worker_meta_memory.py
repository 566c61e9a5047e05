"""A rank that builds a ~150 MB Hugging Face Llama in ``configure_model`` and reports how much its resident memory grew
while the strategy set it up (built on meta, cut, this rank's shards materialised), and what it holds after."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import lightning as L
import torch
import transformers

from lightning_tpp import TensorPipeStrategy


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    """This process's own peak resident memory (``VmHWM``). Not ``ru_maxrss``: a process started by (v)fork + exec
    carries its parent's high-water mark there, so a test run after others measured pytest's memory, not its own."""
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))


class Llama(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.model = None
        self.marks: dict[str, int] = {}

    def configure_model(self) -> None:
        cfg = transformers.LlamaConfig(vocab_size=4096, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                                       num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=64)
        self.model = transformers.LlamaForCausalLM(cfg)
        self.marks["configured"] = rss_bytes()

    def on_validation_start(self) -> None:
        self.marks["set up"] = rss_bytes()
        self.marks["peak at set up"] = peak_rss_bytes()

    def validation_step(self, batch: tuple[torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self.model(input_ids=batch[0], labels=batch[0]).loss)


def main() -> None:
    out, tp, pp = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    L.seed_everything(0, verbose=False)
    module = Llama()
    with torch.device("meta"):  # import the modelling code first: its import is not the model's memory
        module.configure_model()
    module.model, module.marks = None, {}
    before = rss_bytes()
    trainer = L.Trainer(accelerator="cpu", devices=tp * pp, strategy=TensorPipeStrategy(tp=tp, pp=pp, print_plan=False),
                        logger=False, enable_progress_bar=False, enable_model_summary=False, limit_val_batches=1)
    data = torch.utils.data.TensorDataset(torch.randint(0, 4096, (4, 16)))
    trainer.validate(module, torch.utils.data.DataLoader(data, batch_size=4))
    held = sum(t.numel() * t.element_size() for t in module.parameters())
    rank = int(os.environ["LOCAL_RANK"])
    marks = module.marks
    (out / f"rank{rank}.json").write_text(json.dumps({"growth": marks["peak at set up"] - before,
                                                      "held": held, "before": before, **marks}))


if __name__ == "__main__":
    main()
