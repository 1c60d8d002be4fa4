import torch

from .dp_sgd import DPSGD
from .registry import register
from .transforms import HeavyBall


@register(
    "dp_sgd_l2",
    source="seed 002 (Differential Privacy Meets Weight Decay)",
    summary="DP-SGD with the L2 term added to every per-sample gradient before clipping",
)
class DPSGDL2(DPSGD):
    r"""DP-SGD with weight decay *inside* the clipped per-sample gradient (seed 002, "Our Method").

    Per example: g_i = ∇_θ[ℓ(θ, x_i) + (λ/2)‖θ‖²] = ∇ℓ_i + λθ_{t−1};  ḡ_i = g_i·min(1, C/‖g_i‖);
    g̃_t = (1/B)(Σ_i ḡ_i + N(0, σ²C²I));  θ_t = θ_{t−1} − η_t g̃_t (optionally heavy-ball momentum).
    No decay is applied after noising.

    Sensitivity: θ_{t−1} is public (the current model), and each example's contribution ḡ_i is
    clipped *after* adding λθ, so ‖ḡ_i‖ ≤ C and the L2 sensitivity of the sum is C, exactly as in
    DP-SGD: same accountant, same guarantee.

    Choice (paper ambiguity): the paper averages over the realised batch |I_t|; like every hf_dp
    optimizer we divide by the *expected* batch B (Opacus semantics under Poisson sampling). λ is
    the param group's ``weight_decay`` (HF's no-decay groups — biases, LayerNorm — get λ = 0).
    """

    def chain(self, group):
        return (HeavyBall(),)

    def per_sample_affine(self, params):
        """(o, s) = (λθ_{t−1}, None): ghost clipping adds o inside each per-example norm and (Σ_i c_i)·o
        to the clipped sum."""
        wd = {id(p): float(g.get("weight_decay", 0.0)) for g in self.param_groups for p in g["params"]}
        return {p: (p.detach() * wd[id(p)], None) for p in params if wd.get(id(p), 0.0) != 0.0}

    def to_clip_space(self, params, grad_samples):
        wd = {id(p): float(g.get("weight_decay", 0.0)) for g in self.param_groups for p in g["params"]}
        out = []
        for p, gs in zip(params, grad_samples):
            lam = wd.get(id(p), 0.0)
            out.append(gs if lam == 0.0 else torch.add(gs, p.detach().to(gs.dtype).unsqueeze(0), alpha=lam))
        return out
