"""Small helpers shared by the benchmark scripts: JSON-lines result files, their --out/--report options, the --work
folder their runs write under, and the commit a row ran on."""

from __future__ import annotations

import json
import os
import subprocess
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
