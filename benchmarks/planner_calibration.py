"""Calibrating the planner's warning (issue 31 item 3): R_run against what the run actually learned.

For each task (SST-2, QNLI), training-set size N (a random subset of the training rows, seed 0; or all of them) and
target ε, this runs the recipe's defaults — all-MiniLM-L6-v2, ``--trainable last_block`` with the frozen prefix cached,
dp_adamw at the planner's learning rate, C = 0.1, δ = 1e-5, PRV, the planner's logical batch B at the recipes' 10
epochs, each Poisson draw grouped by length — and records the planner's public quantities (N, B, T, σ, d, R_step,
R_epoch, R_run, the bound) beside the outcome: GLUE dev accuracy and whether it is distinguishable from the constant
predictor (always the dev set's majority class): above majority + 2 binomial standard errors of the dev set.

The dev set chooses no model here: it measures how far each plan got, to set the planner's *warning thresholds* on
public quantities (hf_dp.plan.CONSTANT_R_RUN for the harder task, QNLI; hf_dp.plan.CONSTANT_R_RUN_ALL for both;
tests/test_plan.py checks them against the raw file). The frozen-prefix cache of every training row and of dev is built once
per task; a subset is a selection of cached rows.

    HF_HUB_OFFLINE=1 nohup python benchmarks/planner_calibration.py --tasks qnli,sst2 --sizes 1000,2500,4000,8000 \
        --epsilons 1,3,8 &
    python benchmarks/planner_calibration.py --report

Rows are appended to ``--out`` as JSON lines as each run ends (a rerun skips finished rows).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
if str(REPO) not in sys.path:
    sys.path.append(str(REPO))
from bench_io import add_work_option, git_commit, load_jsonl  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "planner_calibration.jsonl"


def majority_rate(labels) -> float:
    labels = list(labels)
    return max(labels.count(v) for v in set(labels)) / len(labels)


def above_constant(accuracy: float, majority: float, n_dev: int) -> bool:
    """Accuracy above the majority rate by more than two binomial standard errors of the dev set (at p = majority)."""
    return accuracy > majority + 2.0 * math.sqrt(majority * (1.0 - majority) / n_dev)


def subset(data, idx: list[int]):
    """Rows ``idx`` of a dataset: a ``datasets.Dataset`` selects them; a frozen-prefix cache
    (:class:`hf_dp.models.prefix_cache.CachedFeatures`) is rebuilt from their cached states (same prefix signature)."""
    if hasattr(data, "select"):
        return data.select(idx)
    import torch

    from hf_dp.models.prefix_cache import CachedFeatures

    starts, ends = data.offsets[:-1][idx], data.offsets[1:][idx]
    hidden = torch.cat([data.hidden[int(a):int(b)] for a, b in zip(starts, ends)])
    offsets = torch.zeros(len(idx) + 1, dtype=data.offsets.dtype)
    offsets[1:] = torch.cumsum(ends - starts, 0)
    return CachedFeatures(hidden, offsets, None if data.labels is None else data.labels[idx],
                          suffix_blocks=data.suffix_blocks, prefix_signature=data.prefix_signature)


def labels_of(data) -> list:
    if getattr(data, "labels", None) is not None and not callable(data.labels):
        return [int(x) for x in data.labels.reshape(-1).tolist()]
    return list(data["labels" if "labels" in data.column_names else "label"])


#: "at or barely above the constant predictor" (issue 31's words): less than this many accuracy points above the
#: dev set's majority rate. The threshold of hf_dp.plan.CONSTANT_R_RUN separates such runs from those that learned.
from recipes.glue_support.metrics import BARELY_POINTS  # noqa: E402  (the recipes' verdict uses the same rule)


def outcome(accuracy: float, majority: float) -> str:
    return "learned" if 100.0 * (accuracy - majority) >= BARELY_POINTS else "constant"


def threshold(rows: list[dict], task: str | None = None) -> tuple[float | None, float | None]:
    """(largest R_run of a run that learned, smallest R_run of a run at or barely above the constant predictor), over
    ``task``'s rows (all rows by default)."""
    rows = [r for r in rows if task is None or r.get("task") == task]
    learned = [r["planned"]["r_run"] for r in rows if outcome(r["dev_accuracy"], r["majority"]) == "learned"]
    const = [r["planned"]["r_run"] for r in rows if outcome(r["dev_accuracy"], r["majority"]) == "constant"]
    return (max(learned) if learned else None), (min(const) if const else None)


def _key(r: dict) -> tuple:
    return (r["task"], r["n"], float(r["epsilon_target"]), r["seed"], r.get("trainable", "last_block"), r["epochs"])


def run(task: str, sizes: list[int | None], epsilons: list[float], seeds: list[int], epochs: float, out: str,
        trainable: str = "last_block", max_rows: int | None = None, model: str | None = None, *, work: str) -> None:
    from transformers import AutoModelForSequenceClassification

    from hf_dp.models import apply_trainable
    from hf_dp.plan import PLANNED_LR, recommend
    from main_job_tuning import Data, run_one
    from qnli_optimizers import _minilm_path

    done = {_key(r) for r in load_jsonl(out)}
    params = apply_trainable(AutoModelForSequenceClassification.from_pretrained(_minilm_path(model), num_labels=2),
                             trainable)[1].num_trainable
    data = Data(task, 128, 0.1, trainable=trainable, full_train=True, max_rows=max_rows, model=model)
    full = data.train
    import random

    order = list(range(len(full)))
    random.Random(0).shuffle(order)  # one fixed order of the training rows: subsets are nested (1,000 ⊂ 2,500 ⊂ ...)
    majority = majority_rate(labels_of(data.dev))
    print(f"{task}: {len(full)} training rows, dev {len(data.dev)} (majority {majority:.4f}), cache {data.cache_seconds:.0f}s, "
          f"d = {params}", flush=True)
    for n in sizes:
        n = len(full) if n is None or n >= len(full) else n
        for eps in epsilons:
            for seed in seeds:
                if (task, n, float(eps), seed, trainable, epochs) in done:
                    continue
                sub = SimpleNamespace(task=task, model=data.model, collator=data.collator, cached=data.cached,
                                      train=subset(full, order[:n]), tune=None, dev=data.dev, tune_split=None,
                                      sizes={"train": n, "validation": len(data.dev)})
                plan = recommend(n, eps, 1e-5, params, epochs=epochs)
                t0 = time.time()
                rec = run_one(sub, work=work, epochs=epochs, lr=PLANNED_LR["dp_adamw"], seed=seed, epsilon=eps, params=params,
                              trainable=trainable, group_by_length=True, C=0.1)
                c = plan.choice
                rec.update({
                    "n": n, "wall_seconds": time.time() - t0, "majority": majority, "n_dev": len(data.dev),
                    "above_constant": above_constant(rec["dev_accuracy"], majority, len(data.dev)),
                    "planned": {"batch_size": c.batch_size, "steps": c.steps, "sigma": c.sigma, "r_step": c.r_step,
                                "r_epoch": c.r_epoch, "r_run": c.r_run, "bound": c.bound},
                    "commit": git_commit(),
                })
                with open(out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps({k: rec[k] for k in ("task", "n", "epsilon_target", "batch", "steps", "dev_accuracy",
                                                      "above_constant", "train_seconds")} | {"r_run": c.r_run}), flush=True)


def report(out: str) -> None:
    rows = sorted(load_jsonl(out), key=lambda r: (r["task"], r["planned"]["r_run"]))
    print("| task | N | ε | B | T | σ | R_epoch | R_run | dev acc % | majority % | points above majority | outcome "
          f"(learned: ≥ {BARELY_POINTS:g} points) | above by 2 s.e. | train s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        p = r["planned"]
        o = outcome(r["dev_accuracy"], r["majority"])
        print(f"| {r['task']} | {r['n']:,} | {r['epsilon_target']:g} | {p['batch_size']} | {p['steps']} | {p['sigma']:.3f} | "
              f"{p['r_epoch']:.3g} | {p['r_run']:.3g} | {100 * r['dev_accuracy']:.1f} | {100 * r['majority']:.1f} | "
              f"{100 * (r['dev_accuracy'] - r['majority']):+.1f} | {'learned' if o == 'learned' else '**constant or barely above**'} | "
              f"{'yes' if r['above_constant'] else 'no'} | {r['train_seconds']:.0f} |")
    print()
    for task in sorted({r["task"] for r in rows}) + [None]:
        hi, lo = threshold(rows, task)
        print(f"{task or 'all tasks'}: largest R_run of a run that learned: {hi if hi is None else f'{hi:.3g}'}; smallest "
              f"R_run of a run at or barely above the constant predictor: {lo if lo is None else f'{lo:.3g}'}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="qnli,sst2")
    ap.add_argument("--sizes", default="1000,2500,4000,8000,all", help="training rows per run; 'all' = every row")
    ap.add_argument("--epsilons", default="1,3,8")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--epochs", type=float, default=10.0, help="the recipes' compute budget")
    ap.add_argument("--trainable", default="last_block")
    ap.add_argument("--max_rows", type=int, default=None, help="smoke runs only: the first N rows of each split")
    ap.add_argument("--model", default=None, help="smoke runs only: a model folder instead of all-MiniLM-L6-v2")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    add_work_option(ap, "planner_calibration")
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args(argv)
    if a.report:
        report(a.out)
        return
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    sizes = [None if s == "all" else int(s) for s in a.sizes.split(",")]
    for task in a.tasks.split(","):
        run(task, sizes, [float(e) for e in a.epsilons.split(",")], [int(s) for s in a.seeds.split(",")], a.epochs,
            a.out, trainable=a.trainable, max_rows=a.max_rows, model=a.model, work=a.work)


if __name__ == "__main__":
    main()
