"""The package's dependency direction, checked: a module imports only from lower layers (or its own subpackage), and
the peer subpackages never import each other. Documented in docs/architecture.md.

    6  lightning_tpp/__init__.py, __main__.py        the public names, the command line
    5  strategy.py                                   Lightning glue: orders the steps
    4  integration/, memory/, incidents/             Lightning extension points (checkpoint hooks, precision, summary,
                                                     launcher); the memory planner; the spike guard (a callback)
  3.5  steps.py                                      the setup steps, in order (the strategy, the memory planner
                                                     and the layout profile run them)
    3  parallel_state.py                             ParallelState: what was decided for one model; ModelMap
  2.5  config.py                                     TensorPipeConfig: the arguments, validated (reads the peers'
                                                     argument checks)
    2  tensor_parallel/  pipeline/  experts/  data_parallel/  context_parallel/  checkpoint/  reliability/
                                                     peers: none imports another
    1  core/                                         mesh, shards, collectives, parameter names, class swaps,
                                                     checks against the original
    0  _compat.py                                    private Lightning/torch names, wrapped once
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "lightning_tpp"
LAYERS = {"_compat": 0, "core": 1, "tensor_parallel": 2, "pipeline": 2, "experts": 2, "checkpoint": 2, "reliability": 2,
          "data_parallel": 2, "context_parallel": 2, "config": 2.5, "parallel_state": 3, "steps": 3.5, "memory": 4, "integration": 4,
          "incidents": 4, "layout": 4.5, "strategy": 5,
          "__init__": 6, "__main__": 6}  # layout: the layout search reads the memory planner; the strategy calls it


def _unit(module: str) -> str:
    """``lightning_tpp.pipeline.stage`` -> ``pipeline``; ``lightning_tpp`` (the package itself) -> ``__init__``."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else "__init__"


def _imports(path: Path) -> list[tuple[str, int]]:
    """Every lightning_tpp module this file imports (function-level and TYPE_CHECKING imports included)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("lightning_tpp"):
            out.append((node.module, node.lineno))
        elif isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names if a.name.startswith("lightning_tpp")]
    return out


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_every_module_belongs_to_a_layer() -> None:
    units = {_unit("lightning_tpp." + ".".join(p.relative_to(PACKAGE).with_suffix("").parts)) for p in _modules()}
    assert units <= set(LAYERS), f"modules outside the layer table: {sorted(units - set(LAYERS))}"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_imports_point_down(path: Path) -> None:
    own = _unit("lightning_tpp." + ".".join(path.relative_to(PACKAGE).with_suffix("").parts))
    wrong = []
    for module, line in _imports(path):
        other = _unit(module)
        if other == own:
            continue
        if LAYERS[other] >= LAYERS[own]:
            wrong.append(f"line {line}: {module} (layer {LAYERS[other]}, this file's is {LAYERS[own]})")
    assert not wrong, f"{path.relative_to(PACKAGE)} imports from its own layer or above: {wrong}"


def test_the_checker_sees_an_upward_import(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text("def f():\n    from lightning_tpp.strategy import TensorPipeStrategy\n")
    assert _imports(bad) == [("lightning_tpp.strategy", 2)]
    assert LAYERS[_unit("lightning_tpp.strategy")] > LAYERS["core"]
