"""LightningCLI reads the strategy's typed keyword arguments from the command line and from YAML."""

from __future__ import annotations

from pathlib import Path

import pytest
from lightning.pytorch.cli import LightningCLI

from lightning_tpp import TensorPipeStrategy
from models import LitLM


def test_cli_command_line() -> None:
    cli = LightningCLI(LitLM, run=False, args=[
        "--trainer.accelerator=cpu", "--trainer.devices=2", "--trainer.logger=false",
        "--trainer.strategy=lightning_tpp.TensorPipeStrategy", "--trainer.strategy.tp=2",
        "--trainer.strategy.tp_plan={'*.mlp': 'replicate'}"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, TensorPipeStrategy)
    assert strategy.config.tp == 2 and strategy.config.tp_plan == {"*.mlp": "replicate"}


def test_cli_yaml(tmp_path: Path) -> None:
    config = tmp_path / "config.yaml"
    config.write_text("""
trainer:
  accelerator: cpu
  devices: 4
  logger: false
  strategy:
    class_path: lightning_tpp.TensorPipeStrategy
    init_args:
      tp: 2
      dp: 2
      verify: false
model:
  name: llama
""")
    cli = LightningCLI(LitLM, run=False, args=[f"--config={config}"])
    strategy = cli.trainer.strategy
    assert isinstance(strategy, TensorPipeStrategy) and strategy.config.tp == 2 and strategy.config.dp == 2
    assert strategy.config.verify is False


def test_registered_name() -> None:
    import lightning as L

    trainer = L.Trainer(strategy="tensor_pipe", accelerator="cpu", devices=2, logger=False)
    assert isinstance(trainer.strategy, TensorPipeStrategy)


@pytest.mark.parametrize(("kwargs", "message"), [
    (dict(tp=0), r"tp=0 must be a positive integer"),
    (dict(tp=2, dp=0), r"dp=0 must be a positive integer or 'auto'"),
    (dict(schedule="fast"),
     r"schedule='fast' is not one of \('gpipe', '1f1b', 'interleaved-1f1b', 'zero-bubble', 'zb-drain', 'zb-lead'\)"),
    (dict(microbatches=0), r"microbatches=0 must be a positive integer"),
])
def test_constructor_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        TensorPipeStrategy(**kwargs)


def test_tp_plan_type_error() -> None:
    with pytest.raises(TypeError, match=r"tp_plan must be 'auto' or a mapping of module globs to styles, got 3"):
        TensorPipeStrategy(tp=2, tp_plan=3)  # type: ignore[arg-type]


def test_command_line_tool_imports_modules_from_the_working_directory(tmp_path: Path) -> None:
    """``lightning-tpp export-hf CKPT OUT --module my_module.MyModule`` finds ``my_module.py`` where it is run, as
    ``python -m lightning_tpp`` does (the console script's own folder is first on its path, not the working one)."""
    import shutil
    import subprocess

    tool = shutil.which("lightning-tpp")
    if tool is None:
        pytest.skip("the lightning-tpp console script is not installed (pip install -e .)")
    (tmp_path / "my_module.py").write_text("import lightning as L\n\nclass MyModule(L.LightningModule):\n    pass\n")
    done = subprocess.run([tool, "export-hf", str(tmp_path / "missing.ckpt"), str(tmp_path / "hf"), "--module",
                           "my_module.MyModule"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    assert "ModuleNotFoundError" not in done.stderr, done.stderr[-2000:]
    assert "missing.ckpt" in done.stderr, done.stderr[-2000:]  # it got past the import, to the checkpoint
