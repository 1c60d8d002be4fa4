"""A release never states a guarantee that does not hold (the adversarial review's findings on 88472cc).

1. Non-private training after a DP run: a ``--disable_dp`` trainer on a model that carries a ledger marks it (in
   memory and in its config) when its ``train()`` starts; a stale DP trainer's release, and a later DP run of a model
   loaded from a marked release, keep the mark, and their privacy.json and card say that no DP guarantee covers that
   training (on 88472cc: dp=True, no mark, nothing said).
2. ``--prior_privacy separate`` on the same data is refused also when the two runs planned another N
   (``--public_dataset_size``, ``--audit_canaries``; on 88472cc accepted: the second run counted 0 earlier steps).
3. Private or not is fixed when the trainer is built: a ``train()`` (or a step) with ``args.disable_dp`` flipped is
   refused (on 88472cc: trained without noise, privacy.json said differential_privacy=True, epsilon=0), and
   privacy.json's ``dp_seed`` is the run's, not the arguments' of the moment.
"""

from __future__ import annotations

import json

import pytest
from transformers import AutoModelForSequenceClassification, TrainerCallback

from hf_dp import DPTrainer

from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer, snapshot

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def ds(tok):
    return make_pair_dataset(tok, n=64)


@pytest.fixture(scope="module")
def collator(tok):
    return make_collator(tok)


def _trainer(out, ds, collator, model=None, **kw):
    base = dict(epsilon=None, noise_multiplier=1.0, per_device_train_batch_size=8, max_steps=2, logging_steps=1,
                dp_seed=None, delta=1e-3, accountant="rdp", trainable="last_block")
    base.update(kw)
    return DPTrainer(model=model if model is not None else make_model(), args=dp_args(out, **base), train_dataset=ds,
                     data_collator=collator)


def _plain(out, ds, collator, model, **kw):
    return _trainer(out, ds, collator, model, disable_dp=True, optim="adamw_torch", **kw)


def _release(trainer, folder):
    trainer.save_model(str(folder))
    privacy = json.loads((folder / "privacy.json").read_text())
    config = json.loads((folder / "config.json").read_text())["hf_dp_privacy"]
    return privacy, config, (folder / "README.md").read_text()


def _says_non_private(privacy, config, card):
    return (config.get("trained_without_dp_after") is True
            and privacy["ledger"].get("trained_without_dp_after") is True
            and "no privacy guarantee covers the data of that training" in privacy["non_private_training"]["note"]
            and "Also trained WITHOUT differential privacy" in card and "trained_without_dp_too: true" in card)


# ---------------------------------------------------------------------------------------------------
# 1. non-private training after a DP run
# ---------------------------------------------------------------------------------------------------
def test_a_stale_dp_trainer_after_a_non_private_run_says_so(ds, collator, tmp_path):
    t1 = _trainer(tmp_path / "a", ds, collator)
    t1.train()
    plain = _plain(tmp_path / "b", ds, collator, t1.model)
    plain.train()
    assert t1.model.config.hf_dp_privacy["trained_without_dp_after"] is True  # marked before any save
    privacy, config, card = _release(t1, tmp_path / "rel")
    assert privacy["differential_privacy"] is True and privacy["steps"] == 2
    assert _says_non_private(privacy, config, card)
    t1.train()  # T1 trains it again with DP: the history still holds the non-private run
    assert _says_non_private(*_release(t1, tmp_path / "rel2"))


def test_a_model_marked_in_its_release_keeps_the_mark_through_later_dp_training(ds, collator, tmp_path):
    t1 = _trainer(tmp_path / "a", ds, collator)
    t1.train()
    plain = _plain(tmp_path / "b", ds, collator, t1.model)
    plain.train()
    plain.save_model(str(tmp_path / "r3"))
    loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "r3"))
    t4 = _trainer(tmp_path / "c", ds, collator, loaded)
    t4.train()
    privacy, config, card = _release(t4, tmp_path / "r4")
    assert privacy["steps"] == 4 and _says_non_private(privacy, config, card)
    # a DP trainer built before the non-private run of its model keeps the mark too
    t5 = _trainer(tmp_path / "d", ds, collator, make_model())
    _trainer(tmp_path / "e", ds, collator, t5.model).train()
    _plain(tmp_path / "f", ds, collator, t5.model).train()
    t5.train()
    assert _says_non_private(*_release(t5, tmp_path / "r5"))


def test_dp_only_history_has_no_mark(ds, collator, tmp_path):
    t1 = _trainer(tmp_path / "a", ds, collator)
    t1.train()
    privacy, config, card = _release(t1, tmp_path / "rel")
    assert "trained_without_dp_after" not in config and "non_private_training" not in privacy
    assert "WITHOUT differential privacy" not in card


# ---------------------------------------------------------------------------------------------------
# 2. --prior_privacy separate compares the data, never the planned N
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("first", [{}, {"public_dataset_size": 100}, {"audit_canaries": 100, "delta": 1e-5}],
                         ids=["same_n", "public_dataset_size", "audit_canaries"])
def test_separate_on_the_same_data_is_refused_whatever_n_was_planned(ds, collator, tmp_path, first):
    t1 = _trainer(tmp_path / "a", ds, collator, **first)
    t1.train()
    with pytest.raises(ValueError, match="--prior_privacy separate, but this model was already trained with DP on"):
        _trainer(tmp_path / "b", ds, collator, t1.model, prior_privacy="separate")
    t2 = _trainer(tmp_path / "c", ds, collator, t1.model, public_dataset_size=200)  # counted, whatever N
    assert t2.ledger.prior_steps == t1.ledger.steps


# ---------------------------------------------------------------------------------------------------
# 3. private or not, as built
# ---------------------------------------------------------------------------------------------------
def test_a_train_with_disable_dp_flipped_is_refused_and_nothing_moves(ds, collator, tmp_path):
    t = _trainer(tmp_path / "a", ds, collator)
    before = snapshot(t.model)
    t.args.disable_dp, t.args.optim = True, "adamw_torch"
    with pytest.raises(ValueError, match="built with DP and trainer.args now asks to train without DP"):
        t.train()
    assert all((p == before[n]).all() for n, p in t.model.named_parameters())
    t.args.disable_dp, t.args.optim = False, "dp_adamw"
    t.train()  # as built: trains with DP
    assert t.ledger.steps == 2

    plain = _plain(tmp_path / "b", ds, collator, make_model())
    plain.args.disable_dp = False
    with pytest.raises(ValueError, match="built without DP .* now asks to train with DP"):
        plain.train()
    assert plain.privacy_report()["differential_privacy"] is False


def test_a_callback_flipping_disable_dp_mid_run_is_refused(ds, collator, tmp_path):
    class Flip(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if state.global_step == 1:
                args.disable_dp = True

    t = _trainer(tmp_path / "a", ds, collator, max_steps=3)
    t.add_callback(Flip())
    with pytest.raises(ValueError, match="built with DP and trainer.args now asks to train without DP"):
        t.train()
    assert t.ledger.steps == 1


def test_privacy_json_records_the_runs_seed_not_the_arguments(ds, collator, tmp_path):
    t = _trainer(tmp_path / "a", ds, collator, dp_seed=1234)
    t.train()
    t.args.dp_seed = 99  # changed after the run: the noise was drawn under 1234
    assert t.privacy_report()["dp_seed"] == 1234
