"""``examples/notebook.ipynb`` runs top to bottom in a Jupyter kernel, as a user runs it: the strategy forks tp=2 x
pp=2 CPU ranks from the kernel, rank 0 prints the plan table, the loss falls, ``PipelineTimeline`` writes its
picture and ``trainer.test`` prints its metric. The committed notebook carries no outputs."""

from __future__ import annotations

import asyncio
import math
import re
import os
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

from launch import ROOT

NOTEBOOK = ROOT / "examples" / "notebook.ipynb"
CELL_TIMEOUT_S = 240  # one cell (the training cell takes ~15 s on 2 busy cores)
TOTAL_TIMEOUT_S = 420  # the whole notebook, kernel start included, so a hang anywhere fails


def _text(cell: nbformat.NotebookNode) -> str:
    """A code cell's printed text (stdout and stderr, forked ranks' included) and its rich outputs' mime types."""
    parts = []
    for out in cell.get("outputs", []):
        if out["output_type"] == "stream":
            parts.append(out["text"])
        elif out["output_type"] == "error":
            parts.append(f"ERROR {out['ename']}: {out['evalue']}")
        else:
            parts.extend(f"<{mime}>" for mime in out.get("data", {}))
    return "".join(parts)


def _cell(nb: nbformat.NotebookNode, marker: str) -> str:
    found = [c for c in nb.cells if c.cell_type == "code" and marker in c.source]
    assert len(found) == 1, f"{len(found)} code cells contain {marker!r}; the notebook changed, update this test"
    return _text(found[0])


def _python3_kernel_of_this_interpreter(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The notebook names kernel ``python3``; make it this interpreter (the one with the project installed), without
    touching the user's Jupyter folders: a kernelspec under a temporary JUPYTER_PATH, which is searched first."""
    from ipykernel.kernelspec import install

    install(prefix=str(tmp_path / "jupyter"))  # -> <prefix>/share/jupyter/kernels/python3, argv[0] = sys.executable
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "jupyter" / "share" / "jupyter"))


def test_committed_notebook_has_no_outputs() -> None:
    nb = nbformat.read(NOTEBOOK, as_version=4)
    nbformat.validate(nb)
    dirty = [i for i, c in enumerate(nb.cells)
             if c.cell_type == "code" and (c.outputs or c.execution_count is not None)]
    assert not dirty, (f"code cells {dirty} of {NOTEBOOK.name} carry outputs or execution counts; strip them: "
                       f"jupyter nbconvert --clear-output --inplace {NOTEBOOK}")
    assert nb.metadata.kernelspec.name == "python3"


@pytest.mark.slow
def test_notebook_runs_top_to_bottom(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _python3_kernel_of_this_interpreter(tmp_path, monkeypatch)
    # the kernel inherits this environment: `from gpt import ...` as from the notebook's own folder; one thread a rank
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(ROOT / "examples"), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    # a fresh notebook's environment: earlier tests in this process may have left Lightning's rendezvous variables
    # (an in-process Trainer stores the free port it found in MASTER_PORT; by now another process may hold it)
    for name in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    work = tmp_path / "work"
    work.mkdir()
    nb = nbformat.read(NOTEBOOK, as_version=4)
    client = NotebookClient(nb, kernel_name="python3", timeout=CELL_TIMEOUT_S, allow_errors=False,
                            resources={"metadata": {"path": str(work)}})
    try:
        asyncio.run(asyncio.wait_for(client.async_execute(), TOTAL_TIMEOUT_S))
    except asyncio.TimeoutError:
        pytest.fail(f"the notebook ran past {TOTAL_TIMEOUT_S} s; outputs so far:\n"
                    + "\n".join(_text(c)[-2000:] for c in nb.cells if c.cell_type == "code"))

    plan = _cell(nb, "detect(model, tp=2)")  # the plan as data, computed in the notebook's process
    for name, style in [("wte", "vocab"), ("blocks.1.attn.c_attn", "colwise"), ("blocks.1.mlp.2", "rowwise")]:
        assert re.search(rf"^{re.escape(name)} +{style} ", plan, flags=re.M), plan

    fit = _cell(nb, "trainer.fit(")  # rank 0's table, printed from a forked rank into the cell's output
    assert "Tensor-parallel plan (tp=2)" in fit and "parameters per rank:" in fit, fit[-3000:]
    assert re.search(r"^0 +blocks\.0\.attn\.c_attn +Linear +colwise ", fit, flags=re.M), fit[-3000:]  # pp rank 0
    assert "stage 1 (pp rank 1)" in fit, fit[-3000:]

    curve = _cell(nb, "metrics.csv")
    found = re.search(r"train_loss ([\d.]+) at step \d+ -> ([\d.]+) at step (\d+)", curve)
    assert found, curve
    first, last, last_step = float(found[1]), float(found[2]), int(found[3])
    assert last < 0.85 * first and last_step >= 25, (first, last, last_step)  # measured: 4.05 -> 3.15 in 30 steps
    assert "<image/png>" in curve, curve

    png = work / "out" / "timeline.png"
    assert png.is_file() and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", sorted(work.rglob("*"))
    assert (work / "out" / "timeline.json").is_file()
    assert "<image/png>" in _cell(nb, "timeline.png")

    tested = _cell(nb, "trainer.test(")
    found = re.search(r"\[\{'test_loss': ([\d.e+-]+)\}\]", tested)
    assert found, tested[-3000:]
    test_loss = float(found[1])
    assert math.isfinite(test_loss) and test_loss < 0.9 * first, (first, test_loss)  # the trained weights were tested
