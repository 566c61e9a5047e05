"""The documentation site builds with ``mkdocs build --strict`` (broken links, missing pages, docstrings the API
reference cannot render all fail it), covers the public API, repeats README's commands verbatim, and its schedule
pictures are the project's own schedules."""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lightning_tpp
from launch import ROOT

DOCS = ROOT / "docs"


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    log = out.stdout + out.stderr
    warnings = [line for line in log.splitlines() if re.match(r"\s*(WARNING|ERROR)\b", line)]
    assert out.returncode == 0 and not warnings, (
        "mkdocs build --strict failed (a page in docs/ must be listed in mkdocs.yml's nav; links must resolve):\n"
        + log[-4000:])
    reference = (tmp_path / "site" / "reference" / "index.html").read_text()
    assert "microbatches" in reference and "estimate_memory" in reference  # docstrings rendered, not just headings


def test_reference_lists_every_public_name() -> None:
    text = (DOCS / "reference.md").read_text()
    documented = set(re.findall(r"^::: lightning_tpp\.(\w+)$", text, flags=re.M))
    missing = sorted(set(lightning_tpp.__all__) - documented)
    assert not missing, f"add '::: lightning_tpp.<name>' to docs/reference.md for {missing}"


def test_quickstart_repeats_readme_commands() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Set up and run", 1)[1].split("\n## ", 1)[0]
    commands = re.findall(r"```bash\n(.*?)```", section, flags=re.S)
    assert len(commands) == 2, section
    quickstart = (DOCS / "quickstart.md").read_text()
    for command in commands:
        assert command in quickstart, f"docs/quickstart.md lacks README's command {command!r}"


def _figures():
    spec = importlib.util.spec_from_file_location("docs_figures", DOCS / "figures.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("pp, m", [(2, 4), (4, 8)])
def test_timelines_are_the_schedules(pp: int, m: int) -> None:
    """Each drawn timeline runs exactly the schedule's own actions, in its order, and times like the simulator (the
    function checks the makespan and busy time against ``simulate`` itself)."""
    from lightning_tpp.pipeline.schedule import actions

    figures = _figures()
    for name, virtual in figures.SCHEDULES:
        rows = figures.timeline(name, pp, m, virtual)
        for rank, row in enumerate(rows):
            assert [a[:3] for a in row] == list(actions(name, rank, pp, m, virtual)), (name, rank)
            assert all(e > s for *_, s, e in row) and all(a[4] <= b[3] for a, b in zip(row, row[1:])), (name, rank)


def test_figures_draw(tmp_path: Path) -> None:
    figures = _figures()
    written = [figures.mesh(tmp_path), figures.schedule_timeline(tmp_path, "1f1b", 1, pp=2, m=4)]
    for path in written:
        assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for name, _ in figures.SCHEDULES:  # the committed pictures the concepts page shows
        assert (DOCS / "img" / f"schedule_{name}.png").is_file(), name
        assert f"img/schedule_{name}.png" in (DOCS / "concepts.md").read_text(), name
