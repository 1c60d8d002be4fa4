"""What both paths of the empirical privacy audit share: the bound, the power check, the result and its table.

:mod:`hf_dp.audit` (the mechanism driven directly, and the command line ``python -m hf_dp.audit``) and
:mod:`hf_dp.audit_trainer` (``--path trainer``: every trial through DPTrainer) produce test statistics on D and D';
this module turns them into ε_lower (:func:`epsilon_lower_bound`: threshold and side chosen on one half of the
trials, one-sided Clopper–Pearson limits on the other, Bonferroni), says what the trials can certify at most
(:func:`certifiable_ceiling`, :func:`low_power`), and holds the default audit hyper-parameters
(:data:`AUDIT_HYPER`), :class:`AuditResult` and :func:`format_table`. The method is described in
:mod:`hf_dp.audit`'s docstring ("The bound", "Power"). It imports nothing of hf_dp.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

#: default audit hyper-parameters (chosen for audit power; see the module docstring)
AUDIT_HYPER: dict[str, dict] = {
    "dp_sgd": dict(lr=1.0),
    "dp_sgd_l2": dict(lr=1.0, weight_decay=0.5),
    "dp_adam": dict(lr=1.0, eps=1e3),
    "dp_adamw": dict(lr=1.0, eps=1e6),
    "dp_adambc": dict(lr=1.0, gamma=1e6),
    "dp_adamw_bc": dict(lr=1.0, gamma=1e6),
    # h1 = h2 = 1 freezes MacAdam's per-coordinate bound at b_t = 1 from t = 2 on (d = 1 per trial);
    # with the default h1 = 1e-12 the refreshed bound collapses to ~1e-6 on this zero-gradient task
    # and the canary's signal in g̃ = b⊙w̃ + m̂ vanishes after step 1 (still a valid, weaker audit)
    "dp_macadam": dict(lr=1.0, eps=1e3, h1=1.0, h2=1.0),
}


# ------------------------------------------------------------------------------------------------
# statistics
# ------------------------------------------------------------------------------------------------
def clopper_pearson_upper(k, n: int, level: float) -> np.ndarray:
    """One-sided Clopper–Pearson upper limit: P(p ≤ upper) ≥ ``level`` for k successes in n trials."""
    from scipy.stats import beta

    k = np.asarray(k, dtype=float)
    with np.errstate(all="ignore"):
        up = beta.ppf(level, k + 1, n - k)
    return np.where(k >= n, 1.0, up)


def epsilon_from_rates(fpr_up, fnr_up, delta: float) -> np.ndarray:
    """max(0, log((1−δ−FNR)/FPR), log((1−δ−FPR)/FNR)) — the ε any (ε,δ)-DP test must respect."""
    fpr_up, fnr_up = np.asarray(fpr_up, dtype=float), np.asarray(fnr_up, dtype=float)
    with np.errstate(all="ignore"):
        e1 = np.where((1 - delta - fnr_up > 0) & (fpr_up > 0), np.log((1 - delta - fnr_up) / fpr_up), 0.0)
        e2 = np.where((1 - delta - fpr_up > 0) & (fnr_up > 0), np.log((1 - delta - fpr_up) / fnr_up), 0.0)
    return np.maximum(0.0, np.maximum(e1, e2))


def _rates(s0: np.ndarray, s1: np.ndarray, taus: np.ndarray):
    """(#D-trials with stat > τ, #D'-trials with stat ≤ τ) for each τ."""
    s0, s1 = np.sort(s0), np.sort(s1)
    fp = len(s0) - np.searchsorted(s0, taus, side="right")
    fn = np.searchsorted(s1, taus, side="right")
    return fp, fn


@dataclass
class BoundResult:
    eps_lower: float
    threshold: float
    side: int  # +1: "canary" iff stat > τ; −1: iff stat < τ
    fpr: float  # on the evaluation half
    tpr: float
    fpr_up: float
    fnr_up: float
    n_eval: tuple[int, int]


def epsilon_lower_bound(
    stats_d: np.ndarray,
    stats_dprime: np.ndarray,
    delta: float,
    alpha: float = 0.05,
    max_thresholds: int = 1024,
) -> BoundResult:
    """ε_lower at confidence 1 − α from test statistics on D (no canary) and D' (canary).

    The first half of each array selects (τ, side), the second half evaluates it (see the module
    docstring); trials are i.i.d., so the halves are independent.
    """
    s0 = np.asarray(stats_d, dtype=float)
    s1 = np.asarray(stats_dprime, dtype=float)
    h0, h1 = len(s0) // 2, len(s1) // 2
    sel0, ev0, sel1, ev1 = s0[:h0], s0[h0:], s1[:h1], s1[h1:]
    level = 1.0 - alpha / 2.0
    best = (-1.0, 0.0, 1)
    for side in (1, -1):
        a, b = side * sel0, side * sel1
        taus = np.unique(np.concatenate([a, b]))
        if len(taus) > max_thresholds:
            taus = np.unique(np.quantile(taus, np.linspace(0, 1, max_thresholds)))
        taus = np.concatenate([[-np.inf], taus])
        fp, fn = _rates(a, b, taus)
        eps = epsilon_from_rates(clopper_pearson_upper(fp, len(a), level), clopper_pearson_upper(fn, len(b), level), delta)
        i = int(np.argmax(eps))
        if eps[i] > best[0]:
            best = (float(eps[i]), float(taus[i]), side)
    _, tau, side = best
    a, b = side * ev0, side * ev1
    fp, fn = _rates(a, b, np.array([tau]))
    fp, fn = int(fp[0]), int(fn[0])
    fpr_up = float(clopper_pearson_upper(fp, len(a), level))
    fnr_up = float(clopper_pearson_upper(fn, len(b), level))
    eps = float(epsilon_from_rates(fpr_up, fnr_up, delta))
    return BoundResult(eps, side * tau, side, fp / len(a), 1 - fn / len(b), fpr_up, fnr_up, (len(a), len(b)))


def certifiable_ceiling(trials, delta: float, alpha: float = 0.05) -> float | np.ndarray:
    """The largest ε_lower ``trials`` trials per side can certify: the bound of a perfectly non-private
    mechanism, i.e. 0 false positives and 0 false negatives on both evaluation halves, through the same
    Clopper–Pearson limits and ε conversion as :func:`epsilon_lower_bound`. A claimed ε at or above it
    can never be refuted by this many trials, whatever the implementation does."""
    n = np.asarray(trials)
    n_eval = n - n // 2
    level = 1.0 - alpha / 2.0
    up = clopper_pearson_upper(np.zeros_like(n_eval, dtype=float), n_eval, level)
    out = epsilon_from_rates(up, up, delta)
    return float(out) if np.ndim(out) == 0 else out


#: the audit is flagged as lacking power when the claimed ε is above ``ceiling − POWER_MARGIN``. A broken
#: variant that is never wrong on D (FPR = 0) but detects the canary only with probability TPR reaches
#: about ``ceiling + log(TPR)``; with this margin it must still have TPR > 1/e to show a violation
#: (with Poisson sampling TPR ≤ 1 − (1 − q)^T: the canary is never drawn in the rest of the runs)
POWER_MARGIN = 1.0


def low_power(eps_claimed: float, trials: int, delta: float, alpha: float = 0.05, margin: float = POWER_MARGIN) -> bool:
    """True when the claimed ε exceeds, or is within ``margin`` of, :func:`certifiable_ceiling`:
    the audit then cannot (or can barely) report a violation, so ``ok`` means little."""
    return bool(eps_claimed > certifiable_ceiling(trials, delta, alpha) - margin)


def power_warning(eps_claimed: float, trials: int, delta: float, alpha: float = 0.05) -> str:
    """The stderr line printed when :func:`low_power` holds."""
    ceiling = certifiable_ceiling(trials, delta, alpha)
    where = "above" if eps_claimed > ceiling else f"within {POWER_MARGIN:g} of"
    return (
        f"warning: the claimed epsilon {eps_claimed:.3f} is {where} the ceiling {ceiling:.3f} that {trials} trials per "
        f"dataset can certify at delta={delta:g}; this audit (almost) cannot report a violation, so 'ok' means little. "
        "Lower the claim (raise --noise_multiplier) or raise --trials (ceiling ~ log(trials/7.4))."
    )


# ------------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------------
@dataclass
class AuditResult:
    config: Any  # hf_dp.audit.AuditConfig or hf_dp.audit_trainer.TrainerAuditConfig
    eps_lower: float
    eps_claimed: float
    bound: BoundResult
    stats_d: np.ndarray
    stats_dprime: np.ndarray
    seconds: float
    info: dict = field(default_factory=dict)  # trainer path: the trainer's steps, sigma, q, reported epsilon, N, B

    @property
    def ceiling(self) -> float:
        """:func:`certifiable_ceiling` for this audit's trials, δ and α."""
        return certifiable_ceiling(self.config.trials, self.config.delta, self.config.alpha)

    @property
    def low_power(self) -> bool:
        """The claimed ε is above (or within :data:`POWER_MARGIN` of) :attr:`ceiling`."""
        return low_power(self.eps_claimed, self.config.trials, self.config.delta, self.config.alpha)

    @property
    def violation(self) -> bool:
        return self.eps_lower > self.eps_claimed

    def row(self) -> dict:
        c, b = self.config, self.bound
        return dict(
            optim=c.optim, variant=c.variant, sigma=c.noise_multiplier, q=c.sample_rate, steps=self.info.get("steps", c.steps),
            trials=c.trials, eps_lower=self.eps_lower, eps_claimed=self.eps_claimed, ceiling=self.ceiling,
            low_power=self.low_power, tpr=b.tpr, fpr=b.fpr, threshold=b.threshold, seconds=self.seconds,
        )


def format_table(results: list[AuditResult]) -> str:
    """One line per result. ``T``: the steps the claim is for (trainer path: all steps in the trainer's
    ledger, over every ``train()`` call); ``ceiling``: :func:`certifiable_ceiling`; ``power``: ``LOW`` when
    the claim is above or within :data:`POWER_MARGIN` of it (then ``ok`` means little), else ``ok``."""
    head = f"{'optimizer':<12} {'variant':<13} {'sigma':>6} {'q':>5} {'T':>3} {'trials':>6} " \
           f"{'eps_lower':>9} {'eps_claim':>9} {'ceiling':>7} {'TPR':>6} {'FPR':>6} {'thresh':>8} {'verdict':<10} {'power':<5} {'sec':>6}"
    lines = [head, "-" * len(head)]
    for r in results:
        c, b = r.config, r.bound
        steps = r.info.get("steps", c.steps)  # trainer path: every step in the trainer's ledger
        verdict = "VIOLATION" if r.violation else "ok"
        power = "LOW" if r.low_power else "ok"
        lines.append(
            f"{c.optim:<12} {c.variant:<13} {c.noise_multiplier:>6.3g} {c.sample_rate:>5.3g} {steps:>3d} {c.trials:>6d} "
            f"{r.eps_lower:>9.3f} {r.eps_claimed:>9.3f} {r.ceiling:>7.3f} {b.tpr:>6.3f} {b.fpr:>6.3f} {b.threshold:>8.3g} "
            f"{verdict:<10} {power:<5} {r.seconds:>6.1f}"
        )
    return "\n".join(lines)
