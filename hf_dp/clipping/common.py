"""What the layer files of ghost clipping share: record shapes, the per-sample affine map, dense norms, the
Gram cache and the materialisation budget of one collection (:class:`Workspace`), and the regrouping of records by
privacy unit (:class:`UnitIndex`)."""

from __future__ import annotations

import torch

__all__ = ["as_3d", "cat_records", "affine_of", "dense_sq", "Workspace", "TokenBounds", "UnitIndex", "unit_index", "gamma",
           "unit_roundoff", "gram64", "gram_bound", "diag_norms", "summed_sq", "sum_gamma", "row_norms64", "TINY32", "GRAM_CHUNK"]

#: float32's smallest positive subnormal: a product or sum that underflows is off by at most half of it
TINY32 = 2.0**-149
#: the Gram products are summed in float32 over chunks of this many features, the chunks in float64
#: (:func:`gram64`): the worst-case rounding of an entry is then γ_512 ≈ 3e-5 of ‖x_t‖‖x_s‖ whatever the width (an
#: LM head's g gᵀ over 30,522 words in chunks of 512 took about 1.35× one float32 batched matmul on CPU, 256: 1.65×)
GRAM_CHUNK = 512


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
    """‖(x_i + o) ⊙ s‖² per row of x [B, n] (o, s flattened to n), squared and summed in float64 (a float32 sum of
    squares loses squares below 2^-149 to underflow: the records carry the loss scale, which may be tiny), in row
    chunks so that no float64 copy of a large x exists."""
    if o is not None:
        x = x + o.reshape(1, -1)
    if sc is not None:
        x = x * (sc if isinstance(sc, float) else sc.reshape(1, -1))
    step = max(1, (1 << 22) // max(1, x.shape[1]))
    return torch.cat([x[i : i + step].double().pow(2).sum(1) for i in range(0, x.shape[0], step)]) if x.shape[0] else x.new_zeros(0, dtype=torch.float64)


def summed_sq(v: torch.Tensor, x: torch.Tensor | None, g: torch.Tensor, o=None, sc=None, sum_g=0.0, own=None) -> torch.Tensor:
    """An upper bound [B] (float64) of ‖(v_i + o) ⊙ s‖² for v_i = Σ_t x_t ⊙ g_t (``x`` None: Σ_t g_t) as computed
    in float32 (``v``, [B, n]): the exact sum of the same products may differ by γ_{T+1}·S_i + 2T·2^-149·√n,
    S_i = Σ_t ‖x_t‖‖g_t‖ (cancellation across tokens), T the example's tokens — ``own``, a public bound of them
    (:class:`Workspace`; ``None``: the records' own length, for callers outside a clipper); ``sum_g``·S_i (a number
    or a [B] tensor, each example's own) is added to the norm for the rounding of the clipped sum across examples
    (:func:`sum_gamma`)."""
    T, n = (g.shape[1] if own is None else own), v.shape[1]
    u = unit_roundoff(v.dtype)
    tiny = 2.0**-1074 if v.dtype == torch.float64 else TINY32
    ng = row_norms64(g)
    S = (ng * row_norms64(x)).sum(1) if x is not None else ng.sum(1)
    err = gamma(T + 1, u) * S + 2 * T * tiny * n**0.5
    if sc is not None:
        err = err * (abs(sc) if isinstance(sc, float) else float(sc.abs().max()))
    norm = dense_sq(v, o, sc).sqrt() * (1 + 2.0**-50) + err + sum_g * S
    return norm * norm * (1 + 2.0**-40)


def unit_roundoff(dtype: torch.dtype) -> float:
    return 2.0**-53 if dtype == torch.float64 else 2.0**-24


def gamma(n, u: float = 2.0**-24):
    """γ_n = n·u/(1 − n·u): the worst-case relative error of a sum of n products in precision u, any order (n a number
    or a tensor). Defined for n·u < 1 only: ``ValueError`` from n·u ≥ 1/2 on (the bound would be meaningless, and past
    1 negative — an allowance that lifted every clip factor above C)."""
    nu = n * u
    if (float(nu.max()) if torch.is_tensor(nu) else nu) >= 0.5:
        raise ValueError(f"a float rounding allowance over {float(n.max()) if torch.is_tensor(n) else n:.0f} terms at unit "
                         f"roundoff {u:g} is not meaningful (n·u >= 1/2): use smaller public token bounds (--dp_max_length)")
    return nu / (1 - nu)


def row_norms64(x: torch.Tensor) -> torch.Tensor:
    """Upper bounds of ‖x_t‖ per row of x [B, T, d], float64, from one read of x (no copy): the float32 norm's
    square is off by at most γ_{d+2} relative (any summation order) plus d·2^-149 for squares that underflow; a sum
    of squares that overflows gives inf (the caller's non-finite check then recomputes in float64)."""
    n = torch.linalg.vector_norm(x, dim=-1).double()
    d, u = x.shape[-1], unit_roundoff(x.dtype)
    tiny = 2.0**-1074 if x.dtype == torch.float64 else TINY32
    return ((n * n * (1 + 8 * u) + 2 * d * tiny) / (1 - gamma(d + 2, u))).sqrt() * (1 + 2.0**-50)


def gram64(x: torch.Tensor):
    """(x xᵀ per example in float64 [B, T, T], rel, abs) with |result_ts − x_t·x_s| ≤ rel·‖x_t‖‖x_s‖ + abs (exact
    x_t·x_s of the given x). Float32 products summed over chunks of :data:`GRAM_CHUNK` features (no copy of x: the
    chunks are views), the chunks added in float64: rel = γ_512 + 2γ^(64)_{n/512}, whatever the summation order of the
    matrix product; abs covers products and sums that underflow (n·2^-149, or its float64 analogue)."""
    n = x.shape[-1]
    if x.dtype == torch.float64 or n <= GRAM_CHUNK:
        u = unit_roundoff(x.dtype)
        tiny = 2.0**-1074 if x.dtype == torch.float64 else TINY32
        return torch.bmm(x, x.transpose(1, 2)).double(), gamma(n, u), 2 * n * tiny
    out = None
    for k in range(0, n, GRAM_CHUNK):
        xc = x[..., k : k + GRAM_CHUNK]
        p = torch.bmm(xc, xc.transpose(1, 2)).double()
        out = p if out is None else out.add_(p)
    m = -(-n // GRAM_CHUNK)
    return out, gamma(GRAM_CHUNK) + 2 * gamma(m + 1, 2.0**-53), 2 * n * TINY32


def diag_norms(gram, rel, eps):
    """Upper bounds of ‖x_t‖ from a :func:`gram64` result: ‖x_t‖² ≤ (gram_tt + abs)/(1 − rel)."""
    return ((torch.diagonal(gram, dim1=1, dim2=2) + eps) / (1 - rel)).clamp_min(0).sqrt() * (1 + 2.0**-50)


def sum_gamma(tokens, u: float = 2.0**-24):
    """γ_{N+2} for a clipped sum Σ_i c_i Σ_t (g_t a_tᵀ or g_t ⊙ x_t) formed in float32 over N = ``tokens`` tokens
    (one matmul, autograd's weight gradient, an ``index_add_``): its rounding is ≤ γ_{N+2} Σ_i c_i S_i, so adding
    γ_{N+2}·S_i to the bound of ‖G_i‖ makes c_i·(‖G_i‖ + the example's share of that rounding) ≤ C. Inside a clipper
    N is never the micro-batch's own count but a public bound of it (:attr:`Workspace.total`), so that each
    example's clip factor depends on that example alone."""
    return gamma(tokens + 2, u)


def gram_bound(A, ra, ea, G, rg, eg, sum_g=0.0, own=None) -> torch.Tensor:
    """An upper bound [B] (float64) of the exact ‖Σ_t g_t a_tᵀ‖² = Σ_{t,s} (a_t·a_s)(g_t·g_s) from A = a aᵀ and
    G = g gᵀ as :func:`gram64` gives them (|ΔA_ts| ≤ ra‖a_t‖‖a_s‖ + ea, |ΔG_ts| ≤ rg‖g_t‖‖g_s‖ + eg), with ``sum_g``·S_i
    added to the norm (:func:`sum_gamma`).

    Σ_{t,s} A_ts G_ts is summed in float64; its error is ≤ (ra + rg + ra·rg)·S² + ea(1 + rg)·(Σ_t‖g_t‖)² +
    eg(1 + ra)·(Σ_t‖a_t‖)² + ea·eg·T², S = Σ_t ‖a_t‖‖g_t‖ — relative to S², not to the result, which is what the
    cancellation of terms of both signs (repeated inputs, alternating gradients) needs — plus the float64 sum of the
    T² products. The norms ‖a_t‖, ‖g_t‖ are bounded from the Grams' diagonals (no further pass over the records). T is
    ``own`` when given (a public bound of the example's tokens, :class:`Workspace`), else the records' length."""
    T = A.shape[1] if own is None else own
    na, ng = diag_norms(A, ra, ea), diag_norms(G, rg, eg)
    S, Sa, Sg = (na * ng).sum(1), na.sum(1), ng.sum(1)
    rel = ra + rg + ra * rg + 4 * gamma(T * T + 2, 2.0**-53)
    slack = rel * S * S + ea * (1 + rg) * Sg * Sg + eg * (1 + ra) * Sa * Sa + ea * eg * T * T
    sq = (A * G).sum((1, 2)) + slack * (1 + 2.0**-40)
    norm = sq.clamp_min(0).sqrt() * (1 + 2.0**-50) + sum_g * S
    return norm * norm * (1 + 2.0**-40)


class TokenBounds:
    """The public token bounds of a run that the rounding allowances of ghost clipping's norms are computed from
    (issue 49): ``max_length``, the most tokens of one row (its own: padding adds exact zeros only), and ``max_tokens``,
    the most tokens that one float32 clipped sum may run over (a micro-batch's rows × its padded length; a micro-batch
    of several privacy units whose rows would exceed it is split by the trainer, a unit alone may exceed it by its own
    rows). Both are public inputs of the plan, never counts of the data: each example's clip factor is then a function
    of that example's records and of these constants only, whatever else shares its micro-batch — before, the
    allowance was γ over the micro-batch's own rows × padded length, and 256 copies of a short row each lost a little
    of their factor when one long row joined them, moving the clipped sum by 2.37 C (issue 49's review)."""

    def __init__(self, max_length: int, max_tokens: int | None = None, micro_batches: int = 1):
        max_length = int(max_length)
        max_tokens = int(max_tokens if max_tokens is not None else DEFAULT_ROWS * max_length)
        if max_length < 1 or max_tokens < max_length or int(micro_batches) < 1:
            raise ValueError(f"token bounds need 1 <= max_length <= max_tokens and micro_batches >= 1, got {max_length}, "
                             f"{max_tokens} and {micro_batches}")
        #: ``micro_batches``: the float32 additions of the micro-batches' clipped sums into one logical batch's
        self.max_length, self.max_tokens, self.micro_batches = max_length, max_tokens, int(micro_batches)
        if self.allowance > MAX_ALLOWANCE:
            raise ValueError(
                f"the rounding allowance of the clipped sum over {max_tokens:,} tokens per micro-batch (max_length "
                f"{max_length:,}) would be {f'{self.allowance:.2%}' if self.allowance < 1 else 'undefined (n·u >= 1/2)'} of "
                f"every clipped norm, more than {MAX_ALLOWANCE:.0%}: set "
                "--dp_max_length to the rows' truncation length (the default is the model's maximum positions), or "
                "lower --per_device_train_batch_size")

    @property
    def allowance(self) -> float:
        """γ of :attr:`sum_terms` (float32): each example's share of its clipped sum's rounding, relative to its S_i."""
        nu = (self.sum_terms + 2) * 2.0**-24
        return nu / (1 - nu) if nu < 0.5 else float("inf")

    def __repr__(self) -> str:
        return f"TokenBounds(max_length={self.max_length}, max_tokens={self.max_tokens}, micro_batches={self.micro_batches})"

    @property
    def sum_terms(self) -> int:
        """The most terms of one parameter's clipped sum over a logical batch, per call of a layer: a micro-batch's
        tokens, then the micro-batches' additions (γ of it is each example's share of that sum's rounding)."""
        return self.max_tokens + self.micro_batches

    @classmethod
    def for_model(cls, model, max_length: int | None = None, rows: int = 0, micro_batches: int = 1) -> "TokenBounds":
        """Bounds from public inputs: ``max_length`` (else the model's maximum positions, else 2048) and a micro-batch
        of ``rows`` rows (else :data:`DEFAULT_ROWS`)."""
        if max_length is None:
            cfg = getattr(model, "config", None)
            for name in ("max_position_embeddings", "n_positions", "max_sequence_length", "seq_length"):
                v = getattr(cfg, name, None)
                if isinstance(v, int) and v > 0:
                    max_length = v
                    break
            else:
                max_length = 2048
        return cls(max_length, int(max_length) * max(int(rows) or DEFAULT_ROWS, 1), micro_batches)


#: the rows of a micro-batch a :class:`TokenBounds` allows for when none are given (a clipper built outside DPTrainer)
DEFAULT_ROWS = 16
#: the largest rounding allowance (γ of the bounds' terms, relative) a :class:`TokenBounds` accepts: 2^20 tokens per
#: micro-batch give 6.7 %; beyond, the allowance costs more than it is worth — and past 2^23 γ is not defined
MAX_ALLOWANCE = 0.07


class Workspace:
    """State shared by the layers of one collection of terms: ``budget``, the bytes of per-example gradients the
    layers may still materialise (``GhostClipper(materialize_bytes=)``), the Gram cache, and the public token bounds
    of the layer in hand (:meth:`bound_layer`): ``own`` — an upper bound of one example's tokens in the layer's
    records, the count in its own rounding terms — and ``total`` — of the tokens of the float32 clipped sum its
    gradient joins, the count in its share of that sum's rounding (:func:`sum_gamma`). Each is a number, or a [B]
    float64 tensor under privacy units (a unit's own rows); never a count of the micro-batch's other rows."""

    def __init__(self, budget: int = 0, bounds: "TokenBounds | None" = None):
        self.budget = int(budget)
        self.grams: dict = {}
        self.bounds = bounds
        self.own = None
        self.total = None

    def bound_layer(self, records: list, idx=None) -> None:
        """Set :attr:`own` and :attr:`total` for a layer's ``records`` (before any regrouping by unit; ``idx`` the
        :class:`UnitIndex` or ``None``), after checking that the records fit the public bounds: every call's rows ×
        padded length ≤ ``max_tokens`` unless the micro-batch is one unit alone (``ValueError`` otherwise: DPTrainer
        splits larger micro-batches, and refuses rows longer than ``max_length``)."""
        if self.bounds is None:
            self.own = self.total = None
            return
        L, N, M = self.bounds.max_length, self.bounds.max_tokens, self.bounds.micro_batches
        calls = max(len(records), 1)
        for r in records:
            g = r[1] if len(r) > 1 and torch.is_tensor(r[1]) else r[0]
            rows = int(g.shape[0]) if g.dim() > 0 else 1
            tokens = int(as_3d(g).shape[1]) if g.dim() > 1 else 1
            # (a padded length above L is allowed: the positions past a row's own tokens have zero output gradients,
            # so their products add exact zeros — the caller checks the rows' own lengths, split_to_bounds)
            if rows * tokens > N and not (idx is not None and idx.num_units == 1):
                raise ValueError(f"a micro-batch of {rows} rows x {tokens} tokens exceeds the run's public max_tokens "
                                 f"{N} (the bound of ghost clipping's rounding allowance); split it")
        if idx is None:
            self.own, self.total = calls * L, calls * N + M
        else:  # a unit of k rows: k·L tokens of its own; alone in its micro-batch it may exceed N by them
            k = idx.counts.to(torch.float64)
            self.own = calls * L * k
            self.total = calls * torch.clamp(L * k, min=N) + M

    def gram(self, a: torch.Tensor):
        """:func:`gram64` of a (a aᵀ per example in float64, rel, abs), computed once per input tensor
        (query/key/value share their input)."""
        key = (a.data_ptr(), tuple(a.shape), a.stride(), a.dtype)
        hit = self.grams.get(key)
        if hit is None:  # the entry holds a itself, so no other tensor can take its address while cached
            hit = self.grams[key] = (a, gram64(a))
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
            self.counts = units.new_zeros(0)
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
        self.counts = counts  # each unit's rows (its own token bound: Workspace.bound_layer)
        self.identity = self.num_units == self.rows and bool(torch.equal(units, torch.arange(rows, device=units.device)))
        order = torch.argsort(units, stable=True)
        starts = torch.cumsum(counts, 0) - counts
        slot = torch.empty_like(units)
        slot[order] = torch.arange(rows, device=units.device) - starts[units[order]]
        self.dest = units * self.max_rows + slot  # row r goes to slot dest[r] of the [U·K] grid

    def to(self, device) -> "UnitIndex":
        if self.dest.device != torch.device(device):
            self.units, self.dest, self.counts = self.units.to(device), self.dest.to(device), self.counts.to(device)
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
