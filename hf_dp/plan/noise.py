"""Would correlated noise help this plan? ``python -m hf_dp.plan ... --noise_comparison`` (issue 52 item 5).

No training and no data: for a plan (N, B, T, ε, δ, accountant) and each number of bands b, the σ that the accountant
calibrates for ``--noise_mechanism banded_sqrt --noise_bands b`` (DP-SGD at rate min(1, b·q) for ⌈T/b⌉ rounds, with
cyclic Poisson sampling: :func:`hf_dp.privacy.banded.dp_sgd_equivalent`) and the noise the training loop then sees,
σ·Clip·s·w with w = M⁻¹z (:mod:`hf_dp.privacy.banded`: M the BSR factor, s its column norm). Three figures of that
noise, each relative to independent noise (b = 1) at its own σ:

* ``prefix_ratio``: the root-mean-square, over the steps t, of the std of the noise in the running sum of the updates up
  to t (the noise in SGD's iterate: the workload banded square roots are built for);
* ``momentum_ratio``: the same for heavy-ball momentum :data:`MOMENTUM` (each update's noise enters the iterate k steps
  later with weight (1 − β^(k+1))/(1 − β)), closer to what Adam-type rules accumulate;
* ``marginal_ratio``: one step's own noise std (σ·s·√V_n at the last step, what DP-AdamBC's Φ reads), which *grows*
  with b.

A ratio below 1 is less noise in the trajectory at the same ε. These are predictions of noise, not of accuracy: what a
lower momentum ratio buys in accuracy is measured by training, and no measured plan turned it into accuracy
(benchmarks/RESULTS.md §13: SST-2's full set at 1 epoch, b = 8, ratio 0.661, 3 seeds, no gain; at 10 epochs, ratio
0.85, 1.6 points lost). Under the Adam-type rules the recipes use, one step's own noise (the marginal ratio, 2–3 × at
those b) is what the update divides by. So :func:`noise_verdict` says independent at every plan; below
:data:`BANDED_MOMENTUM_THRESHOLD` (0.66: beyond the lowest ratio measured) it names banded noise as an experiment to
run, not a recommendation. Each b costs one σ calibration (memoised as the planner's
are, :func:`hf_dp.plan.plans.noise_multiplier`; on disk with ``disk_cache``). ``benchmarks/correlated_noise_gain.py``
prints the same table for the recipes' presets. The start-of-run block's line on the noise mechanism, which calibrates
nothing, is :mod:`hf_dp.plan.noise_line`.
"""

from __future__ import annotations

import numpy as np

from hf_dp.plan.plans import noise_multiplier
from hf_dp.privacy.accounting import dp_sgd_equivalent
from hf_dp.privacy.banded import column_norm, inverse_impulse, marginal_std_factor

#: the numbers of bands compared (b = 1, independent noise, is the reference; b with b·q > 1 are left out)
BANDS = (1, 2, 3, 4, 6, 8, 12, 16)
#: β of the heavy-ball momentum workload
MOMENTUM = 0.9
#: the lowest momentum ratio at which banded noise was trained (benchmarks/RESULTS.md §13: SST-2's full set, 1 epoch,
#: b = 8: 81.5 / 80.2 / 80.7 % against independent noise's 81.2 / 80.5 / 80.7 %); it bought no accuracy there or above
MEASURED_LOWEST_RATIO = 0.661
#: below this best momentum ratio a plan is beyond the measured range: the verdict names banded noise as an experiment
BANDED_MOMENTUM_THRESHOLD = 0.66
#: where the accuracy the noise reduction buys is measured
ACCURACY_REFERENCE = "benchmarks/RESULTS.md §13"


def workload_rmse(bands: int, steps: int, beta: float = 0.0) -> float:
    """The RMS over the steps t of the std of Σ_{j≤t} a_{t−j}·w_j, w = M⁻¹z with z i.i.d. N(0, 1) (unit σ, unit s):
    the noise of the iterate after step t for the workload a_k = 1 (``beta`` = 0: the prefix sum, SGD) or
    a_k = (1 − β^(k+1))/(1 − β) (heavy-ball momentum β). Multiply by σ·s for the mechanism's noise (in units of Clip)."""
    steps = int(steps)
    d = np.asarray(inverse_impulse(bands, steps - 1), dtype=np.float64)
    k = np.arange(steps)
    a = np.ones(steps) if beta == 0 else (1 - beta ** (k + 1)) / (1 - beta)
    # the noise of iterate t: Σ_i z_i · Σ_{j=i}^{t} a_{t−j} d_{j−i} (a Toeplitz product: h = a * d, truncated)
    h = np.convolve(a, d)[:steps]
    # iterate t (from 0) sees h_0..h_t: its variance is Σ_{m≤t} h_m², the running sum
    var = np.cumsum(h * h)
    return float(np.sqrt(var.mean()))


def noise_comparison(n: int, batch: int, steps: int, epsilon: float, delta: float, accountant: str = "prv",
                     bands=BANDS, *, disk_cache: bool = False, progress=None) -> list[dict]:
    """One row per b of ``bands`` (b = 1 always first; the b with b·q > 1, q = ``batch``/``n``, left out: cyclic
    Poisson sampling could not draw at rate b·q): ``bands``, ``sigma`` (calibrated for the b-banded mechanism at target
    ε, exactly :func:`~hf_dp.privacy.accounting.calibrate_noise_multiplier` with ``bands=b``), ``column_norm`` (s),
    and ``prefix_ratio``, ``momentum_ratio``, ``marginal_ratio`` (relative to b = 1, whose ratios are 1; see the module
    docstring), with the plan (``n``, ``batch``, ``steps``, ``delta``, ``epsilon``). ``disk_cache``: read and write σ
    in the planner's cache (:data:`hf_dp.plan.plans.CACHE_ENV`). ``progress(row)``, if given, after each row."""
    n, batch, steps = int(n), int(batch), int(steps)
    if not 0 < batch <= n or steps <= 0:
        raise ValueError(f"the noise comparison needs 0 < B <= N and T > 0, got N = {n}, B = {batch}, T = {steps}")
    q = batch / n
    out, base = [], None
    for b in sorted({1, *(int(b) for b in bands)}):
        if b < 1 or b * q > 1:
            continue
        rate, rounds = dp_sgd_equivalent(q, steps, b)
        sigma = noise_multiplier(epsilon, delta, rate, rounds, accountant, disk_cache)
        s = column_norm(b)
        figures = (sigma * s * workload_rmse(b, steps, 0.0), sigma * s * workload_rmse(b, steps, MOMENTUM),
                   sigma * marginal_std_factor(b, steps - 1))
        base = base or figures
        out.append({"n": n, "batch": batch, "steps": steps, "delta": delta, "epsilon": epsilon, "bands": b,
                    "sigma": sigma, "column_norm": s, "prefix_ratio": figures[0] / base[0],
                    "momentum_ratio": figures[1] / base[1], "marginal_ratio": figures[2] / base[2]})
        if progress is not None:
            progress(out[-1])
    return out


def best_bands(rows: list[dict]) -> dict:
    """The row with the smallest momentum ratio (ties: the smaller b); b = 1's row when no b > 1 is below 1."""
    return min(rows, key=lambda r: (r["momentum_ratio"], r["bands"]))


def format_comparison(rows: list[dict]) -> str:
    """The rows as a Markdown table (b, σ, s and the three ratios)."""
    lines = ["| b | σ | s | prefix-sum noise | momentum noise | one step's noise |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(f"| {r['bands']} | {r['sigma']:.3f} | {r['column_norm']:.3f} | {r['prefix_ratio']:.3f}× | "
                     f"{r['momentum_ratio']:.3f}× | {r['marginal_ratio']:.2f}× |")
    return "\n".join(lines)


def noise_verdict(rows: list[dict], threshold: float = BANDED_MOMENTUM_THRESHOLD) -> tuple[str, int, str]:
    """``(mechanism, bands, line)``: always ``independent`` (b = 1) — at no measured plan did banded noise buy accuracy
    (benchmarks/RESULTS.md §13) — and ``line`` says why, in one line: the noise the best b would save, and whether this
    plan lies within the measured range (best momentum ratio ≥ ``threshold``: banded noise was trained there and
    bought nothing) or beyond it (below ``threshold``: untested, so banded noise is named as an experiment to run
    against independent noise on a tune split, not recommended)."""
    base, best = rows[0], best_bands(rows)
    assert base["bands"] == 1, "the rows of noise_comparison start with b = 1"
    measured = (f"banded noise was trained at momentum ratios down to {MEASURED_LOWEST_RATIO:g} and bought no accuracy "
                f"under DP-AdamW ({ACCURACY_REFERENCE})")
    if best["bands"] == 1:
        tried = [r for r in rows if r["bands"] > 1]
        if not tried:
            return "independent", 1, ("noise: independent — no banded_sqrt b > 1 fits this plan (cyclic Poisson sampling "
                                      "needs b·B ≤ N)")
        least = min(tried, key=lambda r: (r["momentum_ratio"], r["bands"]))
        return "independent", 1, (
            f"noise: independent — no banded_sqrt b in {{{', '.join(str(r['bands']) for r in tried)}}} lowers the noise "
            f"the trajectory accumulates (momentum {MOMENTUM:g}) at this plan: the least bad, b = {least['bands']}, raises "
            f"it by {(least['momentum_ratio'] - 1) * 100:.1f} % (its accounting, DP-SGD at rate {least['bands']}·q for "
            f"⌈T/{least['bands']}⌉ rounds, needs σ {least['sigma']:.3f} instead of {base['sigma']:.3f})")
    b, cut = best["bands"], (1 - best["momentum_ratio"]) * 100
    why = (f"(σ {base['sigma']:.3f} → {best['sigma']:.3f} from its accounting, DP-SGD at rate {b}·q for ⌈T/{b}⌉ rounds; "
           f"one step's own noise {best['marginal_ratio']:.2f}×)")
    if best["momentum_ratio"] < threshold:
        return "independent", 1, (
            f"noise: independent — the best banded_sqrt (b = {b}) would lower the noise the trajectory accumulates "
            f"(momentum {MOMENTUM:g}) by {cut:.1f} % at this plan {why}, beyond the measured range: {measured}; "
            f"--noise_mechanism banded_sqrt --noise_bands {b} at the same B and T is an experiment to compare with "
            f"independent noise on a tune split, not a recommendation")
    return "independent", 1, (
        f"noise: independent — the best banded_sqrt (b = {b}) would lower the noise the trajectory accumulates "
        f"(momentum {MOMENTUM:g}) by {cut:.1f} % at this plan {why}, within the measured range: {measured}")
