"""Ghost clipping of ``nn.Embedding`` (incl. broadcast position ids, see
:func:`hf_dp.clipping.hooks.install_batch_hooks`).

A custom function (:class:`_GhostEmbedding`) records the token ids and the output gradient and builds no dense,
table-sized weight gradient. Per example the gradient's rows are sums of g over equal token ids, so
‖G_i‖² = Σ_{t,s} [id_t = id_s] g_t·g_s (an upper bound of it: the Gram products' float32 rounding and underflow
are added, as for linear layers), and the clipped sum is one ``index_add_`` of the c-weighted rows.
``max_norm``, ``scale_grad_by_freq`` and ``sparse`` are refused.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .common import affine_of, as_3d, diag_norms, gamma, gram64, sum_gamma, unit_roundoff
from .registry import GhostLayerType, patch_forward, recording, register_layer


class _GhostEmbedding(torch.autograd.Function):
    """y = weight[ids]; backward records (ids, dL/dy) and returns no weight gradient (the dense table-sized
    gradient autograd would build is never used: the clipped sum is built from the records)."""

    @staticmethod
    def forward(ctx, ids, weight, padding_idx, record):
        ctx.record = record
        ctx.save_for_backward(ids)
        return F.embedding(ids, weight, padding_idx)

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        ctx.record.append((ids, grad_out))
        return None, None, None, None


@register_layer(nn.Embedding)
class EmbeddingType(GhostLayerType):
    name = "embedding"

    def check(self, module, name):
        if module.max_norm is not None or module.scale_grad_by_freq or module.sparse:
            raise ValueError(f"ghost clipping does not support the embedding options of {name}")

    def instrument(self, layer) -> list:
        m = layer.module

        prev = m.__dict__.get("forward")  # another clipper's patch, reached while this one is paused

        def forward(ids, _m=m, _rec=layer.records, _layer=layer, _prev=prev):
            if not recording(_m, _layer):
                return _prev(ids) if _prev is not None else type(_m).forward(_m, ids)
            return _GhostEmbedding.apply(ids, _m.weight, _m.padding_idx, _rec)

        return [patch_forward(m, forward)]

    def terms(self, layer, scale, affine, dt, work):
        # per-example gradient rows are sums of g over equal token ids
        m = layer.module
        ids = torch.cat([r[0].reshape(r[0].shape[0], -1) for r in layer.records], dim=1)
        g = torch.cat([as_3d(r[1].to(dt) / scale) for r in layer.records], dim=1)
        if m.padding_idx is not None:
            g = g * (ids != m.padding_idx).unsqueeze(-1)
        same = ids.unsqueeze(2) == ids.unsqueeze(1)
        o, sc = affine_of(affine, m.weight, dtype=dt)
        s2 = 1.0
        if isinstance(sc, float):
            s2, sc = sc * sc, None
        gs = g if sc is None else g * sc[ids]  # row id_t of the per-example gradient, scaled
        # Σ_{t,s} [id_t = id_s] g_t·g_s from float32 Gram products summed in float64, plus their worst-case rounding
        # (relative to ‖g_t‖‖g_s‖, see hf_dp.clipping.common.gram_bound) and the clipped sum's over B·T tokens
        G, rg, eg = gram64(gs)
        ng = diag_norms(G, rg, eg)
        samef = same.to(torch.float64)
        sg = ng.sum(1)
        T = g.shape[1] if work.own is None else work.own  # the public bound of the example's tokens (Workspace)
        slack = (rg * (torch.bmm(samef, ng.unsqueeze(2)).squeeze(2) * ng).sum(1) + eg * T * T
                 + 4 * gamma(T * T + 2, 2.0**-53) * (1 + rg) * sg * sg)  # the float64 sum of the T² entries
        sq = ((G * samef).sum((1, 2)) + slack * (1 + 2.0**-40)).clamp_min(0).sqrt() * (1 + 2.0**-50)
        total = g.shape[0] * g.shape[1] if work.total is None else work.total  # the clipped sum's public token bound
        sq = (sq + sum_gamma(total, unit_roundoff(dt)) * sg).pow(2) * (1 + 2.0**-40)
        if o is not None:  # 2⟨G_i, o ⊙ s²⟩ + ‖o ⊙ s‖² (o covers every row of the table)
            os2 = o if sc is None else o * sc.pow(2)
            sq = sq + 2 * (g * os2[ids]).sum((1, 2)) + (o if sc is None else o * sc).pow(2).sum()
        sq = s2 * sq

        def clipped(c, ids=ids, g=g):
            c = c.to(dt)
            w = torch.zeros(m.weight.shape, device=g.device, dtype=dt)
            w.index_add_(0, ids.reshape(-1), (g * c.view(-1, 1, 1)).reshape(-1, g.shape[-1]))
            return {m.weight: w.to(m.weight.dtype)}

        return sq, clipped
