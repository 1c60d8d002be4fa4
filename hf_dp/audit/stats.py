"""What both paths of the empirical privacy audit share: the bound, the power check, the result and its table.

:mod:`hf_dp.audit.many_runs` (the mechanism driven directly, and the command line ``python -m hf_dp.audit``) and
:mod:`hf_dp.audit.trainer_path` (``--path trainer``: every trial through DPTrainer) produce test statistics on D and D';
this module turns them into ε_lower (:func:`epsilon_lower_bound`: the test — one tail or both tails pooled, its
thresholds — chosen on 20 % of the trials, one-sided Clopper–Pearson limits on the rest, Bonferroni), says what the
trials can certify at most
(:func:`certifiable_ceiling`, :func:`low_power`), and holds the default audit hyper-parameters
(:data:`AUDIT_HYPER`), :class:`AuditResult` and :func:`format_table`. The method is described in
:mod:`hf_dp.audit.many_runs`'s docstring ("The bound", "Power"). It imports nothing of hf_dp.
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


def clopper_pearson_lower(k, n: int, level: float) -> np.ndarray:
    """One-sided Clopper–Pearson lower limit: P(p ≥ lower) ≥ ``level`` for k successes in n trials."""
    return 1.0 - clopper_pearson_upper(n - np.asarray(k, dtype=float), n, level)


def epsilon_from_counts(heavy, n_heavy: int, light, n_light: int, delta: float, alpha: float = 0.05) -> np.ndarray:
    """max(0, log((H_low − δ)/L_up)): ``heavy`` events where (ε, δ)-DP allows at most e^ε × the ``light`` rate + δ,
    H_low / L_up the one-sided Clopper–Pearson limits at 1 − α/2 each (Bonferroni: both hold with ≥ 1 − α)."""
    level = 1.0 - alpha / 2.0
    h = clopper_pearson_lower(heavy, n_heavy, level) - delta
    u = clopper_pearson_upper(light, n_light, level)
    with np.errstate(all="ignore"):
        out = np.where((h > 0) & (u > 0), np.log(np.maximum(h, 1e-300) / np.maximum(u, 1e-300)), 0.0)
    return np.maximum(0.0, out)


#: the share of the trials (of each dataset) that chooses the test; the rest evaluates it (see :func:`epsilon_lower_bound`)
SELECT_FRACTION = 0.2
#: the tests :func:`epsilon_lower_bound` chooses from
TESTS = ("upper", "lower", "pooled")


@dataclass
class BoundResult:
    eps_lower: float
    threshold: float  # τ: the upper event is {stat > τ} (side +1) or {stat < τ} (side −1); the lower test's τ_l
    side: int  # +1: the canary pushes the statistic up (D' is heavy above τ); −1: down
    fpr: float  # on the evaluation part: P_D(canary side of threshold)
    tpr: float  # P_D'(canary side of threshold)
    heavy: float  # on the evaluation part: the rate of the heavy events, H / n_H
    light: float  # L / n_L
    heavy_low: float  # the Clopper–Pearson limits the bound uses
    light_up: float
    n_eval: tuple[int, int]
    test: str = "upper"  # "upper", "lower" or "pooled" (see epsilon_lower_bound)
    threshold_low: float | None = None  # τ_l of the pooled test's lower event


def _upper_counts(a: np.ndarray, b: np.ndarray, taus: np.ndarray):
    """Upper events {x > τ}: (#D' in it = heavy, #D in it = light) for each τ; ``a`` D, ``b`` D' (sorted)."""
    return len(b) - np.searchsorted(b, taus, side="right"), len(a) - np.searchsorted(a, taus, side="right")


def _lower_counts(a: np.ndarray, b: np.ndarray, taus: np.ndarray):
    """Lower events {x ≤ τ}: (#D in it = heavy, #D' in it = light) for each τ."""
    return np.searchsorted(a, taus, side="right"), np.searchsorted(b, taus, side="right")


def _grid(a: np.ndarray, b: np.ndarray, size: int) -> np.ndarray:
    taus = np.unique(np.concatenate([a, b]))
    if len(taus) > size:
        taus = np.unique(np.quantile(taus, np.linspace(0, 1, size)))
    return np.concatenate([[-np.inf], taus])


def _score(heavy, n_heavy, light, n_light, delta, alpha):
    """The selection criterion: the bound the counts give, ties (notably at 0, with few selection trials) broken by
    the separation of the rates, heavy/n_H − light/n_L (so that a handful of trials still picks a separating test)."""
    sep = np.asarray(heavy) / n_heavy - np.asarray(light) / n_light
    return epsilon_from_counts(heavy, n_heavy, light, n_light, delta, alpha) + 1e-6 * sep


def _choose(a, b, delta, alpha, max_thresholds, pooled_ok):
    """The best test on the selection part: (criterion, side, kind, τ, τ_l)."""
    best = (-np.inf, 1, "upper", -np.inf, None)
    n0, n1 = len(a), len(b)
    for side in (1, -1):
        x0, x1 = np.sort(side * a), np.sort(side * b)
        taus = _grid(x0, x1, max_thresholds)
        hu, lu = _upper_counts(x0, x1, taus)
        eu = _score(hu, n1, lu, n0, delta, alpha)
        hl, ll = _lower_counts(x0, x1, taus)
        el = _score(hl, n0, ll, n1, delta, alpha)
        i, j = int(np.argmax(eu)), int(np.argmax(el))
        for e, kind, tau in ((eu[i], "upper", taus[i]), (el[j], "lower", taus[j])):
            if e > best[0]:
                best = (float(e), side, kind, float(tau), None)
        if pooled_ok:
            g = _grid(x0, x1, 256)
            hu, lu = _upper_counts(x0, x1, g)
            hl, ll = _lower_counts(x0, x1, g)
            ep = _score(hu[:, None] + hl[None, :], n0 + n1, lu[:, None] + ll[None, :], n0 + n1, delta, alpha)
            ep = np.where(g[None, :] <= g[:, None], ep, -np.inf)  # τ_l ≤ τ (disjoint events; rows: τ, columns: τ_l)
            k = np.unravel_index(int(np.argmax(ep)), ep.shape)
            if ep[k] >= best[0]:  # a tie: the pooled test has twice the trials
                best = (float(ep[k]), side, "pooled", float(g[k[0]]), float(g[k[1]]))
    return best


def epsilon_lower_bound(
    stats_d: np.ndarray,
    stats_dprime: np.ndarray,
    delta: float,
    alpha: float = 0.05,
    max_thresholds: int = 1024,
    select_fraction: float = SELECT_FRACTION,
    pooled: bool = True,
) -> BoundResult:
    """ε_lower at confidence 1 − α from test statistics on D (no canary) and D' (canary).

    The first ``select_fraction`` of each array chooses the test, the rest evaluates it; trials are i.i.d., so the
    two parts are independent. The tests (for the canary pushing the statistic up, ``side`` +1, or down, −1):

    * ``upper``: the event {stat > τ}; (ε, δ)-DP allows P_D'(·) ≤ e^ε P_D(·) + δ;
    * ``lower``: {stat ≤ τ}, with the roles of D and D' exchanged (add/remove DP holds in both directions);
    * ``pooled`` (equal trial counts): both at once, {stat > τ} for D' and {stat ≤ τ_l} for D as the *heavy* events
      H, the same events for D and D' as the light events L (2n Bernoulli trials each). Adding the two constraints,
      E[H] ≤ e^ε E[L] + 2nδ; H and L are sums of independent Bernoullis with unequal rates, for which the
      Clopper–Pearson limits of a binomial stay valid (Hoeffding 1956: a Poisson-binomial count is more concentrated
      than the binomial of the same mean outside ±1 of it, and the 97.5 % limits are far outside). For a symmetric
      statistic (a Gaussian shift: q = 1, T = 1) this doubles the evaluation trials.

    ε_lower = max(0, log((H_low − δ)/L_up)), H_low and L_up one-sided Clopper–Pearson limits at 1 − α/2 each.
    """
    s0 = np.asarray(stats_d, dtype=float)
    s1 = np.asarray(stats_dprime, dtype=float)
    if not 0 < select_fraction < 1:
        raise ValueError(f"select_fraction must be in (0, 1), got {select_fraction}")
    h0, h1 = max(1, int(len(s0) * select_fraction)), max(1, int(len(s1) * select_fraction))
    if min(len(s0) - h0, len(s1) - h1) < 1:
        raise ValueError("the audit needs at least two trials per dataset")
    sel0, ev0, sel1, ev1 = s0[:h0], s0[h0:], s1[:h1], s1[h1:]
    pooled_ok = pooled and len(ev0) == len(ev1) and len(sel0) == len(sel1)
    _, side, kind, tau, tau_l = _choose(sel0, sel1, delta, alpha, max_thresholds, pooled_ok)
    x0, x1 = side * ev0, side * ev1
    n0, n1 = len(x0), len(x1)
    up_h, up_l = int((x1 > tau).sum()), int((x0 > tau).sum())  # D' and D above τ
    if kind == "upper":
        heavy, nh, light, nl = up_h, n1, up_l, n0
    elif kind == "lower":
        heavy, nh, light, nl = int((x0 <= tau).sum()), n0, int((x1 <= tau).sum()), n1
    else:
        heavy, light = up_h + int((x0 <= tau_l).sum()), up_l + int((x1 <= tau_l).sum())
        nh = nl = n0 + n1
    level = 1.0 - alpha / 2.0
    eps = float(epsilon_from_counts(heavy, nh, light, nl, delta, alpha))
    return BoundResult(
        eps, side * tau, side, up_l / n0, up_h / n1, heavy / nh, light / nl,
        float(clopper_pearson_lower(heavy, nh, level)), float(clopper_pearson_upper(light, nl, level)), (n0, n1),
        kind, None if tau_l is None else side * tau_l,
    )


def certifiable_ceiling(trials, delta: float, alpha: float = 0.05, select_fraction: float = SELECT_FRACTION) -> float | np.ndarray:
    """The largest ε_lower ``trials`` trials per side can certify: the bound of a perfectly non-private
    mechanism — every evaluation trial on the right side of the pooled test (H = 2n, L = 0, n the evaluation trials
    per dataset) — through the same Clopper–Pearson limits and ε conversion as :func:`epsilon_lower_bound`. A claimed ε
    at or above it can never be refuted by this many trials, whatever the implementation does."""
    n = np.asarray(trials)
    n_eval = n - np.maximum(1, (n * select_fraction).astype(int))
    out = epsilon_from_counts(2 * n_eval, 2 * n_eval, np.zeros_like(n_eval), 2 * n_eval, delta, alpha)
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


def power_note(eps_claimed: float | None, ceiling: float | None, canaries: int) -> str:
    """What a one-run audit's card line and the recipes' summary add when the claim is above, or within
    :data:`POWER_MARGIN` of, the ceiling ``canaries`` can certify (the rule of :func:`low_power`); else ``""``."""
    if eps_claimed is None or ceiling is None or not eps_claimed > ceiling - POWER_MARGIN:
        return ""
    where = "above" if eps_claimed > ceiling else f"within {POWER_MARGIN:g} of"
    return (f". LOW POWER: the claimed ε {eps_claimed:.2f} is {where} the ceiling {ceiling:.2f} that {canaries} canaries "
            "can certify at all, so this audit can (almost) never show a violation and its result says little; "
            "more canaries (--audit_canaries) or a smaller ε raise its power")


def power_warning(eps_claimed: float, trials: int, delta: float, alpha: float = 0.05) -> str:
    """The stderr line printed when :func:`low_power` holds."""
    ceiling = certifiable_ceiling(trials, delta, alpha)
    where = "above" if eps_claimed > ceiling else f"within {POWER_MARGIN:g} of"
    return (
        f"warning: the claimed epsilon {eps_claimed:.3f} is {where} the ceiling {ceiling:.3f} that {trials} trials per "
        f"dataset can certify at delta={delta:g}; this audit (almost) cannot report a violation, so 'ok' means little. "
        "Lower the claim (raise --noise_multiplier) or raise --trials (ceiling ~ log(trials/2.3))."
    )


def parse_hyper(items: list[str]) -> dict:
    """``--hyper k=v`` (repeatable) as a dict of numbers (a comma list: a tuple); ``SystemExit`` with one sentence
    otherwise (the command lines of :mod:`hf_dp.audit.many_runs` and :mod:`hf_dp.audit.one_run`)."""
    out = {}
    for it in items or []:
        k, _, v = it.partition("=")
        if not _:
            raise SystemExit(f"error: --hyper expects key=value, got {it!r}")
        try:
            out[k] = tuple(float(x) for x in v.split(",")) if "," in v else float(v)
        except ValueError:
            raise SystemExit(f"error: --hyper {k}: not a number: {v!r}") from None
    return out


# ------------------------------------------------------------------------------------------------
# results
# ------------------------------------------------------------------------------------------------
@dataclass
class AuditResult:
    config: Any  # hf_dp.audit.many_runs.AuditConfig or hf_dp.audit.trainer_path.TrainerAuditConfig
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
    ledger, over every ``train()`` call), ``T/bB`` for the B-banded mechanism (``noise_bands``); ``ceiling``: :func:`certifiable_ceiling`; ``power``: ``LOW`` when
    the claim is above or within :data:`POWER_MARGIN` of it (then ``ok`` means little), else ``ok``."""
    head = f"{'optimizer':<12} {'variant':<17} {'sigma':>6} {'q':>5} {'T':>3} {'trials':>6} " \
           f"{'eps_lower':>9} {'eps_claim':>9} {'ceiling':>7} {'TPR':>6} {'FPR':>6} {'thresh':>8} {'verdict':<10} {'power':<5} {'sec':>6}"
    lines = [head, "-" * len(head)]
    for r in results:
        c, b = r.config, r.bound
        steps = r.info.get("steps", c.steps)  # trainer path: every step in the trainer's ledger
        bands = getattr(c, "noise_bands", 1)
        steps = f"{steps}/b{bands}" if bands > 1 else str(steps)  # one field: the columns split on whitespace
        verdict = "VIOLATION" if r.violation else "ok"
        power = "LOW" if r.low_power else "ok"
        lines.append(
            f"{c.optim:<12} {c.variant:<17} {c.noise_multiplier:>6.3g} {c.sample_rate:>5.3g} {steps:>3} {c.trials:>6d} "
            f"{r.eps_lower:>9.3f} {r.eps_claimed:>9.3f} {r.ceiling:>7.3f} {b.tpr:>6.3f} {b.fpr:>6.3f} {b.threshold:>8.3g} "
            f"{verdict:<10} {power:<5} {r.seconds:>6.1f}"
        )
    return "\n".join(lines)
