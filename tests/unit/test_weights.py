"""Weights from files (checkpoint.weights), in one process: Hugging Face safetensors (one file, sharded), Lightning
.ckpt and sharded checkpoints; tensor-parallel slices emulated with a hand-built ShardIndex; one error for every
mismatch."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file
from torch import nn

from lightning_tpp import TensorPipeStrategy, WeightsMismatchError
from lightning_tpp.checkpoint.dcp import META
from lightning_tpp.checkpoint.weights import boxes, choose_prefix, load_weights
from lightning_tpp.core.params import ParamNames, ShardIndex, ShardInfo
from lightning_tpp.core.sharding import ShardSpec, shard_tensor


def _llama(seed: int):
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
                                   tie_word_embeddings=True)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


class HFHolder(L.LightningModule):
    """The usual way to fine-tune: the Hugging Face model as ``self.model`` (names gain the prefix ``model.``)."""

    def __init__(self, seed: int = 1) -> None:
        super().__init__()
        self.model = _llama(seed)


@pytest.fixture(scope="module")
def hf(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("hf")
    model = _llama(0)
    model.save_pretrained(root / "one")
    model.save_pretrained(root / "sharded", max_shard_size="20KB")
    return {"one": root / "one", "sharded": root / "sharded"}


def _load(module: nn.Module, source: Path, shards: ShardIndex | None = None, rank: int = 0, world: int = 1,
          names: ParamNames | None = None, **kwargs):
    return load_weights(module, source, names=names or ParamNames.of(module), shards=shards or ShardIndex(),
                        tp_rank=rank, tp_size=world, **kwargs)


@pytest.mark.parametrize("form", ["file", "folder", "sharded-folder", "index"])
def test_hf_safetensors_equal_from_pretrained(hf: dict[str, Path], form: str) -> None:
    import transformers

    source = {"file": hf["one"] / "model.safetensors", "folder": hf["one"], "sharded-folder": hf["sharded"],
              "index": hf["sharded"] / "model.safetensors.index.json"}[form]
    assert form != "sharded-folder" or len(list(hf["sharded"].glob("*.safetensors"))) > 2
    reference = transformers.LlamaForCausalLM.from_pretrained(hf["one"])
    module = HFHolder(seed=1)
    report = _load(module, source)
    assert report.prefix == "model."  # chosen automatically: the file lacks the LightningModule's attribute
    got = module.model.state_dict()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(got[name], value, rtol=0, atol=0, msg=name)
    assert module.model.lm_head.weight is module.model.model.embed_tokens.weight  # tied: the file holds one alias


def test_a_stage_reads_only_the_files_holding_its_tensors(hf: dict[str, Path]) -> None:
    """A pipeline stage without layer 1 (a stand-in in its place): layer 1's files are not read."""
    module = HFHolder()
    names = ParamNames.of(module)  # the whole model's, recorded before the stage dropped its modules
    module.model.model.layers[1] = nn.Identity()
    report = _load(module, hf["sharded"], names=names)
    weight_map = json.loads((hf["sharded"] / "model.safetensors.index.json").read_text())["weight_map"]
    own = {str(hf["sharded"] / f) for k, f in weight_map.items() if not k.startswith("model.layers.1.")}
    assert set(report.files) == own and len(own) < len(set(weight_map.values()))


def test_every_stage_raises_for_a_key_another_stage_misses(hf: dict[str, Path], tmp_path: Path) -> None:
    """The decision is the whole model's: a stage without layer 1 raises for layer 1's missing key as the stage
    holding it does, so no rank goes on to wait in a collective for a rank that raised."""
    from safetensors.torch import load_file

    state = load_file(hf["one"] / "model.safetensors")
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, tmp_path / "model.safetensors")
    for drop in (0, 1):
        module = HFHolder()
        names = ParamNames.of(module)
        module.model.model.layers[drop] = nn.Identity()
        with pytest.raises(WeightsMismatchError, match=r"missing \(1\): \['model.model.layers.1.mlp.down_proj.weight'\]"
                           r"\. Model"):
            _load(module, tmp_path / "model.safetensors", names=names)


class Fused(nn.Module):
    """A fused [q | k | v] projection (GQA: 32 | 16 | 16 rows), a row-parallel output, a vocab-parallel embedding and
    a replicated norm."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(64, 32)
        self.qkv = nn.Linear(32, 64)
        self.out = nn.Linear(32, 32)
        self.norm = nn.LayerNorm(32)


SPECS = {"emb.weight": ShardSpec(0), "qkv.weight": ShardSpec(0, (32, 16, 16)), "qkv.bias": ShardSpec(0, (32, 16, 16)),
         "out.weight": ShardSpec(1)}


def _tp_shard(module: nn.Module, rank: int, world: int) -> ShardIndex:
    """What tensor parallelism leaves on ``rank``: each cut parameter a plain tensor of its slice's shape (garbage)."""
    shards = ShardIndex()
    for name, p in module.named_parameters():
        spec = SPECS.get(name)
        if spec is not None:
            full_shape = tuple(p.shape)
            p.data = torch.full_like(shard_tensor(p.data, spec, rank, world), float("nan"))
            shards.add(p, ShardInfo(spec, full_shape))
    return shards


def _write(kind: str, state: dict[str, torch.Tensor], path: Path) -> Path:
    if kind == "safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, path / "w.safetensors")
        return path / "w.safetensors"
    if kind == "ckpt":
        torch.save({"state_dict": state, "epoch": 0, "global_step": 1}, path / "w.ckpt")
        return path / "w.ckpt"
    dcp.save({f"model.{k}": v for k, v in state.items()}, checkpoint_id=path / "run.ckpt", no_dist=True)
    torch.save({"tpp": {}}, path / "run.ckpt" / META)
    return path / "run.ckpt"


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
@pytest.mark.parametrize("kind", ["safetensors", "ckpt", "sharded-checkpoint"])
@pytest.mark.parametrize("rank", [0, 1])
def test_tp_slices_equal_shard_tensor(tmp_path: Path, kind: str, rank: int) -> None:
    """Each rank's slice, read box by box (one box per fused segment), equals shard_tensor of the whole tensor; the
    file's bf16 values are cast to the parameters' fp32."""
    torch.manual_seed(0)
    full = {k: v.to(torch.bfloat16) for k, v in Fused().state_dict().items()}
    source = _write(kind, full, tmp_path)
    module = Fused()
    names = ParamNames.of(module)
    shards = _tp_shard(module, rank, 2)
    report = _load(module, source, shards, rank, 2, names=names)
    assert report.prefix == "" and report.loaded == len(full)
    for name, p in module.state_dict().items():
        spec = SPECS.get(name)
        want = full[name].float() if spec is None else shard_tensor(full[name].float(), spec, rank, 2)
        assert p.dtype == torch.float32
        torch.testing.assert_close(p, want, rtol=0, atol=0, msg=name)


def test_boxes_cover_exactly_the_shard() -> None:
    full = torch.arange(64 * 8).reshape(64, 8)
    for spec, world in ((ShardSpec(0), 4), (ShardSpec(0, (32, 16, 16)), 4), (ShardSpec(1), 2),
                        (ShardSpec(1, (4, 4)), 2)):
        for rank in range(world):
            dest = torch.empty_like(shard_tensor(full, spec, rank, world))
            for offsets, sizes, view in boxes(dest, spec, full.shape, rank, world):
                view.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
            assert torch.equal(dest, shard_tensor(full, spec, rank, world)), (spec, rank)



@pytest.mark.parametrize("dim", [0, 1], ids=["same-dim", "next-dim"])
def test_boxes_cover_exactly_a_window_of_the_shard(dim: int) -> None:
    """A rank's shard cut again, as FSDP2 cuts an expert bank over its replicas (``torch.chunk`` along ``dim``, the
    last part short or empty): the boxes fill exactly that window, and read nothing outside it."""
    full = torch.arange(12 * 6 * 2).reshape(12, 6, 2)
    for spec, world in ((None, 1), (ShardSpec(0), 2), (ShardSpec(0, (8, 4)), 2), (ShardSpec(0), 4)):
        for rank in range(world):
            shard = full if spec is None else shard_tensor(full, spec, rank, world)
            for replicas in (2, 4, 5):
                chunks = torch.chunk(shard, replicas, dim=dim)
                start = 0
                for part in chunks:
                    dest = torch.full_like(part, -1)
                    found = boxes(dest, spec, full.shape, rank, world, window=(dim, start))
                    for offsets, sizes, view in found:
                        view.copy_(full[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))])
                    assert torch.equal(dest, part), (spec, rank, replicas, start)
                    assert sum(v.numel() for *_, v in found) == part.numel()
                    start += part.shape[dim]

@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_lightning_ckpt_and_sharded_checkpoint(tmp_path: Path) -> None:
    """A .ckpt written by the Trainer (weights_only-loadable, memory-mapped), and a sharded checkpoint folder."""

    class Lit(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = Fused()

        def training_step(self, batch, batch_idx):
            return self.net.out(self.net.emb(batch[0]).mean(1)).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trained = Lit()
    data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randint(0, 64, (4, 5))), batch_size=2)
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(trained, data)
    trainer.save_checkpoint(tmp_path / "whole.ckpt")
    folder = _write("sharded-checkpoint", trained.state_dict(), tmp_path)
    for source in (tmp_path / "whole.ckpt", folder):
        fresh = Lit()
        assert _load(fresh, source).prefix == ""
        for name, value in trained.state_dict().items():
            torch.testing.assert_close(fresh.state_dict()[name], value, rtol=0, atol=0, msg=f"{source}: {name}")


def test_one_error_lists_missing_unexpected_and_misshaped(tmp_path: Path) -> None:
    state = {k: v.clone() for k, v in Fused().state_dict().items()}
    del state["norm.bias"]
    state["extra.weight"] = torch.zeros(2)
    state["out.weight"] = torch.zeros(32, 16)
    save_file(state, tmp_path / "bad.safetensors")
    module = Fused()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    with pytest.raises(WeightsMismatchError, match=r"under prefix '' \(chosen automatically: 6 of the file's 7 keys"
                       r".*missing \(1\): \['norm.bias'\]; unexpected \(1\): \['extra.weight'\]; mis-shaped \(1\): "
                       r"\['out.weight: file \(32, 16\) vs model \(32, 32\)'\].*Fix: build the model with the "
                       r"configuration.*weights_prefix=.*strict_loading = False"):
        _load(module, tmp_path / "bad.safetensors")
    assert all(torch.equal(v, before[k]) for k, v in module.state_dict().items())  # nothing half-loaded
    with pytest.raises(WeightsMismatchError, match=r"mis-shaped \(1\)") as err:
        _load(module, tmp_path / "bad.safetensors", strict=False)
    assert "missing (" not in str(err.value)
    del state["out.weight"]
    save_file(state, tmp_path / "partial.safetensors")
    assert _load(module, tmp_path / "partial.safetensors", strict=False).loaded == 5  # what matches; the rest kept
    assert torch.equal(module.norm.bias, before["norm.bias"])


def test_prefixes(tmp_path: Path) -> None:
    assert choose_prefix(["layers.0.w", "norm.w"], ["model.model.layers.0.w", "model.model.norm.w", "head.w"]) \
        == ("model.model.", 2)
    assert choose_prefix(["w"], ["w", "a.w"]) == ("", 1)  # the shortest among equals
    save_file({k: v.contiguous() for k, v in Fused().state_dict().items()}, tmp_path / "w.safetensors")
    holder = nn.Module()
    holder.net = Fused()
    assert _load(holder, tmp_path / "w.safetensors").prefix == "net."
    assert _load(holder, tmp_path / "w.safetensors", prefix="net").prefix == "net."
    with pytest.raises(WeightsMismatchError, match=r"under prefix 'body.' \(given\): missing \(7\)"):
        _load(holder, tmp_path / "w.safetensors", prefix="body.")
    save_file({"something.else": torch.zeros(1)}, tmp_path / "other.safetensors")
    with pytest.raises(WeightsMismatchError, match=r"no module prefix makes any of the file's 1 keys a model name "
                                                   r"\(file keys like \['something.else'\].*pass weights_prefix="):
        _load(holder, tmp_path / "other.safetensors")


def test_weights_are_part_of_the_strategy_configuration() -> None:
    """A second Trainer whose strategy names other weights is refused (ParallelState.check_same compares these)."""
    a = TensorPipeStrategy()._config()
    b = TensorPipeStrategy(weights="w.safetensors", weights_prefix="model.")._config()
    assert {k for k in a if a[k] != b[k]} == {"weights", "weights_prefix"}


def test_safetensors_without_the_package_says_what_to_install(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    import sys

    from lightning_tpp.checkpoint.weights import SafetensorsSource

    save_file({"w": torch.ones(2)}, str(tmp_path / "model.safetensors"))
    source = SafetensorsSource.file(tmp_path / "model.safetensors")  # headers read without the package
    monkeypatch.setitem(sys.modules, "safetensors", None)
    with pytest.raises(ModuleNotFoundError, match="reading safetensors weights needs safetensors, which is not "
                                                  "installed: pip install safetensors"):
        source.read({"w": [((), (), torch.empty(2))]})
