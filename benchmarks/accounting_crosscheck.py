"""Cross-check hf_dp's ε (Opacus PRV / RDP) against Google's dp_accounting on the full grid.

Usage:  .venv/bin/python benchmarks/accounting_crosscheck.py [--out benchmarks/accounting_crosscheck.md]
Prints a markdown table (and writes it, with the command and date, to --out). ``--smoke``: three points of at most
10 steps from the test grid, PLD discretisation 1e-2 unless given, instead of the full grid (about a second;
tests/test_benchmark_smoke.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from hf_dp.privacy import crosscheck as cc  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None, help="write the markdown report here")
    ap.add_argument("--json", default=None, help="also dump the raw rows as JSON")
    ap.add_argument("--pld-dx", type=float, default=None, help=f"pessimistic PLD discretisation (default "
                    f"{cc.DEFAULT_PLD_DISCRETIZATION:g}; 1e-2 with --smoke)")
    ap.add_argument("--lower-floor", type=float, default=cc.LOWER_BOUND_MIN_DISCRETIZATION)
    ap.add_argument("--smoke", action="store_true", help="three short points of the test grid (checks the script runs)")
    args = ap.parse_args(argv)
    grid = cc.DEFAULT_GRID
    if args.smoke:
        grid = [p for p in cc.FAST_GRID if p.steps <= 10 and (p.sample_rate == 1.0 or p.steps == 10)]
    if args.pld_dx is None:
        args.pld_dx = 1e-2 if args.smoke else cc.DEFAULT_PLD_DISCRETIZATION

    import dp_accounting
    import opacus

    t0 = time.time()
    rows = []
    for p in grid:
        t = time.time()
        r = cc.crosscheck_point(p, args.pld_dx, True, args.lower_floor)
        rows.append(r)
        print(f"[{time.time() - t:6.1f}s] {p.setting}: PRV {r['eps_hf_dp_prv']:.4f} PLD [{r['eps_pld_lower']:.4f}, "
              f"{r['eps_pld_upper']:.4f}]", file=sys.stderr, flush=True)
    table = cc.format_markdown(rows)
    worst_lower = min(r["gap_prv_minus_pld_lower"] - (-cc.prv_tolerance(r["eps_pld_lower"])) for r in rows)
    under = [r for r in rows if r["eps_hf_dp_prv"] < r["eps_pld_lower"] - cc.prv_tolerance(r["eps_pld_lower"])]
    add_dom = [r for r in rows if r.get("pld_upper_by_direction") and r["pld_upper_by_direction"]["add"] > r["pld_upper_by_direction"]["remove"]]
    gaps = [r["gap_prv_minus_pld_upper"] for r in rows]
    rel = [r["gap_prv_minus_pld_upper"] / r["eps_pld_upper"] for r in rows if r["eps_pld_upper"] > 0]
    rdp_rel = [r["gap_rdp_minus_google_rdp"] / r["eps_google_rdp"] for r in rows]
    # (run from the repo root; paths outside the repo, e.g. a --json under the system's temporary directory, are not named)
    shown = [x if not os.path.isabs(x) else "<" + os.path.basename(x) + ">" for x in (sys.argv[1:] if argv is None else argv)]
    cmd = "python " + " ".join(["benchmarks/accounting_crosscheck.py"] + shown)
    report = f"""### Accounting cross-check: hf_dp (Opacus) vs Google `dp_accounting`

Produced by `{cmd}` on {datetime.date.today().isoformat()} ({platform.machine()}, CPU; dp_accounting {getattr(dp_accounting, '__version__', '0.6')}, opacus {opacus.__version__}; {time.time() - t0:.0f} s).

Mechanism: Poisson-subsampled Gaussian, add/remove-one adjacency (dp_accounting's default
`NeighboringRelation.ADD_OR_REMOVE_ONE`, passed explicitly). Steps = ⌈epochs·N/B⌉.
Seed-000 rows: σ calibrated by hf_dp (PRV) to ε* ∈ {{1, 3, 7}} at δ = 1e-5.

* **ε PLD lower** = dp_accounting PLD with `pessimistic_estimate=False` (privacy buckets, losses
  rounded down; read at δ + 1e-15 to undo the composition's tail-mass bookkeeping): a
  certified *lower* bound on the true ε. Discretisation Δ = clip(0.02/steps, {args.lower_floor:g}, 1e-3).
* **ε PLD upper** = `PLDAccountant` (pessimistic, connect-the-dots), Δ = {args.pld_dx:g}: a certified *upper* bound.
* **ε Google RDP** = `RdpAccountant` on {len(cc.DENSE_RDP_ORDERS)} dense orders (1.01…4096).
* **dominant dir.**: which of the REMOVE / ADD PLDs gives the larger ε (Opacus' PRV models REMOVE only).

{table}
Summary over {len(rows)} points:
* hf_dp PRV below the certified PLD lower bound (beyond 1% + 2e-3): **{len(under)}** points.
  Smallest margin (PRV − (lower − tol)): {worst_lower:+.4f}.
* PRV − PLD upper: min {min(gaps):+.4f}, max {max(gaps):+.4f} (relative {min(rel):+.2%} … {max(rel):+.2%}).
* hf_dp RDP − Google RDP (relative): {min(rdp_rel):+.2%} … {max(rdp_rel):+.2%}.
* ADD direction dominating REMOVE: **{len(add_dom)}** points.
"""
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1, default=float)


if __name__ == "__main__":
    main()
