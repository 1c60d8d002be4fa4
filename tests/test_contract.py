"""The per-example contract enforced at run time (issue 27; hf_dp/run/contract.py).

Each test reproduces a way the reported ε could be false on ff55d8f — accepted silently there — and checks that it
is now refused in one sentence before a step is taken (or, for a callback, before the step it would falsify).
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from transformers import DataCollatorWithPadding, TrainerCallback

from hf_dp import DPTrainer, DPTrainingArguments

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from helpers import StepCounter, dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer, snapshot  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

ENGINES = ["ghost", "ghost_two_pass", "hooks"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


@pytest.fixture(scope="module")
def data(tok):
    return make_pair_dataset(tok, n=64)


def _trainer(tmp_path, tok, data, cls=DPTrainer, collator=None, model=None, **over):
    kw = dict(noise_multiplier=1.0, epsilon=None, max_steps=3, trainable="all", per_device_train_batch_size=8)
    kw.update(over)
    tr = cls(model=model if model is not None else make_model(), args=dp_args(tmp_path / "out", **kw),
             train_dataset=data, data_collator=collator or make_collator(tok))
    steps = StepCounter()
    tr.add_callback(steps)
    return tr, steps


def _refused_before_any_step(tr, steps, match):
    before = snapshot(tr.model)
    with pytest.raises(ValueError, match=match):
        tr.train()
    assert steps.optimizer_steps == 0
    assert all(torch.equal(before[n], p) for n, p in tr.model.named_parameters())


# ---------------------------------------------------------------------------------------------------
# 1. rows = examples
# ---------------------------------------------------------------------------------------------------
class TwoViews(DataCollatorWithPadding):
    """Augmented views: two rows per drawn example (sensitivity 2C)."""

    def __call__(self, features):
        return super().__call__(list(features) + list(features))


class Packing(DataCollatorWithPadding):
    """Packs consecutive examples into one row (sensitivity up to 3.2C in the issue's measurement)."""

    def __call__(self, features):
        features = list(features)
        packed = []
        for i in range(0, len(features), 2):
            a = dict(features[i])
            if i + 1 < len(features):
                b = features[i + 1]
                a = {"input_ids": a["input_ids"] + b["input_ids"][1:], "attention_mask": a["attention_mask"] + b["attention_mask"][1:],
                     "token_type_ids": a["token_type_ids"] + b["token_type_ids"][1:], "labels": a["labels"]}
            packed.append(a)
        return super().__call__(packed)


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("collator_cls", [TwoViews, Packing])
def test_a_collator_that_does_not_give_one_row_per_example_is_refused(tmp_path, tok, data, engine, collator_cls):
    tr, steps = _trainer(tmp_path, tok, data, collator=collator_cls(tok), clipping=engine)
    _refused_before_any_step(tr, steps, r"^the data collator returned '\w+' with \d+ rows for \d+ drawn example\(s\): DP training needs exactly one row per example")


def test_a_collator_that_tokenizes_a_row_past_the_token_bound_is_refused_before_any_step(tmp_path, tok):
    """Rows of raw text tokenized by the collator: their lengths cannot be read before training, and a row longer than
    --dp_max_length was refused only at the step that drew it (on main at e4f5b9a: after training had begun, and only
    if it was drawn — whether a model comes out then depends on that row's presence). Now every row is collated alone
    at train(), before any step."""
    from datasets import Dataset

    from helpers import WORDS

    texts = [" ".join(WORDS[(i + j) % 50] for j in range(3 + i % 4)) for i in range(64)]
    texts[37] = " ".join(WORDS[:30])  # 30 words: 32 tokens with [CLS] and [SEP]
    rows = Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(64)]})

    def tokenizing(features):
        out = tok([f["text"] for f in features], padding=True, return_tensors="pt")
        out["labels"] = torch.tensor([f["label"] for f in features])
        return out

    tr, steps = _trainer(tmp_path, tok, rows, collator=tokenizing, remove_unused_columns=False, dp_max_length=16)
    _refused_before_any_step(tr, steps, r"^the data collator makes training row 37 \(counting from 0\) 32 tokens long, "
                                        r"more than the run's public --dp_max_length 16")
    texts[37] = " ".join(WORDS[:14])  # 16 tokens: within the bound, trains
    tr, steps = _trainer(tmp_path, tok, Dataset.from_dict({"text": texts, "label": [i % 2 for i in range(64)]}),
                         collator=tokenizing, remove_unused_columns=False, dp_max_length=16)
    tr.train()
    assert steps.optimizer_steps == 3


def test_the_row_check_runs_on_every_micro_batch(tmp_path, tok, data):
    """A collator that breaks the contract only for some batches is caught at the batch that does (no step taken
    with it)."""

    class Sometimes(DataCollatorWithPadding):
        calls = 0

        def __call__(self, features):
            Sometimes.calls += 1
            features = list(features)
            if Sometimes.calls > 20 and features:
                features = features + features[:1]
            return super().__call__(features)

    tr, steps = _trainer(tmp_path, tok, data, collator=Sometimes(tok), max_steps=50, gradient_accumulation_steps=2,
                         per_device_train_batch_size=4)
    with pytest.raises(ValueError, match="one row per example"):
        tr.train()
    assert steps.optimizer_steps < 50


# ---------------------------------------------------------------------------------------------------
# 2. each example's loss depends on that example alone
# ---------------------------------------------------------------------------------------------------
class BatchTerm(DPTrainer):
    """The issue's example: a batch-level term w·‖mean logits‖² (sensitivity 1.07–1.15·C)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True, num_items_in_batch=num_items_in_batch)
        loss = loss + 1.0 * outputs.logits.mean(0).pow(2).sum()
        return (loss, outputs) if return_outputs else loss


class TokenMean(DPTrainer):
    """A token-mean loss whose denominator is the micro-batch's token count."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        mask = inputs["attention_mask"]
        labels = inputs.pop("labels")
        outputs = model(**inputs)
        per_example = F.cross_entropy(outputs.logits.float(), labels, reduction="none")
        loss = (per_example * mask.sum(1)).sum() / mask.sum()
        return (loss, outputs) if return_outputs else loss


class ItemsNormalised(DPTrainer):
    """A loss normalised by HF's num_items_in_batch (the number of labelled items in the batch)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs=return_outputs)
        if num_items_in_batch is not None:
            loss = loss * 8 / num_items_in_batch
        return loss


class MeanOverRows(DPTrainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        rows = inputs["labels"].shape[0]
        return super().compute_loss(model, inputs, return_outputs=return_outputs) / rows


class Mixup(DataCollatorWithPadding):
    """Mixes each example's tokens with the next example's (rows = examples, but one example reaches two rows)."""

    def __call__(self, features):
        batch = super().__call__(features)
        ids = batch["input_ids"]
        if ids.shape[0] > 1:
            batch["input_ids"] = torch.cat([ids[:, :3], ids.roll(1, 0)[:, 3:]], dim=1)
        return batch


@pytest.mark.parametrize("engine", ENGINES)
@pytest.mark.parametrize("cls", [BatchTerm, TokenMean, ItemsNormalised, MeanOverRows])
def test_a_loss_that_couples_examples_is_refused(tmp_path, tok, data, engine, cls):
    tr, steps = _trainer(tmp_path, tok, data, cls=cls, clipping=engine)
    _refused_before_any_step(tr, steps, r"^the per-example contract does not hold: (replacing|removing) one example of a probe micro-batch changed the other examples' loss gradients")


def test_a_collator_that_mixes_examples_is_refused(tmp_path, tok, data):
    tr, steps = _trainer(tmp_path, tok, data, collator=Mixup(tok))
    _refused_before_any_step(tr, steps, r"^the per-example contract does not hold: .* changed the other examples' outputs")


class Doubled(DPTrainer):
    """A legitimate override: a per-example term (2·ℓ_i + 0.1·‖logits_i‖²) for each example."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True)
        loss = 2 * loss + 0.1 * outputs.logits.pow(2).sum() / (self.privacy_spec.expected_batch_size)
        return (loss, outputs) if return_outputs else loss


@pytest.mark.parametrize("engine", ENGINES)
def test_a_per_example_override_passes_the_probe_and_trains(tmp_path, tok, data, engine):
    tr, steps = _trainer(tmp_path, tok, data, cls=Doubled, clipping=engine)
    before = snapshot(tr.model)
    tr.train()
    assert steps.optimizer_steps == 3 and tr.ledger.steps == 3
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())


def test_the_probe_leaves_no_engine_state_behind(tmp_path, tok, data):
    """The probe's forwards run without autograd: the same dp_seed trains the same model with and without it."""
    import hf_dp.run.independence as independence

    a, _ = _trainer(tmp_path / "a", tok, data, clipping="ghost")
    a.train()
    b, _ = _trainer(tmp_path / "b", tok, data, clipping="ghost")
    orig = independence.probe_independence
    independence.probe_independence = lambda *a, **kw: "passed"
    try:
        b.train()
    finally:
        independence.probe_independence = orig
    for (n, p), q in zip(a.model.named_parameters(), b.model.parameters()):
        assert torch.equal(p, q), n


# ---------------------------------------------------------------------------------------------------
# 3. the mechanism does not change after the trainer is built
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("change", [
    ("gradient_accumulation_steps", 3), ("per_device_train_batch_size", 4), ("per_sample_max_grad_norm", 5.0),
    ("noise_multiplier", 0.3), ("max_steps", 30), ("delta", 1e-6), ("clipping", "hooks"), ("optim", "dp_sgd"),
])
def test_arguments_changed_after_the_trainer_is_built_are_refused(tmp_path, tok, data, change):
    tr, steps = _trainer(tmp_path, tok, data)
    setattr(tr.args, *change)
    _refused_before_any_step(tr, steps, rf"^the privacy mechanism changed after the DPTrainer was built \({change[0]}: planned .*, now .*\)")


def test_a_trainable_set_changed_after_the_trainer_is_built_is_refused(tmp_path, tok, data):
    tr, steps = _trainer(tmp_path, tok, data, trainable="last_block")
    for p in tr.model.parameters():
        p.requires_grad_(True)
    _refused_before_any_step(tr, steps, r"^the privacy mechanism changed after the DPTrainer was built \(trainable_parameters: planned \d+ trainable tensors, now \d+ trainable tensors\)")


def test_arguments_changed_by_a_callback_during_training_are_refused_at_the_next_step(tmp_path, tok, data):
    class Change(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == 2:
                args.gradient_accumulation_steps = 3

    tr, steps = _trainer(tmp_path, tok, data, max_steps=5)
    tr.add_callback(Change())
    with pytest.raises(ValueError, match=r"^the privacy mechanism changed after the DPTrainer was built \(gradient_accumulation_steps: planned 1, now 3\)"):
        tr.train()
    assert steps.optimizer_steps == 2 and tr.ledger.steps == 2


def test_a_second_train_with_unchanged_arguments_is_fine(tmp_path, tok, data):
    tr, steps = _trainer(tmp_path, tok, data)
    tr.train()
    tr.train()
    assert tr.ledger.steps == 6


# ---------------------------------------------------------------------------------------------------
# 5. evaluation on the training set, at every evaluate() / predict()
# ---------------------------------------------------------------------------------------------------
EVAL_IS_TRAIN = r"^the eval dataset is \(or overlaps\) the private training set"


def test_evaluate_and_predict_on_the_training_set_after_train_are_refused(tmp_path, tok, data):
    heldout = make_pair_dataset(tok, n=16, seed=5)
    tr, _ = _trainer(tmp_path, tok, data)
    tr.eval_dataset = None
    tr.train()
    with pytest.raises(ValueError, match=EVAL_IS_TRAIN):
        tr.evaluate(eval_dataset=data)
    with pytest.raises(ValueError, match=EVAL_IS_TRAIN):
        tr.evaluate(eval_dataset={"train": data})
    with pytest.raises(ValueError, match=EVAL_IS_TRAIN):
        tr.predict(data)
    tr.eval_dataset = data  # set after construction
    with pytest.raises(ValueError, match=EVAL_IS_TRAIN):
        tr.evaluate()
    assert "eval_loss" in tr.evaluate(eval_dataset=heldout)
    # no metric of the training set was ever logged
    assert not any(k.startswith("eval_train") for e in tr.state.log_history for k in e)


# ---------------------------------------------------------------------------------------------------
# 6. labels the loss can use (the engines' own guarantee: tests/test_nonfinite.py)
# ---------------------------------------------------------------------------------------------------
def _with_labels(data, labels):
    return data.remove_columns("labels").add_column("labels", labels)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_non_finite_regression_labels_are_refused_before_training(tmp_path, tok, data, bad):
    labels = [float(i % 3) for i in range(len(data))]
    labels[17] = bad
    with pytest.raises(ValueError, match=r"^the training labels \(column 'labels'\) contain NaN or infinite values \(first at row 17, counting from 0\)"):
        _trainer(tmp_path, tok, _with_labels(data, labels), model=make_model(num_labels=1))


def test_out_of_range_class_labels_are_refused_before_training(tmp_path, tok, data):
    labels = [i % 2 for i in range(len(data))]
    labels[40] = 5
    with pytest.raises(ValueError, match=r"^the training labels \(column 'labels'\) contain 5 \(first at row 40, counting from 0\), outside the model's classes 0\.\.1"):
        _trainer(tmp_path, tok, _with_labels(data, labels))
    labels[40] = -100  # the ignore index is fine
    _trainer(tmp_path, tok, _with_labels(data, labels))


# ---------------------------------------------------------------------------------------------------
# 10. a loss computed for the wrong head
# ---------------------------------------------------------------------------------------------------
def _gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(vocab_size=60, n_positions=32, n_embd=16, n_layer=2, n_head=2))


def _bert_token_classifier():
    from transformers import BertForTokenClassification

    from helpers import tiny_config

    return BertForTokenClassification(tiny_config())


def _bert_masked_lm():
    from transformers import BertForMaskedLM

    from helpers import tiny_config

    return BertForMaskedLM(tiny_config())


@pytest.mark.parametrize("factory,kind", [(_bert_masked_lm, "masked language"), (_bert_token_classifier, "token-classification")])
def test_a_model_whose_loss_dptrainer_does_not_compute_is_refused(tmp_path, tok, data, factory, kind):
    with pytest.raises(ValueError, match=rf"^\w+ is a {kind} model, but DPTrainer computes each example's loss only for the heads it supports"):
        _trainer(tmp_path, tok, data, model=factory())


def test_a_causal_lm_is_accepted_and_gets_the_causal_lm_objective(tmp_path, tok, data):
    tr, _ = _trainer(tmp_path, tok, data, model=_gpt2(), clipping="hooks")  # issue 29: refused on c4278d0
    assert tr.objective.name == "causal_lm"


def test_a_custom_model_with_per_token_logits_is_refused_at_its_first_forward(tmp_path, tok, data):
    from transformers import BertForSequenceClassification

    class PerToken(BertForSequenceClassification):  # a sequence-classifier name, token-level logits
        def forward(self, input_ids=None, attention_mask=None, token_type_ids=None, labels=None, **kw):
            out = super().forward(input_ids=input_ids, attention_mask=attention_mask, token_type_ids=token_type_ids)
            out["logits"] = out.logits[:, None, :].expand(-1, input_ids.shape[1], -1)
            return out

    from helpers import tiny_config

    torch.manual_seed(0)
    tr, steps = _trainer(tmp_path, tok, data, model=PerToken(tiny_config()))
    _refused_before_any_step(tr, steps, r"^the model returned logits of shape \(\d+, \d+, 2\) for labels of shape \(\d+,\): DPTrainer's per-example loss needs one row of logits per example")


# ---------------------------------------------------------------------------------------------------
# minor: arguments
# ---------------------------------------------------------------------------------------------------
def test_a_zero_batch_size_is_refused_in_one_line(tmp_path):
    with pytest.raises(ValueError, match=r"^--per_device_train_batch_size must be a whole number >= 1 under DP, got 0$"):
        dp_args(tmp_path, per_device_train_batch_size=0)


def test_an_epsilon_above_the_ceiling_is_refused_at_once(tmp_path):
    import time

    t = time.perf_counter()
    with pytest.raises(ValueError, match=r"^--epsilon 1e\+06 is above hf_dp's ceiling of 50"):
        dp_args(tmp_path, epsilon=1e6)
    assert time.perf_counter() - t < 30  # not a timing claim: the old behaviour ran for minutes


# ---------------------------------------------------------------------------------------------------
# 4. ranks holding the data in different orders (2 gloo processes)
# ---------------------------------------------------------------------------------------------------
RANK_CASES = ("order", "clip", "same")  # refused, refused, then a run that trains (in the same two processes)
RANK_WORKER = r"""
    import json
    from hf_dp import DPTrainer
    from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer, StepCounter

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    results = {{}}
    for case in {cases!r}:
        data = make_pair_dataset(tok, n=64)
        if case == "order":
            data = data.shuffle(seed=rank)  # an unseeded shuffle in each process: a different order per rank
        clip = 3.0 if case == "clip" and rank == 1 else 1.0
        args = dp_args(os.path.join(out, case), noise_multiplier=1.0, epsilon=None, max_steps=2,
                       per_device_train_batch_size=4, trainable="all", per_sample_max_grad_norm=clip)
        tr = DPTrainer(model=make_model(), args=args, train_dataset=data, data_collator=make_collator(tok))
        steps = StepCounter()
        tr.add_callback(steps)
        try:
            tr.train()
            result = "trained"
        except ValueError as e:
            result = str(e)
        results[case] = {{"result": result, "steps": steps.optimizer_steps}}
    with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
        json.dump(results, f)
    import torch.distributed as dist
    if dist.is_initialized():  # leave the gloo group cleanly (an exit with it alive can abort: "terminate called ...")
        dist.barrier()
        dist.destroy_process_group()
    """


@pytest.fixture(scope="module")
def rank_cases(tmp_path_factory):
    """One 2-process launch runs every case of RANK_CASES, one after another: {case: [rank 0's, rank 1's result]}."""
    import json

    from two_process import gloo_available, launch

    if not gloo_available():
        pytest.skip("gloo not available")
    base = tmp_path_factory.mktemp("rank_cases")
    launch(base, RANK_WORKER.format(cases=RANK_CASES))
    ranks = [json.loads((base / f"rank{r}.json").read_text()) for r in (0, 1)]
    return {case: [r[case] for r in ranks] for case in RANK_CASES}


@pytest.mark.distributed
@pytest.mark.parametrize("case", RANK_CASES)
def test_ranks_holding_other_data_orders_or_settings_are_refused(rank_cases, case):
    results = rank_cases[case]
    if case == "same":
        assert [r["result"] for r in results] == ["trained", "trained"]
        return
    want = {"order": "the processes hold different training data or the same data in different orders",
            "clip": "the processes plan different privacy mechanisms"}[case]
    for r in results:
        assert r["result"].startswith(want), r["result"]
        assert r["steps"] == 0


# ---------------------------------------------------------------------------------------------------
# review findings: the paths around the checks
# ---------------------------------------------------------------------------------------------------
def test_an_optimizer_replaced_after_create_optimizer_is_refused(tmp_path, tok, data):
    """Before: training ran on raw gradients and the release said 'DP, epsilon 0'."""
    tr, steps = _trainer(tmp_path, tok, data)
    tr.create_optimizer()
    tr.optimizer = torch.optim.AdamW(tr.model.parameters(), lr=1e-3)
    _refused_before_any_step(tr, steps, r"^the optimizer is not DPTrainer's privatizer \(trainer\.optimizer was replaced by AdamW")


def test_a_privatizer_whose_noise_was_changed_is_refused(tmp_path, tok, data):
    tr, steps = _trainer(tmp_path, tok, data)
    tr.create_optimizer().noise_multiplier = 1e-3
    _refused_before_any_step(tr, steps, r"^the privatizer's settings were changed after it was built \(noise_multiplier: planned 1\.0, now 0\.001\)")


def test_a_training_set_of_the_same_size_replaced_after_init_is_refused(tmp_path, tok, data):
    tr, steps = _trainer(tmp_path, tok, data)
    tr.train_dataset = data.shuffle(seed=3)
    _refused_before_any_step(tr, steps, r"^train_dataset was replaced after the DPTrainer was built")


@pytest.mark.parametrize("flag,value", [("neftune_noise_alpha", 5.0), ("gradient_checkpointing", True)])
def test_hf_flags_refused_under_dp_are_refused_when_set_after_construction(tmp_path, tok, data, flag, value):
    tr, steps = _trainer(tmp_path, tok, data)
    setattr(tr.args, flag, value)
    _refused_before_any_step(tr, steps, rf"^--{flag.split('_noise')[0]}\w* .*is not supported with DP")


class NoMask(DataCollatorWithPadding):
    """Drops the attention mask: every row then attends to the batch's padding, set by the longest drawn example."""

    def __call__(self, features):
        batch = super().__call__(features)
        batch.pop("attention_mask")
        return batch


def test_rows_that_see_the_batch_padding_are_refused(tmp_path, tok, data):
    """Before (review): the probe never changed the padded length, so a missing mask passed (3.3·C measured)."""
    tr, steps = _trainer(tmp_path, tok, data, collator=NoMask(tok))
    _refused_before_any_step(tr, steps, r"^the per-example contract does not hold: lengthening one example of a probe micro-batch changed the other examples' outputs")


class SplitsOneRow(DataCollatorWithPadding):
    """Two rows for one particular (long) example only: a refusal at the step that draws it would reveal its presence."""

    def __call__(self, features):
        features = list(features)
        extra = [f for f in features if len(f["input_ids"]) >= 14]
        return super().__call__(features + extra[:1])


def test_a_collator_that_breaks_the_contract_for_one_row_is_refused_before_any_step(tmp_path, tok, data):
    long_rows = [i for i in range(len(data)) if len(data[i]["input_ids"]) >= 14]
    assert long_rows and min(long_rows) >= 0
    tr, steps = _trainer(tmp_path, tok, data, collator=SplitsOneRow(tok), max_steps=20)
    _refused_before_any_step(tr, steps, "one row per example")
