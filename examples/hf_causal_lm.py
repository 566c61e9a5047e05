"""Train a Hugging Face Llama (small config, random weights, no download) from a LightningModule with tensor x
pipeline parallelism on 4 CPU processes, with validation, checkpoints, a CSV log and resume; then export it in
``save_pretrained`` format and load it back with ``transformers`` in one process.

    python examples/hf_causal_lm.py --root runs/hf_llama --steps 20            # train tp=2 x pp=2, 4 processes
    python examples/hf_causal_lm.py --root runs/hf_llama --steps 40 --resume   # continue from last.ckpt to step 40
    python examples/hf_causal_lm.py --root runs/hf_llama --export              # one process: export-hf, compare

``--restart-at 20 --steps 40`` does the first two in one launch: it stops at step 20, then a new module and a new
Trainer resume from ``last.ckpt``, as a restarted job would. Each training run ends by predicting the logits of a few
probe sequences from the best checkpoint (by ``val_loss``) with the strategy, in the tp x pp layout. ``--export``
runs, in one process, what a user would type at the repository root (``PYTHONPATH=.`` makes ``examples``
importable; ``python -m lightning_tpp export-hf ...`` does the same),

    PYTHONPATH=. lightning-tpp export-hf runs/hf_llama/checkpoints/<best> runs/hf_llama/hf \\
        --module examples.hf_causal_lm.LitLlama

then ``transformers.AutoModelForCausalLM.from_pretrained(runs/hf_llama/hf)`` and checks that its logits match those
predictions and those of ``LitLlama.load_from_checkpoint`` (one process, no strategy); a mismatch exits non-zero.

The model is built in ``configure_model``: under the strategy it is created on the meta device and each rank
allocates only its own shards; ``load_from_checkpoint`` calls the same hook in one process.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import io
import json
import sys
import tempfile
from pathlib import Path
from typing import Optional

import lightning as L
import torch
import torch.nn.functional as F
import transformers
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from lightning_tpp import TensorPipeStrategy, consolidate
from lightning_tpp import __main__ as cli

ROOT = Path(__file__).resolve().parents[1]  # the repository: `examples.hf_causal_lm` imports from here
MODULE = "examples.hf_causal_lm.LitLlama"

with contextlib.redirect_stdout(io.StringIO()):  # `import this` prints the Zen; we only want its text
    import this
TEXT = codecs.decode(this.s, "rot13").encode()  # bytes: a byte-level vocabulary of 256 needs no tokenizer


class LitLlama(L.LightningModule):
    """A next-byte language model around ``transformers.LlamaForCausalLM``, written for one device."""

    def __init__(self, vocab_size: int = 256, hidden_size: int = 64, num_layers: int = 4, num_heads: int = 4,
                 num_kv_heads: int = 2, seq_len: int = 64, lr: float = 3e-3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.model: Optional[transformers.LlamaForCausalLM] = None

    def configure_model(self) -> None:
        if self.model is not None:  # called again by a later fit/validate/predict of the same module
            return
        hp = self.hparams
        config = transformers.LlamaConfig(
            vocab_size=hp.vocab_size, hidden_size=hp.hidden_size, intermediate_size=2 * hp.hidden_size,
            num_hidden_layers=hp.num_layers, num_attention_heads=hp.num_heads, num_key_value_heads=hp.num_kv_heads,
            max_position_embeddings=hp.seq_len, tie_word_embeddings=False, attn_implementation="sdpa")
        self.model = transformers.LlamaForCausalLM(config)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids).logits

    def _loss(self, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self(x).flatten(0, 1).float(), y.flatten())

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        loss = self._loss(batch)
        self.log("train_loss", loss, prog_bar=True, sync_dist=True)
        return loss

    def validation_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> None:
        self.log("val_loss", self._loss(batch), prog_bar=True, sync_dist=True)

    def predict_step(self, batch: tuple[torch.Tensor, ...], batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=self.hparams.lr)


def windows(seq_len: int, *, validation: bool) -> torch.utils.data.TensorDataset:
    """Next-byte windows of the Zen of Python: the last tenth of the text is held out for validation."""
    ids = torch.tensor(list(TEXT))
    cut = len(ids) * 9 // 10
    ids = ids[cut - seq_len:] if validation else ids[:cut]
    starts = range(0, len(ids) - seq_len - 1, 8 if validation else 4)
    x = torch.stack([ids[s:s + seq_len] for s in starts])
    return torch.utils.data.TensorDataset(x, torch.stack([ids[s + 1:s + seq_len + 1] for s in starts]))


def probe_ids(seq_len: int) -> torch.Tensor:
    """A few fixed sequences whose logits are compared between the strategy and the exported model."""
    return torch.stack([torch.tensor(list(TEXT[s:s + seq_len])) for s in (0, 100, 200, 300)])


def train(root: Path, steps: int, *, resume: bool, val_every: int, predict: bool = True) -> None:
    last = root / "checkpoints" / "last.ckpt"
    if resume and not last.exists():
        raise FileNotFoundError(f"--resume needs {last}; run without --resume first")
    torch.set_num_threads(1)
    L.seed_everything(0, verbose=False)
    model = LitLlama()
    seq_len = model.hparams.seq_len
    train_loader = torch.utils.data.DataLoader(windows(seq_len, validation=False), batch_size=8, shuffle=True)
    val_loader = torch.utils.data.DataLoader(windows(seq_len, validation=True), batch_size=8)
    checkpoint = ModelCheckpoint(dirpath=root / "checkpoints", monitor="val_loss", mode="min", save_last=True,
                                 filename="step{step:03d}-val_loss{val_loss:.3f}", auto_insert_metric_name=False)
    trainer = L.Trainer(
        accelerator="cpu", devices=4, strategy=TensorPipeStrategy(tp=2, pp=2, microbatches=4, print_plan=not resume),
        max_steps=steps, limit_train_batches=20, val_check_interval=val_every, check_val_every_n_epoch=None,
        num_sanity_val_steps=0,
        logger=CSVLogger(root, name="logs"), callbacks=[checkpoint], log_every_n_steps=1,
        enable_progress_bar=False, enable_model_summary=False, gradient_clip_val=1.0)
    trainer.fit(model, train_loader, val_loader, ckpt_path=last if resume else None)
    if trainer.is_global_zero:
        print(f"step {trainer.global_step}  val_loss {float(trainer.callback_metrics['val_loss']):.3f}  "
              f"best {checkpoint.best_model_path}", flush=True)
    if not predict:
        return
    best = checkpoint.best_model_path  # the same path on every rank
    ids = probe_ids(seq_len)
    probe = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=len(ids))
    logits = torch.cat(trainer.predict(model, probe, ckpt_path=best))  # whole logits on every rank
    if trainer.is_global_zero:
        torch.save({"checkpoint": best, "ids": ids, "logits": logits, "global_step": trainer.global_step},
                   root / "probe.pt")


def export_hf(checkpoint: str, out: Path) -> None:
    """``lightning-tpp export-hf`` (its ``main``, in this process) as typed in a shell at the repository root."""
    if str(ROOT) not in sys.path:  # the repository root, where `examples.hf_causal_lm` imports from
        sys.path.insert(0, str(ROOT))
    argv = ["export-hf", checkpoint, str(out), "--module", MODULE]
    print("$ lightning-tpp", " ".join(argv), flush=True)
    cli.main(argv)


def compare(hf_dir: Path, probe: dict, *, atol: float = 1e-4) -> float:
    """Load the export with ``transformers`` and check its logits against the strategy's and the LightningModule's
    (loaded in one process); returns the largest difference, raises ``ValueError`` when over ``atol``."""
    hf = transformers.AutoModelForCausalLM.from_pretrained(hf_dir).eval()
    with tempfile.TemporaryDirectory() as tmp:  # the sharded checkpoint as one .ckpt, as `lightning-tpp consolidate`
        whole = Path(tmp) / "whole.ckpt"
        consolidate(Path(probe["checkpoint"]), whole)
        lit = LitLlama.load_from_checkpoint(whole, map_location="cpu").eval()
    with torch.no_grad():
        exported, single = hf(input_ids=probe["ids"]).logits, lit(probe["ids"])
    worst = 0.0
    for name, reference in (("the strategy (tp=2 x pp=2)", probe["logits"]), ("load_from_checkpoint", single)):
        diff = float((exported - reference).abs().max())
        if diff > atol:
            raise ValueError(f"logits of the export in {hf_dir} differ from {name}'s by up to {diff:.3g} "
                             f"(> {atol}) on the probe ids")
        worst = max(worst, diff)
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", type=Path, default=Path("runs/hf_llama"), help="checkpoints, logs and export")
    parser.add_argument("--steps", type=int, default=20, help="train until this global step")
    parser.add_argument("--val-every", type=int, default=10, help="validate (and checkpoint) every this many steps; "
                                                                   "an epoch is 20 steps")
    parser.add_argument("--resume", action="store_true", help="continue from ROOT/checkpoints/last.ckpt")
    parser.add_argument("--restart-at", type=int, default=None, help="stop at this step, then resume from "
                        "last.ckpt with a new module and Trainer in the same processes")
    parser.add_argument("--export", action="store_true", help="one process: export-hf the best checkpoint, load it "
                                                              "with transformers and compare logits")
    args = parser.parse_args()
    root = args.root.resolve()
    if args.export:
        probe = torch.load(root / "probe.pt", weights_only=True)  # written by the last training run
        export_hf(probe["checkpoint"], root / "hf")
        worst = compare(root / "hf", probe)
        print(json.dumps({"exported": str(root / "hf"), "checkpoint": probe["checkpoint"],
                          "max_logit_diff": worst}), flush=True)
        return
    if args.restart_at is not None:
        train(root, args.restart_at, resume=args.resume, val_every=args.val_every, predict=False)
    train(root, args.steps, resume=args.resume or args.restart_at is not None, val_every=args.val_every)

if __name__ == "__main__":
    main()
