"""The private Lightning/torch names wrapped in ``lightning_tpp._compat`` still mean what they meant: an upgrade that
moves one fails here, by name, instead of silently changing behaviour."""

from __future__ import annotations

import inspect

from lightning.pytorch import Trainer

from lightning_tpp._compat import requested_weights_only


def test_trainer_run_still_carries_weights_only() -> None:
    """``requested_weights_only`` reads this parameter from the running ``Trainer._run``."""
    assert "weights_only" in inspect.signature(Trainer._run).parameters


def test_lightning_still_drops_weights_only_for_restore_after_setup() -> None:
    """When this fails, Lightning passes ``weights_only`` to ``Strategy.load_checkpoint`` itself: remove the
    workaround (``requested_weights_only``)."""
    assert "_restore_modules_and_callbacks(ckpt_path)" in inspect.getsource(Trainer._run)


def test_no_trainer_call_means_torchs_default() -> None:
    def _run(weights_only: bool = False) -> object:  # same name and local, not Trainer._run's code
        return requested_weights_only()

    assert _run() is None
