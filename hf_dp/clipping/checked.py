"""Ghost clipping's per-layer terms, safe for any records: what each layer type's ``terms`` gives, with the examples
whose terms come out non-finite recomputed from their own records (:func:`checked_terms`).

**Non-finite and overflowing examples.** Whatever an example's loss (NaN, ±inf, or finite but huge, e.g. a
regression label of 1e19), its contribution c_i v_i to the clipped sum is finite with norm ≤ C, and the other
examples keep theirs bit for bit:

* an example whose squared norm ‖v_i‖² is not finite in the working precision — NaN or inf records, or
  ‖v_i‖ ≥ 2^64 ≈ 1.8e19 in float32 — gets c_i = 0 (:func:`~hf_dp.clipping.ghost.clip_factors`) and contributes exactly 0, never
  0·inf = NaN: its rows are zeroed before the sum (one pass), its output gradients are zeroed by the layer
  hooks during the second backward (two passes, where the backward of c_i ℓ_i = 0·NaN would otherwise carry
  NaN from the loss into every weight gradient; this needs the forward's activations to be finite, which they
  are whatever the labels);
* a ghost norm whose float32 products overflow although the gradient itself is representable (output
  gradients ~1e20 on small activations: g_t·g_s overflows, ‖Σ_t g_t a_tᵀ‖ does not) is recomputed in float64
  for that example and layer only (:func:`checked_terms`), and the example is clipped to C as
  usual — in one pass its clipped sum for that layer is computed in float64 as well.

Only examples with a non-finite layer norm pay for this (one finiteness check of a [B] vector per layer
otherwise). Nothing is logged: not which examples, not how many.
"""

from __future__ import annotations

import torch

from .common import Workspace
from .registry import Layer

__all__ = ["work_dtype", "capped", "layer_terms", "with_records", "exact_terms", "checked_terms"]


def work_dtype(*dtypes) -> torch.dtype:
    """The precision of norms and clipped sums: float64 if any operand (input, output gradient, parameter) is
    float64, else float32 — also under bf16 autocast, whose records are bf16 (never the default dtype)."""
    return torch.float64 if torch.float64 in dtypes else torch.float32


def capped(sq: torch.Tensor, dt: torch.dtype) -> torch.Tensor:
    """The squared norms (kept in float64, upper bounds) as inf where they exceed ``dt``'s range: an example whose
    ‖v_i‖² overflows the working precision gets c_i = 0, as when the norms were computed in it."""
    if dt == torch.float64 or sq.dtype != torch.float64:
        return sq
    return sq.masked_fill(sq > torch.finfo(dt).max, float("inf"))


def layer_terms(layer: Layer, scale: float, affine: dict | None, work: Workspace):
    """(per-example ‖v_i‖² over this layer's parameters [B], function c -> {param: Σ_i c_i ∇ℓ_i}) with
    v_i = (∇ℓ_i + o) ⊙ s per parameter, (o, s) = ``affine.get(param)`` (default: v_i = ∇ℓ_i): the layer
    type's :meth:`~hf_dp.clipping.registry.GhostLayerType.terms`, in the working precision."""
    affine = affine or {}
    m = layer.module
    if not layer.records:
        raise ValueError(f"layer {type(m).__name__} recorded no backward pass; is every trainable layer used in the forward?")
    dt = work_dtype(*(t.dtype for r in layer.records for t in r[:2]), *(p.dtype for p in layer.params()))
    return layer.type.terms(layer, scale, affine, dt, work)

def with_records(layer: Layer, fn, dtype: torch.dtype | None = None) -> Layer:
    """A stand-in for ``layer`` whose records are ``fn(t)`` for every tensor t of its records (floating ones
    then converted to ``dtype``); ``fn`` keeps the batch axis first."""

    def one(t):
        if not torch.is_tensor(t):
            return t
        t = fn(t)
        return t.to(dtype) if dtype is not None and t.is_floating_point() else t

    out = Layer(layer.module, layer.type)
    out.records = [tuple(one(t) for t in r) for r in layer.records]
    return out

def exact_terms(layer: Layer, scale: float, affine: dict | None, work: Workspace, rows=None):
    """:func:`layer_terms` of a stand-in layer (records of a few examples, ``rows`` of the layer's), never
    materialising and with a Gram cache of its own; the token bounds are ``work``'s (those ``rows``')."""

    def pick(v):
        return v.index_select(0, rows.to(v.device)) if rows is not None and torch.is_tensor(v) else v

    exact = Workspace(bounds=work.bounds)
    exact.own, exact.total = pick(work.own), pick(work.total)
    return layer_terms(layer, scale, affine, exact)

def checked_terms(layer: Layer, scale: float, affine: dict | None, work: Workspace, with_sum: bool = True):
    """:func:`layer_terms`, safe for any records: (‖v_i‖² [B], c -> {param: Σ_i c_i v_i}).

    Where the float32 terms come out non-finite (NaN/inf records, or products such as g_t·g_s that overflow
    although ‖v_i‖² does not), those examples' terms are recomputed in float64 from their records alone and
    stored back in the working dtype — still inf if ‖v_i‖² is not representable there, and NaN if the records
    are, so :func:`~hf_dp.clipping.ghost.clip_factors` gives them c_i = 0. The clipped sum then adds the other examples' terms with
    those examples' records zeroed (c_i·inf never enters a sum; the others' results are unchanged) and, for
    the recomputed examples with c_i > 0, their float64 clipped sum. Costs one check of a [B] vector unless
    an example is non-finite."""
    sq, clipped = layer_terms(layer, scale, affine, work)
    bad = ~torch.isfinite(sq)
    if not bool(bad.any()):
        return sq, clipped
    rows = bad.nonzero().squeeze(1)
    exact = with_records(layer, lambda t: t.index_select(0, rows), torch.float64)
    dt = work_dtype(*(t.dtype for r in layer.records for t in r[:2]), *(p.dtype for p in layer.params()))
    sq = sq.index_put((rows,), capped(exact_terms(exact, scale, affine, work, rows)[0].to(sq.dtype), dt))
    if not with_sum:
        return sq, None

    def zero_bad(t):
        return t.masked_fill(bad.view(-1, *([1] * (t.dim() - 1))), 0) if t.is_floating_point() else t

    _, clipped_rest = exact_terms(with_records(layer, zero_bad), scale, affine, work)

    def clipped_all(c, exact=exact, rows=rows):
        out = clipped_rest(c)
        c_rows = c.index_select(0, rows)
        keep = c_rows > 0  # c_i = 0 (non-finite ‖v_i‖²) contributes exactly nothing
        if bool(keep.any()):
            kept = rows
            if not bool(keep.all()):
                exact = with_records(exact, lambda t: t[keep])
                kept = rows[keep]
            for p, v in exact_terms(exact, scale, affine, work, kept)[1](c_rows[keep]).items():
                out[p] = out[p] + v.to(out[p].dtype)
        return out

    return sq, clipped_all
