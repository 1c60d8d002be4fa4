"""Correlated noise: the Banded Square Root factorization (``--noise_mechanism banded_sqrt --noise_bands b``).

The mechanism (Kalinin & Lampert, "Banded Square Root Matrix Factorization for Differentially Private Model
Training", NeurIPS 2024), with cyclic Poisson sampling and the amplification analysis of Choquette-Choo et al.,
"(Amplified) Banded Matrix Factorizations: A unified approach to private training" (NeurIPS 2023):

* **The factor.** C is the lower-triangular Toeplitz b-banded matrix whose first column is c_0, …, c_{b−1},
  c_k = binom(2k, k)/4^k (the coefficients of (1 − x)^(−1/2), the square root of the prefix-sum matrix) truncated to b
  bands (:func:`bsr_coefficients`; c_0 = 1). Its largest column norm is s = √(Σ_{k<b} c_k²) (:func:`column_norm`),
  and C~ = C/s has column norms ≤ 1.
* **What the accountant sees**: C~x + σ·Clip·z, x_t the clipped gradient sum of step t (Clip: the clipping norm),
  z i.i.d. N(0, I). **What the training loop sees** is its post-processing C~⁻¹(C~x + σ·Clip·z) = x + σ·Clip·s·w with
  w = C⁻¹z, computed online by w_t = z_t − Σ_{k=1}^{min(b−1, n)} c_k w_{t−k} (n: the step's position in its
  correlation segment). So step t's clipped sum gets σ·Clip·s·w_t instead of DP-SGD's σ·Clip·z_t; z_t is drawn exactly
  as DP-SGD's noise is (:class:`BandedNoise` transforms it), and with b = 1 (s = 1, w = z) the noise is DP-SGD's, bit
  for bit.
* **Segments.** The last b − 1 noise tensors live in memory only (never in a checkpoint, a state dict, a log or a
  release); a privatizer built anew, or loaded from a checkpoint (a resume), starts a new segment whose first noise
  is z itself. A block-diagonal C of banded blocks is still b-banded with column norms ≤ s, so segments change
  nothing in the accounting.
* **Cyclic Poisson sampling** (:mod:`hf_dp.privacy.cyclic`, :class:`hf_dp.privacy.sampler.PoissonBatchSampler`):
  every unit belongs to one of b partitions by a fixed public function of its own identity; at the run's step t only
  the units of partition t mod b are eligible, each drawn with probability p = b·q.
* **Accounting** (:func:`dp_sgd_equivalent`): over T noisy steps every partition has at most ⌈T/b⌉ opportunities, b
  steps apart; the columns of C~ at those steps have disjoint supports and norms ≤ 1, so the mechanism is as private
  as DP-SGD at rate min(1, b·q), noise multiplier σ, for ⌈T/b⌉ rounds (Choquette-Choo et al. 2023, the cyclic
  Poisson theorem). ε(T) is the existing accountant (PRV or RDP) at those numbers, and σ for a target ε is calibrated
  on them (:mod:`hf_dp.privacy.accounting`); with b = 1 they are (q, T), the DP-SGD formulas exactly.
* **The update rules' noise figure** (:func:`marginal_std_factor`): the noise of step n of a segment has
  per-coordinate standard deviation σ·Clip·s·√V_n, V_n = Σ_{m≤n} d_m², d the impulse response of C⁻¹
  (:func:`inverse_impulse`).
"""

from __future__ import annotations

import functools
import math

INDEPENDENT = "independent"
BANDED_SQRT = "banded_sqrt"
#: ``--noise_mechanism``'s values
NOISE_MECHANISMS = (INDEPENDENT, BANDED_SQRT)
#: what the sampler of a banded run does, in the words of privacy.json and the card
CYCLIC_SAMPLING = ("cyclic Poisson: {b} partitions by a hash of each unit, rate {b}*q at the steps of its partition "
                   "(step t: partition t mod {b})")
#: how ε of a banded run is computed, in the words of privacy.json and the card
EQUIVALENT_ACCOUNTING = ("DP-SGD equivalent: rate min(1, {b}*q), ceil(T/{b}) rounds (Choquette-Choo et al. 2023, "
                         "the cyclic Poisson theorem for b-banded factorizations with column norms <= 1)")


def check_noise_mechanism(mechanism: str, bands) -> tuple[str, int]:
    """``(mechanism, bands)`` validated: the mechanism one of :data:`NOISE_MECHANISMS`, ``bands`` a whole number ≥ 1,
    and 1 for ``independent``. One sentence (``ValueError``) otherwise."""
    if mechanism not in NOISE_MECHANISMS:
        raise ValueError(f"--noise_mechanism must be one of {', '.join(NOISE_MECHANISMS)}, got {mechanism!r}")
    if isinstance(bands, bool) or not isinstance(bands, int) or bands < 1:
        raise ValueError(f"--noise_bands must be a whole number >= 1, got {bands!r}")
    if mechanism == INDEPENDENT and bands != 1:
        raise ValueError(f"--noise_bands {bands} needs --noise_mechanism banded_sqrt (independent noise has one band)")
    return mechanism, int(bands)


def effective_bands(mechanism: str, bands: int) -> int:
    """The b the sampler and the accountant use: 1 for independent noise, else ``bands``."""
    return 1 if mechanism == INDEPENDENT else int(bands)


def dp_sgd_equivalent(sample_rate: float, steps: int, bands: int = 1) -> tuple[float, int]:
    """``(rate, rounds)`` of the DP-SGD mechanism (Poisson rate, noise multiplier σ) that is exactly as private as
    ``steps`` noisy steps of the b-banded mechanism at sample rate q (the one function every ε and σ of hf_dp goes
    through: the ledger, the budget check, the planner, the resume path). ``bands`` = 1: ``(q, steps)`` unchanged;
    else ``(min(1, b·q), ⌈steps/b⌉)``."""
    b = int(bands)
    if b == 1:
        return sample_rate, steps
    return min(1.0, b * float(sample_rate)), -(-int(steps) // b)


def cyclic_rate(sample_rate: float, bands: int) -> float:
    """The rate p = b·q at which an eligible unit is drawn (q for b = 1); ``ValueError`` (one sentence) above 1."""
    b = int(bands)
    if b == 1:
        return sample_rate
    p = b * float(sample_rate)
    if p > 1.0:
        raise ValueError(f"--noise_bands {b} with q = B/N = {sample_rate:.4g}: cyclic Poisson sampling draws each unit "
                         f"of the step's partition with probability b*q = {p:.4g} > 1; lower --noise_bands (at most "
                         f"{max(1, int(1.0 / float(sample_rate)))}) or the logical batch")
    return p


@functools.lru_cache(maxsize=64)
def bsr_coefficients(bands: int) -> tuple[float, ...]:
    """c_0, …, c_{b−1}: c_k = binom(2k, k)/4^k (c_0 = 1, c_k = c_{k−1}·(2k − 1)/(2k)), the first b coefficients of
    (1 − x)^(−1/2)."""
    out = [1.0]
    for k in range(1, int(bands)):
        out.append(out[-1] * (2 * k - 1) / (2 * k))
    return tuple(out)


def column_norm(bands: int) -> float:
    """s = √(Σ_{k<b} c_k²): the largest column norm of C (its first column's); 1 for b = 1."""
    return math.sqrt(math.fsum(c * c for c in bsr_coefficients(bands)))


#: b -> (d_0, d_1, …, and V_0, V_1, …) computed so far, grown by :func:`_grow` (each step costs O(b) once)
_IMPULSES: dict[int, tuple[list[float], list[float]]] = {}


def _grow(bands: int, n: int) -> tuple[list[float], list[float]]:
    c = bsr_coefficients(bands)
    d, v = _IMPULSES.setdefault(int(bands), ([1.0], [1.0]))
    while len(d) <= n:
        m = len(d)
        d.append(-math.fsum(c[k] * d[m - k] for k in range(1, min(m, len(c) - 1) + 1)))
        v.append(v[-1] + d[-1] * d[-1])
    return d, v


def inverse_impulse(bands: int, n: int) -> list[float]:
    """d_0, …, d_n: the impulse response of C⁻¹ (the first column of the inverse of the banded Toeplitz C):
    d_0 = 1, d_m = −Σ_{k=1}^{min(m, b−1)} c_k d_{m−k}."""
    return _grow(bands, int(n))[0][: int(n) + 1]


def marginal_std_factor(bands: int, position: int) -> float:
    """s·√V_n, V_n = Σ_{m≤n} d_m² (n = ``position``, the step's place in its segment, from 0): the per-coordinate
    standard deviation of a step's noise in units of σ·Clip (1 for b = 1)."""
    if int(bands) == 1:
        return 1.0
    return column_norm(bands) * math.sqrt(_grow(bands, int(position))[1][int(position)])


def describe(bands: int) -> dict:
    """The public description of the b-banded mechanism (privacy.json's ``correlated_noise``, the card)."""
    b = int(bands)
    return {
        "factorization": "banded square root (BSR; Kalinin & Lampert, NeurIPS 2024): the factor C (not the clipping "
                         "norm) is lower-triangular Toeplitz with first column c_0..c_{b-1}, c_k = binom(2k,k)/4^k, the "
                         "square root of the prefix-sum matrix truncated to b bands",
        "bands": b,
        "coefficients": list(bsr_coefficients(b)),
        "column_norm": column_norm(b),
        "noise": "step t's clipped sum gets sigma*Clip*s*w_t (Clip: the clipping norm), w = C^-1 z (w_t = z_t - "
                 "sum_{k=1}^{b-1} c_k w_{t-k} within a correlation segment), z i.i.d. N(0, I): the post-processing of "
                 "C~x + sigma*Clip*z, C~ = C/s",
        "segments": "the last b-1 noise tensors are kept in memory only, never saved; a new privatizer or a resume "
                    "starts a new segment (block-diagonal C: still b-banded, column norms <= s)",
        "sampling": CYCLIC_SAMPLING.format(b=b),
        "accounting": EQUIVALENT_ACCOUNTING.format(b=b),
    }


class BandedNoise:
    """The running state of one privatizer's correlated noise (memory only: no ``state_dict``).

    Per step: :meth:`begin_step` (the run's step index: a step that does not follow the segment's last one starts a new
    segment), :meth:`correlate` for each tensor's fresh draw z_t ~ N(0, (σ·Clip·s)²) (keyed by the parameter, or under
    FSDP by the parameter of this rank's shard) — it returns n_t = z_t − Σ_k c_k n_{t−k} and keeps it —, and
    :meth:`end_step`. Every rank calls :meth:`begin_step` and :meth:`end_step` (the segment's position drives the
    update rules' noise figure on every rank); only the ranks that add noise call :meth:`correlate`, so under DDP only
    rank 0 holds the last b − 1 noise tensors, and under FSDP each rank those of its own shards."""

    def __init__(self, bands: int):
        self.bands = int(bands)
        self.coefficients = bsr_coefficients(self.bands)
        self.scale = column_norm(self.bands)
        self.reset()

    def reset(self) -> None:
        """A new segment: no earlier noise, position 0."""
        self._previous: dict = {}
        self.position = 0  # steps of the current segment already noised
        self.next_step: int | None = None  # the run's step index the segment's next step must have

    def begin_step(self, step: int) -> None:
        if self.next_step is not None and int(step) != self.next_step:
            self.reset()

    def correlate(self, key, z):
        """n_t from the fresh draw ``z`` (in place: ``z`` is returned, and kept for the next b − 1 steps)."""
        if self.bands == 1:
            return z
        previous = self._previous.get(key, [])  # most recent first, at most min(b − 1, position) tensors
        for c, earlier in zip(self.coefficients[1:], previous):
            z.add_(earlier, alpha=-c)
        self._previous[key] = [z, *previous[: self.bands - 2]]
        return z

    def end_step(self, step: int) -> None:
        self.position += 1
        self.next_step = int(step) + 1

    def std_factor(self) -> float:
        """s·√V_n of the step noised last in this segment (n = 0 before any): :func:`marginal_std_factor`."""
        return marginal_std_factor(self.bands, max(self.position - 1, 0))

    def buffered(self) -> list:
        """The noise tensors held (for tests and memory accounting)."""
        return [t for ts in self._previous.values() for t in ts]
