"""Issue 15.8: selection on private data.

* Under DP an eval set that is (or overlaps) the training set is refused (the simple cases are rows of
  docs/misuse.md, see tests/test_misuse.py; here: the cases that must stay allowed).
* When the released model is chosen on eval data (``load_best_model_at_end``, ``metric_for_best_model``, an
  ``EarlyStoppingCallback``), privacy.json and the card say which data selected it and that this is outside
  the guarantee; the card says that checkpoints (non-private training loss in ``trainer_state.json``) are
  not private artefacts and are kept out of pushes.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import EarlyStoppingCallback

from hf_dp import DPTrainer
from hf_dp.hub import parse_front_matter
from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")

EVAL_IS_TRAIN = r"^the eval dataset is \(or overlaps\) the private training set"


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    return tok, make_pair_dataset(tok, n=64, seed=0), make_pair_dataset(tok, n=24, seed=1)


def _trainer(tmp_path, train, eval_dataset, tok, callbacks=None, **kw):
    args = dp_args(tmp_path / "out", epsilon=None, noise_multiplier=1.0, max_steps=2, **kw)
    return DPTrainer(model=make_model(), args=args, train_dataset=train, eval_dataset=eval_dataset,
                     data_collator=make_collator(tok), callbacks=callbacks)


def test_overlapping_subsets_refused_disjoint_allowed(data, tmp_path):
    tok, train, _ = data
    base = train
    with pytest.raises(ValueError, match=EVAL_IS_TRAIN):  # the training Subset overlaps the eval Subset
        _trainer(tmp_path, torch.utils.data.Subset(base, range(0, 48)), torch.utils.data.Subset(base, range(40, 64)), tok)
    with pytest.raises(ValueError, match=EVAL_IS_TRAIN):  # eval = the whole base, train = a Subset of it
        _trainer(tmp_path, torch.utils.data.Subset(base, range(0, 48)), base, tok)
    _trainer(tmp_path, torch.utils.data.Subset(base, range(0, 48)), torch.utils.data.Subset(base, range(48, 64)), tok)


def test_held_out_eval_and_non_private_runs_allowed(data, tmp_path):
    tok, train, heldout = data
    _trainer(tmp_path, train, heldout, tok)
    _trainer(tmp_path, train, {"a": heldout, "b": heldout.select(range(8))}, tok)
    # a non-private run may evaluate on its training data (no guarantee to protect)
    _trainer(tmp_path, train, train, tok, optim="adamw_torch", disable_dp=True)


def _saved(trainer, tmp_path):
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    return json.loads((out / "privacy.json").read_text()), (out / "README.md").read_text()


def test_selection_on_eval_data_is_reported(data, tmp_path):
    tok, train, heldout = data
    trainer = _trainer(
        tmp_path, train, {"heldout": heldout}, tok, callbacks=[EarlyStoppingCallback(early_stopping_patience=1)],
        load_best_model_at_end=True, metric_for_best_model="eval_heldout_loss", greater_is_better=False,
        eval_strategy="steps", eval_steps=1, save_strategy="steps", save_steps=1,
    )
    trainer.train()
    privacy, card = _saved(trainer, tmp_path)
    sel = privacy["model_selection"]
    assert sel["selected_on_eval_data"] is True and sel["load_best_model_at_end"] is True and sel["early_stopping"] is True
    assert sel["metric_for_best_model"] == "eval_heldout_loss"
    assert sel["eval_datasets"] == ["heldout"] and sel["eval_dataset_sizes"] == {"heldout": 24}
    assert "outside the privacy guarantee" in sel["note"]
    assert parse_front_matter(card)["differential_privacy"]["epsilon"] == privacy["epsilon"]
    body = card.split("\n---\n", 1)[1]
    assert "**Model selection on evaluation data:**" in body
    assert "`eval_heldout_loss` on `heldout` (24 examples)" in body
    assert "EarlyStoppingCallback" in body and "load_best_model_at_end" in body
    assert "**outside the privacy\nguarantee**" in body
    exclusions = body.split("## What the guarantee does not cover", 1)[1]
    assert "(used for this model" in exclusions
    assert "trainer_state.json" in exclusions and "not private artefacts" in exclusions and "checkpoint-*" in exclusions


def test_no_selection_is_reported_as_such(data, tmp_path):
    tok, train, heldout = data
    trainer = _trainer(tmp_path, train, heldout, tok)
    privacy, card = _saved(trainer, tmp_path)
    assert privacy["model_selection"]["selected_on_eval_data"] is False
    assert privacy["model_selection"]["eval_datasets"] == []
    body = card.split("\n---\n", 1)[1]
    assert "**Model selection on evaluation data:**" not in body
    exclusions = body.split("## What the guarantee does not cover", 1)[1]
    assert "Model selection on evaluation data" in exclusions and "(used for this model" not in exclusions
    assert "trainer_state.json" in exclusions  # checkpoints are never private artefacts
