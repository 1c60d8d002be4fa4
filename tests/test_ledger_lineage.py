"""The ledger belongs to the model and to the lineage of its checkpoints (issue 27, items 7, 8, 9).

7. A model trained by DPTrainer carries its ledger — in memory (with a fingerprint of the training data, never
   written anywhere public) and in the release (``config.json``'s ``hf_dp_privacy`` and ``privacy.json``: public
   numbers only). A new DPTrainer on that model continues the ledger — also on other data, or on a model loaded from
   a release, whose data cannot be compared (one warning says so): a re-ordered or re-columned copy of the same rows
   cannot be told from other data (issue 38 item 5); ``--prior_privacy separate`` must be said to count nothing.
   On ff55d8f three DPTrainers in turn on one model each reported the ε of their own steps.
8. Forks: a resumed run is a new run with a parent (run id + checkpoint step); the checkpoint folder records which
   runs resumed from it, and a later resume of the same checkpoint counts their steps (and warns). On ff55d8f each
   fork claimed only the original run's steps plus its own.
9. ``hf_dp_epsilon_spent.json`` keeps every run's record; a fresh run into an output_dir holding another run's
   checkpoints is refused before any step. On ff55d8f the second run replaced the first run's record silently.
"""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from hf_dp import DPTrainer
from hf_dp.privacy.accounting import compute_epsilon

from tests.helpers import StepCounter, dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")

Q = 8 / 64
DELTA = 1e-3


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def ds(tok):
    return make_pair_dataset(tok, n=64)


@pytest.fixture(scope="module")
def other(tok):
    return make_pair_dataset(tok, n=64, seed=7)


@pytest.fixture(scope="module")
def collator(tok):
    return make_collator(tok)


def _args(out, **kw):
    base = dict(epsilon=None, noise_multiplier=1.0, per_device_train_batch_size=8, max_steps=3, logging_steps=1,
                dp_seed=None, delta=DELTA, accountant="rdp", trainable="last_block")
    base.update(kw)
    return dp_args(out, **base)


def _trainer(out, ds, collator, model=None, **kw):
    callbacks = kw.pop("callbacks", None)
    return DPTrainer(model=model if model is not None else make_model(), args=_args(out, **kw), train_dataset=ds,
                     data_collator=collator, callbacks=callbacks)


def _eps(steps, sigma=1.0, q=Q):
    return compute_epsilon(sigma, q, steps, DELTA, "rdp")


def _hf_dp_warnings(caplog):
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("hf_dp")]


# ---------------------------------------------------------------------------------------------------
# 7. the ledger belongs to the model
# ---------------------------------------------------------------------------------------------------
def test_trainers_in_turn_on_one_model_continue_its_ledger(ds, collator, tmp_path):
    """ff55d8f: each trainer reported 3 steps (ε of 3), the model took 9."""
    model = make_model()
    for i in range(3):
        t = _trainer(tmp_path / f"t{i}", ds, collator, model=model)
        t.train()
        assert t.ledger.steps == 3 * (i + 1)
        assert t.get_epsilon() == pytest.approx(_eps(3 * (i + 1)), rel=1e-9)
    t.save_model(str(tmp_path / "final"))
    privacy = json.loads((tmp_path / "final" / "privacy.json").read_text())
    assert privacy["steps"] == 9 and privacy["epsilon"] == pytest.approx(_eps(9), rel=1e-9)
    runs = privacy["ledger"]["runs"]
    assert [r["steps"] for r in runs] == [3, 3, 3] and runs[-1]["run_id"] == t.run_id
    # the release names only public numbers: no fingerprint of the training data
    fingerprint = t._train_data_info()["sha256"]
    for name in ("privacy.json", "config.json", "README.md"):
        assert fingerprint not in (tmp_path / "final" / name).read_text()
    config = json.loads((tmp_path / "final" / "config.json").read_text())
    assert config["hf_dp_privacy"]["steps"] == 9 and "sha256" not in json.dumps(config["hf_dp_privacy"])


def test_a_stale_trainer_saves_the_ledger_the_model_carries(ds, collator, tmp_path, caplog):
    """Issue 49 item 4 (72a3f42): T1 trained a model 3 steps, T2 3 more, T1 3 more (9 noisy steps); T2.save_model
    then wrote 6 steps (epsilon of 6) into privacy.json and config.json, and a DPTrainer on that release started at 6.
    Whatever trainer writes it, a release never counts fewer steps than the weights it holds took."""
    from transformers import AutoModelForSequenceClassification

    model = make_model()
    t1 = _trainer(tmp_path / "t1", ds, collator, model=model)
    t1.train()
    t2 = _trainer(tmp_path / "t2", ds, collator, model=model)
    t2.train()
    t1.train()
    assert t1.ledger.steps == 9
    # T2 is stale: what it saves, its report and its epsilon are the model's (one warning says so)
    out = tmp_path / "t2" / "release"
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        t2.save_model(str(out))
        privacy = json.loads((out / "privacy.json").read_text())
        assert privacy["steps"] == 9 and privacy["epsilon"] == pytest.approx(_eps(9), rel=1e-9)
        assert json.loads((out / "config.json").read_text())["hf_dp_privacy"]["steps"] == 9
        assert t2.get_epsilon() == pytest.approx(_eps(9), rel=1e-9)
        assert t2.privacy_report()["steps"] == 9
    warned = [m for m in _hf_dp_warnings(caplog) if "another DPTrainer" in m]
    assert len(warned) == 1 and t1.run_id in warned[0] and "9 noisy steps" in warned[0], _hf_dp_warnings(caplog)
    assert sorted((r["run_id"], r["steps"]) for r in privacy["ledger"]["runs"]) == sorted([(t1.run_id, 6), (t2.run_id, 3)])
    from hf_dp.run.spent import read_spent_runs

    assert read_spent_runs(str(tmp_path / "t2"))[t2.run_id]["steps"] == 9
    loaded = AutoModelForSequenceClassification.from_pretrained(str(out))
    assert _trainer(tmp_path / "t3", ds, collator, model=loaded).ledger.steps == 9
    # the in-memory model the same; T1 training again counts T2's steps once, not twice
    assert _trainer(tmp_path / "t4", ds, collator, model=model).ledger.steps == 9
    t1.train()
    assert t1.ledger.steps == 12


def test_a_trainer_that_never_trained_saves_the_steps_its_model_took_since(ds, collator, tmp_path):
    """A DPTrainer built before another one trained the model: its release counts those steps (it wrote epsilon 0)."""
    model = make_model()
    idle = _trainer(tmp_path / "idle", ds, collator, model=model)
    _trainer(tmp_path / "t1", ds, collator, model=model).train()
    idle.save_model(str(tmp_path / "idle" / "release"))
    privacy = json.loads((tmp_path / "idle" / "release" / "privacy.json").read_text())
    assert privacy["steps"] == 3 and privacy["epsilon"] == pytest.approx(_eps(3), rel=1e-9)
    assert json.loads((tmp_path / "idle" / "release" / "config.json").read_text())["hf_dp_privacy"]["steps"] == 3


def test_a_stale_trainers_log_leaves_the_models_config_whole(ds, collator, tmp_path):
    """A stale trainer's log() (an evaluate()) refreshes model.config: it must not put the stale record there, which a
    plain ``model.save_pretrained`` would then release."""
    from transformers import AutoModelForSequenceClassification

    model = make_model()
    t1 = _trainer(tmp_path / "t1", ds, collator, model=model)
    t1.train()
    t2 = _trainer(tmp_path / "t2", ds, collator, model=model)
    t2.train()
    t1.train()
    t2.log({"loss": 0.0})
    assert model.config.hf_dp_privacy["steps"] == 9
    model.save_pretrained(str(tmp_path / "plain"))
    loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "plain"))
    assert _trainer(tmp_path / "t3", ds, collator, model=loaded).ledger.steps == 9


def test_the_same_data_rebuilt_is_recognised(tok, ds, collator, tmp_path):
    model = make_model()
    _trainer(tmp_path / "a", ds, collator, model=model).train()
    again = make_pair_dataset(tok, n=64)  # another Dataset object, the same rows
    t = _trainer(tmp_path / "b", again, collator, model=model)
    t.train()
    assert t.ledger.steps == 6


def test_a_spent_target_is_refused_before_any_step(ds, collator, tmp_path):
    """ff55d8f: a second --epsilon trainer on the model took its full planned run again."""
    model = make_model()
    first = _trainer(tmp_path / "a", ds, collator, model=model, epsilon=3.0, noise_multiplier=None, max_steps=4)
    first.train()
    spent = first.get_epsilon()
    assert spent <= 3.0
    counter = StepCounter()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    second = _trainer(tmp_path / "b", ds, collator, model=model, epsilon=3.0, noise_multiplier=None, max_steps=4,
                      callbacks=[counter])
    with pytest.raises(ValueError, match=r"already spent epsilon=.*target epsilon=3"):
        second.train()
    assert counter.optimizer_steps == 0
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_a_larger_target_counts_the_earlier_run(ds, collator, tmp_path):
    """A larger --epsilon is the model's total: the second run stops when the total reaches it."""
    model = make_model()
    first = _trainer(tmp_path / "a", ds, collator, model=model, max_steps=4)
    first.train()
    target = _eps(6)  # room for about two more steps at sigma = 1
    second = _trainer(tmp_path / "b", ds, collator, model=model, epsilon=target * 1.0001, noise_multiplier=None, max_steps=4)
    second.train()
    assert second.get_epsilon() <= target * 1.0001
    assert 4 < second.ledger.steps < 8


def test_other_data_is_counted_with_one_warning_unless_separate(ds, other, collator, tmp_path, caplog):
    model = make_model()
    _trainer(tmp_path / "a", ds, collator, model=model).train()
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        t = _trainer(tmp_path / "b", other, collator, model=model)
    warned = [m for m in _hf_dp_warnings(caplog) if "prior_privacy" in m]
    assert len(warned) == 1 and "composes" in warned[0] and f"{_eps(3):.4g}" in warned[0], _hf_dp_warnings(caplog)
    assert "on other training data" in warned[0] and "--prior_privacy separate" in warned[0]
    t.train()
    assert t.ledger.steps == 6  # counted by default (fail closed): the user is told how not to count it
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        counted = _trainer(tmp_path / "c", other, collator, model=model, prior_privacy="continue")
    assert not [m for m in _hf_dp_warnings(caplog) if "prior_privacy" in m]
    counted.train()
    assert counted.ledger.steps == 9  # the model's ledger: a's 3 and b's 3 steps, and its own 3
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        _trainer(tmp_path / "d", ds, collator, model=make_model(), prior_privacy="separate")
    assert not [m for m in _hf_dp_warnings(caplog) if "prior_privacy" in m]


def test_a_reordered_or_recolumned_copy_of_the_data_is_counted_unless_separate_is_said(ds, other, collator, tmp_path):
    """Issue 38 item 5: the default counts every earlier DP run of the model. Before the fix ``auto`` counted only runs
    whose data had the same fingerprint: a re-ordered copy of the same rows, or the same rows with one more column,
    were "other data" (one warning) and the new run reported the epsilon of its own steps only."""
    model = make_model()
    _trainer(tmp_path / "a", ds, collator, model=model).train()
    reordered = ds.select(list(range(len(ds)))[::-1])
    t = _trainer(tmp_path / "b", reordered, collator, model=model)
    t.train()
    assert t.ledger.steps == 6 and t.get_epsilon() == pytest.approx(_eps(6), rel=1e-9)
    recolumned = ds.add_column("note", [0] * len(ds))
    t = _trainer(tmp_path / "c", recolumned, collator, model=model)
    t.train()
    assert t.ledger.steps == 9 and t.get_epsilon() == pytest.approx(_eps(9), rel=1e-9)
    # disjoint data must be said: --prior_privacy separate
    t = _trainer(tmp_path / "d", other, collator, model=model, prior_privacy="separate")
    t.train()
    assert t.ledger.steps == 3 and t.get_epsilon() == pytest.approx(_eps(3), rel=1e-9)


def test_separate_is_refused_on_the_same_data(ds, collator, tmp_path):
    model = make_model()
    _trainer(tmp_path / "a", ds, collator, model=model).train()
    with pytest.raises(ValueError, match="same training data"):
        _trainer(tmp_path / "b", ds, collator, model=model, prior_privacy="separate")


def test_a_release_carries_its_ledger(ds, collator, tmp_path, caplog):
    """ff55d8f: a release retrained on the same data reported only the new steps, without a word."""
    from transformers import AutoModelForSequenceClassification

    first = _trainer(tmp_path / "a", ds, collator)
    first.train()
    first.save_model(str(tmp_path / "release"))
    loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "release"))
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        t = _trainer(tmp_path / "b", ds, collator, model=loaded)
    warned = [m for m in _hf_dp_warnings(caplog) if "prior_privacy" in m]
    assert len(warned) == 1 and "cannot be compared" in warned[0], _hf_dp_warnings(caplog)
    t.train()
    assert t.ledger.steps == 6  # counted by default (fail closed)
    for prior in ("auto", "continue", str(tmp_path / "release" / "privacy.json"), str(tmp_path / "release")):
        loaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "release"))
        t = _trainer(tmp_path / "c", ds, collator, model=loaded, prior_privacy=prior)
        t.train()
        assert t.ledger.steps == 6 and t.get_epsilon() == pytest.approx(_eps(6), rel=1e-9), prior
        report = t.privacy_report()
        assert [r["run_id"] for r in report["ledger"]["runs"]] == [first.run_id, t.run_id]


def test_a_legacy_privacy_json_starts_the_ledger(ds, collator, tmp_path):
    legacy = {"epsilon": _eps(5), "delta": DELTA, "accountant": "rdp", "noise_multiplier": 1.0, "sample_rate": Q,
              "steps": 5, "differential_privacy": True}
    path = tmp_path / "old_privacy.json"
    path.write_text(json.dumps(legacy))
    t = _trainer(tmp_path / "b", ds, collator, prior_privacy=str(path))
    t.train()
    assert t.ledger.steps == 8 and t.get_epsilon() == pytest.approx(_eps(8), rel=1e-9)


def test_heterogeneous_prior_is_composed(ds, collator, tmp_path):
    """The earlier run's (sigma, q) differ from this run's: the accountant composes both."""
    from hf_dp.privacy.accounting import make_accountant

    model = make_model()
    _trainer(tmp_path / "a", ds, collator, model=model, noise_multiplier=2.0, per_device_train_batch_size=16).train()
    t = _trainer(tmp_path / "b", ds, collator, model=model)
    t.train()
    acc = make_accountant("rdp")
    acc.history = [(2.0, 16 / 64, 3), (1.0, Q, 3)]
    assert t.ledger.steps == 6 and t.get_epsilon() == pytest.approx(acc.get_epsilon(delta=DELTA), rel=1e-9)


def test_a_non_private_run_after_dp_training_is_marked_in_the_release(ds, collator, tmp_path):
    from tests.helpers import dp_args as plain_args

    model = make_model()
    _trainer(tmp_path / "a", ds, collator, model=model).train()
    args = plain_args(tmp_path / "b", optim="adamw_torch", disable_dp=True, epsilon=None, max_steps=2,
                      per_device_train_batch_size=8)
    t = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=collator)
    t.train()
    t.save_model(str(tmp_path / "b" / "final"))
    record = json.loads((tmp_path / "b" / "final" / "config.json").read_text())["hf_dp_privacy"]
    assert record["trained_without_dp_after"] is True and record["steps"] == 3


# ---------------------------------------------------------------------------------------------------
# 8. forks
# ---------------------------------------------------------------------------------------------------
def test_forks_of_one_checkpoint_count_each_other(ds, collator, tmp_path, caplog):
    """ff55d8f: two forks of checkpoint-2 each claimed 4 + 2 = 6 steps; a third one into fork 1's folder 8; the
    lineage took 4 + 2 + 2 + 2 = 10."""
    from hf_dp.run.checkpointing import checkpoint_problem

    out = tmp_path / "run"
    original = _trainer(out, ds, collator, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=None)
    original.train()
    ckpt = out / "checkpoint-2"

    f1 = _trainer(tmp_path / "fork1", ds, collator, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        f1.train(resume_from_checkpoint=str(ckpt))
    assert f1.ledger.steps == 4 + 2  # the original's 4 (2 of them past the checkpoint) and its own 2
    assert not [m for m in _hf_dp_warnings(caplog) if "already resumed" in m]
    assert f1.run_id != original.run_id
    caplog.clear()

    f2 = _trainer(tmp_path / "fork2", ds, collator, max_steps=4)
    with caplog.at_level(logging.WARNING, logger="hf_dp"):
        f2.train(resume_from_checkpoint=str(ckpt))
    assert f2.ledger.steps == 4 + 2 + 2
    warned = [m for m in _hf_dp_warnings(caplog) if "already resumed" in m]
    assert len(warned) == 1 and f1.run_id in warned[0] and f"{_eps(6):.4g}" in warned[0], _hf_dp_warnings(caplog)

    f3 = _trainer(tmp_path / "fork1", ds, collator, max_steps=4)  # into fork 1's folder
    f3.train(resume_from_checkpoint=str(ckpt))
    assert f3.ledger.steps == 4 + 2 + 2 + 2
    assert f3.get_epsilon() == pytest.approx(_eps(10), rel=1e-9)

    # the checkpoint records who resumed from it, and is still a complete checkpoint
    assert checkpoint_problem(str(ckpt)) is None
    recorded = {json.loads(p.read_text())["run_id"] for p in ckpt.glob("hf_dp_resumed_by*.json")}
    assert recorded == {f1.run_id, f2.run_id, f3.run_id}

    # privacy.json and the card name the parent run and step
    f2.save_model(str(tmp_path / "fork2_release"))
    privacy = json.loads((tmp_path / "fork2_release" / "privacy.json").read_text())
    assert privacy["ledger"]["parent"] == {"run_id": original.run_id, "global_step": 2}
    assert privacy["run_id"] == f2.run_id
    card = (tmp_path / "fork2_release" / "README.md").read_text()
    assert original.run_id in card and "step 2" in card
    assert str(tmp_path) not in json.dumps(privacy)  # no local path in a release


def test_a_fork_of_a_fork_is_counted_at_the_first_checkpoint(ds, collator, tmp_path):
    out = tmp_path / "run"
    _trainer(out, ds, collator, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=None).train()
    f1 = _trainer(tmp_path / "f1", ds, collator, max_steps=5, save_strategy="steps", save_steps=2, save_total_limit=None)
    f1.train(resume_from_checkpoint=str(out / "checkpoint-2"))  # 4 + 3 own; its checkpoint-4 at ledger 6
    assert f1.ledger.steps == 7
    f11 = _trainer(tmp_path / "f11", ds, collator, max_steps=6)
    f11.train(resume_from_checkpoint=str(tmp_path / "f1" / "checkpoint-4"))  # 6 + 1 (f1 past it) + 2 own = 9
    assert f11.ledger.steps == 9
    g = _trainer(tmp_path / "g", ds, collator, max_steps=3)
    g.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    # 4 (original) + 3 (f1) + 2 (f11, registered in its ancestor checkpoint too) + 1 own
    assert g.ledger.steps == 10
    assert g.privacy_report()["ledger"]["counted_past_parent"] == {
        "parent_run_steps": 2, "other_resumes": [{"run_id": r.run_id, "steps": n} for r, n in sorted([(f1, 3), (f11, 2)], key=lambda x: x[0].run_id)]}


# ---------------------------------------------------------------------------------------------------
# 9. an earlier run's record is never overwritten
# ---------------------------------------------------------------------------------------------------
def test_a_second_run_into_a_folder_with_another_runs_checkpoints_is_refused(ds, collator, tmp_path):
    out = tmp_path / "run"
    first = _trainer(out, ds, collator, max_steps=4, save_strategy="steps", save_steps=2, save_total_limit=None)
    first.train()
    marker = (out / "checkpoint-2" / "hf_dp_checkpoint.json").read_text()
    spent = (out / "hf_dp_epsilon_spent.json").read_text()
    counter = StepCounter()
    second = _trainer(out, ds, collator, max_steps=4, save_strategy="steps", save_steps=2, callbacks=[counter])
    with pytest.raises(ValueError, match=rf"checkpoint-4 .*run {first.run_id}.*4 noisy steps.*another output_dir"):
        second.train()
    assert counter.optimizer_steps == 0
    assert (out / "checkpoint-2" / "hf_dp_checkpoint.json").read_text() == marker
    assert (out / "hf_dp_epsilon_spent.json").read_text() == spent
    # the same trainer training again (the same run) is fine; so is resuming
    first.train()
    assert first.ledger.steps == 8
    resumed = _trainer(out, ds, collator, max_steps=6)
    resumed.train(resume_from_checkpoint=True)


def test_every_runs_record_is_kept(ds, collator, tmp_path):

    out = tmp_path / "run"
    a = _trainer(out, ds, collator, max_steps=2)
    a.train()
    b = _trainer(out, ds, collator, max_steps=3)  # no checkpoints in the folder: accepted
    b.train()
    record = (out / "hf_dp_epsilon_spent.json").read_text()
    assert a.run_id in record and b.run_id in record  # ff55d8f: b's record replaced a's
    from hf_dp.run.spent import read_spent, read_spent_runs

    runs = read_spent_runs(str(out))
    assert runs[a.run_id]["steps"] == 2 and runs[b.run_id]["steps"] == 3
    assert read_spent(str(out))["run_id"] == b.run_id  # the newest record, as the single-record format read


def test_the_single_record_format_is_read_and_kept(ds, collator, tmp_path):

    out = tmp_path / "run"
    out.mkdir()
    old = {"steps": 7, "epsilon": 1.5, "privacy_spec": {"noise_multiplier": 1.0}, "run_id": "0123456789abcdef"}
    (out / "hf_dp_epsilon_spent.json").write_text(json.dumps(old))
    t = _trainer(out, ds, collator, max_steps=2)
    t.train()
    assert "0123456789abcdef" in (out / "hf_dp_epsilon_spent.json").read_text()  # ff55d8f: replaced
    from hf_dp.run.spent import read_spent_runs

    runs = read_spent_runs(str(out))
    assert runs["0123456789abcdef"]["steps"] == 7 and runs[t.run_id]["steps"] == 2


# ---------------------------------------------------------------------------------------------------
# the pieces
# ---------------------------------------------------------------------------------------------------
def test_the_data_reference_never_leaves_memory():
    import copy
    import pickle

    from hf_dp.run.lineage import DataRef

    rows = [{"input_ids": [1, 2], "labels": 0}]  # a list: no weak reference, held
    ref = DataRef(rows)  # its actual row count, never a planned N (tests/test_ledger_honesty.py)
    assert ref.dataset() is rows and ref.fingerprint is None  # hashed only when asked
    assert ref.get_fingerprint() is not None
    assert copy.deepcopy(ref) is ref
    restored = pickle.loads(pickle.dumps(ref))  # torch.save(model) is a file: no fingerprint, no data
    assert restored.fingerprint is None and restored.dataset() is None and restored.rows == 1


def test_a_resume_record_leaves_the_checkpoint_folder_times_alone(tmp_path):
    """HF rotates checkpoints by mtime: a record of a resume must not make an old checkpoint look new."""
    from hf_dp.run.spent import read_resume_records, write_resume_record

    folder = tmp_path / "checkpoint-2"
    folder.mkdir()
    os.utime(folder, ns=(1_000_000_000, 1_000_000_000))
    assert write_resume_record(str(folder), {"run_id": "abc", "start_steps": 3, "steps": 5})
    assert os.stat(folder).st_mtime_ns == 1_000_000_000
    assert read_resume_records(str(folder)) == [{"run_id": "abc", "start_steps": 3, "steps": 5}]
    assert not write_resume_record(str(tmp_path / "checkpoint-9"), {"run_id": "abc", "start_steps": 0, "steps": 1})
    assert not (tmp_path / "checkpoint-9").exists()  # a rotated-away checkpoint is not re-created


def test_composition_does_not_depend_on_how_runs_split_the_steps():
    from hf_dp.privacy.accounting import composed_epsilon

    for accountant in ("rdp", "prv"):
        whole = composed_epsilon(((1.0, Q, 6), (2.0, 0.25, 3)), DELTA, accountant)
        split = composed_epsilon(((2.0, 0.25, 1), (1.0, Q, 2), (1.0, Q, 4), (2.0, 0.25, 2)), DELTA, accountant)
        assert whole == split
        assert composed_epsilon(((1.0, Q, 2), (1.0, Q, 4)), DELTA, accountant) == compute_epsilon(1.0, Q, 6, DELTA, accountant)
