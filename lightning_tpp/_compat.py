"""Private Lightning and torch names that lightning_tpp relies on, each wrapped once here; ``tests/unit/test_compat.py``
fails loudly when an upgrade moves one of them."""

from __future__ import annotations

import sys
from typing import Optional

from lightning.pytorch import Trainer


def requested_weights_only(depth: int = 40) -> Optional[bool]:
    """The ``weights_only=`` the user passed to ``trainer.fit/validate/test/predict``.

    Lightning 2.6 drops it on the way to ``Strategy.load_checkpoint`` for strategies that restore after setup
    (``Trainer._run`` calls ``_restore_modules_and_callbacks(ckpt_path)`` without it), so it is read from the running
    ``Trainer._run`` frame. None when not found (torch's default, ``True``, then applies)."""
    frame = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code is Trainer._run.__code__:
            value = frame.f_locals.get("weights_only")
            return value if isinstance(value, bool) else None
        frame = frame.f_back
    return None
