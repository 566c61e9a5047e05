"""``layout="auto"`` without ``example_input_array`` (issue #44 item 6): the batch shape the blocks are timed on is
read from the first batch of the run's data (a loader given to the Trainer, or the module's or datamodule's
``*_dataloader`` hook), without taking a batch from training or moving the random streams; ``example_input_array``
stays the override; what cannot be read is an ``AutoLayoutError`` that says what was found and the fixes."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator

import lightning as L
import pytest
import torch
from lightning.pytorch.trainer.connectors.data_connector import _DataLoaderSource
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_tpp import TensorPipeStrategy
from lightning_tpp.layout.strategy import AutoLayoutError, batch_shape, shared_batch_shape
from models import SEQ, VOCAB, LitLM, token_dataset


def _given(data: Any) -> _DataLoaderSource:
    """What the Trainer holds for data given to ``trainer.fit``."""
    return _DataLoaderSource(data, "train_dataloader")


def _ids(batch: int = 4, seq: int = 12) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq))


class _Batches(torch.utils.data.Dataset):
    """Each item is a whole batch (``batch_size=None``): the batch is what the tests hand it."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> Any:
        return self.batch


def _loader_of(batch: Any) -> DataLoader:
    return DataLoader(_Batches(batch), batch_size=None)


@dataclass
class _Features:
    mask: torch.Tensor
    tokens: torch.Tensor


@pytest.mark.parametrize("batch, shape", [
    (_ids(), (4, 12)),  # the batch is the token ids
    ((_ids(3, 10), _ids(3, 10)), (3, 10)),  # (x, y): x
    ([torch.randn(2, 5), _ids(2, 7)], (2, 7)),  # the first 2-D integer tensor, past a float one
    ({"labels": _ids(4, 9), "input_ids": _ids(4, 8), "attention_mask": _ids(4, 8)}, (4, 8)),  # input_ids preferred
    ({"pixel_values": torch.randn(2, 3), "tokens": _ids(2, 6)}, (2, 6)),  # no input_ids: the first integer 2-D
    ({"x": {"input_ids": _ids(5, 3)}, "y": torch.zeros(5)}, (5, 3)),  # nested
    (_Features(mask=torch.ones(2, 4, dtype=torch.bool), tokens=_ids(2, 4)), (2, 4)),  # a dataclass, a bool mask passed
])
def test_the_token_ids_are_found_in_the_first_batch(batch: Any, shape: tuple[int, int]) -> None:
    assert batch_shape(torch.nn.Module(), _given(_loader_of(batch))) == shape


def test_a_hugging_face_collators_batch_gives_its_input_ids() -> None:
    from transformers import BatchEncoding

    batch = BatchEncoding({"attention_mask": _ids(4, 16), "input_ids": _ids(4, 11), "labels": _ids(4, 11)})
    assert batch_shape(torch.nn.Module(), _given(_loader_of(batch))) == (4, 11)


def test_a_plain_dataloader_gives_its_per_process_batch_and_collections_of_loaders_too() -> None:
    loader = DataLoader(token_dataset(16), batch_size=4)
    assert batch_shape(torch.nn.Module(), _given(loader)) == (4, SEQ)
    floats = DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=2)
    assert batch_shape(torch.nn.Module(), _given({"a": floats, "b": loader})) == (4, SEQ)  # the first that has ids


def test_example_input_array_is_the_override() -> None:
    module = torch.nn.Module()
    module.example_input_array = torch.zeros(2, 5, dtype=torch.long)
    assert batch_shape(module, _given(DataLoader(token_dataset(16), batch_size=4))) == (2, 5)
    module.example_input_array = torch.zeros(2, 5)  # a wrong override is an error, not a fallback to the data
    with pytest.raises(AutoLayoutError, match=r"example_input_array, which must be one per-process batch of token "
                                              r"ids \(batch, tokens\); got \(2, 5\)"):
        batch_shape(module, _given(DataLoader(token_dataset(16), batch_size=4)))


def test_no_example_and_no_data_says_both() -> None:
    with pytest.raises(AutoLayoutError, match=r"example_input_array.*\(unset\) and the run has no data to read a first "
                                              r"batch from; got NoneType.*torch.zeros\(batch_size"):
        batch_shape(torch.nn.Module(), None)


def test_a_batch_without_token_ids_says_what_it_found() -> None:
    batch = {"pixel_values": torch.randn(2, 3, 8, 8), "labels": torch.arange(2)}
    with pytest.raises(AutoLayoutError, match=r"found none in the first batch of the DataLoader given to trainer.fit"
                                              r"\(\): \{'pixel_values': float32 tensor \(2, 3, 8, 8\), 'labels': "
                                              r"int64 tensor \(2,\)\}\. .*torch.zeros\(batch_size, seq_len"):
        batch_shape(torch.nn.Module(), _given(_loader_of(batch)))


def test_a_one_shot_iterator_is_not_read() -> None:
    batches = iter([_ids(), _ids()])
    with pytest.raises(AutoLayoutError, match=r"first batch of the list_iterator given to trainer.fit\(\), an iterator "
                                              r"\(list_iterator\) that is read once.*Give a DataLoader"):
        batch_shape(torch.nn.Module(), _given(batches))
    assert len(list(batches)) == 2  # training still gets every batch


def test_an_empty_loader_is_named() -> None:
    with pytest.raises(AutoLayoutError, match=r"the DataLoader given to trainer.fit\(\), which is empty"):
        batch_shape(torch.nn.Module(), _given(DataLoader(token_dataset(0), batch_size=4)))


class _Broken(IterableDataset):
    def __iter__(self) -> Iterator[torch.Tensor]:
        raise OSError("shard 0 missing")


def test_a_loader_that_fails_to_read_is_named() -> None:
    with pytest.raises(AutoLayoutError, match=r"reading it raised OSError: shard 0 missing\. Either set "
                                              r"self.example_input_array.*or give data that reads"):
        batch_shape(torch.nn.Module(), _given(DataLoader(_Broken(), batch_size=None)))


def test_reading_the_first_batch_takes_nothing_from_training_and_moves_no_random_stream() -> None:
    """A shuffling sampler draws its seed from torch's global generator: put back, the epoch's order (and anything
    drawn after, e.g. configure_model's weights) is what it would have been with example_input_array."""
    loader = DataLoader(token_dataset(16), batch_size=4, shuffle=True)
    torch.manual_seed(3)
    expected = [x for x, _ in loader]
    torch.manual_seed(3)
    assert batch_shape(torch.nn.Module(), _given(loader)) == (4, SEQ)
    got = [x for x, _ in loader]
    assert len(got) == 4 and all(torch.equal(a, b) for a, b in zip(got, expected))


def test_a_persistent_worker_pool_is_not_left_behind() -> None:
    loader = DataLoader(token_dataset(8), batch_size=4, num_workers=1, persistent_workers=True)
    assert batch_shape(torch.nn.Module(), _given(loader)) == (4, SEQ)
    assert loader._iterator is None  # its worker stopped; the Trainer's iter() starts its own pool
    assert len(list(loader)) == 2


def test_one_process_shares_its_own_shape() -> None:
    module = torch.nn.Module()
    module.example_input_array = torch.zeros(3, 7, dtype=torch.long)
    assert shared_batch_shape(module, None, rank=0, world=1) == (3, 7)
    with pytest.raises(AutoLayoutError, match="got NoneType"):  # the original error, not a wrapped one
        shared_batch_shape(torch.nn.Module(), None, rank=0, world=1)


# ---- through the Trainer: the data given to fit, a module's hook, a datamodule's -------------------------------------
def _fit(module: L.LightningModule, **data: Any) -> L.Trainer:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=TensorPipeStrategy(layout="auto", print_plan=False),
                        max_steps=1, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False)
    try:
        trainer.fit(module, **data)
    finally:  # the strategy's one-process group, which later tests would meet
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    return trainer


def test_fit_without_example_input_array_reads_the_loaders_first_batch() -> None:
    module = LitLM("llama")
    assert module.example_input_array is None
    trainer = _fit(module, train_dataloaders=DataLoader(token_dataset(16), batch_size=4, shuffle=True))
    assert trainer.global_step == 1 and trainer.strategy.layout_ranking is not None
    assert "(4 sequences per process;" in trainer.strategy.layout_ranking.table()


class _Data(L.LightningDataModule):
    """Builds its dataset in ``setup("fit")``, as the Lightning docs' datamodules do (``early``: in ``__init__``)."""

    def __init__(self, early: bool = False) -> None:
        super().__init__()
        self.calls = {"setup": 0, "train_dataloader": 0}
        if early:
            self.train_set = token_dataset(16)

    def setup(self, stage: str) -> None:
        self.calls["setup"] += 1
        if not hasattr(self, "train_set"):
            self.train_set = token_dataset(16)

    def train_dataloader(self) -> DataLoader:
        self.calls["train_dataloader"] += 1
        return DataLoader(self.train_set, batch_size=2)


def test_a_datamodule_whose_loader_needs_setup_gets_both_fixes() -> None:
    data = _Data()
    match = (r"from the first batch of _Data.train_dataloader\(\), before Lightning calls prepare_data\(\) and "
             r"setup\(\), and reading it raised AttributeError: '_Data' object has no attribute 'train_set'\. Either "
             r"set self.example_input_array = torch.zeros\(batch_size, seq_len, dtype=torch.long\) in the "
             r"LightningModule .*or let train_dataloader\(\) work before setup\(\) \(build its dataset in "
             r"_Data.__init__")
    with pytest.raises(AutoLayoutError, match=match):
        _fit(LitLM("llama"), datamodule=data)
    assert data.calls["setup"] == 0  # not called early: prepare_data() has not run either


def test_a_datamodule_that_reads_before_setup_and_the_override_both_train() -> None:
    data = _Data(early=True)
    trainer = _fit(LitLM("llama"), datamodule=data)
    assert "(2 sequences per process;" in trainer.strategy.layout_ranking.table()
    assert data.calls == {"setup": 1, "train_dataloader": 2}  # once here, once by Lightning
    module, data = LitLM("llama"), _Data()
    module.example_input_array = torch.zeros(4, SEQ, dtype=torch.long)
    trainer = _fit(module, datamodule=data)  # the override: no data hook called early
    assert "(4 sequences per process;" in trainer.strategy.layout_ranking.table()
    assert data.calls == {"setup": 1, "train_dataloader": 1}


def test_a_modules_own_train_dataloader_hook_is_read() -> None:
    class WithLoader(LitLM):
        def train_dataloader(self) -> DataLoader:
            return DataLoader(token_dataset(16), batch_size=8)

    trainer = _fit(WithLoader("llama"))
    assert "(8 sequences per process;" in trainer.strategy.layout_ranking.table()


def test_validate_alone_reads_its_own_loader() -> None:
    trainer = L.Trainer(accelerator="cpu", devices=1, strategy=TensorPipeStrategy(layout="auto", print_plan=False),
                        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    try:
        trainer.validate(LitLM("llama"), DataLoader(token_dataset(8), batch_size=2))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
    assert "(2 sequences per process;" in trainer.strategy.layout_ranking.table()
