"""How the main job's defaults were chosen (issue 16 §1): epochs, batch and learning rate, on a tune split of QNLI *train*.

The main job (``recipes/qnli.py --optim dp_adamw --epsilon 3``: all-MiniLM-L6-v2, last block + pooler + head, frozen
prefix cached, C = 0.1, δ = 1e-5, PRV) gets its logical batch from the planner (``hf_dp.plan.recommend``) at a number
of epochs E. What is left is E (the compute budget) and the learning rate. This script trains on a *fit* part of the
QNLI training rows and scores on a *tune* part carved from the same training rows (``train_test_split(0.1, seed=0)``,
as ``qnli_optimizers.py``); GLUE dev is also scored and recorded, but never used to choose anything.

Each row: E, the planner's B for the fit set's N at E, lr, seed → tune/dev accuracy, ε, σ, steps, training seconds.
Results are appended to ``--out`` as JSON lines as each run finishes (a rerun skips finished rows); ``--report``
prints the markdown table.

    nohup python benchmarks/main_job_tuning.py --epochs 10,20 --lrs 1e-3,3e-3,1e-2,3e-2 &
    python benchmarks/main_job_tuning.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
if str(REPO) not in sys.path:  # recipes.glue_support: the recipes' GLUE data and metrics
    sys.path.append(str(REPO))
from bench_io import add_work_option, git_commit, load_jsonl  # noqa: E402
DEFAULT_OUT = REPO / "benchmarks" / "results" / "main_job_tuning.jsonl"



def _key(r: dict) -> tuple:
    return (r["task"], r.get("trainable", "last_block"), bool(r.get("full_train")), r["epochs"], r["lr"], r["seed"],
            r["epsilon_target"], r.get("scheduler", "constant"), r.get("sigma_target"),
            None if r.get("full_train") else r.get("tune_split", "rows"), bool(r.get("group_by_length")), r.get("C", 0.1),
            r.get("noise_mechanism", "independent"), r.get("noise_bands", 1))


TUNE_SENTENCES = 1000


def sentence_split(train, n_tune: int, seed: int = 0):
    """A tune split of SST-2 *train* that looks like GLUE dev: ``n_tune`` whole sentences, none of whose phrases is left
    in the fit part.

    SST-2's training rows are every labelled phrase of each training sentence (67,349 rows from ~8k sentences), and dev
    holds whole sentences only. A random row split (``rows``) leaves most phrases of a tune row in fit, so its accuracy
    rewards memorising phrases (clip-only training: 89.5 % tune, 83.6 % dev). Here the tune rows are sentences (rows
    that occur in no other row, drawn at random), and every fit row that is a substring of one of them is dropped (a
    conservative cut: a common phrase that is also part of a fit sentence goes too). Only the training rows' text is
    read; dev is not involved."""
    import random

    text = [t.strip() for t in train["sentence"]]
    every = "\n".join(text)
    order = list(range(len(text)))
    random.Random(seed).shuffle(order)
    tune: list[int] = []
    for i in order:  # a row that occurs once in the whole text is in no other row: a whole sentence
        if every.count(text[i]) == 1:
            tune.append(i)
            if len(tune) == n_tune:
                break
    held = "\n".join(text[i] for i in tune)
    fit = [i for i in range(len(text)) if text[i] not in held]
    return train.select(fit), train.select(sorted(tune))


class Data:
    """Tokenized fit / tune / GLUE-dev splits (fit + tune carved from train, or ``full_train``: fit = every training
    row, no tune split), with their frozen-prefix caches when the trainable set allows one."""

    def __init__(self, task: str, max_length: int, tune_fraction: float, *, trainable: str, full_train: bool = False,
                 tune_split: str = "rows", max_rows: int | None = None, model: str | None = None):
        import datasets
        from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

        from hf_dp.models import apply_trainable, suffix_blocks
        from hf_dp.models.prefix_cache import build_prefix_cache
        from recipes.glue_support import load_raw_datasets, preprocess
        from qnli_optimizers import SHARED, _minilm_path

        self.task = task
        self.model = _minilm_path(model)
        tok = AutoTokenizer.from_pretrained(self.model)
        self.collator = DataCollatorWithPadding(tok)
        raw = load_raw_datasets(task_name=task, data_dir=str(SHARED / "data" / "glue"))
        parts = {"validation": raw["validation"]}
        if full_train:
            parts["train"] = raw["train"]
        elif tune_split == "sentences":
            parts["train"], parts["tune"] = sentence_split(raw["train"], TUNE_SENTENCES)
        else:
            split = raw["train"].train_test_split(test_size=tune_fraction, seed=0)
            parts["train"], parts["tune"] = split["train"], split["test"]
        if max_rows:  # a smoke run: the first rows of each split
            parts = {k: v.select(range(min(max_rows, len(v)))) for k, v in parts.items()}
        tokd = {k: preprocess(datasets.DatasetDict({"validation": v}), tok, task_name=task, max_seq_length=max_length)["validation"]
                for k, v in parts.items()}
        t0 = time.time()
        k = suffix_blocks(trainable)  # None: no frozen prefix to cache (all, lora, bias)
        cache = k is not None
        if cache:
            model, _ = apply_trainable(AutoModelForSequenceClassification.from_pretrained(self.model, num_labels=2), trainable)
            tokd = {name: build_prefix_cache(model, v, self.collator, batch_size=128, progress=True, name=name, suffix_blocks=k)
                    for name, v in tokd.items()}
        self.cache_seconds = time.time() - t0
        self.tune_split = None if full_train else tune_split
        self.train, self.tune, self.dev = tokd["train"], tokd.get("tune"), tokd["validation"]
        self.cached = cache
        self.sizes = {k: len(v) for k, v in tokd.items()}


def run_one(data, *, work: str, epochs: float, lr: float, seed: int, epsilon: float, params: int, trainable: str = "last_block",
            scheduler: str = "constant", sigma: float | None = None, group_by_length: bool = False, C: float = 0.1,
            noise_mechanism: str = "independent", noise_bands: int = 1) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification

    from hf_dp import DPTrainer, DPTrainingArguments
    from hf_dp.plan import recommend, split_batch
    from recipes.glue_support import build_compute_metrics

    n = len(data.train)
    plan = recommend(n, epsilon, 1e-5, params, epochs=epochs)  # B stays the planner's at epsilon, with or without sigma
    per_device, accum = split_batch(plan.batch_size)
    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(data.model, num_labels=2)
    args = DPTrainingArguments(
        output_dir=f"{work}/{epochs}_{lr}_{seed}", per_device_train_batch_size=per_device,
        gradient_accumulation_steps=accum, per_device_eval_batch_size=256, num_train_epochs=epochs,
        learning_rate=lr, weight_decay=1e-5, lr_scheduler_type=scheduler, warmup_steps=0,
        logging_steps=10, save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True, seed=seed,
        disable_tqdm=True, cache_frozen_features=data.cached, trainable=trainable, dataloader_num_workers=0,
        train_sampling_strategy="group_by_length" if group_by_length else "random",
        optim="dp_adamw", delta=1e-5, per_sample_max_grad_norm=C, dp_seed=seed,
        noise_mechanism=noise_mechanism, **({"noise_bands": noise_bands} if noise_mechanism != "independent" else {}),
        # a tiny sigma is beyond the PRV accountant's grid (it runs out of memory); RDP reports a huge, finite epsilon
        **({"epsilon": epsilon} if sigma is None else {"noise_multiplier": sigma, "accountant": "rdp"}),
    )
    trainer = DPTrainer(model=model, args=args, train_dataset=data.train, compute_metrics=build_compute_metrics(data.task),
                        data_collator=None if data.cached else data.collator)
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    tune = trainer.evaluate(eval_dataset=data.tune, metric_key_prefix="tune") if data.tune is not None else {}
    dev = trainer.evaluate(eval_dataset=data.dev, metric_key_prefix="dev")
    rep = trainer.privacy_report()
    return {
        "task": data.task, "trainable": trainable, "full_train": data.tune is None, "epochs": epochs, "batch": plan.batch_size,
        "lr": lr, "scheduler": scheduler, "seed": seed, "epsilon_target": epsilon if sigma is None else None,
        "sigma_target": sigma, "params": params, "tune_split": data.tune_split, "group_by_length": group_by_length, "C": C,
        "noise_mechanism": noise_mechanism, "noise_bands": noise_bands,
        "tune_accuracy": tune.get("tune_accuracy"), "dev_accuracy": dev["dev_accuracy"], "train_seconds": train_s,
        "steps": trainer.state.global_step, "epsilon": rep["epsilon"], "sigma": rep["noise_multiplier"],
        "sizes": data.sizes, "commit": git_commit(),
    }


def report(out: str) -> None:
    rows = load_jsonl(out)
    print("| task | trainable | tune split | train rows | E | B (planner) | steps | σ | lr | schedule | seeds | tune acc % | "
          "GLUE dev acc % | train s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    groups: dict = {}
    for r in rows:
        split = "— (all train)" if r.get("full_train") else r.get("tune_split", "rows")
        if r.get("C", 0.1) != 0.1:
            split += f", C = {r['C']:g}"
        if r.get("group_by_length"):
            split += ", grouped by length"
        if r.get("noise_mechanism", "independent") != "independent":
            split += f", {r['noise_mechanism']} b = {r['noise_bands']}"
        if r.get("sigma_target") is not None:
            split += f", σ = {r['sigma_target']:g} (diagnostic, not private)"
        groups.setdefault((r["task"], r.get("trainable", "last_block"), split, r["epochs"], r["lr"],
                           r.get("scheduler", "constant"), str(r["epsilon_target"])), []).append(r)
    sd = lambda xs: f" ± {statistics.stdev(xs):.1f}" if len(xs) > 1 else ""  # noqa: E731
    for (task, trainable, split, e, lr, sched, _eps), g in sorted(groups.items(), key=lambda kv: kv[0][:6]):
        tune = [100 * r["tune_accuracy"] for r in g if r.get("tune_accuracy") is not None]
        dev = [100 * r["dev_accuracy"] for r in g]
        print(f"| {task} | {trainable} | {split} | {g[0]['sizes']['train']:,} | {e:g} | {g[0]['batch']} | {g[0]['steps']} | "
              f"{g[0]['sigma']:.3f} | {lr:g} | {sched} | {','.join(str(r['seed']) for r in g)} | "
              f"{(f'{statistics.mean(tune):.1f}' + sd(tune)) if tune else '—'} | {statistics.mean(dev):.1f}{sd(dev)} | "
              f"{statistics.mean(r['train_seconds'] for r in g):.0f} |")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="qnli")
    ap.add_argument("--epochs", default="10,20")
    ap.add_argument("--lrs", default="1e-3,3e-3,1e-2,3e-2")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--epsilon", type=float, default=3.0)
    ap.add_argument("--max_length", type=int, default=128)
    ap.add_argument("--noise_multiplier", type=float, default=None,
                    help="diagnostic only: this sigma instead of --epsilon's (e.g. 1e-6 to measure what clipping alone "
                    "costs); B stays the planner's at --epsilon; the row's epsilon_target is None")
    ap.add_argument("--trainable", default="last_block", help="last_block, last_k:K and head are cached; all and lora are not")
    ap.add_argument("--scheduler", default="constant", help="HF lr_scheduler_type (constant, linear, cosine, ...)")
    ap.add_argument("--full_train", action="store_true", help="train on every training row (no tune split): final runs "
                    "of a configuration already chosen on the tune split")
    ap.add_argument("--tune_split", default="rows", choices=["rows", "sentences"],
                    help="rows: 10%%%% of the training rows at random; sentences (SST-2): %d whole training sentences with "
                    "none of their phrases left in fit (see sentence_split)" % TUNE_SENTENCES)
    ap.add_argument("--C", type=float, default=0.1, help="per_sample_max_grad_norm (the main job's C = 0.1)")
    ap.add_argument("--group_by_length", action="store_true",
                    help="--train_sampling_strategy group_by_length: each Poisson draw ordered by length before it is cut "
                         "into micro-batches (same draws and noise, less padding)")
    ap.add_argument("--noise_mechanism", default="independent", choices=["independent", "banded_sqrt"],
                    help="DPTrainingArguments.noise_mechanism (issue 52: banded correlated noise with cyclic Poisson)")
    ap.add_argument("--noise_bands", type=int, default=1, help="the bands b of --noise_mechanism banded_sqrt")
    ap.add_argument("--max_rows", type=int, default=None, help="smoke runs only: keep the first N rows of each split")
    ap.add_argument("--model", default=None, help="smoke runs only: a model folder instead of all-MiniLM-L6-v2")
    ap.add_argument("--out", default=str(DEFAULT_OUT))
    add_work_option(ap, "main_job_tuning")
    ap.add_argument("--report", action="store_true")
    a = ap.parse_args(argv)
    if a.tune_split == "sentences" and a.task != "sst2":
        ap.error("--tune_split sentences is for SST-2 (rows that are phrases of sentences); use rows for other tasks")
    if a.report:
        report(a.out)
        return
    from transformers import AutoModelForSequenceClassification

    from hf_dp.models import apply_trainable
    from qnli_optimizers import _minilm_path

    params = apply_trainable(AutoModelForSequenceClassification.from_pretrained(_minilm_path(a.model), num_labels=2),
                             a.trainable)[1].num_trainable
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    done = {_key(r) for r in load_jsonl(a.out)}
    bands = a.noise_bands if a.noise_mechanism != "independent" else 1  # as run_one records it (independent: b = 1)
    data = Data(a.task, a.max_length, 0.1, trainable=a.trainable, full_train=a.full_train, tune_split=a.tune_split,
                max_rows=a.max_rows, model=a.model)
    print(f"data {data.sizes}, cached: {data.cached} ({data.cache_seconds:.0f}s); d = {params}", flush=True)
    for e in [float(x) for x in a.epochs.split(",")]:
        for lr in [float(x) for x in a.lrs.split(",")]:
            for seed in [int(s) for s in a.seeds.split(",")]:
                eps_t = a.epsilon if a.noise_multiplier is None else None
                if (a.task, a.trainable, a.full_train, e, lr, seed, eps_t, a.scheduler, a.noise_multiplier,
                        None if a.full_train else a.tune_split, a.group_by_length, a.C, a.noise_mechanism, bands) in done:
                    continue
                rec = run_one(data, work=a.work, epochs=e, lr=lr, seed=seed, epsilon=a.epsilon, params=params, trainable=a.trainable,
                              scheduler=a.scheduler, sigma=a.noise_multiplier, group_by_length=a.group_by_length, C=a.C,
                              noise_mechanism=a.noise_mechanism, noise_bands=bands)
                with open(a.out, "a") as f:
                    f.write(json.dumps(rec) + "\n")
                print(json.dumps({k: rec[k] for k in ("epochs", "batch", "lr", "seed", "tune_accuracy", "dev_accuracy",
                                                      "epsilon", "train_seconds")}), flush=True)


if __name__ == "__main__":
    main()
