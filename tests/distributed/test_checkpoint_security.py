"""Nothing a user loads can run code: payloads planted in a checkpoint's files are refused on every rank, in every
layout and by the command line, and the payload never runs; the user's ``weights_only=False`` is honoured."""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import ROOT, RunResult, run_ranks

SCRIPT = ROOT / "tests" / "distributed" / "worker_security.py"


class Payload:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A genuine sharded checkpoint written at tp2 x pp2."""
    ckpt = tmp_path_factory.mktemp("genuine") / "run.ckpt"
    run_ranks(SCRIPT, 4, ["save", str(ckpt), "2", "2", "sharded"], timeout=240).check()
    assert (ckpt / "meta.pt").is_file()
    return ckpt


def _plant_meta(src: Path, dst: Path, marker: Path) -> Path:
    """The checkpoint with a payload inside meta.pt: plain pickle would run it and carry on."""
    shutil.copytree(src, dst)
    meta = torch.load(dst / "meta.pt", weights_only=True)
    meta["hyper_parameters"] = {"name": Payload(marker)}
    torch.save(meta, dst / "meta.pt")
    return dst


def _plant_metadata(src: Path, dst: Path, marker: Path) -> Path:
    """The checkpoint with a payload inside DCP's .metadata, which torch's own reader would run."""
    from lightning_tpp.checkpoint.safe_load import SafeFileSystemReader

    shutil.copytree(src, dst)
    md = SafeFileSystemReader(dst).read_metadata()
    md.planner_data = {"x": Payload(marker)}
    (dst / ".metadata").write_bytes(pickle.dumps(md))
    return dst


def _assert_refused_everywhere(result: RunResult, marker: Path, what: str) -> None:
    assert not result.timed_out, "a refused checkpoint must fail fast, not hang"
    for rank, (code, out) in enumerate(zip(result.returncodes, result.outputs)):
        assert code != 0, f"rank {rank} carried on after loading a planted checkpoint:\n{out[-3000:]}"
        assert "UnsafeCheckpointError" in out and what in out and "holds the global posix.system" in out, \
            f"rank {rank} did not say what it refused:\n{out[-3000:]}"
    assert not marker.exists(), "the planted payload ran"


@pytest.mark.parametrize("plant", ["meta.pt", ".metadata"])
def test_planted_sharded_checkpoint_refused_at_tp2_pp2(tmp_path: Path, sharded: Path, plant: str) -> None:
    marker = tmp_path / "ran"
    ckpt = (_plant_meta if plant == "meta.pt" else _plant_metadata)(sharded, tmp_path / "run.ckpt", marker)
    result = run_ranks(SCRIPT, 4, ["resume", str(ckpt), "2", "2", "default"], timeout=240)
    _assert_refused_everywhere(result, marker, plant)


def test_planted_sharded_checkpoint_refused_in_one_process(tmp_path: Path, sharded: Path) -> None:
    marker = tmp_path / "ran"
    ckpt = _plant_meta(sharded, tmp_path / "run.ckpt", marker)
    result = run_ranks(SCRIPT, 1, ["resume", str(ckpt), "1", "1", "default"], timeout=120)
    _assert_refused_everywhere(result, marker, "meta.pt")


@pytest.mark.parametrize("command", ["consolidate", pytest.param("export-hf", marks=pytest.mark.slow)])
def test_planted_checkpoint_refused_by_the_command_line(tmp_path: Path, sharded: Path, command: str) -> None:
    marker = tmp_path / "ran"
    for plant in (_plant_meta, _plant_metadata):
        ckpt = plant(sharded, tmp_path / f"{plant.__name__}.ckpt", marker)
        args = [str(ckpt), str(tmp_path / "out")] + (["--module", "models.LitLM"] if command == "export-hf" else [])
        done = subprocess.run([sys.executable, "-m", "lightning_tpp", command, *args], capture_output=True, text=True,
                              timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": f"{ROOT}:{ROOT / 'tests'}"})
        assert done.returncode != 0 and "UnsafeCheckpointError" in done.stderr, done.stderr[-2000:]
        assert "holds the global posix.system" in done.stderr
        assert not marker.exists() and not (tmp_path / "out").exists()


def test_planted_single_file_checkpoint_refused(tmp_path: Path, sharded: Path) -> None:
    """The whole-file format (save_distributed_checkpoint=False): loaded as plain Lightning loads it."""
    from lightning_tpp import consolidate

    marker = tmp_path / "ran"
    whole = tmp_path / "whole.ckpt"
    consolidate(sharded, whole)
    state = torch.load(whole, weights_only=True)
    state["hyper_parameters"] = {"name": Payload(marker)}
    torch.save(state, whole)
    result = run_ranks(SCRIPT, 1, ["resume", str(whole), "1", "1", "default"], timeout=120)
    _assert_refused_everywhere(result, marker, "whole.ckpt")


def test_hyper_parameters_of_the_users_class_need_their_consent(tmp_path: Path) -> None:
    """As in plain Lightning: a class of the user's own is refused with the way to allow it, and
    ``fit(..., weights_only=False)`` loads it."""
    ckpt = tmp_path / "configured.ckpt"
    run_ranks(SCRIPT, 1, ["save", str(ckpt), "1", "1", "sharded", "configured"], timeout=120).check()
    refused = run_ranks(SCRIPT, 1, ["resume", str(ckpt), "1", "1", "default", "configured"], timeout=120)
    assert refused.returncodes[0] != 0
    assert re.search(r"holds the global \w+\.RunConfig.*torch\.serialization\.add_safe_globals\(\[\w+\.RunConfig\]\)",
                     refused.outputs[0]), refused.outputs[0][-2000:]
    trusted = run_ranks(SCRIPT, 1, ["resume", str(ckpt), "1", "1", "trust", "configured"], timeout=120).check()
    assert "resumed at step 3" in trusted.outputs[0]
