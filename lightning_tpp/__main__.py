"""Command line: ``lightning-tpp consolidate CKPT OUT.ckpt`` and ``lightning-tpp export-hf CKPT DIR --module M``."""

from __future__ import annotations

import argparse
import importlib
import sys
import tempfile
from pathlib import Path
from typing import Optional, Sequence

from lightning_tpp.checkpoint.dcp import consolidate, is_sharded_checkpoint
from lightning_tpp.checkpoint.safe_load import load_or_explain


def export_hf(checkpoint: Path, out: Path, module: str, *, weights_only: bool = True) -> Path:
    """Write the Hugging Face model inside a LightningModule checkpoint in ``save_pretrained`` format.

    ``module`` is the LightningModule class as ``package.module.Class`` (its ``load_from_checkpoint`` rebuilds it).
    The checkpoint is loaded with ``weights_only`` unless told otherwise (only for files you trust)."""
    mod_name, _, cls_name = module.rpartition(".")
    if not mod_name:
        raise ValueError(f"--module {module!r} must be a dotted path such as my_project.models.MyModule")
    cls = getattr(importlib.import_module(mod_name), cls_name)
    with tempfile.TemporaryDirectory() as tmp:
        path = checkpoint
        if is_sharded_checkpoint(checkpoint):
            path = Path(tmp) / "whole.ckpt"
            consolidate(checkpoint, path, weights_only=weights_only)
        lit = load_or_explain(lambda _: cls.load_from_checkpoint(path, map_location="cpu", weights_only=weights_only),
                              checkpoint)
    models = [m for m in lit.modules() if hasattr(m, "save_pretrained") and hasattr(m, "config")]
    if not models:
        raise ValueError(f"{cls_name} holds no Hugging Face PreTrainedModel to export")
    models[0].save_pretrained(out)
    return out


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="lightning-tpp", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    c = sub.add_parser("consolidate", help="one ordinary Lightning checkpoint from a sharded one")
    c.add_argument("checkpoint", type=Path)
    c.add_argument("out", type=Path)
    e = sub.add_parser("export-hf", help="save_pretrained() the Hugging Face model of a checkpoint")
    e.add_argument("checkpoint", type=Path)
    e.add_argument("out", type=Path)
    e.add_argument("--module", required=True, help="the LightningModule class, e.g. my_project.models.MyModule")
    for p in (c, e):
        p.add_argument("--no-weights-only", dest="weights_only", action="store_false",
                       help="load with plain pickle, which runs any code a file holds: only for checkpoints you trust")
    args = parser.parse_args(argv)
    if args.command == "consolidate":
        consolidate(args.checkpoint, args.out, weights_only=args.weights_only)
        print(f"wrote {args.out}")
    else:
        export_hf(args.checkpoint, args.out, args.module, weights_only=args.weights_only)
        print(f"wrote {args.out} (load with from_pretrained)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
