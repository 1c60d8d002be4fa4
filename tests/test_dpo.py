"""DP preference tuning (issue 51): DPDPOTrainer and DPRewardTrainer, one preference pair = one example.

A tiny random Llama (2 layers, width 16) from a config, the 60-word WordPiece tokenizer of tests/helpers.py, synthetic
prompt/chosen/rejected pairs. What is checked:

* every loss type of the installed TRL has a verdict, every DPOConfig / RewardConfig flag is classified, and the tables
  of docs/dpo.md are current;
* each pair's loss is TRL's own per-pair loss (value and gradient, every allowed loss type, f-divergences, LD-DPO, WPO
  weighting): TRL's ``_compute_loss`` on the pair alone is the reference;
* DPTrainer's clipped sum (its own ``training_step``, noise left out) is Σ over pairs (users) of clip_C of the autograd
  gradient of TRL's per-pair loss, and adding/removing one pair (one user's pairs) moves it by ≤ C, replacing by ≤ 2C,
  under ghost, ghost_two_pass and hooks clipping — and likewise for the reward model;
* a changed prompt token changes no scored label, and no scored log-probability is one of a prompt token;
* the reference model's log-probabilities are in no file the run writes, nor in its logs; TRL's warning that quotes a
  prompt neither; a pair over the token bound and a ``ref_model`` whose DP training the ledger does not count are
  refused at construction, and what is accepted beside them (every other refusal of hf_dp.dpo, each with its row of
  docs/misuse.md: tests/test_dpo_refusals.py);
* a DP DPO run (LoRA, user level) and a DP reward-model run train, evaluate and release ε ≤ the target.
"""

from __future__ import annotations

import copy
import inspect
import io
import json
import logging
import math
import os
import random
import re
import struct
import sys

import pytest
import torch

pytest.importorskip("trl")

from datasets import Dataset  # noqa: E402
from transformers import LlamaForSequenceClassification  # noqa: E402
from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer  # noqa: E402
from trl.trainer.dpo_trainer import DataCollatorForPreference  # noqa: E402

sys.path.insert(0, os.path.dirname(__file__))
from helpers import dpo_config, dpo_tokenizer, drawn, make_tokenizer, transformers_warnings  # noqa: E402
from helpers import preference_pairs as pairs  # noqa: E402
from helpers import random_words as words  # noqa: E402
from helpers import tiny_llama as llama  # noqa: E402

from hf_dp.dpo import (DPO_FLAGS, LOSS_TYPES, REWARD_FLAGS, DPDPOConfig, DPDPOTrainer, DPRewardConfig,  # noqa: E402
                       DPRewardTrainer)
from hf_dp.dpo.config import markdown, new_fields  # noqa: E402
from hf_dp.dpo.pairs import PairLoss  # noqa: E402
from hf_dp.flags import REFUSED  # noqa: E402
from hf_dp.models.loss import IGNORE_INDEX  # noqa: E402
from hf_dp.run.data import UNIT_OF_ROW_KEY  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore")]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENGINES = ("ghost", "ghost_two_pass", "hooks")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return dpo_tokenizer(tmp_path_factory.mktemp("tok"))


def config(tmp_path, cls=DPDPOConfig, **over):
    return dpo_config(tmp_path, cls, **over)


def make(tmp_path, tok, rows, eval_rows=None, model=None, ref_model=None, **over):
    ev = Dataset.from_list(eval_rows) if eval_rows is not None else None
    return DPDPOTrainer(model=model if model is not None else llama(tok), args=config(tmp_path, **over),
                        train_dataset=Dataset.from_list(rows), eval_dataset=ev, processing_class=tok,
                        ref_model=ref_model)


# ------------------------------------------------------------------------------------------ verdicts and the tables
def trl_loss_types() -> set[str]:
    """The loss types TRL's DPOTrainer computes (its ``_compute_loss`` branches)."""
    return set(re.findall(r'loss_type == "(\w+)"', inspect.getsource(DPOTrainer._compute_loss)))


def test_every_trl_loss_type_and_config_field_has_a_verdict_and_the_doc_tables_are_current():
    assert len(trl_loss_types()) >= 15 and trl_loss_types() == set(LOSS_TYPES)
    assert set(new_fields(DPOConfig)) == set(DPO_FLAGS), "classify the new DPOConfig fields in hf_dp/dpo/config.py"
    assert set(new_fields(RewardConfig)) == set(REWARD_FLAGS), "classify the new RewardConfig fields"
    assert {k for k, r in LOSS_TYPES.items() if r.status == REFUSED} == {"aot", "aot_unpaired"}
    with open(os.path.join(ROOT, "docs", "dpo.md"), encoding="utf-8") as f:
        doc = f.read()
    for table in markdown().split("\n\n"):  # the loss types', DPOConfig's and RewardConfig's tables
        assert table.strip() in doc, "regenerate the tables in docs/dpo.md: python -m hf_dp.dpo.config --markdown"


# ------------------------------------------------------------------------------ each pair's loss is TRL's own
def _perturb_adapter(model, seed=1):
    """LoRA's B starts at 0 (policy = reference): give it values so that the log-ratios are not all 0."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def _features(tr, idx):
    return [{k: tr.train_dataset[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")} for i in idx]


def trl_pair_loss(tr, feature) -> torch.Tensor:
    """TRL's own loss (DPOTrainer._compute_loss, its fused LM head and reference) of one pair alone."""
    batch = DataCollatorForPreference(pad_token_id=tr.processing_class.pad_token_id)([feature])
    return DPOTrainer._compute_loss(tr, tr.model, batch, False)


def dp_pair_losses(tr, features) -> torch.Tensor:
    """``[P]``: DPDPOTrainer's per-pair losses of a micro-batch of pairs (its objective, before any clipping)."""
    inputs, objective = tr.pair_objective(tr.model, tr.data_collator(features))
    labels = inputs.pop("labels")
    logits = tr.model(**inputs).logits
    return objective.per_example(logits, labels, tr.model.config, attention_mask=inputs["attention_mask"])[0::2]


CASES = [({"loss_type": [k]}, {}) for k, r in LOSS_TYPES.items() if r.status != REFUSED and k != "exo_pair"] + [
    ({"loss_type": ["exo_pair"], "label_smoothing": 1e-3}, {}),
    ({"loss_type": ["robust"], "label_smoothing": 0.1}, {}),
    ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}, {}),  # RPO: α·NLL on the chosen answer
    ({"loss_type": ["sigmoid", "bco_pair", "sft"], "loss_weights": [0.8, 0.2, 1.0]}, {}),  # MPO
    ({"ld_alpha": 0.5}, {}),
    ({"f_divergence_type": "forward_kl"}, {}), ({"f_divergence_type": "js_divergence"}, {}),
    ({"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3}, {}),
    ({"loss_type": ["ipo"], "beta": 0.5}, {"use_weighting": True}),
]


@pytest.mark.parametrize("case,init", CASES, ids=[",".join(f"{k}={v}" for k, v in {**c, **i}.items()) for c, i in CASES])
def test_each_pairs_loss_and_gradient_are_trls_own_per_pair_loss(tmp_path, tok, case, init):
    tr = make(tmp_path, tok, pairs(12), trainable="lora", lora_r=2, max_steps=1, **init)
    _perturb_adapter(tr.model)
    for k, v in case.items():  # DPOTrainer's attributes (TRL) and the DP objective's settings (hf_dp), the same values
        setattr(tr.args, k, v)
    tr.loss_types, tr.loss_weights = tr.args.loss_type, tr.args.loss_weights or [1.0] * len(tr.args.loss_type)
    for k in ("beta", "label_smoothing", "ld_alpha", "f_divergence_type", "f_alpha_divergence_coef", "use_weighting"):
        setattr(tr, k, getattr(tr.args, k))
    tr.pair_loss = PairLoss.from_args(tr.args)
    tr.model.train()
    feats = _features(tr, range(4))
    params = [p for p in tr.model.parameters() if p.requires_grad]
    mine = dp_pair_losses(tr, feats)  # the four pairs in one micro-batch, padded together
    for j, f in enumerate(feats):
        ref = trl_pair_loss(tr, f)
        torch.testing.assert_close(mine[j], ref.to(mine.dtype), rtol=1e-4, atol=1e-6)
        g_ref = torch.autograd.grad(ref, params)
        g_mine = torch.autograd.grad(dp_pair_losses(tr, feats)[j], params)
        for a, b in zip(g_mine, g_ref):
            torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-6)


# ------------------------------------------------------------------------------------------- sensitivity
C = 1e-4  # every pair (user) is clipped: each contributes exactly its clipped share


def _pair(r, prompt, answer):
    ids = lambda n: [r.randrange(5, 60) for _ in range(n)]  # noqa: E731
    return {"prompt_ids": ids(prompt), "chosen_ids": ids(answer), "rejected_ids": ids(max(1, answer - 1))}


def clipped_sum(tr, features) -> torch.Tensor:
    """The clipped sum DPTrainer's step hands the privatizer for one micro-batch of pairs (noise left out)."""
    opt = tr.create_optimizer()
    opt.discard_pending()
    tr.model.train()
    tr.training_step(tr.model, drawn(tr, tr.get_train_dataloader().collate_fn(features)))
    out = torch.cat([p.summed_grad.reshape(-1).double() for p in opt.params])
    opt.discard_pending()
    return out


def reference_sum(tr, features, c=C) -> torch.Tensor:
    """Σ over units of clip_c(Σ over the unit's pairs of ∇ TRL's own per-pair loss), by autograd, in float64."""
    opt = tr.create_optimizer()
    units: dict = {}
    for f in features:
        units.setdefault(f.get(UNIT_OF_ROW_KEY, id(f)), []).append(f)
    total = 0.0
    tr.model.train()
    for members in units.values():
        g = 0.0
        for f in members:
            plain = {k: f[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
            grads = torch.autograd.grad(trl_pair_loss(tr, plain), opt.params, allow_unused=True)
            g = g + torch.cat([(torch.zeros_like(p) if x is None else x).reshape(-1).double()
                               for p, x in zip(opt.params, grads)])
        total = total + g * min(1.0, c / float(g.norm()))
    return total


@pytest.mark.parametrize("engine", ENGINES)
def test_unclipped_the_dp_sum_is_the_sum_of_trls_per_pair_gradients(tmp_path, tok, engine):
    """With C above every unit's norm the step's sum is Σ_pairs ∇ TRL's per-pair loss itself (magnitudes included),
    with the policy moved away from the reference (so that each pair's σ(−βΔ) weighs its gradient differently)."""
    tr = make(tmp_path, tok, pairs(24, users=6), trainable="all", per_sample_max_grad_norm=1e3, clipping=engine,
              max_steps=1, privacy_unit_column="user_id")
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in tr.model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.3)
    r = random.Random(5)
    feats = [{**_pair(r, 1 + i % 5, 1 + i % 4), UNIT_OF_ROW_KEY: i // 3} for i in range(9)]
    got, want = clipped_sum(tr, feats), reference_sum(tr, feats, c=1e3)
    assert float(want.norm()) > 1e-3
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5 * float(want.abs().max()))


@pytest.mark.parametrize("users", [False, True], ids=["pair", "user"])
@pytest.mark.parametrize("engine", ENGINES)
def test_one_pair_or_one_users_pairs_move_the_clipped_sum_by_at_most_c_removed_and_2c_replaced(tmp_path, tok, engine,
                                                                                                  users):
    tr = make(tmp_path, tok, pairs(24, users=6), trainable="all", per_sample_max_grad_norm=C, clipping=engine,
              max_steps=1, privacy_unit_column="user_id" if users else None)
    r = random.Random(7)
    tag = (lambda f, u: {**f, UNIT_OF_ROW_KEY: u}) if users else (lambda f, u: f)
    short = _pair(r, 2, 2)
    varied = [tag(_pair(r, 1 + i % 6, 1 + i % 5), i // 2) for i in range(10)]  # user level: 2 pairs per user
    copies = [tag(dict(short), i) for i in range(24)]
    x = [tag(_pair(r, 20, 24), 100)] + ([tag(_pair(r, 3, 30), 100)] if users else [])  # a long pair (a user's two)
    x2 = [tag(_pair(r, 1, 1), 100)]  # another pair (user) in its place
    for name, D in (("10 pairs of varied lengths", varied), ("24 copies of a short pair", copies)):
        s_d, s_dx, s_dx2 = clipped_sum(tr, D), clipped_sum(tr, D + x), clipped_sum(tr, D + x2)
        add, rep = float((s_dx - s_d).norm()) / C, float((s_dx - s_dx2).norm()) / C
        assert add <= 1.0 + 1e-6, f"{engine}, {name}: adding one unit moved the clipped sum by {add:.6f} C"
        assert rep <= 2.0 + 1e-6, f"{engine}, {name}: replacing one unit moved the clipped sum by {rep:.6f} C"
        assert add >= 0.99  # the unit's whole clipped share (it is clipped: ‖g‖ > C)
        # the same sum from TRL's own loss, pair (user) by pair, by autograd: equal up to ghost clipping's rounding
        # allowance, which shrinks each unit's clipped vector by a relative ~1e-3 here (public token bounds)
        ref, units = reference_sum(tr, D + x), len({id(f) if UNIT_OF_ROW_KEY not in f else f[UNIT_OF_ROW_KEY]
                                                    for f in D + x})
        err = float((s_dx - ref).norm()) / C
        assert err <= 5e-3 * units, f"{engine}, {name}: DP clipped sum differs from TRL's per-pair reference by {err} C"


# --------------------------------------------------------------------------------------- the prompt is never scored
def test_a_changed_prompt_token_changes_no_scored_label_and_no_prompt_token_is_scored(tmp_path, tok):
    rows = [{"prompt": "w1 w2 w3 w4", "chosen": " w7 w8 w9", "rejected": " w10 w11"},
            {"prompt": "w1 w40 w3 w4", "chosen": " w7 w8 w9", "rejected": " w10 w11"}] + pairs(6)
    tr = make(tmp_path, tok, [{k: v for k, v in p.items() if k != "user_id"} for p in rows], trainable="lora",
              lora_r=2, max_steps=1)
    _perturb_adapter(tr.model)
    batch = tr.data_collator(_features(tr, [0, 1]))
    ids, labels, completion = batch["input_ids"], batch["labels"], batch["completion_mask"]
    assert not torch.equal(ids[0], ids[2]) and torch.equal(labels[0], labels[2]) and torch.equal(labels[1], labels[3])
    changed = (ids[0] != ids[2]).nonzero()[:, 0]
    assert changed.numel() and bool((labels[0, changed] == IGNORE_INDEX).all())  # the changed token is not scored
    prompt_len = len(tr.train_dataset[0]["prompt_ids"])
    assert bool((labels[:, :prompt_len] == IGNORE_INDEX).all())  # no prompt token of any row is scored
    assert bool(((labels != IGNORE_INDEX) == completion.bool()).all())
    # the loss reads no log-probability of a prompt token: its gradient w.r.t. the logits that predict one is 0
    tr.model.train()
    inputs, objective = tr.pair_objective(tr.model, batch)
    lab = inputs.pop("labels")
    logits = tr.model(**inputs).logits.detach().requires_grad_(True)
    loss = objective.per_example(logits, lab, tr.model.config, attention_mask=inputs["attention_mask"]).sum()
    (grad,) = torch.autograd.grad(loss, logits)
    predicts_scored = torch.nn.functional.pad(lab, (0, 1), value=IGNORE_INDEX)[:, 1:] != IGNORE_INDEX
    assert grad[~predicts_scored].abs().max() == 0 and grad[predicts_scored].abs().sum(-1).min() > 0
    # a prompt token's own log-probability changed (its logit raised) changes no pair's loss
    bumped = logits.detach().clone()
    bumped[:, : prompt_len - 1, :] += torch.randn_like(bumped[:, : prompt_len - 1, :])
    again = objective.per_example(bumped, lab, tr.model.config, attention_mask=inputs["attention_mask"]).sum()
    torch.testing.assert_close(again, loss.detach())


# ------------------------------------------------------------------------------ the reference log-probs stay in memory
def _float_bytes(values) -> list[bytes]:
    """Each value as float64 bytes and as text (a float32's 4 bytes would match random weights too often)."""
    out = []
    for v in values:
        out += [struct.pack("<d", v), repr(v).encode(), f"{v:.6g}".encode()]
    return [b for b in out if len(b.strip(b"-0.")) >= 5]


def test_the_reference_models_log_probs_reach_no_file_and_no_log(tmp_path, tok):
    tr = make(tmp_path, tok, pairs(24, users=6), trainable="all", max_steps=2, save_strategy="steps", save_steps=1,
              privacy_unit_column="user_id")
    seen = []
    own = tr.reference_logps

    def recording(model, inputs):
        tok_logps = own(model, inputs)
        seen.extend(float(v) for v in tok_logps.sum(dim=1) if float(v) != 0.0)
        return tok_logps
    tr.reference_logps = recording
    tr.train()
    tr.save_model()
    assert seen, "the reference forward ran"
    assert not any("ref_" in c for c in tr.train_dataset.column_names)  # nothing added to the training set
    needles = _float_bytes(seen) + [b"ref_chosen_logps", b"ref_rejected_logps"]
    roots = [str(tmp_path / "out")] + sorted({os.path.dirname(f["filename"]) for f in tr.train_dataset.cache_files})
    files = [os.path.join(d, f) for root in roots for d, _, fs in os.walk(root) for f in fs]
    assert any(f.endswith("privacy.json") for f in files) and any("checkpoint-" in f for f in files)
    for path in files:
        data = open(path, "rb").read()
        hits = [n for n in needles if n in data]
        assert not hits, f"{path} holds a reference log-probability ({hits[0]!r})"
    logged = json.dumps(tr.state.log_history)
    assert "ref" not in logged and not any(repr(v) in logged for v in seen)


# --------------------------------------------------------------------------------------------------- end to end
def test_a_user_level_dp_dpo_run_trains_evaluates_and_releases_with_epsilon_below_target(tmp_path, tok):
    tr = make(tmp_path, tok, pairs(40, users=10), pairs(8, seed=5), trainable="lora", lora_r=2,
              privacy_unit_column="user_id", num_train_epochs=2)
    assert tr.num_units == 10 and tr.privacy_spec.dataset_size == 10  # N = users, not the 40 pairs
    assert "ref" not in tr.model.peft_config  # the reference is the base (adapter disabled), no copy of the adapter
    from hf_dp.run import independence

    loader = tr.get_train_dataloader()  # each pair's loss is its own, through the pair rows
    assert independence.probe_independence(loader.dataset, loader.collate_fn, tr.model, tr.dp,
                                           compute_loss=tr.compute_loss, prepare_inputs=tr._prepare_inputs) == "passed"
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters() if p.requires_grad}
    tr.train()
    assert any(not torch.equal(before[n], p) for n, p in tr.model.named_parameters() if n in before)
    metrics = tr.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and 0 <= metrics["eval_rewards/accuracies"] <= 1
    tr.save_model()
    report = json.load(open(tmp_path / "out" / "privacy.json"))
    assert 0 < report["epsilon"] <= 3.0 + 1e-6
    unit = report["privacy_unit"]
    assert (unit["column"], unit["num_units"], report["dataset_size"]) == ("user_id", 10, 10)
    assert "user-level DP over preference pairs" in unit["description"]
    assert report["dpo"]["loss_type"] == ["sigmoid"] and "LoRA adapter disabled" in report["dpo"]["reference_model"]
    card = open(tmp_path / "out" / "README.md").read()
    assert "DPOTrainer" in card and "user-level DP over preference pairs" in card


def test_a_row_level_full_fine_tuning_run_uses_a_frozen_copy_as_reference(tmp_path, tok):
    model = llama(tok)
    tr = make(tmp_path, tok, pairs(24), model=model, trainable="all", max_steps=2)
    assert tr.num_units == 24 and "one preference pair" in tr.privacy_report()["unit_of_privacy"]
    start = {n: p.detach().clone() for n, p in tr.ref_model.named_parameters()}
    assert not any(p.requires_grad for p in tr.ref_model.parameters())
    tr.train()
    assert all(torch.equal(start[n], p) for n, p in tr.ref_model.named_parameters())  # never trained
    assert tr.privacy_report()["dpo"]["reference_model"] == "a frozen copy of the starting model"
    with pytest.raises(ValueError, match="overlaps"):
        tr.evaluate(tr._raw_train_dataset)  # the raw pairs, before TRL prepares them


def test_tr_dpo_mixes_the_reference_with_the_dp_policy_and_a_non_private_baseline_is_trls(tmp_path, tok):
    tr = make(tmp_path, tok, pairs(24), trainable="all", max_steps=2, sync_ref_model=True, ref_model_sync_steps=1)
    start = [p.detach().clone() for p in tr.ref_model.parameters()]
    tr.train()  # TR-DPO: the reference becomes a mix with the policy, a function of the released noisy steps
    assert any(not torch.equal(a, p) for a, p in zip(start, tr.ref_model.parameters()))
    base = make(tmp_path, tok, pairs(24), trainable="lora", lora_r=2, max_steps=1, disable_dp=True,
                optim="adamw_torch", epsilon=None)
    assert type(base.data_collator).__name__ == "DataCollatorForPreference"  # TRL's, unchanged
    base.train()
    assert base.state.global_step == 1


def _reward_rows(n, seed=0, users=8):
    """Pairs whose chosen answer uses words w0-w9 and rejected answer w30-w39: learnable."""
    r = random.Random(seed)
    return [{"prompt": words(r, 2, 4), "chosen": " " + " ".join(f"w{r.randrange(10)}" for _ in range(3)),
             "rejected": " " + " ".join(f"w{30 + r.randrange(10)}" for _ in range(3)), "user_id": f"u{i % users}"}
            for i in range(n)]


def test_a_dp_reward_model_run_trains_evaluates_and_releases_with_epsilon_below_target(tmp_path, tok):
    model = llama(tok, cls=LlamaForSequenceClassification, num_labels=1)
    args = config(tmp_path, cls=DPRewardConfig, trainable="all", num_train_epochs=2, privacy_unit_column="user_id")
    ev = [{k: v for k, v in p.items() if k != "user_id"} for p in _reward_rows(8, seed=3)]
    tr = DPRewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(_reward_rows(40)),
                         eval_dataset=Dataset.from_list(ev), processing_class=tok)
    assert tr.num_units == 8
    tr.train()
    metrics = tr.evaluate()
    assert 0 <= metrics["eval_accuracy"] <= 1 and math.isfinite(metrics["eval_loss"])
    tr.save_model()
    report = json.load(open(tmp_path / "out" / "privacy.json"))
    assert 0 < report["epsilon"] <= 3.0 + 1e-6 and report["privacy_unit"]["num_units"] == 8
    assert report["reward_model"]["trainer"].startswith("DPRewardTrainer")


def _reward_reference(tr, features):
    """Σ over pairs of clip_C(∇ TRL's own RewardTrainer loss of the pair alone), by autograd, in float64."""
    from trl.trainer.reward_trainer import DataCollatorForPreference as RewardCollator

    opt = tr.create_optimizer()
    collate = RewardCollator(pad_token_id=tr.processing_class.pad_token_id)
    total = 0.0
    for f in features:
        loss = RewardTrainer.compute_loss(tr, tr.model, collate([f]))
        g = torch.cat([x.reshape(-1).double() for x in torch.autograd.grad(loss, opt.params)])
        total = total + g * min(1.0, C / float(g.norm()))
    return total


@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_one_reward_pair_moves_the_clipped_sum_by_at_most_c(tmp_path, tok, engine):
    model = llama(tok, cls=LlamaForSequenceClassification, num_labels=1)
    args = config(tmp_path, cls=DPRewardConfig, trainable="all", max_steps=1, per_sample_max_grad_norm=C,
                  clipping=engine)
    tr = DPRewardTrainer(model=model, args=args, train_dataset=Dataset.from_list(_reward_rows(24)), processing_class=tok)
    r = random.Random(2)
    feats = [{"chosen_ids": [r.randrange(5, 60) for _ in range(2 + i % 7)],
              "rejected_ids": [r.randrange(5, 60) for _ in range(1 + i % 5)]} for i in range(9)]
    D, x, x2 = feats[:8], feats[8:], [{"chosen_ids": [7] * 30, "rejected_ids": [9]}]
    s_d, s_dx, s_dx2 = clipped_sum(tr, D), clipped_sum(tr, D + x), clipped_sum(tr, D + x2)
    assert 0.99 <= float((s_dx - s_d).norm()) / C <= 1.0 + 1e-6
    assert float((s_dx - s_dx2).norm()) / C <= 2.0 + 1e-6
    tr.model.train()
    assert float((s_dx - _reward_reference(tr, D + x)).norm()) / C <= 5e-3 * len(D + x)


# ------------------------------------------------------------------------- before any step: logs, lengths, reference
def _preparation_log(tmp_path, tok, rows) -> str:
    buf = io.StringIO()
    handler = logging.StreamHandler(buf)
    root, level = logging.getLogger(), logging.getLogger().level
    root.addHandler(handler)  # TRL's and hf_dp's loggers propagate to it
    root.setLevel(logging.INFO)
    try:
        make(tmp_path, tok, rows, trainable="lora", lora_r=2, privacy_unit_column="user_id", dataset_num_proc=2)
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
    return buf.getvalue()


def test_trls_warning_that_quotes_a_private_prompt_is_withheld_under_dp(tmp_path, tok):
    """TRL's warning quotes the prompt's text: withheld. hf_dp's line in its place is the same whether TRL warned or
    not (review of issue 51: a line only when a prompt's tokens merged with its answer's told that of the pairs)."""
    # "w17 w5" + "3 w8": the prompt's last token merges with the answer's first characters (TRL quotes "w5")
    secret = [{"prompt": f"w17 w{d}", "chosen": "3 w8", "rejected": "4 w9", "user_id": f"s{d}"} for d in (5, 6)]
    log = _preparation_log(tmp_path / "a", tok, secret + pairs(22, users=6))
    assert "left out of the training sequence" not in log and "w5 [SEP]" not in log and "w6 [SEP]" not in log, log
    plain = _preparation_log(tmp_path / "b", tok, pairs(24, users=6))
    said = [ln for ln in log.splitlines() if "hf_dp: TRL's" in ln or "withheld" in ln]
    assert said and said == [ln for ln in plain.splitlines() if "hf_dp: TRL's" in ln or "withheld" in ln]


def test_a_pair_longer_than_the_runs_token_bound_is_refused_before_any_step(tmp_path, tok):
    rows = pairs(24, users=6)
    rows[7] = {"prompt": " ".join(["w3"] * 20), "chosen": " " + " ".join(["w4"] * 30), "rejected": " w5", "user_id": "u1"}
    with pytest.raises(ValueError, match="longer than the run's public token bound of 24 tokens"):
        make(tmp_path, tok, rows, trainable="lora", lora_r=2, dp_max_length=24)
    assert make(tmp_path, tok, rows, trainable="lora", lora_r=2, max_length=24).dp.bounds.max_length == 24  # cut
    with pytest.raises(ValueError, match="longer than the run's public token bound of 24 tokens"):
        DPRewardTrainer(model=llama(tok, cls=LlamaForSequenceClassification, num_labels=1), processing_class=tok,
                        args=config(tmp_path, cls=DPRewardConfig, trainable="all", dp_max_length=24),
                        train_dataset=Dataset.from_list(rows))


def test_a_reference_model_whose_dp_training_the_ledger_does_not_count_is_refused(tmp_path, tok):
    from hf_dp.dpo import checks
    from hf_dp.run import lineage

    assert (checks.MODEL_ATTR, checks.CONFIG_ATTR, checks.NON_PRIVATE) == (
        lineage.MODEL_ATTR, lineage.CONFIG_ATTR, lineage.NON_PRIVATE)
    rows = pairs(24, users=6)
    first = make(tmp_path, tok, rows, trainable="all", max_steps=2)
    first.train()  # a model DP-trained on these pairs
    trained = first.model
    with pytest.raises(ValueError, match=r"ref_model= was trained with DP \(run \w+: 2 noisy steps\)"):
        make(tmp_path, tok, rows, trainable="all", ref_model=copy.deepcopy(trained))
    marked = llama(tok)
    marked.config.hf_dp_privacy = {"runs": [], lineage.NON_PRIVATE: True}  # trained without DP after a DP run
    with pytest.raises(ValueError, match="ref_model= was trained without DP after a DP run"):
        make(tmp_path, tok, rows, trainable="all", ref_model=marked)
    # counted when the policy starts from that model; declared separate: said in privacy.json
    make(tmp_path, tok, rows, model=copy.deepcopy(trained), trainable="all", ref_model=copy.deepcopy(trained))
    tr = make(tmp_path, tok, rows, trainable="all", ref_model=copy.deepcopy(trained), prior_privacy="separate")
    assert "--prior_privacy separate" in tr.privacy_report()["dpo"]["reference_model"]


def test_the_tokenizers_longer_than_maximum_warning_is_not_logged_where_the_length_is_cut_or_refused(tmp_path):
    """transformers warns once per tokenizer that a text has more tokens than its model_max_length ("... will result in
    indexing errors") when TRL tokenizes a pair whole; under DP every sequence is cut to max_length (or its pair refused
    over the run's token bound) before the model sees it, so that warning is not logged — the baseline still logs it."""
    from hf_dp.flags import LENGTH_WARNING

    def short_tok(name):
        t = make_tokenizer(tmp_path / name)
        t.eos_token, t.model_max_length = "[SEP]", 8  # every pair is longer
        return t

    rows, held_out = pairs(16, users=4), pairs(4, seed=3)
    for name, build in (
            ("dpo", lambda t: make(tmp_path, t, rows, held_out, trainable="lora", lora_r=2)),
            ("reward", lambda t: DPRewardTrainer(
                model=llama(t, cls=LlamaForSequenceClassification, num_labels=1), processing_class=t,
                args=config(tmp_path, cls=DPRewardConfig, trainable="all"), train_dataset=Dataset.from_list(rows),
                eval_dataset=Dataset.from_list(held_out))),
            ("baseline", lambda t: make(tmp_path, t, rows, trainable="lora", lora_r=2, disable_dp=True,
                                        optim="adamw_torch", epsilon=None))):
        with transformers_warnings() as logged:
            build(short_tok(name))
        said = [m for m in logged if LENGTH_WARNING in m]
        assert len(said) == (1 if name == "baseline" else 0), (name, logged)
    assert not logging.getLogger("transformers.tokenization_utils_base").filters  # the filter is gone afterwards


def test_a_reference_cast_to_bfloat16_after_the_trainer_was_built_is_refused_at_train(tmp_path, tok):
    """Review of issue 51 (finding 2): a bfloat16 ref_model= was accepted, and its log-probability of one pair moved by
    4.3e-4 nats when a longer pair joined the micro-batch. Refused when the trainer is built (docs/misuse.md
    dpo-ref-model-reduced-precision) and in every DP step, before the reference's forward: also when cast since."""
    tr = make(tmp_path, tok, pairs(16, users=4), ref_model=llama(tok), trainable="all", max_steps=1)
    tr.ref_model.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^DP training needs the reference model \(ref_model=\) in float32"):
        tr.train()
    assert tr.state.global_step == 0
