"""What the layer files of ghost clipping share: record shapes, the per-sample affine map, dense norms, the
Gram cache and the materialisation budget of one collection (:class:`Workspace`), and the regrouping of records by
privacy unit (:class:`UnitIndex`)."""

from __future__ import annotations

import torch

__all__ = ["as_3d", "cat_records", "affine_of", "dense_sq", "Workspace", "UnitIndex", "unit_index"]


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


def unit_index(units, rows: int) -> "UnitIndex | None":
    """The :class:`UnitIndex` of ``units`` for a micro-batch of ``rows`` rows; ``None`` when there is nothing to
    regroup (``units`` is ``None`` or every row is its own unit in row order). ``ValueError`` for malformed units."""
    if units is None:
        return None
    idx = UnitIndex(units, rows)
    return None if idx.identity else idx


class UnitIndex:
    """Which rows of a micro-batch form one privacy unit, and the regrouping that makes each unit one example.

    ``units``: integer tensor [rows] with values 0..U−1, every value present (row r belongs to unit ``units[r]``).
    :meth:`regroup` maps a batch-first tensor [rows, *tokens, d] to [U, K·tokens, d] (K = the most rows of any unit):
    unit u's rows side by side along the token axis, in row order, the slots of a unit with fewer rows zero-filled.
    A unit's gradient is the sum of its rows' gradients, and every per-layer gradient is a sum over token positions
    of terms that vanish for a zero input or a zero output gradient, so each layer's per-example ``terms`` applied
    to the regrouped records give the per-unit norms and sums unchanged."""

    def __init__(self, units, rows: int):
        if not torch.is_tensor(units) or units.dim() != 1 or units.dtype.is_floating_point or units.dtype == torch.bool:
            raise ValueError(f"units must be a 1-D integer tensor (one unit index per row), got {units!r}")
        if units.numel() != rows:
            raise ValueError(f"units has {units.numel()} entries for a micro-batch of {rows} rows")
        units = units.long()
        self.rows = int(rows)
        if rows == 0:
            self.units, self.num_units, self.max_rows, self.identity = units, 0, 0, True
            self.dest = units
            return
        if int(units.min()) < 0:
            raise ValueError("units must be in 0..U-1 (a negative unit index was given)")
        counts = torch.bincount(units)
        if not bool((counts > 0).all()):
            raise ValueError("units must number the units 0..U-1 with every value present")
        self.units = units
        self.num_units = int(counts.numel())
        self.max_rows = int(counts.max())
        self.identity = self.num_units == self.rows and bool(torch.equal(units, torch.arange(rows, device=units.device)))
        order = torch.argsort(units, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(units)
        slot[order] = torch.arange(rows, device=units.device) - starts[units[order]]
        self.dest = units * self.max_rows + slot  # row r goes to slot dest[r] of the [U·K] grid

    def to(self, device) -> "UnitIndex":
        if self.dest.device != torch.device(device):
            self.units, self.dest = self.units.to(device), self.dest.to(device)
        return self

    def regroup(self, t: torch.Tensor) -> torch.Tensor:
        """[rows, *tokens, d] -> [U, K·prod(tokens), d] for a floating tensor (d its feature axis; [rows, d] ->
        [U, K, d]); [rows, *tokens] -> [U, K·prod(tokens)] for an index tensor (no feature axis) or a 1-D one. A
        tensor whose batch dimension is 1 (broadcast over the micro-batch) is expanded first."""
        B, U, K = self.rows, self.num_units, self.max_rows
        if t.shape[0] == 1 and B > 1:
            t = t.expand(B, *t.shape[1:])
        if t.dim() == 0 or t.shape[0] != B:
            raise ValueError(f"a record of shape {tuple(t.shape)} has no batch dimension of {B} rows to group by unit")
        if t.dim() == 1 or not t.is_floating_point():
            flat = t.reshape(B, -1)
        else:
            flat = t.reshape(B, -1, t.shape[-1])
        out = flat.new_zeros((U * K, *flat.shape[1:]))
        out.index_copy_(0, self.dest.to(t.device), flat)
        return out.view(U, -1) if flat.dim() == 2 else out.view(U, -1, flat.shape[-1])

    def rows_of(self, per_unit: torch.Tensor) -> torch.Tensor:
        """[U] -> [rows]: each row gets its unit's value."""
        return per_unit.index_select(0, self.units.to(per_unit.device))
