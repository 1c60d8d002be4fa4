"""Every micro-batch DPTrainer trains on under DP comes from its own Poisson loader, once.

The accountant assumes each example (or unit) joins each step by its own draw at rate q and that no draw is trained on
twice. A subclass owns ``get_train_dataloader``: on main at e4f5b9a, one that built its own loader (shuffled
fixed-size batches, or DPTrainer's own dataset and collator under another sampler) or replayed the loader's batches
trained silently with the reported ε — and under ``--privacy_unit_column`` its batches carried no unit map, so each
row was clipped alone. Each test below reproduces one of those loaders; each is now refused in one sentence at the
first step, and loaders that build on ``super().get_train_dataloader()`` still train.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from hf_dp import DPTrainer
from hf_dp.run.data import DRAWN_KEY

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer, snapshot  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def data(tok):
    return make_pair_dataset(tok, n=64)


def _trainer(tmp_path, tok, data, cls=DPTrainer, **over):
    kw = dict(noise_multiplier=1.0, epsilon=None, max_steps=3, trainable="all", per_device_train_batch_size=8)
    kw.update(over)
    return cls(model=make_model(), args=dp_args(tmp_path, **kw), train_dataset=data, data_collator=make_collator(tok))


class OwnShuffledLoader(DPTrainer):
    """The override a user writes for "my own loader": shuffled fixed-size batches, HF's collator."""

    def get_train_dataloader(self):
        return DataLoader(self.train_dataset, batch_size=8, shuffle=True,
                          collate_fn=self.data_collator)


class OwnSamplerOverDPCollator(DPTrainer):
    """DPTrainer's own dataset and collator (so its batches carry the loader's tag) under a sampler of one's own."""

    def get_train_dataloader(self):
        base = super().get_train_dataloader()
        return DataLoader(base.dataset, batch_sampler=BatchSampler(RandomSampler(base.dataset), 8, drop_last=False),
                          collate_fn=base.collate_fn)


class _Replay:
    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        for batch in self.loader:
            again = dict(batch)  # kept before the step consumes the batch (the step pops its tag)
            yield batch
            yield again  # the same draw a second time

    def set_epoch(self, epoch):
        self.loader.set_epoch(epoch)


class ReplayingLoader(DPTrainer):
    def get_train_dataloader(self):
        return _Replay(super().get_train_dataloader())


class _Passthrough(_Replay):
    """An honest wrapper: every batch of the Poisson loader once, with a key of its own added and removed again."""

    def __iter__(self):
        for batch in self.loader:
            batch["extra_note"] = torch.zeros(1)
            batch.pop("extra_note")
            yield batch


class WrappingLoader(DPTrainer):
    def get_train_dataloader(self):
        return _Passthrough(super().get_train_dataloader())


@pytest.mark.parametrize("cls", [OwnShuffledLoader, OwnSamplerOverDPCollator, ReplayingLoader],
                         ids=["own-loader", "own-sampler", "replay"])
def test_a_loader_that_is_not_the_poisson_draw_is_refused_before_an_update(tmp_path, tok, data, cls):
    tr = _trainer(tmp_path, tok, data, cls=cls)
    before = snapshot(tr.model)
    with pytest.raises(RuntimeError) as e:
        tr.train()
    msg = str(e.value)
    assert "\n" not in msg and "super().get_train_dataloader()" in msg, msg
    expected = {OwnShuffledLoader: "did not come from DPTrainer's training loader",
                OwnSamplerOverDPCollator: "not drawn by its Poisson sampler", ReplayingLoader: "trained on before"}
    assert expected[cls] in msg, msg
    # refused at the first step that would have used it, before the noisy update of that step
    assert tr.state.global_step <= (1 if cls is ReplayingLoader else 0)
    if cls is not ReplayingLoader:
        assert all(torch.equal(before[k], v) for k, v in snapshot(tr.model).items())


def test_own_loader_under_a_unit_column_is_refused(tmp_path, tok, data):
    """Under units the own loader's batches have no unit map: each row would be clipped alone (C per row, not per
    unit) — refused like any loader of one's own."""
    users = data.add_column("user", [i % 16 for i in range(len(data))])
    tr = _trainer(tmp_path, tok, users, cls=OwnShuffledLoader, privacy_unit_column="user", remove_unused_columns=False)
    with pytest.raises(RuntimeError, match="did not come from DPTrainer's training loader"):
        tr.train()


def test_a_wrapper_that_passes_each_batch_once_trains(tmp_path, tok, data):
    tr = _trainer(tmp_path, tok, data, cls=WrappingLoader)
    before = snapshot(tr.model)
    tr.train()
    assert tr.state.global_step == 3
    assert any(not torch.equal(before[k], v) for k, v in snapshot(tr.model).items())


def test_the_tag_is_this_trainers_own(tmp_path, tok, data):
    """A batch collated by another DPTrainer's loader (another token) is refused; a batch of this trainer's loader
    trains once and is refused the second time (its draw count does not increase)."""
    a = _trainer(tmp_path / "a", tok, data)
    b = _trainer(tmp_path / "b", tok, data)
    assert a.dp.contract.loader_token != b.dp.contract.loader_token  # random per trainer (62 bits)
    a.create_optimizer_and_scheduler(num_training_steps=3)
    batch = next(iter(b.get_train_dataloader()))
    assert DRAWN_KEY in batch
    a.model.train()
    with pytest.raises(RuntimeError, match="did not come from DPTrainer's training loader"):
        a.training_step(a.model, dict(batch))
    own = next(iter(a.get_train_dataloader()))
    a.training_step(a.model, dict(own))
    with pytest.raises(RuntimeError, match="trained on before"):
        a.training_step(a.model, dict(own))


def test_the_collator_refuses_a_batch_that_sets_the_tag_itself(tmp_path, tok, data):
    collate = make_collator(tok)

    def forging(features):
        out = collate(features)
        out[DRAWN_KEY] = (0, 10**9)
        return out

    tr = DPTrainer(model=make_model(), args=dp_args(tmp_path, noise_multiplier=1.0, epsilon=None, max_steps=1,
                                                    trainable="all", per_device_train_batch_size=8),
                   train_dataset=data, data_collator=forging)
    with pytest.raises(ValueError, match="which DPTrainer sets itself"):
        tr.train()
