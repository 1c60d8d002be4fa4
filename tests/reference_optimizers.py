"""Step-by-step references for the hf_dp optimizers, written from the papers' equations.

Independent of hf_dp: everything here is numpy (float64) on ONE flat vector holding all trainable
coordinates (so "jointly over all parameters" is literal), with a per-coordinate weight-decay vector
λ (param groups with different decay just give different entries). Each class follows one
algorithm of one paper line by line; the choices hf_dp documents where a paper is open are
*explicit arguments* here, so a test can pin each one.

Papers (the ``seeds`` folder of the shared data beside the repo, ``../shared/seeds``):

* seed 000, Alg. 1 (DP-AdamW) and Alg. 2 (DP-AdamW-BC);
* seed 001 (DP-MacAdam);
* seed 002 (DP-SGD with the L2 term inside the per-sample gradient, "Our Method");
* seed 003, §3 (DP-Adam) and Alg. 1 / eq. 4 (DP-AdamBC).

The privatized gradient (seed 000 Alg. 1 line 5, seed 003 Alg. 1):
    g̃_t = (1/B) ( Σ_i g_i / max(1, ‖g_i‖₂/C) + z_t ),   z_t ~ N(0, σ²C²I).
"""

from __future__ import annotations

import numpy as np
import torch


# ----------------------------------------------------------------------------------------------
# helpers: flat vectors, per-sample gradients, clipping, replaying the privatizer's noise
# ----------------------------------------------------------------------------------------------
def flat(tensors) -> np.ndarray:
    return np.concatenate([t.detach().double().reshape(-1).cpu().numpy() for t in tensors])


def unflat(vec: np.ndarray, like) -> list[torch.Tensor]:
    out, off = [], 0
    for t in like:
        n = t.numel()
        out.append(torch.from_numpy(vec[off : off + n].copy()).view_as(t).to(t.dtype))
        off += n
    return out


def clip_paper(g: np.ndarray, C: float) -> np.ndarray:
    """g / max(1, ‖g‖₂/C)  (seed 000 line 5; seed 002 step 3; seed 001 with C = 1)."""
    return g / max(1.0, float(np.linalg.norm(g)) / C)


def per_sample_grads(model: torch.nn.Module, params, loss_fn, xs: torch.Tensor, ys: torch.Tensor) -> np.ndarray:
    """One row per example: ∇_θ ℓ(θ, x_i) flattened in the order of ``params``, by a plain
    autograd loop over examples (no Opacus)."""
    params = list(params)
    rows = []
    for x, y in zip(xs, ys):
        loss = loss_fn(model(x.unsqueeze(0)), y.unsqueeze(0))
        grads = torch.autograd.grad(loss, params)
        rows.append(flat(grads))
    if not rows:
        return np.zeros((0, sum(p.numel() for p in params)))
    return np.stack(rows)


class NoiseReplay:
    """Reproduces the privatizer's Gaussian draws in a fresh run: one ``torch.Generator`` keyed by
    (the optimizer's ``noise_seed``, "noise", step 0) (``hf_dp.privacy.randomness.stream_generator``), one
    ``torch.normal(0, std, shape)`` per trainable parameter per step, in parameter order (the order Opacus'
    ``add_noise`` uses). Returns the flat noise z_t."""

    def __init__(self, seed: int, shapes, dtype=torch.float64):
        from hf_dp.privacy.randomness import stream_generator

        self.gen = stream_generator(int(seed), "noise", 0)
        self.shapes = [tuple(s) for s in shapes]
        self.dtype = dtype

    def draw(self, std: float) -> np.ndarray:
        if std == 0:
            return np.zeros(sum(int(np.prod(s)) for s in self.shapes))
        parts = [torch.normal(mean=0.0, std=std, size=s, generator=self.gen, dtype=self.dtype) for s in self.shapes]
        return flat(parts)


def privatize(per_sample: np.ndarray, C: float, z: np.ndarray, B: float) -> np.ndarray:
    """g̃ = (1/B)(Σ_i clip_C(g_i) + z).  B is the *expected* batch (hf_dp's documented choice;
    seed 002 writes 1/|I_t|, seeds 000/003 write 1/B with sampling probability B/N)."""
    s = np.zeros_like(z)
    for g in per_sample:
        s = s + clip_paper(g, C)
    return (s + z) / B


# ----------------------------------------------------------------------------------------------
# update rules that only read g̃
# ----------------------------------------------------------------------------------------------
class RefDPSGD:
    """DP-SGD (Abadi et al.) on g̃ with weight decay *after noising* (seed 002, DP-SGD step 5:
    θ_{t+1} = (1−ηλ)θ_t − ηg̃_t) and optional heavy-ball momentum with torch.optim.SGD semantics
    (hf_dp's documented choice): d_t = g̃_t + λθ_{t−1}; b_1 = d_1, b_t = μb_{t−1} + d_t; θ_t = θ_{t−1} − ηb_t."""

    def __init__(self, theta0, lam, momentum=0.0):
        self.theta = np.array(theta0, dtype=np.float64)
        self.lam = np.asarray(lam, dtype=np.float64)
        self.mu = momentum
        self.buf = None

    def step(self, g, lr):
        d = g + self.lam * self.theta
        if self.mu:
            self.buf = d.copy() if self.buf is None else self.mu * self.buf + d
            d = self.buf
        self.theta = self.theta - lr * d
        return self.theta


class _Moments:
    """Lines 6–9 of seed 000 Alg. 1/2 (= seed 003 §3): m, v, m̂, v̂ with m_0 = v_0 = 0."""

    def __init__(self, n, b1, b2):
        self.m = np.zeros(n)
        self.v = np.zeros(n)
        self.b1, self.b2 = b1, b2
        self.t = 0

    def update(self, g):
        self.t += 1
        self.m = self.b1 * self.m + (1 - self.b1) * g
        self.v = self.b2 * self.v + (1 - self.b2) * g * g
        return self.m / (1 - self.b1**self.t), self.v / (1 - self.b2**self.t)


class RefDPAdam:
    """DP-Adam, seed 003 §3: θ_t = θ_{t−1} − η m̂_t/(√v̂_t + γ), moments of g̃_t.
    Documented hf_dp choice (not in the paper): optional coupled L2, g̃_t ← g̃_t + λθ_{t−1}
    before the moments (torch.optim.Adam's weight_decay)."""

    def __init__(self, theta0, lam, betas=(0.9, 0.999), eps=1e-8):
        self.theta = np.array(theta0, dtype=np.float64)
        self.lam = np.asarray(lam, dtype=np.float64)
        self.mom = _Moments(self.theta.size, *betas)
        self.eps = eps

    def step(self, g, lr):
        g = g + self.lam * self.theta
        m_hat, v_hat = self.mom.update(g)
        self.theta = self.theta - lr * m_hat / (np.sqrt(v_hat) + self.eps)
        return self.theta


class RefDPAdamBC:
    """DP-AdamBC, seed 003 Alg. 1 / eq. 4: θ_t = θ_{t−1} − η m̂_t/√max(v̂_t − Φ, γ'), Φ = (σC/B)².
    Same optional coupled L2 as RefDPAdam (documented, default λ = 0)."""

    def __init__(self, theta0, lam, phi, gamma, betas=(0.9, 0.999)):
        self.theta = np.array(theta0, dtype=np.float64)
        self.lam = np.asarray(lam, dtype=np.float64)
        self.mom = _Moments(self.theta.size, *betas)
        self.phi, self.gamma = phi, gamma
        self.clamp_rate = None

    def step(self, g, lr):
        g = g + self.lam * self.theta
        m_hat, v_hat = self.mom.update(g)
        corr = v_hat - self.phi
        self.clamp_rate = float(np.mean(corr < self.gamma))
        self.theta = self.theta - lr * m_hat / np.sqrt(np.maximum(corr, self.gamma))
        return self.theta


class RefDPAdamW:
    """DP-AdamW, seed 000 Alg. 1 line 10: θ_t = θ_{t−1} − η_t ( m̂_t/√(v̂_t + ε0) + λθ_{t−1} )  (ε0 INSIDE the root)."""

    def __init__(self, theta0, lam, betas=(0.9, 0.999), eps0=1e-8):
        self.theta = np.array(theta0, dtype=np.float64)
        self.lam = np.asarray(lam, dtype=np.float64)
        self.mom = _Moments(self.theta.size, *betas)
        self.eps0 = eps0

    def step(self, g, lr):
        m_hat, v_hat = self.mom.update(g)
        self.theta = self.theta - lr * (m_hat / np.sqrt(v_hat + self.eps0) + self.lam * self.theta)
        return self.theta


class RefDPAdamWBC:
    """DP-AdamW-BC, seed 000 Alg. 2 line 10: θ_t = θ_{t−1} − η_t ( m̂_t/√max(v̂_t − (σC/B)², γ) + λθ_{t−1} )."""

    def __init__(self, theta0, lam, phi, gamma, betas=(0.9, 0.999)):
        self.theta = np.array(theta0, dtype=np.float64)
        self.lam = np.asarray(lam, dtype=np.float64)
        self.mom = _Moments(self.theta.size, *betas)
        self.phi, self.gamma = phi, gamma
        self.clamp_rate = None

    def step(self, g, lr):
        m_hat, v_hat = self.mom.update(g)
        corr = v_hat - self.phi
        self.clamp_rate = float(np.mean(corr < self.gamma))
        self.theta = self.theta - lr * (m_hat / np.sqrt(np.maximum(corr, self.gamma)) + self.lam * self.theta)
        return self.theta


# ----------------------------------------------------------------------------------------------
# rules whose per-sample processing differs
# ----------------------------------------------------------------------------------------------
class RefDPSGDL2:
    """seed 002 "Our Method": g_i = ∇[ℓ(θ, x_i) + (λ/2)‖θ‖²] = ∇ℓ_i + λθ;  ḡ_i = g_i·min(1, R/‖g_i‖);
    g̃ = (1/B)(Σ_i ḡ_i + σR·N(0, I));  θ_{t+1} = θ_t − ηg̃  (no decay after noising).
    Documented hf_dp choices: divide by the expected B; optional heavy-ball momentum as RefDPSGD."""

    def __init__(self, theta0, lam, C, B, momentum=0.0):
        self.theta = np.array(theta0, dtype=np.float64)
        self.lam = np.asarray(lam, dtype=np.float64)
        self.C, self.B = C, B
        self.mu = momentum
        self.buf = None
        self.last_g = None

    def step(self, per_sample_loss_grads: np.ndarray, z: np.ndarray, lr):
        g_i = per_sample_loss_grads + self.lam * self.theta[None, :]
        g = privatize(g_i, self.C, z, self.B)
        self.last_g = g
        if self.mu:
            self.buf = g.copy() if self.buf is None else self.mu * self.buf + g
            g = self.buf
        self.theta = self.theta - lr * g
        return self.theta


class RefDPMacAdam:
    """DP-MacAdam, seed 001 (all coordinate-wise; norms and Σ_j over every trainable coordinate):

        w_i = (g_i − m̂_{t−1})/b_{t−1};  w̄_i = w_i/max(1, ‖w_i‖₂);  z_t ~ N(0, σ²/B² I);
        w̃_t = (1/B)Σ_i w̄_i + z_t;  g̃_t = b_{t−1}⊙w̃_t + m̂_{t−1};
        m_t, v_t, m̂_t, v̂_t as Adam;  θ_t = θ_{t−1} − η m̂_t/(√v̂_t + γ);
        u_t = (g̃_t − m̂_t)²;  s_t = β1 s_{t−1} + (1−β1)u_t;  κ_t = 2(β1 − β1^t)/(1+β1);
        ŝ_t = clamp(s_t/κ_t − b_{t−1}²σ²/B², h1, h2);  b_t = ŝ_t^{1/4}(Σ_j ŝ_{t,j}^{1/2})^{1/2}.

    Choices the paper leaves open, all explicit arguments here (hf_dp's documented values):
      * ``b0`` (hf_dp: the user's C, every coordinate) and m̂_0 = 0, s_0 = 0;
      * no bound refresh at t = 1 (κ_1 = 0 would divide by zero), so b_1 = b_0; s is still updated at t = 1;
      * ``h1``, ``h2`` (hf_dp defaults 1e-12, 1.0);
      * optional decoupled weight decay −ηλθ_{t−1} (hf_dp, default λ = 0, not in the paper);
      * B is the expected batch.
    ``z_sum`` passed to :meth:`step` is the noise on the SUM in clip space, N(0, σ²I); z_t = z_sum/B.
    """

    def __init__(self, theta0, lam, b0, sigma, B, betas=(0.9, 0.999), gamma=1e-8, h1=1e-12, h2=1.0):
        self.theta = np.array(theta0, dtype=np.float64)
        n = self.theta.size
        self.lam = np.asarray(lam, dtype=np.float64)
        self.b = np.full(n, float(b0))
        self.m_hat_prev = np.zeros(n)
        self.s = np.zeros(n)
        self.mom = _Moments(n, *betas)
        self.b1 = betas[0]
        self.sigma, self.B, self.gamma, self.h1, self.h2 = sigma, B, gamma, h1, h2
        self.last_g = None

    def step(self, per_sample: np.ndarray, z_sum: np.ndarray, lr):
        w_bar = [clip_paper((g - self.m_hat_prev) / self.b, 1.0) for g in per_sample]
        w_tilde = (np.sum(w_bar, axis=0) if w_bar else 0.0) / self.B + z_sum / self.B
        g = self.b * w_tilde + self.m_hat_prev
        self.last_g = g
        m_hat, v_hat = self.mom.update(g)
        theta_prev = self.theta
        self.theta = theta_prev - lr * (m_hat / (np.sqrt(v_hat) + self.gamma) + self.lam * theta_prev)
        t = self.mom.t
        u = (g - m_hat) ** 2
        self.s = self.b1 * self.s + (1 - self.b1) * u
        kappa = 2 * (self.b1 - self.b1**t) / (1 + self.b1)
        if t >= 2:  # κ_1 = 0: the paper's ŝ_1 is undefined; hf_dp keeps b_1 = b_0
            s_hat = np.clip(self.s / kappa - self.b**2 * self.sigma**2 / self.B**2, self.h1, self.h2)
            self.b = s_hat**0.25 * np.sqrt(np.sum(np.sqrt(s_hat)))
        self.m_hat_prev = m_hat
        return self.theta


# ----------------------------------------------------------------------------------------------
# the variant of seed 000's authors' public code (issue 17 §12): not the paper; --optim_args variant=adam_corr
# ----------------------------------------------------------------------------------------------
class RefAuthorsDPAdamW:
    """The authors' code for DP-AdamW (``variant=adam_corr``): ε0 OUTSIDE the root, weight decay applied to the already-updated θ:
    θ̃ = θ_{t−1} − η_t m̂_t/(√v̂_t + ε0);  θ_t = (1 − η_tλ) θ̃."""

    def __init__(self, theta0, lam, betas=(0.9, 0.999), eps0=1e-8):
        self.theta = np.array(theta0, dtype=np.float64)
        self.lam = np.asarray(lam, dtype=np.float64)
        self.mom = _Moments(self.theta.size, *betas)
        self.eps0 = eps0

    def step(self, g, lr):
        m_hat, v_hat = self.mom.update(g)
        updated = self.theta - lr * m_hat / (np.sqrt(v_hat) + self.eps0)
        self.theta = (1.0 - lr * self.lam) * updated
        return self.theta


class RefAuthorsDPAdamWBC:
    """The authors' code for DP-AdamW-BC (their ``adam_corr.py``; ``variant=adam_corr``): the optimizer's eps added outside the clamped root,
    γ = 1e-10 where the paper fixes 1e-8, decay on the updated θ:
    θ̃ = θ_{t−1} − η_t m̂_t/(√max(v̂_t − Φ, γ) + ε);  θ_t = (1 − η_tλ) θ̃."""

    def __init__(self, theta0, lam, phi, gamma=1e-10, eps0=1e-8, betas=(0.9, 0.999)):
        self.theta = np.array(theta0, dtype=np.float64)
        self.lam = np.asarray(lam, dtype=np.float64)
        self.mom = _Moments(self.theta.size, *betas)
        self.phi, self.gamma, self.eps0 = phi, gamma, eps0
        self.clamp_rate = None

    def step(self, g, lr):
        m_hat, v_hat = self.mom.update(g)
        corr = v_hat - self.phi
        self.clamp_rate = float(np.mean(corr < self.gamma))
        updated = self.theta - lr * m_hat / (np.sqrt(np.maximum(corr, self.gamma)) + self.eps0)
        self.theta = (1.0 - lr * self.lam) * updated
        return self.theta
