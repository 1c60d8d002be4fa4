"""The canaries of the one-run audit (:mod:`hf_dp.audit.canaries` drives them inside DPTrainer).

* :class:`SequenceCanaries` — ``--audit_kind input`` (black-box): m out-of-distribution token sequences with random
  labels, each included in the training set with probability ½, scored by the trained model's label margin
  (:func:`label_margins`).
* :class:`GradientDirections` — ``--audit_kind gradient`` (white-box): one random unit direction u_k over the
  trainable parameters per canary, from a full-entropy keyed stream; the canary's per-example gradient is s·u_k
  (s ≥ C, chosen by the auditor), clipped and noised with the batch; the score is a likelihood ratio of the
  projections ⟨g̃_t, u_k⟩ of every step's privatized (noisy) gradient g̃_t (:func:`step_log_likelihood_ratio`; under
  banded noise, of their whitened sequence: :class:`BandedLikelihoodRatio`).

Both hold their secret (the inclusion bits) in memory only: pickling is refused and :meth:`forget` drops them. This
module imports nothing of hf_dp.
"""

from __future__ import annotations

import math
import secrets

import numpy as np

# ------------------------------------------------------------------------------------------------
# black-box (input) canaries for a sequence classifier
# ------------------------------------------------------------------------------------------------
def _special_tokens(tokenizer) -> tuple[list[int], list[int], bool]:
    """(prefix, suffix, token_type_ids?) the tokenizer puts around one sequence (e.g. [CLS] … [SEP]), read off the
    encoding of a probe text with and without special tokens."""
    full = tokenizer("x")
    bare = list(tokenizer("x", add_special_tokens=False)["input_ids"])
    ids = list(full["input_ids"])
    for i in range(len(ids) - len(bare) + 1):
        if ids[i:i + len(bare)] == bare:
            return ids[:i], ids[i + len(bare):], "token_type_ids" in full
    raise ValueError("error: cannot tell which special tokens this tokenizer adds around a sequence")


def _secret_rng(seed):
    if seed is None:
        return np.random.default_rng(secrets.randbits(128))
    return np.random.default_rng(seed)


class SequenceCanaries:
    """m black-box canaries for a sequence classifier trained by DPTrainer (see the module docstring).

    ``draw(m, num_labels, tokenizer=... or vocab_size=..., length=32)``; ``append_to(train_dataset)`` → the training
    set with the included canaries appended (one row, one unit each); ``dataset()`` → the canaries to score;
    ``forget()`` drops the bits. DPTrainer's ``--audit_canaries`` drives it (:func:`attach`, :func:`after_train`).
    """

    kind = "black-box"
    score_name = "label margin z_y - logsumexp(z_j, j != y)"

    def __init__(self, input_ids, labels, included, token_type_ids=None):
        self.input_ids = [list(map(int, x)) for x in input_ids]
        self.labels = [int(y) for y in labels]
        self.token_type_ids = None if token_type_ids is None else [list(map(int, x)) for x in token_type_ids]
        self._included = np.asarray(included, dtype=bool).copy()
        if not (len(self.input_ids) == len(self.labels) == len(self._included) >= 1):
            raise ValueError("error: canaries need as many input sequences, labels and inclusion bits, at least one")

    # ----- drawing -----------------------------------------------------------------------------------
    @classmethod
    def draw(cls, m: int, num_labels: int, *, tokenizer=None, vocab_size: int | None = None, length: int = 32,
             token_range: tuple[int, int] | None = None, seed=None, bits_seed=None) -> "SequenceCanaries":
        """``m`` canaries of ``length`` random tokens (from ``token_range`` = [lo, hi), default the whole vocabulary
        minus the tokenizer's special tokens), each with a random label in [0, ``num_labels``) and an inclusion bit.
        ``seed`` fixes the tokens and labels (public anyway); ``bits_seed`` the inclusion bits — tests only: the default
        None draws them from the OS entropy source, so that nobody can recompute them."""
        if not (isinstance(m, int) and m >= 1):
            raise ValueError(f"error: the number of canaries must be a positive integer, got {m!r}")
        if not (isinstance(num_labels, int) and num_labels >= 2):
            raise ValueError(f"error: black-box canaries need a classifier with >= 2 labels (random labels), got num_labels={num_labels!r}")
        if not (isinstance(length, int) and length >= 1):
            raise ValueError(f"error: the canary length must be a positive integer, got {length!r}")
        if vocab_size is None:
            if tokenizer is None:
                raise ValueError("error: give the tokenizer or the vocabulary size to draw canary tokens from")
            vocab_size = len(tokenizer)
        lo, hi = token_range if token_range is not None else (0, int(vocab_size))
        special = set(getattr(tokenizer, "all_special_ids", []) or []) if tokenizer is not None else set()
        pool = np.array([t for t in range(int(lo), int(hi)) if t not in special], dtype=np.int64)
        if len(pool) < 2:
            raise ValueError(f"error: no tokens to draw canaries from in [{lo}, {hi}) without the special tokens")
        content = _secret_rng(seed)  # content and labels: not secret, but there is no reason to make them guessable
        tokens = pool[content.integers(0, len(pool), size=(m, length))]
        labels = content.integers(0, num_labels, size=m)
        bits = _secret_rng(bits_seed).random(m) < 0.5
        types = None
        if tokenizer is not None:
            prefix, suffix, with_types = _special_tokens(tokenizer)
            ids = [prefix + list(map(int, t)) + suffix for t in tokens]
            if with_types:
                types = [[0] * len(x) for x in ids]
        else:
            ids = tokens.tolist()
        return cls(ids, labels, bits, types)

    def __len__(self) -> int:
        return len(self.labels)

    @property
    def included(self) -> np.ndarray:
        """The secret inclusion bits (a copy). Refused after :meth:`forget`."""
        if self._included is None:
            raise ValueError("error: the canaries' inclusion draw was forgotten (forget() was called)")
        return self._included.copy()

    def forget(self) -> None:
        """Drop the inclusion bits (call after :meth:`audit`)."""
        self._included = None

    def __reduce__(self):
        raise TypeError("SequenceCanaries cannot be pickled: the inclusion draw must never be stored with the model")

    # ----- rows --------------------------------------------------------------------------------------
    def rows(self, columns, which=None, blank=()) -> dict:
        """Columns ``columns`` for the canaries ``which`` (indices; default all): input_ids, attention_mask,
        token_type_ids, labels/label, and the ``blank`` columns (None: e.g. the privacy-unit column, each canary its
        own unit). Any other column is refused."""
        idx = range(len(self)) if which is None else [int(i) for i in which]
        out = {}
        for c in columns:
            if c in blank:
                out[c] = [None for _ in idx]
            elif c == "input_ids":
                out[c] = [self.input_ids[i] for i in idx]
            elif c == "attention_mask":
                out[c] = [[1] * len(self.input_ids[i]) for i in idx]
            elif c == "token_type_ids":
                out[c] = [self.token_type_ids[i] if self.token_type_ids else [0] * len(self.input_ids[i]) for i in idx]
            elif c in ("labels", "label"):
                out[c] = [self.labels[i] for i in idx]
            else:
                raise ValueError(
                    f"error: the training set has a column {c!r} that canaries cannot fill (they have input_ids, "
                    "attention_mask, token_type_ids and labels); remove it before appending the canaries"
                )
        return out

    def dataset(self, like=None, which=None, blank=(), labels=True, drop=()):
        """The canaries ``which`` (default all) as a 🤗 ``datasets.Dataset`` with the columns (and features) of
        ``like`` (default: input_ids, attention_mask, labels); ``blank`` columns are None; ``labels=False`` and
        ``drop`` leave columns out (scoring: no label reaches the trainer)."""
        import datasets

        columns = list(getattr(like, "column_names", None) or ["input_ids", "attention_mask", "labels"])
        if "input_ids" not in columns:
            raise ValueError("error: canaries need an input_ids column in the training set")
        if not ({"labels", "label"} & set(columns)):
            raise ValueError("error: canaries need a labels (or label) column in the training set")
        out = [c for c in columns if c not in drop and (labels or c not in ("labels", "label"))]
        ds = datasets.Dataset.from_dict(self.rows(out, which, blank))
        features = getattr(like, "features", None)
        if features is None:
            return ds
        features = datasets.Features({c: features[c] for c in out})
        if ds.features == features:
            return ds
        with _quiet_datasets():
            return ds.cast(features)

    def append_to(self, train_dataset, blank=()):
        """The training set with the included canaries appended (rows N_real … N_real + |included| − 1); ``blank``
        columns are None for the canaries. A 🤗 ``Dataset`` gives a ``Dataset`` (same features); any other map-style
        dataset of dicts a concatenation."""
        which = np.flatnonzero(self.included)
        if hasattr(train_dataset, "column_names") and hasattr(train_dataset, "features"):
            import datasets

            if not len(which):
                return train_dataset
            return datasets.concatenate_datasets([train_dataset, self.dataset(like=train_dataset, which=which, blank=blank)])
        first = train_dataset[0]
        extra = self.rows(list(first.keys()), which, blank)
        rows = [{k: extra[k][j] for k in extra} for j in range(len(which))]
        return _Appended(train_dataset, rows)


class _quiet_datasets:
    """No 🤗 Datasets progress bars inside (casting the canaries' few rows)."""

    def __enter__(self):
        from datasets.utils import logging as ds_logging

        self._was = ds_logging.is_progress_bar_enabled()
        ds_logging.disable_progress_bar()

    def __exit__(self, *exc):
        from datasets.utils import logging as ds_logging

        if self._was:
            ds_logging.enable_progress_bar()


class _Appended:
    """A map-style dataset: ``base`` then ``extra`` (a list of row dicts)."""

    def __init__(self, base, extra):
        self.base, self.extra = base, extra

    def __len__(self):
        return len(self.base) + len(self.extra)

    def __getitem__(self, i):
        n = len(self.base)
        if i < 0:
            i += len(self)
        return self.base[i] if i < n else dict(self.extra[i - n])


def label_margins(logits, labels) -> np.ndarray:
    """z_y − log Σ_{j≠y} e^{z_j} per row (for two labels: z_y − z_other)."""
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(labels, dtype=np.int64)
    if z.ndim != 2 or z.shape[1] < 2 or z.shape[0] != len(y):
        raise ValueError(f"error: expected logits [m, >= 2 labels] for {len(y)} canaries, got shape {z.shape}")
    own = z[np.arange(len(y)), y]
    others = z.copy()
    others[np.arange(len(y)), y] = -np.inf
    mx = others.max(axis=1, keepdims=True)
    lse = mx[:, 0] + np.log(np.exp(others - mx).sum(axis=1))
    return own - lse


# ------------------------------------------------------------------------------------------------
# white-box (gradient) canaries: random directions over the trainable parameters
# ------------------------------------------------------------------------------------------------
#: nonzero coordinates of one canary direction (all of them for a model with fewer trainable parameters): a random
#: sparse direction is as good a canary as a dense one (the noise is isotropic: its projection on any unit vector is
#: N(0, σ²C²) per step) and costs O(SUPPORT), not O(d), to build at every step and to score
SUPPORT = 1 << 12


class GradientDirections:
    """m random unit directions u_k over d trainable coordinates (the privatizer's parameters, flattened in order):
    u_k has :data:`SUPPORT` (or d) coordinates, drawn without replacement, each ±1/√support, from a keyed stream
    (a 128-bit key from the OS entropy source and k). The directions are not secret (the inclusion bits are);
    the key is kept so that every rank builds the same ones."""

    def __init__(self, m: int, sizes, key: int | None = None, support: int = SUPPORT):
        if not (isinstance(m, int) and m >= 1):
            raise ValueError(f"error: the number of canaries must be a positive integer, got {m!r}")
        self.m = m
        self.sizes = [int(s) for s in sizes]
        self.d = int(sum(self.sizes))
        if self.d < 1:
            raise ValueError("error: gradient canaries need at least one trainable parameter")
        self.key = secrets.randbits(128) if key is None else int(key)
        self.support = min(int(support), self.d)
        self._offsets = np.concatenate([[0], np.cumsum(self.sizes)])

    def direction(self, k: int) -> tuple[np.ndarray, np.ndarray]:
        """(flat indices, values) of u_k; ‖u_k‖ = 1."""
        if not 0 <= int(k) < self.m:
            raise IndexError(f"canary {k} out of range 0..{self.m - 1}")
        rng = np.random.default_rng([self.key & (2**64 - 1), self.key >> 64, int(k), 0x6C1A])
        if self.support == self.d:
            idx = np.arange(self.d)
        else:
            idx = np.sort(rng.choice(self.d, size=self.support, replace=False))
        vals = np.where(rng.random(self.support) < 0.5, -1.0, 1.0) / math.sqrt(self.support)
        return idx, vals

    def per_parameter(self, k: int):
        """u_k split by parameter: [(parameter position, local flat indices, values)] for the parameters it touches."""
        idx, vals = self.direction(k)
        owner = np.searchsorted(self._offsets, idx, side="right") - 1
        out = []
        for j in np.unique(owner):
            sel = owner == j
            out.append((int(j), idx[sel] - self._offsets[j], vals[sel]))
        return out

    def matrix(self):
        """All m directions at once, for a per-step projection: (indices, signs) as (m, support) arrays (int64, int8),
        u_k = signs[k] / √support on indices[k]."""
        idx = np.empty((self.m, self.support), dtype=np.int64)
        signs = np.empty((self.m, self.support), dtype=np.int8)
        for k in range(self.m):
            i, v = self.direction(k)
            idx[k], signs[k] = i, np.sign(v)
        return idx, signs


def step_log_likelihood_ratio(x, sample_rate: float, noise_multiplier: float) -> np.ndarray:
    """log p₁(x)/p₀(x) of one step's projection x = B·⟨g̃_t, u_k⟩/C (in units of C) of a gradient canary: under "the
    canary is in the training set" x ~ (1 − q)·N(0, σ²) + q·N(1, σ²) (drawn with probability q, clipped to exactly C
    along u_k), under "it is not" x ~ N(0, σ²); so the ratio is log(1 − q + q·exp((x − ½)/σ²)), computed without
    overflow. Summed over the steps it is the Neyman–Pearson statistic of the whole run for one canary (the steps'
    noises are independent), which the sum ⟨Σ_t g̃_t, u_k⟩ is not: a canary drawn in few of many steps is seen in
    those steps' projections, not diluted by the noise of all the others. σ = 0 (a run without noise) falls back to x.
    """
    x = np.asarray(x, dtype=np.float64)
    q, s = float(sample_rate), float(noise_multiplier)
    if not (0.0 < q <= 1.0) or s <= 0.0:
        return x.copy()
    return np.logaddexp(math.log1p(-q) if q < 1.0 else -np.inf, math.log(q) + (x - 0.5) / (s * s))


class BandedLikelihoodRatio:
    """The gradient canaries' score under b-banded noise (``--noise_bands`` b > 1: the privatizer's noise is σ·C·s·w_t,
    w = M⁻¹z, :mod:`hf_dp.privacy.banded`), fed each step's projections x_t = B·⟨g̃_t, u_k⟩/C of every canary in turn.

    x = p + σ·s·M⁻¹ζ (p_t ∈ {0, 1}: canary k drawn at step t, ζ i.i.d. N(0, 1)), so the whitened sequence
    r = M·x/s = M~·p + σ·ζ (M~ = M/s) has independent noise. Canary k can only join the steps u of its partition
    (u ≡ ``partitions[k]`` mod b), each with probability p = min(1, b·q); their columns of M~ (support u … u + b − 1) are
    disjoint, so the projections a_u = ⟨r, M~e_u⟩ are independent, a_u ~ N(n_u·p_u, σ²·n_u), n_u = ‖M~e_u‖² (1 for a
    complete column, less for one cut by the end of the run). The log-likelihood ratio of "included" against "not" is
    Σ_u log(1 − p + p·exp((a_u − n_u/2)/σ²)) over the canary's steps: the exact Neyman–Pearson statistic of the whole
    sequence, the DP-SGD-equivalent test (with b = 1 it is :func:`step_log_likelihood_ratio` summed). Every input is
    public (the privatized gradients, the canaries' partitions, q, σ, the coefficients), never an inclusion bit, so the
    score keeps the one-run bound valid. One segment: the steps fed are the privatizer's steps 0, 1, … of one segment.
    Holds the last b projections and whitened values per canary (memory only)."""

    def __init__(self, partitions, coefficients, sample_rate: float, noise_multiplier: float):
        self.partitions = np.asarray(partitions, dtype=np.int64).reshape(-1)
        self.c = np.asarray(coefficients, dtype=np.float64)
        self.b = len(self.c)
        self.s = float(np.sqrt((self.c**2).sum()))
        self.rate = min(1.0, self.b * float(sample_rate))
        self.sigma = float(noise_multiplier)
        self.steps = 0
        self._x: list[np.ndarray] = []  # x_{t-1}, x_{t-2}, …: the last b − 1, most recent first
        self._r: list[np.ndarray] = []  # r of the last (at most) b steps, oldest first
        self._score = np.zeros(len(self.partitions))

    def _term(self, a: np.ndarray, n: float) -> np.ndarray:
        if self.sigma <= 0.0:  # a run without nominal noise: the projection itself
            return a
        return step_log_likelihood_ratio(a - (n - 1.0) / 2.0, self.rate, self.sigma)  # log(1 − p + p·e^((a − n/2)/σ²))

    def _column(self, u: int, length: int) -> tuple[np.ndarray, float]:
        """(a_u, n_u) from the whitened values of steps u … u + length − 1 (held in ``_r``)."""
        first = self.steps - len(self._r)
        w = self.c[:length] / self.s
        a = sum(wj * self._r[u + j - first] for j, wj in enumerate(w))
        return a, float((w**2).sum())

    def update(self, x) -> None:
        """Step ``steps``'s projections (one per canary)."""
        x = np.asarray(x, dtype=np.float64)
        r = (self.c[0] * x + sum(c * xp for c, xp in zip(self.c[1:], self._x))) / self.s
        self._x = [x, *self._x[: self.b - 2]]
        self._r = [*self._r[-(self.b - 1):], r] if self.b > 1 else [r]
        self.steps += 1
        u = self.steps - self.b  # the step whose column is now complete
        if u >= 0:
            a, n = self._column(u, self.b)
            mine = self.partitions == u % self.b
            self._score[mine] += self._term(a[mine], n)

    def scores(self) -> np.ndarray:
        """The score of every canary over the steps fed so far: the complete columns', plus the columns the end of the
        run cut (steps T − b + 1 … T − 1, n_u < 1); the state is unchanged."""
        out = self._score.copy()
        for u in range(max(0, self.steps - self.b + 1), self.steps):
            a, n = self._column(u, self.steps - u)
            mine = self.partitions == u % self.b
            out[mine] += self._term(a[mine], n)
        return out
