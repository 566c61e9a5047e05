"""``examples/hf_causal_lm.py`` end to end as a user runs it: a Hugging Face Llama trained at tp=2 x pp=2 on 4 CPU
processes with validation, ``ModelCheckpoint`` and a CSV log; resumed from ``last.ckpt`` by a new module and Trainer;
exported with ``lightning-tpp export-hf`` and loaded by ``transformers``, whose logits match the strategy's
predictions."""

from __future__ import annotations

import csv
import importlib.util
import json
import math
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from launch import ROOT

EXAMPLE = ROOT / "examples" / "hf_causal_lm.py"


def _run(*args: str, timeout: float) -> str:
    """Run the example; on a hang kill its whole process group (Lightning's ranks 1-3 are its children)."""
    proc = subprocess.Popen([sys.executable, str(EXAMPLE), *args], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True,
                            env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"})
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"examples/hf_causal_lm.py {' '.join(args)} hung for {timeout}s:\n{out[-3000:]}")
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # leftovers of a failed run
        except ProcessLookupError:
            pass
    assert proc.returncode == 0, out[-6000:]
    return out


def _metrics(root: Path, version: int) -> list[dict[str, str]]:
    with open(root / "logs" / f"version_{version}" / "metrics.csv") as f:
        return list(csv.DictReader(f))


def _example():
    spec = importlib.util.spec_from_file_location("hf_causal_lm_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.timeout(420)
@pytest.mark.slow
def test_hf_example_trains_resumes_and_exports(tmp_path: Path) -> None:
    import transformers

    root = tmp_path / "run"
    # one launch of 4 ranks: train to step 4, then a new module and Trainer resume from last.ckpt to step 8 (what
    # `--resume` does in a new launch; one launch keeps the test within a minute on 2 cores)
    _run("--root", str(root), "--steps", "8", "--restart-at", "4", "--val-every", "4", timeout=240)
    probe = torch.load(root / "probe.pt", weights_only=True)
    assert probe["global_step"] == 8

    fresh, resumed = _metrics(root, 0), _metrics(root, 1)
    for rows in (fresh, resumed):
        assert [r for r in rows if r["val_loss"]], rows  # validation ran and was logged in each run
    first_loss = [float(r["train_loss"]) for r in fresh if r["train_loss"]]
    resumed_loss = [float(r["train_loss"]) for r in resumed if r["train_loss"]]
    assert len(first_loss) == 4 and len(resumed_loss) == 4, (first_loss, resumed_loss)
    assert abs(first_loss[0] - math.log(256)) < 0.3, first_loss  # random init: uniform over 256 bytes
    assert resumed_loss[0] < first_loss[-1] + 0.1, (first_loss, resumed_loss)  # weights came from last.ckpt

    best = Path(probe["checkpoint"])
    assert best.parent == root / "checkpoints" and "val_loss" in best.name, best  # ModelCheckpoint(monitor=)
    assert (best / ".metadata").is_file() and (root / "checkpoints" / "last.ckpt" / ".metadata").is_file()

    out = _run("--root", str(root), "--export", timeout=150)
    report = json.loads(out.strip().splitlines()[-1])
    assert report["max_logit_diff"] < 1e-4, report

    # independently of the example's own check: transformers loads the export and matches the strategy's logits
    hf = transformers.AutoModelForCausalLM.from_pretrained(root / "hf").eval()
    assert isinstance(hf, transformers.LlamaForCausalLM)
    with torch.no_grad():
        logits = hf(input_ids=probe["ids"]).logits
    torch.testing.assert_close(logits, probe["logits"], rtol=1e-4, atol=1e-4)
    loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), probe["ids"][:, 1:].flatten())
    assert float(loss) < first_loss[0] - 0.5, (float(loss), first_loss)  # trained weights were exported

    # and the example's check fails when the export differs from what was trained
    with torch.no_grad():
        hf.lm_head.weight[3] += 0.05
    hf.save_pretrained(tmp_path / "tampered")
    with pytest.raises(ValueError, match="differ from the strategy"):
        _example().compare(tmp_path / "tampered", probe)
