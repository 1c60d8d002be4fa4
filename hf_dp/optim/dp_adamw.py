from .dp_adam import _AdamFamily
from .registry import register
from .transforms import AdamDenominator, AdamMoments, DecayOfUpdatedParams, DecoupledWeightDecay


@register("dp_adamw", source="seed 000, Algorithm 1", summary="DP-AdamW, decoupled weight decay")
class DPAdamW(_AdamFamily):
    r"""DP-AdamW (seed 000, Algorithm 1), exactly as written there:

    m_t = β1 m_{t−1} + (1−β1)g̃_t;  v_t = β2 v_{t−1} + (1−β2)g̃_t²;  m̂_t = m_t/(1−β1^t);  v̂_t = v_t/(1−β2^t);
    θ_t = θ_{t−1} − η_t ( m̂_t/√(v̂_t + ε0) + λθ_{t−1} ).

    Choices where the paper is open: ε0 (= ``eps``) is *inside* the square root, as in the
    paper's line 10 (``torch.optim.AdamW`` puts it outside; the two coincide for ε0 = 0); the decay
    uses θ_{t−1} and is multiplied by η_t (so it follows the LR schedule; torch AdamW does the same).
    Runs torch's fused AdamW kernel with ε moved into v (see ``_AdamFamily``; ``fused=False``: the chain).

    ``authors_code=True`` (``--optim_args authors_code=true``): the update of the authors' public code instead of
    the paper's — ε0 *outside* the root and the decay applied to the already-updated parameters:
    θ_t = (1 − η_tλ)(θ_{t−1} − η_t m̂_t/(√v̂_t + ε0)) (:class:`~hf_dp.optim.transforms.DecayOfUpdatedParams`;
    always the transform chain).
    """

    denominator = "eps_inside"
    decay = DecoupledWeightDecay

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=None, authors_code=False):
        if authors_code not in (True, False):
            raise ValueError(f"authors_code must be true or false, got {authors_code!r}")
        if authors_code and fused:
            raise ValueError("authors_code=true has no fused kernel (its decay acts on the updated parameters): drop fused=true")
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, fused=fused, authors_code=bool(authors_code))

    def chain(self, group):
        if group.get("authors_code"):
            return (AdamMoments(), AdamDenominator("eps_outside"), DecayOfUpdatedParams())
        return super().chain(group)

    def fused_group_step(self, ctx):
        if ctx.group.get("authors_code"):
            return False
        return super().fused_group_step(ctx)
