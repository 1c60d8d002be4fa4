import math

import torch

from .base import Variant, check_positive
from .dp_adam import _AdamFamily
from .registry import register


@register(
    "dp_macadam",
    source="seed 001 (Tasnim, Sankar, Kosut)",
    summary="DP-MacAdam: adaptive per-coordinate clipping reusing Adam's moments",
)
class DPMacAdam(_AdamFamily):
    r"""DP-MacAdam (seed 001): per-example gradients are centred by m̂_{t−1}, scaled per coordinate
    by b_{t−1}, clipped to unit norm, averaged and noised; the same moments drive Adam.

    w_i = (g_i − m̂_{t−1}) / b_{t−1};  w̄_i = w_i / max(1, ‖w_i‖₂);
    w̃_t = (1/B)(Σ_i w̄_i + N(0, σ²I));  g̃_t = b_{t−1} ⊙ w̃_t + m̂_{t−1};
    m_t, v_t, m̂_t, v̂_t as in Adam on g̃_t;  θ_t = θ_{t−1} − η m̂_t/(√v̂_t + γ)   (γ = ``eps``);
    u_t = (g̃_t − m̂_t)²;  s_t = β1 s_{t−1} + (1−β1)u_t;  κ_t = 2(β1 − β1^t)/(1+β1);
    ŝ_t = clamp(s_t/κ_t − b_{t−1}²σ²/B², h1, h2);  b_t = ŝ_t^{1/4} (Σ_j ŝ_{t,j}^{1/2})^{1/2}.
    All norms and the sum over j run over every trainable coordinate jointly.

    Sensitivity: m̂_{t−1} and b_{t−1} are computed from earlier privatized gradients only (public
    by post-processing), so the map g_i ↦ w̄_i uses no other private data, and ‖w̄_i‖ ≤ 1: each
    example changes Σ_i w̄_i by at most 1 in L2, and the noise N(0, σ²I) on that sum is the Gaussian
    mechanism with sensitivity 1 and multiplier σ — the same (q, σ, steps) accounting as DP-SGD.
    The user's clip norm C enters only through the initial bound b_0.

    Choices where the paper is open (documented and tested):
    * b_0 = C·1 (every coordinate) and m̂_0 = 0, so step 1 is exactly DP-SGD clipping at C;
    * at t = 1, κ_1 = 0, so the bound is not refreshed (b_1 = b_0); s is updated from t = 1 on;
    * β1 = 0 is refused (κ_t would be 0 at every step);
    * noise is divided by the expected batch B (Opacus semantics), and Φ-like correction uses it;
    * h1 = 1e-12, h2 = 1.0 by default (``h1``, ``h2``; the paper leaves them to the user);
    * optional decoupled ``weight_decay`` (default 0, not in the paper) as in DP-AdamW.
    """

    variants = (Variant("paper", "seed 001", denominator="eps_outside", decay="decoupled"),)

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, h1=1e-12, h2=1.0, initial_bound=None,
                 fused=None, variant="paper"):
        check_positive("h1", h1)
        check_positive("h2", h2)
        if h1 > h2:
            raise ValueError(f"h1 must be <= h2, got h1={h1}, h2={h2}")
        # b_0 = C: None means "the C of the privatizer this rule gets attached to" (1.0 standalone)
        self._initial_bound_explicit = initial_bound is not None
        if initial_bound is not None:
            check_positive("initial_bound (C)", initial_bound)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused, variant=variant,
                         h1=h1, h2=h2)
        self.initial_bound = float(initial_bound) if initial_bound is not None else 1.0

    def check_group(self, group):
        super().check_group(group)
        if group["betas"][0] <= 0:  # κ_t = 2(β1 − β1^t)/(1+β1) would be 0 at every step: ŝ = s/κ undefined
            raise ValueError(f"DP-MacAdam needs betas[0] (--adam_beta1) > 0: its bound refresh divides by κ_t ∝ β1 − β1^t; got {group['betas'][0]}")
        h1 = check_positive("h1", group["h1"])
        h2 = check_positive("h2", group["h2"])
        if h1 > h2:
            raise ValueError(f"h1 must be <= h2, got h1={h1}, h2={h2}")

    def clip_norm(self, max_grad_norm):
        """The one statement of MacAdam's clip norm: per-sample vectors are clipped to the unit ball in clip space,
        whatever the user's C (the privatizer asks this)."""
        return 1.0

    def attach_privatizer(self, privatizer):
        super().attach_privatizer(privatizer)
        if not self._initial_bound_explicit:  # b_0 = the user's C, the one the privatizer was given
            self.initial_bound = float(privatizer.user_max_grad_norm)

    def _center_and_bound(self, p):
        """(inv_c1, b) for parameter p after t steps: the centre is m̂ = exp_avg · inv_c1 with
        inv_c1 = 1/(1−β1^t) (None when t = 0: m̂_0 = 0), b the current bound; (None, None) before the
        state exists (b = b_0)."""
        st = self.state[p]
        if "bound" not in st:
            return None, None
        t = st["step"]
        return (1.0 / (1.0 - self._group_of(p)["betas"][0] ** t) if t > 0 else None), st["bound"]

    def _group_of(self, p):
        index = self.__dict__.get("_group_index")
        if index is None or id(p) not in index:  # built lazily, rebuilt after add_param_group
            index = self._group_index = {id(q): g for g in self.param_groups for q in g["params"]}
        if id(p) not in index:
            raise KeyError("parameter not in optimizer")
        return index[id(p)]

    def per_sample_affine(self, params):
        """w_i = (g_i − m̂_{t−1}) / b_{t−1} as (o, s) = (−m̂_{t−1}, 1/b_{t−1}) for ghost clipping (the same
        map as :meth:`to_clip_space`; before the first step o = None, s = 1/b_0)."""
        out = {}
        for p in params:
            inv_c1, bound = self._center_and_bound(p)
            if bound is None:
                out[p] = (None, 1.0 / self.initial_bound)
            else:
                out[p] = (None if inv_c1 is None else torch.mul(self.state[p]["exp_avg"], -inv_c1), bound.reciprocal())
        return out

    def to_clip_space(self, params, grad_samples):
        out = []
        for p, gs in zip(params, grad_samples):
            inv_c1, bound = self._center_and_bound(p)
            if bound is None:
                out.append(gs / self.initial_bound)
            elif inv_c1 is None:
                out.append(gs / bound.unsqueeze(0))
            else:
                out.append((gs - (self.state[p]["exp_avg"] * inv_c1).unsqueeze(0)) / bound.unsqueeze(0))
        return out

    def from_clip_space(self, params):
        for p in params:
            if p.grad is None:
                continue
            inv_c1, bound = self._center_and_bound(p)
            if bound is None:
                p.grad.mul_(self.initial_bound)
            else:
                p.grad.mul_(bound)  # g̃ = b ⊙ w̃ + m̂
                if inv_c1 is not None:
                    p.grad.add_(self.state[p]["exp_avg"], alpha=inv_c1)

    def _init_state(self, p, state, transforms):
        super()._init_state(p, state, transforms)
        state["s"] = torch.zeros_like(p)  # s_t = s_scale · state["s"] (see after_step)
        state["s_scale"] = 1.0
        state["bound"] = torch.full_like(p, self.initial_bound)

    @torch.no_grad()
    def after_step(self):
        """Refresh s_t and b_t from g̃_t (``p.grad``) and m_t, jointly over all coordinates.

        Two scalings keep the passes over the tensors few (≈ 8, ``benchmarks/RESULTS.md`` §2):

        * s_t is stored as ρ_t · S_t (``state["s_scale"]`` = ρ_t, ``state["s"]`` = S_t) with ρ_t = β1 ρ_{t−1},
          so s_t = β1 s_{t−1} + (1−β1)u² is the single pass S_t = S_{t−1} + ((1−β1)/ρ_t) u²; S is
          rescaled to ρ = 1 when ρ would drop below 1e-6 (one extra pass every ~130 steps at β1 = 0.9);
        * κ_t and ρ_t are folded into scalars: with y = clamp(S_t − (κ_t/ρ_t) b_{t−1}²σ²/B², κ_t h1/ρ_t,
          κ_t h2/ρ_t) = κ_t ŝ_t / ρ_t, b_t = ŝ^{1/4} (Σ_j ŝ_j^{1/2})^{1/2} = y^{1/4} (ρ_t/κ_t)^{1/4} ·
          (Σ_tensors (ρ_t/κ_t)^{1/2} Σ_j y_j^{1/2})^{1/2}.

        Per parameter tensor: u = g̃_t − m̂_t (one new buffer), S_t, then y written into u's buffer,
        clamped, ^{1/2}, summed, ^{1/4}; the buffer becomes b_t after one scaling pass by the global factor.

        The global sum is numerically sensitive (ŝ cancels, and b feeds back into the next ŝ): a
        float32 ``torch._foreach_norm(·, 1)`` per tensor (used at first) left ~1.6e-3 of the coordinates
        of a last-block-sized set more than 0.1% (up to 30×) away from a float64 run after 8 steps. Each
        tensor's ``sum()`` is a pairwise (cascade) reduction, accumulated in at least float32, and the
        per-tensor sums are added in float64: median error ~5e-8, a handful of coordinates (where ŝ
        nearly cancels) up to ~2% (``tests/test_optimizers.py::test_dp_macadam_float32_bound_tracks_float64``)."""
        var = self.noise_std_of_mean() ** 2  # (σ/B)² in clip space (this step's, under banded correlated noise)
        refreshed, partial = [], []
        for g in self.param_groups:
            b1 = g["betas"][0]
            for p in g["params"]:
                st = self.state.get(p)
                if p.grad is None or not st or "s" not in st:
                    continue
                t = st["step"]
                rho = st.get("s_scale", 1.0)
                if b1 * rho < 1e-6:  # renormalise S before ρ gets small (S grows as 1/ρ)
                    st["s"].mul_(rho)
                    rho = 1.0
                rho *= b1
                st["s_scale"] = rho
                u = torch.add(p.grad, st["exp_avg"], alpha=-1.0 / (1.0 - b1**t))  # g̃_t − m̂_t
                st["s"].addcmul_(u, u, value=(1.0 - b1) / rho)  # s_t/ρ_t = s_{t−1}/ρ_{t−1} + (1−β1)u²/ρ_t
                if t < 2:  # κ_1 = 0: keep b_1 = b_0
                    continue
                k = 2.0 * (b1 - b1**t) / (1.0 + b1) / rho  # κ_t/ρ_t
                y = torch.addcmul(st["s"], st["bound"], st["bound"], value=-k * var, out=u)  # κ ŝ/ρ, unclamped
                y.clamp_(k * g["h1"], k * g["h2"]).sqrt_()  # y^{1/2}
                partial.append(y.sum(dtype=torch.float32 if y.element_size() < 4 else None).double() / math.sqrt(k))
                refreshed.append((st, y.sqrt_(), k))  # y^{1/4}
        if not refreshed:
            return
        total = torch.stack(partial).sum().sqrt()  # (Σ_j ŝ_j^{1/2})^{1/2}: a tensor, no device sync
        for st, y_quarter, k in refreshed:
            st["bound"] = y_quarter.mul_((total / k**0.25).to(y_quarter.dtype))
