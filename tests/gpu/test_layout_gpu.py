"""layout='auto' on one GPU (NCCL, one process): the link is measured on the GPU (NCCL refuses CPU tensors: the
first run on an H200 failed there), the blocks are timed on it, and the chosen layout trains. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_layout_auto_one_gpu_trains_and_records_the_choice() -> None:
    import lightning as L

    from lightning_tpp import TensorPipeStrategy
    from models import LitLM, token_dataset

    module = LitLM("llama")
    module.example_input_array = torch.zeros(4, 16, dtype=torch.long)
    strategy = TensorPipeStrategy(layout="auto", print_plan=False)
    trainer = L.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-true", max_steps=2,
                        logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(module, torch.utils.data.DataLoader(token_dataset(16), batch_size=4))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    chosen = trainer.strategy.parallel_state.layout
    assert (chosen.tp, chosen.pp, chosen.dp) == (1, 1, 1) and trainer.global_step == 2
    assert strategy.layout_ranking is not None and strategy.layout_ranking.best.time.total > 0


def test_measure_link_on_the_gpu_under_nccl(monkeypatch) -> None:
    """``measure_link`` puts its tensors where the backend takes them and waits for the GPU before reading the
    clock."""
    import socket

    import torch.distributed as dist

    from lightning_tpp.layout import measure_link
    from lightning_tpp.layout.links import backend_device

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(port))
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        assert backend_device().type == "cuda"
        link = measure_link()
        assert link.bandwidth > 0 and link.latency > 0
    finally:
        dist.destroy_process_group()
