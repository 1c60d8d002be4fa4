import torch
from torch.optim.adam import adam as _torch_adam

from .base import DPUpdateRule, Variant, check_betas, check_nonnegative
from .registry import register
from .transforms import AdamDenominator, AdamMoments, CoupledWeightDecay, DecayOfUpdatedParams, DecoupledWeightDecay

_DECAY = {"coupled": CoupledWeightDecay, "decoupled": DecoupledWeightDecay, "of_updated": DecayOfUpdatedParams}

# where torch's fused Adam/AdamW kernels are used (other devices/dtypes run the transform chain)
_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
# ε inside the root is moved into v (see _AdamFamily): only where v keeps that shift's rounding small
_SHIFT_DTYPES = (torch.float32, torch.float64)


class _AdamFamily(DPUpdateRule):
    """Shared constructor of the Adam-type rules (lr, betas, eps, weight_decay, variant [, gamma]); the update is
    the group's :class:`~hf_dp.optim.base.Variant` (``variants``, the default first): Adam's moments, its
    denominator, its weight decay.

    ``fused``: a rule whose chain is torch's Adam/AdamW update (ε outside the square root, no, coupled
    or decoupled weight decay: DP-Adam, DP-MacAdam's Adam half) runs it as torch's fused kernel
    (``torch.optim.Adam(fused=True)``'s): one pass over the tensors instead of ≈ 10
    (``benchmarks/RESULTS.md`` §2). With ε *inside* the root (DP-AdamW, seed 000: m̂/√(v̂ + ε)) the same
    kernel runs with ε = 0 on v_t + ε(1−β2^t), since √((v_t + ε(1−β2^t))/(1−β2^t)) = √(v̂_t + ε): the
    kernel computes β2 v + (1−β2)g̃², so v_{t−1} is first raised by ε(1−β2^t)/β2, and ε(1−β2^t) is
    subtracted afterwards (the state holds plain v_t, whichever path ran). ``None`` (default): fused
    where the parameters are on CPU/CUDA in a floating dtype (for ε inside: β2 > 0 and float32/float64,
    since bf16/fp16 state would carry the shift's rounding), the chain elsewhere; ``False``: always the chain; ``True``: fused or an error. Both compute the same update
    and state up to float rounding (``tests/test_optimizers.py``). For ε inside, the rounding of v_t
    next to the shift (≈ 6e-8 · ε per step in float32) is carried by the state, where the chain adds ε
    afresh each step: against a float64 run, 2,000 float32 steps with gradients down to 1e-7 left
    parameters within 3.6e-6 (chain: 7.4e-7) — far below the DP noise, but not bit-for-bit the chain.
    """

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=None, variant="paper",
                 **extra):
        betas = check_betas(betas)
        check_nonnegative("eps", eps)
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        self.fused = fused
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, variant=variant, **extra))
        if fused:  # refuse now, not at the first step
            bad = [p for g in self.param_groups for p in g["params"] if not self._fusable_tensor(p)]
            if bad:
                raise ValueError(f"fused=True needs floating-point parameters on CPU or CUDA; got {bad[0].dtype} on {bad[0].device}")
            inside = [g for g in self.param_groups if self.variant_of(g).denominator == "eps_inside"]
            if any(g["eps"] != 0 for g in inside):
                if any(g["betas"][1] == 0 for g in inside):
                    raise ValueError("fused=True with eps inside the square root needs betas[1] > 0 (eps is moved into v by 1/beta2)")
                low = [p for g in inside for p in g["params"] if p.dtype not in _SHIFT_DTYPES]
                if low:
                    raise ValueError(f"fused=True with eps inside the square root needs float32/float64 parameters (v would carry "
                                     f"the rounding of the eps shift), got {low[0].dtype}")

    @staticmethod
    def _fusable_tensor(p) -> bool:
        return p.device.type in _FUSED_DEVICES and p.dtype in _FUSED_DTYPES

    @classmethod
    def fusable(cls) -> bool:
        """True if the default variant's update is torch's Adam/AdamW kernel (:meth:`Variant.fusable`)."""
        return cls.variants[0].fusable()

    def check_group(self, group):
        super().check_group(group)
        check_betas(group["betas"])
        check_nonnegative("eps", group["eps"])
        variant = self.variant_of(group)
        if self.fused and not variant.fusable():
            raise ValueError(f"{self.registry_name} (variant {variant.name}) has no fused kernel: its update is not "
                             "torch's Adam/AdamW; drop fused=true")

    def chain(self, group):
        v = self.variant_of(group)
        pieces = [AdamMoments(), AdamDenominator(v.denominator, eps_outside=v.eps_outside_clamp)]
        if v.decay == "coupled":
            pieces.insert(0, CoupledWeightDecay())
        else:
            pieces.append(_DECAY[v.decay]())
        return tuple(pieces)

    def fused_group_step(self, ctx):
        variant = self.variant_of(ctx.group)
        if self.fused is False or not variant.fusable():
            return False
        params = ctx.params
        b1, b2 = ctx.group["betas"]
        eps = float(ctx.group["eps"])
        inside = variant.denominator == "eps_inside" and eps != 0.0  # (ε = 0: both forms agree)
        if not all(self._fusable_tensor(p) and p.grad.dtype == p.dtype and p.grad.layout == torch.strided for p in params) or (
            inside and (b2 == 0.0 or any(p.dtype not in _SHIFT_DTYPES for p in params))
        ):
            if self.fused:
                raise RuntimeError(
                    "fused=True needs dense floating-point parameters and gradients on CPU or CUDA "
                    "(and, for eps inside the root, betas[1] > 0 and float32/float64 parameters)"
                )
            return False
        # torch's functional Adam increments its step tensors before use: hand it t − 1 (our ints are the truth)
        steps = [None] * len(params)
        for dev in {p.device for p in params}:
            idx = [i for i, p in enumerate(params) if p.device == dev]
            counts = torch.tensor([float(ctx.states[i]["step"] - 1) for i in idx], dtype=torch.float32, device=dev)
            for i, c in zip(idx, counts.unbind()):
                steps[i] = c
        v = [st["exp_avg_sq"] for st in ctx.states]
        if inside:  # v_{t−1} + ε(1−β2^t)/β2, so that the kernel's v is v_t + ε(1−β2^t)
            shift = [eps * (1.0 - b2 ** st["step"]) for st in ctx.states]
            torch._foreach_add_(v, [d / b2 for d in shift])
        _torch_adam(
            params,
            [p.grad for p in params],
            [st["exp_avg"] for st in ctx.states],
            v,
            [],
            steps,
            fused=True,
            decoupled_weight_decay=variant.decay == "decoupled",
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=float(ctx.group["lr"]),
            weight_decay=float(ctx.group.get("weight_decay", 0.0)),
            eps=0.0 if inside else eps,
            maximize=False,
        )
        if inside:
            torch._foreach_sub_(v, shift)  # plain v_t again
        return True


@register("dp_adam", source="seed 003 §3", summary="Adam on the privatized gradient, coupled (L2) weight decay")
class DPAdam(_AdamFamily):
    r"""DP-Adam (seed 003 §3): Adam applied to the privatized gradient, ``torch.optim.Adam`` semantics.

    u_t = g̃_t + λθ_{t−1} (coupled L2 decay, λ = ``weight_decay``, default 0);
    m_t = β1 m_{t−1} + (1−β1)u_t;  v_t = β2 v_{t−1} + (1−β2)u_t²;
    m̂_t = m_t/(1−β1^t);  v̂_t = v_t/(1−β2^t);  θ_t = θ_{t−1} − η m̂_t/(√v̂_t + γ)   (γ = ``eps``).
    """

    variants = (Variant("paper", "seed 003 §3", denominator="eps_outside", decay="coupled"),)
