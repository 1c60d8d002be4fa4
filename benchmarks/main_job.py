"""The README's main job, end to end, as a new user runs it (issue 16 §1: ≥ 60 % QNLI dev accuracy at ε = 3 in ≤ 8 min).

The command is read from README.md itself (the block after ``# 3. run the main job``), so what is measured is what
the README says; each run adds only ``--seed S`` (the head's initialisation and HF's data order; sampling and noise
come from OS entropy as for any user, no ``--dp_seed``) and its own ``--output_dir``; the planner's on-disk cache is
off, as on a fresh machine. Each run is its own process;
the wall time is the whole process (imports, tokenization, the planner, cache building, training, evaluation on the
full GLUE dev set, saving model + card). The 1-minute load average before and after each run is recorded (the
machine should be idle). Results are appended to ``--out`` as JSON lines; ``--report`` prints the table.

    nohup python benchmarks/main_job.py --seeds 0,1,2 &
    python benchmarks/main_job.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
from bench_io import add_work_option, git_commit, load_jsonl, results_cli  # noqa: E402
DEFAULT_OUT = REPO / "benchmarks" / "results" / "main_job.jsonl"


def readme_command() -> tuple[dict[str, str], list[str]]:
    """(environment variables, argv) of the README's main-job command."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    block = text.split("# 3. run the main job", 1)[1].split("\n", 1)[1].split("```", 1)[0]
    lines = []
    for ln in block.splitlines():
        if not ln.strip() or ln.lstrip().startswith("#"):
            if lines:
                break  # the command ended; the README's next numbered step begins
            continue
        lines.append(ln)
        if not ln.rstrip().endswith("\\"):
            break  # the command's last line
    words = shlex.split(" ".join(ln.rstrip("\\").strip() for ln in lines))
    env = {}
    while words and re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def _field(text: str, name: str):
    m = re.search(rf"^{re.escape(name)}\s*: (\S+)", text, re.M)
    return m.group(1) if m else None


def run_one(seed: int, work: str, extra: list[str] = ()) -> dict:
    env, argv = readme_command()
    exe = readme_exe = argv[0]
    if exe.startswith(".venv/"):
        exe = sys.executable  # the interpreter running this script (the README's venv)
    argv = [exe, *argv[1:]]
    out_dir = os.path.join(work, f"s{seed}")  # this run's --output_dir
    if "--output_dir" in argv:
        argv[argv.index("--output_dir") + 1] = out_dir
    argv += ["--seed", str(seed), *extra]
    shutil.rmtree(out_dir, ignore_errors=True)
    load_before = os.getloadavg()[0]
    t0 = time.perf_counter()
    # as on a fresh machine: no on-disk cache of the planner's σ calibrations (HF_DP_PLAN_CACHE=off)
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True,
                          env={**os.environ, **env, "HF_DP_PLAN_CACHE": "off"})
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed} failed:\n{proc.stderr[-3000:]}")
    text = proc.stdout
    num = lambda v: float(v) if v not in (None, "n/a") else None  # noqa: E731
    privacy = json.loads((Path(out_dir) / "release" / "privacy.json").read_text())  # the recipe's release folder
    return {
        "seed": seed, "command": _shown(readme_exe, argv, out_dir), "wall_seconds": wall,
        "accuracy": num(_field(text, "accuracy")), "epsilon": privacy["epsilon"], "steps": privacy["steps"],
        "batch": privacy["expected_batch_size"], "sigma": privacy["noise_multiplier"],
        "learning_rate": (privacy.get("optimizer") or {}).get("hyperparameters", {}).get("lr"),
        "majority_rate": (privacy.get("eval_baseline") or {}).get("majority_rate"),
        "train_runtime": num((re.findall(r"'train_runtime': '?([0-9.]+)'?", text) or [None])[-1]),
        "load_before": load_before, "load_after": os.getloadavg()[0], "commit": git_commit(),
    }




def _shown(readme_exe: str, argv: list[str], out_dir: str) -> str:
    """The command as recorded: the README's interpreter, the output folder relative to the repo when it is inside (a
    row names no folder of one machine)."""
    rel = os.path.relpath(out_dir, REPO)
    shown = [rel if w == out_dir and not rel.startswith("..") else w for w in argv[1:]]
    return " ".join(shlex.quote(w) for w in [readme_exe, *shown])


def report(out: str) -> None:
    rows = load_jsonl(out)
    print("| seed | wall s | of which training s | QNLI dev accuracy % | ε spent | B | steps | σ | lr | load avg before/after | commit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        print(f"| {r['seed']} | {r['wall_seconds']:.0f} | {r['train_runtime'] or float('nan'):.0f} | {100 * r['accuracy']:.1f} | "
              f"{r['epsilon']:.2f} | {r['batch']:g} | {r['steps']} | {r['sigma']:.3f} | {r['learning_rate']:g} | "
              f"{r['load_before']:.1f}/{r['load_after']:.1f} | {r['commit']} |")
    if len(rows) > 1:
        acc = [100 * r["accuracy"] for r in rows]
        wall = [r["wall_seconds"] for r in rows]
        print(f"\nmean over {len(rows)} seeds: accuracy {statistics.mean(acc):.1f} ± {statistics.stdev(acc):.1f} % "
              f"(min {min(acc):.1f}), wall {statistics.mean(wall):.0f} ± {statistics.stdev(wall):.0f} s (max {max(wall):.0f})")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--extra_args", default="", help="appended to the README's command: a variant of the main job (e.g. RESULTS "
                    "§13's '--noise_mechanism banded_sqrt --noise_bands 3 --learning_rate 0.02', into its own --out), "
                    "or a smoke run ('--max_train_samples 64 --max_eval_samples 32')")
    add_work_option(ap, "main_job")
    a = results_cli(ap, DEFAULT_OUT, report, argv)
    if a is None:
        return
    print("command:", readme_command(), flush=True)
    for seed in [int(s) for s in a.seeds.split(",")]:
        rec = run_one(seed, a.work, shlex.split(a.extra_args))
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)


if __name__ == "__main__":
    main()
