"""A rank of ``TensorPipeStrategy(layout="auto")`` training a tiny model through the parity helper: records what it
trained (for the parity check), the layout rank 0 chose and, on rank 0, the ranked table's figures."""

from __future__ import annotations

import argparse
import json
import os
from dataclasses import asdict
from pathlib import Path

import functools

import lightning as L
import torch

from models import MODELS, SEQ, TinyLlama
from parity import train

# four blocks: a pipeline over the 4 processes (the naive layout) exists
MODELS.setdefault("llama4", functools.partial(TinyLlama, n_layers=4))


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    return (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()


class TensorPeak(L.Callback):
    """The tensor bytes a rank holds at its most in a step, measured: its parameters, gradients and optimizer state
    at the end of each step, plus the most bytes saved for backward alive at once during it (each storage once,
    parameters excepted). Not the process's resident memory (the interpreter, gloo's buffers)."""

    def __init__(self) -> None:
        self.peak = 0
        self.refs: dict[int, int] = {}
        self.now = self.step_peak = 0

    def _pack(self, t: torch.Tensor) -> object:
        key = _storage(t).data_ptr()
        if key == 0 or key in self.params:
            return t
        if self.refs.get(key, 0) == 0:
            self.now += _storage(t).nbytes()
            self.step_peak = max(self.step_peak, self.now)
        self.refs[key] = self.refs.get(key, 0) + 1
        return _Held(t, key, _storage(t).nbytes(), self)

    def _release(self, key: int, nbytes: int) -> None:
        self.refs[key] -= 1
        if self.refs[key] == 0:
            self.now -= nbytes

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        self.params = {_storage(p).data_ptr() for p in pl_module.parameters()}
        self.now = self.step_peak = 0
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda h: h.t if isinstance(h, _Held)
                                                              else h)
        self.hooks.__enter__()

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, *args: object) -> None:
        self.hooks.__exit__(None, None, None)
        params = list({id(p): p for p in pl_module.parameters()}.values())
        states = sum(_storage(p).nbytes() for p in params) + sum(_storage(p.grad).nbytes() for p in params
                                                                  if p.grad is not None)
        states += sum(_storage(v).nbytes() for opt in trainer.optimizers for s in opt.state.values()
                      for v in s.values() if isinstance(v, torch.Tensor))
        self.peak = max(self.peak, states + self.step_peak)


class _Held:
    __slots__ = ("t", "key", "nbytes", "owner")

    def __init__(self, t: torch.Tensor, key: int, nbytes: int, owner: TensorPeak) -> None:
        self.t, self.key, self.nbytes, self.owner = t, key, nbytes, owner

    def __del__(self) -> None:
        self.owner._release(self.key, self.nbytes)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--device-memory", type=float, default=None)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=SEQ, help="positions per sample")
    parser.add_argument("--ep", default=None, help="tp='auto' with this ep, or 'auto': ep searched alone at tp=1 "
                                                   "(else layout='auto')")
    parser.add_argument("--cp-mode", default="allgather", help="cp_mode= ('auto': the search chooses it)")
    args = parser.parse_args()
    from lightning_tpp import TensorPipeStrategy

    rank = int(os.environ["LOCAL_RANK"])
    if args.ep is None:
        strategy = TensorPipeStrategy(layout="auto", device_memory=args.device_memory, cp_mode=args.cp_mode,
                                      print_plan=False)
    else:
        auto = args.ep == "auto"
        strategy = TensorPipeStrategy(tp=1 if auto else "auto", ep="auto" if auto else int(args.ep),
                                      device_memory=args.device_memory, print_plan=False)

    def prepare(module: torch.nn.Module) -> None:
        module.example_input_array = torch.zeros(args.batch_size, args.seq, dtype=torch.long)

    peak = TensorPeak()
    record = train(args.model, strategy=strategy, devices=int(os.environ["WORLD_SIZE"]), steps=args.steps,
                   batch_size=args.batch_size, prepare=prepare, callbacks=[peak], seq=args.seq)
    out = Path(args.out)
    torch.save(asdict(record), out / f"{args.model}.rank{rank}.pt")
    chosen = strategy.parallel_state.layout
    info = {"layout": asdict(chosen), "dims": [strategy.dims.dp, strategy.dims.pp, strategy.dims.tp, strategy.dims.cp],
            "measured_peak": peak.peak, "cp_mode": strategy.config.cp_mode,
            "a2a_calls": strategy.parallel_state.context.traffic.a2a_calls
            if strategy.parallel_state.context is not None else 0,
            "ep_group": strategy._groups.ep.size if strategy._groups.ep is not None else 1}
    if strategy.layout_ranking is not None:
        best = strategy.layout_ranking.best
        info.update(memory=best.memory.total, candidates=len(strategy.layout_ranking.ranked),
                    ranked=[c.layout.describe() for c in strategy.layout_ranking.ranked],
                    dropped=[d.reason for d in strategy.layout_ranking.dropped])
    (out / f"layout.rank{rank}.json").write_text(json.dumps(info))


if __name__ == "__main__":
    main()
