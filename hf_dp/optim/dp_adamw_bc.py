from .dp_adambc import _BiasCorrected
from .registry import register
from .transforms import AdamDenominator, AdamMoments, DecayOfUpdatedParams, DecoupledWeightDecay

#: what the public code of seed 000's authors hard-codes (the paper: γ' = 1e-8, nothing outside the root)
AUTHORS_GAMMA, AUTHORS_OUTER_EPS = 1e-10, 1e-8


@register("dp_adamw_bc", source="seed 000, Algorithm 2", summary="DP-AdamW-BC: bias-corrected DP-AdamW")
class DPAdamWBC(_BiasCorrected):
    r"""DP-AdamW-BC (seed 000, Algorithm 2):

    moments as in DP-AdamW;  θ_t = θ_{t−1} − η_t ( m̂_t/√max(v̂_t − (σC/B)², γ) + λθ_{t−1} ).

    γ = ``gamma`` (default 1e-8, the paper's QNLI value). σ, C, B come from the privatizer
    (B = expected logical batch). ``eps`` is unused. ``last_clamp_rate`` records the fraction of
    coordinates where v̂_t − Φ < γ (the §F.3 diagnostic).

    ``authors_code=True`` (``--optim_args authors_code=true``): the authors' public code instead of the paper —
    γ = 1e-10 (unless ``gamma`` is given), 1e-8 added outside the clamped root, and the decay applied to the
    already-updated parameters: θ_t = (1 − η_tλ)(θ_{t−1} − η_t m̂_t/(√max(v̂_t − Φ, γ) + 1e-8)).
    """

    decay = DecoupledWeightDecay

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, gamma=None, fused=None, authors_code=False):
        if authors_code not in (True, False):
            raise ValueError(f"authors_code must be true or false, got {authors_code!r}")
        self.authors_code = bool(authors_code)
        if authors_code and gamma is None:
            gamma = AUTHORS_GAMMA
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, gamma=gamma, fused=fused)

    def chain(self, group):
        if self.authors_code:
            return (AdamMoments(), AdamDenominator("bias_corrected", outer_eps=AUTHORS_OUTER_EPS), DecayOfUpdatedParams())
        return super().chain(group)
