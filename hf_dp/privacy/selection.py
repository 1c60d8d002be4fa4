"""The privacy cost of private hyper-parameter selection: best of a random number K of DP runs.

**The algorithm** (Papernot & Steinke, "Hyperparameter Tuning with Renyi Differential Privacy", ICLR 2022,
arXiv:2110.03620): draw K from a distribution fixed in advance (independent of the data); run K independent trials —
each a full DP training run Q with a configuration drawn from the search space and fresh randomness — and release the
best trial's output (its model, its configuration, its score) and nothing else: not the other trials, **not K**.

**The bound** (Rényi DP of order λ). Let each trial Q be (λ, ε(λ))-RDP for every order λ (here: the Poisson-subsampled
Gaussian mechanism (q, σ) composed over the run's T steps).

* K ~ truncated negative binomial D_{η,γ}, η ≥ 0, γ ∈ (0, 1]:
  P[K = k] = (1-γ)^k / (γ^{-η} - 1) · Π_{ℓ=0}^{k-1} (ℓ+η)/(ℓ+1) for k ≥ 1 (η = 0, the logarithmic distribution:
  P[K = k] = (1-γ)^k / (k·log(1/γ)); η = 1, the geometric: P[K = k] = γ(1-γ)^{k-1}), with
  E[K] = η(1-γ) / (γ(1-γ^η)) (η = 0: (1/γ - 1)/log(1/γ)). **Theorem 2**: for all λ > 1 and λ̂ ≥ 1 the selection is
  (λ, ε')-RDP with

      ε' = ε(λ) + (1+η)·(1 - 1/λ̂)·ε(λ̂) + (1+η)·log(1/γ)/λ̂ + log(E[K])/(λ-1),

  minimised over λ̂.
* K ~ Poisson(μ) (K = 0 happens with probability e^{-μ}: nothing trained, the model from ``model_init`` released).
  **Theorem 6**: if Q is also (ε̂, δ̂)-DP with e^{ε̂} ≤ 1 + 1/(λ-1), the selection is (λ, ε')-RDP with

      ε' = ε(λ) + μ·δ̂ + log(μ)/(λ-1).

**A trial scored on held-out private data** (``score_data="private"``, :mod:`hf_dp.tuning.private_score`): Q is then the DP
training run *followed by* the DP score — the sum of per-example (per-unit) scores in [0, 1] released with Gaussian
noise N(0, σ_s²), sensitivity 1 under add/remove of one unit — so Q's curve is their sequential composition,
ε(λ) = ε_train(λ) + λ/(2σ_s²) (it holds whether or not the held-out rows are also training rows), and the theorems
above apply to that curve: the score's cost enters the total once per trial, inside the selection.

The resulting curve is converted to (ε, δ) as any RDP curve. The computation is dp-accounting's
(``RdpAccountant`` with ``RepeatAndSelectDpEvent`` of a ``SelfComposedDpEvent`` of a ``PoissonSampledDpEvent`` of a
``GaussianDpEvent`` — with a DP score, a ``ComposedDpEvent`` of that and the score's ``GaussianDpEvent(σ_s)``: the
per-trial curve, the theorems above with the minimum over λ̂ on the order grid, then the RDP-to-(ε, δ) conversion);
``tests/test_selection.py`` re-computes Theorems 2 and 6 independently from Opacus' RDP curve (plus λ/(2σ_s²) for a
DP score) and checks both against the exact Rényi divergence of a best-of-K selection on a two-point mechanism.

**Why K stays secret.** The bound is on the distribution of the released output alone; the pair (K, output) can be
far less private (given K = k, the best of k runs costs up to k times one run). So K drawn, the number of trials
run, the other trials' scores and the search's wall time are not part of the release (:mod:`hf_dp.tuning.search` keeps
them out of privacy.json and the card).

:func:`calibrate_selection_sigma` finds the per-trial σ (for the trials' q and steps, and the score's σ_s) for which
the total ε of the selection at δ meets a target, by bisection on σ.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import math
from dataclasses import dataclass

from .accounting import check_delta, check_epsilon, check_sample_rate

#: what the DPTrainers made in a :func:`plan_context` are to a private selection, for their start-of-run plan line
#: (``hf_dp.run.setup``): None (a run of their own), :data:`HOLDER` (a trainer that only holds a selection: the single
#: run its σ is planned for is never made, so its plan is not printed) or a note for a trial's ε ("per trial (rdp, …)")
_PLAN_CONTEXT: contextvars.ContextVar = contextvars.ContextVar("hf_dp_selection_plan", default=None)
HOLDER = "holder"


@contextlib.contextmanager
def plan_context(role):
    """DPTrainers made inside: ``HOLDER`` (e.g. a recipe's trainer under ``--tune``) or a trial's note."""
    token = _PLAN_CONTEXT.set(role)
    try:
        yield
    finally:
        _PLAN_CONTEXT.reset(token)


def plan_role():
    """The :func:`plan_context` of a DPTrainer being made: None, :data:`HOLDER` or a trial's note."""
    return _PLAN_CONTEXT.get()

#: Rényi orders of the computation: dense near 1 (the λ̂ of Theorem 2 and small ε) up to 1024
ORDERS = tuple(
    [round(1.0 + i / 100.0, 4) for i in range(1, 10)] + [round(1.0 + i / 10.0, 4) for i in range(1, 100)]
    + [float(x) for x in range(11, 64)] + [80.0, 96.0, 128.0, 192.0, 256.0, 384.0, 512.0, 1024.0]
)

#: σ_s of the DP score when none is given: the noisy mean score's standard deviation is σ_s/n on n held-out units
#: (1 point of accuracy on 2,000 rows, 0.3 on 6,700 — a 10 % hold-out of SST-2), and one score alone is the Gaussian
#: mechanism at σ 20 (RDP λ/800; ε ≈ 0.25 at δ = 1e-5), a small part of a total ε of a few units
DEFAULT_SCORE_NOISE_MULTIPLIER = 20.0

#: the DP score may take at most this share of the selection's total ε (more leaves the training too little budget)
MAX_SCORE_SHARE = 0.5

#: the distributions of the number of trials K, by name: their shape η (``inf``: Poisson)
DISTRIBUTIONS = {"logarithmic": 0.0, "geometric": 1.0, "negative_binomial": None, "poisson": math.inf}


@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials K: ``name`` (one of :data:`DISTRIBUTIONS`), its mean E[K] and, for
    ``negative_binomial``, its shape η > 0 (``logarithmic``: η = 0, ``geometric``: η = 1)."""

    name: str
    mean: float
    eta: float | None = None

    def __post_init__(self):
        if self.name not in DISTRIBUTIONS:
            raise ValueError(f"the distribution of the number of trials must be one of {sorted(DISTRIBUTIONS)}, "
                             f"got {self.name!r}")
        if not isinstance(self.mean, (int, float)) or math.isnan(self.mean) or math.isinf(self.mean) or self.mean < 1:
            raise ValueError(f"the expected number of trials must be a finite number >= 1, got {self.mean!r}")
        if self.name == "negative_binomial":
            if not isinstance(self.eta, (int, float)) or math.isnan(self.eta) or not 0 < self.eta < math.inf:
                raise ValueError(f"the negative binomial distribution needs a shape eta > 0, got {self.eta!r} "
                                 "(eta = 0 is 'logarithmic', eta = 1 'geometric')")
        elif self.eta is not None and float(self.eta) != (DISTRIBUTIONS[self.name]):
            raise ValueError(f"the {self.name} distribution has no free shape parameter (got eta={self.eta!r})")

    @property
    def shape(self) -> float:
        """η (``math.inf`` for Poisson), as dp-accounting's ``RepeatAndSelectDpEvent`` takes it."""
        return float(self.eta) if self.name == "negative_binomial" else DISTRIBUTIONS[self.name]

    @property
    def gamma(self) -> float | None:
        """γ of the truncated negative binomial with this mean (``None`` for Poisson)."""
        return None if self.name == "poisson" else _gamma_for_mean(self.shape, float(self.mean))

    def pmf(self, k: int) -> float:
        """P[K = k]."""
        if self.name == "poisson":
            mu = float(self.mean)
            return math.exp(-mu + k * math.log(mu) - math.lgamma(k + 1)) if k >= 0 else 0.0
        if k < 1:
            return 0.0
        eta, gamma = self.shape, self.gamma
        if gamma >= 1.0:
            return 1.0 if k == 1 else 0.0
        if eta == 0:
            return math.exp(k * math.log1p(-gamma) - math.log(k) - math.log(math.log(1.0 / gamma)))
        log_coef = math.lgamma(k + eta) - math.lgamma(eta) - math.lgamma(k + 1)  # Π (ℓ+η)/(ℓ+1)
        return math.exp(log_coef + k * math.log1p(-gamma) - math.log(math.expm1(-eta * math.log(gamma))))

    def sample(self, uniform) -> int:
        """One draw of K by inversion of the CDF, from ``uniform()`` (a callable giving a uniform in [0, 1))."""
        u, k, cdf = float(uniform()), (0 if self.name == "poisson" else 1), 0.0
        while True:
            cdf += self.pmf(k)
            if u < cdf or k > 10_000_000:
                return k
            if cdf >= 1.0 - 1e-15 and self.pmf(k) < 1e-300:  # the floating-point tail: the last k with mass
                return k
            k += 1

    def describe(self) -> dict:
        out = {"name": self.name, "mean": float(self.mean)}
        if self.name == "poisson":
            out.update(support="K >= 0 (K = 0: no trial, the untrained model_init model is released)",
                       theorem="Papernot & Steinke 2022, Theorem 6")
        else:
            out.update(eta=self.shape, gamma=self.gamma, support="K >= 1",
                       theorem="Papernot & Steinke 2022, Theorem 2")
        return out


def expected_trials(eta: float, gamma: float) -> float:
    """E[K] of the truncated negative binomial D_{η,γ}: η(1-γ)/(γ(1-γ^η)); η = 0: (1/γ - 1)/log(1/γ)."""
    if gamma >= 1.0:
        return 1.0
    if eta == 0:
        return (1.0 / gamma - 1.0) / math.log(1.0 / gamma)
    return eta * (1.0 - gamma) / (gamma * -math.expm1(eta * math.log(gamma)))


@functools.lru_cache(maxsize=256)
def _gamma_for_mean(eta: float, mean: float) -> float:
    """γ with E[K] = ``mean`` (E[K] decreases in γ; bisection on log γ)."""
    if mean <= 1.0:
        return 1.0
    if eta == 1.0:
        return 1.0 / mean
    lo, hi = 1e-300, 1.0  # E[K](lo) > mean >= E[K](hi) = 1
    for _ in range(200):
        mid = math.sqrt(lo * hi) if lo > 0 else hi / 2
        if expected_trials(eta, mid) > mean:
            lo = mid
        else:
            hi = mid
        if hi / lo < 1 + 1e-13:
            break
    return hi


@contextlib.contextmanager
def _quiet_absl():
    """dp-accounting logs (through absl) each fractional order whose series does not converge (large q, orders near
    1) and leaves that order out, which can only loosen the bound: not a message for the user."""
    log = logging.getLogger("absl")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


def check_score_noise_multiplier(value) -> float:
    """σ_s of a DP score: a finite number > 0 (one sentence otherwise)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"score_noise_multiplier (the DP score's noise sigma_s, sensitivity 1) must be a finite number "
                         f"> 0, got {value!r}")
    return float(value)


def _trial_event(sigma: float, q: float, steps: int, score_noise_multiplier: float | None = None):
    """One trial: ``steps`` Poisson-subsampled Gaussian steps (q, σ), then (with ``score_noise_multiplier`` σ_s) the
    Gaussian DP score of sensitivity 1 — sequential composition."""
    import dp_accounting as dpa

    train = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(q, dpa.GaussianDpEvent(sigma)), int(steps))
    if score_noise_multiplier is None:
        return train
    return dpa.ComposedDpEvent([train, dpa.GaussianDpEvent(float(score_noise_multiplier))])


def _epsilon(event, delta: float) -> float:
    from dp_accounting.rdp import RdpAccountant

    acc = RdpAccountant(orders=list(ORDERS))
    with _quiet_absl():
        acc.compose(event)
        return float(acc.get_epsilon(delta))


@functools.lru_cache(maxsize=4096)
def trial_epsilon(sigma: float, sample_rate: float, steps: int, delta: float,
                  score_noise_multiplier: float | None = None) -> float:
    """ε at δ of one trial alone — its training, and its DP score if ``score_noise_multiplier`` is given (the same
    RDP computation as the selection's, without the selection)."""
    return _epsilon(_trial_event(sigma, sample_rate, steps, score_noise_multiplier), delta)


@functools.lru_cache(maxsize=4096)
def selection_epsilon(sigma: float, sample_rate: float, steps: int, delta: float, count: TrialCount,
                      score_noise_multiplier: float | None = None) -> float:
    """ε at δ of releasing the best of K trials, K ~ ``count``, each trial ``steps`` Poisson-subsampled Gaussian steps
    (q, σ) — composed with a Gaussian DP score of noise ``score_noise_multiplier`` (sensitivity 1) when the trials are
    scored on held-out private data: Theorem 2 (truncated negative binomial) or Theorem 6 (Poisson) of Papernot &
    Steinke 2022 (see the module docstring), by dp-accounting's ``RdpAccountant``."""
    import dp_accounting as dpa

    if sigma <= 0:
        return math.inf
    return _epsilon(dpa.dp_event.RepeatAndSelectDpEvent(_trial_event(sigma, sample_rate, steps, score_noise_multiplier),
                                                        float(count.mean), count.shape), delta)


@functools.lru_cache(maxsize=256)
def score_selection_epsilon(score_noise_multiplier: float, delta: float, count: TrialCount) -> float:
    """ε at δ of the selection if the trials' training cost nothing: the DP scores' own share of the total (the limit
    of :func:`selection_epsilon` as the training σ grows)."""
    import dp_accounting as dpa

    return _epsilon(dpa.dp_event.RepeatAndSelectDpEvent(dpa.GaussianDpEvent(float(score_noise_multiplier)),
                                                        float(count.mean), count.shape), delta)


def check_score_share(score_noise_multiplier, target_epsilon: float, delta: float, count: TrialCount) -> float:
    """σ_s checked (:func:`check_score_noise_multiplier`), and refused if the DP scores alone would take more than
    :data:`MAX_SCORE_SHARE` of the selection's total (independent of the training's q and steps). Returns σ_s."""
    sigma = check_score_noise_multiplier(score_noise_multiplier)
    share = score_selection_epsilon(sigma, float(delta), count)
    if share > MAX_SCORE_SHARE * target_epsilon:
        raise ValueError(f"score_noise_multiplier={sigma:g}: the DP scores alone would spend epsilon {share:.3g} of the "
                         f"selection's total {target_epsilon:g} (more than half, leaving the training too little); "
                         "raise it")
    return sigma


@dataclass(frozen=True)
class SelectionPlan:
    """The calibrated mechanism of a private selection: each trial's σ (at its q and steps), its ε alone, and the
    total ε of the selection at δ (≤ the target)."""

    noise_multiplier: float
    sample_rate: float
    steps: int
    delta: float
    count: TrialCount
    total_epsilon: float
    per_trial_epsilon: float
    target_epsilon: float
    #: σ_s of the trials' DP score (held-out private data), None when they are scored on public data
    score_noise_multiplier: float | None = None
    #: ε of one trial's training alone (= per_trial_epsilon without a DP score)
    per_trial_training_epsilon: float | None = None


@functools.lru_cache(maxsize=256)
def calibrate_selection_sigma(target_epsilon: float, delta: float, sample_rate: float, steps: int,
                              count: TrialCount, rel_tolerance: float = 1e-3,
                              score_noise_multiplier: float | None = None) -> SelectionPlan:
    """The smallest σ (to ``rel_tolerance``) such that the best-of-K selection of trials of ``steps`` steps at rate q
    — each followed by a Gaussian DP score of noise ``score_noise_multiplier`` if given — has total ε ≤
    ``target_epsilon`` at ``delta`` (:func:`selection_epsilon`); bisection on σ. A σ_s whose scores alone would take
    more than :data:`MAX_SCORE_SHARE` of the target is refused."""
    check_epsilon(target_epsilon)
    check_delta(delta)
    check_sample_rate(sample_rate)
    if int(steps) <= 0:
        raise ValueError(f"the number of steps must be positive, got {steps}")
    if score_noise_multiplier is not None:
        score_noise_multiplier = check_score_share(score_noise_multiplier, target_epsilon, delta, count)
    total = functools.partial(selection_epsilon, sample_rate=float(sample_rate), steps=int(steps), delta=float(delta),
                              count=count, score_noise_multiplier=score_noise_multiplier)
    hi = 1.0
    while total(hi) > target_epsilon:
        hi *= 2.0
        if hi > 1e6:
            raise ValueError(f"cannot reach a total epsilon={target_epsilon} at delta={delta:g} for the selection "
                             f"({count.name}, E[K]={count.mean:g}) with q={sample_rate:.4g} over {steps} steps")
    lo = hi / 2.0
    while lo > 1e-3 and total(lo) <= target_epsilon:
        hi, lo = lo, lo / 2.0
    while hi - lo > rel_tolerance * hi:
        mid = (lo + hi) / 2.0
        if total(mid) <= target_epsilon:
            hi = mid
        else:
            lo = mid
    sigma = float(hi)
    return SelectionPlan(noise_multiplier=sigma, sample_rate=float(sample_rate), steps=int(steps), delta=float(delta),
                         count=count, total_epsilon=total(sigma),
                         per_trial_epsilon=trial_epsilon(sigma, float(sample_rate), int(steps), float(delta),
                                                         score_noise_multiplier),
                         target_epsilon=float(target_epsilon), score_noise_multiplier=score_noise_multiplier,
                         per_trial_training_epsilon=trial_epsilon(sigma, float(sample_rate), int(steps), float(delta)))
