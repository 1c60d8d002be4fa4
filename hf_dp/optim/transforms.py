"""Small composable update pieces shared by the DP optimizers (vectorised with ``torch._foreach_*``).

Each piece maps the list of per-parameter updates ``u`` (initially g̃_t = ``p.grad``) to a new list
and never writes into ``p.grad``, so that after ``step()`` ``p.grad`` still holds g̃_t.
Notation: t is the 1-based step, λ the group's ``weight_decay``, θ_{t−1} the parameters before
the step (the chain runs before the final ``θ ← θ − η·u``, so ``ctx.params`` are θ_{t−1}).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .base import StepContext, Transform


class CoupledWeightDecay(Transform):
    """u ← u + λ·θ_{t−1} (L2 regularisation added to the privatized gradient, as ``torch.optim.Adam``)."""

    def __call__(self, updates, ctx):
        wd = float(ctx.group.get("weight_decay", 0.0))
        if wd == 0.0:
            return updates
        return torch._foreach_add(updates, ctx.params, alpha=wd)


class DecoupledWeightDecay(CoupledWeightDecay):
    """u ← u + λ·θ_{t−1}, applied *after* the adaptive direction, so that the step is
    θ_t = θ_{t−1} − η_t(Δ_t + λθ_{t−1}) (seed 000, Alg. 1/2 line 10). The same operation as
    :class:`CoupledWeightDecay`; what makes it decoupled is its place at the end of the chain."""


class HeavyBall(Transform):
    """Heavy-ball momentum with ``torch.optim.SGD`` semantics (dampening 0): b_1 = u_1,
    b_t = μ·b_{t−1} + u_t, u ← b_t. A no-op when μ = 0."""

    def init_state(self, p, state):
        state["momentum_buffer"] = None

    def __call__(self, updates, ctx):
        mu = float(ctx.group.get("momentum", 0.0))
        if mu == 0.0:
            return updates
        old_b, old_u = [], []
        for st, u in zip(ctx.states, updates):
            if st["momentum_buffer"] is None:
                st["momentum_buffer"] = u.clone()
            else:
                old_b.append(st["momentum_buffer"])
                old_u.append(u)
        if old_b:
            torch._foreach_mul_(old_b, mu)
            torch._foreach_add_(old_b, old_u)
        return [st["momentum_buffer"] for st in ctx.states]


class AdamMoments(Transform):
    """m_t = β1·m_{t−1} + (1−β1)·g, v_t = β2·v_{t−1} + (1−β2)·g², and the bias-corrected
    m̂_t = m_t/(1−β1^t), v̂_t = v_t/(1−β2^t), handed on in ``ctx.extras`` (``m_hat``, ``v_hat``).
    The update it returns is m̂_t; a denominator piece divides it."""

    def init_state(self, p, state):
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)

    def __call__(self, updates, ctx):
        b1, b2 = ctx.group["betas"]
        m = [st["exp_avg"] for st in ctx.states]
        v = [st["exp_avg_sq"] for st in ctx.states]
        torch._foreach_lerp_(m, updates, 1.0 - b1)
        torch._foreach_mul_(v, b2)
        torch._foreach_addcmul_(v, updates, updates, value=1.0 - b2)
        # each parameter's own t: a parameter whose p.grad was None at some earlier step (skipped by
        # step()) has taken fewer steps than the others in its group and needs its own correction
        steps = [st["step"] for st in ctx.states]
        if all(t == steps[0] for t in steps):
            t = steps[0]
            m_hat = torch._foreach_div(m, 1.0 - b1**t)
            v_hat = torch._foreach_div(v, 1.0 - b2**t)
        else:
            m_hat = [mi / (1.0 - b1**t) for mi, t in zip(m, steps)]
            v_hat = [vi / (1.0 - b2**t) for vi, t in zip(v, steps)]
        ctx.extras["m_hat"], ctx.extras["v_hat"] = m_hat, v_hat
        return m_hat


class AdamDenominator(Transform):
    """u ← m̂_t / D(v̂_t) with D one of:

    * ``"eps_outside"``: D = √v̂_t + ε (Kingma & Ba; ``torch.optim.Adam``; seed 003 §2),
    * ``"eps_inside"``:  D = √(v̂_t + ε) (seed 000, Alg. 1 line 10: ``m̂/√(v̂+ε0)``),
    * ``"bias_corrected"``: D = √max(v̂_t − Φ, γ'), Φ = (σC/B)² (seed 003 eq. 4 / Alg. 1; seed 000 Alg. 2),
      where σC/B comes from the privatizer. The fraction of coordinates clamped to γ'
      (v̂_t − Φ < γ') is stored in ``ctx.extras["clamped"]``/``["numel"]`` (seed 000 §F.3).

    ε is the group's ``eps``; γ' is the group's ``gamma``.
    """

    def __init__(self, kind: str):
        if kind not in ("eps_outside", "eps_inside", "bias_corrected"):
            raise ValueError(f"unknown denominator {kind!r}")
        self.kind = kind

    def __call__(self, updates, ctx):
        v_hat = ctx.extras["v_hat"]
        if self.kind == "eps_outside":
            den = torch._foreach_sqrt(v_hat)
            torch._foreach_add_(den, float(ctx.group["eps"]))
        elif self.kind == "eps_inside":
            den = torch._foreach_add(v_hat, float(ctx.group["eps"]))
            torch._foreach_sqrt_(den)
        else:
            phi = ctx.rule.noise_std_of_mean() ** 2
            gamma = float(ctx.group["gamma"])
            den = torch._foreach_sub(v_hat, phi)
            # kept as a tensor: no host sync in the hot path
            ctx.extras["clamped"] = torch.stack([(d < gamma).sum() for d in den]).sum()
            ctx.extras["numel"] = sum(d.numel() for d in den)
            torch._foreach_clamp_min_(den, gamma)
            torch._foreach_sqrt_(den)
        return torch._foreach_div(updates, den)
