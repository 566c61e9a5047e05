"""Where the forward reads each parameter (``data_parallel.reads.find_reads``, one forward of a meta copy) and the
FSDP2 units and vocabulary matrices chosen from it (``data_parallel.fsdp.fsdp_units``, ``called_where_read``): a parent
reading its child's weight functionally makes the unit a module enclosing the read (issue #44 item 3)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from lightning_tpp.data_parallel.fsdp import called_where_read, fsdp_units
from lightning_tpp.data_parallel.reads import find_reads, probe_input
from lightning_tpp.data_parallel.rows import candidates


class Mixer(nn.Module):
    """Reads ``conv1d``'s weight with ``F.conv1d`` and ``proj``'s with ``F.linear``; calls neither."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1d = nn.Conv1d(4, 4, 3, groups=4, padding=2)
        self.proj = nn.Linear(4, 4)
        self.scale = nn.LayerNorm(4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.conv1d(x.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=2, groups=4)
        h = h[..., :x.shape[1]].transpose(1, 2).to(self.scale.weight.dtype)  # .dtype: no read of the values
        return self.scale(F.linear(h, self.proj.weight, self.proj.bias))


class LM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.mixer = Mixer()
        self.layers = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))
        self.head = nn.Linear(4, 10, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.mixer(self.embed(idx))
        for layer in self.layers:
            x = layer(x)
        return F.linear(x, self.head.weight)


class Root(nn.Module):
    """The model held as ``model`` (as a LightningModule holds it), optionally with an example input."""

    def __init__(self, example: torch.Tensor | None = None) -> None:
        super().__init__()
        self.model = LM()
        self.example_input_array = example

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.model(idx)


BLOCKS = ["model.layers.0", "model.layers.1"]


def _readers(root: nn.Module) -> dict[str, list[str]]:
    reads = find_reads(root)
    assert reads.complete, reads
    return {n: sorted(reads.readers.get(id(p), ())) for n, p in root.named_parameters()}


def test_a_parent_reading_its_childs_weight_is_found_by_the_forward() -> None:
    readers = _readers(Root())
    assert readers["model.mixer.conv1d.weight"] == readers["model.mixer.conv1d.bias"] == ["model.mixer"]
    assert readers["model.mixer.proj.weight"] == ["model.mixer"]
    assert readers["model.mixer.scale.weight"] == ["model.mixer.scale"]  # its .dtype read by the mixer: metadata
    assert readers["model.head.weight"] == ["model"]
    assert readers["model.layers.0.weight"] == ["model.layers.0"]


def test_units_enclose_every_read_of_their_parameters() -> None:
    root = Root()
    before, _ = fsdp_units(root, BLOCKS)
    assert "model.mixer.conv1d" in before and "model.head" in before  # by module boundaries: read sharded
    units, replicated = fsdp_units(root, BLOCKS, reads=find_reads(root).readers)
    assert units == ["model.layers.0", "model.layers.1", "model.mixer.scale", "model.embed", "model.mixer", "model"]
    assert replicated == []


def test_a_block_whose_weight_is_read_outside_it_gives_way_to_the_enclosing_unit() -> None:
    """FSDP2 gives a parameter to the innermost unit holding it: a block cannot stay a unit when its weight is read
    by its parent, the parameters it held go to the unit enclosing the read."""
    root = Root()
    reads = {id(root.model.layers[1].weight): ["model"]}
    units, _ = fsdp_units(root, BLOCKS, reads=reads)
    assert "model.layers.1" not in units and "model.layers.0" in units and units[-1] == "model"


def test_a_read_by_the_root_forward_leaves_the_parameter_replicated() -> None:
    root = Root()
    units, replicated = fsdp_units(root, BLOCKS, reads={id(root.model.mixer.proj.weight): [""]})
    assert replicated == ["model.mixer.proj.weight"] and "model.mixer.proj" in units  # its bias still sharded


def test_a_vocabulary_matrix_read_outside_its_module_is_left_to_fsdp() -> None:
    root = Root()
    names = candidates(root, BLOCKS)
    assert "model.head" in names
    kept = called_where_read(root, names, find_reads(root).readers)
    assert "model.head" not in kept and "model.embed" in kept  # the embedding is only read by its own forward


def test_the_input_of_the_probe() -> None:
    example = torch.zeros(2, 3, dtype=torch.long)
    root, args, kwargs, source = probe_input(Root(example))  # type: ignore[misc]
    assert (root, source, kwargs) == ("", "example_input_array", {}) and args[0] is example
    root, args, _, source = probe_input(Root())  # type: ignore[misc]
    assert root == "model" and source == "token ids (1, 8)" and args[0].shape == (1, 8)

    class Dict(nn.Module):  # the smallest module holding every parameter has no forward: its caller is run
        def __init__(self) -> None:
            super().__init__()
            self.t = nn.ModuleDict(dict(wte=nn.Embedding(10, 4), head=nn.Linear(4, 10)))

        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            return self.t["head"](self.t["wte"](idx))

    assert probe_input(Dict())[0] == ""  # type: ignore[index]
    assert probe_input(nn.Sequential(nn.Linear(2, 2), nn.ReLU())) is None  # no example, no token ids to give


def test_the_probe_leaves_the_model_and_the_random_generators_alone() -> None:
    torch.manual_seed(0)
    root = Root(torch.zeros(2, 3, dtype=torch.long))
    before = {n: p.detach().clone() for n, p in root.named_parameters()}
    state = torch.get_rng_state()
    find_reads(root)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(p, before[n]) and not p.is_meta for n, p in root.named_parameters())
    assert not any(m._forward_hooks or m._forward_pre_hooks for m in root.modules())


def test_a_forward_that_fails_on_meta_keeps_what_it_read() -> None:
    class Opaque(LM):
        def forward(self, idx: torch.Tensor) -> torch.Tensor:
            x = self.embed(idx)
            if bool(x.sum() > 0):  # a value: no meta tensor has one
                return x
            return super().forward(idx)

    model = Opaque()
    reads = find_reads(model)
    assert not reads.complete and reads.source == "token ids (1, 8)"
    assert set(reads.readers) == {id(model.embed.weight)}
