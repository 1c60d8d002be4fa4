"""Ghost clipping of ``nn.Linear`` and transformers' ``Conv1D`` (GPT-2's transposed linear).

One backward pass records, per call, the layer's input activations ``a`` and output gradients ``g``
(:class:`_GhostLinear`, which does *not* compute the weight gradient during backward: it only propagates
input gradients); then

* per-example squared norms come from ``a`` and ``g`` directly ("ghost norms"): for a linear layer
  ‖Σ_t g_tᵀa_t‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s), computed as ⟨a aᵀ, g gᵀ⟩ when the sequence is short
  (T ≤ 2·d_in·d_out/(d_in+d_out), :data:`GRAM_FACTOR`) and by materialising per-example gradients in chunks
  otherwise — either way as float64 upper bounds of the exact norms that allow for the float32 rounding (also of
  the clipped sum) and underflow (:func:`~hf_dp.clipping.common.gram_bound`, :func:`_materialised_bound`; see
  "Norms are upper bounds" in :mod:`hf_dp.clipping.ghost`);
* with the clip factors c_i, the clipped sum of the weight is one matmul (c·g)ᵀa or gᵀ(c·a), c folded into the
  smaller of the two — the same cost as an ordinary weight gradient;
* optionally (``materialize_bytes`` > 0, default 0), for layers applied to a sequence (T > 1), while the
  per-example gradients fit in that many bytes (in total per micro-batch), they are materialised with one
  batched matmul and give both the norms and the clipped sum (Σ_i c_i G_i, a matrix-vector product). That saves
  the B·T²·(d_in+d_out) multiply-adds of the ghost norms in theory, but on CPU the batched matmul was slower than
  ghost norms + one large matmul and needs B·d_in·d_out more floats (benchmarks/RESULTS.md §1), so it is off.

* single-query attention (the first-token-only last block, :mod:`hf_dp.models.first_token`): the key and
  value projections see T positions but feed one query, so per example and head h their output gradient is
  rank one across positions, g_{t,h} = v_{t,h} q̂_hᵀ (q̂_h a unit vector: the query for keys, the head's output
  gradient for values). Then G_h = q̂_h (Σ_t v_{t,h} a_t)ᵀ = q̂_h w_hᵀ, ‖G‖² = Σ_h ‖w_h‖², and the clipped sum is
  Σ_i c_i Σ_h q̂_{i,h} w_{i,h}ᵀ: B·H·T·d_in multiply-adds instead of the Gram products (B·T²·(d_in+d_out)) and
  the weight-gradient matmul (B·T·d_in·d_out). Code that calls these projections says so with
  :func:`hf_dp.models.hints.single_query_heads`; the factorisation is checked (relative residual ≤ 1e-3 per
  example, else the generic path runs), and the contribution that is clipped and summed is exactly the
  factorised Ĝ_i whose norm is used, so a residual could only perturb the gradient, never the bound c_i‖Ĝ_i‖ ≤ C.
  Two passes do not use it (their second backward sums the exact gradients).

Per-sample affine maps (``affine=``, see :meth:`hf_dp.clipping.ghost.GhostClipper.clipped_sum`):
‖(G_i + O) ⊙ S‖² = ‖G_i ⊙ S‖² + 2⟨G_i, O ⊙ S²⟩ + ‖O ⊙ S‖², with ⟨G_i, O⟩ = Σ_t g_t·(O a_t) and, for one
position (T = 1), ‖G_i ⊙ S‖² = (g² S²)·a² as matmuls; per-coordinate S with T > 1 materialises the
per-example gradients (in chunks) for the norms.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from hf_dp.models.hints import single_query_head_size

from .common import TINY32, affine_of, cat_records, dense_sq, gamma, gram64, gram_bound, row_norms64, sum_gamma, summed_sq, unit_roundoff
from .registry import GhostLayerType, patch_forward, recording, register_layer

try:  # GPT-2 style transposed linear
    from transformers.pytorch_utils import Conv1D
except Exception:  # pragma: no cover
    Conv1D = ()

#: ghost norms by Gram products (B·T²·(d_in + d_out) multiply-adds) while T·(d_in + d_out) ≤ GRAM_FACTOR·d_in·d_out,
#: else per-example gradients materialised in chunks (B·T·d_in·d_out): on CPU the Gram products' square batched
#: matmuls ran about 2-3× faster per multiply-add than the materialising ones (an LM head over 30,522 words at T = 128:
#: 91 ms against 175-288 ms for 8 examples), so the Gram side wins up to twice the multiply-adds
GRAM_FACTOR = 2

#: largest relative residual ‖g − v q̂ᵀ‖/‖g‖ (per example) accepted for the single-query factorisation; the
#: check computes ‖g‖² − ‖v‖², which float32 v resolves to ~1e-7·‖g‖² (a genuine single query gives ~1e-7)
SINGLE_QUERY_TOL = 1e-3


class _GhostLinear(torch.autograd.Function):
    """y = x Wᵀ + b (or x W + b for Conv1D); backward returns only dL/dx and records (x, dL/dy)."""

    @staticmethod
    def forward(ctx, x, weight, bias, record, transposed, head_size=None):
        ctx.save_for_backward(x, weight)
        ctx.record = record
        ctx.transposed = transposed
        ctx.head_size = head_size
        if transposed:
            out = torch.addmm(bias, x.reshape(-1, x.shape[-1]), weight) if bias is not None else x.reshape(-1, x.shape[-1]) @ weight
            return out.view(*x.shape[:-1], weight.shape[-1])
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight = ctx.saved_tensors
        ctx.record.append((x, grad_out, ctx.head_size))
        grad_x = None
        if ctx.needs_input_grad[0]:
            w = weight.to(grad_out.dtype)  # under autocast the forward ran on a reduced-precision copy of the weight
            grad_x = (grad_out @ w.t() if ctx.transposed else grad_out @ w).to(x.dtype)
        return grad_x, None, None, None, None, None


def _single_query(a: torch.Tensor, g: torch.Tensor, head_size: int):
    """(q̂ [B, H, hs], w [B, H, d_in]) with g_{t,h} = v_{t,h} q̂_hᵀ and w_h = Σ_t v_{t,h} a_t, or None
    if g is not rank one across positions per example and head.

    q̂_h = the largest row of head h, normalised; v_h = g_h q̂_h. Check: since q̂ is a unit vector,
    ‖g − v q̂ᵀ‖² = ‖g‖² − ‖v‖² (summed in float64 from float32 row sums); rejected if above
    SINGLE_QUERY_TOL² · ‖g‖² for any example. Two layouts, neither copied nor squared into a
    temporary of g's size: the keys' gradient comes with positions innermost ([B, H, hs, T] in
    memory), the values' with positions outermost ([B, T, H, hs])."""
    B, T, d_out = g.shape
    if d_out % head_size:
        return None
    H = d_out // head_size

    def unit(x):
        return x / torch.linalg.vector_norm(x, dim=-1, keepdim=True).clamp_min(torch.finfo(x.dtype).tiny)  # 0 stays 0

    if g.transpose(1, 2).is_contiguous():  # keys
        m = g.transpose(1, 2).view(B * H, head_size, T)
        row_sq = torch.zeros(B * H, T, dtype=g.dtype, device=g.device)
        for j in range(head_size):  # Σ_j m_j² without a [B, d_out, T] temporary
            row_sq.addcmul_(m[:, j], m[:, j])
        ref = torch.gather(m, 2, row_sq.argmax(1)[:, None, None].expand(B * H, head_size, 1)).squeeze(2)
        q = unit(ref)  # [B·H, hs]
        v = torch.bmm(q.unsqueeze(1), m).view(B, H, T)
        q = q.view(B, H, head_size)
    else:  # values (and anything else)
        gh = g.contiguous().view(B, T, H, head_size)
        row_sq = torch.linalg.vector_norm(gh, dim=-1).pow_(2)  # [B, T, H]
        q = unit(torch.gather(gh, 1, row_sq.argmax(1)[:, None, :, None].expand(B, 1, H, head_size)).squeeze(1))
        qd = (q.unsqueeze(-1) * torch.eye(H, dtype=g.dtype, device=g.device).unsqueeze(1)).reshape(B, d_out, H)
        v = torch.bmm(gh.view(B, T, d_out), qd).transpose(1, 2).contiguous()  # [B, H, T]; block-diagonal q: one read of g
    g_sq = row_sq.double().view(B, -1).sum(1)
    # a non-finite ‖g‖² (NaN, or a float32 overflow: q̂ would be 0) goes to the generic path, which flags it
    if not bool(torch.isfinite(g_sq).all()) or bool((g_sq - v.double().pow(2).sum((1, 2)) > SINGLE_QUERY_TOL**2 * g_sq).any()):
        return None
    return q, torch.bmm(v, a)


def _materialised_bound(a: torch.Tensor, g: torch.Tensor, sum_g, G: torch.Tensor | None = None, own=None) -> torch.Tensor:
    """An upper bound [B] (float64) of ‖Σ_t g_t a_tᵀ‖² (exact, of the given records) from the per-example gradients
    materialised in float32 (``G``, or formed here): the batched matmul sums T products per entry, so
    ‖fl(G_i) − G_i‖ ≤ γ_T·S_i + 2T·2^-149·√(d_in·d_out), S_i = Σ_t ‖a_t‖‖g_t‖; ``sum_g``·S_i is added for the
    clipped sum's rounding (:func:`~hf_dp.clipping.common.sum_gamma`); T is ``own`` when given (the public bound of an
    example's tokens, :class:`~hf_dp.clipping.common.Workspace`)."""
    B, T, d_in = a.shape
    if own is not None:
        T = own
    d_out = g.shape[-1]
    u = unit_roundoff(a.dtype)
    tiny = 2.0**-1074 if a.dtype == torch.float64 else TINY32
    norm = dense_sq(torch.bmm(g.transpose(1, 2), a).flatten(1) if G is None else G, None, None).sqrt() * (1 + 2.0**-50)
    S = (row_norms64(a) * row_norms64(g)).sum(1)
    bound = norm + (gamma(T, u) + sum_g) * S + 2 * T * tiny * (d_in * d_out) ** 0.5
    return bound * bound * (1 + 2.0**-40)


def _sum_g(work, tokens: int, dt):
    """γ_{N+2} of the clipped sum's rounding, N the public bound of its tokens (``work.total``, a number or one per
    unit); ``tokens`` (the records' own count) only for a workspace without bounds (a caller outside a clipper)."""
    return sum_gamma(tokens if work.total is None else work.total, unit_roundoff(dt))


def _rows(v, i: int, chunk: int):
    """Rows i..i+chunk of a per-example bound (a [B] tensor), or the bound itself (a number or ``None``)."""
    return v[i : i + chunk] if torch.is_tensor(v) else v


@register_layer(nn.Linear)
class LinearType(GhostLayerType):
    """y = x Wᵀ + b. Records (x, dL/dy, single-query head size or None) per call."""

    name = "linear"
    transposed = False  # Conv1D: y = x W + b, its weight is [d_in, d_out]

    def instrument(self, layer) -> list:
        m = layer.module

        prev = m.__dict__.get("forward")  # another clipper's patch, reached while this one is paused

        def forward(x, _m=m, _rec=layer.records, _tr=self.transposed, _layer=layer, _prev=prev):
            if not recording(_m, _layer):
                return _prev(x) if _prev is not None else type(_m).forward(_m, x)
            return _GhostLinear.apply(x, _m.weight, _m.bias, _rec, _tr, single_query_head_size())

        return [patch_forward(m, forward)]

    def terms(self, layer, scale, affine, dt, work):
        m = layer.module
        transposed = self.transposed
        a, g = cat_records(layer.records, scale, dt)
        a = a.to(dt)
        B, T, d_in = a.shape
        d_out = g.shape[-1]
        sq = torch.zeros(B, device=g.device, dtype=torch.float64)  # norms in float64 (see hf_dp.clipping.common)
        per_example = factored = None
        if m.weight.requires_grad:
            o, sc = affine_of(affine, m.weight, transpose=transposed, dtype=dt)  # as [d_out, d_in]
            s2 = 1.0
            if isinstance(sc, float):  # a scalar scale: ‖(G + o)s‖² = s²‖G + o‖²
                s2, sc = sc * sc, None
            wsq = None
            head_size = layer.records[0][2] if len(layer.records) == 1 else None
            if head_size and T > 1 and o is None and sc is None:  # single-query attention (checked)
                factored = _single_query(a, g, head_size)
            if factored is not None:
                # ‖Ĝ_i‖² = Σ_h ‖q̂_{i,h}‖²‖w_{i,h}‖², ‖q̂‖² ≤ 1 + γ_{hs+2} (a float32 unit vector); Ĝ_i is what is summed
                wsq = factored[1].double().pow(2).sum((1, 2)) * (1 + gamma(head_size + 2, unit_roundoff(dt)))
            elif T > 1 and 4 * B * d_in * d_out <= work.budget:
                # materialise: one batched matmul (the cost of the ordinary weight gradient) gives both
                # the norms and, later, the clipped sum as a cheap weighted sum over examples
                work.budget -= 4 * B * d_in * d_out
                per_example = torch.bmm(g.transpose(1, 2), a).view(B, -1)  # [B, d_out * d_in]
                if o is None and sc is None:  # an upper bound of the exact ‖G_i‖² (also what is summed: fl(G_i))
                    wsq = _materialised_bound(a, g, _sum_g(work, B * T, dt), per_example, work.own)
                else:
                    wsq = dense_sq(per_example, o, sc)
            elif sc is not None and T == 1:  # rank one: Σ_jk g_j² a_k² s_jk² (+ cross terms) as matmuls
                g1, a1 = g[:, 0], a[:, 0]
                wsq = ((g1.pow(2) @ sc.pow(2)) * a1.pow(2)).sum(1)
                if o is not None:
                    wsq = wsq + 2 * ((g1 @ (o * sc.pow(2))) * a1).sum(1) + (o * sc).pow(2).sum()
            elif sc is not None:  # per-coordinate scale, T > 1: materialise in chunks for the norms only
                chunk = max(1, int(2**26 // (d_in * d_out)))
                wsq = torch.cat([dense_sq(torch.bmm(g[i : i + chunk].transpose(1, 2), a[i : i + chunk]).flatten(1), o, sc) for i in range(0, B, chunk)])
            else:
                sum_g = _sum_g(work, B * T, dt)  # the clipped sum below runs over the micro-batch's tokens
                if T * (d_in + d_out) <= GRAM_FACTOR * d_in * d_out:  # an upper bound of the exact ‖G_i‖²
                    wsq = gram_bound(*work.gram(a), *gram64(g), sum_g, work.own)
                else:
                    chunk = max(1, int(2**26 // (d_in * d_out)))
                    wsq = torch.cat([_materialised_bound(a[i : i + chunk], g[i : i + chunk], _rows(sum_g, i, chunk),
                                                         own=_rows(work.own, i, chunk)) for i in range(0, B, chunk)])
                if o is not None:  # ‖G + o‖² = ‖G‖² + 2⟨G, o⟩ + ‖o‖², ⟨G_i, o⟩ = Σ_t g_t·(o a_t)
                    wsq = wsq + 2 * (torch.matmul(a, o.t()) * g).sum((1, 2)) + o.pow(2).sum()
            sq = sq + s2 * wsq
        gsum = None
        if m.bias is not None and m.bias.requires_grad:
            gsum = g.sum(1)
            sq = sq + summed_sq(gsum, None, g, *affine_of(affine, m.bias, dtype=dt), sum_g=_sum_g(work, B * T, dt), own=work.own)

        def clipped(c, a=a, g=g, gsum=gsum, per_example=per_example, factored=factored):
            c = c.to(dt)
            out = {}
            if factored is not None:  # Σ_i c_i Σ_h q̂_{i,h} w_{i,h}ᵀ, heads stacked along d_out
                qhat, w = factored
                w = torch.einsum("bhd,bhi->hdi", qhat * c.view(-1, 1, 1), w).reshape(d_out, d_in)
                out[m.weight] = (w.t() if transposed else w).to(m.weight.dtype)
            elif per_example is not None:
                w = torch.mv(per_example.t(), c).view(d_out, d_in)
                out[m.weight] = (w.t() if transposed else w).to(m.weight.dtype)
            elif m.weight.requires_grad:  # c folded into the smaller of a and g (an LM head's g is [B, T, vocab])
                if d_in < d_out:
                    w = g.reshape(-1, d_out).t() @ (a * c.view(-1, 1, 1)).reshape(-1, d_in)  # [d_out, d_in]
                else:
                    w = (g * c.view(-1, 1, 1)).reshape(-1, d_out).t() @ a.reshape(-1, d_in)
                out[m.weight] = (w.t() if transposed else w).to(m.weight.dtype)
            if gsum is not None:
                out[m.bias] = (gsum * c.view(-1, 1)).sum(0).to(m.bias.dtype)
            return out

        return sq, clipped


@register_layer(Conv1D)
class Conv1DType(LinearType):
    """transformers' ``Conv1D`` (GPT-2): a linear layer whose weight is stored transposed, [d_in, d_out]."""

    name = "conv1d"
    transposed = True
