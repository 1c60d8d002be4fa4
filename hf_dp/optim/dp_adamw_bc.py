from .base import Variant
from .dp_adambc import _BiasCorrected
from .dp_adamw import ADAM_CORR
from .registry import register


@register("dp_adamw_bc", source="seed 000, Algorithm 2", summary="DP-AdamW-BC: bias-corrected DP-AdamW")
class DPAdamWBC(_BiasCorrected):
    r"""DP-AdamW-BC (seed 000, Algorithm 2):

    moments as in DP-AdamW;  θ_t = θ_{t−1} − η_t ( m̂_t/√max(v̂_t − (σC/B)², γ) + λθ_{t−1} ).

    γ = ``gamma`` (default 1e-8, the paper's QNLI value). σ, C, B come from the privatizer
    (B = expected logical batch; with banded correlated noise (σC/B)² is the step's (σC·s/B)²·V_n). ``eps`` is unused. ``last_clamp_rate`` records the fraction of
    coordinates where v̂_t − Φ < γ (the §F.3 diagnostic).

    ``variant="adam_corr"`` (``--optim_args variant=adam_corr``): the authors' public code (``adam_corr.py``) instead
    of the paper — γ = 1e-10 (unless ``gamma`` is given), ``eps`` (``--adam_epsilon``) added outside the clamped
    root, and the decay applied to the already-updated parameters:
    θ_t = (1 − η_tλ)(θ_{t−1} − η_t m̂_t/(√max(v̂_t − Φ, γ) + ε)).
    """

    variants = (
        Variant("paper", "seed 000, Algorithm 2", denominator="bias_corrected", decay="decoupled", gamma=1e-8),
        Variant(ADAM_CORR, "adam_corr.py, the public code of seed 000's authors", denominator="bias_corrected",
                decay="of_updated", eps_outside_clamp=True, gamma=1e-10),
    )
