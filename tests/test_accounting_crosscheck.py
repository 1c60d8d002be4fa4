"""hf_dp's ε (Opacus PRV/RDP) cross-checked against Google's dp_accounting (PLD and RDP).

The property under test is "hf_dp never under-reports ε". Only a *certified lower bound* on
the true ε can refute it, so the hard assertion compares hf_dp's PRV ε with dp_accounting's
optimistic PLD (losses rounded down → lower bound). Tolerance: 1% relative + 2e-3 absolute
(see :func:`hf_dp.privacy.crosscheck.prv_tolerance`): the lower bound is certified up to
floating-point FFT error (≪ 1e-3), and Opacus' PRV already adds eps_error = 0.01 on top of
its estimate, so a correct implementation clears the bound by ~0.01; a shortfall of > 1%
would be a genuine under-report. Further checks: PRV agrees with the pessimistic PLD upper
bound (both near-tight), RDP values agree between the two libraries, noise calibration lands
at or just below the target, and the REMOVE direction (the only one Opacus' PRV models)
dominates the add/remove PLD at every point.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

pytest.importorskip("dp_accounting")

from hf_dp.privacy import crosscheck as cc  # noqa: E402
from hf_dp.privacy.accounting import calibrate_noise_multiplier, compute_epsilon  # noqa: E402

# Coarser floor for the optimistic-PLD discretisation than the benchmark (1e-6) to keep the
# file fast; the lower bound stays certified, only looser (≤ steps·Δ in total loss).
FAST_LOWER_FLOOR = 1e-4


@pytest.fixture(scope="module")
def rows():
    return cc.crosscheck_grid(cc.FAST_GRID, with_directions=False, lower_discretization_floor=FAST_LOWER_FLOOR)


def test_fast_grid_is_big_enough():
    assert len(cc.FAST_GRID) >= 8
    assert len(cc.DEFAULT_GRID) >= 20


def test_neighbouring_relation_default_is_add_remove():
    import dp_accounting as dp

    assert dp.pld.PLDAccountant().neighboring_relation == dp.NeighboringRelation.ADD_OR_REMOVE_ONE
    assert dp.rdp.RdpAccountant().neighboring_relation == dp.NeighboringRelation.ADD_OR_REMOVE_ONE


def test_pld_bounds_bracket(rows):
    for r in rows:
        assert r["eps_pld_lower"] <= r["eps_pld_upper"] + 1e-9, r


def test_prv_never_below_certified_lower_bound(rows):
    for r in rows:
        tol = cc.prv_tolerance(r["eps_pld_lower"])
        assert r["eps_hf_dp_prv"] >= r["eps_pld_lower"] - tol, (
            f"hf_dp PRV ε {r['eps_hf_dp_prv']:.5f} < certified lower bound {r['eps_pld_lower']:.5f} "
            f"- {tol:.4f} at {r['setting']}: under-reported ε"
        )


def test_prv_agrees_with_pessimistic_pld(rows):
    # Not a certificate (the pessimistic PLD is itself an upper bound), but both are tight:
    # a PRV more than 1% + 0.01 below it, or > 5% + 0.05 above it, would signal a problem.
    for r in rows:
        hi = r["eps_pld_upper"]
        assert r["eps_hf_dp_prv"] >= hi - (0.01 * hi + 0.01), r
        assert r["eps_hf_dp_prv"] <= hi + (0.05 * hi + 0.05), r


def test_rdp_is_an_rdp_bound_and_matches_google(rows):
    for r in rows:
        # RDP is an upper bound on the true ε, hence above the certified PLD lower bound
        assert r["eps_hf_dp_rdp"] >= r["eps_pld_lower"] - 1e-6, r
        assert r["eps_google_rdp"] >= r["eps_pld_lower"] - 1e-6, r
        # Same RDP→DP conversion; differences come only from the order sets (Google's dense
        # list; Google drops fractional orders whose series does not converge and uses a
        # looser bound for fractional α < 2 — see test_rdp_per_order_*). Observed ≤ 1.1%.
        tol = 0.015 * r["eps_google_rdp"] + 1e-6
        assert r["eps_hf_dp_rdp"] >= r["eps_google_rdp"] - tol, r
        assert r["eps_hf_dp_rdp"] <= r["eps_google_rdp"] + tol, r


@pytest.mark.parametrize("q,sigma,steps", [(0.01, 1.0, 10), (256 / 67_349, 0.62, 790), (0.1, 1.0, 100), (0.5, 3.0, 100)])
def test_rdp_per_order_against_quadrature_and_google(q, sigma, steps):
    orders = np.array(cc.OPACUS_RDP_ORDERS)
    opacus = cc.opacus_rdp_per_order(sigma, q, steps, orders)
    google = cc.google_rdp_per_order(sigma, q, steps, orders)
    integer = np.isclose(orders, np.round(orders))
    # integer orders: closed-form binomial sum in both libraries → identical
    np.testing.assert_allclose(google[integer], opacus[integer], rtol=1e-8)
    # fractional orders: Google is never below Opacus (it uses a bound / drops orders)
    finite = np.isfinite(google)
    assert np.all(google[finite] >= opacus[finite] * (1 - 1e-8))
    # ... and Opacus' value is the exact integral (independent quadrature referee)
    for a in (1.1, 1.5, 2.5, 3.7, 12.0):
        exact = cc.rdp_by_quadrature(sigma, q, steps, a)
        got = opacus[int(np.argmin(np.abs(orders - a)))]
        assert math.isclose(got, exact, rel_tol=1e-6), (a, got, exact)


@pytest.mark.parametrize(
    "q,sigma,steps,delta",
    [
        (256 / 104_743, 0.4, 1228, 1e-5),  # seed-004 QNLI
        (256 / 9_000, 0.4, 352, 1e-5),  # seed-004 local 9k, 10 epochs
        (0.1, 1.0, 100, 1e-5),  # large q: closest ADD vs REMOVE
        (0.01, 1.1, 3000, 1e-8),
    ],
)
def test_remove_direction_dominates(q, sigma, steps, delta):
    """Opacus' PRV models only the REMOVE pair; check it is the worst case of add/remove."""
    d = cc.pld_epsilon_by_direction(sigma, q, steps, delta, pessimistic=True)
    assert d["remove"] >= d["add"], d


@pytest.mark.parametrize("target", [1.0, 4.0])  # the two ends of the range (a middle target took the same path)
def test_calibration_lands_at_or_below_target(target):
    # seed-004 local setting: QNLI 9k subset, B=256, 3 epochs (106 steps) — fast to calibrate.
    q, steps, delta = 256 / 9_000, 106, 1e-5
    sigma = calibrate_noise_multiplier(target, delta, q, steps, "prv")
    eps = compute_epsilon(sigma, q, steps, delta, "prv")
    assert target - 0.05 * target <= eps <= target, (target, sigma, eps)
    # the independent PLD upper bound at that σ must also respect the target (PRV carries
    # +0.01 of slack, so the pessimistic PLD should come in below it)
    hi = cc.pld_epsilon_upper(sigma, q, steps, delta)
    assert hi <= target + 0.01 * target, (target, sigma, hi)
    lo = cc.pld_epsilon_lower(sigma, q, steps, delta, cc.lower_bound_discretization(steps, FAST_LOWER_FLOOR))
    assert lo <= target


def test_lower_bound_discretization_scales_with_steps():
    assert cc.lower_bound_discretization(1) == 1e-3
    assert cc.lower_bound_discretization(10_000) == pytest.approx(2e-6)
    assert cc.lower_bound_discretization(10**7) == cc.LOWER_BOUND_MIN_DISCRETIZATION


def test_tuple_and_dict_points():
    a = cc.crosscheck_grid([(1.0, 2.0, 10, 1e-8)], with_directions=False)[0]
    b = cc.crosscheck_grid([{"q": 1.0, "sigma": 2.0, "steps": 10, "delta": 1e-8}], with_directions=False)[0]
    assert a["eps_hf_dp_prv"] == b["eps_hf_dp_prv"]
    for k in ("eps_hf_dp_prv", "eps_hf_dp_rdp", "eps_pld_lower", "eps_pld_upper", "eps_google_rdp", "gap_prv_minus_pld_upper"):
        assert math.isfinite(a[k])
