"""End to end: the seed-000 QNLI protocol with and without ``--cache_frozen_features``.

Runs the main job itself — ``recipes/qnli.py`` (seed 000's protocol by default: dp_adamw, ε = 3,
δ = 1e-5, C = 0.1, logical batch 32 with Poisson sampling, 10 epochs, last block + pooler + head)
on all-MiniLM-L6-v2 and the local GLUE QNLI folder — once per (seed, mode), each in its own process,
modes interleaved within a seed. The wall time is the whole process (imports, tokenization, cache
building, training, evaluation on the full GLUE dev set, saving model + card). Results are appended
to ``--out`` as JSON lines as each run finishes; a rerun skips finished (seed, mode, scale) rows;
``--report`` prints the markdown table (minus ``paused_seconds``, where a row records that its process was
stopped for a while).

    nohup python benchmarks/cache_end_to_end.py --seeds 0,1,2 --max_train_samples 2000 &
    python benchmarks/cache_end_to_end.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_io import add_work_option, load_jsonl, results_cli  # noqa: E402
SHARED = Path(os.environ.get("HF_DP_SHARED", REPO.parent / "shared"))
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cache_end_to_end.jsonl"



def _parse_summary(text: str) -> dict:
    def field(name):
        m = re.search(rf"^{re.escape(name)}\s*: (\S+)", text, re.M)
        return m.group(1) if m else None

    def logged(key):  # HF's PrinterCallback prints the log dicts ({'train_runtime': '52.77', ...})
        m = re.findall(rf"'{key}': '?([0-9.eE+-]+)'?", text)
        return float(m[-1]) if m else None

    num = lambda v: float(v) if v not in (None, "None", "—") else None  # noqa: E731
    return {"accuracy": num(field("accuracy")), "epsilon": num(field("epsilon spent")), "steps": num(field("steps")),
            "sigma": num(field("noise multiplier sigma")), "train_runtime": logged("train_runtime"),
            "eval_runtime": logged("eval_runtime")}


def run_one(mode: str, seed: int, a) -> dict:
    out_dir = os.path.join(a.work, f"{mode}_s{seed}")  # each run's --output_dir
    cmd = [
        sys.executable, str(REPO / "recipes" / "qnli.py"), "--model_name_or_path", a.model,
        "--data_dir", str(SHARED / "data" / "glue"), "--output_dir", out_dir,
        "--seed", str(seed), "--dp_seed", str(seed), "--num_train_epochs", str(a.epochs),
        "--per_device_train_batch_size", str(a.batch), "--per_device_eval_batch_size", "128",
        "--save_strategy", "no", "--report_to", "none", "--disable_tqdm", "true", "--use_cpu",
    ]
    if a.max_train_samples:
        cmd += ["--max_train_samples", str(a.max_train_samples)]
    if a.max_eval_samples:  # (a smoke run only: the rows measured evaluate on the full GLUE dev set)
        cmd += ["--max_eval_samples", str(a.max_eval_samples)]
    if mode == "cached":
        cmd += ["--cache_frozen_features"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} seed {seed} failed:\n{proc.stderr[-3000:]}")
    return {"mode": mode, "seed": seed, "epochs": a.epochs, "batch": a.batch, "max_train_samples": a.max_train_samples,
            "wall_seconds": wall, **_parse_summary(proc.stdout)}


def _key(r: dict) -> tuple:
    return (r["mode"], r["seed"], r["epochs"], r["batch"], r["max_train_samples"])


def report(out: str) -> None:
    rows = load_jsonl(out)
    scales = sorted({(r["epochs"], r["batch"], r["max_train_samples"]) for r in rows}, key=str)
    for epochs, batch, n in scales:
        rs = [r for r in rows if (r["epochs"], r["batch"], r["max_train_samples"]) == (epochs, batch, n)]
        print(f"\n### {epochs:g} epochs, logical batch {batch}, QNLI train rows: {n or 'all'}\n")
        print("| mode | seeds | wall s (mean ± std) | of which training s | dev accuracy (mean ± std) | ε spent | steps |")
        print("| --- | --- | --- | --- | --- | --- | --- |")
        means = {}
        for mode in ("uncached", "cached"):
            g = [r for r in rs if r["mode"] == mode]
            if not g:
                continue
            # a run that was SIGSTOPped (to time something else alone) records the pause; it is not run time
            w = [r["wall_seconds"] - r.get("paused_seconds", 0.0) for r in g]
            acc = [r["accuracy"] * 100 for r in g if r["accuracy"] is not None]
            sd = lambda xs: f" ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else ""  # noqa: E731
            means[mode] = statistics.mean(w)
            tr = [r["train_runtime"] - r.get("paused_seconds", 0.0) for r in g if r.get("train_runtime") is not None]
            trs = f"{statistics.mean(tr):.0f}" if tr else "—"
            print(f"| {mode} | {','.join(str(r['seed']) for r in g)} | {statistics.mean(w):.0f}{sd(w)} | {trs} | "
                  f"{statistics.mean(acc):.1f}{sd(acc)} | {max(r['epsilon'] for r in g):.2f} | {g[0]['steps']:.0f} |")
            if tr:
                means[mode + "_train"] = statistics.mean(tr)
        if "uncached" in means and "cached" in means:
            print(f"\nend-to-end speed-up (mean wall time uncached / cached): **{means['uncached'] / means['cached']:.2f}×**")
            if epochs < 10 and "uncached_train" in means and "cached_train" in means:
                k = 10 / epochs - 1  # the training part scales with the epochs; the rest (start-up, data, cache, eval) does not
                proj = {m: means[m] + k * means[m + "_train"] for m in ("uncached", "cached")}
                print(f"projected to 10 epochs from these parts (wall + {k:g} × training time): uncached {proj['uncached']:.0f} s, "
                      f"cached {proj['cached']:.0f} s: **{proj['uncached'] / proj['cached']:.2f}×**")


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--epochs", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--max_train_samples", type=int, default=None)
    ap.add_argument("--modes", default="cached,uncached")
    ap.add_argument("--max_eval_samples", type=int, default=None, help="smoke runs only (default: the full GLUE dev set)")
    ap.add_argument("--model", default="minilm", help="smoke runs only: a model folder instead of all-MiniLM-L6-v2")
    add_work_option(ap, "cache_end_to_end")
    a = results_cli(ap, DEFAULT_OUT, report, argv)
    if a is None:
        return
    done = {_key(r) for r in load_jsonl(a.out)}
    for seed in [int(s) for s in a.seeds.split(",")]:
        for mode in a.modes.split(","):
            key = (mode, seed, a.epochs, a.batch, a.max_train_samples)
            if key in done:
                continue
            rec = run_one(mode, seed, a)
            with open(a.out, "a") as f:
                f.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
