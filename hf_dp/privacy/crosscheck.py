"""Independent cross-check of hf_dp's ε against Google's ``dp_accounting``.

:mod:`hf_dp.privacy.accounting` gets ε from Opacus (PRV by default, RDP optionally). This
module recomputes ε for the *same* mechanism with a second, independently written library,
Google's ``dp_accounting``:

* **PLD** (privacy loss distributions, Meiser & Mohammadi 2018; Koskela et al.; Doroshenko
  et al. 2022 "Connect the dots"), twice:

  - *pessimistic* (``pessimistic_estimate=True``, connect-the-dots; what ``PLDAccountant``
    does): a certified **upper** bound on the true ε (up to floating point);
  - *optimistic* (``pessimistic_estimate=False``, privacy buckets with every privacy loss
    rounded *down*, Gaussian tails rounded down, composition tails dropped): a certified
    **lower** bound on the true ε. The composition step still adds
    ``tail_mass_truncation`` (1e-15) to the infinity mass even for optimistic PMFs, so we
    read ε off at ``δ + tail_mass_truncation``; this keeps the value a lower bound (if
    δ̂(ε) ≤ δ_true(ε) + t, then ε̂(δ + t) ≤ ε_true(δ)).

  The true ε lies in ``[ε_pld_lower, ε_pld_upper]``. The property that matters for a DP
  training library is "never under-report ε", i.e. ``ε_hf_dp ≥ ε_true`` — which can only be
  *refuted* by a certified lower bound: ``ε_hf_dp < ε_pld_lower`` proves under-reporting.
  ``ε_hf_dp − ε_pld_upper`` measures how much slack hf_dp's bound has.

* **RDP** (``dp_accounting.rdp.RdpAccountant``) on a dense order list. Both it and Opacus'
  RDP accountant are upper bounds from the same RDP→(ε, δ) conversion (Balle et al. 2020 /
  Canonne et al. 2020, Prop. 12); with the *same* orders they must agree to ~1e-6, and with
  our denser orders Google's value can only be lower or equal (up to rounding).

Neighbouring relation. The mechanism (see :mod:`hf_dp.privacy.accounting`) is the Poisson-
subsampled Gaussian under **add/remove-one** adjacency. ``dp_accounting``'s default
``NeighboringRelation`` for both ``PLDAccountant`` and ``RdpAccountant`` is
``ADD_OR_REMOVE_ONE`` (checked in dp_accounting 0.6 ``privacy_accountant.py``); we pass it
explicitly anyway. For q < 1 the PLD under add/remove is *asymmetric*: ``dp_accounting``
keeps two PMFs, one for REMOVE (pair ``((1−q)N(0,σ²)+qN(1,σ²), N(0,σ²))``) and one for ADD
(the reverse pair), and reports the max of the two hockey-stick curves. Opacus' PRV
accountant models only the REMOVE-direction privacy random variable (``t > log(1−q)``
support, Gopi et al. Prop. B1/B4); :func:`pld_epsilon_by_direction` exposes both
directions so that this choice can be checked numerically (the cross-check reports which
direction dominates at every grid point).

Everything here is for checking/reporting only; training never calls it.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
import warnings
from dataclasses import dataclass
from typing import Iterable, Sequence

import numpy as np

from .accounting import calibrate_noise_multiplier, compute_epsilon

# Discretisation of the privacy-loss axis for the *pessimistic* PLD (connect-the-dots). Its
# error does not grow much with the number of steps: 1e-4 is within ~1e-3 of 1e-5 on the
# 32,733-step QNLI point (0.98308 vs 0.98288), whereas 1e-3 over-estimates there by ~0.02.
DEFAULT_PLD_DISCRETIZATION = 1e-4
# The *optimistic* PLD (privacy buckets, losses rounded down) is biased low by up to
# Δ per step, i.e. up to steps·Δ in total privacy loss, so its Δ must shrink like 1/steps to
# stay informative. ``lower_bound_discretization`` picks Δ = clip(budget/steps, floor, 1e-3).
LOWER_BOUND_LOSS_BUDGET = 0.02
LOWER_BOUND_MIN_DISCRETIZATION = 1e-6  # ~60 s for a 32k-step point; the tests use 1e-5
# Mass the FFT self-composition may drop from the PMF's tails (dp_accounting's default).
TAIL_MASS_TRUNCATION = 1e-15

# Dense RDP orders: step 0.01 on (1, 2], 0.05 on (2, 10], 0.25 on (10, 64], powers of 2 beyond.
DENSE_RDP_ORDERS: tuple[float, ...] = tuple(
    sorted(
        set(
            np.round(
                np.concatenate(
                    [
                        np.arange(1.01, 2.0 + 1e-9, 0.01),
                        np.arange(2.05, 10.0 + 1e-9, 0.05),
                        np.arange(10.25, 64.0 + 1e-9, 0.25),
                        [80, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096],
                    ]
                ),
                6,
            ).tolist()
        )
    )
)
# Opacus' RDPAccountant.DEFAULT_ALPHAS (used by hf_dp's "rdp" accountant): with these orders
# Google's RDP must reproduce Opacus' RDP ε to ~1e-6 relative.
OPACUS_RDP_ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))


def lower_bound_discretization(steps: int, floor: float = LOWER_BOUND_MIN_DISCRETIZATION) -> float:
    """Δ for the optimistic PLD: total rounding bias ≤ ``LOWER_BOUND_LOSS_BUDGET`` if possible."""
    return float(min(1e-3, max(floor, LOWER_BOUND_LOSS_BUDGET / max(int(steps), 1))))


@contextlib.contextmanager
def _quiet():
    """Silence dp_accounting's per-order 'failed to converge' warnings and numpy noise."""
    prev = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(prev)


def _dp():
    import dp_accounting  # noqa: F401  (import error → caller sees a clear ModuleNotFoundError)

    return dp_accounting


def _event(noise_multiplier: float, sample_rate: float, steps: int):
    dp = _dp()
    return dp.SelfComposedDpEvent(
        dp.PoissonSampledDpEvent(float(sample_rate), dp.GaussianDpEvent(float(noise_multiplier))), int(steps)
    )


def pld_epsilon_upper(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
) -> float:
    """Pessimistic PLD ε (certified upper bound) via ``dp_accounting.pld.PLDAccountant``."""
    dp = _dp()
    acc = dp.pld.PLDAccountant(
        neighboring_relation=dp.NeighboringRelation.ADD_OR_REMOVE_ONE,
        value_discretization_interval=value_discretization_interval,
    )
    with _quiet():
        acc.compose(_event(noise_multiplier, sample_rate, steps))
        return float(acc.get_epsilon(delta))


def _optimistic_pld(noise_multiplier: float, sample_rate: float, steps: int, value_discretization_interval: float):
    dp = _dp()
    single = dp.pld.privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=float(noise_multiplier),
        sensitivity=1.0,
        pessimistic_estimate=False,
        value_discretization_interval=value_discretization_interval,
        sampling_prob=float(sample_rate),
        use_connect_dots=False,  # connect-the-dots is pessimistic-only
        neighboring_relation=dp.NeighboringRelation.ADD_OR_REMOVE_ONE,
    )
    return single.self_compose(int(steps), tail_mass_truncation=TAIL_MASS_TRUNCATION)


def pld_epsilon_lower(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    value_discretization_interval: float | None = None,
) -> float:
    """Optimistic PLD ε: a certified LOWER bound on the true ε (see module docstring).

    ``value_discretization_interval=None`` → :func:`lower_bound_discretization` (steps).
    """
    if value_discretization_interval is None:
        value_discretization_interval = lower_bound_discretization(steps)
    with _quiet():
        pld = _optimistic_pld(noise_multiplier, sample_rate, steps, value_discretization_interval)
        return float(pld.get_epsilon_for_delta(delta + TAIL_MASS_TRUNCATION))


def pld_epsilon_by_direction(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    pessimistic: bool = True,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
) -> dict[str, float]:
    """ε of the REMOVE and ADD directions separately (the add/remove ε is their max)."""
    dp = _dp()
    with _quiet():
        single = dp.pld.privacy_loss_distribution.from_gaussian_mechanism(
            standard_deviation=float(noise_multiplier),
            pessimistic_estimate=pessimistic,
            value_discretization_interval=value_discretization_interval,
            sampling_prob=float(sample_rate),
            use_connect_dots=pessimistic,
            neighboring_relation=dp.NeighboringRelation.ADD_OR_REMOVE_ONE,
        )
        pld = single.self_compose(int(steps), tail_mass_truncation=TAIL_MASS_TRUNCATION)
    d = delta if pessimistic else delta + TAIL_MASS_TRUNCATION
    remove = float(pld._pmf_remove.get_epsilon_for_delta(d))  # noqa: SLF001 (no public accessor)
    add = remove if pld._symmetric else float(pld._pmf_add.get_epsilon_for_delta(d))  # noqa: SLF001
    return {"remove": remove, "add": add}


def google_rdp_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    orders: Sequence[float] = DENSE_RDP_ORDERS,
) -> float:
    """ε from ``dp_accounting.rdp.RdpAccountant`` (add/remove) on ``orders``."""
    dp = _dp()
    acc = dp.rdp.RdpAccountant(orders=list(orders), neighboring_relation=dp.NeighboringRelation.ADD_OR_REMOVE_ONE)
    with _quiet():
        acc.compose(_event(noise_multiplier, sample_rate, steps))
        return float(acc.get_epsilon(delta))


def google_rdp_per_order(noise_multiplier: float, sample_rate: float, steps: int, orders: Sequence[float]) -> np.ndarray:
    """Google's per-order RDP (``inf`` where its fractional-order series did not converge)."""
    dp = _dp()
    acc = dp.rdp.RdpAccountant(orders=list(orders), neighboring_relation=dp.NeighboringRelation.ADD_OR_REMOVE_ONE)
    with _quiet():
        acc.compose(_event(noise_multiplier, sample_rate, steps))
    return np.asarray(acc._rdp, dtype=float)  # noqa: SLF001 (no public accessor)


def opacus_rdp_per_order(noise_multiplier: float, sample_rate: float, steps: int, orders: Sequence[float]) -> np.ndarray:
    """Opacus' per-order RDP (what hf_dp's ``rdp`` accountant minimises over)."""
    from opacus.accountants.analysis.rdp import compute_rdp

    with _quiet():
        return np.asarray(
            compute_rdp(q=sample_rate, noise_multiplier=noise_multiplier, steps=steps, orders=list(orders)), dtype=float
        )


def rdp_by_quadrature(noise_multiplier: float, sample_rate: float, steps: int, order: float) -> float:
    """Per-order RDP of the Poisson-subsampled Gaussian by direct numerical integration.

    steps · log(A_α)/(α−1) with A_α = E_{z~N(0,σ²)}[(1 − q + q·exp((2z − 1)/(2σ²)))^α]
    (Mironov, Talwar & Zhang 2019, the quantity both libraries' series evaluate). Independent
    of either library's series; used to referee orders where they disagree or Google gives up.
    """
    from scipy import integrate, stats

    s, q, a = float(noise_multiplier), float(sample_rate), float(order)

    def log_integrand(z):
        ratio = np.log1p(q * np.expm1((2 * z - 1) / (2 * s * s))) if q < 1 else (2 * z - 1) / (2 * s * s)
        return a * ratio + stats.norm.logpdf(z, scale=s)

    # The integrand is log-concave-ish and peaks near z* = α/… ; normalise by its maximum.
    zs = np.linspace(-40 * s, 40 * s + 2 * a, 20001)
    lmax = float(np.max(log_integrand(zs)))
    zpk = float(zs[np.argmax(log_integrand(zs))])
    val, _ = integrate.quad(
        lambda z: math.exp(log_integrand(z) - lmax), -40 * s, 40 * s + 2 * a, points=[zpk], limit=500, epsabs=0, epsrel=1e-10
    )
    return steps * (math.log(val) + lmax) / (a - 1)


# --------------------------------------------------------------------------------------------
# Grid


@dataclass(frozen=True)
class GridPoint:
    setting: str
    sample_rate: float
    noise_multiplier: float | None  # None → calibrate with hf_dp (PRV) to target_epsilon
    steps: int
    delta: float
    target_epsilon: float | None = None

    def resolved_sigma(self) -> float:
        if self.noise_multiplier is not None:
            return float(self.noise_multiplier)
        return calibrate_noise_multiplier(self.target_epsilon, self.delta, self.sample_rate, self.steps, "prv")


def steps_for(dataset_size: int, batch_size: int, epochs: float) -> int:
    """Planned steps for ``epochs`` passes with expected logical batch B: ⌈epochs·N/B⌉."""
    return int(math.ceil(epochs * dataset_size / batch_size))


QNLI_N = 104_743
SST2_N = 67_349
QNLI_LOCAL_N = 9_000


def _grid() -> list[GridPoint]:
    g: list[GridPoint] = []
    # seed-000 protocol: bert on QNLI, B=32, 10 epochs, δ=1e-5, σ calibrated (hf_dp PRV) to ε.
    q0, s0 = 32 / QNLI_N, steps_for(QNLI_N, 32, 10)
    for eps in (1.0, 3.0, 7.0):
        g.append(GridPoint(f"QNLI B=32 10ep, ε*={eps:g} (seed-000)", q0, None, s0, 1e-5, eps))
    # seed-004: QNLI B=256, σ=0.4 (full train 3 and 10 epochs; local 9k subset 3 and 10 epochs).
    q4 = 256 / QNLI_N
    g.append(GridPoint("QNLI B=256 σ=0.4 3ep (seed-004)", q4, 0.4, steps_for(QNLI_N, 256, 3), 1e-5))
    g.append(GridPoint("QNLI B=256 σ=0.4 10ep (seed-004)", q4, 0.4, steps_for(QNLI_N, 256, 10), 1e-5))
    q9 = 256 / QNLI_LOCAL_N
    g.append(GridPoint("QNLI-9k B=256 σ=0.4 3ep (seed-004 local)", q9, 0.4, steps_for(QNLI_LOCAL_N, 256, 3), 1e-5))
    g.append(GridPoint("QNLI-9k B=256 σ=0.4 10ep (seed-004 local)", q9, 0.4, steps_for(QNLI_LOCAL_N, 256, 10), 1e-5))
    # SST-2, B=256, σ≈0.62, 3 epochs.
    g.append(GridPoint("SST-2 B=256 σ=0.62 3ep", 256 / SST2_N, 0.62, steps_for(SST2_N, 256, 3), 1e-5))
    # small q, many steps
    g.append(GridPoint("small q, many steps", 1e-4, 0.8, 100_000, 1e-6))
    g.append(GridPoint("small q, many steps", 5e-4, 1.0, 50_000, 1e-5))
    g.append(GridPoint("small q, σ=0.5", 1e-3, 0.5, 5_000, 1e-5))
    # large q
    g.append(GridPoint("large q", 0.1, 1.0, 100, 1e-5))
    g.append(GridPoint("large q", 0.1, 2.0, 1_000, 1e-6))
    g.append(GridPoint("large q", 0.5, 3.0, 100, 1e-5))
    g.append(GridPoint("full batch", 1.0, 5.0, 100, 1e-5))
    g.append(GridPoint("full batch", 1.0, 2.0, 10, 1e-8))
    # few steps
    g.append(GridPoint("single step", 1.0, 1.0, 1, 1e-5))
    g.append(GridPoint("single step", 0.01, 0.5, 1, 1e-5))
    g.append(GridPoint("10 steps", 0.01, 1.0, 10, 1e-6))
    g.append(GridPoint("10 steps", 0.3, 5.0, 10, 1e-8))
    # δ sweep at a fixed mechanism
    for d in (1e-8, 1e-7, 1e-6):
        g.append(GridPoint(f"δ sweep", 0.01, 1.1, 3_000, d))
    return g


DEFAULT_GRID: tuple[GridPoint, ...] = tuple(_grid())

# A fast subset (≥ 8 points; each well under a second or two) used by the test-suite.
FAST_GRID: tuple[GridPoint, ...] = (
    GridPoint("QNLI-9k B=256 σ=0.4 3ep (seed-004 local)", 256 / QNLI_LOCAL_N, 0.4, steps_for(QNLI_LOCAL_N, 256, 3), 1e-5),
    GridPoint("SST-2 B=256 σ=0.62 3ep", 256 / SST2_N, 0.62, steps_for(SST2_N, 256, 3), 1e-5),
    GridPoint("QNLI B=256 σ=0.4 3ep (seed-004)", 256 / QNLI_N, 0.4, steps_for(QNLI_N, 256, 3), 1e-5),
    GridPoint("large q", 0.1, 1.0, 100, 1e-5),
    GridPoint("large q", 0.5, 3.0, 100, 1e-5),
    GridPoint("full batch", 1.0, 2.0, 10, 1e-8),
    GridPoint("single step", 1.0, 1.0, 1, 1e-5),
    GridPoint("single step", 0.01, 0.5, 1, 1e-5),
    GridPoint("10 steps", 0.01, 1.0, 10, 1e-6),
    GridPoint("δ sweep", 0.01, 1.1, 3_000, 1e-8),
)


def _as_point(p) -> GridPoint:
    if isinstance(p, GridPoint):
        return p
    if isinstance(p, dict):
        return GridPoint(
            setting=p.get("setting", ""),
            sample_rate=p["q"] if "q" in p else p["sample_rate"],
            noise_multiplier=p.get("sigma", p.get("noise_multiplier")),
            steps=p["steps"],
            delta=p["delta"],
            target_epsilon=p.get("target_epsilon"),
        )
    q, sigma, steps, delta = p  # (q, σ, steps, δ)
    return GridPoint("", q, sigma, steps, delta)


def crosscheck_point(
    point,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    with_directions: bool = True,
    lower_discretization_floor: float = LOWER_BOUND_MIN_DISCRETIZATION,
) -> dict:
    """All ε values for one (q, σ, steps, δ) point, plus gaps and timings.

    ``value_discretization_interval`` is used for the pessimistic PLD; the optimistic (lower
    bound) PLD uses :func:`lower_bound_discretization` (steps, ``lower_discretization_floor``).
    """
    p = _as_point(point)
    t0 = time.perf_counter()
    sigma = p.resolved_sigma()
    q, steps, delta = p.sample_rate, p.steps, p.delta
    t1 = time.perf_counter()
    with _quiet():
        eps_prv = compute_epsilon(sigma, q, steps, delta, "prv")
        t2 = time.perf_counter()
        eps_rdp = compute_epsilon(sigma, q, steps, delta, "rdp")
    t3 = time.perf_counter()
    lower_dx = lower_bound_discretization(steps, lower_discretization_floor)
    eps_lo = pld_epsilon_lower(sigma, q, steps, delta, lower_dx)
    t4 = time.perf_counter()
    eps_hi = pld_epsilon_upper(sigma, q, steps, delta, value_discretization_interval)
    t5 = time.perf_counter()
    eps_grdp = google_rdp_epsilon(sigma, q, steps, delta)
    g_orders = google_rdp_per_order(sigma, q, steps, OPACUS_RDP_ORDERS)
    o_orders = opacus_rdp_per_order(sigma, q, steps, OPACUS_RDP_ORDERS)
    finite = np.isfinite(g_orders)
    rel = np.abs(g_orders[finite] - o_orders[finite]) / np.maximum(np.abs(o_orders[finite]), 1e-300)
    t6 = time.perf_counter()
    row = {
        "setting": p.setting,
        "q": q,
        "sigma": sigma,
        "steps": steps,
        "delta": delta,
        "target_epsilon": p.target_epsilon,
        "eps_hf_dp_prv": eps_prv,
        "eps_hf_dp_rdp": eps_rdp,
        "eps_pld_lower": eps_lo,
        "eps_pld_upper": eps_hi,
        "eps_google_rdp": eps_grdp,
        # > 0 ⇔ hf_dp reports more than the certified upper bound (slack, safe);
        "gap_prv_minus_pld_upper": eps_prv - eps_hi,
        # < 0 beyond tolerance ⇔ hf_dp provably under-reports ε (must never happen).
        "gap_prv_minus_pld_lower": eps_prv - eps_lo,
        "gap_rdp_minus_google_rdp": eps_rdp - eps_grdp,
        # per-order RDP, Opacus vs Google on Opacus' orders
        "rdp_orders_google_dropped": [float(a) for a, f in zip(OPACUS_RDP_ORDERS, finite) if not f],
        "rdp_per_order_max_rel_diff": float(rel.max()) if rel.size else float("nan"),
        "pld_discretization_upper": value_discretization_interval,
        "pld_discretization_lower": lower_dx,
        "seconds": {
            "calibrate": t1 - t0,
            "prv": t2 - t1,
            "rdp": t3 - t2,
            "pld_lower": t4 - t3,
            "pld_upper": t5 - t4,
            "google_rdp": t6 - t5,
        },
    }
    if with_directions and q < 1.0:
        row["pld_upper_by_direction"] = pld_epsilon_by_direction(sigma, q, steps, delta, True, value_discretization_interval)
    return row


def crosscheck_grid(
    grid: Iterable | None = None,
    value_discretization_interval: float = DEFAULT_PLD_DISCRETIZATION,
    with_directions: bool = True,
    lower_discretization_floor: float = LOWER_BOUND_MIN_DISCRETIZATION,
) -> list[dict]:
    """Cross-check every point of ``grid`` (default: :data:`DEFAULT_GRID`).

    A point is a :class:`GridPoint`, a dict with keys ``q``/``sigma``/``steps``/``delta``
    (optionally ``setting``, ``target_epsilon`` with ``sigma=None``) or a tuple
    ``(q, σ, steps, δ)``. Returns one dict per point with keys ``eps_hf_dp_prv``,
    ``eps_hf_dp_rdp``, ``eps_pld_lower`` (optimistic), ``eps_pld_upper`` (pessimistic),
    ``eps_google_rdp`` and the gaps.
    """
    grid = DEFAULT_GRID if grid is None else grid
    return [
        crosscheck_point(p, value_discretization_interval, with_directions, lower_discretization_floor) for p in grid
    ]


def prv_tolerance(eps_pld_lower: float) -> float:
    """Allowed shortfall of hf_dp's PRV ε below the certified PLD lower bound.

    A shortfall beyond this is a real under-report. Budget: 1% relative (covers the FFT's
    floating-point error and the PLD lower bound's own slight optimism being exactly at the
    true value) + 2e-3 absolute. Opacus' PRV already adds its own ``eps_error=0.01`` to the
    estimate, so a correct PRV ε sits ≥ ~0.01 *above* the true ε; this tolerance therefore
    only bites if something is wrong by more than ~1%.
    """
    return 0.01 * eps_pld_lower + 2e-3


def format_markdown(rows: Sequence[dict]) -> str:
    head = (
        "| setting | q | σ | steps | δ | ε hf_dp PRV | ε hf_dp RDP | ε PLD lower (optimistic) "
        "| ε PLD upper (pessimistic) | ε Google RDP | gap PRV−PLD_upper | dominant dir. |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    lines = []
    for r in rows:
        dirs = r.get("pld_upper_by_direction")
        if dirs is None:
            dom = "sym."
        else:
            dom = "remove" if dirs["remove"] >= dirs["add"] else f"**add** (+{dirs['add'] - dirs['remove']:.3g})"
        lines.append(
            f"| {r['setting']} | {r['q']:.4g} | {r['sigma']:.4g} | {r['steps']} | {r['delta']:.0e} "
            f"| {r['eps_hf_dp_prv']:.4f} | {r['eps_hf_dp_rdp']:.4f} | {r['eps_pld_lower']:.4f} "
            f"| {r['eps_pld_upper']:.4f} | {r['eps_google_rdp']:.4f} | {r['gap_prv_minus_pld_upper']:+.4f} | {dom} |"
        )
    return head + "\n".join(lines) + "\n"
