"""Issue 52 item 5: where banded correlated noise (``--noise_mechanism banded_sqrt``) can beat independent noise.

No training: for a setting (N, B, T, ε, δ) and each number of bands b, the σ that hf_dp's accountant calibrates for
the b-banded mechanism with cyclic Poisson sampling (:func:`hf_dp.privacy.accounting.calibrate_noise_multiplier`
with ``bands=b``: DP-SGD at rate min(1, b·q) for ⌈T/b⌉ rounds) and the noise the training loop then sees, σ·s·C⁻¹z
(:mod:`hf_dp.privacy.banded`: the BSR coefficients, s their column norm). Two figures of that noise, relative to
independent noise (b = 1) at its own σ:

* ``prefix``: the root-mean-square, over the steps t, of the noise in the running sum of the updates up to t (the
  error of SGD's iterate: the workload banded square roots are built for);
* ``momentum``: the same for heavy-ball momentum 0.9 (each update's noise enters later iterates with weight
  (1 − 0.9^k)/(1 − 0.9)), closer to what Adam-type rules accumulate;
* ``marginal``: each step's own noise std (σ·s·√V_n, what DP-AdamBC's Φ reads), which *grows* with b.

A ratio below 1 is less noise in the trajectory at the same ε; the accuracy gain it buys is measured by training
(benchmarks/RESULTS.md §15). The presets are the recipes' default settings at ε = 3:

    python benchmarks/correlated_noise_gain.py                      # the presets
    python benchmarks/correlated_noise_gain.py --n 8999 --batch 512 --steps 90,180,450,900
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_io import git_commit  # noqa: E402

from hf_dp.privacy.accounting import calibrate_noise_multiplier  # noqa: E402
from hf_dp.privacy.banded import column_norm, inverse_impulse, marginal_std_factor  # noqa: E402

#: name -> (N, B, T, δ): the recipes' defaults at ε = 3 (RESULTS §0d, §9, §10b)
PRESETS = {
    "qnli main job (qnli.py)": (8999, 512, 90, 1e-5),
    "sst-2 full, 10 epochs (glue.py, RESULTS 9)": (67349, 1024, 660, 1e-5),
    "causal LM, row level (clm.py, 4,000 rows)": (4000, 250, 32, 1e-5),
    "causal LM, user level (clm.py, 1,045 users)": (1045, 65, 32, 1e-5),
}
BANDS = (1, 2, 3, 4, 6, 8, 12, 16)
OUT = REPO / "benchmarks" / "results" / "correlated_noise_gain.jsonl"


def workload_rmse(bands: int, steps: int, beta: float) -> float:
    """RMS over t of the std of Σ_{j≤t} a_{t−j}·w_j, w = C⁻¹z (unit σ, unit s), a_k = 1 (β = 0) or (1 − β^{k+1})/(1 − β)."""
    d = np.asarray(inverse_impulse(bands, steps - 1), dtype=np.float64)
    k = np.arange(steps)
    a = np.ones(steps) if beta == 0 else (1 - beta ** (k + 1)) / (1 - beta)
    # the noise of iterate t: Σ_i z_i · Σ_{j=i}^{t} a_{t−j} d_{j−i}  (a Toeplitz product: h = a * d, truncated)
    h = np.convolve(a, d)[:steps]
    # iterate t (from 0) sees h_0..h_t: its variance is Σ_{m≤t} h_m², the running sum
    var = np.cumsum(h * h)
    return float(np.sqrt(var.mean()))


def rows(n: int, batch: int, steps: int, delta: float, epsilon: float, bands_list=BANDS):
    q = batch / n
    base = None
    for b in bands_list:
        if b * q > 1:
            break
        sigma = calibrate_noise_multiplier(epsilon, delta, q, steps, bands=b)
        s = column_norm(b)
        prefix = sigma * s * workload_rmse(b, steps, 0.0)
        momentum = sigma * s * workload_rmse(b, steps, 0.9)
        marginal = sigma * marginal_std_factor(b, steps - 1)
        if base is None:
            base = (prefix, momentum, marginal)
        yield {"n": n, "batch": batch, "steps": steps, "delta": delta, "epsilon": epsilon, "bands": b,
               "sigma": sigma, "column_norm": s, "prefix_ratio": prefix / base[0],
               "momentum_ratio": momentum / base[1], "marginal_ratio": marginal / base[2]}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, help="N (units); with --batch and --steps instead of the presets")
    ap.add_argument("--batch", type=int)
    ap.add_argument("--steps", default=None, help="T, or several separated by commas")
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--out", default=None, help="append the rows as JSON lines (e.g. " + str(OUT.relative_to(REPO)) + ")")
    a = ap.parse_args(argv)
    if a.n is not None:
        if a.batch is None or a.steps is None:
            ap.error("--n needs --batch and --steps")
        settings = {f"N={a.n}, B={a.batch}, T={t}": (a.n, a.batch, int(t), a.delta) for t in a.steps.split(",")}
    else:
        settings = PRESETS
    commit = git_commit()
    out = open(a.out, "a", encoding="utf-8") if a.out else None
    for name, (n, batch, steps, delta) in settings.items():
        print(f"\n{name}: N {n:,}, B {batch}, T {steps}, q {batch / n:.4g}, ε {a.epsilon:g}, δ {delta:g}")
        print("| b | σ | s | prefix-sum noise | momentum noise | one step's noise |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in rows(n, batch, steps, delta, a.epsilon):
            print(f"| {r['bands']} | {r['sigma']:.3f} | {r['column_norm']:.3f} | {r['prefix_ratio']:.3f}× | "
                  f"{r['momentum_ratio']:.3f}× | {r['marginal_ratio']:.2f}× |")
            if out:
                out.write(json.dumps(dict(r, setting=name, commit=commit)) + "\n")
    if out:
        out.close()


if __name__ == "__main__":
    main()
