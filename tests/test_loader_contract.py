"""Every micro-batch DPTrainer trains on under DP comes from its own Poisson loader, once.

The accountant assumes each example (or unit) joins each step by its own draw at rate q and that no draw is trained on
twice. A subclass owns ``get_train_dataloader``: on main at e4f5b9a, one that built its own loader (shuffled
fixed-size batches, or DPTrainer's own dataset and collator under another sampler) or replayed the loader's batches
trained silently with the reported ε — and under ``--privacy_unit_column`` its batches carried no unit map, so each
row was clipped alone. Each test below reproduces one of those loaders; each is now refused in one sentence at the
first step, and loaders that build on ``super().get_train_dataloader()`` still train.

A later review found that only the token was checked with loader workers, that the rows fed into DPTrainer's collator
were never compared with the draw, and that what reached ``training_step`` was not tied to the collated batch (copies
of rows, rows added, cut or merged, micro-batches skipped: one example then moved the clipped sum by 2C). The sampler
now yields ``DrawnIndices`` (draw, logical draw, position), the loader's dataset stamps each drawn row, the collator
checks the rows are exactly that draw, and ``training_step`` checks the rows and the order of each step's micro-batches
(``HOLES`` below: each reproduction, refused at the first step it affects).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.utils.data import BatchSampler, DataLoader, RandomSampler

from hf_dp import DPTrainer
from hf_dp.run.draws import DRAWN_KEY

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
                OwnSamplerOverDPCollator: "not one draw of its Poisson sampler", ReplayingLoader: "trained on before"}
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


# ---------------------------------------------------------------------------------------------------
# the rows of each micro-batch are exactly one Poisson draw, from the sampler to training_step
# (an adversarial review's holes: each was trained on silently before the draw stamps)
# ---------------------------------------------------------------------------------------------------
class _Over:
    """A loader wrapper: ``edit(batches)`` -> the batches it yields."""

    def __init__(self, loader, edit):
        self.loader, self.edit = loader, edit

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return self.edit(iter(self.loader))

    def set_epoch(self, epoch):
        self.loader.set_epoch(epoch)


def _loader_trainer(edit_loader):
    class T(DPTrainer):
        def get_train_dataloader(self):
            return edit_loader(self, super().get_train_dataloader())
    return T


def _collate_edit(edit):
    def make(trainer, loader):
        inner = loader.collate_fn
        loader.collate_fn = lambda features: inner(edit(trainer, loader, list(features)))
        return loader
    return _loader_trainer(make)


def _own_sampler(trainer, loader):  # DPTrainer's dataset and collator under shuffled batches, loader workers
    return DataLoader(loader.dataset, batch_size=8, shuffle=True, collate_fn=loader.collate_fn, num_workers=2)


class _Cached(_Over):
    """The first epoch's batches (copies) replayed every epoch."""

    def __init__(self, loader):
        super().__init__(loader, None)
        self.cache = None

    def __iter__(self):
        import copy

        if self.cache is None:
            self.cache = [copy.deepcopy(b) for b in self.loader]
        return iter([copy.deepcopy(b) for b in self.cache])


class CachingLoader(DPTrainer):
    def get_train_dataloader(self):
        if not hasattr(self, "_cached"):
            self._cached = _Cached(super().get_train_dataloader())
        return self._cached


class _FixedSize:
    """A batch-sampler wrapper: each Poisson draw padded with random indices or cut to exactly 8."""

    def __init__(self, inner, n, in_place=False):
        self.inner, self.n, self.in_place = inner, n, in_place

    def __len__(self):
        return len(self.inner)

    def set_epoch(self, epoch):
        self.inner.set_epoch(epoch)

    def __iter__(self):
        for idx in self.inner:
            extra = torch.randint(self.n, (max(0, 8 - len(idx)),)).tolist()
            if self.in_place:  # the sampler's own list, changed
                idx.extend(extra)
                del idx[8:]
                yield idx
            else:
                yield (list(idx) + extra)[:8]


def _fixed_size(in_place):
    def make(trainer, loader):
        return DataLoader(loader.dataset, batch_sampler=_FixedSize(loader.batch_sampler, len(loader.dataset), in_place),
                          collate_fn=loader.collate_fn)
    return _loader_trainer(make)


def _cat(a, b):
    out = {}
    for k in a:
        if torch.is_tensor(a[k]) and a[k].dim() == 2:
            w = max(a[k].shape[1], b[k].shape[1])
            out[k] = torch.cat([torch.nn.functional.pad(t, (0, w - t.shape[1])) for t in (a[k], b[k])])
        elif torch.is_tensor(a[k]):
            out[k] = torch.cat([a[k], b[k]])
        else:
            out[k] = a[k]
    return out


def _merge_pairs(batches):
    for a in batches:
        b = next(batches, None)
        yield a if b is None else _cat(a, b)


def _append_copies(batches):  # every row appended again after collation
    for b in batches:
        yield {k: torch.cat([v, v]) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in b.items()}


def _skip_second(batches):  # the second micro-batch (micro-batch 1 of the first draw) left out
    for i, b in enumerate(batches):
        if i != 1:
            yield b


class _Shorter(_Over):
    def __len__(self):
        return len(self.loader) - 1


def _drop_last(batches):  # the epoch's last micro-batch left out (and the length says so: HF steps on the rest)
    prev = next(batches, None)
    for b in batches:
        yield prev
        prev = b


def _tensors_only(batches):  # a pass-through that keeps the tensors only
    for b in batches:
        yield {k: v for k, v in b.items() if torch.is_tensor(v)}


class DoublingStep(DPTrainer):
    """A training_step override that trains on every row twice."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        inputs = {k: torch.cat([v, v]) if torch.is_tensor(v) and v.dim() > 0 else v for k, v in inputs.items()}
        return super().training_step(model, inputs, num_items_in_batch)


class MergingStep(DPTrainer):
    """A training_step override that adds the previous micro-batch's rows to each."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        prev, self._prev = getattr(self, "_prev", None), {k: v for k, v in inputs.items() if torch.is_tensor(v)}
        return super().training_step(model, inputs if prev is None else _cat(inputs, prev), num_items_in_batch)


HOLES = {
    # 1: a sampler of one's own, and replayed batches, with loader workers (only the token was checked)
    "own-sampler-workers": (_loader_trainer(_own_sampler), dict(dataloader_num_workers=2), "not one draw of its Poisson sampler"),
    "replay-cache-workers": (CachingLoader, dict(dataloader_num_workers=2, max_steps=-1, num_train_epochs=2), "trained on before"),
    # 2: rows fed into the DP collator that are not the draw
    "collate-copies": (_collate_edit(lambda t, l, f: f + [dict(x) for x in f]), {}, "not exactly one Poisson draw"),
    "collate-undrawn-rows": (_collate_edit(lambda t, l, f: f + [l.dataset[i] for i in range(4)]), {}, "not exactly one Poisson draw"),
    "collate-first-k": (_collate_edit(lambda t, l, f: f[:2]), {}, "not exactly one Poisson draw"),
    "collate-copies-workers": (_collate_edit(lambda t, l, f: f + f), dict(dataloader_num_workers=2), "not exactly one Poisson draw"),
    "batch-sampler-fixed-size": (_fixed_size(False), {}, "not one draw of its Poisson sampler"),
    "batch-sampler-in-place": (_fixed_size(True), {}, "changed after the sampler drew it"),
    # 3: what reaches training_step is not the collated batch, or not the step's draw
    "append-after-collation": (_loader_trainer(lambda t, l: _Over(l, _append_copies)), {}, "where DPTrainer's collator made"),
    "merge-micro-batches": (_loader_trainer(lambda t, l: _Over(l, _merge_pairs)), {}, "where DPTrainer's collator made"),
    "training-step-doubles": (DoublingStep, {}, "where DPTrainer's collator made"),
    "training-step-merges-previous": (MergingStep, {}, "where DPTrainer's collator made"),
    "skip-micro-batch-ga2": (_loader_trainer(lambda t, l: _Over(l, _skip_second)), dict(gradient_accumulation_steps=2),
                             "micro-batch 1 of logical draw 1"),
    "drop-last-micro-batch-ga2": (_loader_trainer(lambda t, l: _Shorter(l, _drop_last)),
                                  dict(gradient_accumulation_steps=2, max_steps=-1, num_train_epochs=1,
                                       per_device_train_batch_size=4), "after 1 of the 2 micro-batches"),
    # 4: a wrapper that drops the non-tensor keys
    "drops-non-tensor-keys": (_loader_trainer(lambda t, l: _Over(l, _tensors_only)), {}, "dropped DPTrainer's non-tensor keys"),
}


@pytest.mark.parametrize("name", list(HOLES))
def test_a_batch_that_is_not_exactly_its_draw_is_refused_at_its_first_step(tmp_path, tok, data, name):
    cls, over, expected = HOLES[name]
    tr = _trainer(tmp_path, tok, data, cls=cls, **over)
    before = snapshot(tr.model)
    with pytest.raises((RuntimeError, ValueError)) as e:
        tr.train()
    msg = str(e.value)
    # (a refusal in a loader worker reaches the trainer in torch's "Caught ValueError in DataLoader worker" wrapper)
    assert expected in msg and ("\n" not in msg or "DataLoader worker" in msg), msg
    if name == "replay-cache-workers":  # the first epoch is honest; the replay is refused at its first batch
        assert tr.dp.ledger.steps == tr.state.global_step == tr.dp.sampler.steps_per_epoch
        return
    if name == "drop-last-micro-batch-ga2":  # refused at the epoch's last step, the first it affects
        assert tr.state.global_step == tr.dp.ledger.steps == tr.dp.sampler.steps_per_epoch - 1
        return
    if name == "training-step-merges-previous":  # its first micro-batch has no previous one: the second is refused
        assert tr.state.global_step == tr.dp.ledger.steps == 1
        return
    assert tr.state.global_step == 0 and tr.dp.ledger.steps == 0
    assert all(torch.equal(before[k], v) for k, v in snapshot(tr.model).items())


def test_the_row_stamps_make_the_copied_example_count_once(tmp_path, tok, data):
    """Under units a collate wrapper that repeats rows is refused as well (the unit tags do not hide the copies)."""
    users = data.add_column("user", [i % 16 for i in range(len(data))])
    cls = _collate_edit(lambda t, l, f: f + [dict(x) for x in f])
    tr = _trainer(tmp_path, tok, users, cls=cls, privacy_unit_column="user", remove_unused_columns=False)
    with pytest.raises(ValueError, match="not exactly one Poisson draw"):
        tr.train()


@pytest.mark.parametrize("over", [dict(dataloader_num_workers=2), dict(gradient_accumulation_steps=2),
                                  dict(privacy_unit_column="user", remove_unused_columns=False, gradient_accumulation_steps=2),
                                  dict(gradient_accumulation_steps=2, max_steps=-1, num_train_epochs=2)],
                         ids=["workers", "ga2", "units-ga2", "ga2-two-epochs"])
def test_honest_runs_train(tmp_path, tok, data, over):
    ds = data.add_column("user", [i % 16 for i in range(len(data))]) if "privacy_unit_column" in over else data
    tr = _trainer(tmp_path, tok, ds, cls=WrappingLoader, per_device_train_batch_size=4, **over)
    tr.train()
    assert tr.state.global_step == tr.dp.ledger.steps == (3 if over.get("max_steps") != -1 else 2 * tr.dp.sampler.steps_per_epoch)
    # every draw trained on once, in order (loader workers draw ahead: the sampler may have yielded more)
    assert tr.dp.contract.last_draw == tr.state.global_step * tr.args.gradient_accumulation_steps


def test_a_resume_mid_epoch_and_a_second_train_keep_the_draw_order(tmp_path, tok, data):
    """HF's resume skips whole steps' worth of micro-batches (so the first trained is micro-batch 0 of a draw); a
    train() after a max_steps stop mid-epoch starts a new draw."""
    from helpers import StopAt

    kw = dict(max_steps=-1, num_train_epochs=2, save_strategy="steps", save_steps=3, gradient_accumulation_steps=2,
              per_device_train_batch_size=4)
    tr = _trainer(tmp_path, tok, data, **kw)
    tr.add_callback(StopAt(3))
    tr.train()
    assert tr.state.global_step == 3
    tr2 = _trainer(tmp_path, tok, data, **kw)
    tr2.train(resume_from_checkpoint=True)
    assert tr2.state.global_step == tr2.dp.ledger.steps == 2 * tr2.dp.sampler.steps_per_epoch


def test_drawn_indices_keep_their_numbers_through_pickling_and_a_skip():
    import pickle

    from accelerate.data_loader import SkipBatchSampler

    from hf_dp.privacy.sampler import DrawnIndices, PoissonBatchSampler

    s = PoissonBatchSampler(40, 0.25, steps_per_epoch=3, micro_batches=2, seed=3)
    lists = list(s)
    assert [(b.draw, b.logical, b.micro) for b in lists] == [(1, 1, 0), (2, 1, 1), (3, 2, 0), (4, 2, 1), (5, 3, 0), (6, 3, 1)]
    back = pickle.loads(pickle.dumps(lists[3]))
    assert isinstance(back, DrawnIndices) and back == lists[3] and (back.draw, back.logical, back.micro) == (4, 2, 1)
    skipped = list(SkipBatchSampler(s, skip_batches=2))  # HF's resume: accelerate yields the sampler's own lists
    assert all(isinstance(b, DrawnIndices) for b in skipped) and skipped[0].micro == 0
    assert type(lists[0][:2]) is list and type(lists[0] + [1]) is list  # a cut or padded draw is no draw


def test_rows_read_one_by_one_carry_no_stamp(tmp_path, tok, data):
    """The contract's row check and the independence probe collate rows read with dataset[i]: no stamp, tag draw 0
    (which training_step would refuse)."""
    tr = _trainer(tmp_path, tok, data)
    loader = tr.get_train_dataloader()
    batch = loader.collate_fn([loader.dataset[0], loader.dataset[1]])
    assert batch[DRAWN_KEY][1] == 0 and batch[DRAWN_KEY][-1] == 2


def test_a_wrapper_showing_the_loader_dataset_logs_the_public_unit_count(tmp_path, tok, data):
    """HF logs num_examples(train loader): under a unit column only the number of units is public. A wrapper of
    super()'s loader that shows its ``dataset`` (the stamped rows) must get the unit count, not the row count."""
    users = data.add_column("user", [i % 16 for i in range(len(data))])
    tr = _trainer(tmp_path, tok, users, privacy_unit_column="user", remove_unused_columns=False)

    class Showing(_Passthrough):
        @property
        def dataset(self):
            return self.loader.dataset

    wrapper = Showing(DPTrainer.get_train_dataloader(tr))
    assert len(wrapper.dataset) == len(users) == 64
    assert tr.num_examples(wrapper) == 16
