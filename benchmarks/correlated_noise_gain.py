"""Issue 52 item 5: where banded correlated noise (``--noise_mechanism banded_sqrt``) can beat independent noise.

No training: for a setting (N, B, T, ε, δ) and each number of bands b, the σ that hf_dp's accountant calibrates for
the b-banded mechanism with cyclic Poisson sampling (:func:`hf_dp.privacy.accounting.calibrate_noise_multiplier`
with ``bands=b``: DP-SGD at rate min(1, b·q) for ⌈T/b⌉ rounds) and the noise the training loop then sees, σ·s·C⁻¹z
(:mod:`hf_dp.privacy.banded`: the BSR coefficients, s their column norm). Three figures of that noise, relative to
independent noise (b = 1) at its own σ:

* ``prefix``: the root-mean-square, over the steps t, of the noise in the running sum of the updates up to t (the
  error of SGD's iterate: the workload banded square roots are built for);
* ``momentum``: the same for heavy-ball momentum 0.9 (each update's noise enters later iterates with weight
  (1 − 0.9^k)/(1 − 0.9)), closer to what Adam-type rules accumulate;
* ``marginal``: each step's own noise std (σ·s·√V_n, what DP-AdamBC's Φ reads), which *grows* with b.

A ratio below 1 is less noise in the trajectory at the same ε; the accuracy gain it buys is measured by training
(benchmarks/RESULTS.md §13). The computation is :mod:`hf_dp.plan.noise` (also ``python -m hf_dp.plan ...
--noise_comparison``, for the plan the planner computes); this script prints it for the recipes' default settings at
ε = 3:

    python benchmarks/correlated_noise_gain.py                      # the presets
    python benchmarks/correlated_noise_gain.py --n 8999 --batch 512 --steps 90,180,450,900
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_io import git_commit  # noqa: E402

from hf_dp.plan.noise import BANDS, format_comparison, noise_comparison  # noqa: E402

#: name -> (N, B, T, δ): the recipes' defaults at ε = 3 (RESULTS §0d, §9, §10b)
PRESETS = {
    "qnli main job (qnli.py)": (8999, 512, 90, 1e-5),
    "sst-2 full, 10 epochs (glue.py, RESULTS 9)": (67349, 1024, 660, 1e-5),
    "causal LM, row level (clm.py, 4,000 rows)": (4000, 250, 32, 1e-5),
    "causal LM, user level (clm.py, 1,045 users)": (1045, 65, 32, 1e-5),
}
OUT = REPO / "benchmarks" / "results" / "correlated_noise_gain.jsonl"


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
        rows = noise_comparison(n, batch, steps, a.epsilon, delta, bands=BANDS)
        print(format_comparison(rows))
        for r in rows if out else ():
            out.write(json.dumps(dict(r, setting=name, commit=commit)) + "\n")
    if out:
        out.close()


if __name__ == "__main__":
    main()
