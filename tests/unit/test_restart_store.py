"""reliability.restart: the process group of a torchrun restart attempt, on its own store prefix."""

from __future__ import annotations

import socket
from datetime import timedelta

import pytest

from lightning_tpp.reliability.restart import init_processes


class _Env:
    main_address = "127.0.0.1"

    def __init__(self, port: int) -> None:
        self.main_port = port

    def global_rank(self) -> int:
        return 1

    def world_size(self) -> int:
        return 2


def test_a_store_that_never_answers_is_an_error_naming_what_it_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    with pytest.raises(RuntimeError, match=rf"rank 1 of 2 could not form the process group of torchrun's restart "
                                           rf"attempt 1 within 0:00:01 \(store at 127.0.0.1:{port}, backend gloo\)"):
        init_processes(_Env(port), "gloo", timedelta(seconds=1))
