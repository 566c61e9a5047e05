"""Command line: ``lightning-tpp consolidate CKPT OUT.ckpt``, ``lightning-tpp export-hf CKPT DIR --module M`` and
``lightning-tpp plan MODEL --tp 8 --pp 4 ...`` (memory per rank, computed on the meta device)."""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional, Sequence

import torch
from torch import nn

from lightning_tpp.checkpoint.dcp import consolidate, is_sharded_checkpoint
from lightning_tpp.checkpoint.safe_load import load_or_explain
from lightning_tpp.core.optional import MissingDependencyError, require
from lightning_tpp.config import parse_bytes
from lightning_tpp.memory import GiB, MemoryReport, estimate_memory
from lightning_tpp.pipeline.build import format_partition


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


def build_on_meta(target: str, init_args: Optional[dict[str, Any]] = None) -> nn.Module:
    """The model ``target`` names, built on the meta device: a Hugging Face ``config.json`` (or a folder holding
    one) through ``AutoModelForCausalLM.from_config``, else a class ``package.module.Class`` called with
    ``init_args``, then its ``configure_model()`` if it has one (a LightningModule's hook for large models)."""
    path = Path(target)
    if path.is_dir() and (path / "config.json").is_file():
        path = path / "config.json"
    if path.suffix == ".json" and path.is_file():
        transformers = require("transformers", f"building the model of {path} (a Hugging Face config)")
        config = transformers.AutoConfig.for_model(**json.loads(path.read_text()))
        with torch.device("meta"):
            return transformers.AutoModelForCausalLM.from_config(config)
    mod_name, _, cls_name = target.rpartition(".")
    if not mod_name:
        raise ValueError(f"{target!r} is neither a config.json nor a dotted path such as my_project.models.MyModule")
    cls = getattr(importlib.import_module(mod_name), cls_name)
    with torch.device("meta"):
        model = cls(**(init_args or {}))
        if callable(getattr(model, "configure_model", None)):
            model.configure_model()
    return model


def _init_args(args: argparse.Namespace) -> dict[str, Any]:
    out = json.loads(args.init_args) if args.init_args else {}
    for item in args.arg:
        key, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"--arg {item!r} must be key=value")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def plan(args: argparse.Namespace) -> Optional[MemoryReport]:
    """Print the partition, the memory per rank and what fits a device of ``--device-memory``; with ``--auto``,
    every layout of ``--devices`` ranked (``lightning_tpp.layout``)."""
    model = build_on_meta(args.model, _init_args(args))
    if args.auto:
        from lightning_tpp.layout.paper import rank_on_paper
        ranking = rank_on_paper(model, devices=args.devices, devices_per_node=args.devices_per_node,
                                device=args.device, batch=args.batch_size, seq_len=args.seq_len,
                                device_memory=parse_bytes(args.device_memory), global_batch=args.global_batch,
                                dtype=getattr(torch, args.dtype), optimizer=args.optimizer,
                                cp_mode=None if args.cp_mode == "auto" else args.cp_mode)
        print(ranking.table(top=args.top))
        print(ranking.why())
        return None
    if args.cp_mode == "auto":
        raise SystemExit("lightning-tpp plan: --cp-mode auto ranks both modes with --auto; without it, give "
                         "--cp-mode allgather or a2a")
    kwargs = dict(tp=args.tp, pp=args.pp, dp=args.dp, microbatches=args.microbatches, batch_size=args.batch_size,
                  seq_len=args.seq_len, schedule=args.schedule, virtual_stages=args.virtual_stages,
                  optimizer=args.optimizer, param_dtype=getattr(torch, args.dtype), dp_shard=args.dp_shard,
                  vocab_exchange=args.vocab_exchange, ep=args.ep, cp=args.cp, cp_mode=args.cp_mode,
                  backend=args.backend)
    report = estimate_memory(model, activation_checkpointing=args.activation_checkpointing, **kwargs)
    if report.partition is not None:
        print(format_partition(report.partition, args.pp))
    print(report)
    device = parse_bytes(args.device_memory)
    other = estimate_memory(model, activation_checkpointing=not args.activation_checkpointing, **kwargs)
    print(f"\nWhat fits a device of {args.device_memory} ({device / GiB:.1f} GiB), micro-batch of "
          f"{report.micro_batch_size} x {report.seq_len} tokens, {report.microbatches} micro-batches:")
    for r in sorted((report, other), key=lambda r: r.activation_checkpointing):
        room = [(device - x.states) / (x.activations / r.micro_batch_size or 1) for x in r.ranks]
        most = max(int(min(room)), 0)
        print(f"  activation checkpointing {'on ' if r.activation_checkpointing else 'off'}: largest rank "
              f"{r.largest.total / GiB:.2f} GiB -> {'fits' if r.fits(device) else 'does not fit'}; activations grow "
              f"with the micro-batch: up to {most} sequence(s) of {r.seq_len} tokens per micro-batch fit")
    return report


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
    _plan_parser(sub)
    for p in (c, e):
        p.add_argument("--no-weights-only", dest="weights_only", action="store_false",
                       help="load with plain pickle, which runs any code a file holds: only for checkpoints you trust")
    args = parser.parse_args(argv)
    if "" not in sys.path and os.getcwd() not in sys.path:  # --module/MODEL import paths resolve from the working
        sys.path.insert(0, os.getcwd())                     # directory, as under `python -m lightning_tpp`
    try:
        if args.command == "plan":
            plan(args)
        elif args.command == "consolidate":
            consolidate(args.checkpoint, args.out, weights_only=args.weights_only)
            print(f"wrote {args.out}")
        else:
            export_hf(args.checkpoint, args.out, args.module, weights_only=args.weights_only)
            print(f"wrote {args.out} (load with from_pretrained)")
    except MissingDependencyError as err:  # what to install, without a traceback
        print(f"lightning-tpp {args.command}: {err}", file=sys.stderr)
        return 1
    return 0


def _plan_parser(sub: Any) -> None:
    p = sub.add_parser("plan", help="memory per rank of a layout, computed on the meta device (nothing allocated)")
    p.add_argument("model", help="a Hugging Face config.json (or its folder), or a model class such as "
                                 "my_project.models.MyModule (built on meta; its configure_model() called)")
    p.add_argument("--init-args", default=None, help='the class\'s arguments as JSON, e.g. \'{"n_layers": 32}\'')
    p.add_argument("--arg", action="append", default=[], help="one argument key=value (value read as JSON if it "
                                                              "parses); may be repeated")
    for name, default in (("--tp", 1), ("--pp", 1), ("--dp", 1), ("--virtual-stages", 1)):
        p.add_argument(name, type=int, default=default)
    p.add_argument("--ep", type=int, default=1, help="experts split over ep ranks drawn from dp x cp x tp (as the "
                                                     "strategy's ep=)")
    p.add_argument("--cp", type=int, default=1, help="context parallelism: the blocks run on seq-len / cp positions "
                   "of each sequence (docs/context_parallel.md)")
    p.add_argument("--cp-mode", default="allgather", choices=("allgather", "a2a", "auto"),
                   help="how each attention sees the whole sequence under cp (as the strategy's cp_mode=; 'auto' "
                        "with --auto: both modes ranked)")
    p.add_argument("--microbatches", type=int, default=None, help="per step (default 2 * pp, as the strategy)")
    p.add_argument("--batch-size", type=int, required=True, help="global batch: all dp replicas together")
    p.add_argument("--seq-len", type=int, required=True)
    p.add_argument("--schedule", default="auto",
                   help='as the strategy\'s; "auto" (the default): the most any schedule it may run holds')
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "adam", "sgd-momentum", "sgd"))
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"),
                   help="parameter dtype (gradients and optimizer state follow it, as in torch.optim)")
    p.add_argument("--no-dp-shard", dest="dp_shard", action="store_false",
                   help="states replicated over dp (dp_sharding=\"no_shard\") instead of FSDP2-sharded (the default)")
    p.add_argument("--no-vocab-exchange", dest="vocab_exchange", action="store_false",
                   help="vocabulary matrices gathered by FSDP2 like other units (vocab_exchange=False) instead of "
                        "computed over dp where their rows lie (the default)")
    p.add_argument("--backend", default="nccl", choices=("nccl", "gloo"),
                   help="the process groups' backend: nccl (GPUs, the default) or gloo (CPU processes)")
    p.add_argument("--device-memory", default="80GB", help="e.g. 80GB (10^9 bytes) or 80GiB (2^30 bytes)")
    a = p.add_argument_group("--auto: every layout ranked by predicted time per sample (docs/layout.md); "
                             "--batch-size is then per process, as a loader's")
    a.add_argument("--auto", action="store_true")
    a.add_argument("--devices", type=int, default=8, help="devices in all")
    a.add_argument("--devices-per-node", type=int, default=8)
    a.add_argument("--device", default="h100", help="h100, h200 or a100 (lightning_tpp.layout.DEVICES)")
    a.add_argument("--global-batch", type=int, default=None, help="samples per optimizer step, kept fixed")
    a.add_argument("--top", type=int, default=10, help="rows of the ranked table")


if __name__ == "__main__":
    sys.exit(main())
