"""Ghost clipping of RMSNorm layers (Llama-family models): y = w ⊙ x̂, x̂ = x / √(mean_j x_j² + ε), weight only.

Per example the weight's gradient is Σ_t g_t ⊙ x̂_t (x̂ recomputed from the recorded input in the working precision,
float32 or float64), a vector of the layer's width, formed per example as for ``nn.LayerNorm``. Gemma's variant
y = (1 + w) ⊙ x̂ has the same gradient and is handled by the same entry.

**Which classes.** ``torch.nn.RMSNorm`` is registered by class (one normalised axis, ``weight`` trainable; ε = None
means ``torch.finfo(x.dtype).eps``, as torch does). transformers defines one RMSNorm class per model family
(``LlamaRMSNorm``, ``MistralRMSNorm``, ``Qwen2RMSNorm``, ``GemmaRMSNorm``, …, more than 200 classes without a common
base), so these are matched by a predicate (:func:`hf_dp.clipping.registry.register_matcher`), consulted only when no
class of the module's MRO is registered: the class name ends with ``RMSNorm``, the module's only parameter is a 1-D
``weight``, its ε is its ``variance_epsilon`` or ``eps`` attribute (a number) and its ``forward`` takes exactly one
argument (so gated variants, ``forward(x, gate)``, are not matched). The name is only a guess, so
:meth:`RMSNormType.check` verifies the computation before ghost clipping is accepted: it runs the module on a probe
input (random weight, rows with and without a large mean, one row whose mean square is ε itself, under
``torch.no_grad``) and requires the output to equal w ⊙ x̂ or (1 + w) ⊙ x̂ (relative tolerance 1e-4, 2e-2 for a bf16 or
fp16 module); otherwise it refuses in one sentence and ``--clipping auto`` takes the Opacus hooks. (One pass clips
exactly the vector it computes, so a wrong formula could only cost accuracy; two passes sum autograd's gradients
with these norms, hence the check.) A class whose forward differs between the probe and training is not detected.

Under ``--clipping hooks`` Opacus has no grad sampler for these classes and computes their per-sample gradients
with its generic functorch fallback (a per-example ``vmap`` of the module's own forward), exact for any of them
(``tests/test_clm_layers.py``); ``torch.nn.RMSNorm`` has Opacus' own sampler.
"""

from __future__ import annotations

import inspect

import torch
from torch import nn

from .common import affine_of, cat_records, sum_gamma, summed_sq, unit_roundoff
from .registry import GhostLayerType, recording, register_layer, register_matcher, without_parameter_gradients

__all__ = ["RMSNormType", "HFRMSNormType", "is_hf_rmsnorm", "rmsnorm_eps"]


def rmsnorm_eps(module: nn.Module):
    """The ε of an RMSNorm module (``variance_epsilon`` or ``eps``), ``None`` if it has none (torch's default)."""
    for attr in ("variance_epsilon", "eps"):
        v = getattr(module, attr, None)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return float(v)
    return None


def is_hf_rmsnorm(module: nn.Module) -> bool:
    """The predicate of transformers' per-family RMSNorm classes (see the module docstring)."""
    if not type(module).__name__.endswith("RMSNorm") or isinstance(module, nn.RMSNorm):
        return False
    params = dict(module.named_parameters())
    if set(params) != {"weight"} or params["weight"].dim() != 1 or rmsnorm_eps(module) is None:
        return False
    try:
        sig = inspect.signature(module.forward)
    except (TypeError, ValueError):  # pragma: no cover - builtins
        return False
    return len(sig.parameters) == 1 and all(
        p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in sig.parameters.values())


def _normalised(x: torch.Tensor, eps: float | None, dt: torch.dtype) -> torch.Tensor:
    e = torch.finfo(x.dtype).eps if eps is None else eps
    x = x.to(dt)
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + e)


class RMSNormType(GhostLayerType):
    """``torch.nn.RMSNorm`` (one normalised axis): records (input, output gradient) per call."""

    name = "rmsnorm"

    def check(self, module, name):
        if len(getattr(module, "normalized_shape", (0,))) != 1:
            raise ValueError(f"ghost clipping supports RMSNorm over one axis only ({name} normalises {tuple(module.normalized_shape)})")

    def instrument(self, layer) -> list:
        """The default recording, also when the input is passed by keyword; the forward computes no weight gradient
        (:func:`~hf_dp.clipping.registry.without_parameter_gradients`: the records give it)."""

        def fwd_hook(module, args, kwargs, out, _rec=layer.records):
            if not recording(module, layer) or not torch.is_tensor(out) or not out.requires_grad:
                return
            x = args[0] if args else next(v for v in kwargs.values() if torch.is_tensor(v))
            x = x.detach()
            out.register_hook(lambda g, _x=x: _rec.append((_x, g)))

        return [layer.module.register_forward_hook(fwd_hook, with_kwargs=True), without_parameter_gradients(layer.module, layer)]

    def terms(self, layer, scale, affine, dt, work):
        m = layer.module
        x, g = cat_records(layer.records, scale, dt)
        xhat = _normalised(x, rmsnorm_eps(m), dt)
        gw = (g * xhat).sum(1)  # Σ_t g_t ⊙ x̂_t
        sum_g = sum_gamma(g.shape[0] * g.shape[1] if work.total is None else work.total, unit_roundoff(dt))  # the clipped sum's rounding (its public token bound)
        sq = summed_sq(gw, xhat, g, *affine_of(affine, m.weight, dtype=dt), sum_g=sum_g, own=work.own)  # an upper bound

        def clipped(c, gw=gw):
            return {m.weight: (gw * c.to(dt).view(-1, 1)).sum(0).to(m.weight.dtype)}

        return sq, clipped


register_layer(nn.RMSNorm)(RMSNormType)


@register_matcher(is_hf_rmsnorm)
class HFRMSNormType(RMSNormType):
    """transformers' per-family ``*RMSNorm`` (matched by :func:`is_hf_rmsnorm`, verified by :meth:`check`)."""

    name = "rmsnorm"

    def check(self, module, name):
        if self.variant(module) is None:
            raise ValueError(
                f"ghost clipping does not support trainable layer {name} ({type(module).__name__}): it is named like an "
                "RMSNorm but does not compute w * x/sqrt(mean(x^2) + eps) nor (1 + w) * x/sqrt(mean(x^2) + eps); "
                "use --clipping hooks (Opacus per-sample gradients)"
            )

    @staticmethod
    def variant(module: nn.Module) -> str | None:
        """``"weight"`` (y = w ⊙ x̂), ``"one_plus_weight"`` (y = (1 + w) ⊙ x̂) or ``None``: the probe of the module
        docstring."""
        w, eps = module.weight, rmsnorm_eps(module)
        d = w.shape[0]
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(4, 3, d, generator=gen, dtype=torch.float64)
        x[1] += 3.0  # a large mean: a LayerNorm (mean subtracted) differs
        x[2] *= (eps / x[2].pow(2).mean(-1, keepdim=True)).sqrt()  # mean square = ε: a missing or different ε differs
        probe_w = 1.0 + 0.5 * torch.randn(d, generator=gen, dtype=torch.float64)
        x_in, w_in = x.to(device=w.device, dtype=w.dtype), probe_w.to(device=w.device, dtype=w.dtype)
        try:
            with torch.no_grad():
                y = torch.func.functional_call(module, {"weight": w_in}, (x_in,))
        except Exception:
            return None
        if not torch.is_tensor(y) or y.shape != x.shape:
            return None
        y = y.double().cpu()
        xi, wi = x_in.double().cpu(), w_in.double().cpu()
        xhat = xi * torch.rsqrt(xi.pow(2).mean(-1, keepdim=True) + eps)
        rtol = 2e-2 if w.dtype in (torch.bfloat16, torch.float16) else 1e-4
        for variant, ref in (("weight", wi * xhat), ("one_plus_weight", (1.0 + wi) * xhat)):
            if bool(torch.isfinite(y).all()) and bool(((y - ref).abs() <= rtol * ref.abs() + rtol * 1e-2).all()):
                return variant
        return None
