"""Small composable update pieces shared by the DP optimizers (vectorised with ``torch._foreach_*``).

Each piece maps the list of per-parameter updates ``u`` (initially g̃_t = ``p.grad``) to a new list
and never writes into ``p.grad`` or optimizer state it does not own, so that after ``step()`` ``p.grad``
still holds g̃_t. A piece that returns a fresh list of temporaries marks it (``ctx.mark_temporary``);
later pieces may then update it in place instead of allocating another parameter-sized list.
Notation: t is the 1-based step, λ the group's ``weight_decay``, θ_{t−1} the parameters before
the step (the chain runs before the final ``θ ← θ − η·u``, so ``ctx.params`` are θ_{t−1}).
"""

from __future__ import annotations

import math

import torch

from .base import Transform


class CoupledWeightDecay(Transform):
    """u ← u + λ·θ_{t−1} (L2 regularisation added to the privatized gradient, as ``torch.optim.Adam``)."""

    def __call__(self, updates, ctx):
        wd = float(ctx.group.get("weight_decay", 0.0))
        if wd == 0.0:
            return updates
        if ctx.is_temporary(updates):  # a fresh list of an earlier piece (not g̃, not state): in place
            torch._foreach_add_(updates, ctx.params, alpha=wd)
            return updates
        return torch._foreach_add(updates, ctx.params, alpha=wd)


class DecoupledWeightDecay(CoupledWeightDecay):
    """u ← u + λ·θ_{t−1}, applied *after* the adaptive direction, so that the step is
    θ_t = θ_{t−1} − η_t(Δ_t + λθ_{t−1}) (seed 000, Alg. 1/2 line 10). The same operation as
    :class:`CoupledWeightDecay`; what makes it decoupled is its place at the end of the chain."""


class DecayOfUpdatedParams(Transform):
    """u ← (1 − η_tλ)·u + λ·θ_{t−1}, so that the final θ ← θ − η_t·u gives θ_t = (1 − η_tλ)(θ_{t−1} − η_t·u_in):
    weight decay applied to the *already-updated* parameters, as the public code of seed 000's authors does
    (``--optim_args variant=adam_corr``; the paper decays θ_{t−1}: :class:`DecoupledWeightDecay`)."""

    def __call__(self, updates, ctx):
        wd = float(ctx.group.get("weight_decay", 0.0))
        if wd == 0.0:
            return updates
        out = updates if ctx.is_temporary(updates) else torch._foreach_mul(updates, 1.0)
        torch._foreach_mul_(out, 1.0 - float(ctx.group["lr"]) * wd)
        torch._foreach_add_(out, ctx.params, alpha=wd)
        return ctx.mark_temporary(out)


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
    """m_t = β1·m_{t−1} + (1−β1)·g, v_t = β2·v_{t−1} + (1−β2)·g².

    Returns the *raw* m_t and hands on v_t and the bias corrections c1 = 1−β1^t, c2 = 1−β2^t (one per
    parameter: a parameter skipped at some step has its own t) in ``ctx.extras``; a denominator piece
    (:class:`AdamDenominator`) must follow: it applies m̂_t = m_t/c1 and v̂_t = v_t/c2 folded into its
    own arithmetic, so that no bias-corrected copy of m or v is ever materialised."""

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
        ctx.extras["c1"] = [1.0 - b1 ** st["step"] for st in ctx.states]
        ctx.extras["c2"] = [1.0 - b2 ** st["step"] for st in ctx.states]
        ctx.extras["v"] = v
        return m


class AdamDenominator(Transform):
    """u ← m̂_t / D(v̂_t) (m̂_t = m_t/c1, v̂_t = v_t/c2 from :class:`AdamMoments`) with D one of:

    * ``"eps_outside"``: D = √v̂_t + ε (Kingma & Ba; ``torch.optim.Adam``; seed 003 §2),
    * ``"eps_inside"``:  D = √(v̂_t + ε) (seed 000, Alg. 1 line 10: ``m̂/√(v̂+ε0)``),
    * ``"bias_corrected"``: D = √max(v̂_t − Φ, γ'), Φ = (σC/B)² (seed 003 eq. 4 / Alg. 1; seed 000 Alg. 2),
      where σC/B comes from the privatizer (the noise std of the step; with banded correlated noise σC·s·√V_n/B,
      :mod:`hf_dp.privacy.banded`). The fraction of coordinates clamped to γ'
      (v̂_t − Φ < γ') is stored in ``ctx.extras["clamped"]``/``["numel"]`` (seed 000 §F.3).

    ε is the group's ``eps``; γ' is the group's ``gamma``. ``eps_outside=True`` (``bias_corrected`` only): D =
    √max(v̂_t − Φ, γ') + ε, as the public code of seed 000's authors (``adam_corr.py``); the papers add nothing.
    Computed as m_t / (c1·D), with c1 and c2 folded into per-parameter scalars (one temporary list, no copies of m̂ or v̂).
    """

    def __init__(self, kind: str, eps_outside: bool = False):
        if kind not in ("eps_outside", "eps_inside", "bias_corrected"):
            raise ValueError(f"unknown denominator {kind!r}")
        self.kind = kind
        self.eps_outside = bool(eps_outside) and kind == "bias_corrected"

    def __call__(self, updates, ctx):
        v, c1, c2 = ctx.extras["v"], ctx.extras["c1"], ctx.extras["c2"]
        if self.kind == "eps_outside":  # c1·(√(v/c2) + ε) = √v·(c1/√c2) + c1·ε
            den = torch._foreach_sqrt(v)
            torch._foreach_mul_(den, [a / math.sqrt(b) for a, b in zip(c1, c2)])
            torch._foreach_add_(den, [a * float(ctx.group["eps"]) for a in c1])
        elif self.kind == "eps_inside":  # c1·√(v/c2 + ε) = √(v·c1²/c2 + ε·c1²)
            den = torch._foreach_mul(v, [a * a / b for a, b in zip(c1, c2)])
            torch._foreach_add_(den, [a * a * float(ctx.group["eps"]) for a in c1])
            torch._foreach_sqrt_(den)
        else:  # c1·√max(v/c2 − Φ, γ') = √max(c1²(v/c2 − Φ), c1²γ')
            phi = ctx.rule.noise_std_of_mean() ** 2
            gamma = float(ctx.group["gamma"])
            den = torch._foreach_mul(v, [a * a / b for a, b in zip(c1, c2)])
            torch._foreach_add_(den, [-phi * a * a for a in c1])
            floors = [gamma * a * a for a in c1]
            every = int(getattr(ctx.rule, "clamp_rate_every", 1) or 0)
            if every and ctx.states[0]["step"] % every == 0:  # the §F.3 diagnostic costs a pass: only when logged
                # kept as a tensor: no host sync in the hot path
                ctx.extras["clamped"] = torch.stack([(d < f).sum() for d, f in zip(den, floors)]).sum()
                ctx.extras["numel"] = sum(d.numel() for d in den)
            torch._foreach_clamp_min_(den, floors)
            torch._foreach_sqrt_(den)
            if self.eps_outside:  # c1·(√max(…) + ε) = √max(c1²…) + c1·ε
                torch._foreach_add_(den, [a * float(ctx.group["eps"]) for a in c1])
        torch._foreach_div_(den, updates)  # den ← den / m, then invert: no second temporary list
        torch._foreach_reciprocal_(den)
        return ctx.mark_temporary(den)
