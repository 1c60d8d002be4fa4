from .dp_adambc import _BiasCorrected
from .registry import register
from .transforms import DecoupledWeightDecay


@register("dp_adamw_bc", source="seed 000, Algorithm 2", summary="DP-AdamW-BC: bias-corrected DP-AdamW")
class DPAdamWBC(_BiasCorrected):
    r"""DP-AdamW-BC (seed 000, Algorithm 2):

    moments as in DP-AdamW;  θ_t = θ_{t−1} − η_t ( m̂_t/√max(v̂_t − (σC/B)², γ) + λθ_{t−1} ).

    γ = ``gamma`` (default 1e-8, the paper's QNLI value). σ, C, B come from the privatizer
    (B = expected logical batch). ``eps`` is unused. ``last_clamp_rate`` records the fraction of
    coordinates where v̂_t − Φ < γ (the §F.3 diagnostic).
    """

    decay = DecoupledWeightDecay
