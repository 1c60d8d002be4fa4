"""--audit_canaries m on a causal LM (hf_dp.audit.lm_canaries): black-box canaries are token sequences without a
label, one unit each (N = real + m whatever the draw, also under --privacy_unit_column), scored after training by minus
their mean per-token loss under the trained model (checked here against the loss recomputed with the saved model
itself), through the evaluation path without a metric; --audit_kind gradient works unchanged on a causal LM (a canary
row's model loss is 0 whatever the objective). Before issue 39 item 4 both were refused ("sequence classifiers only")."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from hf_dp.audit import canaries as hooks
from hf_dp.audit import lm_canaries

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one intra-op thread (tests/conftest.py)

N_REAL, LENGTH, VOCAB = 40, 8, 64


def _rows(units: bool = False):
    import datasets

    rng = np.random.default_rng(0)
    x = rng.integers(5, VOCAB, size=(N_REAL, LENGTH))
    cols = {"input_ids": x.tolist(), "attention_mask": np.ones_like(x).tolist()}
    if units:
        cols["user_id"] = [f"u{i % 10}" for i in range(N_REAL)]  # 10 users of 4 rows
    return datasets.Dataset.from_dict(cols)


class _Collator:
    """DataCollatorForLanguageModeling(mlm=False) without a tokenizer: labels = input_ids (all rows are full)."""

    def __call__(self, features):
        import torch

        ids = torch.tensor([f["input_ids"] for f in features])
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _trainer(tmp_path, kind="input", units=False, optim="dp_adam", **kw):
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_dp import DPTrainer, DPTrainingArguments

    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2, n_positions=32,
                                       bos_token_id=0, eos_token_id=0, pad_token_id=0))
    args = dict(output_dir=str(tmp_path), optim=optim, noise_multiplier=1.0, per_sample_max_grad_norm=1.0,
                learning_rate=1e-2, per_device_train_batch_size=16, max_steps=2, trainable="all", report_to=[],
                use_cpu=True, disable_tqdm=True, save_strategy="no", logging_strategy="no", delta=1e-5,
                audit_canaries=100, audit_canary_length=LENGTH, audit_kind=kind, dp_seed=0)
    if units:
        args["privacy_unit_column"] = "user_id"
    args.update(kw)
    return DPTrainer(model=model, args=DPTrainingArguments(**args), train_dataset=_rows(units),
                     data_collator=_Collator())


def _losses(model, ids) -> np.ndarray:
    """Each sequence's mean next-token cross-entropy, written out here (not lm_canaries' function)."""
    import torch

    model.eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor(ids)).logits.double()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    target = torch.tensor(ids)[:, 1:]
    return -logp.gather(-1, target.unsqueeze(-1)).squeeze(-1).mean(1).numpy()


def test_causal_lm_canaries_are_units_and_are_scored_by_their_loss(tmp_path, monkeypatch):
    tr = _trainer(tmp_path)
    state = tr.dp.audit
    assert isinstance(state.canaries, lm_canaries.TokenCanaries)
    bits = state.canaries.included
    assert tr.privacy_spec.dataset_size == N_REAL + 100  # every canary is a unit, whatever the draw
    assert len(tr.train_dataset) == N_REAL + int(bits.sum())
    assert set(tr.train_dataset.column_names) == {"input_ids", "attention_mask"}  # no label column: the collator's
    ids = [list(r) for r in state.canaries.input_ids]
    assert {len(r) for r in ids} == {LENGTH}  # no tokenizer given: no special tokens around them
    seen = {}
    real = hooks.lm_canary_scores

    def capture(predictions, m):
        seen["scores"] = real(predictions, m)
        return seen["scores"]

    monkeypatch.setattr(hooks, "lm_canary_scores", capture)
    tr.train()
    # minus the mean per-token loss under the trained model, recomputed directly from the canaries' tokens
    assert np.allclose(seen["scores"], -_losses(tr.model, ids), rtol=0, atol=1e-4)
    rec = tr.audit_record
    assert rec["kind"] == "black-box" and rec["canaries"] == 100 and rec["real_units"] == N_REAL
    assert rec["score"] == lm_canaries.TokenCanaries.score_name and "gaussian_dp" in rec
    assert tr.state.log_history == [] or not any("canary" in k for h in tr.state.log_history for k in h)
    with pytest.raises(ValueError, match="forgotten"):
        state.canaries.included  # noqa: B018 - the bits are dropped after the audit
    with pytest.raises(TypeError, match="pickled"):
        pickle.dumps(state.canaries)


def test_under_a_unit_column_each_canary_is_its_own_unit(tmp_path):
    tr = _trainer(tmp_path, units=True)
    state = tr.dp.audit
    bits = state.canaries.included
    assert tr.privacy_spec.dataset_size == 10 + 100 and tr.num_units == 110
    canary_units = tr.dp.units.rows[10:]
    assert [len(u) for u in canary_units] == bits.astype(int).tolist()
    assert all(u == [N_REAL + j] for j, u in enumerate(x for x in canary_units if x))
    tr.train()
    assert tr.audit_record["real_units"] == 10


def test_gradient_canaries_work_unchanged_on_a_causal_lm(tmp_path):
    tr = _trainer(tmp_path, kind="gradient")
    assert tr.privacy_spec.dataset_size == N_REAL + 100
    tr.train()
    rec = tr.audit_record
    assert rec["kind"] == "white-box" and rec["score"] == hooks.GRADIENT_SCORE and rec["canaries"] == 100
    assert tr.ledger.steps == 2


def test_a_token_canary_dataset_scores_every_token():
    c = lm_canaries.TokenCanaries.draw(3, vocab_size=50, length=4, seed=1, bits_seed=2)
    ds = c.dataset(score=True)
    assert ds.column_names == ["input_ids", "attention_mask", "labels"] and ds["labels"] == ds["input_ids"]
    assert c.dataset().column_names == ["input_ids", "attention_mask"]
    assert c.rows(["input_ids", "user_id"], which=[0], blank=("user_id",))["user_id"] == [None]


def test_without_noise_the_loss_scores_find_the_included_canaries(tmp_path):
    """A broken run (the privatizer's noise taken out; 40 steps of dp_adam at lr 1e-2 over 40 real rows and the
    canaries): the trained LM gives its included canaries a lower loss, so the guesses are right and ε̂ is far above 0
    (seen: 50 of 50 right, ε̂ 2.33 against a ceiling of 3.05; 20 of 20 right, ε̂ 1.34 and 47 of 50, ε̂ 1.47 when the
    clip factors' rounding allowance changed by 1e-3: how many guesses the audit dares varies from run to run) — the
    scores carry the membership signal."""
    from hf_dp.audit.trainer_path import noise_off

    tr = _trainer(tmp_path, max_steps=40, per_device_train_batch_size=64)
    tr.add_callback(noise_off(tr.dp))
    tr.train()
    rec = tr.audit_record
    assert rec["guesses"] >= 20 and rec["correct"] >= 0.9 * rec["guesses"] and rec["epsilon_lower_bound"] > 1.0, rec["summary"]


@pytest.mark.parametrize("kind", ["input", "gradient"])
def test_canary_rows_do_not_enter_the_logged_training_loss(tmp_path, monkeypatch, kind):
    """Issue 49 item 6: a causal-LM input canary's loss entered the logged training loss (13 % of it), while gradient
    canaries (model loss 0) were already left out. The loss each micro-batch reports (what HF sums into the logged
    `loss`) is the real rows' summed loss / (B / world size); the canaries are still trained on (input kind)."""
    import torch

    from hf_dp.run import step as trainer_module  # where DPTrainer.compute_loss computes each example's loss

    tr = _trainer(tmp_path, kind=kind, max_steps=3, logging_strategy="steps", logging_steps=1)
    canary_ids = {tuple(r) for r in tr.dp.audit.canaries.input_ids}
    real = trainer_module.per_example_loss
    seen, reported = [], []

    def recording(logits, labels, *a, **k):
        losses = real(logits, labels, *a, **k)
        seen.append((labels.detach().clone(), losses.detach().clone()))
        return losses

    monkeypatch.setattr(trainer_module, "per_example_loss", recording)
    step = type(tr).training_step

    def training_step(self, *a, **k):
        n = len(seen)
        loss = step(self, *a, **k)
        reported.append((seen[n:], float(loss)))
        return loss

    monkeypatch.setattr(type(tr), "training_step", training_step)
    tr.train()
    b = tr.privacy_spec.expected_batch_size
    canary_rows = 0
    for batches, value in reported:
        want = 0.0
        for labels, losses in batches:
            is_canary = torch.tensor([tuple(r) in canary_ids for r in labels.tolist()])
            canary_rows += int(is_canary.sum())
            want += float(losses[~is_canary].sum())
        assert value == pytest.approx(want / b, rel=1e-5, abs=1e-7)
    assert canary_rows > 0  # the draws held canaries (the seeded run: q ≈ 0.11 of ~50 included ones per step)
    logged = [h["loss"] for h in tr.state.log_history if "loss" in h]
    assert len(logged) == 3 and logged == pytest.approx([v for _, v in reported], rel=1e-3)
