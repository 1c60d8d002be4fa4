"""Issue 32: private hyper-parameter selection (hf_dp/privacy/selection.py, hf_dp/tuning/).

* The accounting: dp-accounting's computation (what hf_dp uses) against an independent one of Papernot & Steinke's
  Theorems 2 and 6 from Opacus' RDP curve; both against the exact Rényi divergence of a best-of-K selection on a
  two-point mechanism (the bound holds and is not absurdly loose; publishing K would void it); the distribution of
  K (pmf against scipy, E[K] against sampling); the calibrated σ meets the total and is the smallest that does.
* The search: fresh model, seed, Poisson and noise streams per trial; the trainer holds the best trial's model; the
  release reports the total ε with a ``hyperparameter_selection`` record (no K), the card says so; no trial's files
  are left; a later train() / a new DPTrainer on the released model refuses to continue it; every refusal before
  any model is built.
* The DP score on held-out private data (``score_data="private"``): the composed per-trial curve against an
  independent computation (σ_s → ∞ gives the public case back), the calibration with it, the noisy score's law (mean
  and std σ_s/n, each randomness source), the per-example scores (accuracy, clipping, unit means), no exact statistic
  of the held-out set anywhere (callbacks, log_history, logs, stdout, privacy.json, card), the recipe's
  ``--tune_score private`` (a random hold-out split) end to end, and the refusals.
"""

from __future__ import annotations

import json
import logging
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


def _gaussian_rdp(sigma_s, orders):
    """RDP of the Gaussian mechanism, sensitivity 1: λ/(2σ²)."""
    return np.asarray(orders, dtype=float) / (2 * sigma_s ** 2)


@pytest.mark.parametrize("count", [TrialCount("logarithmic", 4), TrialCount("geometric", 5),
                                   TrialCount("negative_binomial", 3, 0.5), TrialCount("poisson", 6)],
                         ids=lambda c: c.name)
def test_a_dp_score_enters_each_trial_of_the_published_bound(count):
    """score_data='private': each trial is its training composed with the Gaussian score (σ_s, sensitivity 1); the
    theorems apply to the composed curve. σ_s → ∞ is the public case again."""
    sigma, q, steps, delta, sigma_s = 1.1, 0.02, 300, 1e-5, 5.0
    rdp = _opacus_rdp(sigma, q, steps, ORDERS) + _gaussian_rdp(sigma_s, ORDERS)
    if count.name == "poisson":
        curve = _theorem6(ORDERS, rdp, count.mean)
    else:
        curve = _theorem2(ORDERS, rdp, count.shape, count.gamma, count.mean)
    used = selection_epsilon(sigma, q, steps, delta, count, sigma_s)
    public = selection_epsilon(sigma, q, steps, delta, count)
    assert used == pytest.approx(_to_eps(ORDERS, curve, delta), rel=0.02)
    assert used > public * 1.01  # the score costs something
    assert selection_epsilon(sigma, q, steps, delta, count, 1e7) == pytest.approx(public, rel=1e-6)


def test_the_calibration_with_a_dp_score_meets_the_total():
    from hf_dp.privacy.selection import score_selection_epsilon, trial_epsilon

    count = TrialCount("geometric", 4)
    public = calibrate_selection_sigma(3.0, 1e-5, 0.02, 200, count)
    plan = calibrate_selection_sigma(3.0, 1e-5, 0.02, 200, count, score_noise_multiplier=20.0)
    assert plan.total_epsilon <= 3.0 and plan.score_noise_multiplier == 20.0
    assert selection_epsilon(plan.noise_multiplier * 0.995, 0.02, 200, 1e-5, count, 20.0) > 3.0
    assert plan.noise_multiplier > public.noise_multiplier  # the training gets what the scores leave
    assert plan.per_trial_training_epsilon == trial_epsilon(plan.noise_multiplier, 0.02, 200, 1e-5)
    assert plan.per_trial_epsilon > plan.per_trial_training_epsilon
    assert 0 < score_selection_epsilon(20.0, 1e-5, count) < 0.5 * 3.0  # the default sigma_s: a small share
    with pytest.raises(ValueError, match=r"^score_noise_multiplier=0\.5: the DP scores alone would spend epsilon .*"
                                         "more than half"):
        calibrate_selection_sigma(3.0, 1e-5, 0.02, 200, count, score_noise_multiplier=0.5)
    for bad in (0, -1.0, math.inf, math.nan, "20", True):
        with pytest.raises(ValueError, match="^score_noise_multiplier .* must be a finite number > 0"):
            calibrate_selection_sigma(3.0, 1e-5, 0.02, 200, count, score_noise_multiplier=bad)


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

    import hf_dp.tuning.search as sel

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


def test_selections_whose_seeds_gave_their_trials_one_31_bit_seed_draw_different_noise(data, tmp_path, monkeypatch,
                                                                                         trial_dirs):
    """Issue 38 item 1: a trial's --dp_seed was mix(seed, 'selection', 'trial', i) % 2**31, so two selections whose
    --dp_seed values differ but whose residues agree (a birthday search finds such a pair among ~2^16 seeds) trained
    their trial 0 with one seed: the same Poisson draws and the same noise. A trial's seed keeps the whole seed now."""
    import torch

    from hf_dp.privacy.privatizer import PrivateOptimizer
    from hf_dp.privacy.randomness import mix

    seen, pair = {}, None
    for s in range(1, 1_000_000):
        low = mix(s, "selection", "trial", 0) % (2**31)
        if low in seen:
            pair = (seen[low], s)
            break
        seen[low] = s
    assert pair is not None
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 1)
    noises, original = [], PrivateOptimizer.add_noise

    def spy(self):
        out = original(self)
        noises.append(torch.cat([(p.grad - p.summed_grad.view_as(p)).reshape(-1) for p in self.params]).clone())
        return out

    monkeypatch.setattr(PrivateOptimizer, "add_noise", spy)
    first = []
    for i, seed in enumerate(pair):
        del noises[:]
        _search(_trainer(tmp_path / f"s{i}", data, dp_seed=seed), _Inits(), hp_space={"learning_rate": [1e-3]})
        assert len(noises) == 2
        first.append(noises[0])
    assert not torch.allclose(first[0], first[1], atol=1e-3)  # before the fix: the same draw


def test_the_release_reports_the_total_and_cannot_be_continued(data, tmp_path, trial_dirs, caplog):
    from transformers import BertForSequenceClassification

    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model

    tok, train, _ = data
    with caplog.at_level(logging.INFO, logger="hf_dp"):
        trainer = _trainer(tmp_path, data)
        single = trainer.privacy_spec.noise_multiplier
        best = _search(trainer, _Inits(), n_trials=2.5)
    sel = trainer.hyperparameter_selection
    # issue 44 §2: the σ logged when the trainer was made is a single run's; the selection line says so
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_dp: private selection"))
    assert f"σ = {sel['per_trial_noise_multiplier']:.4g} per trial" in line
    assert f"(σ = {single:.4g}) is a single run's" in line
    assert sel["total_epsilon"] <= 3.0 and trainer.get_epsilon() == sel["total_epsilon"]
    assert sel["per_trial_epsilon"] < sel["total_epsilon"]
    assert trainer.privacy_spec.noise_multiplier == sel["per_trial_noise_multiplier"]
    # issue 44 §2: the trial's own ε is the selection's per-trial ε (one accountant, RDP, for every number of it)
    assert trainer.ledger.spec.accountant == "rdp" and trainer.privacy_spec.accountant == "rdp"
    assert math.isclose(trainer.ledger.get_epsilon(), sel["per_trial_epsilon"], rel_tol=2e-3)
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
    (dict(score_data="privat"), "^declare what the trials are scored on"),
    (dict(score_data="private", direction="maximize", compute_objective=lambda m: m["eval_loss"]),
     "^under score_data='private' a trial's score is the DP mean of example_score"),
    (dict(score_data="private"), r"^the default DP score is the accuracy \(higher is better\)"),
    (dict(score_data="private", direction="maximize", score_noise_multiplier=0.0), "must be a finite number > 0"),
    (dict(score_data="private", direction="maximize", score_noise_multiplier=0.3), "more than half"),
    (dict(score_data="private", direction="maximize", example_score="accuracy"), "^example_score must be a function"),
    (dict(score_noise_multiplier=20.0), "go with score_data='private' only"),
    (dict(example_score=lambda logits, labels: logits[:, 0]), "go with score_data='private' only"),
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
    from hf_dp.tuning.space import parse_space

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
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    record = privacy["hyperparameter_selection"]
    assert privacy["epsilon"] == record["total_epsilon"] <= 3.0 == record["target_epsilon"]
    assert record["trials_distribution"]["name"] == "logarithmic" and record["trials_distribution"]["mean"] == 2.0
    assert record["search_space"] == {"learning_rate": ["1e-3", "1e-2"], "per_sample_max_grad_norm": ["0.1", "1.0"]}
    assert record["score"]["objective"] == "eval_accuracy" and record["score"]["declared_public"] is True
    assert privacy["max_grad_norm"] == record["selected_hyperparameters"]["per_sample_max_grad_norm"]
    assert privacy["cache_frozen_features"] is True  # the trials reused the recipe's frozen-prefix caches
    assert "Hyper-parameters chosen privately" in (out / "release" / "README.md").read_text()
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("checkpoint")) == []


def test_the_recipe_s_plan_lines_state_the_trials_sigma_and_one_epsilon_per_trial(glue, tiny_bert, tmp_path, capsys,
                                                                                    monkeypatch, caplog):
    """Issue 44 §2: under --tune the first plan block showed a single run's σ (0.834) while the trials ran at σ 1.027,
    and the trials' blocks said ε = 1.79 per trial (PRV) where the selection line and the card said 2.2 (RDP)."""
    import re

    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 2)
    out = tmp_path / "out"
    with caplog.at_level(logging.INFO, logger="hf_dp"):
        code, stdout, err = _run(glue, capsys, _tune_argv(tiny_bert, _glue_layout(tmp_path), out, "--tune",
                                                          "learning_rate=1e-3,1e-2", "--tune_trials", "2"))
    assert code == 0, err[-3000:]
    record = json.loads((out / "release" / "privacy.json").read_text())["hyperparameter_selection"]
    messages = [r.getMessage() for r in caplog.records]
    blocks = [m for m in messages if m.startswith("hf_dp plan (public")]
    assert len(blocks) == 2  # one per trial; none for the single run the selection does not make
    sigmas = {float(s) for b in blocks for s in re.findall(r"σ = ([0-9.]+)", b)}
    assert sigmas == {float(f"{record['per_trial_noise_multiplier']:.4g}")}
    per_trial = f"{record['per_trial_epsilon']:.3g}"
    for b in blocks:  # each trial's ε, by the accountant the selection's total uses, and named
        assert f"ε = {per_trial} per trial (rdp" in b, b
    line = next(m for m in messages if m.startswith("hf_dp: private selection"))
    assert f"ε {per_trial} each alone (rdp)" in line and "σ" in line
    assert json.loads((out / "release" / "privacy.json").read_text())["accountant"] == "rdp"


@pytest.mark.parametrize("extra,expect", [
    (["--tune", "learning_rate"], "cannot read the search space entry"),
    (["--tune", "num_train_epochs=1,2"], "may not hold --num_train_epochs"),
    (["--tune", "learning_rate=1e-3", "--tune_distribution", "uniform"], "must be one of"),
    (["--tune", "learning_rate=1e-3", "--tune_trials", "0"], ">= 1"),
    (["--tune", "learning_rate=1e-3", "--resume_from_checkpoint", "True"], "resume"),  # (nothing to resume, or --tune)
    (["--tune", "learning_rate=1e-3", "--noise_multiplier", "1.0"], "give --epsilon, not --noise_multiplier"),
    (["--tune", "learning_rate=1e-3", "--tune_score", "secret"], "--tune_score is 'public'"),
    (["--tune", "learning_rate=1e-3", "--tune_score", "private", "--tune_holdout_fraction", "1.5"], "a number in (0, 1)"),
    (["--tune", "learning_rate=1e-3", "--tune_score", "private", "--tune_score_noise_multiplier", "0.2"],
     "--tune_score_noise_multiplier=0.2: the DP scores alone would spend"),
    (["--tune", "learning_rate=1e-3", "--tune_score", "private", "--tune_score_noise_multiplier", "-1"],
     "--tune_score_noise_multiplier (the DP score's noise"),
    (["--tune", "learning_rate=1e-3", "--tune_holdout_fraction", "0.2"], "go with --tune_score private"),
    (["--tune_score", "private"], "go with --tune"),
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


def test_the_recipe_scores_privately_on_a_random_holdout(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    """--tune_score private: the runs train on the rows a fresh coin kept and are scored by the DP score on the
    others; privacy.json says so, its N is the rows trained on, the total includes the scores."""
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 2)
    out = tmp_path / "out"
    code, stdout, err = _run(glue, capsys, _tune_argv(
        tiny_bert, _glue_layout(tmp_path), out, "--tune", "learning_rate=1e-3,1e-2", "--tune_trials", "2",
        "--tune_score", "private", "--tune_holdout_fraction", "0.25", "--per_device_train_batch_size", "32"))
    assert code == 0, err[-3000:]
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    record = privacy["hyperparameter_selection"]
    score = record["score"]
    assert score["declared_public"] is False and score["objective"] == "accuracy" and score["direction"] == "maximize"
    dp = score["dp_score"]
    assert dp["noise_multiplier"] == 20.0 and "independent random coin" in dp["heldout_split"]
    assert 0 < dp["heldout_units"] < 96 and dp["heldout_units"] + privacy["dataset_size"] == 96
    assert privacy["epsilon"] == record["total_epsilon"] <= 3.0
    assert record["per_trial_epsilon"] > record["per_trial_training_epsilon"]
    assert "through a DP score" in (out / "release" / "README.md").read_text()


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


# ---------------------------------------------------------------------------- the DP score on held-out private data
@pytest.mark.parametrize("source", ["os_entropy", "dp_seed", "csprng"])
def test_the_noisy_score_is_unbiased_with_std_sigma_over_n(source):
    from hf_dp.tuning.private_score import dp_score

    exact, n, sigma, draws = 13.0, 24, 3.0, 20000
    if source == "dp_seed":
        values = np.array([dp_score(exact, n, sigma, seed=5, key=(i,)) for i in range(draws)])
        assert dp_score(exact, n, sigma, seed=5, key=(3,)) == values[3]  # the stream is the seed's
    else:
        values = np.array([dp_score(exact, n, sigma, secure=source == "csprng") for _ in range(draws)])
    std = sigma / n
    assert abs(values.mean() - exact / n) < 5 * std / math.sqrt(draws)
    assert values.std() == pytest.approx(std, rel=0.04)
    assert len(set(values.tolist())) == draws  # fresh noise every time


def test_the_score_stream_is_not_a_training_stream():
    """Under --dp_seed the score's noise stream is keyed (seed, 'selection', 'score', trial): the seed of no trial's
    Poisson or noise stream (keyed by the trial's own seed, derived_seed(seed, 'selection', 'trial', i))."""
    import torch

    from hf_dp.privacy.randomness import derived_seed, stream_generator
    from hf_dp.tuning.private_score import score_noise

    seed = 5
    score = {stream_generator(seed, "selection", "score", i).initial_seed() for i in range(8)}
    for i in range(8):  # score_noise draws from exactly that stream
        first = torch.randn((), generator=stream_generator(seed, "selection", "score", i), dtype=torch.float64)
        assert score_noise(2.0, seed=seed, key=(i,)) == 2.0 * float(first)
    training = {stream_generator(derived_seed(seed, "selection", "trial", i), purpose, 0, start).initial_seed()
                for i in range(8) for purpose in ("poisson",) for start in range(50)}
    training |= {stream_generator(derived_seed(seed, "selection", "trial", i), "noise", start).initial_seed()
                 for i in range(8) for start in range(50)}
    assert len(score) == 8 and not score & training


def test_heldout_scores_are_the_accuracy_clipped_and_unit_means(data, tmp_path):
    import torch

    from hf_dp.tuning.private_score import heldout_scores, unit_sum

    tok, _, heldout = data
    trainer = _trainer(tmp_path, data)
    scores = heldout_scores(trainer, heldout)
    model = trainer.model.eval()
    with torch.no_grad():  # by hand, one row at a time
        expected = [float(model(**{k: torch.tensor([heldout[i][k]]) for k in ("input_ids", "token_type_ids",
                                                                             "attention_mask")}).logits.argmax(-1)
                          == heldout[i]["labels"]) for i in range(len(heldout))]
    assert scores.dtype == torch.float64 and scores.tolist() == expected
    assert 0 < sum(expected) < len(expected)  # not a degenerate set
    units = [[0, 3, 5], [1], [2, 4]] + [[i] for i in range(6, len(heldout))]
    total, n = unit_sum(scores, units)
    assert n == len(units) and total == pytest.approx(sum(float(np.mean([expected[r] for r in u])) for u in units))
    wild = [-1.0, 2.0, math.nan, math.inf, -math.inf, 0.25]

    seen = []

    def user(logits, labels):  # the wild values in row order, however the rows are grouped into calls
        seen.extend(range(len(seen), len(seen) + labels.shape[0]))
        return torch.tensor([wild[i % len(wild)] for i in seen[-labels.shape[0]:]])

    clipped = heldout_scores(trainer, heldout, user).tolist()
    assert clipped[:6] == [0.0, 1.0, 0.0, 1.0, 0.0, 0.25]
    with pytest.raises(ValueError, match="one score per example"):
        heldout_scores(trainer, heldout, lambda logits, labels: logits)


def test_one_example_moves_the_score_sum_by_at_most_one_whatever_the_score_function(data, tmp_path):
    """The DP score's sensitivity is 1 only if each row's score reads that row alone: a score function with a
    batch-level term (here every row scores the batch's first prediction) is called on one example at a time, so
    removing one held-out example moves the sum by at most 1 (it moved it by up to the eval batch size)."""
    import torch

    from hf_dp.tuning.private_score import heldout_scores, unit_sum

    _, _, heldout = data
    trainer = _trainer(tmp_path, data, per_device_eval_batch_size=8)

    def batch_level(logits, labels):
        return torch.full((labels.shape[0],), float(logits[0].argmax(-1) == labels[0]))

    full, _ = unit_sum(heldout_scores(trainer, heldout, batch_level))
    for i in (0, 1, 8):
        rest = heldout.select([r for r in range(len(heldout)) if r != i])
        less, _ = unit_sum(heldout_scores(trainer, rest, batch_level))
        assert abs(full - less) <= 1.0 + 1e-12, (i, full, less)
    assert full == unit_sum(heldout_scores(trainer, heldout))[0]  # one row at a time, it is that row's accuracy


class _Recorder:
    """A callback that records what it is shown."""

    def __init__(self):
        from transformers import TrainerCallback

        outer = self
        self.evaluate, self.predict, self.logs = [], [], []

        class CB(TrainerCallback):
            def on_evaluate(self, args, state, control, metrics=None, **kw):
                outer.evaluate.append(dict(metrics or {}))

            def on_predict(self, args, state, control, metrics=None, **kw):
                outer.predict.append(dict(metrics or {}))

            def on_log(self, args, state, control, logs=None, **kw):
                outer.logs.append(dict(logs or {}))

        self.callback = CB()


def _distinctive(logits, labels):
    """A per-example score whose exact mean is no round number (a probability, scaled)."""
    import torch

    return torch.softmax(logits.float(), -1)[:, 1] * 0.987


def test_a_private_score_releases_the_noisy_score_only(data, tmp_path, monkeypatch, trial_dirs, capsys, caplog):
    """score_data='private' on the eval set (held-out private rows): no evaluate() (no on_evaluate / on_predict, no
    eval_* in log_history, also with eval_strategy='steps' on the trainer), no exact score of any trial in the logs,
    stdout, privacy.json or the card; the record holds the noisy score, σ_s and the composed total."""
    import logging

    import hf_dp.tuning.private_score as sel
    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model

    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 2)
    exact = []  # each trial's exact mean score, as the library computed it (the value that must not leave)
    unit_sum = sel.unit_sum

    def recording(scores, units=None):
        total, n = unit_sum(scores, units)
        exact.append(total / n)
        return total, n

    monkeypatch.setattr(sel, "unit_sum", recording)
    tok, train, heldout = data
    recorder = _Recorder()
    args = dp_args(tmp_path / "out", epsilon=3.0, max_steps=2, per_device_train_batch_size=64, eval_strategy="steps",
                   eval_steps=1, logging_steps=1)
    trainer = DPTrainer(model=make_model(), args=args, train_dataset=train, eval_dataset=heldout,
                        data_collator=make_collator(tok), callbacks=[recorder.callback])
    inits = _Inits()
    best = _search(trainer, inits, score_data="private", direction="maximize", example_score=_distinctive)
    assert recorder.evaluate == [] and recorder.predict == [] and len(recorder.logs) >= 2  # training logs went out
    history = trainer.state.log_history
    assert history and not any(k.startswith(("eval_", "test_")) for entry in history for k in entry)
    scores = [t["objective"] for t in best.run_summary["trials"]]
    assert len(scores) == len(exact) == 2 and all(abs(s - e) > 1e-9 for s, e in zip(scores, exact))  # noisy
    assert all(0.01 < e < 0.98 and round(e, 3) != e for e in exact)  # distinctive numbers, to look for
    record = trainer.hyperparameter_selection
    assert record["score"]["selected_trial_score"] == best.objective == max(scores)
    assert record["score"]["declared_public"] is False and "held-out private data" in record["score"]["data"]
    dp = record["score"]["dp_score"]
    assert dp["noise_multiplier"] == 20.0 and dp["heldout_units"] == len(heldout) and dp["sensitivity"] == 1.0
    assert dp["score_std"] == pytest.approx(20.0 / len(heldout))
    assert record["total_epsilon"] <= 3.0 and record["per_trial_epsilon"] > record["per_trial_training_epsilon"]
    assert "ComposedDpEvent" in record["accountant"]
    out = tmp_path / "release"
    trainer.save_model(str(out))
    privacy_text = (out / "privacy.json").read_text()
    card = (out / "README.md").read_text()
    assert json.loads(privacy_text)["hyperparameter_selection"]["score"]["dp_score"]["noise_multiplier"] == 20.0
    assert "held-out part of the private data through a DP score" in card
    captured = capsys.readouterr()
    texts = {"log_history": json.dumps(history), "privacy.json": privacy_text, "card": card, "stdout": captured.out,
             "stderr": captured.err, "logging": caplog.text, "callbacks": json.dumps(recorder.logs),
             "trainer_state": json.dumps(trainer.state.log_history)}
    for value in exact:
        for shown in {repr(value), f"{value:.6g}", f"{value:.8f}"}:
            leaks = [name for name, text in texts.items() if shown in text]
            assert not leaks, (shown, leaks)


@pytest.mark.parametrize("source", ["os_entropy", "dp_seed", "csprng"])
def test_each_trial_draws_its_score_noise_from_the_run_source(data, tmp_path, monkeypatch, trial_dirs, source):
    import hf_dp.tuning.private_score as sel

    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 2)
    calls = []
    original = sel.score_noise

    def recording(sigma, **kw):
        calls.append(dict(kw, sigma=sigma))
        return original(sigma, **kw)

    monkeypatch.setattr(sel, "score_noise", recording)
    kw = {"dp_seed": dict(dp_seed=7), "csprng": dict(dp_seed=None, secure_rng=True), "os_entropy": dict(dp_seed=None)}[source]
    trainer = _trainer(tmp_path, data, **kw)
    _search(trainer, _Inits(), score_data="private", direction="maximize", score_noise_multiplier=30.0)
    assert [c["sigma"] for c in calls] == [30.0, 30.0]
    assert [c["secure"] for c in calls] == [source == "csprng"] * 2
    assert [c["seed"] for c in calls] == [7 if source == "dp_seed" else None] * 2
    assert [c["key"] for c in calls] == [(0,), (1,)]
    assert trainer.hyperparameter_selection["score"]["dp_score"]["noise_multiplier"] == 30.0


def test_a_private_score_on_a_score_dataset_keeps_the_eval_set(data, tmp_path, monkeypatch, trial_dirs):
    """score_dataset= (held-out private rows) apart from the eval set: the trials are scored on it, the released
    trainer keeps its own eval set; an overlap with the training set and a missing held-out set are refused."""
    from tests.helpers import make_pair_dataset

    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 1)
    tok, train, heldout = data
    other = make_pair_dataset(tok, n=10, seed=3)
    trainer = _trainer(tmp_path, data)
    _search(trainer, _Inits(), score_data="private", direction="maximize", score_dataset=other)
    assert trainer.hyperparameter_selection["score"]["dp_score"]["heldout_units"] == 10
    assert trainer.eval_dataset is heldout
    inits = _Inits()
    with pytest.raises(ValueError, match="^the held-out score set is \\(or overlaps\\) the training set"):
        _search(_trainer(tmp_path / "b", data), inits, score_data="private", direction="maximize", score_dataset=train)
    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model

    bare = DPTrainer(model=make_model(), args=dp_args(tmp_path / "c", epsilon=3.0, max_steps=2,
                                                      per_device_train_batch_size=64),
                     train_dataset=train, data_collator=make_collator(tok))
    with pytest.raises(ValueError, match="^score_data='private' scores every trial on held-out private data"):
        _search(bare, inits, score_data="private", direction="maximize")
    assert inits.models == []


def test_after_a_private_score_the_heldout_set_cannot_be_evaluated(data, tmp_path, monkeypatch, trial_dirs):
    """review B3: after score_data='private' on the eval set, a bare evaluate() computed the exact held-out metrics and
    save_model() wrote them into the card and privacy.json. Now evaluate() / predict() on that set (the same object or
    an overlapping Subset) are refused in one sentence; another set evaluates; with score_dataset= apart from the eval
    set, the eval set evaluates and the score set is refused."""
    import torch

    from tests.helpers import make_pair_dataset

    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 1)
    tok, train, heldout = data
    other = make_pair_dataset(tok, n=10, seed=3)
    trainer = _trainer(tmp_path, data)
    _search(trainer, _Inits(), score_data="private", direction="maximize")
    assert trainer.eval_dataset is heldout
    refusal = "^this is \\(or overlaps\\) the held-out private data the private selection scored its trials on"
    for call in (lambda: trainer.evaluate(), lambda: trainer.evaluate(eval_dataset=heldout),
                 lambda: trainer.evaluate(eval_dataset=torch.utils.data.Subset(heldout, [3, 5])),
                 lambda: trainer.evaluate(eval_dataset={"a": other, "b": heldout}), lambda: trainer.predict(heldout)):
        with pytest.raises(ValueError, match=refusal) as info:
            call()
        assert "\n" not in str(info.value) and "evaluate on another dataset" in str(info.value)
    assert not any(k.startswith(("eval_", "test_")) for entry in trainer.state.log_history for k in entry)
    metrics = trainer.evaluate(eval_dataset=other)  # other data: evaluated as usual
    assert "eval_loss" in metrics
    out = tmp_path / "release"
    trainer.save_model(str(out))
    assert (out / "model.safetensors").exists()

    apart = _trainer(tmp_path / "apart", data)
    _search(apart, _Inits(), score_data="private", direction="maximize", score_dataset=other)
    assert "eval_loss" in apart.evaluate()  # the eval set was not scored on
    with pytest.raises(ValueError, match=refusal):
        apart.evaluate(eval_dataset=other)
    public = _trainer(tmp_path / "public", data)
    _search(public, _Inits(), score_data="public")
    assert "eval_loss" in public.evaluate()  # a public score set: nothing to refuse


def test_the_default_dp_score_needs_one_label_per_example():
    from types import SimpleNamespace

    from hf_dp.tuning.private_score import check_private_score

    for config in (SimpleNamespace(problem_type="regression", num_labels=1),
                   SimpleNamespace(problem_type="multi_label_classification", num_labels=3)):
        args = SimpleNamespace(dataloader_drop_last=False, privacy_unit_column=None)
        pieces = dict(eval_dataset=[1, 2], model=SimpleNamespace(config=config), objective=None)
        with pytest.raises(ValueError, match="^the default DP score is the accuracy of one label per example"):
            check_private_score(args, None, None, None, None, None, "maximize", **pieces)
        check_private_score(args, None, None, None, lambda logits, labels: logits[:, 0], None, "maximize", **pieces)


def test_the_recipe_holdout_is_a_fresh_random_split(tmp_path):
    from datasets import Dataset, DatasetDict

    from recipes.common.tune import HOLDOUT, carve_holdout
    from tests.helpers import dp_args

    def split(fraction, dp_seed=None, **kw):
        raw = DatasetDict({"train": Dataset.from_dict({"i": list(range(2000))})})
        tune = type("T", (), dict(tune="learning_rate=1e-3", tune_score="private", tune_holdout_fraction=fraction))()
        n = carve_holdout(raw, tune, dp_args(tmp_path / "unused", dp_seed=dp_seed, **kw), max_train_samples=1600)
        held = raw[HOLDOUT]["i"]
        assert n == len(raw["train"]) and n + len(held) == 1600 and not set(held) & set(raw["train"]["i"])
        return held

    a, b = split(0.25), split(0.25)
    assert a != b  # fresh randomness, not an index rule
    assert abs(len(a) - 400) < 5 * math.sqrt(1600 * 0.25 * 0.75)
    assert split(0.25, dp_seed=3) == split(0.25, dp_seed=3) != split(0.25, dp_seed=4)
    assert abs(len(split(0.1, secure_rng=True)) - 160) < 5 * math.sqrt(1600 * 0.1 * 0.9)


# ------------------------------------------------------------------- adversarial review of the DP score (review C)
def test_a_callback_cannot_make_a_trial_evaluate_the_heldout_set(data, tmp_path, monkeypatch, trial_dirs):
    """review C1: the trials run with eval_strategy 'no', but a callback may set control.should_evaluate; the trial then
    evaluated the held-out private set (the eval set) and its exact eval_loss reached on_evaluate, the log line and the
    released trainer's log_history. A trial now refuses to evaluate the held-out set, in one sentence."""
    from transformers import TrainerCallback

    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model

    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 1)
    seen = []

    class Force(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            control.should_evaluate = True

        def on_evaluate(self, args, state, control, metrics=None, **kw):
            seen.append(dict(metrics or {}))

    tok, train, heldout = data
    trainer = DPTrainer(model=make_model(), args=dp_args(tmp_path / "out", epsilon=3.0, max_steps=2,
                                                         per_device_train_batch_size=64),
                        train_dataset=train, eval_dataset=heldout, data_collator=make_collator(tok), callbacks=[Force()])
    with pytest.raises(ValueError, match="^this is \\(or overlaps\\) the held-out private data the private selection"):
        _search(trainer, _Inits(), score_data="private", direction="maximize")
    assert seen == []
    assert not any(k.startswith("eval_") for entry in trainer.state.log_history for k in entry)
    assert getattr(trainer, "hyperparameter_selection", None) is None


def _tokens(dataset) -> int:
    return sum(sum(row["attention_mask"]) for row in dataset)


def test_the_score_set_cache_does_not_log_its_token_count(data, tmp_path, monkeypatch, trial_dirs, caplog):
    """review C2: under --cache_frozen_features the held-out score set's frozen-prefix cache logged 'N rows, X KiB of
    float32 states': X is the held-out set's total token count × hidden size × 4 bytes, an exact statistic of the
    held-out private data (one example more or less moves it). The score set is now cached without that line."""
    import logging

    from hf_dp.models.prefix_cache import _size
    from tests.helpers import make_pair_dataset

    caplog.set_level(logging.DEBUG)
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 2)
    tok, _, _ = data
    other = make_pair_dataset(tok, n=10, seed=3)
    size = _size(_tokens(other) * 16 * 4)  # tests.helpers' hidden size 16, float32
    trainer = _trainer(tmp_path, data, trainable="last_block", cache_frozen_features=True)
    caplog.clear()
    _search(trainer, _Inits(), score_data="private", direction="maximize", score_dataset=other,
            hp_space={"learning_rate": [1e-3], "trainable": ["last_block", "last_k:2"]})
    assert size not in caplog.text and "prefix cache (score)" not in caplog.text, caplog.text[-2000:]


def test_the_winners_own_cache_of_the_heldout_set_is_refused_too(data, tmp_path, monkeypatch, trial_dirs):
    """review C3: when the search space moves the frozen prefix (trainable), the winning trial cached the eval set (the
    held-out set) with its own prefix; the released trainer's eval set was that cache, which the refusal did not know,
    so a bare evaluate() computed and logged the exact held-out metrics."""
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 1)
    trainer = _trainer(tmp_path, data, trainable="last_block", cache_frozen_features=True)
    _search(trainer, _Inits(), score_data="private", direction="maximize",
            hp_space={"learning_rate": [1e-3], "trainable": ["last_k:2"]})
    with pytest.raises(ValueError, match="^this is \\(or overlaps\\) the held-out private data"):
        trainer.evaluate()
    with pytest.raises(ValueError, match="^this is \\(or overlaps\\) the held-out private data"):
        trainer.predict(trainer.eval_dataset)
    assert not any(k.startswith("eval_") for entry in trainer.state.log_history for k in entry)


def test_delta_must_be_below_one_over_the_private_rows_with_the_heldout_set(data, tmp_path):
    """review C4: δ < 1/N was checked on the training rows only; the held-out score set is private data too, so the
    selection's δ must be below 1/(N + n) (a δ in between allows releasing one whole record of the union)."""
    from tests.helpers import make_pair_dataset

    tok, train, heldout = data  # N = 64, n = 24: 1/88 < 0.0125 < 1/64
    inits = _Inits()
    trainer = _trainer(tmp_path, data, delta=0.0125)
    with pytest.raises(ValueError, match=r"^delta=0\.0125 is not below 1/\(N \+ n\) = 1/88"):
        _search(trainer, inits, score_data="private", direction="maximize")
    other = make_pair_dataset(tok, n=10, seed=3)  # N + n = 74 < 80: accepted by the check
    from hf_dp.tuning.private_score import check_private_score

    check_private_score(trainer.args, trainer.dp.spec, other, None, None, None, "maximize",
                        train_sets=(trainer._fingerprint_source, trainer.train_dataset), model=trainer.model,
                        objective=trainer.objective)
    assert inits.models == []


def test_a_collator_that_makes_several_rows_per_example_is_refused_without_a_count(data, tmp_path, monkeypatch,
                                                                                   trial_dirs):
    """review C5: a collator emitting a data-dependent number of rows per example (here: one extra row per positive
    example) was caught only after the whole set was scored, by an error whose message held the number of rows scored
    — n plus the number of positives of the held-out set, an exact statistic. It is now refused at the first batch
    whose row count is not its number of examples, with public numbers only."""
    import torch

    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model

    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 1)
    tok, train, heldout = data
    pad = make_collator(tok)

    def expanding(features):
        batch = pad(features)
        extra = [i for i, f in enumerate(features) if int(f["labels"]) == 1]
        if not extra or "labels" not in batch or batch["labels"].shape[0] != len(features):
            return batch
        return {k: torch.cat([v, v[extra]]) for k, v in batch.items()}

    class Expanding(DPTrainer):  # the training batches as usual, the held-out ones expanded
        def get_test_dataloader(self, test_dataset):
            loader = super().get_test_dataloader(test_dataset)
            loader.collate_fn = expanding
            return torch.utils.data.DataLoader(loader.dataset, batch_size=self.args.eval_batch_size,
                                               collate_fn=expanding)

    trainer = Expanding(model=make_model(), args=dp_args(tmp_path / "out", epsilon=3.0, max_steps=2,
                                                         per_device_train_batch_size=64, remove_unused_columns=False),
                        train_dataset=train, eval_dataset=heldout, data_collator=pad)
    positives = sum(int(r["labels"]) == 1 for r in heldout)
    assert 0 < positives < len(heldout)
    with pytest.raises(ValueError, match="one row per example") as info:
        _search(trainer, _Inits(), score_data="private", direction="maximize")
    message = str(info.value)
    for secret in (len(heldout) + positives, positives):
        assert str(secret) not in message.replace(str(len(heldout)), ""), message


class _SlowFirstRow:
    """A map-style dataset whose row 0 arrives late (a slow worker), so an unordered loader yields batch 1 first."""

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        import time

        if i == 0:
            time.sleep(1.0)
        return self.rows[i]


def test_the_score_reads_the_heldout_rows_in_order(data, tmp_path, monkeypatch, trial_dirs):
    """review C6: a unit's score is the mean of *its* rows' scores, taken by position; with --dataloader_num_workers and
    --dataloader_in_order false the batches arrive as the workers finish them, so the positions held other rows'
    scores (a unit's mean over rows of other units: one unit could then move the sum by more than 1). heldout_scores
    refuses an unordered loader, and the trials of a private selection read the held-out set in order."""
    import torch

    import hf_dp.tuning.private_score as sel
    from hf_dp.tuning.private_score import heldout_scores

    tok, train, heldout = data
    rows = [{k: heldout[i][k] for k in ("input_ids", "token_type_ids", "attention_mask", "labels")}
            for i in range(len(heldout))]
    slow = _SlowFirstRow(rows)
    trainer = _trainer(tmp_path, data, per_device_eval_batch_size=4, dataloader_num_workers=2,
                       dataloader_in_order=False)
    order = [int(b["labels"].shape[0]) and int(b["input_ids"][0, 1]) for b in trainer.get_test_dataloader(slow)]
    assert order[0] != rows[0]["input_ids"][1]  # the danger is real: the first batch delivered is not batch 0
    with pytest.raises(ValueError, match="^the DP score reads the held-out rows in their order"):
        heldout_scores(trainer, slow)
    in_order = []
    original = sel.heldout_scores

    def spy(t, dataset, example_score=None):
        in_order.append((t.args.dataloader_in_order, t.args.dataloader_drop_last))
        return original(t, dataset, example_score)

    monkeypatch.setattr(sel, "heldout_scores", spy)
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 1)
    searched = _trainer(tmp_path / "s", data, dataloader_num_workers=1, dataloader_in_order=False)
    _search(searched, _Inits(), score_data="private", direction="maximize")
    assert in_order == [(True, False)]
    del torch
