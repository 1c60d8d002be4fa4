from .base import DPUpdateRule, check_betas, check_nonnegative
from .registry import register
from .transforms import AdamDenominator, AdamMoments, CoupledWeightDecay


class _AdamFamily(DPUpdateRule):
    """Shared constructor of the Adam-type rules (lr, betas, eps, weight_decay [, gamma])."""

    decay: type | None = None
    denominator = "eps_outside"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, **extra):
        betas = check_betas(betas)
        check_nonnegative("eps", eps)
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **extra))

    def check_group(self, group):
        super().check_group(group)
        check_betas(group["betas"])
        check_nonnegative("eps", group["eps"])

    def chain(self, group):
        pieces = [AdamMoments(), AdamDenominator(self.denominator)]
        if self.decay is CoupledWeightDecay:
            pieces.insert(0, CoupledWeightDecay())
        elif self.decay is not None:
            pieces.append(self.decay())
        return tuple(pieces)


@register("dp_adam", source="seed 003 §3", summary="Adam on the privatized gradient, coupled (L2) weight decay")
class DPAdam(_AdamFamily):
    r"""DP-Adam (seed 003 §3): Adam applied to the privatized gradient, ``torch.optim.Adam`` semantics.

    u_t = g̃_t + λθ_{t−1} (coupled L2 decay, λ = ``weight_decay``, default 0);
    m_t = β1 m_{t−1} + (1−β1)u_t;  v_t = β2 v_{t−1} + (1−β2)u_t²;
    m̂_t = m_t/(1−β1^t);  v̂_t = v_t/(1−β2^t);  θ_t = θ_{t−1} − η m̂_t/(√v̂_t + γ)   (γ = ``eps``).
    """

    decay = CoupledWeightDecay
