"""The Gaussian-DP one-run estimate (hf_dp.audit.fdp; Mahloujifar, Melis & Chaudhuri 2024): the recursion against an
independent computation on known counts (plain Python floats, statistics.NormalDist), the search's answer at its
edge, the μ-GDP privacy profile, and coverage on a mechanism with known privacy (a simulated μ-GDP canary game)."""

from __future__ import annotations

import math
from statistics import NormalDist

import numpy as np
import pytest

from hf_dp.audit.fdp import gdp_audit_scores, gdp_delta, gdp_epsilon, gdp_lower_bound, recursion_end, rejects
from hf_dp.audit.one_run_bound import audit_scores

N01 = NormalDist()


def _end_by_hand(mu: float, m: int, r: int, v: int, tau: float) -> float:
    """The paper's recursion for in/out guesses, written out with Python floats: h_v, ρ_v from τ·r/m split by v/r;
    h_i = max(h_{i+1}, Φ(Φ⁻¹(ρ_{i+1}) − μ)), ρ_i = ρ_{i+1} + i/(r − i)·(h_i − h_{i+1})."""
    def inv_blow_up(x):
        if x <= 0:
            return 0.0
        if x >= 1:
            return 1.0
        return N01.cdf(N01.inv_cdf(x) - mu)

    a = tau * r / m
    h, rho = a * (r - v) / r, a * v / r
    for i in range(v - 1, -1, -1):
        h_new = max(h, inv_blow_up(rho))
        rho += i / (r - i) * (h_new - h)
        h = h_new
    return rho + h


@pytest.mark.parametrize("m,r,v,tau", [(100, 10, 9, 0.01), (1000, 100, 80, 0.01), (1000, 500, 300, 0.05),
                                       (200, 200, 200, 0.05), (500, 50, 25, 0.01)])
def test_recursion_matches_an_independent_computation(m, r, v, tau):
    mus = [0.0, 0.3, 1.0, 2.5, 6.0]
    got = recursion_end(mus, m, r, v, tau)
    want = [_end_by_hand(mu, m, r, v, tau) for mu in mus]
    assert got == pytest.approx(want, rel=1e-9, abs=1e-15)
    assert list(rejects(mus, m, r, v, tau)) == [w > r / m for w in want]


@pytest.mark.parametrize("m,r,v", [(1000, 100, 90), (1000, 500, 400), (200, 40, 40), (1000, 1000, 700)])
def test_mu_lower_bound_is_the_edge_of_the_rejected_set(m, r, v):
    tau = 0.01
    mu = gdp_lower_bound(m, r, v, tau)
    assert mu > 0
    assert _end_by_hand(mu, m, r, v, tau) > r / m  # the returned μ was rejected
    assert _end_by_hand(mu + 1e-3, m, r, v, tau) <= r / m  # a little more is not
    # down-closed: every smaller μ is rejected too (the search relies on it)
    assert all(_end_by_hand(x, m, r, v, tau) > r / m for x in np.linspace(0, mu, 7))


def test_more_correct_guesses_give_a_larger_mu_and_chance_gives_none():
    mus = [gdp_lower_bound(1000, 100, v, 0.01) for v in (50, 60, 70, 80, 90, 100)]
    assert mus[0] == 0.0 and all(a <= b for a, b in zip(mus, mus[1:])) and mus[-1] > 0.9  # 100 of 100: μ ≥ 1.0
    assert gdp_lower_bound(1000, 100, 0, 0.01) == 0.0


def test_gaussian_privacy_profile():
    """δ_μ(ε) = Φ(−ε/μ + μ/2) − e^ε Φ(−ε/μ − μ/2), recomputed; ε_μ(δ) its inverse; μ = 1 at δ = 1e-5 is the Gaussian
    mechanism at σ = 1, q = 1, T = 1, whose ε the PRV accountant puts at 4.387 (benchmarks/audit.md §1)."""
    for mu, eps in ((0.5, 0.3), (1.0, 2.0), (3.0, 10.0)):
        want = N01.cdf(-eps / mu + mu / 2) - math.exp(eps) * N01.cdf(-eps / mu - mu / 2)
        assert gdp_delta(eps, mu) == pytest.approx(want, rel=1e-9, abs=1e-15)
    for mu, delta in ((0.5, 1e-5), (1.0, 1e-5), (2.0, 1e-6)):
        eps = gdp_epsilon(mu, delta)
        assert gdp_delta(eps, mu) == pytest.approx(delta, rel=1e-6)
    assert gdp_epsilon(1.0, 1e-5) == pytest.approx(4.387, abs=0.02)
    assert gdp_epsilon(0.0, 1e-5) == 0.0


def _gaussian_game(rng, m: int, mu: float):
    """m canaries of a μ-GDP mechanism: each included with probability ½, its score N(μ, 1) if included, N(0, 1) if not
    (exactly the trade-off curve of μ-GDP for each canary)."""
    inc = rng.random(m) < 0.5
    return mu * inc + rng.standard_normal(m), inc


def test_coverage_on_a_gaussian_mechanism():
    """At 95 % confidence the estimate stays at or below the true μ in at least 95 % of the repetitions of a μ-GDP
    canary game (seeded: deterministic), it has power (well above 0 on average), and for this Gaussian mechanism its ε
    is above Steinke et al.'s assumption-free bound on the same scores most of the time (why it is reported)."""
    rng = np.random.default_rng(20240)
    m, mu, delta, reps = 200, 2.0, 1e-5, 40
    over, mus, tighter = 0, [], 0
    for _ in range(reps):
        scores, inc = _gaussian_game(rng, m, mu)
        est = gdp_audit_scores(scores, inc, delta, beta=0.05)
        over += est.mu_lower > mu
        mus.append(est.mu_lower)
        tighter += est.epsilon >= audit_scores(scores, inc, delta, 0.05).epsilon_lower
    assert over <= 0.05 * reps, over
    assert np.mean(mus) > 0.35 * mu, np.mean(mus)  # seen: 0.85 for μ = 2 with 200 canaries
    assert tighter >= 0.8 * reps, tighter
    # a non-private game (μ huge): nearly every guess right, and the estimate refutes a μ = 0.5 claim (200 canaries
    # cannot certify more than μ ≈ 1.3)
    scores, inc = _gaussian_game(rng, m, 50.0)
    assert gdp_audit_scores(scores, inc, delta).epsilon > gdp_epsilon(0.5, delta)


def test_bad_input_is_refused_in_one_sentence():
    for args in ((10, 5, 6, 0.05), (10, 11, 3, 0.05), (10, 5, 3, 0.0), (10, 5, 3, 1.5)):
        with pytest.raises(ValueError, match="^error: "):
            gdp_lower_bound(*args)
