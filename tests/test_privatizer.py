"""The privatizer (hf_dp.privacy.PrivateOptimizer): clipping, noise scale, accumulation, loss
scale, empty batches, the noise scale handed to the rules, and MacAdam's unit clip space."""

from __future__ import annotations

import math

import numpy as np
import opacus
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import reference_optimizers as ref
from hf_dp.optim import make_optimizer
from hf_dp.optim.dp_macadam import DPMacAdam
from hf_dp.privacy import PrivacyLedger, PrivacySpec, PrivateOptimizer

DT = torch.float64


def mlp(seed=0, d_in=5, hidden=4, out=3):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(d_in, hidden), nn.Tanh(), nn.Linear(hidden, out)).to(DT)


def data(n, seed=0, d_in=5, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=g, dtype=DT) * scale, torch.randint(0, 3, (n,), generator=g)


def sum_ce(out, y):
    return F.cross_entropy(out, y, reduction="sum")


def summed(opt):
    return ref.flat([p.summed_grad for p in opt.params])


def grads(opt):
    return ref.flat([p.grad for p in opt.params])


def test_each_per_sample_contribution_is_clipped_to_C():
    C = 2.0
    model = mlp()
    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    opt = make_optimizer("dp_sgd", model.parameters(), noise_multiplier=1.0, max_grad_norm=C, expected_batch_size=4, lr=0.1)
    x, y = data(12, scale=3.0)
    m0 = mlp()
    per_sample = ref.per_sample_grads(m0, list(m0.parameters()), sum_ce, x, y)
    norms = np.linalg.norm(per_sample, axis=1)
    assert (norms > C).any() and (norms < C).any()  # both branches of min(1, C/‖g‖)
    for i in range(len(x)):  # a batch of one: summed_grad is exactly that example's clipped gradient
        sum_ce(gsm(x[i : i + 1]), y[i : i + 1]).backward()
        assert opt.accumulate() == 1
        contrib = summed(opt)
        assert np.linalg.norm(contrib) <= C * (1 + 1e-12)
        np.testing.assert_allclose(contrib, ref.clip_paper(per_sample[i], C), rtol=1e-5, atol=1e-12)
        for p in opt.params:
            p.summed_grad = None
        opt.zero_grad()


def test_noise_std_is_sigma_C_over_B():
    sigma, C, B = 1.5, 0.4, 8
    model = nn.Linear(100, 60).to(DT)  # 6060 coordinates
    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    x = torch.randn(8, 100, dtype=DT)
    y = torch.randn(8, 60, dtype=DT)
    g = {}
    for s in (0.0, sigma):
        opt = make_optimizer("dp_sgd", model.parameters(), noise_multiplier=s, max_grad_norm=C, expected_batch_size=B, noise_seed=4, lr=0.0)
        ((gsm(x) - y) ** 2).sum().backward()
        opt.accumulate()
        opt.step()
        g[s] = grads(opt)
        opt.zero_grad()
    # σ = 0: g̃ is the mean of the clipped per-sample gradients (paper formula)
    per_sample = ref.per_sample_grads(model, list(model.parameters()), lambda o, t: ((o - t) ** 2).sum(), x, y)
    np.testing.assert_allclose(g[0.0], ref.privatize(per_sample, C, np.zeros(g[0.0].size), B), rtol=1e-5, atol=1e-12)
    noise = g[sigma] - g[0.0]
    n = noise.size
    assert opt.noise_std_of_mean == pytest.approx(sigma * C / B, rel=1e-15)
    assert noise.std() == pytest.approx(sigma * C / B, rel=5 / math.sqrt(2 * n))  # 5 standard errors
    assert abs(noise.mean()) < 5 * sigma * C / B / math.sqrt(n)


def _one_logical_batch(micro, name="dp_sgd", loss_scale=None, sigma=0.9, seed=21, **hyper):
    model = mlp()
    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    opt = make_optimizer(name, model.parameters(), noise_multiplier=sigma, max_grad_norm=0.3, expected_batch_size=12, noise_seed=seed, lr=0.1, **hyper)
    x, y = data(12, seed=1, scale=2.0)
    for xs, ys in zip(torch.split(x, micro), torch.split(y, micro)):
        scale = 1.0 if loss_scale is None else loss_scale
        (scale * sum_ce(gsm(xs), ys)).backward()
        opt.accumulate(loss_scale=scale)
    opt.step()
    return opt, grads(opt), ref.flat(opt.params)


@pytest.mark.parametrize("name", ["dp_sgd", "dp_sgd_l2", "dp_macadam"])
def test_micro_batch_accumulation_equals_one_big_batch(name):
    hyper = {"weight_decay": 0.1} if name == "dp_sgd_l2" else {}
    _, g_big, th_big = _one_logical_batch(12, name, **hyper)
    for micro in (4, 5, 1):
        _, g, th = _one_logical_batch(micro, name, **hyper)
        np.testing.assert_allclose(g, g_big, rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(th, th_big, rtol=1e-12, atol=1e-14)


def test_pending_grad_samples_are_accumulated_by_step():
    """Several backward passes without accumulate() in between: step() clips what is pending."""
    _, g_big, _ = _one_logical_batch(12)
    model = mlp()
    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    opt = make_optimizer("dp_sgd", model.parameters(), noise_multiplier=0.9, max_grad_norm=0.3, expected_batch_size=12, noise_seed=21, lr=0.1)
    x, y = data(12, seed=1, scale=2.0)
    for xs, ys in zip(torch.split(x, 4), torch.split(y, 4)):
        sum_ce(gsm(xs), ys).backward()
    opt.step()
    np.testing.assert_allclose(grads(opt), g_big, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("scale", [1 / 3, 0.25, 7.0])
def test_loss_scale_is_undone_exactly(scale):
    _, g_ref, _ = _one_logical_batch(4)
    _, g, _ = _one_logical_batch(4, loss_scale=scale)
    np.testing.assert_allclose(g, g_ref, rtol=1e-12, atol=1e-15)
    # not undoing it would clip the scaled gradients (and change g̃)
    model = mlp()
    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    opt = make_optimizer("dp_sgd", model.parameters(), noise_multiplier=0.9, max_grad_norm=0.3, expected_batch_size=12, noise_seed=21, lr=0.1)
    x, y = data(12, seed=1, scale=2.0)
    (scale * sum_ce(gsm(x), y)).backward()
    opt.accumulate()
    opt.step()
    if scale != 1.0:
        assert not np.allclose(grads(opt), g_ref, rtol=1e-6)


def test_bad_loss_scale():
    model = mlp()
    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    opt = make_optimizer("dp_sgd", model.parameters(), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, lr=0.1)
    x, y = data(4)
    sum_ce(gsm(x), y).backward()
    with pytest.raises(ValueError, match="loss_scale"):
        opt.accumulate(loss_scale=-1.0)


def test_empty_logical_batch_still_adds_noise_and_records_the_step():
    sigma, C, B = 1.1, 0.5, 10
    spec = PrivacySpec(noise_multiplier=sigma, max_grad_norm=C, sample_rate=0.01, expected_batch_size=B, dataset_size=1000, delta=1e-5)
    ledger = PrivacyLedger(spec)
    model = nn.Linear(60, 50).to(DT)
    opacus.GradSampleModule(model, loss_reduction="sum")
    before = ref.flat(model.parameters())
    opt = make_optimizer("dp_sgd", model.parameters(), noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B, noise_seed=8, ledger=ledger, lr=1.0)
    assert opt.accumulate() == 0  # nothing to accumulate
    opt.step()  # no backward at all this logical batch (Poisson sampled nobody)
    g = grads(opt)
    assert ledger.steps == 1 and opt.steps_taken == 1
    assert g.std() == pytest.approx(sigma * C / B, rel=5 / math.sqrt(2 * g.size))
    # exactly the replayed noise / B, and the parameters moved by it
    z = ref.NoiseReplay(8, [p.shape for p in opt.params]).draw(sigma * C)
    np.testing.assert_allclose(g, z / B, rtol=1e-14)
    np.testing.assert_allclose(ref.flat(model.parameters()), before - g, rtol=1e-12, atol=1e-15)


def test_noise_std_of_mean_and_phi_use_the_logical_batch_under_accumulation():
    sigma, C, B, micro = 0.8, 0.25, 16, 4
    model = mlp()
    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    params = list(model.parameters())
    for name, R in (("dp_adambc", ref.RefDPAdamBC), ("dp_adamw_bc", ref.RefDPAdamWBC)):
        theta0 = ref.flat(params)
        opt = make_optimizer(name, params, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B, noise_seed=2, lr=0.01, gamma=1e-6)
        phi = (sigma * C / B) ** 2
        assert opt.noise_std_of_mean == pytest.approx(sigma * C / B, rel=1e-15)
        assert opt.rule.noise_std_of_mean() ** 2 == pytest.approx(phi, rel=1e-15)
        x, y = data(B, seed=3)
        for xs, ys in zip(torch.split(x, micro), torch.split(y, micro)):
            sum_ce(gsm(xs), ys).backward()
            opt.accumulate()
        opt.step()
        g = grads(opt)
        reference = R(theta0, 0.0, phi, 1e-6)
        np.testing.assert_allclose(ref.flat(params), reference.step(g, 0.01), rtol=1e-12)
        assert opt.rule.last_clamp_rate == pytest.approx(reference.clamp_rate)
        # the physical batch would give a different Φ, hence a different step
        wrong = R(theta0, 0.0, (sigma * C / micro) ** 2, 1e-6)
        assert not np.allclose(ref.flat(params), wrong.step(g, 0.01), rtol=1e-6)
        opt.zero_grad()
        with torch.no_grad():
            for p, v in zip(params, ref.unflat(theta0, params)):
                p.copy_(v)


def test_macadam_clips_in_unit_space():
    sigma, C, B = 0.9, 0.05, 6
    model = mlp()
    gsm = opacus.GradSampleModule(model, loss_reduction="sum")
    opt = make_optimizer("dp_macadam", model.parameters(), noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=B, noise_seed=5, lr=0.01)
    assert opt.max_grad_norm == 1.0 and opt.user_max_grad_norm == C
    assert opt.noise_std_of_mean == pytest.approx(sigma / B, rel=1e-15)  # noise std σ/B in clip space
    x, y = data(3, scale=3.0)
    m0 = mlp()
    per_sample = ref.per_sample_grads(m0, list(m0.parameters()), sum_ce, x, y)
    for i in range(3):  # step 1: w_i = g_i / b_0 = g_i / C, clipped to the unit ball
        sum_ce(gsm(x[i : i + 1]), y[i : i + 1]).backward()
        opt.accumulate()
        contrib = summed(opt)
        assert np.linalg.norm(contrib) <= 1 + 1e-12
        np.testing.assert_allclose(contrib, ref.clip_paper(per_sample[i] / C, 1.0), rtol=1e-5)
        for p in opt.params:
            p.summed_grad = None
        opt.zero_grad()
    # an empty first step: g̃ = b_0 ⊙ z/B with z ~ N(0, σ²I) in clip space
    opt.step()
    z = ref.NoiseReplay(5, [p.shape for p in opt.params]).draw(sigma * 1.0)
    np.testing.assert_allclose(grads(opt), C * z / B, rtol=1e-12)


def test_macadam_wrapped_directly_also_clips_in_unit_space():
    """PrivateOptimizer(DPMacAdam(...), max_grad_norm=C) without clip_norm: unit clip space, b_0 = C."""
    model = mlp()
    rule = DPMacAdam(model.parameters(), lr=0.01)
    opt = PrivateOptimizer(rule, noise_multiplier=1.0, max_grad_norm=0.05, expected_batch_size=4, noise_seed=0)
    assert opt.max_grad_norm == 1.0
    assert rule.initial_bound == 0.05
    assert opt.noise_std_of_mean == pytest.approx(1.0 / 4)


def test_privatizer_validation():
    p = nn.Parameter(torch.zeros(2))
    rule = make_optimizer("dp_sgd", [p], noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4).rule
    with pytest.raises(ValueError, match="noise_multiplier"):
        PrivateOptimizer(rule, noise_multiplier=-1.0, max_grad_norm=1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="max_grad_norm"):
        PrivateOptimizer(rule, noise_multiplier=1.0, max_grad_norm=0.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="expected_batch_size"):
        PrivateOptimizer(rule, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=0)
    with pytest.raises(TypeError):
        PrivateOptimizer(torch.optim.SGD([p], lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)


def test_noise_stream_continues_across_steps_and_is_seeded():
    """Two steps draw consecutive noise from one generator keyed by noise_seed (stream_generator(seed, "noise", 0))."""
    model = nn.Linear(7, 3).to(DT)
    opacus.GradSampleModule(model, loss_reduction="sum")
    opt = make_optimizer("dp_sgd", model.parameters(), noise_multiplier=2.0, max_grad_norm=0.5, expected_batch_size=5, noise_seed=77, lr=0.0)
    replay = ref.NoiseReplay(77, [p.shape for p in opt.params])
    for _ in range(3):
        opt.step()
        np.testing.assert_allclose(grads(opt), replay.draw(1.0) / 5, rtol=1e-14)
