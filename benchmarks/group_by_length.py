"""What ``--train_sampling_strategy group_by_length`` saves: DP step time with each Poisson draw ordered by length
before it is cut into micro-batches, against the default order, side by side in one process.

Real GLUE rows (the first ``--rows`` training rows of ``--task``), all-MiniLM-L6-v2 with the frozen prefix cached
below ``--trainable``, the planner's split of B = ``--batch`` into 64-row micro-batches, dp_adamw, C = 0.1, a fixed
σ = 1 (RDP; no calibration: the step is what is timed). For each repetition the two orders run ``--steps`` steps each,
alternating which goes first, after one unrecorded warm-up step of each; both use the same ``--dp_seed``, so they draw the same rows. Recorded per run: seconds
per step (HF's train_runtime / steps) and the padded positions the model saw per step against the real tokens.

    python benchmarks/group_by_length.py --task sst2 --trainable last_k:2 --out benchmarks/results/group_by_length.jsonl
    python benchmarks/group_by_length.py --report --out benchmarks/results/group_by_length.jsonl
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
if str(REPO) not in sys.path:  # recipes.glue_support: the recipes' GLUE data and metrics
    sys.path.append(str(REPO))
from bench_io import add_work_option, git_commit, load_jsonl, results_cli  # noqa: E402

DEFAULT_OUT = REPO / "benchmarks" / "results" / "group_by_length.jsonl"
MODES = ("random", "group_by_length")


def run(a) -> None:
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

    from hf_dp import DPTrainer, DPTrainingArguments
    from hf_dp.models import apply_trainable, suffix_blocks
    from hf_dp.models.prefix_cache import build_prefix_cache
    from hf_dp.plan import split_batch
    from recipes.glue_support import load_raw_datasets, preprocess
    from qnli_optimizers import SHARED, _minilm_path

    tok = AutoTokenizer.from_pretrained(_minilm_path(a.model))
    raw = load_raw_datasets(task_name=a.task, data_dir=str(SHARED / "data" / "glue"))["train"]
    raw = raw.select(range(min(a.rows, len(raw))))
    tokd = preprocess(datasets.DatasetDict({"validation": raw}), tok, task_name=a.task, max_seq_length=128)["validation"]
    base = lambda: AutoModelForSequenceClassification.from_pretrained(_minilm_path(a.model), num_labels=2)  # noqa: E731
    model, _ = apply_trainable(base(), a.trainable)
    cache = build_prefix_cache(model, tokd, DataCollatorWithPadding(tok), batch_size=128, progress=False,
                               suffix_blocks=suffix_blocks(a.trainable))
    per_device, accum = split_batch(a.batch)
    runs = [(None, m) for m in MODES] + [(rep, m) for rep in range(a.reps) for m in (MODES if rep % 2 == 0 else MODES[::-1])]
    for rep, mode in runs:  # rep None: a warm-up run of each order (one step, not recorded)
        torch.manual_seed(0)
        model = base()
        seen = {"positions": 0, "tokens": 0}

        def count(_m, _args, kwargs):
            if _m.training:
                mask = kwargs["attention_mask"]
                seen["positions"] += mask.numel()
                seen["tokens"] += int(mask.sum())

        model.register_forward_pre_hook(count, with_kwargs=True)
        args = DPTrainingArguments(
            output_dir=f"{a.work}/{mode}", per_device_train_batch_size=per_device,
            gradient_accumulation_steps=accum, max_steps=1 if rep is None else a.steps, learning_rate=1e-3, save_strategy="no",
            eval_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
            cache_frozen_features=True, trainable=a.trainable, optim="dp_adamw", per_sample_max_grad_norm=0.1,
            noise_multiplier=1.0, accountant="rdp", delta=1e-5, dp_seed=1, train_sampling_strategy=mode,
            logging_steps=a.steps,
        )
        trainer = DPTrainer(model=model, args=args, train_dataset=cache)
        out = trainer.train()
        if rep is None:
            continue
        rec = {"task": a.task, "trainable": a.trainable, "rows": len(cache), "batch": a.batch, "mode": mode,
               "rep": rep, "steps": trainer.state.global_step,
               "seconds_per_step": out.metrics["train_runtime"] / trainer.state.global_step,
               "positions_per_step": seen["positions"] / trainer.state.global_step,
               "tokens_per_step": seen["tokens"] / trainer.state.global_step, "commit": git_commit()}
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(json.dumps(rec), flush=True)


def report(out: str) -> None:
    rows = load_jsonl(out)
    print("| task | trainable | B | steps × reps | s/step random | s/step grouped | grouped / random | padded positions "
          "per step random → grouped (real tokens) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    groups: dict = {}
    for r in rows:
        groups.setdefault((r["task"], r["trainable"], r["batch"], r["commit"]), []).append(r)
    for (task, trainable, b, _c), g in groups.items():
        by = {m: [r for r in g if r["mode"] == m] for m in MODES}
        if not all(by.values()):
            continue
        med = {m: statistics.median(r["seconds_per_step"] for r in by[m]) for m in MODES}
        pos = {m: statistics.mean(r["positions_per_step"] for r in by[m]) for m in MODES}
        print(f"| {task} | {trainable} | {b} | {by['random'][0]['steps']} × {len(by['random'])} | {med['random']:.2f} | "
              f"{med['group_by_length']:.2f} | **{med['group_by_length'] / med['random']:.2f}×** | "
              f"{pos['random']:,.0f} → {pos['group_by_length']:,.0f} ({statistics.mean(r['tokens_per_step'] for r in g):,.0f}) |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="sst2")
    ap.add_argument("--trainable", default="last_k:2")
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--batch", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--model", default=None, help="smoke runs only: a model folder instead of all-MiniLM-L6-v2")
    add_work_option(ap, "group_by_length")
    a = results_cli(ap, DEFAULT_OUT, report, argv)
    if a is None:
        return
    run(a)


if __name__ == "__main__":
    main()
