from .base import Variant
from .dp_adam import _AdamFamily
from .registry import register

#: the update of the public PyTorch code of seed 000's authors (issue 17 §12), named after its file ``adam_corr.py``
ADAM_CORR = "adam_corr"


@register("dp_adamw", source="seed 000, Algorithm 1", summary="DP-AdamW, decoupled weight decay")
class DPAdamW(_AdamFamily):
    r"""DP-AdamW (seed 000, Algorithm 1), exactly as written there:

    m_t = β1 m_{t−1} + (1−β1)g̃_t;  v_t = β2 v_{t−1} + (1−β2)g̃_t²;  m̂_t = m_t/(1−β1^t);  v̂_t = v_t/(1−β2^t);
    θ_t = θ_{t−1} − η_t ( m̂_t/√(v̂_t + ε0) + λθ_{t−1} ).

    Choices where the paper is open: ε0 (= ``eps``) is *inside* the square root, as in the
    paper's line 10 (``torch.optim.AdamW`` puts it outside; the two coincide for ε0 = 0); the decay
    uses θ_{t−1} and is multiplied by η_t (so it follows the LR schedule; torch AdamW does the same).
    Runs torch's fused AdamW kernel with ε moved into v (see ``_AdamFamily``; ``fused=False``: the chain).

    ``variant="adam_corr"`` (``--optim_args variant=adam_corr``): the update of the authors' public code instead of
    the paper's — ε0 *outside* the root and the decay applied to the already-updated parameters:
    θ_t = (1 − η_tλ)(θ_{t−1} − η_t m̂_t/(√v̂_t + ε0)) (:class:`~hf_dp.optim.transforms.DecayOfUpdatedParams`;
    always the transform chain).
    """

    variants = (
        Variant("paper", "seed 000, Algorithm 1", denominator="eps_inside", decay="decoupled"),
        Variant(ADAM_CORR, "the public code of seed 000's authors", denominator="eps_outside", decay="of_updated"),
    )
