"""A privacy audit in one training run (Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training run",
NeurIPS 2023): m canaries, each included in the training set independently with probability ½, and afterwards a
count of how many inclusions can be guessed from the trained model, turned into an ε lower bound.

What it says, and what it does not
----------------------------------
The bound is a statistical *lower* bound on the ε of the training run with respect to one canary (one privacy unit,
add/remove adjacency), at the run's δ and 95 % confidence. ε_lower above the run's reported ε means, with 95 %
confidence, that the run is not as private as it claims: a bug (noise missing, clipping skipped, a unit counted
twice, a wrong sampling rate, ...). ε_lower below it is the expected outcome *and proves nothing*: black-box canaries
scored on the final model are far from the worst case the accountant bounds, so ε_lower ≪ ε for a correct run (and
for many broken ones). "a lower bound that can expose a bug, never a proof of privacy".

The bound (:func:`epsilon_lower_bound`)
---------------------------------------
Canary i is included iff S_i = +1 (S uniform on {−1, +1}^m, drawn independently of everything else); after training
the auditor guesses T_i ∈ {−1, 0, +1} from the model alone (0: abstain), r = ‖T‖₁ guesses in all, fixed in number
before training, and W = #{i : T_i = S_i} correct guesses. With f(v) = P[Binomial(r, e^ε/(1 + e^ε)) ≥ v]:

* **ε-DP** (δ = 0; the paper's Theorem 3.1): P[W ≥ v] ≤ f(v). The largest ε rejected at level β has a closed form:
  f(v) ≤ β ⟺ e^ε/(1 + e^ε) ≤ p_β, p_β the one-sided Clopper–Pearson lower limit of a success probability from v
  successes in r trials at confidence 1 − β (``beta.ppf(β, v, r − v + 1)``), so ε_lower = max(0, logit p_β).
* **(ε, δ)-DP** (the paper's Theorem 5.2 with the binomial f of its Corollary 5.4):
  P[W ≥ v] ≤ f(v) + 2mδ · max_{i ≥ 1} (f(v − i) − f(v))/i. ε_lower is the largest ε whose p-value is ≤ β, found by
  the numerical search of the paper's Appendix D: bracket, then bisection on ε, the returned ε always one whose
  p-value was computed to be ≤ β (valid whatever the shape of p(ε): every ε ≥ the run's true ε is a true null).
  2mδ must be well below β (m = 1000 canaries at δ = 1e-5: 0.02), or nothing can be certified.

The guesses. Canaries are ranked by a score (higher: more likely included); the guess set (k₊, k₋) says "included"
for the k₊ highest and "excluded" for the k₋ lowest (r = k₊ + k₋). The number of guesses must not be chosen after
looking at the outcome, so :func:`audit_scores` tries a small grid of guess sets fixed in advance
(:data:`GUESS_FRACTIONS`: r = 5 %, 10 %, 20 %, 50 %, 100 % of m, half of them "included") and tests each at β/5
(Bonferroni): the reported bound, the largest of the five, holds with probability ≥ 1 − β. Ties in the score are
broken by the canary's index, which is independent of the draw.

Black-box canaries for a sequence classifier (:class:`SequenceCanaries`; ``--audit_canaries m``)
-----------------------------------------------------------------------------------------------
m out-of-distribution inputs — sequences of tokens drawn uniformly from the vocabulary (special tokens excluded,
wrapped in the tokenizer's special tokens when one is given; as long as a typical training row, at most
:data:`CANARY_TOKENS`) — each with a uniformly random label; canary i is included iff its secret bit says so. The
tokens and labels come from a public stream (``--seed``; the same on every rank); the bits from the OS entropy source
(rank 0's, broadcast in memory under DDP) and live only in memory: never in the model, its config, ``privacy.json``,
a checkpoint, a log or a pickle (pickling is refused). DPTrainer (:func:`attach`, :func:`extend_units`) appends the
included canaries to the training set given to it, which stays the source of the data fingerprint (a hash of the
training set with the canaries would be a function of the draw). After ``train()`` (:func:`after_train`) every canary
is scored through HF's ``evaluation_loop`` with the trainer's collator, device and frozen-prefix cache, *without its
label* (no loss, no metric; canaries never enter an evaluation set): the score is the label's logit margin
z_y − log Σ_{j≠y} e^{z_j} (included canaries were trained on and tend to score higher). Guesses, counts and the bound
go to ``trainer.audit_record`` (``privacy.json``'s ``audit``, the card's line next to ε); the bits are then dropped.

Accounting. Every canary is a privacy unit whether or not the draw included it: an excluded canary is a unit with no
row, drawn by the Poisson sampler like any unit and contributing nothing. So **N = real units + m** and
**q = B/(N_real + m)** do not depend on the draw (the released N, q and ε reveal nothing about which or how many
canaries were included), and (ε, δ) is the guarantee of the mechanism for add/remove of any one unit — a canary, the
auditor's null hypothesis, or a real unit, each sampled at that q: canaries are extra units and the real examples'
guarantee is the reported ε. The reported N (``dataset_size``, the card's N) counts the m canaries; the record says so.
With ``--privacy_unit_column`` each canary is its own unit (its unit column is empty). A run cannot be resumed (the
draw is not stored, so a new process cannot rebuild the training set) and is audited after its one ``train()``.
The frozen-prefix cache of the training set is built without its progress bar and log line (their row count would
be real + included).

White-box canaries (:func:`hf_dp.audit.one_run.white_box_run`) — the command line only: each canary owns one
coordinate of the audit's bias-free linear "classifier" (:mod:`hf_dp.audit.trainer_path`'s ``CanaryModel``) and its
gradient is clipped to exactly C along that coordinate (a Dirac gradient canary); the score is the coordinate's
movement θ_0 − θ_T. Through DPTrainer on a real model, gradient canaries would need the clipping engine to accept
injected per-example gradients; that is not done.

The command line: ``python -m hf_dp.audit --one_run ...`` (:mod:`hf_dp.audit.one_run`: the black-box run is a
DPTrainer run with ``--audit_canaries``, variants as the trainer path of :mod:`hf_dp.audit.trainer_path`); see
``benchmarks/audit.md``.
"""

from __future__ import annotations

import math
import secrets
import warnings
from dataclasses import dataclass, field

import numpy as np

METHOD = "one-run (Steinke, Nasr, Jagielski 2023)"
NOTE = "a lower bound that can expose a bug, never a proof of privacy"
#: the guess sets tried, as fractions of m guessed (half "included", half "excluded"); Bonferroni over them
GUESS_FRACTIONS = (0.05, 0.1, 0.2, 0.5, 1.0)
KINDS = ("black-box", "white-box")


# ------------------------------------------------------------------------------------------------
# the bound
# ------------------------------------------------------------------------------------------------
def _check_counts(m, r, v) -> tuple[int, int, int]:
    try:
        mi, ri, vi = (int(x) for x in (m, r, v))
    except (TypeError, ValueError):
        raise ValueError(f"error: the canary counts must be integers, got m={m!r}, r={r!r}, v={v!r}") from None
    if (mi, ri, vi) != (m, r, v) or not (0 <= vi <= ri <= mi and mi >= 1):
        raise ValueError(f"error: the counts must be integers with 0 <= correct <= guesses <= canaries, canaries >= 1; "
                         f"got canaries={m}, guesses={r}, correct={v}")
    return mi, ri, vi


def _check_probability(name: str, x: float, zero_ok: bool) -> float:
    x = float(x)
    if not (0.0 <= x < 1.0 if zero_ok else 0.0 < x < 1.0) or math.isnan(x):
        raise ValueError(f"error: {name} must be in {'[0, 1)' if zero_ok else '(0, 1)'}, got {x}")
    return x


def p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """P[W ≥ v] allowed by (ε, δ)-DP for ``v`` correct of ``r`` guesses on ``m`` canaries (the module docstring's
    f(v) + 2mδ · max_i (f(v − i) − f(v))/i; f(v) alone when δ = 0), capped at 1."""
    from scipy.special import expit
    from scipy.stats import binom

    m, r, v = _check_counts(m, r, v)
    delta = _check_probability("delta", delta, zero_ok=True)
    if not epsilon >= 0:
        raise ValueError(f"error: epsilon must be >= 0, got {epsilon}")
    if v == 0:
        return 1.0
    q = float(expit(epsilon))
    tail = float(binom.sf(v - 1, r, q))  # f(v) = P[Bin(r, q) >= v]
    if delta == 0.0:
        return min(1.0, tail)
    # f(v − i) − f(v) = P[v − i <= Bin < v]: the masses at v−1, v−2, ..., 0 summed (i > v adds nothing and divides by more)
    window = np.cumsum(binom.pmf(np.arange(v - 1, -1, -1), r, q))
    alpha = float(np.max(window / np.arange(1, v + 1)))
    return min(1.0, tail + 2.0 * m * delta * alpha)


def epsilon_lower_bound(m: int, r: int, v: int, delta: float, beta: float = 0.05, tol: float = 1e-7) -> float:
    """ε_lower at confidence 1 − ``beta``: the largest ε at which ``v`` correct of ``r`` guesses on ``m`` canaries
    refute (ε, ``delta``)-DP (0 if even ε = 0 is not refuted). δ = 0: the closed form; δ > 0: bisection on ε."""
    from scipy.special import logit
    from scipy.stats import beta as beta_dist

    m, r, v = _check_counts(m, r, v)
    delta = _check_probability("delta", delta, zero_ok=True)
    beta = _check_probability("beta (1 - confidence)", beta, zero_ok=False)
    if v == 0 or p_value(m, r, v, 0.0, delta) > beta:
        return 0.0
    if delta == 0.0:
        if v == r and r > 0:
            p_lo = beta ** (1.0 / r)  # P[Bin(r, p) >= r] = p^r
        else:
            p_lo = float(beta_dist.ppf(beta, v, r - v + 1))
        return max(0.0, float(logit(p_lo)))
    lo, hi = 0.0, 1.0  # invariant: p(lo) <= beta < p(hi)
    while p_value(m, r, v, hi, delta) <= beta:
        lo, hi = hi, 2.0 * hi
        if hi > 1e4:  # unreachable for r <= 1e9 guesses; a guard against a silent infinite loop
            return lo
    while hi - lo > tol:
        mid = 0.5 * (lo + hi)
        if p_value(m, r, v, mid, delta) <= beta:
            lo = mid
        else:
            hi = mid
    return lo


#: the paper's notation
eps_lower = epsilon_lower_bound


def guess_sets(m: int, fractions=GUESS_FRACTIONS) -> list[tuple[int, int]]:
    """The (k₊, k₋) guess sets tried for ``m`` canaries: r = round(f·m) guesses, ⌈r/2⌉ "included", ⌊r/2⌋ "excluded"."""
    out = []
    for f in fractions:
        r = max(1, min(m, int(round(f * m))))
        pair = ((r + 1) // 2, r // 2)
        if pair not in out:
            out.append(pair)
    return out


def count_correct(scores, included, k_plus: int, k_minus: int) -> tuple[int, int]:
    """(r, v): ``k_plus`` "included" guesses on the highest scores, ``k_minus`` "excluded" guesses on the lowest
    (ties broken by index), and how many of the r = k₊ + k₋ guesses match ``included``."""
    s = np.asarray(scores, dtype=float)
    inc = np.asarray(included, dtype=bool)
    if s.ndim != 1 or s.shape != inc.shape:
        raise ValueError(f"error: scores and included must be 1-D of the same length, got {s.shape} and {inc.shape}")
    if not np.all(np.isfinite(s)):
        raise ValueError("error: every canary score must be finite")
    m = len(s)
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > m:
        raise ValueError(f"error: k_plus + k_minus must be at most the {m} canaries, got {k_plus} + {k_minus}")
    order = np.argsort(s, kind="stable")  # ascending; equal scores keep index order (independent of the draw)
    top, bottom = order[m - k_plus:], order[:k_minus]
    return k_plus + k_minus, int(inc[top].sum() + (~inc[bottom]).sum())


@dataclass
class OneRunBound:
    epsilon_lower: float
    canaries: int
    guesses: int
    correct: int
    k_plus: int
    k_minus: int
    delta: float
    confidence: float
    guess_sets: int  # guess sets tried (Bonferroni)
    tried: list = field(default_factory=list)  # (k_plus, k_minus, correct, bound) for every set


def audit_scores(scores, included, delta: float, beta: float = 0.05, guesses=None) -> OneRunBound:
    """The one-run bound from canary ``scores`` (higher: more likely included) and the secret ``included`` bits:
    every guess set of ``guesses`` (default :func:`guess_sets`) tested at β/len(guesses), the best reported."""
    inc = np.asarray(included, dtype=bool)
    m = len(inc)
    if m < 1:
        raise ValueError("error: the audit needs at least one canary")
    sets = guess_sets(m) if guesses is None else [(int(a), int(b)) for a, b in guesses]
    if not sets:
        raise ValueError("error: at least one guess set (k_plus, k_minus) is needed")
    beta = _check_probability("beta (1 - confidence)", beta, zero_ok=False)
    each = beta / len(sets)
    best, tried = None, []
    for kp, km in sets:
        r, v = count_correct(scores, inc, kp, km)
        eps = epsilon_lower_bound(m, r, v, delta, each)
        tried.append((kp, km, v, eps))
        if best is None or eps > best[3]:
            best = (kp, km, v, eps)
    kp, km, v, eps = best
    return OneRunBound(eps, m, kp + km, v, kp, km, float(delta), 1.0 - beta, len(sets), tried)


def ceiling(m: int, delta: float, beta: float = 0.05, guesses=None) -> float:
    """The largest bound ``m`` canaries can give at all: every guess of every set correct (a run with no privacy,
    scored perfectly). A claimed ε at or above it cannot be refuted by this audit."""
    sets = guess_sets(m) if guesses is None else list(guesses)
    return max(epsilon_lower_bound(m, a + b, a + b, delta, beta / len(sets)) for a, b in sets)


def record(bound: OneRunBound, kind: str = "black-box", score: str | None = None) -> dict:
    """The ``privacy.json`` entry for a one-run audit (its card line: :func:`describe`)."""
    if kind not in KINDS:
        raise ValueError(f"error: kind must be one of {KINDS}, got {kind!r}")
    out = {
        "method": METHOD,
        "canaries": bound.canaries,
        "guesses": bound.guesses,
        "correct": bound.correct,
        "confidence": round(bound.confidence, 10),
        "delta": bound.delta,
        "epsilon_lower_bound": bound.epsilon_lower,
        "kind": kind,
        "guess_sets_tried": bound.guess_sets,
        "note": NOTE,
    }
    if score:
        out["score"] = score
    return out


def describe(rec: dict) -> str:
    """One sentence for the model card, e.g. "empirical lower bound ε̂ = 0.00 (one-run audit, 1000 canaries,
    black-box, 95 % confidence at δ = 1e-05): a lower bound that can expose a bug, never a proof of privacy"."""
    return (f"empirical lower bound ε̂ = {rec['epsilon_lower_bound']:.2f} (one-run audit, {rec['canaries']} canaries, "
            f"{rec['kind']}, {100 * rec['confidence']:g} % confidence at δ = {rec['delta']:g}; {rec['correct']} of "
            f"{rec['guesses']} inclusion guesses correct): {rec['note']}")


# ------------------------------------------------------------------------------------------------
# black-box canaries for a sequence classifier
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
# --audit_canaries m: the canaries of a DPTrainer run (the trainer's hooks call these; they take the trainer)
# ------------------------------------------------------------------------------------------------
#: the fewest canaries --audit_canaries accepts: below it even a run with no privacy cannot be refuted at ε ≈ 1–3
MIN_CANARIES = 100
#: 1 − confidence of the trainer's audit (95 %); 2mδ must stay below it (:func:`check_canary_count`)
AUDIT_BETA = 0.05
#: tokens of one black-box canary (capped by the model's positions)
CANARY_TOKENS = 32
ACCOUNTING = (
    "q = B/(N_real + m): every canary is counted as a privacy unit whether or not the secret draw included it, so N, "
    "q and epsilon do not depend on the draw; the reported N is the real units plus the m canaries, and the real "
    "examples' guarantee is the reported epsilon (each real unit is sampled at that q)"
)


def check_canary_count(m, delta: float, beta: float = AUDIT_BETA) -> None:
    """One-sentence ``ValueError`` unless ``m`` (--audit_canaries) is a whole number ≥ :data:`MIN_CANARIES` with
    2mδ < β (else the δ term of the bound alone reaches β and nothing can be certified)."""
    if isinstance(m, bool) or not isinstance(m, int) or m < MIN_CANARIES:
        raise ValueError(f"--audit_canaries must be a whole number >= {MIN_CANARIES} (fewer canaries cannot refute any "
                         f"useful epsilon), got {m!r}")
    if 2 * m * delta >= beta:
        raise ValueError(f"--audit_canaries {m} with --delta {delta:g}: 2*m*delta = {2 * m * delta:g} >= {beta:g}, so the "
                         "one-run bound can certify nothing; use fewer canaries or a smaller delta")


class TrainerCanaries:
    """A DPTrainer's canaries (``trainer._audit``): the :class:`SequenceCanaries`, where they sit in the training set
    (rows ``real_rows`` … ``real_rows + #included − 1``) and the number of real units. Held in memory only."""

    def __init__(self, canaries: SequenceCanaries, real_rows: int, like):
        self.canaries, self.real_rows, self.like = canaries, int(real_rows), like
        self.m = len(canaries)
        self.included_rows = int(canaries.included.sum())
        self.real_units: int | None = None
        self.trained = False
        self.bound: OneRunBound | None = None

    def __reduce__(self):
        raise TypeError("the trainer's canaries cannot be pickled: the inclusion draw must never be stored")

    @property
    def public_rows(self) -> int:
        """What HF may report as the number of training examples: real rows + m (not + the included ones)."""
        return self.real_rows + self.m


def _shared_bits(bits: np.ndarray, args) -> np.ndarray:
    """Under DDP every rank must train on the same canaries: rank 0's bits, broadcast in memory."""
    import torch

    if getattr(args, "world_size", 1) <= 1:
        return bits
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("--audit_canaries with several processes needs torch.distributed initialized (torchrun)")
    device = torch.device("cpu") if dist.get_backend() == "gloo" else args.device
    t = torch.as_tensor(bits.astype(np.uint8), device=device)
    dist.broadcast(t, src=0)
    return t.cpu().numpy().astype(bool)


def attach(trainer, model, args, train_dataset, tokenizer=None):
    """``--audit_canaries m`` (DPTrainer's ``__init__``, before HF's): draw the m black-box canaries and return the
    training set with the included ones appended; ``trainer._audit`` keeps them (None without the flag)."""
    trainer._audit = None
    m = getattr(args, "audit_canaries", None)
    if not m or not args.dp_enabled:
        return train_dataset
    check_canary_count(m, args.delta)
    config = getattr(model, "config", None)
    num_labels = int(getattr(config, "num_labels", 0) or 0)
    if getattr(trainer.objective, "name", None) != "sequence_classification" or getattr(config, "problem_type", None) in (
            "regression", "multi_label_classification") or num_labels < 2:
        raise ValueError("--audit_canaries supports single-label sequence classifiers (>= 2 labels) only: its black-box "
                         "canaries are random token sequences with random labels")
    if train_dataset is None or not hasattr(train_dataset, "__len__") or not hasattr(train_dataset, "__getitem__"):
        raise ValueError("--audit_canaries needs a sized, map-style train_dataset to append its canaries to")
    if getattr(args, "keep_frozen_features_cache", False):
        raise ValueError("--audit_canaries with --keep_frozen_features_cache: the kept cache of the training set would "
                         "hold the included canaries' features, i.e. the secret draw; drop --keep_frozen_features_cache")
    if type(train_dataset).__name__ == "CachedFeatures":
        raise ValueError("--audit_canaries needs the tokenized training set, not a prebuilt frozen-prefix cache")
    vocab = int(getattr(config, "vocab_size", 0) or 0) or (len(tokenizer) if tokenizer is not None else 0)
    if vocab < 2:
        raise ValueError("--audit_canaries needs the model's vocab_size to draw canary tokens")
    reserved = sum(len(x) for x in _special_tokens(tokenizer)[:2]) if tokenizer is not None else 0
    _check_input_ids(train_dataset)
    # the length is a public constant (capped by the model's positions), never read from the training rows: canaries
    # that depended on the private data would differ between neighbouring datasets in every canary at once
    length = int(getattr(args, "audit_canary_length", CANARY_TOKENS) or CANARY_TOKENS)
    length = max(1, min(length, int(getattr(config, "max_position_embeddings", 512) or 512)) - reserved)
    # the tokens and labels come from a public stream (the same on every rank); the inclusion bits from OS entropy
    content_seed = [int(args.seed) & 0xFFFFFFFF, 0x0A0D17]
    canaries = SequenceCanaries.draw(int(m), num_labels, tokenizer=tokenizer, vocab_size=min(vocab, len(tokenizer))
                                     if tokenizer is not None else vocab, length=length, seed=content_seed)
    canaries._included = _shared_bits(canaries._included, args)
    unit_col = getattr(args, "privacy_unit_column", None)
    state = TrainerCanaries(canaries, len(train_dataset), train_dataset)
    trainer._audit = state
    return canaries.append_to(train_dataset, blank=(unit_col,) if unit_col else ())


def _check_input_ids(train_dataset) -> None:
    """One-sentence refusal unless the training rows have an ``input_ids`` column (the canaries are token sequences)."""
    try:
        train_dataset[0]["input_ids"]
    except (KeyError, TypeError, IndexError):
        raise ValueError("--audit_canaries needs an input_ids column in the training set") from None


def extend_units(trainer, rows: int) -> None:
    """At the end of DPTrainer's ``_setup_units``: the units of the canaries, one each, appended to the real units —
    an included canary's unit is its row, an excluded canary's unit has no row (it is drawn like any unit, and adds
    nothing) —, so that N = real units + m whatever the draw."""
    state = getattr(trainer, "_audit", None)
    if state is None:
        return
    if rows != state.real_rows + state.included_rows:
        raise ValueError("internal: the training set does not hold the real rows and the included canaries")
    real = trainer._unit_rows if trainer._unit_rows is not None else [[i] for i in range(state.real_rows)]
    state.real_units = len(real)
    units, k = list(real), state.real_rows
    for b in state.canaries.included:
        units.append([k] if b else [])
        k += int(b)
    if trainer._unit_of_row is not None:  # unit-level clipping: each included canary row is its own unit
        for j, rows_of in enumerate(units[len(real):], start=len(real)):
            for r in rows_of:
                trainer._unit_of_row[r] = j
    trainer._unit_rows = units
    trainer.num_units = len(units)


def before_train(trainer, resume_from_checkpoint) -> None:
    """Refuse a resume (the draw is not stored: a new process cannot rebuild the training set) and a second train()
    (the bits were dropped after the first audit)."""
    state = getattr(trainer, "_audit", None)
    if state is None:
        return
    if resume_from_checkpoint is not None:
        raise ValueError("--audit_canaries cannot resume from a checkpoint: the canaries' inclusion draw is never "
                         "stored, so the resumed run would train on a different set; start the run again")
    if state.trained:
        raise ValueError("--audit_canaries audits one train() call: the inclusion draw was dropped after the first "
                         "audit; make a new DPTrainer")


def canary_scores(trainer, state: TrainerCanaries) -> np.ndarray:
    """The label margin of every canary under the trained model: the trainer's collator, device, frozen-prefix cache
    and suffix context, through HF's ``evaluation_loop`` on the canaries *without* their labels (no loss, no metric,
    no callback's on_evaluate/on_predict ever sees them)."""
    c = state.canaries
    like = state.like if hasattr(state.like, "column_names") else None
    ds = c.dataset(like=like, labels=False, drop=(getattr(trainer.args, "privacy_unit_column", None),))
    if trainer._prefix_cache:
        ds = trainer.prefix_cache.cache(ds, "canaries")
    loader = trainer.get_test_dataloader(ds)
    with trainer._suffix_ctx(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = trainer.evaluation_loop(loader, description="Canary scoring", prediction_loss_only=False,
                                      metric_key_prefix="canary")
    pred = out.predictions
    logits = np.asarray(pred[0] if isinstance(pred, (tuple, list)) else pred, dtype=np.float64)
    return label_margins(logits[: len(c)], c.labels)


def after_train(trainer) -> dict | None:
    """After DPTrainer's train(): score, guess, count, bound; ``trainer.audit_record`` (privacy.json's ``audit``, the
    card's line); the inclusion bits are then dropped."""
    state = getattr(trainer, "_audit", None)
    if state is None or state.trained:
        return None
    state.trained = True
    try:
        scores = canary_scores(trainer, state)
        beta = float(getattr(trainer, "audit_beta", AUDIT_BETA))  # the command line's --alpha; else 95 %
        bound = audit_scores(scores, state.canaries.included, float(trainer.args.delta), beta)
    finally:
        state.canaries.forget()
    state.bound = bound  # counts and the bound only (no bit)
    rec = record(bound, "black-box", SequenceCanaries.score_name)
    eps = float(trainer.get_epsilon())
    rec.update(
        epsilon=eps, violation=bool(bound.epsilon_lower > eps), ceiling=ceiling(state.m, float(trainer.args.delta), beta),
        real_units=state.real_units, dataset_size_includes_canaries=state.m, accounting=ACCOUNTING,
    )
    rec["summary"] = describe(rec)
    trainer.audit_record = rec
    return rec


def report(trainer) -> dict:
    """``{"audit": record}`` for ``privacy.json`` once the run was audited, else ``{}``."""
    rec = getattr(trainer, "audit_record", None)
    return {"audit": dict(rec)} if rec else {}
