"""Causal language models and privacy units through DPTrainer (issue 29).

On c4278d0 every causal LM was refused by the head check (before that, on ff55d8f, trained silently on the
sequence-classifier loss) and there was no privacy unit: each test here fails there. What is checked:

* DPTrainer's per-sequence loss is the model's own loss on a one-sequence batch, right- or left-padded;
* a left-padded row gets the same loss as the same row unpadded (positions from the attention mask);
* unit-level sensitivity through ``DPTrainer.training_step``: removing one unit (of 1–3 rows of very different
  lengths) moves the clipped sum by at most C, for every engine and both padding sides;
* the accountant's N is the number of units, q = B/N_units; the sampler puts a unit's rows in one micro-batch;
* a missing or empty unit column is refused in one sentence before any work; privacy.json and the card name the unit.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
from datasets import Dataset
from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_dp import DPTrainer
from hf_dp.models.loss import per_example_loss

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from helpers import dp_args, drawn, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

ENGINES = ["ghost", "ghost_two_pass", "hooks"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def gpt2(tok, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id,
                     eos_token_id=tok.sep_token_id)
    return GPT2LMHeadModel(cfg).to(dtype)


def llama(tok, seed=0):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id, eos_token_id=tok.sep_token_id)
    return LlamaForCausalLM(cfg)


def lm_data(tok, n=48, users=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = []
    for i in range(n):
        length = int(torch.randint(3, 30, (1,), generator=g))
        ids = [tok.cls_token_id] + torch.randint(5, len(tok), (length,), generator=g).tolist() + [tok.sep_token_id]
        rows.append(ids)
    d = {"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}
    if users is not None:
        d["user_id"] = [users(i) for i in range(n)]
    return Dataset.from_dict(d)


def collator(tok, side="right"):
    tok.padding_side = side
    return DataCollatorForLanguageModeling(tok, mlm=False)


def make(tmp_path, tok, model, data, side="right", **over):
    kw = dict(noise_multiplier=1.0, epsilon=None, max_steps=2, trainable="all", per_device_train_batch_size=8)
    kw.update(over)
    return DPTrainer(model=model, args=dp_args(tmp_path / "out", **kw), train_dataset=data, data_collator=collator(tok, side))


# ---------------------------------------------------------------------------------------------------
# the objective
# ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("factory", [gpt2, llama])
def test_the_per_sequence_loss_is_the_models_own_loss_on_one_sequence(tmp_path, tok, side, factory):
    data = lm_data(tok)
    tr = make(tmp_path, tok, factory(tok), data, side=side, clipping="hooks")
    assert tr.objective.name == "causal_lm"
    model = tr.model
    model.eval()  # no dropout; compute_loss's DP path needs training mode: take the objective it calls directly
    for i in (0, 5):
        batch = collator(tok, side)([{"input_ids": data[i]["input_ids"]}])
        own = model(**batch).loss
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ours = per_example_loss(logits, batch["labels"], model.config, tr.objective, batch["attention_mask"])
        torch.testing.assert_close(ours, own.reshape(1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("factory", [gpt2, llama])
def test_a_left_padded_row_gets_the_loss_of_the_same_row_unpadded(tmp_path, tok, factory):
    """DPTrainer's compute_loss passes positions from the attention mask: a left-padded row's loss does not depend on
    how long the other rows of its micro-batch are (without them GPT-2's absolute positions would shift)."""
    data = lm_data(tok)
    tr = make(tmp_path, tok, factory(tok), data, side="left", clipping="hooks")
    tr.model.train()
    tr.dp.contract.probe = True  # compute_loss without the engine
    short, long_ = {"input_ids": data[0]["input_ids"][:5]}, {"input_ids": data[1]["input_ids"] + [7] * 20}
    alone = tr.compute_loss(tr.model, tr._prepare_inputs(dict(collator(tok, "left")([short]))))
    both = tr.compute_loss(tr.model, tr._prepare_inputs(dict(collator(tok, "left")([short, long_]))))
    b = tr.privacy_spec.expected_batch_size
    # the returned loss is Σ_i ℓ_i / B: the pair's minus the long row's own
    long_alone = tr.compute_loss(tr.model, tr._prepare_inputs(dict(collator(tok, "left")([long_]))))
    torch.testing.assert_close((both - long_alone) * b, alone * b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("side", ["right", "left"])
def test_token_weighting_divides_each_sequences_token_sum_by_the_public_length(tmp_path, tok, side):
    """--lm_loss_weighting token: each sequence's loss is its token sum over --dp_max_length (so a short sequence
    weighs less, every token the same, as the model's own loss over a batch), never over a count of the micro-batch:
    a row's loss does not depend on the rows beside it."""
    data = lm_data(tok)
    tr = make(tmp_path, tok, gpt2(tok), data, side=side, clipping="hooks", lm_loss_weighting="token", dp_max_length=48)
    assert tr.dp.loss_token_norm == 48
    model = tr.model
    model.eval()
    for i in (0, 5):
        batch = collator(tok, side)([{"input_ids": data[i]["input_ids"]}])
        scored = int((batch["labels"][:, 1:] != -100).sum())
        own_sum = model(**batch).loss * scored  # the model's own mean times the scored tokens
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        ours = per_example_loss(logits, batch["labels"], model.config, tr.objective, batch["attention_mask"],
                                token_norm=tr.dp.loss_token_norm)
        torch.testing.assert_close(ours, own_sum.reshape(1) / 48, rtol=1e-6, atol=1e-6)
    tr.model.train()
    tr.dp.contract.probe = True  # compute_loss without the engine
    short, long_ = {"input_ids": data[0]["input_ids"][:5]}, {"input_ids": data[1]["input_ids"] + [7] * 20}
    loss = lambda rows: tr.compute_loss(tr.model, tr._prepare_inputs(dict(collator(tok, side)(rows))))  # noqa: E731
    torch.testing.assert_close(loss([short, long_]) - loss([long_]), loss([short]), rtol=1e-5, atol=1e-6)


def test_token_weighting_is_refused_where_it_would_mean_nothing(tmp_path, tok):
    from transformers import BertConfig, BertForSequenceClassification

    from hf_dp.dpo import DPDPOConfig
    from hf_dp.sft import DPSFTConfig

    cls = BertForSequenceClassification(BertConfig(vocab_size=len(tok), hidden_size=16, num_hidden_layers=1,
                                                   num_attention_heads=2, intermediate_size=32))
    rows = Dataset.from_dict({"input_ids": [[2, 5, 3]] * 32, "attention_mask": [[1, 1, 1]] * 32, "labels": [0, 1] * 16})
    with pytest.raises(ValueError, match="one label per example"):
        DPTrainer(model=cls, args=dp_args(tmp_path / "c", noise_multiplier=1.0, epsilon=None, max_steps=1,
                                          trainable="all", lm_loss_weighting="token"), train_dataset=rows)
    for config in (DPSFTConfig, DPDPOConfig):
        with pytest.raises(ValueError, match="lm_loss_weighting token is DPTrainer's causal-LM loss"):
            config(output_dir=str(tmp_path / "x"), epsilon=3.0, use_cpu=True, lm_loss_weighting="token")
    with pytest.raises(ValueError, match="sequence or token"):
        dp_args(tmp_path / "d", lm_loss_weighting="tokens")


def test_the_weighting_is_recorded_fixed_at_construction_and_kept_across_a_resume(tmp_path, tok):
    """Review of --lm_loss_weighting: the release says which loss trained it; a change after the trainer is built, a
    resume under the other weighting (recipes/clm.py's default changed) and a mutated SFT / DPO / reward config are
    refused."""
    from hf_dp.dpo.config import enforce_dpo, enforce_reward
    from hf_dp.sft.config import enforce_sft

    data = lm_data(tok)
    out = tmp_path / "out"  # make()'s output_dir
    first = make(tmp_path, tok, gpt2(tok), data, clipping="hooks", lm_loss_weighting="token", dp_max_length=40,
                 save_strategy="steps", save_steps=2)
    first.train()
    report = first.privacy_report()
    assert report["lm_loss_weighting"] == {"weighting": "token", "token_norm": 40}
    other = make(tmp_path / "b", tok, gpt2(tok), data, clipping="hooks", max_steps=4, dp_max_length=40)
    with pytest.raises(ValueError, match="trained with --lm_loss_weighting token and this run asks for sequence"):
        other.train(resume_from_checkpoint=str(out / "checkpoint-2"))
    changed = make(tmp_path / "c", tok, gpt2(tok), data, clipping="hooks")
    changed.args.lm_loss_weighting = "token"
    with pytest.raises(ValueError, match="lm_loss_weighting"):
        changed.train()
    args = dp_args(tmp_path / "x", lm_loss_weighting="sequence")
    args.lm_loss_weighting = "token"  # set after the config was built: the trainers run these checks again
    for enforce in (enforce_sft, enforce_dpo, enforce_reward):
        with pytest.raises(ValueError, match="lm_loss_weighting token is DPTrainer's causal-LM loss"):
            enforce(args)


# ---------------------------------------------------------------------------------------------------
# unit-level sensitivity through DPTrainer
# ---------------------------------------------------------------------------------------------------
def _clipped_sum(tr, rows, units):
    """The clipped sum DPTrainer's engine hands the privatizer for one micro-batch of ``rows`` (token-id lists)
    whose privacy units are ``units`` (one id per row)."""
    opt = tr.create_optimizer()
    opt.discard_pending()
    ids = {u: j for j, u in enumerate(dict.fromkeys(units))}
    batch = collator(tok_of(tr))([{"input_ids": r} for r in rows])
    batch["_hf_dp_units"] = torch.tensor([ids[u] for u in units])
    tr.model.train()
    tr.training_step(tr.model, drawn(tr, batch))
    out = torch.cat([p.summed_grad.reshape(-1).double() for p in opt.params])
    opt.discard_pending()
    return out


def tok_of(tr):
    return tr.data_collator.tokenizer


@pytest.mark.parametrize("weighting", ["sequence", "token"])
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("engine", ENGINES)
def test_removing_one_unit_moves_the_clipped_sum_by_at_most_c(tmp_path, tok, engine, side, weighting):
    data = lm_data(tok, users=lambda i: i // 3)
    c = 0.01  # every unit's gradient is clipped
    tr = make(tmp_path, tok, gpt2(tok), data, side=side, clipping=engine, per_sample_max_grad_norm=c,
              privacy_unit_column="user_id", lm_loss_weighting=weighting)
    assert tr.clipping == ("hooks" if engine == "hooks" else engine) or engine != "hooks"
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(5, len(tok), (n,), generator=g).tolist() for n in (3, 40, 7, 2, 25, 12)]
    units = ["a", "b", "b", "c", "c", "c"]  # units of 1, 2 and 3 rows of very different lengths
    full = _clipped_sum(tr, rows, units)
    assert full.norm() <= 3 * c * (1 + 1e-5)
    for gone in ("a", "b", "c"):
        keep = [i for i, u in enumerate(units) if u != gone]
        rest = _clipped_sum(tr, [rows[i] for i in keep], [units[i] for i in keep])
        diff = float((full - rest).norm())
        assert diff <= c * (1 + 1e-4), (gone, diff)
        assert diff >= 0.9 * c, (gone, diff)  # a unit's whole (clipped) gradient, not each row's: C, not k·C
    # a unit's rows are clipped together: two rows of one unit contribute C, as two units they would contribute 2C
    two_units = _clipped_sum(tr, rows[1:3], ["b", "x"])
    one_unit = _clipped_sum(tr, rows[1:3], ["b", "b"])
    assert float(one_unit.norm()) <= c * (1 + 1e-4) < float(two_units.norm())


@pytest.mark.parametrize("engine", ENGINES)
def test_token_weighting_under_many_copies_of_a_short_row_and_one_long_row(tmp_path, tok, engine):
    """The batch an attacker would pick: 24 copies of a 2-token row beside one row of the bound's length. Adding or
    removing the long row moves the clipped sum by at most C, and each copy's contribution is what it is alone."""
    data = lm_data(tok, users=lambda i: i)
    c = 0.01
    tr = make(tmp_path, tok, gpt2(tok), data, clipping=engine, per_sample_max_grad_norm=c, privacy_unit_column="user_id",
              lm_loss_weighting="token", dp_max_length=48)
    short, long_ = [7, 9], list(torch.randint(5, len(tok), (48,), generator=torch.Generator().manual_seed(3)).tolist())
    crowd = [short] * 24
    with_long = _clipped_sum(tr, crowd + [long_], [f"u{i}" for i in range(25)])
    without = _clipped_sum(tr, crowd, [f"u{i}" for i in range(24)])
    assert float((with_long - without).norm()) <= c * (1 + 1e-4)
    alone = _clipped_sum(tr, [short], ["u0"])
    torch.testing.assert_close(without, 24 * alone, rtol=1e-4, atol=1e-7)


# ---------------------------------------------------------------------------------------------------
# sampling and accounting over units
# ---------------------------------------------------------------------------------------------------
def test_the_accountant_counts_units_and_each_unit_is_one_draw(tmp_path, tok):
    data = lm_data(tok, n=60, users=lambda i: f"user{i % 12}")
    tr = make(tmp_path, tok, gpt2(tok), data, clipping="hooks", privacy_unit_column="user_id",
              per_device_train_batch_size=3, gradient_accumulation_steps=2)
    spec = tr.privacy_spec
    assert spec.dataset_size == 12
    assert spec.sample_rate == pytest.approx(6 / 12)
    loader = tr.get_train_dataloader()
    users = data["user_id"]
    seen = 0
    for step, micro in enumerate(loader):
        got = micro["_hf_dp_units"]
        assert micro["input_ids"].shape[0] == got.shape[0]
        seen += 1
        if seen >= 8:
            break
    # every draw: whole units, each unit in one micro-batch
    sampler = tr.dp.sampler
    for _ in range(4):
        it = iter(sampler)  # a new stream each time
        chunks = [next(it) for _ in range(2)]
        owners = [{users[r] for r in chunk} for chunk in chunks]
        assert not (owners[0] & owners[1])
        for chunk, own in zip(chunks, owners):
            for u in own:
                assert sorted(r for r in chunk if users[r] == u) == [r for r in range(60) if users[r] == u]


def test_max_rows_per_unit_caps_the_rows_of_a_drawn_unit(tmp_path, tok):
    data = lm_data(tok, n=40, users=lambda i: 0 if i < 30 else i)
    tr = make(tmp_path, tok, gpt2(tok), data, clipping="hooks", privacy_unit_column="user_id", max_rows_per_unit=4,
              per_device_train_batch_size=4)
    users = data["user_id"]
    drawn_big = set()
    it = iter(tr.dp.sampler)
    for _ in range(tr.dp.sampler.steps_per_epoch):
        chunk = next(it)
        big = [r for r in chunk if users[r] == 0]
        assert len(big) <= 4
        drawn_big.update(big)
    assert tr.privacy_spec.dataset_size == 11


@pytest.mark.parametrize("column,match", [
    ("author", r"^--privacy_unit_column author: the training set has no column 'author' \(it has \["),
    ("user_id", r"^--privacy_unit_column user_id: training row 3 \(counting from 0\) has no unit"),
])
def test_a_missing_or_empty_unit_column_is_refused_in_one_sentence(tmp_path, tok, column, match):
    data = lm_data(tok, users=lambda i: None if i == 3 else f"u{i}")
    with pytest.raises(ValueError, match=match):
        make(tmp_path, tok, gpt2(tok), data, clipping="hooks", privacy_unit_column=column)


def test_a_unit_level_run_trains_and_its_release_names_the_unit(tmp_path, tok):
    data = lm_data(tok, n=48, users=lambda i: f"u{i // 4}")
    tr = make(tmp_path, tok, gpt2(tok), data, privacy_unit_column="user_id", epsilon=3.0, noise_multiplier=None,
              max_steps=3)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    assert tr.state.global_step == 3
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters())
    out = tmp_path / "release"
    tr.save_model(str(out))
    report = json.loads((out / "privacy.json").read_text())
    assert report["objective"] == "causal_lm"
    assert report["dataset_size"] == 12
    unit = report["privacy_unit"]
    assert unit["column"] == "user_id" and unit["num_units"] == 12 and unit["level"] == "unit"
    assert "num_rows" not in unit  # the row count is a statistic of the private data (blocks per unit)
    card = (out / "README.md").read_text()
    assert "Unit-level (ε, δ)-DP, unit = `user_id`, N = 12 units" in card and "user-level DP when one value is one person" in card
    assert "pipeline_tag: text-generation" in card
    loaded = GPT2LMHeadModel.from_pretrained(str(out))
    assert loaded.config.vocab_size == len(tok)


# ---------------------------------------------------------------------------------------------------
# a collator that cuts each example into several rows (issue 29: the same mechanism serves it)
# ---------------------------------------------------------------------------------------------------
class Blocks(DataCollatorForLanguageModeling):
    """Cuts each example into consecutive blocks of at most 8 tokens: several rows per example, each its own."""

    def __call__(self, features):
        rows = []
        for f in features:
            ids = f["input_ids"]
            rows += [{"input_ids": ids[i:i + 8]} for i in range(0, len(ids), 8)]
        return super().__call__(rows)


class BlocksAfterTheBatch(DataCollatorForLanguageModeling):
    """Its second blocks come after every example's first: rows of one example are not consecutive (refused)."""

    def __call__(self, features):
        first = [{"input_ids": f["input_ids"][:8]} for f in features]
        rest = [{"input_ids": f["input_ids"][8:16]} for f in features if len(f["input_ids"]) > 8]
        return super().__call__(first + rest)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_collator_that_cuts_examples_into_blocks_is_served_with_each_example_clipped_once(tmp_path, tok, engine):
    data = lm_data(tok)
    tok.padding_side = "right"
    c = 0.01
    tr = DPTrainer(model=gpt2(tok), args=dp_args(tmp_path / "out", noise_multiplier=1.0, epsilon=None, max_steps=2,
                                                  trainable="all", clipping=engine, per_sample_max_grad_norm=c,
                                                  per_device_train_batch_size=8),
                   train_dataset=data, data_collator=Blocks(tok, mlm=False))
    loader = tr.get_train_dataloader()
    long_rows = [i for i in range(len(data)) if len(data[i]["input_ids"]) > 16][:3]
    batch = loader.collate_fn([loader.dataset[i] for i in long_rows])
    assert batch["input_ids"].shape[0] >= 3 * 3 and batch["_hf_dp_units"].tolist() == sorted(batch["_hf_dp_units"].tolist())
    opt = tr.create_optimizer()
    tr.model.train()

    def clipped(b):
        opt.discard_pending()
        tr.training_step(tr.model, drawn(tr, b))
        out = torch.cat([p.summed_grad.reshape(-1).double() for p in opt.params])
        opt.discard_pending()
        return out

    full = clipped(batch)
    rest = clipped(loader.collate_fn([loader.dataset[i] for i in long_rows[:-1]]))
    diff = float((full - rest).norm())
    assert 0.9 * c <= diff <= c * (1 + 1e-4)  # one example of 3+ blocks moves the sum by C, not 3·C
    tr.train()
    assert tr.state.global_step == 2


def test_a_collator_whose_rows_of_one_example_are_not_consecutive_is_refused_before_any_step(tmp_path, tok):
    data = lm_data(tok)
    tr = DPTrainer(model=gpt2(tok), args=dp_args(tmp_path / "out", noise_multiplier=1.0, epsilon=None, max_steps=2,
                                                  trainable="all", clipping="hooks"),
                   train_dataset=data, data_collator=BlocksAfterTheBatch(tok, mlm=False))
    with pytest.raises(ValueError, match=r"^the data collator returned '\w+' with \d+ rows for \d+ drawn example\(s\)"):
        tr.train()
    assert tr.state.global_step == 0


def test_token_ids_outside_the_vocabulary_are_refused_before_training(tmp_path, tok):
    data = lm_data(tok)
    ids = list(data["input_ids"])
    ids[11] = ids[11][:2] + [len(tok) + 3] + ids[11][2:]
    bad = data.remove_columns("input_ids").add_column("input_ids", ids)
    with pytest.raises(ValueError, match=rf"^training row 11 \(counting from 0\) has token id {len(tok) + 3}, outside the model's vocabulary"):
        make(tmp_path, tok, gpt2(tok), bad, clipping="hooks")


@pytest.mark.parametrize("side", ["right", "left"])
def test_the_probe_passes_a_causal_lm_whose_rows_have_many_lengths(tmp_path, tok, side):
    """The probe's lengthened batch pads the other rows to a new length: their per-token outputs are compared on the
    same tokens (a false refusal of every causal LM with varied row lengths before; found by the recipe's tests)."""
    from hf_dp.run import independence

    data = lm_data(tok, n=16)
    data = data.select(sorted(range(16), key=lambda i: len(data[i]["input_ids"])))  # the lengthened variant exists
    tr = make(tmp_path, tok, gpt2(tok), data, side=side, clipping="hooks")
    loader = tr.get_train_dataloader()
    assert independence.probe_independence(loader.dataset, loader.collate_fn, tr.model, tr.dp, compute_loss=tr.compute_loss,
                                           prepare_inputs=tr._prepare_inputs) == "passed"


class Peek(DPTrainer):
    """A coupling loss for a causal LM: each row's loss grows with the batch's longest row."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        return loss * (1 + 0.01 * inputs["input_ids"].shape[1]) if not return_outputs else loss


@pytest.mark.parametrize("order", ["shortest_first", "longest_first"])
def test_the_probe_still_refuses_a_causal_lm_loss_that_couples_rows(tmp_path, tok, order):
    """Longest rows first: no candidate is longer than the probe's rows, so the probe makes a longer row itself (before
    the review, a coupling through the padded length then passed)."""
    data = lm_data(tok, n=16)
    data = data.select(sorted(range(16), key=lambda i: len(data[i]["input_ids"]) * (1 if order == "shortest_first" else -1)))
    tr = Peek(model=gpt2(tok), args=dp_args(tmp_path / "out", noise_multiplier=1.0, epsilon=None, max_steps=2,
                                            trainable="all", clipping="hooks"),
              train_dataset=data, data_collator=collator(tok))
    with pytest.raises(ValueError, match="^the per-example contract does not hold"):
        tr.train()


# ---------------------------------------------------------------------------------------------------
# the adversarial review of issue 29 (each failed on the first version of this work, commit 1b99b10)
# ---------------------------------------------------------------------------------------------------
class CopyLabels:
    """A common hand-written collator: pad, then labels = input_ids (padding not masked in the labels)."""

    def __init__(self, tok):
        self.tok = tok

    def __call__(self, features):
        batch = self.tok.pad([{"input_ids": f["input_ids"]} for f in features], return_tensors="pt")
        batch["labels"] = batch["input_ids"].clone()
        return dict(batch)


@pytest.mark.parametrize("engine", ENGINES)
def test_a_padding_target_is_not_scored(tmp_path, tok, engine):
    """With labels that score the padding, a short row's last token predicted a pad token only when a longer row
    padded it: removing one long row moved the clipped sum by 18.9 C (review finding 1)."""
    tok.padding_side = "right"
    c = 0.01
    g = torch.Generator().manual_seed(3)
    rows = [[tok.cls_token_id] + torch.randint(5, len(tok), (1,), generator=g).tolist() for _ in range(15)]
    long_row = [tok.cls_token_id] + torch.randint(5, len(tok), (40,), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": rows + [long_row]})
    tr = DPTrainer(model=gpt2(tok), args=dp_args(tmp_path / "o", noise_multiplier=1.0, epsilon=None, max_steps=1,
                                                  trainable="all", clipping=engine, per_sample_max_grad_norm=c),
                   train_dataset=data, data_collator=CopyLabels(tok))
    opt = tr.create_optimizer()
    tr.model.train()

    def clipped(feats):
        opt.discard_pending()
        tr.training_step(tr.model, drawn(tr, CopyLabels(tok)([{"input_ids": f} for f in feats])))
        out = torch.cat([p.summed_grad.reshape(-1).double() for p in opt.params])
        opt.discard_pending()
        return out

    diff = float((clipped(rows + [long_row]) - clipped(rows)).norm())
    assert diff <= c * (1 + 1e-4), diff / c


class SmugglingBlocks(DataCollatorForLanguageModeling):
    """Blocks of 8 tokens; pads example i's rows with a token of example i-1, unmasked and scored (review finding 4)."""

    def __call__(self, features):
        singles = [super(SmugglingBlocks, self).__call__(
            [{"input_ids": f["input_ids"][i:i + 8]} for i in range(0, len(f["input_ids"]), 8)]) for f in features]
        width = max(s["input_ids"].shape[1] for s in singles)
        out = {k: [] for k in ("input_ids", "attention_mask", "labels")}
        for i, s in enumerate(singles):
            secret = features[i - 1]["input_ids"][1] if i > 0 else 0
            extra = width - s["input_ids"].shape[1]
            for k in out:
                fill = {"input_ids": secret, "attention_mask": int(i > 0), "labels": secret if i > 0 else -100}[k]
                out[k].append(torch.cat([s[k], torch.full((s[k].shape[0], extra), fill, dtype=s[k].dtype)], 1))
        return {k: torch.cat(v) for k, v in out.items()}


def test_rows_padded_with_another_examples_data_are_refused(tmp_path, tok):
    tok.padding_side = "right"
    g = torch.Generator().manual_seed(5)
    rows = [[tok.cls_token_id] + torch.randint(5, len(tok), (n,), generator=g).tolist() for n in [30] + [3] * 15]
    tr = DPTrainer(model=gpt2(tok), args=dp_args(tmp_path / "o", noise_multiplier=1.0, epsilon=None, max_steps=2,
                                                  trainable="all", clipping="ghost"),
                   train_dataset=Dataset.from_dict({"input_ids": rows}), data_collator=SmugglingBlocks(tok, mlm=False))
    loader = tr.get_train_dataloader()
    with pytest.raises(ValueError, match=r"^the data collator (returned 'input_ids' with 5 rows for 2|'s rows are not what it makes of each)"):
        loader.collate_fn([loader.dataset[i] for i in (0, 1)])


class DropsEmptyBlocks(DataCollatorForLanguageModeling):
    """Blocks of 8 tokens, dropping a block with nothing to predict: an example of 1 token makes no row, one of 16 makes
    two — so two drawn examples can give two rows (review finding 3)."""

    def __call__(self, features):
        rows = [{"input_ids": f["input_ids"][i:i + 8]} for f in features for i in range(0, len(f["input_ids"]), 8)]
        rows = [r for r in rows if len(r["input_ids"]) > 1]
        if not rows:
            return {k: torch.zeros((0, 1), dtype=torch.long) for k in ("input_ids", "attention_mask", "labels")}
        return super().__call__(rows)


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_an_example_whose_rows_happen_to_number_the_examples_is_still_clipped_once(tmp_path, tok, engine):
    tok.padding_side = "right"
    c = 0.01
    g = torch.Generator().manual_seed(1)
    a = [tok.cls_token_id] + torch.randint(5, len(tok), (15,), generator=g).tolist()  # 2 blocks
    b = [tok.cls_token_id]  # no block
    others = [[tok.cls_token_id] + torch.randint(5, len(tok), (5,), generator=g).tolist() for _ in range(30)]
    tr = DPTrainer(model=gpt2(tok), args=dp_args(tmp_path / "o", noise_multiplier=1.0, epsilon=None, max_steps=1,
                                                  trainable="all", clipping=engine, per_sample_max_grad_norm=c),
                   train_dataset=Dataset.from_dict({"input_ids": [a, b] + others}),
                   data_collator=DropsEmptyBlocks(tok, mlm=False))
    tr._check_contract()  # what train() runs first: it sees A make two rows, so every micro-batch is attributed
    loader = tr.get_train_dataloader()
    batch = loader.collate_fn([loader.dataset[i] for i in (0, 1)])
    assert batch["_hf_dp_units"].tolist() == [0, 0]
    opt = tr.create_optimizer()
    tr.model.train()
    opt.discard_pending()
    tr.training_step(tr.model, drawn(tr, batch))
    contribution = torch.cat([p.summed_grad.reshape(-1).double() for p in opt.params]).norm()
    assert float(contribution) <= c * (1 + 1e-4)  # 1.396 C before: A's two blocks were clipped as two examples
    opt.discard_pending()
    tr.training_step(tr.model, drawn(tr, loader.collate_fn([loader.dataset[i] for i in (1, 2)])))  # B makes no row: fine
    opt.discard_pending()


def test_a_collator_that_sets_dptrainers_own_keys_is_refused(tmp_path, tok):
    class Injects(DataCollatorForLanguageModeling):
        def __call__(self, features):
            batch = super().__call__(features)
            batch["_hf_dp_units"] = torch.zeros(batch["input_ids"].shape[0], dtype=torch.long)
            return batch

    tr = make(tmp_path, tok, gpt2(tok), lm_data(tok), clipping="hooks")
    tr.data_collator = Injects(tok, mlm=False)
    loader = tr.get_train_dataloader()
    with pytest.raises(ValueError, match="^the data collator returned the key '_hf_dp_units', which DPTrainer sets itself"):
        loader.collate_fn([loader.dataset[0], loader.dataset[1]])


def test_a_unit_value_that_is_not_a_single_value_is_refused(tmp_path, tok):
    data = lm_data(tok, users=lambda i: ["alice"] if i % 2 else ["alice", "bob"])
    with pytest.raises(ValueError, match=r"^--privacy_unit_column user_id: training row 0 \(counting from 0\) has the unit \['alice', 'bob'\], not a single value"):
        make(tmp_path, tok, gpt2(tok), data, clipping="hooks", privacy_unit_column="user_id")


def test_the_unit_column_never_reaches_the_users_collator(tmp_path, tok):
    data = lm_data(tok, n=24, users=lambda i: f"u{i // 3}")
    tr = make(tmp_path, tok, gpt2(tok), data, privacy_unit_column="user_id", remove_unused_columns=False, max_steps=2)
    tr.train()  # DataCollatorForLanguageModeling fails on a string column
    assert tr.state.global_step == 2


def test_runs_with_different_units_of_privacy_do_not_compose(tmp_path, tok):
    data = lm_data(tok, n=24, users=lambda i: f"u{i // 3}")
    model = gpt2(tok)
    first = make(tmp_path / "a", tok, model, data, max_steps=2)
    first.train()
    with pytest.raises(ValueError, match=r"^this model's earlier DP training \(run \w+: 2 noisy steps\) protected one row, this run protects unit = 'user_id'"):
        make(tmp_path / "b", tok, first.model, data, privacy_unit_column="user_id", prior_privacy="continue")


def test_a_trainable_embedding_with_a_forward_of_its_own_is_refused_in_one_sentence(tmp_path, tok):
    from transformers import OPTConfig, OPTForCausalLM

    torch.manual_seed(0)
    model = OPTForCausalLM(OPTConfig(vocab_size=len(tok), hidden_size=16, ffn_dim=32, num_hidden_layers=1,
                                     num_attention_heads=2, max_position_embeddings=64, word_embed_proj_dim=16))
    for engine in ENGINES:  # a TypeError inside train() before
        with pytest.raises(ValueError, match=r"^the trainable embedding model\.decoder\.embed_positions \(OPTLearnedPositionalEmbedding\)"):
            make(tmp_path / engine, tok, model, lm_data(tok), clipping=engine)
