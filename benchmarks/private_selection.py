#!/usr/bin/env python
"""Private hyper-parameter selection (issue 32) vs the recipe's fixed defaults, at the same total ε, side by side.

    HF_HUB_OFFLINE=1 python benchmarks/private_selection.py --task sst2 --epochs 3 --batch 1024 --epsilon 3 \\
        --tune "learning_rate=3e-3,1e-2,3e-2;per_sample_max_grad_norm=0.1,0.3" --tune_trials 2 \\
        --out benchmarks/results/private_selection.jsonl
    python benchmarks/private_selection.py --report --out benchmarks/results/private_selection.jsonl

Each seed runs ``recipes/glue.py`` twice in this process (MiniLM, last block, frozen prefix cached, GLUE dev as the
score set): ``fixed`` — the recipe with its defaults (lr 1e-2, C = 0.1) at ``--epsilon``; ``tuned`` — the same command
with ``--tune`` (``--epsilon`` is then the selection's total). One JSON line per run as it finishes: dev accuracy, ε
reported, σ, wall time and, for ``tuned``, K drawn and every trial's score — **benchmark bookkeeping only**: K and the
other trials' scores are exactly what a release must not publish (hf_dp keeps them out of privacy.json).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
SHARED = Path(os.environ.get("HF_DP_SHARED", REPO.parent / "shared"))


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--task", default="sst2")
    p.add_argument("--data_dir", default=str(SHARED / "data" / "glue"))
    p.add_argument("--model", default="minilm")
    p.add_argument("--epsilon", type=float, default=3.0)
    p.add_argument("--epochs", type=float, default=3.0)
    p.add_argument("--batch", type=int, default=1024)
    p.add_argument("--lr", type=float, default=1e-2, help="the fixed run's learning rate (the recipe's planned lr)")
    p.add_argument("--clip", type=float, default=0.1, help="the fixed run's C (the recipe's default)")
    p.add_argument("--tune", default="learning_rate=3e-3,1e-2,3e-2;per_sample_max_grad_norm=0.1,0.3")
    p.add_argument("--tune_trials", type=float, default=2.0)
    p.add_argument("--tune_distribution", default="geometric")
    p.add_argument("--seeds", default="0")
    p.add_argument("--modes", default="fixed,tuned")
    p.add_argument("--max_train_samples", type=int, default=None)
    p.add_argument("--max_eval_samples", type=int, default=None)
    p.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "private_selection.jsonl"))
    p.add_argument("--work", default=str(REPO / "runs" / "private_selection"),
                   help="the runs' output folders go under this folder (default: runs/private_selection, git-ignored)")
    p.add_argument("--report", action="store_true", help="print the table of --out and exit")
    return p.parse_args(argv)


def _load_glue():
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_dp_recipe_glue_bench", REPO / "recipes" / "glue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def run_one(args, mode: str, seed: int) -> dict:
    import hf_dp.tuning.search as selection

    glue = _load_glue()
    out = os.path.join(args.work, f"{args.task}-{mode}-s{seed}")
    argv = ["--task_name", args.task, "--data_dir", args.data_dir, "--model_name_or_path", args.model,
            "--epsilon", str(args.epsilon), "--num_train_epochs", str(args.epochs),
            "--per_device_train_batch_size", str(args.batch), "--learning_rate", str(args.lr),
            "--per_sample_max_grad_norm", str(args.clip), "--seed", str(seed), "--output_dir", out,
            "--disable_tqdm", "true", "--logging_steps", "100000"]
    if args.max_train_samples:
        argv += ["--max_train_samples", str(args.max_train_samples)]
    if args.max_eval_samples:
        argv += ["--max_eval_samples", str(args.max_eval_samples)]
    if mode == "tuned":
        argv += ["--tune", args.tune, "--tune_trials", str(args.tune_trials), "--tune_distribution", args.tune_distribution]
    seen = {}
    original = selection.run_search

    def recording(*a, **k):
        best = original(*a, **k)
        seen.update(best.run_summary or {})
        return best

    selection.run_search = recording
    start = time.perf_counter()
    try:
        code = glue.main(argv)
    finally:
        selection.run_search = original
    wall = time.perf_counter() - start
    row = {"task": args.task, "mode": mode, "seed": seed, "exit_code": code, "wall_s": round(wall, 1),
           "epochs": args.epochs, "batch": args.batch, "argv": argv}
    privacy_file = os.path.join(out, "release", "privacy.json")  # the recipe's release folder
    if code == 0 and os.path.isfile(privacy_file):
        with open(privacy_file, encoding="utf-8") as f:
            privacy = json.load(f)
        row.update(epsilon=privacy["epsilon"], sigma=privacy["noise_multiplier"], steps=privacy["steps"],
                   accuracy=(privacy.get("eval") or {}).get("eval_accuracy"),
                   learning_rate=privacy["optimizer"]["hyperparameters"].get("lr"), clip=privacy["max_grad_norm"])
        sel = privacy.get("hyperparameter_selection")
        if sel:
            row.update(per_trial_epsilon=sel["per_trial_epsilon"], distribution=sel["trials_distribution"],
                       selected=sel["selected_hyperparameters"], k_drawn=seen.get("k_drawn"),
                       trials=seen.get("trials"))
    return row


def report(path: str) -> str:
    rows = [json.loads(line) for line in open(path, encoding="utf-8") if line.strip()]
    lines = ["| task | mode | seed | total ε | σ per run | per-run ε | K drawn | kept (lr, C) | dev acc % | wall s |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        acc = r.get("accuracy")
        lines.append(f"| {r['task']} | {r['mode']} | {r['seed']} | {r.get('epsilon', float('nan')):.3f} | "
                     f"{r.get('sigma', float('nan')):.3f} | {r.get('per_trial_epsilon', r.get('epsilon', float('nan'))):.3f} | "
                     f"{r.get('k_drawn', '—') if r['mode'] == 'tuned' else '—'} | "
                     f"{r.get('learning_rate')}, {r.get('clip')} | {100 * acc:.1f} | {r['wall_s']} |"
                     if acc is not None else f"| {r['task']} | {r['mode']} | {r['seed']} | failed (exit {r['exit_code']}) |")
    return "\n".join(lines)


def main(argv=None) -> None:
    args = parse(argv)
    if args.report:
        print(report(args.out))
        return
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    for seed in [int(s) for s in args.seeds.split(",")]:
        for mode in args.modes.split(","):
            row = run_one(args, mode, seed)
            with open(args.out, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps({k: v for k, v in row.items() if k not in ("argv", "trials")}), flush=True)


if __name__ == "__main__":
    main()
