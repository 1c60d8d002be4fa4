import torch
from torch.optim.adam import adam as _torch_adam

from .base import DPUpdateRule, check_betas, check_nonnegative
from .registry import register
from .transforms import AdamDenominator, AdamMoments, CoupledWeightDecay, DecoupledWeightDecay

# where torch's fused Adam/AdamW kernels are used (other devices/dtypes run the transform chain)
_FUSED_DEVICES = ("cpu", "cuda")
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class _AdamFamily(DPUpdateRule):
    """Shared constructor of the Adam-type rules (lr, betas, eps, weight_decay [, gamma]).

    ``fused``: a rule whose chain is exactly torch's Adam/AdamW update (ε outside the square root,
    no, coupled or decoupled weight decay: DP-Adam, DP-MacAdam's Adam half) can run it as torch's
    fused kernel (``torch.optim.Adam(fused=True)``'s), one pass over the tensors instead of ≈ 10
    (``benchmarks/RESULTS.md`` §2). ``None`` (default): fused where the parameters are on CPU/CUDA in
    a floating dtype, the chain elsewhere; ``False``: always the chain; ``True``: fused or an error.
    Both compute the same update up to float rounding (``tests/test_optimizers.py``).
    """

    decay: type | None = None
    denominator = "eps_outside"

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, fused=None, **extra):
        betas = check_betas(betas)
        check_nonnegative("eps", eps)
        if fused not in (None, True, False):
            raise ValueError(f"fused must be None, True or False, got {fused!r}")
        if fused and not self.fusable():
            raise ValueError(f"{type(self).__name__} has no fused kernel: its update is not torch's Adam/AdamW")
        self.fused = fused
        super().__init__(params, dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **extra))

    @classmethod
    def fusable(cls) -> bool:
        """True if the chain is exactly torch's Adam (coupled or no decay) or AdamW (decoupled) update."""
        return cls.denominator == "eps_outside" and cls.decay in (None, CoupledWeightDecay, DecoupledWeightDecay)

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

    def fused_group_step(self, ctx):
        if self.fused is False or not self.fusable():
            return False
        params = ctx.params
        if not all(
            p.device.type in _FUSED_DEVICES and p.dtype in _FUSED_DTYPES and p.grad.dtype == p.dtype and p.grad.layout == torch.strided
            for p in params
        ):
            if self.fused:
                raise RuntimeError("fused=True needs dense floating-point parameters and gradients on CPU or CUDA")
            return False
        # torch's functional Adam increments its step tensors before use: hand it t − 1 (our ints are the truth)
        steps = [None] * len(params)
        for dev in {p.device for p in params}:
            idx = [i for i, p in enumerate(params) if p.device == dev]
            counts = torch.tensor([float(ctx.states[i]["step"] - 1) for i in idx], dtype=torch.float32, device=dev)
            for i, c in zip(idx, counts.unbind()):
                steps[i] = c
        b1, b2 = ctx.group["betas"]
        _torch_adam(
            params,
            [p.grad for p in params],
            [st["exp_avg"] for st in ctx.states],
            [st["exp_avg_sq"] for st in ctx.states],
            [],
            steps,
            fused=True,
            decoupled_weight_decay=self.decay is DecoupledWeightDecay,
            amsgrad=False,
            beta1=b1,
            beta2=b2,
            lr=float(ctx.group["lr"]),
            weight_decay=float(ctx.group.get("weight_decay", 0.0)) if self.decay is not None else 0.0,
            eps=float(ctx.group["eps"]),
            maximize=False,
        )
        return True


@register("dp_adam", source="seed 003 §3", summary="Adam on the privatized gradient, coupled (L2) weight decay")
class DPAdam(_AdamFamily):
    r"""DP-Adam (seed 003 §3): Adam applied to the privatized gradient, ``torch.optim.Adam`` semantics.

    u_t = g̃_t + λθ_{t−1} (coupled L2 decay, λ = ``weight_decay``, default 0);
    m_t = β1 m_{t−1} + (1−β1)u_t;  v_t = β2 v_{t−1} + (1−β2)u_t²;
    m̂_t = m_t/(1−β1^t);  v̂_t = v_t/(1−β2^t);  θ_t = θ_{t−1} − η m̂_t/(√v̂_t + γ)   (γ = ``eps``).
    """

    decay = CoupledWeightDecay
