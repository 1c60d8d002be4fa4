from .base import Variant, check_positive
from .dp_adam import _AdamFamily
from .registry import register


class _BiasCorrected(_AdamFamily):
    """Adds the γ' floor and records the clamp rate of the last step (seed 000 §F.3). ``gamma=None``: the
    group's variant's γ (:attr:`Variant.gamma <hf_dp.optim.base.Variant>`)."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, gamma=None, fused=None,
                 variant="paper"):
        if gamma is not None:
            check_positive("gamma", gamma)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, gamma=gamma, fused=fused,
                         variant=variant)
        self._clamped = None
        self._numel = 0

    def check_group(self, group):
        super().check_group(group)  # fills a gamma left None with the variant's
        check_positive("gamma", group["gamma"])

    def after_group_step(self, ctx):
        if "clamped" in ctx.extras:
            c = ctx.extras["clamped"]
            self._clamped = c if self._clamped is None else self._clamped + c
            self._numel += ctx.extras["numel"]

    def after_step(self):
        if self._numel:
            self.last_clamp_rate = float(self._clamped) / self._numel
        self._clamped, self._numel = None, 0

    #: fraction of coordinates clamped to γ' at the last step where it was measured
    last_clamp_rate: float | None = None
    #: measure the clamp rate every this many steps (0: never); DPTrainer sets it to --logging_steps
    clamp_rate_every: int = 1


@register("dp_adambc", source="seed 003 Alg. 1; seed 004", summary="DP-AdamBC: m̂/√max(v̂−Φ, γ'), Φ=(σC/B)²")
class DPAdamBC(_BiasCorrected):
    r"""DP-AdamBC (seed 003, Algorithm 1 and eq. 4).

    m_t, v_t, m̂_t, v̂_t as in Adam on g̃_t;  Φ = (σC/B)² (the privatizer's noise variance per coordinate of
    g̃_t: with banded correlated noise, (σC·s/B)²·V_n of the step, hf_dp.privacy.banded);
    θ_t = θ_{t−1} − η m̂_t / √max(v̂_t − Φ, γ').

    σ, C and B are read from the privatizer that generated the noise (B is the expected *logical*
    batch, also under micro-batch accumulation). γ' = ``gamma`` (default 1e-8; seed 004 uses
    γ' ≈ 3e-9…3e-10 for text; pass ``--bc_gamma``). ``eps`` is unused (γ' replaces Adam's γ, as in
    the paper). Optional coupled L2 ``weight_decay`` (default 0, not in the paper) is added to g̃
    before the moments, as in ``dp_adam``. ``last_clamp_rate`` is the fraction of coordinates
    with v̂_t − Φ < γ' at the last step.
    """

    variants = (Variant("paper", "seed 003 Alg. 1 / eq. 4", denominator="bias_corrected", decay="coupled", gamma=1e-8),)
