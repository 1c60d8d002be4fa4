"""Correlated noise (``--noise_mechanism banded_sqrt --noise_bands b``, hf_dp.privacy.banded): the noise the
privatizer adds, the update rules' noise figure and the ledger's accounting, each against an independent float64
reference (issue 52).

* b = 1 is today's DP-SGD noise, bit for bit (same seeded stream, same privatized gradients, same ε).
* The noise of b = 2 and 4 is σ·C·s·C⁻¹z, C the b-banded Toeplitz square root of the prefix-sum matrix with
  coefficients binom(2k, k)/4^k, z the independent run's draws: a dense float64 solve, over several steps and across
  a segment restart (``load_state_dict``: block-diagonal C).
* ``noise_std_of_mean`` is the step's marginal std σ·C·s·√V_n/B (V_n from the dense inverse), and the empirical std
  of the noise actually added matches it; DP-AdamBC's update uses Φ = (σ·C·s/B)²·V_n (a float64 Adam-BC reference).
* The ledger: ε of T banded steps is the accountant's at (σ, b·q, ⌈T/b⌉), steps count noisy steps, the budget stops
  at the equivalent rounds, priors compose, a checkpoint of another b is refused.
"""

from __future__ import annotations

import math

import pytest
import torch

from hf_dp.optim import make_optimizer
from hf_dp.privacy import banded
from hf_dp.privacy.accounting import PrivacyLedger, PrivacySpec, calibrate_noise_multiplier, compute_epsilon, public_run
from hf_dp.privacy.privatizer import PrivacyBudgetExceeded

SHAPES = [(40,), (6, 5), (3,)]


def _params(shapes=SHAPES, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g)) for s in shapes]


def _opt(mechanism="independent", bands=1, name="dp_sgd", sigma=1.0, C=1.0, B=1.0, seed=5, params=None, **kw):
    kw.setdefault("lr", 0.0)
    return make_optimizer(name, params if params is not None else _params(), noise_multiplier=sigma, max_grad_norm=C,
                          expected_batch_size=B, noise_seed=seed, noise_mechanism=mechanism, noise_bands=bands, **kw)


def _step(opt, sums=None) -> torch.Tensor:
    """One noisy step over the clipped sums ``sums`` (zeros when None): the privatized gradients, flattened."""
    opt.add_clipped_sum({p: (torch.zeros_like(p) if sums is None else sums[i]) for i, p in enumerate(opt.params)})
    opt.step()
    return torch.cat([p.grad.detach().reshape(-1).clone() for p in opt.params])


def _reference_c(b: int, T: int) -> torch.Tensor:
    """The b-banded lower-triangular Toeplitz C (float64), its coefficients computed here: binom(2k, k)/4^k."""
    c = [math.comb(2 * k, k) / 4**k for k in range(b)]
    M = torch.zeros(T, T, dtype=torch.float64)
    for k in range(min(b, T)):
        M += torch.diag(torch.full((T - k,), c[k], dtype=torch.float64), -k)
    return M


def test_the_coefficients_are_those_of_the_square_root_of_the_prefix_sum():
    for b in (1, 2, 3, 4, 7):
        assert banded.bsr_coefficients(b) == pytest.approx([math.comb(2 * k, k) / 4**k for k in range(b)], rel=1e-15)
        assert banded.column_norm(b) == pytest.approx(math.sqrt(sum((math.comb(2 * k, k) / 4**k) ** 2 for k in range(b))))
    full = _reference_c(12, 12)  # untruncated, C·C is the all-ones lower triangle (the prefix sum)
    assert torch.allclose(full @ full, torch.tril(torch.ones(12, 12, dtype=torch.float64)), atol=1e-12)


def test_b1_reproduces_todays_noise_bit_for_bit():
    """banded_sqrt with b = 1 adds exactly the noise of the default mechanism (same seeded stream)."""
    sums = [torch.randn(s, generator=torch.Generator().manual_seed(9)) for s in SHAPES]
    default = _opt(sigma=1.3, C=0.7, B=3.0)
    one_band = _opt("banded_sqrt", 1, sigma=1.3, C=0.7, B=3.0)
    for _ in range(4):
        a, b = _step(default, sums), _step(one_band, sums)
        assert torch.equal(a, b)
        assert default.noise_std_of_mean == one_band.noise_std_of_mean == 1.3 * 0.7 / 3.0
    default.load_state_dict(default.state_dict())
    one_band.load_state_dict(one_band.state_dict())
    assert torch.equal(_step(default, sums), _step(one_band, sums))
    assert one_band.correlation.buffered() == []


@pytest.mark.parametrize("b", [2, 4])
def test_the_noise_is_c_inverse_z_across_a_segment_restart(b):
    """σ = C = B = 1: the privatized gradient of a zero sum is the noise. The independent run with the same seed draws
    z (unit normal); the banded run's noise must be s·C⁻¹z, C block-diagonal over the two segments (the second
    starting at load_state_dict, a resume)."""
    indep, band = _opt(seed=11), _opt("banded_sqrt", b, seed=11)
    zs, ws = [], []
    T1, T2 = 6, 4
    for _ in range(T1):
        zs.append(_step(indep))
        ws.append(_step(band))
    assert len(band.correlation.buffered()) == (b - 1) * len(SHAPES)  # the last b − 1 noises of each tensor
    for opt in (indep, band):
        opt.load_state_dict(opt.state_dict())
    assert band.correlation.buffered() == [] and band.correlation.position == 0
    for _ in range(T2):
        zs.append(_step(indep))
        ws.append(_step(band))
    Z, W = torch.stack(zs).double(), torch.stack(ws).double()
    C = torch.block_diag(_reference_c(b, T1), _reference_c(b, T2))
    s = math.sqrt(sum((math.comb(2 * k, k) / 4**k) ** 2 for k in range(b)))
    expected = s * torch.linalg.solve(C, Z)
    assert torch.allclose(W, expected, rtol=1e-5, atol=1e-5)
    assert torch.allclose(W[T1], s * Z[T1], rtol=1e-6, atol=1e-6)  # the restarted segment's first noise: s·z itself
    # without the restart the step after it would have been correlated with the step before
    assert not torch.allclose(W[T1 + 1], s * torch.linalg.solve(_reference_c(b, T1 + T2), Z)[T1 + 1], atol=1e-3)


def test_a_step_off_the_segment_starts_a_new_segment():
    """The noise correlates consecutive steps of the run only: a step whose index does not follow (steps counted in
    between, e.g. by a resume) gets plain s·z."""
    state = banded.BandedNoise(3)
    z = torch.ones(4)
    state.begin_step(0)
    state.correlate("p", z.clone())
    state.end_step(0)
    state.begin_step(1)
    assert torch.allclose(state.correlate("p", z.clone()), torch.full((4,), 0.5))
    state.end_step(1)
    state.begin_step(5)
    assert torch.equal(state.correlate("p", z.clone()), z) and state.position == 0


def _marginal_std_reference(b: int, n: int) -> float:
    """s·√V_n from the dense inverse: V_n = Σ_{m≤n} (C⁻¹)[n, n−m]² = the squared norm of row n of C⁻¹."""
    s = math.sqrt(sum((math.comb(2 * k, k) / 4**k) ** 2 for k in range(b)))
    row = torch.linalg.inv(_reference_c(b, n + 1))[n]
    return s * float(row.norm())


@pytest.mark.parametrize("b", [2, 4])
def test_noise_std_of_mean_is_the_steps_marginal_std(b):
    sigma, C, B = 0.8, 0.5, 4.0
    big = [torch.nn.Parameter(torch.zeros(200_000))]
    opt = _opt("banded_sqrt", b, sigma=sigma, C=C, B=B, params=big, seed=2)
    assert opt.noise_std_of_mean == pytest.approx(sigma * C * banded.column_norm(b) / B, rel=1e-12)  # before a step
    for n in range(7):
        noise = _step(opt)
        expected = sigma * C * _marginal_std_reference(b, n) / B
        assert opt.noise_std_of_mean == pytest.approx(expected, rel=1e-12)
        assert opt.rule.noise_std_of_mean() == pytest.approx(expected, rel=1e-12)
        assert float(noise.std()) == pytest.approx(expected, rel=0.01)  # 200,000 draws: the std's error ~0.16 %
    assert _marginal_std_reference(b, 6) != pytest.approx(banded.column_norm(b), rel=1e-3)  # V_n is not 1


def _adam_bc_reference(grads, theta0, lr, betas, gamma, phis):
    """Float64 DP-AdamBC (seed 003 Alg. 1): θ ← θ − η m̂/√max(v̂ − Φ_t, γ') over the privatized gradients ``grads``."""
    b1, b2 = betas
    theta, m, v = theta0.clone(), torch.zeros_like(theta0), torch.zeros_like(theta0)
    for t, (g, phi) in enumerate(zip(grads, phis), 1):
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        mh, vh = m / (1 - b1**t), v / (1 - b2**t)
        theta = theta - lr * mh / torch.sqrt(torch.clamp(vh - phi, min=gamma))
    return theta


def test_dp_adambc_uses_phi_of_the_banded_noise():
    """Φ_t = (σ·C·s/B)²·V_n, n the step's position in its segment: the update equals the float64 reference with these
    Φ, and not the one with DP-SGD's Φ = (σC/B)²."""
    b, sigma, C, B, lr, betas, gamma = 3, 1.0, 1.0, 2.0, 0.05, (0.9, 0.999), 1e-8
    params = [torch.nn.Parameter(torch.randn(500, generator=torch.Generator().manual_seed(4)))]
    theta0 = params[0].detach().double().clone()
    opt = _opt("banded_sqrt", b, name="dp_adambc", sigma=sigma, C=C, B=B, params=params, seed=8, lr=lr, betas=betas,
               gamma=gamma)
    gen = torch.Generator().manual_seed(6)
    grads, phis = [], []
    for n in range(4):
        sums = [10.0 * torch.randn(500, generator=gen)]  # v̂ − Φ far above γ': no coordinate near the clamp
        grads.append(_step(opt, sums).double())
        phis.append((sigma * C * _marginal_std_reference(b, n) / B) ** 2)
        assert opt.rule.noise_std_of_mean() ** 2 == pytest.approx(phis[-1], rel=1e-12)
    got = params[0].detach().double()
    assert torch.allclose(got, _adam_bc_reference(grads, theta0, lr, betas, gamma, phis), rtol=1e-5, atol=1e-6)
    dp_sgd_phi = [(sigma * C / B) ** 2] * 4
    assert not torch.allclose(got, _adam_bc_reference(grads, theta0, lr, betas, gamma, dp_sgd_phi), rtol=1e-5, atol=1e-6)


# --------------------------------------------------------------------------------------------------- accounting
def _spec(bands=1, mechanism=None, sigma=1.1, q=0.05, **kw):
    mechanism = mechanism or ("independent" if bands == 1 else "banded_sqrt")
    return PrivacySpec(noise_multiplier=sigma, max_grad_norm=1.0, sample_rate=q, expected_batch_size=q * 1000,
                       dataset_size=1000, delta=1e-5, noise_mechanism=mechanism, noise_bands=bands, **kw)


def test_the_ledger_counts_noisy_steps_and_composes_the_equivalent_rounds():
    b, T = 4, 10
    ledger = PrivacyLedger(_spec(b))
    for _ in range(T):
        ledger.record_step()
    assert ledger.steps == ledger.own_steps == T
    assert ledger.accountant.history == [(1.1, 0.2, 3)]  # (σ, b·q, ⌈T/b⌉)
    assert ledger.get_epsilon() == compute_epsilon(1.1, 0.2, 3, 1e-5) == compute_epsilon(1.1, 0.05, T, 1e-5, "prv", b)
    assert ledger.epsilon_after(12) == ledger.get_epsilon() < ledger.epsilon_after(13)
    run = ledger.own_run()
    assert run["steps"] == T and run["history"] == [[1.1, 0.2, 3]] and run["noise_bands"] == b
    assert run["noise_mechanism"] == "banded_sqrt" and public_run(run)["steps"] == T
    # b = 1 (either name) is DP-SGD's accounting exactly
    plain, one = PrivacyLedger(_spec(1)), PrivacyLedger(_spec(1, "banded_sqrt"))
    for _ in range(T):
        plain.record_step()
        one.record_step()
    assert plain.accountant.history == one.accountant.history == [(1.1, 0.05, T)]
    assert plain.get_epsilon() == one.get_epsilon() == compute_epsilon(1.1, 0.05, T, 1e-5)
    assert "noise_bands" not in plain.own_run() and "noise_bands" not in one.own_run()
    assert calibrate_noise_multiplier(2.0, 1e-5, 0.05, 40, bands=4) == calibrate_noise_multiplier(2.0, 1e-5, 0.2, 10)


def test_the_budget_stops_at_the_equivalent_rounds():
    b = 2
    target = compute_epsilon(1.1, 0.05, 4, 1e-5, "prv", b)  # 2 rounds
    opt = _opt("banded_sqrt", b, sigma=1.1, max_epsilon=target, ledger=PrivacyLedger(_spec(b, target_epsilon=target)))
    for _ in range(4):  # steps 1-4: rounds 1, 1, 2, 2
        _step(opt)
    with pytest.raises(PrivacyBudgetExceeded, match="step 5 would spend more than the target"):
        _step(opt)


def test_a_resumed_ledger_and_its_priors():
    ledger = PrivacyLedger(_spec(3))
    for _ in range(7):
        ledger.record_step()
    state = ledger.state_dict()
    again = PrivacyLedger(_spec(3))
    again.load_state_dict(state)
    assert again.steps == 7 and again.accountant.history == [(1.1, pytest.approx(0.15), 3)]
    again.add_steps(2)  # steps a crashed run took past the checkpoint
    assert again.steps == 9 and again.accountant.history == [(1.1, pytest.approx(0.15), 3)]
    with pytest.raises(ValueError, match="noise_bands: checkpoint 3 vs now 2"):
        PrivacyLedger(_spec(2)).load_state_dict(state)
    with pytest.raises(ValueError, match="noise_mechanism: checkpoint 'banded_sqrt' vs now 'independent'"):
        PrivacyLedger(_spec(1)).load_state_dict(state)
    # a checkpoint written before correlated noise existed (no own_steps, no noise fields) is an independent run
    old = {"spec": {k: v for k, v in _spec(1).as_dict().items() if k not in ("noise_mechanism", "noise_bands")},
           "history": [(1.1, 0.05, 5)]}
    legacy = PrivacyLedger(_spec(1))
    legacy.load_state_dict(old)
    assert legacy.steps == legacy.own_steps == 5
    # an independent run after a banded one: steps are noisy steps, ε composes the banded run's equivalent rounds
    later = PrivacyLedger(_spec(1, sigma=0.9))
    later.set_prior([dict(ledger.own_run(), run_id="banded")])
    for _ in range(4):
        later.record_step()
    assert later.prior_steps == 7 and later.steps == 11 and later.own_steps == 4
    assert later.accountant.history == [(1.1, pytest.approx(0.15), 3), (0.9, 0.05, 4)]
    assert later.get_epsilon() > compute_epsilon(1.1, 0.05, 7, 1e-5, "prv", 3)


def test_the_planner_and_the_mechanism_calibrate_on_the_equivalent():
    from hf_dp.plan import flags_for, make_plan, plan_row, run_block
    from hf_dp.privacy.mechanism import Mechanism

    row = plan_row(1000, 3.0, 1e-5, 50, 2, bands=4, disk_cache=False)
    assert row.steps == 40 and row.bands == 4
    assert row.sigma == calibrate_noise_multiplier(3.0, 1e-5, 0.2, 10) == calibrate_noise_multiplier(3.0, 1e-5, 0.05, 40, bands=4)
    plan = make_plan(1000, 3.0, 1e-5, batch_sizes=(50, 300), epochs=(2,), params=10_000, disk_cache=False, bands=4)
    assert [r.batch_size for r in plan.rows] == [50]  # b·B > N left out
    flags = flags_for(plan)
    i = flags.index("--noise_mechanism")
    assert flags[i : i + 4] == ["--noise_mechanism", "banded_sqrt", "--noise_bands", "4"]
    mech = Mechanism.plan(n=1000, declared=False, per_device_batch=50, accumulation=1, world_size=1, delta=1e-5,
                          epsilon=3.0, noise_multiplier=None, max_grad_norm=1.0, accountant="prv", max_steps=0,
                          num_train_epochs=2, noise_mechanism="banded_sqrt", noise_bands=4)
    assert mech.noise_multiplier == row.sigma and mech.bands == 4 and mech.planned_epsilon <= 3.0
    assert mech.describe()["correlated_noise"]["coefficients"] == [1.0, 0.5, 0.375, 0.3125]
    block, _ = run_block(n=1000, batch_size=50, steps=40, sigma=1.0, delta=1e-5, accountant="prv", max_grad_norm=1.0,
                         params=10_000, bands=4)
    assert f"ε = {compute_epsilon(1.0, 0.05, 40, 1e-5, 'prv', 4):.3g}" in block and "banded_sqrt noise with b = 4" in block
