"""The one-run bound: a privacy audit in one training run (Steinke, Nasr & Jagielski, "Privacy auditing with one (1) training run",
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

The canaries: :mod:`hf_dp.audit.canary_kinds`; what ``--audit_canaries`` does in DPTrainer: :mod:`hf_dp.audit.canaries`;
the Gaussian-DP estimate beside this bound: :mod:`hf_dp.audit.fdp`. It imports nothing of hf_dp.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from hf_dp.audit.stats import power_note

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
            f"{rec['guesses']} inclusion guesses correct"
            + (f"; Gaussian-DP estimate ε ≈ {g['epsilon_estimate']:.2f}, μ ≥ {g['mu_lower_bound']:.2f}"
               if (g := rec.get("gaussian_dp")) else "")
            + f"): {rec['note']}"
            + power_note(rec.get("epsilon"), rec.get("ceiling"), rec["canaries"]))  # the claim within 1 of the ceiling


#: what the canaries cost the README main job, measured (benchmarks/audit.md §5.4); the card quotes it
MEASURED_COST = ("measured on the README main job with 1,000 gradient canaries riding on top of the planned batch: "
                 "QNLI dev accuracy {with_canaries} with canaries vs {without} without (benchmarks/audit.md §5.4)")
MEASURED = {"with_canaries": "68.6 % (one seed)", "without": "68.2 ± 0.9 % (4 seeds)"}


def utility_cost(m: int, real_units: int, q: float, grown: bool = False) -> str:
    """The card's sentence on what m canaries cost in utility: public quantities only (m, the real units, q — an
    expected q·m/2 canary rows per step, whatever the draw), whether the recipe's planner grew the logical batch for
    them (``grown``), and the cost measured on the main job, for reference."""
    return (f"the {m:,} canaries are units of the sampler beside the {real_units:,} real ones: each step draws an "
            f"expected {q * m / 2:.1f} canary rows (half the canaries are in the training set, in expectation) "
            f"beside {q * real_units:.1f} real units, at the same q = {q:.4g}; "
            + ("the recipe's planner grew the logical batch by the canaries' share, so that the real units keep the "
               "planned q and steps; " if grown else "the logical batch was not grown for them, so the real units are "
               "drawn at this q, below B/N_real; ")
            + "for reference, " + MEASURED_COST.format(**MEASURED))
