"""The accounting of banded noise, cross-checked by an independent computation (issue 52).

hf_dp accounts T steps of ``--noise_mechanism banded_sqrt --noise_bands b`` as DP-SGD at rate b·q for ⌈T/b⌉ rounds
(hf_dp.privacy.banded.dp_sgd_equivalent, the cyclic Poisson theorem of Choquette-Choo et al. 2023). Here the full
T-dimensional mechanism is simulated instead: one unit's gradient is a scalar of norm C = 1 in one coordinate, the
output is Y = C~x + σz (C~ the implementation's b-banded factor, x_t = 1 at the unit's steps where its Bernoulli(b·q)
coin came up, those steps read off the implementation's own cyclic Poisson sampler), and the exact log-likelihood
ratio L of the mixture over the unit's participation patterns against N(0, σ²I) gives, by Monte Carlo,
δ(ε) = max(E_P[(1 − e^(ε−L))₊], E_Q[(1 − e^(ε+L))₊]) (remove and add). It must match dp_accounting's PLD δ of
PoissonSampled(b·q, Gaussian(σ)) self-composed ⌈T/b⌉ times within its Monte Carlo error (for the partition whose every
step's column is complete; no partition may exceed it), and the ledger's ε must match dp_accounting's ε. A broken
variant — the same schedule under the full (non-banded) square root, whose columns overlap so that the unit's
participations add up coherently — gives a δ far above what the b-banded accounting claims.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
import torch

from hf_dp.privacy import banded
from hf_dp.privacy.accounting import PrivacyLedger, PrivacySpec
from hf_dp.privacy.crosscheck import pld_epsilon_lower, pld_epsilon_upper, prv_tolerance
from hf_dp.privacy.cyclic import unit_partitions
from hf_dp.privacy.sampler import PoissonBatchSampler

dp_accounting = pytest.importorskip("dp_accounting")
from scipy.special import logsumexp  # noqa: E402

SIGMA, EPS, DRAWS = 1.0, 1.0, 200_000


def _factor(coefficients, T: int) -> np.ndarray:
    """The lower-triangular Toeplitz matrix with first column ``coefficients`` (truncated to T), divided by its largest
    column norm (its first column's)."""
    M = np.zeros((T, T))
    for k, c in enumerate(list(coefficients)[:T]):
        M += np.diag(np.full(T - k, c), -k)
    return M / np.linalg.norm(M[:, 0])


def _schedules(b: int, q: float, T: int) -> dict[int, list[int]]:
    """The steps at which the implementation's sampler lets a unit of each partition join (rate b·q = 1 here, so
    every eligible unit is drawn): partition -> its steps."""
    n = 60
    parts = unit_partitions([f"unit{i}" for i in range(n)], b)
    sampler = PoissonBatchSampler(n, 1.0 / b, T, seed=0, bands=b, partitions=parts)
    steps: dict[int, list[int]] = {}
    for t, batch in enumerate(sampler):
        for j in {int(parts[i]) for i in batch}:
            steps.setdefault(j, []).append(t)
    assert sorted(steps) == list(range(b))
    return steps


def _monte_carlo_delta(M: np.ndarray, steps: list[int], p: float, rng) -> tuple[float, float]:
    """(δ(EPS), its standard error) of Y = M x + σz against σz, x the unit's Bernoulli(p) participations at ``steps``:
    the max of the remove and add directions, each estimated from DRAWS samples."""
    cols = M[:, steps]
    k = len(steps)
    patterns = np.array(list(itertools.product([0.0, 1.0], repeat=k)))
    log_prob = patterns.sum(1) * math.log(p) + (k - patterns.sum(1)) * math.log1p(-p) if p < 1 else None
    means = patterns @ cols.T  # [2^k, T]
    half = 0.5 * (means**2).sum(1)

    def loss(Y):  # log dP/dQ of the mixture P = Σ π_S N(μ_S, σ²I) against Q = N(0, σ²I)
        return logsumexp(log_prob + (Y @ means.T - half) / SIGMA**2, axis=1)

    T = M.shape[0]
    pattern = rng.choice(len(patterns), size=DRAWS, p=np.exp(log_prob))
    remove = np.maximum(0.0, 1.0 - np.exp(EPS - loss(means[pattern] + SIGMA * rng.standard_normal((DRAWS, T)))))
    add = np.maximum(0.0, 1.0 - np.exp(EPS + loss(SIGMA * rng.standard_normal((DRAWS, T)))))
    best = remove if remove.mean() >= add.mean() else add
    return float(best.mean()), float(best.std() / math.sqrt(DRAWS))


def _pld_delta(p: float, rounds: int) -> float:
    acc = dp_accounting.pld.PLDAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                                          value_discretization_interval=1e-4)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(p, dp_accounting.GaussianDpEvent(SIGMA)), rounds))
    return float(acc.get_delta(EPS))


@pytest.mark.parametrize("T, b, q", [(12, 3, 1 / 6), (10, 2, 0.25)])
def test_the_full_mechanism_is_as_private_as_its_dp_sgd_equivalent(T, b, q):
    rng = np.random.default_rng(1234 + T)
    M = _factor(banded.bsr_coefficients(b), T)
    assert np.linalg.norm(M, axis=0).max() == pytest.approx(1.0)  # C~ = C/s: column norms ≤ 1
    rate, rounds = banded.dp_sgd_equivalent(q, T, b)
    assert rate == pytest.approx(b * q) and rounds == math.ceil(T / b)
    claimed = _pld_delta(rate, rounds)
    exact = 0
    for partition, steps in _schedules(b, q, T).items():
        assert all(t % b == partition for t in steps) and len(steps) <= rounds
        delta, se = _monte_carlo_delta(M, steps, rate, rng)
        assert delta <= claimed + 4 * se + 2e-3, (partition, delta, claimed)
        if steps[-1] + b <= T:  # every step's column complete (norm 1): the equivalence is exact
            assert abs(delta - claimed) <= 4 * se + 2e-3, (partition, delta, claimed)
            exact += 1
    assert exact >= 1
    # the ledger's ε (Opacus PRV) is dp_accounting's ε of the equivalent, within the PRV accountant's tolerance
    ledger = PrivacyLedger(PrivacySpec(noise_multiplier=SIGMA, max_grad_norm=1.0, sample_rate=q, expected_batch_size=q * 600,
                                       dataset_size=600, delta=1e-5, noise_mechanism="banded_sqrt", noise_bands=b))
    for _ in range(T):
        ledger.record_step()
    lower, upper = pld_epsilon_lower(SIGMA, rate, rounds, 1e-5), pld_epsilon_upper(SIGMA, rate, rounds, 1e-5)
    assert lower - prv_tolerance(lower) <= ledger.get_epsilon() <= upper + 0.03, (lower, ledger.get_epsilon(), upper)


def test_a_non_banded_factor_would_overstate_the_cancellation():
    """The negative control: the full lower-triangular square root (b = T: overlapping columns) on the same cyclic
    schedule leaks far more than the b-banded accounting claims."""
    T, b, q = 12, 3, 1 / 6
    rng = np.random.default_rng(7)
    full = _factor([math.comb(2 * k, k) / 4**k for k in range(T)], T)
    rate, rounds = banded.dp_sgd_equivalent(q, T, b)
    claimed = _pld_delta(rate, rounds)
    delta, se = _monte_carlo_delta(full, _schedules(b, q, T)[0], rate, rng)
    assert delta > claimed + 20 * se + 0.05, (delta, claimed)


def test_the_schedule_and_factor_come_from_the_implementation():
    """The two pieces the simulation reads are the implementation's: its coefficients (those of (1 − x)^(−1/2)) and
    its sampler's phase (step t: partition t mod b)."""
    assert torch.allclose(torch.tensor(banded.bsr_coefficients(4), dtype=torch.float64),
                          torch.tensor([1.0, 0.5, 0.375, 0.3125], dtype=torch.float64))
    assert _schedules(3, 1 / 6, 9) == {0: [0, 3, 6], 1: [1, 4, 7], 2: [2, 5, 8]}
