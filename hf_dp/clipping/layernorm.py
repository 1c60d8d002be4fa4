"""Ghost clipping of ``nn.LayerNorm``: the default recording (input, output gradient) per call; the layer's own
forward runs with its parameters detached (:func:`~hf_dp.clipping.registry.without_parameter_gradients`), so
autograd computes no weight gradient that would be discarded (and FSDP2 has none to reduce-scatter).

Per example, the weight's gradient is Σ_t g_t ⊙ x̂_t (x̂ the normalised input, recomputed from the recorded
input) and the bias's Σ_t g_t: both are vectors of the layer's width, so they are formed per example; their squared
norms are upper bounds of the exact ones (:func:`~hf_dp.clipping.common.summed_sq`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import affine_of, cat_records, sum_gamma, summed_sq, unit_roundoff
from .registry import GhostLayerType, register_layer, without_parameter_gradients


@register_layer(nn.LayerNorm)
class LayerNormType(GhostLayerType):
    name = "layernorm"

    def instrument(self, layer):
        return super().instrument(layer) + [without_parameter_gradients(layer.module, layer)]

    def terms(self, layer, scale, affine, dt, work):
        m = layer.module
        x, g = cat_records(layer.records, scale, dt)
        xhat = F.layer_norm(x.to(dt), m.normalized_shape, eps=m.eps)
        sq = torch.zeros(g.shape[0], device=g.device, dtype=torch.float64)
        gw = gb = None
        sum_g = sum_gamma(g.shape[0] * g.shape[1] if work.total is None else work.total, unit_roundoff(dt))  # the clipped sum's rounding (its public token bound)
        if m.weight is not None and m.weight.requires_grad:
            gw = (g * xhat).sum(1)
            sq = sq + summed_sq(gw, xhat, g, *affine_of(affine, m.weight, dtype=dt), sum_g=sum_g, own=work.own)
        if m.bias is not None and m.bias.requires_grad:
            gb = g.sum(1)
            sq = sq + summed_sq(gb, None, g, *affine_of(affine, m.bias, dtype=dt), sum_g=sum_g, own=work.own)

        def clipped(c, gw=gw, gb=gb):
            c = c.to(dt)
            out = {}
            if gw is not None:
                out[m.weight] = (gw * c.view(-1, 1)).sum(0).to(m.weight.dtype)
            if gb is not None:
                out[m.bias] = (gb * c.view(-1, 1)).sum(0).to(m.bias.dtype)
            return out

        return sq, clipped
