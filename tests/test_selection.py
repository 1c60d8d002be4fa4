"""Issue 32: private hyper-parameter selection (hf_dp/privacy/selection.py, hf_dp/selection.py).

* The accounting: dp-accounting's computation (what hf_dp uses) against an independent one of Papernot & Steinke's
  Theorems 2 and 6 from Opacus' RDP curve; both against the exact Rényi divergence of a best-of-K selection on a
  two-point mechanism (the bound holds and is not absurdly loose; publishing K would void it); the distribution of
  K (pmf against scipy, E[K] against sampling); the calibrated σ meets the total and is the smallest that does.
* The search: fresh model, seed, Poisson and noise streams per trial; the trainer holds the best trial's model; the
  release reports the total ε with a ``hyperparameter_selection`` record (no K), the card says so; no trial's files
  are left; a later train() / a new DPTrainer on the released model refuses to continue it; every refusal before
  any model is built.
"""

from __future__ import annotations

import json
import math
import os
import random

import numpy as np
import pytest

from hf_dp.privacy.selection import ORDERS, TrialCount, calibrate_selection_sigma, expected_trials, selection_epsilon

pytestmark = pytest.mark.filterwarnings("ignore")


# ------------------------------------------------------------------------------------------- the bound, independently
def _opacus_rdp(sigma, q, steps, orders):
    from opacus.accountants.analysis.rdp import compute_rdp

    return np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=steps, orders=list(orders)), dtype=float)


def _to_eps(orders, rdp, delta):
    """RDP -> (ε, δ) (Balle et al. 2020 / Canonne et al. 2020, as Opacus' get_privacy_spent)."""
    a = np.asarray(orders, dtype=float)
    eps = rdp - (math.log(delta) + np.log(a)) / (a - 1) + np.log((a - 1) / a)
    return float(np.nanmin(eps))


def _delta_at(orders, rdp, eps_hat):
    """δ̂ of the curve at ε̂ (the inverse of the same conversion)."""
    a = np.asarray(orders, dtype=float)
    log_delta = (a - 1) * (rdp - eps_hat) + (a - 1) * np.log1p(-1 / a) - np.log(a)
    return float(min(1.0, np.exp(np.min(log_delta))))


def _theorem2(orders, rdp, eta, gamma, mean):
    """Papernot & Steinke 2022, Theorem 2, written from the paper: ε' (λ) = ε(λ) + (1+η)(1-1/λ̂)ε(λ̂)
    + (1+η)log(1/γ)/λ̂ + log E[K]/(λ-1), minimised over λ̂ on the grid."""
    a = np.asarray(orders, dtype=float)
    c = min((1 + eta) * (1 - 1 / lh) * e + (1 + eta) * math.log(1 / gamma) / lh for lh, e in zip(a, rdp))
    return rdp + c + math.log(mean) / (a - 1)


def _theorem6(orders, rdp, mu):
    """Theorem 6: ε'(λ) = ε(λ) + μ δ̂ + log μ/(λ-1), with (ε̂, δ̂)-DP at e^ε̂ = 1 + 1/(λ-1)."""
    a = np.asarray(orders, dtype=float)
    return np.array([e + mu * _delta_at(a, rdp, math.log1p(1 / (lam - 1))) + math.log(mu) / (lam - 1)
                     for lam, e in zip(a, rdp)])


@pytest.mark.parametrize("count", [TrialCount("logarithmic", 4), TrialCount("geometric", 5),
                                   TrialCount("negative_binomial", 3, 0.5), TrialCount("poisson", 6)],
                         ids=lambda c: c.name)
def test_selection_epsilon_is_the_published_bound(count):
    sigma, q, steps, delta = 1.1, 0.02, 300, 1e-5
    rdp = _opacus_rdp(sigma, q, steps, ORDERS)
    if count.name == "poisson":
        curve = _theorem6(ORDERS, rdp, count.mean)
    else:
        curve = _theorem2(ORDERS, rdp, count.shape, count.gamma, count.mean)
    independent = _to_eps(ORDERS, curve, delta)
    used = selection_epsilon(sigma, q, steps, delta, count)
    single = _to_eps(ORDERS, rdp, delta)
    assert used == pytest.approx(independent, rel=0.02)  # two implementations of the subsampled-Gaussian RDP curve
    assert single < used < count.mean * single + 1  # more than one run; a small multiple, not K times


# ------------------------------------------------------------------------- against the exact divergence of a toy
def _renyi(p, r, lam):
    """D_λ(p || r) in log space (finite supports, r > 0 where p > 0)."""
    p, r = np.asarray(p, dtype=float), np.asarray(r, dtype=float)
    m = p > 0
    terms = lam * np.log(p[m]) + (1 - lam) * np.log(r[m])
    top = terms.max()
    return float((top + math.log(np.exp(terms - top).sum())) / (lam - 1))


def _pgf(count, s):
    if count.name == "poisson":
        return math.exp(count.mean * (s - 1))
    eta, g = count.shape, count.gamma
    if eta == 0:
        return math.log(1 - (1 - g) * s) / math.log(g)
    return ((1 - (1 - g) * s) ** (-eta) - 1) / (g ** (-eta) - 1)


def _best_of(count, p):
    """The law of the released output: ⊥ (K = 0) then the maximum score, P[max ≤ y] = E[F(y)^K] = G(F(y))."""
    g = [_pgf(count, f) for f in np.cumsum(p)]
    return np.diff(np.concatenate([[0.0], [_pgf(count, 0.0)], g]))


def _best_of_k(k, p):
    return np.diff(np.concatenate([[0.0], np.cumsum(p) ** k]))


P, P2 = np.array([0.5, 0.3, 0.2]), np.array([0.2, 0.3, 0.5])  # one trial's score law on neighbouring datasets


def _trial_curve(lam):
    return max(_renyi(P, P2, lam), _renyi(P2, P, lam))


@pytest.mark.parametrize("count", [TrialCount("logarithmic", 4), TrialCount("geometric", 4),
                                   TrialCount("geometric", 20), TrialCount("negative_binomial", 6, 2.0),
                                   TrialCount("poisson", 4)], ids=lambda c: f"{c.name}-{c.mean:g}")
def test_the_bound_holds_for_the_exact_selection_and_is_not_absurdly_loose(count):
    orders = [o for o in ORDERS if o <= 64]
    rdp = np.array([_trial_curve(o) for o in orders])
    if count.name == "poisson":
        bound = _theorem6(orders, rdp, count.mean)
    else:
        bound = _theorem2(orders, rdp, count.shape, count.gamma, count.mean)
    a, b = _best_of(count, P), _best_of(count, P2)
    assert a.sum() == pytest.approx(1.0) and b.sum() == pytest.approx(1.0)
    exact = np.array([max(_renyi(a, b, o), _renyi(b, a, o)) for o in orders])
    assert np.all(bound >= exact - 1e-9)
    high = [i for i, o in enumerate(orders) if o >= 8]
    assert np.all(bound[high] <= 4 * exact[high]), (bound[high] / exact[high]).max()


def test_publishing_k_voids_the_bound():
    """The pair (K, best of K) is far less private than the best alone: K must stay secret."""
    count = TrialCount("geometric", 4)
    lam = 4.0
    rdp = np.array([_trial_curve(o) for o in ORDERS])
    bound = _theorem2(ORDERS, rdp, count.shape, count.gamma, count.mean)[ORDERS.index(lam)]
    joint = [math.log(count.pmf(k)) + (lam - 1) * max(_renyi(_best_of_k(k, P), _best_of_k(k, P2), lam),
                                                       _renyi(_best_of_k(k, P2), _best_of_k(k, P), lam))
             for k in range(1, 200)]
    top = max(joint)
    with_k = (top + math.log(sum(math.exp(j - top) for j in joint))) / (lam - 1)
    assert with_k > 2 * bound


# ----------------------------------------------------------------------------------------------- the law of K
@pytest.mark.parametrize("count", [TrialCount("logarithmic", 4), TrialCount("geometric", 3),
                                   TrialCount("negative_binomial", 5, 0.5), TrialCount("poisson", 3)],
                         ids=lambda c: c.name)
def test_the_law_of_k_matches_scipy_and_sampling(count):
    from scipy import stats

    ks = np.arange(0, 400)
    pmf = np.array([count.pmf(int(k)) for k in ks])
    if count.name == "poisson":
        ref = stats.poisson(count.mean).pmf(ks)
    elif count.name == "logarithmic":
        ref = stats.logser(1 - count.gamma).pmf(ks)
    else:  # negative binomial (failures before η successes, success probability γ), conditioned on K >= 1
        nb = stats.nbinom(count.shape, count.gamma)
        ref = np.where(ks >= 1, nb.pmf(ks) / nb.sf(0), 0.0)
    assert np.allclose(pmf, ref, atol=1e-12)
    assert (pmf * ks).sum() == pytest.approx(count.mean, rel=1e-6)  # γ solved for the mean
    if count.name != "poisson":
        assert expected_trials(count.shape, count.gamma) == pytest.approx(count.mean, rel=1e-9)
    rng = random.Random(7)
    draws = np.array([count.sample(rng.random) for _ in range(20000)])
    sd = math.sqrt(((ks - count.mean) ** 2 * pmf).sum())
    assert abs(draws.mean() - count.mean) < 5 * sd / math.sqrt(len(draws))
    assert draws.min() >= (0 if count.name == "poisson" else 1)


def test_bad_distributions_are_refused():
    with pytest.raises(ValueError, match="one of"):
        TrialCount("uniform", 3)
    with pytest.raises(ValueError, match=">= 1"):
        TrialCount("geometric", 0.5)
    with pytest.raises(ValueError, match="shape eta > 0"):
        TrialCount("negative_binomial", 3)


# --------------------------------------------------------------------------------------------- the calibration
def test_the_calibrated_sigma_meets_the_total_and_is_the_smallest():
    from hf_dp.privacy.accounting import calibrate_noise_multiplier

    count = TrialCount("geometric", 4)
    plan = calibrate_selection_sigma(3.0, 1e-5, 0.02, 200, count)
    assert plan.total_epsilon <= 3.0
    assert selection_epsilon(plan.noise_multiplier * 0.995, 0.02, 200, 1e-5, count) > 3.0
    assert plan.per_trial_epsilon < plan.total_epsilon
    assert plan.noise_multiplier > calibrate_noise_multiplier(3.0, 1e-5, 0.02, 200, "rdp")  # one run alone: less noise


# ------------------------------------------------------------------------------------------------------ the search
@pytest.fixture(scope="module")
def data(tmp_path_factory):
    from tests.helpers import make_pair_dataset, make_tokenizer

    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    return tok, make_pair_dataset(tok, n=64, seed=0), make_pair_dataset(tok, n=24, seed=1)


def _trainer(tmp_path, data, **kw):
    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model

    tok, train, heldout = data
    kw = dict(dict(epsilon=3.0, max_steps=2, per_device_train_batch_size=64), **kw)  # q = 1: accounting in ms
    args = dp_args(tmp_path / "out", **kw)
    return DPTrainer(model=make_model(), args=args, train_dataset=train, eval_dataset=heldout,
                     data_collator=make_collator(tok))


class _Inits:
    """model_init that counts its calls and keeps the models it made."""

    def __init__(self):
        self.models = []

    def __call__(self):
        from tests.helpers import make_model

        self.models.append(make_model(seed=len(self.models)))
        return self.models[-1]


SPACE = {"learning_rate": [1e-3, 1e-2], "per_sample_max_grad_norm": [0.1, 1.0]}


def _search(trainer, inits=None, **kw):
    kw = dict(dict(hp_space=SPACE, n_trials=2, direction="minimize", backend="dp_random_stopping", model_init=inits,
                   score_data="public"), **kw)  # model_init=None in kw: refused
    return trainer.hyperparameter_search(**kw)


@pytest.fixture
def trial_dirs(tmp_path, monkeypatch):
    """The trials' folders, made under tmp_path so that the test can see they are gone."""
    import tempfile

    import hf_dp.selection as sel

    made = []
    root = tmp_path / "trials"
    root.mkdir()

    def folder():
        made.append(tempfile.mkdtemp(prefix="trial_", dir=root))
        return made[-1]

    monkeypatch.setattr(sel, "_trial_folder", folder)
    return made


@pytest.mark.parametrize("seeded", [True, False], ids=["dp_seed", "os_entropy"])
def test_every_trial_is_a_fresh_run(data, tmp_path, monkeypatch, trial_dirs, seeded):
    """Three trials: three models from model_init, three HF seeds, and Poisson and noise streams that no two trials
    share (also under --dp_seed, where the streams are keyed by the ledger step, which every trial starts at 0)."""
    import hf_dp.privacy.privatizer as privatizer
    import hf_dp.privacy.sampler as sampler

    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 3)
    streams = []

    def recording(original, purpose):
        def make(seed, *key, **kw):
            gen = original(seed, *key, **kw)
            streams.append((purpose, gen.initial_seed()))
            return gen
        return make

    monkeypatch.setattr(sampler, "stream_generator", recording(sampler.stream_generator, "poisson"))
    noise_generator = privatizer.PrivateOptimizer._noise_generator

    def recorded_noise(self, device):
        fresh = self.generator is None
        gen = noise_generator(self, device)
        if fresh:
            streams.append(("noise", gen.initial_seed()))
        return gen

    monkeypatch.setattr(privatizer.PrivateOptimizer, "_noise_generator", recorded_noise)
    trainer = _trainer(tmp_path, data, dp_seed=5 if seeded else None)
    inits = _Inits()
    best = _search(trainer, inits)
    assert len(inits.models) == 3 and len({id(m) for m in inits.models}) == 3
    assert len(best.run_summary["trials"]) == 3
    for purpose in ("poisson", "noise"):
        seeds = [s for p, s in streams if p == purpose]
        assert len(seeds) >= 3 and len(set(seeds)) == len(seeds), (purpose, seeds)
    assert len(trial_dirs) == 3 and not any(os.path.exists(d) for d in trial_dirs)
    assert trainer.model is inits.models[int(best.run_id)]  # the trainer holds the best trial's model


def test_the_release_reports_the_total_and_cannot_be_continued(data, tmp_path, trial_dirs):
    from transformers import BertForSequenceClassification

    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model

    tok, train, _ = data
    trainer = _trainer(tmp_path, data)
    best = _search(trainer, _Inits(), n_trials=2.5)
    sel = trainer.hyperparameter_selection
    assert sel["total_epsilon"] <= 3.0 and trainer.get_epsilon() == sel["total_epsilon"]
    assert sel["per_trial_epsilon"] < sel["total_epsilon"]
    assert trainer.privacy_spec.noise_multiplier == sel["per_trial_noise_multiplier"]
    assert 0.5 * sel["per_trial_epsilon"] < trainer.ledger.get_epsilon() <= sel["per_trial_epsilon"]  # one trial: PRV <= RDP
    out = tmp_path / "release"
    trainer.save_model(str(out))
    privacy = json.loads((out / "privacy.json").read_text())
    record = privacy["hyperparameter_selection"]
    assert privacy["epsilon"] == record["total_epsilon"] <= privacy["target_epsilon"] == 3.0
    assert record["trials_distribution"]["name"] == "geometric" and record["trials_distribution"]["mean"] == 2.5
    assert record["search_space"] == SPACE and record["score"]["declared_public"] is True
    assert record["selected_hyperparameters"] == best.hyperparameters
    assert privacy["optimizer"]["hyperparameters"]["lr"] == best.hyperparameters["learning_rate"]
    assert privacy["max_grad_norm"] == best.hyperparameters["per_sample_max_grad_norm"]
    assert "k_drawn" not in json.dumps(best.hyperparameters) and not isinstance(record["k_drawn"], int)
    # config.json's public ledger says what the model cost: the total, the trial's own ledger apart (review finding)
    config_record = json.loads((out / "config.json").read_text())["hf_dp_privacy"]
    assert config_record["epsilon"] == record["total_epsilon"] and config_record["trial_epsilon"] < record["total_epsilon"]
    card = (out / "README.md").read_text()
    assert "**Hyper-parameters chosen privately:**" in card and "total of the whole selection" in card
    assert not any(os.path.exists(d) for d in trial_dirs)
    with pytest.raises(ValueError, match="^refusing to train: this trainer holds the model a private selection"):
        trainer.train()
    # the released model, in memory and from disk, does not continue as if it had spent one trial's epsilon
    for model in (trainer.model, BertForSequenceClassification.from_pretrained(str(out))):
        with pytest.raises(ValueError, match="^this model was released by a private hyper-parameter selection"):
            DPTrainer(model=model, args=dp_args(tmp_path / "again", epsilon=3.0, max_steps=2, per_device_train_batch_size=64),
                      train_dataset=train, data_collator=make_collator(tok))
    with pytest.raises(ValueError, match="^this model was released by a private hyper-parameter selection"):
        DPTrainer(model=make_model(), train_dataset=train, data_collator=make_collator(tok),  # its privacy.json as prior
                  args=dp_args(tmp_path / "file", epsilon=3.0, max_steps=2, per_device_train_batch_size=64,
                               prior_privacy=str(out / "privacy.json")))
    DPTrainer(model=BertForSequenceClassification.from_pretrained(str(out)),  # other data: allowed, said explicitly
              args=dp_args(tmp_path / "other", epsilon=3.0, max_steps=2, prior_privacy="separate",
                           per_device_train_batch_size=64), train_dataset=train,
              data_collator=make_collator(tok))


def test_the_default_objective_is_the_eval_loss_not_epsilon(data, tmp_path, monkeypatch, trial_dirs):
    """Review finding: DPTrainer.log adds ``epsilon`` to the dict evaluate() returns, and HF's default objective sums
    every metric but the loss when there is one — so every trial scored its own ε, all tied, the first was kept. The
    default objective is now the eval loss; and a failed search is not run again on the same trainer."""
    from hf_dp.privacy.selection import TrialCount

    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 3)
    evals = []
    from hf_dp import DPTrainer

    original = DPTrainer.evaluate

    def recording(self, *a, **k):
        evals.append(dict(original(self, *a, **k)))
        return evals[-1]

    monkeypatch.setattr(DPTrainer, "evaluate", recording)
    trainer = _trainer(tmp_path, data)
    best = _search(trainer, _Inits(), n_trials=2.0)  # compute_objective=None: the default
    scores = [t["objective"] for t in best.run_summary["trials"]]
    assert len(scores) == 3 and scores == [m["eval_loss"] for m in evals]
    assert all("epsilon" in m for m in evals) and scores != [m["epsilon"] for m in evals]
    assert trainer.hyperparameter_selection["score"]["selected_trial_score"] == min(scores)

    broken = _trainer(tmp_path / "b", data)
    with pytest.raises(RuntimeError, match="boom"):
        _search(broken, _Inits(), compute_objective=lambda m: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(ValueError, match="^a private selection already ran on this trainer"):
        _search(broken, _Inits())


@pytest.mark.parametrize("change,expect", [
    (dict(hp_space={}), "^the search space is empty"),
    (dict(hp_space={"epsilon": [1, 2]}), "^the search space may not hold --epsilon"),
    (dict(hp_space={"num_train_epochs": [1, 2]}), "^the search space may not hold --num_train_epochs"),
    (dict(hp_space={"learning_rat": [1e-3]}), "^the search space names learning_rat, which is not a training flag"),
    (dict(hp_space={"learning_rate": []}), "must be a non-empty list"),
    (dict(hp_space={"learning_rate": ["fast"]}), "takes numbers"),
    (dict(backend="optuna"), "^under DP hyperparameter_search runs backend='dp_random_stopping' only"),
    (dict(score_data=None), "^declare what the trials are scored on"),
    (dict(score_data="private"), "^score_data='private' .* is not implemented"),
    (dict(model_init=None), "^hyperparameter_search needs model_init="),
    (dict(direction=["minimize", "maximize"]), "^direction must be"),
    (dict(n_trials=0.5), ">= 1"),
    (dict(distribution="uniform"), "must be one of"),
])
def test_refusals_come_before_any_model_is_built(data, tmp_path, change, expect):
    trainer = _trainer(tmp_path, data)
    inits = _Inits()
    kw = dict(model_init=inits)
    kw.update(change)
    with pytest.raises(ValueError, match=expect):
        _search(trainer, **kw)
    assert inits.models == []


@pytest.mark.parametrize("args,expect", [
    (dict(epsilon=None, noise_multiplier=1.0), "give --epsilon \\(the total target\\)"),
    (dict(load_best_model_at_end=True, eval_strategy="steps", save_strategy="steps"), "^--load_best_model_at_end"),
])
def test_incompatible_flags_are_refused(data, tmp_path, args, expect):
    trainer = _trainer(tmp_path, data, **args)
    with pytest.raises(ValueError, match=expect):
        _search(trainer, _Inits())


def test_the_search_space_syntax():
    from hf_dp.selection import parse_space

    assert parse_space("learning_rate=1e-3,3e-3;per_sample_max_grad_norm=0.1") == {
        "learning_rate": ["1e-3", "3e-3"], "per_sample_max_grad_norm": ["0.1"]}
    for bad, expect in (("", "empty"), ("learning_rate", "cannot read"), ("learning_rate=1e-3,", "cannot read"),
                        ("lr=1;lr=2", "twice"), ("1x=3", "cannot read")):
        with pytest.raises(ValueError, match=expect):
            parse_space(bad)


def test_an_hp_space_function_gets_optuna_style_suggestions(data, tmp_path, monkeypatch, trial_dirs):
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 2)
    seen = []

    def space(trial):
        params = {"learning_rate": trial.suggest_float("learning_rate", 1e-4, 1e-2, log=True),
                  "warmup_steps": trial.suggest_int("warmup_steps", 0, 3),
                  "weight_decay": trial.suggest_categorical("weight_decay", [0.0, 0.01])}
        seen.append(params)
        return params

    trainer = _trainer(tmp_path, data)
    best = _search(trainer, _Inits(), hp_space=space)
    assert len(seen) == 2 and all(1e-4 <= p["learning_rate"] <= 1e-2 and 0 <= p["warmup_steps"] <= 3 for p in seen)
    assert best.hyperparameters in seen and trainer.args.learning_rate == best.hyperparameters["learning_rate"]


# ------------------------------------------------------------------------------------------------- the recipe path
from tests.test_recipes import _load_recipe, _run  # noqa: E402


@pytest.fixture(scope="module")
def glue():
    return _load_recipe()


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BERT classifier saved like a Hub checkpoint, with tests/helpers.py's WordPiece vocabulary."""
    from tests.helpers import make_model, make_tokenizer

    d = tmp_path_factory.mktemp("tiny_bert")
    make_tokenizer(d).save_pretrained(str(d))
    make_model().save_pretrained(str(d))
    return str(d)


def _glue_layout(tmp_path, n_train=96, n_dev=32):
    """A tiny SST-2 in GLUE's layout (DIR/SST-2/{train,dev}.tsv): its dev set is GLUE's own, declared public."""
    folder = tmp_path / "glue" / "SST-2"
    folder.mkdir(parents=True)
    for name, n, offset in (("train", n_train, 0), ("dev", n_dev, 1000)):
        rows = ["sentence\tlabel"] + [f"{'good fun movie' if i % 2 else 'bad dull film'} {i + offset} .\t{i % 2}"
                                      for i in range(n)]
        (folder / f"{name}.tsv").write_text("\n".join(rows) + "\n")
    return tmp_path / "glue"


def _tune_argv(tiny_bert, glue_dir, out, *extra):
    return ["--task_name", "sst2", "--data_dir", str(glue_dir), "--model_name_or_path", tiny_bert,
            "--output_dir", str(out), "--epsilon", "3", "--per_device_train_batch_size", "96", "--delta", "1e-3",
            "--max_steps", "2", "--logging_steps", "1000", "--disable_tqdm", "true", *extra]


def test_the_recipe_tunes_privately_and_writes_the_record(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 2)
    out = tmp_path / "out"
    code, stdout, err = _run(glue, capsys, _tune_argv(tiny_bert, _glue_layout(tmp_path), out, "--tune",
                                                      "learning_rate=1e-3,1e-2;per_sample_max_grad_norm=0.1,1.0",
                                                      "--tune_trials", "2", "--tune_distribution", "logarithmic"))
    assert code == 0, err[-3000:]
    assert "private selection: kept" in stdout
    privacy = json.loads((out / "privacy.json").read_text())
    record = privacy["hyperparameter_selection"]
    assert privacy["epsilon"] == record["total_epsilon"] <= 3.0 == record["target_epsilon"]
    assert record["trials_distribution"]["name"] == "logarithmic" and record["trials_distribution"]["mean"] == 2.0
    assert record["search_space"] == {"learning_rate": ["1e-3", "1e-2"], "per_sample_max_grad_norm": ["0.1", "1.0"]}
    assert record["score"]["objective"] == "eval_accuracy" and record["score"]["declared_public"] is True
    assert privacy["max_grad_norm"] == record["selected_hyperparameters"]["per_sample_max_grad_norm"]
    assert privacy["cache_frozen_features"] is True  # the trials reused the recipe's frozen-prefix caches
    assert "Hyper-parameters chosen privately" in (out / "README.md").read_text()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == []


@pytest.mark.parametrize("extra,expect", [
    (["--tune", "learning_rate"], "cannot read the search space entry"),
    (["--tune", "num_train_epochs=1,2"], "may not hold --num_train_epochs"),
    (["--tune", "learning_rate=1e-3", "--tune_distribution", "uniform"], "must be one of"),
    (["--tune", "learning_rate=1e-3", "--tune_trials", "0"], ">= 1"),
    (["--tune", "learning_rate=1e-3", "--resume_from_checkpoint", "True"], "resume"),  # (nothing to resume, or --tune)
    (["--tune", "learning_rate=1e-3", "--noise_multiplier", "1.0"], "give --epsilon, not --noise_multiplier"),
])
def test_the_recipe_refuses_before_loading_the_model(glue, tiny_bert, tmp_path, capsys, monkeypatch, extra, expect):
    def no_model(*a, **k):
        raise AssertionError("the model was loaded before --tune was checked")

    monkeypatch.setattr(glue, "load_model_and_tokenizer", no_model)
    argv = _tune_argv(tiny_bert, _glue_layout(tmp_path), tmp_path / "o", *extra)
    if "--noise_multiplier" in extra:
        argv.remove("--epsilon"), argv.remove("3")
    code, _, err = _run(glue, capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error:") and expect in lines[-1], err[-2000:]
    assert "Traceback" not in err


def test_the_recipe_wants_other_validation_data_declared_public(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(glue, "load_model_and_tokenizer", lambda *a, **k: (_ for _ in ()).throw(AssertionError()))
    glue_dir = _glue_layout(tmp_path)
    argv = _tune_argv(tiny_bert, glue_dir, tmp_path / "o", "--tune", "learning_rate=1e-3",
                      "--validation_file", str(glue_dir / "SST-2" / "dev.tsv"))
    code, _, err = _run(glue, capsys, argv)
    assert code == 2 and "--tune_eval_public true" in err.strip().splitlines()[-1]


def test_a_model_init_that_reuses_a_model_or_a_trained_trainer_is_refused(data, tmp_path, monkeypatch, trial_dirs):
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 2)
    trainer = _trainer(tmp_path, data)
    same = _Inits()()
    with pytest.raises(ValueError, match="^model_init returned a model an earlier trial trained"):
        _search(trainer, lambda: same)
    assert not any(os.path.exists(d) for d in trial_dirs)
    trained = _trainer(tmp_path / "t", data)
    trained.train()
    with pytest.raises(ValueError, match=r"^this trainer already took \d+ noisy steps"):
        _search(trained, _Inits())


def test_poisson_k_zero_releases_the_untrained_model(data, tmp_path, monkeypatch, trial_dirs):
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 0)
    trainer = _trainer(tmp_path, data)
    inits = _Inits()
    before = {k: v.clone() for k, v in inits().state_dict().items()}
    inits.models.clear()
    best = _search(trainer, inits, distribution="poisson")
    assert best.objective is None and len(inits.models) == 1 and trainer.state.global_step == 0
    assert all((before[k] == v).all() for k, v in trainer.model.state_dict().items())
    sel = trainer.hyperparameter_selection
    assert sel["trials_distribution"]["theorem"].endswith("Theorem 6") and trainer.get_epsilon() == sel["total_epsilon"] <= 3


def test_several_processes_are_refused(data, tmp_path, monkeypatch):
    """Every rank would draw its own K and configurations (OS entropy): refused, before any model is built."""
    from hf_dp import DPTrainingArguments

    trainer = _trainer(tmp_path, data)
    monkeypatch.setattr(DPTrainingArguments, "world_size", property(lambda self: 2))
    inits = _Inits()
    with pytest.raises(ValueError, match="^private selection runs in one process"):
        _search(trainer, inits)
    assert inits.models == []
