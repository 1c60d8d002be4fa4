"""The Gaussian-DP (f-DP) one-run estimate (Mahloujifar, Melis & Chaudhuri, "Auditing f-differential privacy in one
run", 2024), beside the Steinke–Nasr–Jagielski bound of :mod:`hf_dp.audit.one_run_bound`.

The game is the same: m canaries, each included independently with probability ½; the auditor makes r guesses
(k₊ "included" on the highest scores, k₋ "excluded" on the lowest, abstaining on the rest) and v of them are right.
Steinke et al. bound P[v correct] under (ε, δ)-DP, which for a Gaussian mechanism is loose: (ε, δ)-DP is the worst
mechanism with that (ε, δ), far from the Gaussian's trade-off curve. Mahloujifar et al. bound it under f-DP for a
whole trade-off function f: if the mechanism is f-DP (with respect to each canary), the probability that an
adversary guessing r of m canaries (alphabet of k = 2: in / out) gets at least v right is at most τ whenever the
following recursion ends with r₀ + h₀ > r/m (their guessing-game theorem with abstentions; the sequences bound the
mass of the events "exactly i guesses right" from v down to 0):

    a = τ·r/m;  h_v = a·(r − v)/r,  ρ_v = a·v/r
    for i = v−1, …, 0:   h_i = max(h_{i+1}, (k − 1)·f̄⁻¹(ρ_{i+1})),   ρ_i = ρ_{i+1} + i/(r − i) · (h_i − h_{i+1})

with f̄⁻¹ the inverse of the "blow-up" x ↦ 1 − f(x). For μ-Gaussian DP, f(x) = Φ(Φ⁻¹(1 − x) − μ), so the blow-up is
x ↦ Φ(Φ⁻¹(x) + μ) and its inverse x ↦ Φ(Φ⁻¹(x) − μ). When the recursion's end exceeds r/m, "the run is μ-GDP" is
rejected at level τ. The rejection is monotone in μ (f̄⁻¹ decreases in μ and the recursion is monotone in it), so the
rejected μ form an interval [0, μ̂): :func:`gdp_lower_bound` returns the largest μ found rejected (by a grid, then a
finer grid in the bracket; the returned μ was itself tested and rejected). With the guess sets of
:func:`hf_dp.audit.one_run_bound.guess_sets` tried at τ = β/#sets each (Bonferroni), P[μ̂ > μ_true] ≤ β.

What it says. μ̂ is a 1 − β lower bound on μ *for the family of Gaussian trade-off curves*: it refutes "the run is
μ-GDP" for μ < μ̂. The ε it gives, ε̂ = ε_μ̂(δ) (the Gaussian mechanism's privacy profile, δ(ε) = Φ(−ε/μ + μ/2) −
e^ε Φ(−ε/μ − μ/2)), is an *estimate* of the run's ε at δ under the hypothesis that its trade-off curve is Gaussian
(DP-SGD's is, approximately, by the central limit theorem over many steps): tighter than Steinke et al.'s bound for a
Gaussian-like mechanism, but not assumption-free. Steinke et al.'s ε_lower stays the verdict's bound. It imports
nothing of hf_dp but :mod:`hf_dp.audit.one_run_bound`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hf_dp.audit.one_run_bound import _check_counts, _check_probability, count_correct, guess_sets

METHOD = "Gaussian-DP one-run estimate (Mahloujifar, Melis, Chaudhuri 2024)"
#: the largest μ searched (μ = 50 is ε ≈ 1 250 at δ = 1e-5: far beyond any claim)
MU_MAX = 50.0


def _inverse_blow_up(x: np.ndarray, mu: np.ndarray) -> np.ndarray:
    """Φ(Φ⁻¹(x) − μ), elementwise (x in [0, 1]; 0 at x = 0)."""
    from scipy.special import ndtr, ndtri

    with np.errstate(divide="ignore", invalid="ignore"):
        return ndtr(ndtri(np.clip(x, 0.0, 1.0)) - mu)


def recursion_end(mu, m: int, r: int, v: int, tau: float) -> np.ndarray:
    """ρ₀ + h₀ of the module docstring's recursion for μ-GDP (``mu`` a scalar or an array: one value each)."""
    m, r, v = _check_counts(m, r, v)
    mu = np.atleast_1d(np.asarray(mu, dtype=np.float64))
    if r == 0:
        return np.zeros_like(mu)
    a = tau * r / m
    h = np.full_like(mu, a * (r - v) / r)
    rho = np.full_like(mu, a * v / r)
    for i in range(v - 1, -1, -1):
        h_new = np.maximum(h, _inverse_blow_up(rho, mu))  # (k − 1) = 1 for in/out guesses
        rho = rho + (i / (r - i)) * (h_new - h)
        h = h_new
    return rho + h


def rejects(mu, m: int, r: int, v: int, tau: float) -> np.ndarray:
    """True where "the run is μ-GDP" is rejected at level ``tau`` by ``v`` correct of ``r`` guesses on ``m`` canaries."""
    m, r, v = _check_counts(m, r, v)
    return recursion_end(mu, m, r, v, tau) > r / m


def gdp_lower_bound(m: int, r: int, v: int, tau: float, mu_max: float = MU_MAX) -> float:
    """μ̂: the largest μ ∈ [0, ``mu_max``] whose μ-GDP hypothesis ``v`` correct of ``r`` guesses reject at level
    ``tau`` (0 if none). Grid of 256 points, then 256 in the bracket; the value returned was tested and rejected."""
    m, r, v = _check_counts(m, r, v)
    tau = _check_probability("tau (the test's level)", tau, zero_ok=False)
    if v == 0 or r == 0:
        return 0.0
    lo, hi = 0.0, float(mu_max)
    best = 0.0
    for _ in range(2):
        grid = np.linspace(lo, hi, 256)
        rej = rejects(grid, m, r, v, tau)
        if not rej.any():
            return best
        j = int(np.flatnonzero(rej).max())  # down-closed: every grid point below j is rejected too
        best = max(best, float(grid[j]))
        if j == len(grid) - 1:
            return best
        lo, hi = float(grid[j]), float(grid[j + 1])
    return best


def gdp_delta(epsilon: float, mu: float) -> float:
    """δ(ε) of μ-GDP: Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2) (Dong, Roth & Su 2019)."""
    from scipy.special import log_ndtr, ndtr

    if mu <= 0:
        return 0.0
    first = ndtr(-epsilon / mu + mu / 2)
    second = math.exp(epsilon + float(log_ndtr(-epsilon / mu - mu / 2)))
    return max(0.0, float(first - second))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The smallest ε with δ_μ(ε) ≤ ``delta`` (0 if δ_μ(0) ≤ δ; ``inf`` for δ = 0 and μ > 0)."""
    from scipy.optimize import brentq

    if mu <= 0 or gdp_delta(0.0, mu) <= delta:
        return 0.0
    if delta <= 0:
        return math.inf
    hi = 1.0
    while gdp_delta(hi, mu) > delta:
        hi *= 2.0
        if hi > 1e6:
            return math.inf
    return float(brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-10))


@dataclass
class GdpEstimate:
    mu_lower: float
    epsilon: float  # ε_μ̂(δ): the estimate under the Gaussian-DP hypothesis
    canaries: int
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    delta: float
    confidence: float
    guess_sets: int
    tried: list = field(default_factory=list)  # (k_plus, k_minus, correct, mu) per set


def gdp_audit_scores(scores, included, delta: float, beta: float = 0.05, guesses=None) -> GdpEstimate:
    """μ̂ and ε̂ from canary ``scores`` and the secret ``included`` bits: every guess set (default
    :func:`~hf_dp.audit.one_run_bound.guess_sets`) tested at β/#sets, the largest μ̂ reported."""
    inc = np.asarray(included, dtype=bool)
    m = len(inc)
    if m < 1:
        raise ValueError("error: the audit needs at least one canary")
    beta = _check_probability("beta (1 - confidence)", beta, zero_ok=False)
    sets = guess_sets(m) if guesses is None else [(int(a), int(b)) for a, b in guesses]
    if not sets:
        raise ValueError("error: at least one guess set (k_plus, k_minus) is needed")
    tau = beta / len(sets)
    tried, best = [], None
    for kp, km in sets:
        r, v = count_correct(scores, inc, kp, km)
        mu = gdp_lower_bound(m, r, v, tau)
        tried.append((kp, km, v, mu))
        if best is None or mu > best[3]:
            best = (kp, km, v, mu)
    kp, km, v, mu = best
    return GdpEstimate(mu, gdp_epsilon(mu, float(delta)), m, kp + km, v, kp, km, float(delta), 1.0 - beta, len(sets), tried)


def gdp_record(est: GdpEstimate) -> dict:
    """The ``gaussian_dp`` entry of ``privacy.json``'s ``audit`` record."""
    return {
        "method": METHOD,
        "mu_lower_bound": est.mu_lower,
        "epsilon_estimate": est.epsilon,
        "guesses": est.guesses,
        "correct": est.correct,
        "confidence": round(est.confidence, 10),
        "delta": est.delta,
        "guess_sets_tried": est.guess_sets,
        "note": "an estimate under the hypothesis that the run's trade-off curve is Gaussian (mu-GDP is refuted for "
                "mu below mu_lower_bound at this confidence); the assumption-free bound is epsilon_lower_bound",
    }
