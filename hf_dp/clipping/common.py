"""What the layer files of ghost clipping share: record shapes, the per-sample affine map, dense norms, the
Gram cache and the materialisation budget of one collection (:class:`Workspace`)."""

from __future__ import annotations

import torch

__all__ = ["as_3d", "cat_records", "affine_of", "dense_sq", "Workspace"]


def as_3d(t: torch.Tensor) -> torch.Tensor:
    """[B, ..., d] -> [B, T, d] (T = product of the middle dims, 1 for a 2-D input)."""
    if t.dim() == 2:
        return t.unsqueeze(1)
    return t.reshape(t.shape[0], -1, t.shape[-1])


def cat_records(records, scale, dtype=torch.float32):
    """(inputs [B, T, d_in], output gradients / scale [B, T, d_out] in ``dtype``) of a layer's (input, output
    gradient, …) records; several calls of one layer are concatenated along the token axis."""
    xs = [as_3d(r[0]) if r[0].dim() > 1 else r[0].unsqueeze(-1) for r in records]
    gs = [as_3d(r[1].to(dtype) if scale == 1.0 else r[1].to(dtype) / scale) for r in records]
    if len(records) == 1:
        return xs[0], gs[0]
    return torch.cat(xs, dim=1), torch.cat(gs, dim=1)


def affine_of(affine: dict, p, transpose: bool = False, dtype=torch.float32):
    """(o, s) for parameter p in ``dtype`` (s: None, a float, or a tensor), optionally transposed."""
    o, sc = affine.get(p, (None, None))
    if o is not None:
        o = o.to(dtype).t() if transpose else o.to(dtype)
    if torch.is_tensor(sc):
        sc = sc.to(dtype).t() if transpose else sc.to(dtype)
    return o, sc


def dense_sq(x: torch.Tensor, o, sc) -> torch.Tensor:
    """‖(x_i + o) ⊙ s‖² per row of x [B, n] (o, s flattened to n)."""
    if o is not None:
        x = x + o.reshape(1, -1)
    if sc is not None:
        x = x * (sc if isinstance(sc, float) else sc.reshape(1, -1))
    return x.pow(2).sum(1)


class Workspace:
    """State shared by the layers of one collection of terms: ``budget``, the bytes of per-example gradients the
    layers may still materialise (``GhostClipper(materialize_bytes=)``), and the Gram cache."""

    def __init__(self, budget: int = 0):
        self.budget = int(budget)
        self.grams: dict = {}

    def gram(self, a: torch.Tensor) -> torch.Tensor:
        """a aᵀ per example, computed once per input tensor (query/key/value share their input)."""
        key = (a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)
        hit = self.grams.get(key)
        if hit is None:  # the entry holds a itself, so no other tensor can take its address while cached
            hit = self.grams[key] = (a, torch.bmm(a, a.transpose(1, 2)))
        return hit[1]
