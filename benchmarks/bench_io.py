"""Small helpers shared by the benchmark scripts: JSON-lines result files, their --out/--report options, the --work
folder their runs write under, and the commit a row ran on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_jsonl(path: str | os.PathLike) -> list[dict]:
    """The rows of a JSON-lines results file ([] when it does not exist yet)."""
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def git_commit() -> str | None:
    """The short hash of this checkout's HEAD (None outside a git checkout)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
    except Exception:
        return None


def results_cli(ap, default_out: str | os.PathLike, report, argv: list[str] | None = None):
    """Add ``--out`` (the JSON-lines results file, appended to) and ``--report`` (print its table) to ``ap`` and parse
    ``argv`` (default: the command line). Returns the arguments of a measuring run (the results folder made), or None
    once ``report(out)`` has printed."""
    ap.add_argument("--out", default=str(default_out))
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args(argv)
    if a.report:
        report(a.out)
        return None
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    return a


def add_work_option(ap, name: str) -> None:
    """Add ``--work``: the folder the runs' output folders go under (made when a run starts). Default ``runs/<name>`` in
    this checkout (git-ignored), never a fixed folder under the system's temporary directory."""
    ap.add_argument("--work", default=str(REPO / "runs" / name),
                    help=f"the runs' output folders go under this folder (default: runs/{name} in the repo, git-ignored)")


class UsageError(Exception):
    """Bad input to an experiment script: printed as one ``error:`` line (:func:`run_experiment`)."""


def relative(text: str) -> str:
    """``text`` with this interpreter shown as ``python`` and this checkout's paths relative (for the raw rows)."""
    return text.replace(sys.executable, "python").replace(str(REPO) + os.sep, "")


def run_inputs(a, runs, splits, script: str, pretrain_hint: str) -> tuple[list[str], list[int], Path, Path]:
    """What an experiment's ``run`` phase checks before any work: the ``--runs`` names (known to ``runs``), the
    ``--seeds``, the split's training and held-out files (written by ``prepare``) and ``--pretrained`` (a folder with
    a config.json, else ``pretrain_hint`` says how to make it). Returns (names, seeds, train file, held-out file)."""
    names = [n for n in a.runs.split(",") if n]
    unknown = [n for n in names if n not in runs]
    if unknown or not names:
        raise UsageError(f"--runs {a.runs}: unknown run {', '.join(unknown) or '(none)'}; choose from {', '.join(runs)}")
    try:
        seeds = [int(s) for s in a.seeds.split(",") if s.strip()]
    except ValueError:
        raise UsageError(f"--seeds {a.seeds}: give integers separated by commas, e.g. 0,1,2") from None
    train_file, dev_file = (Path(a.work) / f for f in splits[a.split])
    if not (train_file.is_file() and dev_file.is_file()):
        raise UsageError(f"{dev_file if train_file.is_file() else train_file} is missing: run "
                         f"'python benchmarks/{script} prepare{' --smoke' if a.smoke else ''}' first")
    if not (Path(a.pretrained) / "config.json").is_file():
        raise UsageError(f"--pretrained {a.pretrained} has no config.json: {pretrain_hint}")
    return names, seeds, train_file, dev_file


def experiment_parser(doc: str, name: str, out, pretrained, runs, splits, what: str, recipe: str):
    """The command line the run-and-score experiments share (dpo_experiment.py, sft_experiment.py): a ``phase``
    (prepare or run), ``--report``, ``--smoke``, ``--work``, ``--out``, ``--pretrained``, ``--seed``, ``--runs``,
    ``--seeds``, ``--split``, ``--threads``, ``--extra`` and ``--tag``; a script adds its own sizes. ``what``: the
    held-out items the dev and tune splits score (e.g. "pairs"); ``recipe``: the recipe ``--extra`` goes to."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n")[0])
    ap.add_argument("phase", nargs="?", choices=["prepare", "run"])
    ap.add_argument("--report", action="store_true", help="print the table of the results file")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes and a tiny random GPT-2: the pipeline in seconds")
    add_work_option(ap, name)
    ap.add_argument("--out", default=str(out))
    ap.add_argument("--pretrained", default=str(pretrained), help="the starting model (clm_cpu_experiment.py pretrain)")
    ap.add_argument("--seed", type=int, default=0, help="prepare: the seed of the shuffle and the users")
    ap.add_argument("--runs", default=",".join(runs))
    ap.add_argument("--seeds", default="0", help="run: the recipe's --seed for each run, e.g. 0,1,2")
    ap.add_argument("--split", choices=tuple(splits), default="dev",
                    help=f"dev: train on train.jsonl, score the held-out {what}; tune: train on the tune split, score "
                         f"its held-out {what} (for choosing defaults)")
    ap.add_argument("--threads", type=int, default=2, help="OMP_NUM_THREADS of each run and of the evaluation")
    ap.add_argument("--extra", default="", help=f"more {recipe} flags, one string")
    ap.add_argument("--tag", default="", help="a name for this configuration in the results file")
    return ap


def run_experiment(a, argv, phases: dict, report, smoke) -> None:
    """Run the parsed command ``a`` of :func:`experiment_parser`: ``--report``, or the phase (``phases[name](a)``)
    after ``smoke(a)`` under ``--smoke``; a :class:`UsageError` becomes one ``error:`` line and exit code 2."""
    a.argv = list(sys.argv[1:] if argv is None else argv)
    try:
        if a.report:
            return report(a.out)
        if a.phase is None:
            raise UsageError("give a phase (prepare or run) or --report")
        if a.smoke:
            smoke(a)
        phases[a.phase](a)
    except UsageError as exc:
        print(f"error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def work_dir(path: str | os.PathLike) -> str:
    """``path`` made (with its parents) and returned as a string."""
    os.makedirs(path, exist_ok=True)
    return os.fspath(path)


def rss_mb() -> float:
    """This process's resident set size in MB (``/proc/self/status``; NaN where there is none)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def timed_steps(step, steps: int) -> tuple[list[float], float]:
    """Run ``step()`` ``steps`` times: (each step's seconds, the peak RSS growth in MB over the RSS before the first),
    RSS sampled every 2 ms by a thread (``ru_maxrss`` would include loading the model)."""
    base = rss_mb()
    peak = [base]
    stop = threading.Event()

    def poll():
        while not stop.is_set():
            peak[0] = max(peak[0], rss_mb())
            time.sleep(0.002)

    th = threading.Thread(target=poll, daemon=True)
    th.start()
    times = []
    try:
        for _ in range(steps):
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    finally:
        stop.set()
        th.join()
    return times, peak[0] - base


def child_result(cmd: list[str], env: dict, label: str) -> dict:
    """Run a benchmark's child process (``cmd`` with ``env``) and return the JSON of its ``RESULT {...}`` line; an
    ``error:`` exit naming ``label`` with the end of its stderr when it printed none."""
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if line is None:
        raise SystemExit(f"error: {label} failed:\n{proc.stderr[-3000:]}")
    return json.loads(line[len("RESULT "):])


def append_row(path: str | os.PathLike, row: dict) -> None:
    """Append ``row`` to the JSON-lines file ``path`` and print it."""
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")
    print(json.dumps(row), flush=True)


def as_new_draw(trainer, batch) -> dict:
    """``batch`` (one collated micro-batch, timed again and again) as a new draw of ``trainer``'s Poisson loader:
    DPTrainer's step trains only on micro-batches its loader tagged, each once (hf_dp.run.step.check_drawn_by); a
    step-time benchmark feeds the same batch at every repetition, so each gets the tag of micro-batch 0 of a new
    logical draw (the counting a real loader does; nothing of the step's arithmetic changes)."""
    from hf_dp.run.data import _batch_rows
    from hf_dp.run.draws import DRAWN_KEY

    batch = {k: v for k, v in dict(batch).items() if k != DRAWN_KEY}
    trainer.dp.sampler.yielded += 1
    trainer.dp.sampler.logical += 1
    trainer.dp.contract.accumulating = None
    return {**batch, DRAWN_KEY: (trainer.dp.contract.loader_token, trainer.dp.sampler.yielded,
                                 trainer.dp.sampler.logical, 0, _batch_rows(batch))}
