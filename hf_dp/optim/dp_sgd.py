from .base import DPUpdateRule, check_nonnegative
from .registry import register
from .transforms import CoupledWeightDecay, HeavyBall


@register("dp_sgd", source="Abadi et al. 2016; seed 003 §3", summary="DP-SGD, optional heavy-ball momentum")
class DPSGD(DPUpdateRule):
    r"""DP-SGD (Abadi et al. 2016) on the privatized gradient g̃_t, with ``torch.optim.SGD`` semantics.

    g̃_t = (1/B)(Σ_i clip_C(g_i) + N(0, σ²C²I)) comes from the privatizer. Then
    u_t = g̃_t + λθ_{t−1};  b_1 = u_1, b_t = μ b_{t−1} + u_t (heavy ball, μ = ``momentum``, default 0);
    θ_t = θ_{t−1} − η_t b_t.
    With μ = 0 the decay term gives θ_t = (1 − ηλ)θ_{t−1} − ηg̃_t: "weight decay after noising",
    the variant seed 002 shows converging to R/λ rather than the optimum (see ``dp_sgd_l2``).
    """

    def __init__(self, params, lr=1e-2, momentum=0.0, weight_decay=0.0):
        check_nonnegative("momentum", momentum)
        if momentum >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    def check_group(self, group):
        super().check_group(group)
        mu = check_nonnegative("momentum", group.get("momentum", 0.0))
        if mu >= 1:
            raise ValueError(f"momentum must be in [0, 1), got {mu}")

    def chain(self, group):
        return (CoupledWeightDecay(), HeavyBall())
