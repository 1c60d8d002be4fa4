"""Empirical privacy audit (hf_dp.audit): the statistics, the batched-trial construction, the real
mechanism staying below the accountant's ε, and power against broken privatizers.

All runs are seeded, so the outcomes are deterministic; the tolerances below leave room for the
Monte-Carlo error of a different seed (the audit bound itself holds at 95% for any seed)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import beta, ks_2samp

from hf_dp.audit import (
    AuditConfig,
    audit,
    clopper_pearson_upper,
    epsilon_from_rates,
    epsilon_lower_bound,
    main,
    run_trials,
)

DELTA = 1e-5
BATCHED = ["dp_sgd", "dp_adamw", "dp_adamw_bc"]
SINGLE = ["dp_sgd_l2", "dp_macadam"]  # rules that couple coordinates: one trial per run
ALL = BATCHED + SINGLE


def trials_for(optim, batched=2000, single=300):
    return batched if optim in BATCHED else single


# ------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------
def test_clopper_pearson_upper():
    n, level = 500, 0.975
    # no event: the exact closed form 1 − (1 − level)^(1/n)
    assert clopper_pearson_upper(0, n, level) == pytest.approx(1 - (1 - level) ** (1 / n), rel=1e-9)
    assert clopper_pearson_upper(n, n, level) == 1.0
    for k in (1, 7, 250):
        up = float(clopper_pearson_upper(k, n, level))
        assert up == pytest.approx(beta.ppf(level, k + 1, n - k))
        # defining property: P(Bin(n, up) ≤ k) = 1 − level
        from scipy.stats import binom

        assert binom.cdf(k, n, up) == pytest.approx(1 - level, rel=1e-6)


def test_epsilon_from_rates_both_directions():
    assert epsilon_from_rates(0.01, 0.5, DELTA) == pytest.approx(math.log((1 - DELTA - 0.5) / 0.01))
    assert epsilon_from_rates(0.5, 0.01, DELTA) == pytest.approx(math.log((1 - DELTA - 0.5) / 0.01))
    assert epsilon_from_rates(0.6, 0.6, DELTA) == 0.0


def test_bound_on_separated_and_identical_samples():
    rng = np.random.default_rng(0)
    # perfectly separated: the bound is what n evaluation trials can certify, nothing more
    b = epsilon_lower_bound(np.zeros(1000), np.ones(1000), DELTA)
    u = 1 - 0.025 ** (1 / 500)
    assert b.fpr == 0 and b.tpr == 1
    assert b.eps_lower == pytest.approx(math.log((1 - DELTA - u) / u), rel=1e-6)
    # identical distributions: (almost) nothing
    b = epsilon_lower_bound(rng.normal(size=4000), rng.normal(size=4000), DELTA)
    assert b.eps_lower < 0.3
    # the threshold is chosen on one half only: shuffling the evaluation half's D/D' labels kills it
    s0, s1 = rng.normal(0, 1, 4000), rng.normal(1, 1, 4000)
    honest = epsilon_lower_bound(s0, s1, DELTA).eps_lower
    mixed = np.concatenate([s1[2000:], s0[2000:]])
    rng.shuffle(mixed)
    placebo = epsilon_lower_bound(np.concatenate([s0[:2000], mixed[:2000]]), np.concatenate([s1[:2000], mixed[2000:]]), DELTA)
    assert honest > 0.8 and placebo.eps_lower < 0.3


# ------------------------------------------------------------------------------------------------
# the trials run the real mechanism; batching trials is exact
# ------------------------------------------------------------------------------------------------
def test_noiseless_trials_are_the_clipped_canary():
    """σ = 0, q = 1, one step, lr = 1, B = 1: θ_0 − θ_1 is exactly C on the canary's coordinate."""
    for batch, micro in ((256, 1), (1, 1), (256, 3)):
        cfg = AuditConfig(optim="dp_sgd", variant="no_noise", trials=20, max_grad_norm=0.7, batch_trials=batch,
                          micro_batches=micro, background=4)
        s0, s1 = run_trials(cfg)
        np.testing.assert_allclose(s0, 0.0, atol=1e-12)
        np.testing.assert_allclose(s1, 0.7, rtol=1e-5)  # Opacus' clip factor C/(‖g‖ + 1e-6)


def test_batched_trials_match_single_trials():
    common = dict(optim="dp_sgd", noise_multiplier=1.0, sample_rate=0.5, steps=3, trials=300, seed=3)
    b0, b1 = run_trials(AuditConfig(**common))
    u0, u1 = run_trials(AuditConfig(**common, batch_trials=1))
    assert ks_2samp(b0, u0).pvalue > 1e-3 and ks_2samp(b1, u1).pvalue > 1e-3
    # and the canary is visible in both: P(canary in ≥ 1 of 3 steps) = 7/8
    assert b1.mean() - b0.mean() == pytest.approx(1.5, abs=0.5)
    assert u1.mean() - u0.mean() == pytest.approx(1.5, abs=0.5)


def test_coupled_rules_refuse_batching():
    with pytest.raises(ValueError, match="couples coordinates"):
        run_trials(AuditConfig(optim="dp_macadam", batch_trials=8, trials=4))


# ------------------------------------------------------------------------------------------------
# the real mechanism: ε_lower ≤ the accountant's ε (and the canary is actually detected)
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("optim", ALL)
def test_real_mechanism_one_full_batch_step(optim):
    r = audit(optim=optim, noise_multiplier=1.0, sample_rate=1.0, steps=1, trials=trials_for(optim), delta=DELTA)
    assert r.eps_claimed == pytest.approx(4.39, abs=0.02)
    assert r.eps_lower <= r.eps_claimed
    assert r.eps_lower > 0.5  # the audit sees the canary: a meaningful, not a vacuous, bound


@pytest.mark.parametrize("optim", ALL)
def test_real_mechanism_poisson_subsampled(optim):
    steps = 5 if optim in BATCHED else 3
    r = audit(optim=optim, noise_multiplier=1.5, sample_rate=0.5, steps=steps, trials=trials_for(optim, single=200), delta=DELTA)
    assert r.eps_lower <= r.eps_claimed
    if optim == "dp_sgd":
        assert r.eps_lower > 0.5


def test_real_mechanism_small_sample_rate():
    r = audit(optim="dp_sgd", noise_multiplier=1.0, sample_rate=0.1, steps=10, trials=2000, delta=DELTA)
    assert r.eps_claimed == pytest.approx(2.86, abs=0.05)
    assert r.eps_lower <= r.eps_claimed


# ------------------------------------------------------------------------------------------------
# power: broken privatizers are caught
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["no_noise", "low_noise", "no_clip"])
@pytest.mark.parametrize("optim", ALL)
def test_broken_mechanism_is_caught(optim, variant):
    r = audit(optim=optim, variant=variant, noise_multiplier=2.0, trials=trials_for(optim, 1000, 300), delta=DELTA)
    assert r.eps_claimed == pytest.approx(2.0, abs=0.02)
    assert r.eps_lower > r.eps_claimed + 1.0, r.row()


@pytest.mark.parametrize("variant", ["no_noise", "low_noise", "no_clip"])
def test_broken_mechanism_is_caught_under_subsampling(variant):
    r = audit(optim="dp_sgd", variant=variant, noise_multiplier=2.0, sample_rate=0.5, steps=5, trials=2000, delta=DELTA)
    assert r.eps_claimed == pytest.approx(2.82, abs=0.05)
    assert r.eps_lower > r.eps_claimed + 1.0, r.row()


# ------------------------------------------------------------------------------------------------
# CLI
# ------------------------------------------------------------------------------------------------
def test_cli_prints_table(capsys):
    code = main(["--optim", "dp_adamw", "--noise_multiplier", "2.0", "--sample_rate", "0.5", "--steps", "2",
                 "--trials", "200", "--variant", "real,no_noise"])
    out = capsys.readouterr().out
    assert code == 0
    lines = [ln for ln in out.splitlines() if ln.startswith("dp_adamw")]
    assert len(lines) == 2 and "eps_lower" in out and "VIOLATION" in lines[1]
    from hf_dp.privacy.accounting import compute_epsilon

    claimed = compute_epsilon(2.0, 0.5, 2, DELTA)
    assert float(lines[0].split()[7]) == pytest.approx(claimed, abs=1e-3)


def test_cli_module_entry_point():
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run(
        [sys.executable, "-m", "hf_dp.audit", "--help"],
        cwd=root, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    assert "--noise_multiplier" in proc.stdout and "--trials" in proc.stdout
