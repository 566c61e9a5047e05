"""The global gradient norm lives on the parameters' device, also where no gradient is left (a step dropped on every
rank): under NCCL its all-reduce takes no CPU tensor. The meta device stands in for a GPU here."""

from __future__ import annotations

import torch
from torch import nn

from lightning_tpp.core.grads import global_grad_norm


def test_norm_without_gradients_is_on_the_parameters_device() -> None:
    layer = nn.Linear(4, 4, device="meta")
    norm = global_grad_norm(layer.parameters(), sharded=set(), tp_rank=0, groups=[])
    assert norm.device.type == "meta" and norm.shape == ()


def test_norm_with_gradients_is_the_norm() -> None:
    layer = nn.Linear(4, 4)
    layer(torch.ones(2, 4)).sum().backward()
    expected = torch.cat([p.grad.flatten() for p in layer.parameters()]).norm()
    norm = global_grad_norm(layer.parameters(), sharded=set(), tp_rank=0, groups=[])
    torch.testing.assert_close(norm, expected)
