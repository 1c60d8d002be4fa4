"""``--train_sampling_strategy group_by_length`` under DP: each Poisson draw is ordered by length before it is cut into
micro-batches. The draws, the clipped sum and the noise are those of ``random``; only the padding shrinks."""

from __future__ import annotations

import pytest
import torch

from hf_dp import DPTrainer
from hf_dp.privacy.sampler import PoissonBatchSampler
from hf_dp.run.data import example_lengths

from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_sampler_orders_each_draw_by_length_and_draws_the_same_rows():
    n, q, steps, micro = 400, 0.1, 12, 4
    lengths = torch.randint(1, 60, (n,))
    plain = PoissonBatchSampler(n, q, steps, micro_batches=micro, seed=5, position=lambda: 3)
    grouped = PoissonBatchSampler(n, q, steps, micro_batches=micro, seed=5, position=lambda: 3, lengths=lengths)
    a, b = list(plain), list(grouped)
    assert len(a) == len(b) == steps * micro
    reordered = 0
    for t in range(steps):
        pa, pb = a[t * micro:(t + 1) * micro], b[t * micro:(t + 1) * micro]
        flat_a, flat_b = [i for p in pa for i in p], [i for p in pb for i in p]
        assert sorted(flat_a) == sorted(flat_b)  # the same rows drawn
        assert [len(p) for p in pa] == [len(p) for p in pb]  # the same micro-batch sizes
        assert lengths[flat_b].tolist() == sorted(lengths[flat_b].tolist())  # ordered by length across the step
        reordered += flat_a != flat_b
        # padding: each micro-batch pads to its own longest row
        padded = lambda parts: sum(len(p) * int(lengths[p].max()) for p in parts if p)  # noqa: E731
        assert padded(pb) <= padded(pa)
    assert reordered == steps


def test_sampler_refuses_lengths_of_another_dataset():
    with pytest.raises(ValueError, match="lengths has 3 entries for a dataset of 4 examples"):
        PoissonBatchSampler(4, 0.5, 2, lengths=[1, 2, 3])


def _train(tok, tmp_path, strategy, **kw):
    ds = make_pair_dataset(tok, n=128, seed=3)
    model = make_model(seed=0)
    widths = []
    model.register_forward_pre_hook(
        lambda m, args, kwargs: widths.append(int((kwargs.get("attention_mask")).shape[1])) if m.training else None,
        with_kwargs=True)
    args = dp_args(tmp_path / strategy, train_sampling_strategy=strategy, per_device_train_batch_size=8,
                   gradient_accumulation_steps=4, num_train_epochs=2, dp_seed=9, **kw)
    trainer = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=make_collator(tok))
    trainer.train()
    return trainer, widths


@pytest.mark.parametrize("cached", [False, True], ids=["full-model", "cached-prefix"])
def test_group_by_length_trains_the_same_model_with_less_padding(tok, tmp_path, cached):
    """Same --dp_seed (same draws, same noise), dropout off: the two orders give the same model, ε and steps, and
    the ordered run pads to fewer positions."""
    kw = {"trainable": "last_block", "cache_frozen_features": True} if cached else {}
    plain, w_plain = _train(tok, tmp_path, "random", **kw)
    grouped, w_grouped = _train(tok, tmp_path, "group_by_length", **kw)
    assert plain.state.global_step == grouped.state.global_step > 0
    assert plain.get_epsilon() == grouped.get_epsilon()
    assert len(w_plain) == len(w_grouped)
    assert sum(w_grouped) < sum(w_plain)
    moved = 0
    init = make_model(seed=0).state_dict()
    for (name, p), (_, g) in zip(plain.model.named_parameters(), grouped.model.named_parameters()):
        if p.requires_grad:
            torch.testing.assert_close(g, p, rtol=1e-4, atol=1e-5, msg=name)
            moved += not torch.allclose(p, init[name])
    assert moved > 0


def test_group_by_length_without_dp_reads_a_prefix_cache_lengths(tok, tmp_path):
    """HF's LengthGroupedSampler reads input_ids, which a prefix cache does not have: without DP the cache's own
    lengths are used, for training and evaluation (HF's grouping)."""
    from transformers.trainer_pt_utils import LengthGroupedSampler

    ds = make_pair_dataset(tok, n=64, seed=4)
    ev = make_pair_dataset(tok, n=32, seed=5)
    args = dp_args(tmp_path, train_sampling_strategy="group_by_length", trainable="last_block",
                   cache_frozen_features=True, num_train_epochs=1, disable_dp=True, optim="adamw_torch")
    trainer = DPTrainer(model=make_model(seed=0), args=args, train_dataset=ds, eval_dataset=ev,
                        data_collator=make_collator(tok))
    eval_cache = trainer._eval_cache()  # the eval set's cache is built when first needed (as evaluate() does)
    for sampler, cache in ((trainer._get_train_sampler(), trainer.train_dataset),
                           (trainer._get_eval_sampler(eval_cache), eval_cache)):
        assert isinstance(sampler, LengthGroupedSampler)
        assert sampler.lengths == cache.lengths.tolist() == [sum(m) for m in (ds if cache is trainer.train_dataset
                                                                                 else ev)["attention_mask"]]
    trainer.train()
    assert trainer.state.global_step > 0
    assert "eval_loss" in trainer.evaluate()


@pytest.mark.parametrize("cached", [False, True], ids=["full-model", "cached-prefix"])
def test_under_dp_evaluation_and_predict_keep_the_dataset_order(tok, tmp_path, cached):
    """group_by_length orders the training draws only: predict() returns rows in the dataset's order (HF's grouped
    eval sampler would permute them, e.g. a recipe's predictions file)."""
    ds = make_pair_dataset(tok, n=64, seed=4)
    test = make_pair_dataset(tok, n=48, seed=7)
    kw = {"trainable": "last_block", "cache_frozen_features": True} if cached else {}
    trainer = DPTrainer(model=make_model(seed=0), args=dp_args(tmp_path, train_sampling_strategy="group_by_length", **kw),
                        train_dataset=ds, data_collator=make_collator(tok))
    out = trainer.predict(test)
    assert out.label_ids.tolist() == test["labels"]
    ref = DPTrainer(model=make_model(seed=0), args=dp_args(tmp_path / "r", **kw), train_dataset=ds,
                    data_collator=make_collator(tok)).predict(test)
    torch.testing.assert_close(torch.as_tensor(out.predictions), torch.as_tensor(ref.predictions), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("strategy", ["random", "group_by_length"])
def test_a_training_set_replaced_after_init_is_refused(tok, tmp_path, strategy):
    """σ, q = B/N and δ < 1/N were set for the dataset the trainer was made with: another size is refused at train()
    (with random it used to train on the first N rows of the new one, silently)."""
    trainer = DPTrainer(model=make_model(seed=0), args=dp_args(tmp_path, train_sampling_strategy=strategy),
                        train_dataset=make_pair_dataset(tok, n=64, seed=4), data_collator=make_collator(tok))
    trainer.train_dataset = make_pair_dataset(tok, n=100, seed=4)
    with pytest.raises(ValueError, match=r"^train_dataset was replaced after the DPTrainer was built: .*make a new "
                                         r"DPTrainer for other data$"):
        trainer.train()
    assert trainer.state.global_step == 0 and trainer.ledger.steps == 0


def test_switching_the_strategy_after_init_is_honoured(tok, tmp_path):
    trainer = DPTrainer(model=make_model(seed=0), args=dp_args(tmp_path, train_sampling_strategy="group_by_length"),
                        train_dataset=make_pair_dataset(tok, n=64, seed=4), data_collator=make_collator(tok))
    assert trainer.dp.sampler.lengths is not None
    trainer.args.train_sampling_strategy = "random"
    trainer.get_train_dataloader()
    assert trainer.dp.sampler.lengths is None


def test_group_by_length_needs_lengths(tok, tmp_path):
    class Rows(torch.utils.data.Dataset):
        def __init__(self, rows):
            self.rows = rows

        def __len__(self):
            return len(self.rows)

        def __getitem__(self, i):
            return self.rows[i]

    rows = [{"inputs_embeds": torch.zeros(3, 16), "labels": i % 2} for i in range(32)]
    with pytest.raises(ValueError, match=r"^--train_sampling_strategy group_by_length needs each training example's "
                                         r"length: give the dataset a 'length' column"):
        DPTrainer(model=make_model(), args=dp_args(tmp_path, train_sampling_strategy="group_by_length"),
                  train_dataset=Rows(rows))
    ds = make_pair_dataset(tok, n=16, seed=6)
    assert example_lengths(ds).tolist() == [sum(m) for m in ds["attention_mask"]]
    assert example_lengths(ds.add_column("length", list(range(16)))).tolist() == list(range(16))
    assert example_lengths(Rows([{"input_ids": [1] * (i + 1)} for i in range(4)])).tolist() == [1, 2, 3, 4]
