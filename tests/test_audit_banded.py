"""The many-run audit of the banded square root mechanism (hf_dp.audit.banded, issue 52 item 6).

The real b-banded noise (the privatizer's BandedNoise) with the real cyclic Poisson sampler must come out "ok" against
the accountant's ε for it, and the broken variant with the cancellation over-stated (the full square root accounted as
b bands) must come out VIOLATION at the same settings; b = 1 is today's audit, bit for bit.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

from hf_dp.audit.many_runs import AuditConfig, audit, claimed_epsilon, main, run_trials

DELTA = 1e-5
#: the audited setting: b = 2, b·q = 1 (partition 0 drawn at each of its 64 steps), claim ≈ 3.05, far below the
#: ceiling of 8 000 trials (8.15); the over-stated variant's final-iterate SNR is 3.1 times the claimed one
BANDED = dict(optim="dp_sgd", noise_multiplier=11.0, sample_rate=0.5, steps=128, noise_bands=2, trials=8000, delta=DELTA)


def _bsr(n: int) -> np.ndarray:
    """binom(2k, k)/4^k, k < n (written out here, not read from the implementation)."""
    return np.array([math.comb(2 * k, k) / 4**k for k in range(n)])


def _sum_noise_var(coefficients: np.ndarray, T: int) -> float:
    """Var of Σ_t s·w_t for w = M⁻¹z, M the lower-triangular Toeplitz matrix with first column ``coefficients``, s its
    first column's norm: s²·‖M⁻ᵀ1‖² (per unit σ·C)."""
    M = sum(np.diag(np.full(T - k, c), -k) for k, c in enumerate(coefficients[:T]))
    s2 = float((coefficients[:T] ** 2).sum())
    return s2 * float(np.linalg.norm(np.linalg.solve(M.T, np.ones(T))) ** 2)


def test_b1_is_todays_audit_exactly():
    """noise_mechanism banded_sqrt with one band (BandedNoise(1), the sampler's plain draw) gives the statistics of the
    independent-noise audit, value for value, and the same claim."""
    for optim in ("dp_sgd", "dp_adamw_bc"):  # dp_adamw_bc reads the privatizer's noise figure
        common = dict(optim=optim, noise_multiplier=1.5, sample_rate=0.5, steps=4, trials=300, delta=DELTA)
        today, banded = AuditConfig(**common), AuditConfig(**common, noise_mechanism="banded_sqrt", noise_bands=1)
        s0, s1 = run_trials(today)
        b0, b1 = run_trials(banded)
        np.testing.assert_array_equal(s0, b0)
        np.testing.assert_array_equal(s1, b1)
        z = (s1.mean() - s0.mean()) / math.sqrt((s0.var() + s1.var()) / len(s0))
        assert z > 4, (optim, z)  # not vacuous: the canary moves its coordinate
        assert claimed_epsilon(banded) == claimed_epsilon(today)


@pytest.mark.parametrize("bands, q, steps, expected", [(2, 0.5, 5, 3.0), (3, 1 / 3, 7, 3.0), (4, 0.25, 12, 3.0)])
def test_the_canary_joins_exactly_its_partitions_steps(bands, q, steps, expected):
    """No noise, b·q = 1: the canary (partition 0) is drawn at steps 0, b, 2b, … only — ⌈T/b⌉ clipped steps of C = 1
    (lr = 1, B = 1) — and the D coordinates do not move."""
    s0, s1 = run_trials(AuditConfig(variant="no_noise", noise_bands=bands, sample_rate=q, steps=steps, trials=64))
    assert expected == math.ceil(steps / bands)
    np.testing.assert_allclose(s1, expected, rtol=1e-8)  # Opacus clips to C/(‖g‖ + 1e-6)
    np.testing.assert_array_equal(s0, 0.0)


def test_subsampled_partition_draws_at_rate_bq():
    """b = 2, q = 0.25: at each of its 3 steps (T = 6) the canary is drawn with probability b·q = 0.5."""
    _, s1 = run_trials(AuditConfig(variant="no_noise", noise_bands=2, sample_rate=0.25, steps=6, trials=2000))
    counts = np.round(s1).astype(int)
    np.testing.assert_allclose(s1, counts, atol=1e-9)
    assert set(counts) <= {0, 1, 2, 3}
    freq = np.bincount(counts, minlength=4) / len(counts)
    np.testing.assert_allclose(freq, [1 / 8, 3 / 8, 3 / 8, 1 / 8], atol=0.04)


@pytest.mark.parametrize("variant, factor", [("real", 2), ("banded_overstated", 8)])
def test_the_noise_is_the_factorized_noise(variant, factor):
    """The D statistic's variance is σ²·s²·‖M⁻ᵀ1‖² of the factor the privatizer used — the 2-banded one for the real
    mechanism (5.0 at T = 8, against 8 for independent noise), the full square root for banded_overstated (2.95)."""
    T = 8
    s0, _ = run_trials(AuditConfig(variant=variant, noise_bands=2, sample_rate=0.5, steps=T, trials=6000))
    expected = _sum_noise_var(_bsr(factor), T)
    assert s0.var() == pytest.approx(expected, rel=0.08), (s0.var(), expected)
    assert abs(s0.var() - T) > 0.25 * T  # not the independent noise's


def test_batched_trials_are_independent_runs():
    """One trial per run and 256 per run give the same distribution of the statistic (KS) under banded noise."""
    from scipy.stats import ks_2samp

    common = dict(noise_multiplier=1.0, noise_bands=2, sample_rate=0.5, steps=6, trials=300)
    u0, u1 = run_trials(AuditConfig(**common, batch_trials=1))
    b0, b1 = run_trials(AuditConfig(**common, seed=1))
    assert ks_2samp(b0, u0).pvalue > 1e-3 and ks_2samp(b1, u1).pvalue > 1e-3
    assert b1.mean() - b0.mean() == pytest.approx(3.0, abs=0.5)  # 3 participations of C = 1


def test_claim_is_the_accountants_dp_sgd_equivalent():
    from hf_dp.privacy.accounting import compute_epsilon

    cfg = AuditConfig(**BANDED)
    claim = claimed_epsilon(cfg)
    assert claim == pytest.approx(compute_epsilon(11.0, 1.0, 64, DELTA), rel=1e-9)  # rate 2·0.5, ⌈128/2⌉ rounds
    assert claimed_epsilon(AuditConfig(**{**BANDED, "variant": "banded_overstated"})) == claim
    assert claim > compute_epsilon(11.0, 0.5, 128, DELTA) + 0.5  # not DP-SGD's own claim at (q, T): no amplification


def test_real_banded_mechanism_is_ok():
    r = audit(**BANDED)
    assert not r.low_power, r.row()
    assert not r.violation, r.row()
    assert r.eps_lower > 0.5, r.row()  # the canary is seen: not a vacuous bound


def test_overstated_cancellation_is_a_violation():
    r = audit(**BANDED, variant="banded_overstated")
    assert not r.low_power, r.row()
    assert r.eps_lower > r.eps_claimed + 0.5, r.row()


def test_real_banded_subsampled_adam_is_ok():
    """b·q < 1 and an Adam-family rule that reads the noise figure (σ·C·s·√V_n/B)."""
    r = audit(optim="dp_adamw_bc", noise_multiplier=2.0, sample_rate=0.25, steps=16, noise_bands=2, trials=2000,
              delta=DELTA)
    assert not r.low_power and not r.violation, r.row()


def test_cli_banded_rows_and_refusals(capsys):
    code = main(["--noise_bands", "2", "--sample_rate", "0.5", "--steps", "6", "--noise_multiplier", "2",
                 "--trials", "200", "--variant", "real,no_noise"])
    out = capsys.readouterr().out
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("dp_sgd")]
    assert code == 0 and len(rows) == 2 and rows[0][4] == "6/b2" and rows[1][12] == "VIOLATION"
    assert "2-banded" in out
    for argv, says in [
        (["--noise_bands", "3", "--sample_rate", "0.5"], "b*q = 1.5 > 1"),
        (["--noise_bands", "2", "--sample_rate", "0.5", "--steps", "2", "--variant", "banded_overstated"], "--steps >"),
        (["--noise_bands", "0"], "whole number >= 1"),
        (["--path", "trainer", "--noise_bands", "2", "--sample_rate", "0.5"], "mechanism path only"),
        (["--one_run", "--canary_kind", "white-box", "--noise_bands", "2", "--sample_rate", "0.5"], "white-box runs"),
        (["--one_run", "--noise_bands", "3", "--sample_rate", "0.5", "--canaries", "200"], "b*q = 1.5 > 1"),
    ]:
        assert main(argv) == 2, argv
        out, err = capsys.readouterr()
        assert out == "" and err.startswith("error: ") and err.count("\n") == 1 and says in err, (argv, err)


# ------------------------------------------------------------------------------------------------
# the one-run audit on banded noise (--audit_canaries with --noise_bands > 1)
# ------------------------------------------------------------------------------------------------
def test_canary_partitions_are_a_function_of_the_canary_not_of_its_bit():
    """Each canary unit's partition is a hash of its own public content, so two draws of the same canaries with other
    inclusion bits give the same partitions (and digest); real rows keep theirs; N = real + m."""
    from datasets import Dataset

    from hf_dp.audit.canaries import TrainerCanaries, extend_units
    from hf_dp.audit.canary_kinds import SequenceCanaries
    from hf_dp.privacy.cyclic import partitions_digest, row_partitions, unit_partitions
    from hf_dp.run.setup import cyclic_partitions
    from hf_dp.run.state import Units

    real = Dataset.from_dict({"input_ids": [[5 + i, 6, 7] for i in range(40)], "label": [i % 2 for i in range(40)]})
    out = []
    for bits_seed in (1, 2):
        canaries = SequenceCanaries.draw(30, 2, vocab_size=100, length=3, seed=7, bits_seed=bits_seed)
        state = TrainerCanaries(canaries, len(real), real)

        class _Dp:  # the run's privacy state, as far as extend_units reads it
            audit, units = state, Units()

        extend_units(_Dp, len(real) + state.included_rows)
        parts = cyclic_partitions(3, real, None, _Dp.units, state)
        assert len(parts) == len(real) + 30 == _Dp.units.count
        assert parts[:40].tolist() == row_partitions(real, 3).tolist()
        assert parts[40:].tolist() == unit_partitions(state.identities(), 3).tolist()
        out.append((canaries.included.copy(), parts, partitions_digest(parts, 3)))
    assert not np.array_equal(out[0][0], out[1][0])  # other bits ...
    assert out[0][1].tolist() == out[1][1].tolist() and out[0][2] == out[1][2]  # ... the same partitions
    assert len(set(out[0][1][40:].tolist())) == 3  # the canaries spread over the partitions


def test_one_run_audit_runs_on_banded_noise(capsys):
    """DPTrainer --audit_canaries with --noise_bands 2 (gradient canaries, b·q = 1): the claim is the banded
    accountant's, the real run is ok and the noiseless one a VIOLATION."""
    from hf_dp.privacy.accounting import compute_epsilon

    code = main(["--one_run", "--canary_kind", "gradient", "--variant", "real,no_noise", "--noise_bands", "2",
                 "--canaries", "200", "--background", "200", "--steps", "20", "--sample_rate", "0.5",
                 "--noise_multiplier", "8"])
    out = capsys.readouterr().out
    rows = {r[2]: r for r in (ln.split() for ln in out.splitlines()) if len(r) > 12 and r[1] == "gradient"}
    assert code == 0 and set(rows) == {"real", "no_noise"}, out
    claim = compute_epsilon(8.0, 1.0, 10, DELTA)  # N = 400, B = 200: rate 2·0.5, 10 rounds
    for r in rows.values():
        assert r[5] == "20/b2" and float(r[10]) == pytest.approx(claim, abs=1e-3), r
    assert rows["real"][12] == "ok" and rows["no_noise"][12] == "VIOLATION", out


def test_banded_likelihood_ratio_is_the_whitened_test():
    """The gradient canaries' score under b-banded noise, computed online (hf_dp.audit.canary_kinds), equals the dense
    computation: r = M·x/s, a_u = ⟨r, M~e_u⟩ at the canary's partition steps, Σ log(1 − p + p·e^((a_u − n_u/2)/σ²)) —
    after every step (the end of the run cutting the last columns); b = 1 is the per-step likelihood ratio summed."""
    from hf_dp.audit.canary_kinds import BandedLikelihoodRatio, step_log_likelihood_ratio

    rng = np.random.default_rng(3)
    m, T, q, sigma = 40, 11, 0.2, 1.5
    for b in (1, 2, 3):
        c = _bsr(b)
        parts = rng.integers(0, b, size=m)
        x = rng.normal(0.3, 2.0, size=(T, m))
        online = BandedLikelihoodRatio(parts, c, q, sigma)
        for t in range(T):
            online.update(x[t])
            n_steps = t + 1
            M = sum(np.diag(np.full(n_steps - k, ck), -k) for k, ck in enumerate(c[:n_steps]))
            s = float(np.sqrt((c**2).sum()))
            R = M @ x[:n_steps] / s
            p = min(1.0, b * q)
            dense = np.zeros(m)
            for u in range(n_steps):
                col = M[:, u] / s
                a, n = col @ R, float(col @ col)
                lr = np.log(1 - p + p * np.exp((a - n / 2) / sigma**2)) if p < 1 else (a - n / 2) / sigma**2
                dense += np.where(parts == u % b, lr, 0.0)
            np.testing.assert_allclose(online.scores(), dense, rtol=1e-10, atol=1e-10)
        if b == 1:
            np.testing.assert_allclose(online.scores(), step_log_likelihood_ratio(x, q, sigma).sum(0), rtol=1e-12)
