"""Issue 53 item 5: DP supervised fine-tuning on conversations (``recipes/sft.py``) at CPU scale, from public text only
— the experiment that chooses sft.py's DP defaults on a public tune split, as clm.py's were (RESULTS §10b).

The starting model is the small GPT-2 pretrained on QNLI's *questions* only (``python benchmarks/clm_cpu_experiment.py
pretrain --corpus wiki --max_steps 300`` writes ``runs/clm_pretrained_questions``: 4 layers, 128 positions, the offline
MiniLM WordPiece tokenizer). The conversations ask a QNLI question and answer it with the Wikipedia sentence that
contains the answer, so the scored text (the assistant's) is in a register the model never saw:

1. ``prepare``: from ../shared/data/glue/QNLI (train.tsv + dev.tsv, read as clm_cpu_experiment.py reads them) the rows
   labelled ``entailment`` (the sentence answers the question), one conversation each, ``{"messages": [{"role":
   "user", "content": <question>}, {"role": "assistant", "content": <sentence>}]}``, with no question and no sentence
   in two conversations; shuffled (``--seed``) and cut into disjoint parts: ``train.jsonl`` (``--train_rows``) with a
   synthetic ``user_id`` (each made-up user gets 1 + Geometric(1/4) consecutive conversations, mean 4, as
   clm_cpu_experiment.py makes users: the users are made up), ``dev.jsonl`` (``--dev_rows``), and the tune split on
   which defaults are chosen — never on train or dev —: ``tune_train.jsonl`` (as many conversations, its own made-up
   users) and ``tune_dev.jsonl`` (as many as dev). **Sizes:** the shared QNLI folder holds 14,462 rows, 7,225 of them
   entailment, with 6,716 distinct sentences: not enough for issue 53's 2 × (4,000 + 500); the defaults are 3,000
   training and 300 held-out conversations per split (6,600 of them). About 0.7 % of the conversations are longer
   than the model's 128 positions: TRL cuts them (``--max_length 128``, the end of the answer is lost).
2. ``run --runs none,nonprivate,dp,dp_user --seeds 0,1,2 --split dev|tune [--tag T --extra "flags"]``: each run but
   ``none`` is ``recipes/sft.py`` as a subprocess from ``--pretrained`` (``--max_length 128``; the recipe's chat
   template for a tokenizer without one; the assistant's tokens scored): ``nonprivate`` = ``--disable_dp --optim
   adamw_torch`` with the fixed settings of clm_cpu_experiment.py's non-private reference (lr 2e-3, B 64 = 16 × 4, the
   recipe's 2 epochs, LoRA, constant schedule); ``dp`` = ε = 3 with the recipe's own defaults, one conversation per
   unit; ``dp_user`` = the same with ``--privacy_unit_column user_id``; ``--extra`` adds a candidate's flags to the DP
   runs only (the non-private reference stays fixed). ``none`` trains nothing: the starting model is scored here with the recipe's own
   pieces (its arguments, data loading, chat template, ``DPSFTTrainer.evaluate`` — what ``recipes/sft.py --do_train
   false`` does too), :func:`evaluate_model`, which also rescores every release (``eval_loss_rescored``: it agrees with
   the recipe's ``eval_loss``).
   The score: ``eval_loss``, TRL's evaluation loss on the held-out conversations (the mean cross-entropy per assistant
   token of each evaluation batch, as privacy.json's ``eval`` records it), and ``perplexity`` = exp(eval_loss).
   Each run appends one JSON line to ``benchmarks/results/sft_experiment.jsonl`` (perplexity, eval_loss, ε, σ, steps,
   B, N, unit, lr, optimizer, wall seconds, the exact command, the commit, the seed, the starting model's fingerprint).
3. ``--report``: per split, run and tag the seeds' perplexities, their mean, and for a DP run the share of the
   non-private gain it keeps, (none − DP)/(none − nonprivate) in perplexity, against the same split and starting model.

    python benchmarks/sft_experiment.py prepare
    python benchmarks/sft_experiment.py run --split tune --runs none,nonprivate --seeds 0    # the references
    python benchmarks/sft_experiment.py run --split tune --runs dp,dp_user --seeds 0 --tag defaults
    python benchmarks/sft_experiment.py run --split tune --runs dp,dp_user --seeds 0 --tag lr2e-3_linear \
        --extra "--learning_rate 2e-3 --lr_scheduler_type linear"                          # a candidate's flags
    python benchmarks/sft_experiment.py --report

Then the chosen defaults on the held-out conversations: ``run --split dev --runs none,nonprivate,dp,dp_user --seeds
0,1,2`` (with the chosen flags in the recipe, or ``--extra``).

``--smoke`` (tests/test_benchmark_smoke.py): a tiny random GPT-2 from a config (dpo_experiment.py's) stands in for the
pretrained folder, 16 conversations, one step per run, DP at q = 1.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import (REPO, UsageError, experiment_parser, git_commit, load_jsonl, relative,  # noqa: E402
                      run_experiment, run_inputs)
from clm_cpu_experiment import GLUE, LR, ROWS_B, _append, _tsv, _with_users, pretrained_id  # noqa: E402
from dpo_experiment import tiny_model  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "sft_experiment.jsonl"
PRETRAINED = REPO / "runs" / "clm_pretrained_questions"  # clm_cpu_experiment.py pretrain --corpus wiki writes it
MAX_LENGTH = 128  # the pretrained GPT-2's positions (clm_cpu_experiment.CONFIG: n_positions=128)
SPLITS = {"dev": ("train.jsonl", "dev.jsonl"), "tune": ("tune_train.jsonl", "tune_dev.jsonl")}
#: the non-private reference: clm_cpu_experiment.py's (lr 2e-3, B 64 = 16 × 4; the recipe's 2 epochs, LoRA), fixed
NONPRIVATE = ["--disable_dp", "--optim", "adamw_torch", *ROWS_B, *LR]
RUNS = {
    # name: recipes/sft.py flags (None: no training, the starting model scored as it is)
    "none": None,
    "nonprivate": NONPRIVATE,
    "dp": ["--epsilon", "3"],
    "dp_user": ["--epsilon", "3", "--privacy_unit_column", "user_id"],
}
DP_RUNS = ("dp", "dp_user")


# ----------------------------------------------------------------------------------------------- prepare


def conversations(rng: random.Random) -> list[dict]:
    """QNLI's entailment rows (train + dev) as conversations, no question or sentence twice, shuffled by ``rng``."""
    rows = [r for split in ("train", "dev") for r in _tsv(GLUE / "QNLI" / f"{split}.tsv") if r["label"] == "entailment"]
    pairs = sorted({(r["question"].strip(), r["sentence"].strip()) for r in rows
                    if r["question"].strip() and r["sentence"].strip()})
    seen_q, seen_s, out = set(), set(), []
    for q, s in pairs:
        if q not in seen_q and s not in seen_s:
            seen_q.add(q)
            seen_s.add(s)
            out.append({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": s}]})
    rng.shuffle(out)
    return out


def prepare(a) -> None:
    work = Path(a.work)
    for name in ("train.tsv", "dev.tsv"):
        if not (GLUE / "QNLI" / name).is_file():
            raise UsageError(f"QNLI not found: {GLUE / 'QNLI' / name} is missing (the shared GLUE folder)")
    rng = random.Random(a.seed)
    convs = conversations(rng)
    n, m = a.train_rows, a.dev_rows
    if 2 * (n + m) > len(convs):
        raise UsageError(f"--train_rows {n} --dev_rows {m}: QNLI's entailment rows give {len(convs):,} distinct "
                         f"conversations, fewer than 2 × ({n:,} + {m:,}) (train, dev, tune train, tune dev)")
    work.mkdir(parents=True, exist_ok=True)
    train, users = _with_users(convs[:n], rng)
    dev = convs[n: n + m]
    tune_train, tune_users = _with_users(convs[n + m: 2 * n + m], random.Random(a.seed + 1))
    tune_dev = convs[2 * n + m: 2 * (n + m)]
    for name, data in (("train.jsonl", [{**r["text"], "user_id": r["user_id"]} for r in train]), ("dev.jsonl", dev),
                       ("tune_train.jsonl", [{**r["text"], "user_id": r["user_id"]} for r in tune_train]),
                       ("tune_dev.jsonl", tune_dev)):
        with open(work / name, "w", encoding="utf-8") as f:
            for r in data:
                f.write(json.dumps(r) + "\n")
    info = {"phase": "prepare", "conversations": len(convs), "train_rows": len(train), "train_users": users,
            "dev_rows": len(dev), "tune_train_rows": len(tune_train), "tune_users": tune_users,
            "tune_dev_rows": len(tune_dev), "seed": a.seed, "smoke": a.smoke}
    (work / "prepare_info.json").write_text(json.dumps(info, indent=1))
    print(f"{len(convs):,} distinct QNLI entailment conversations: train {len(train):,} of {users:,} synthetic users; "
          f"dev {len(dev):,}; tune split {len(tune_train):,} of {tune_users:,} users, tune dev {len(tune_dev):,}")


# ----------------------------------------------------------------------------------------------- evaluation


def evaluate_model(model: str, train_file, dev_file, out_dir, seed: int) -> dict:
    """TRL's evaluation of the causal LM in folder ``model`` on ``dev_file``'s conversations, as recipes/sft.py
    evaluates after training (its arguments and defaults, data loading, chat template, loss scope, DPSFTTrainer's
    ``evaluate``), without training (as `recipes/sft.py --do_train false`, in-process). Non-private: nothing is trained."""
    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    import transformers

    from hf_dp.run.data import no_progress_bar
    from hf_dp.sft import DPSFTTrainer
    from hf_dp.sft.config import resolve_loss_scope
    from recipes import sft
    from recipes.clm_support import build_model
    from recipes.clm_support.trl import load_trl_config_and_tokenizer, load_trl_data

    data_args, model_args, args = sft.parse_args(
        ["--model_name_or_path", str(model), "--train_file", str(train_file), "--validation_file", str(dev_file),
         "--output_dir", str(out_dir), "--seed", str(seed), "--max_length", str(MAX_LENGTH), "--disable_dp",
         "--optim", "adamw_torch", "--disable_tqdm", "true", "--report_to", "none"])
    transformers.set_seed(args.seed)
    with no_progress_bar():  # 🤗 Datasets' bars of TRL's preparation
        train, dev, _ = load_trl_data(data_args, args, lambda ds, what: sft._check_columns(ds, args, what))
        clm_args, config, tokenizer, path = load_trl_config_and_tokenizer(model_args, args)
        if getattr(tokenizer, "chat_template", None) is None:  # as the recipe: its template (a release ships its own)
            tokenizer.chat_template = sft.DEFAULT_CHAT_TEMPLATE
        resolve_loss_scope(args, train[0], tokenizer)
        # one training row (DPSFTTrainer reads the data kind from it; nothing is trained)
        trainer = DPSFTTrainer(model=build_model(clm_args, config, tokenizer, path), args=args,
                               train_dataset=train.select([0]), eval_dataset=dev, processing_class=tokenizer)
        metrics = trainer.evaluate()
    metrics["eval_conversations"] = len(dev)
    return metrics


# ----------------------------------------------------------------------------------------------- runs


def _from_privacy(rep: dict) -> dict:
    ev = rep.get("eval") or {}
    opt = rep.get("optimizer") or {}
    return dict(eval_loss=ev.get("eval_loss"), epsilon=rep.get("epsilon"), sigma=rep.get("noise_multiplier"),
                steps=rep.get("steps"), expected_batch_size=rep.get("expected_batch_size"),
                dataset_size=rep.get("dataset_size"), unit=(rep.get("privacy_unit") or {}).get("column"),
                trainable=(rep.get("trainable") or {}).get("mode"),
                trainable_params=(rep.get("trainable") or {}).get("trainable_params"), optimizer=opt.get("name"),
                learning_rate=(opt.get("hyperparameters") or {}).get("lr"), max_grad_norm=rep.get("max_grad_norm"),
                epochs=rep.get("epochs"), scored_tokens=(rep.get("sft") or {}).get("scored_tokens"),
                eval_token_accuracy=ev.get("eval_mean_token_accuracy"))


def _flag(parts: list[str], name: str, default=None):
    """The last value given to ``name`` in ``parts`` (a later flag overrides an earlier one)."""
    idx = [i for i, p in enumerate(parts) if p == name and i + 1 < len(parts)]
    return parts[idx[-1] + 1] if idx else default


def run(a) -> None:
    import torch

    work = Path(a.work)
    names, seeds, train_file, dev_file = run_inputs(
        a, RUNS, SPLITS, "sft_experiment.py", "run 'python benchmarks/clm_cpu_experiment.py prepare --corpus wiki' and "
        "'pretrain --corpus wiki --max_steps 300' first (they write runs/clm_pretrained_questions)")
    torch.set_num_threads(a.threads)
    fingerprint = pretrained_id(a.pretrained)
    train_rows = load_jsonl(train_file)
    for seed in seeds:
        for name in names:
            flags = RUNS[name]
            out_dir = work / (f"{a.split}_{name}" + (f"_{a.tag}" if a.tag else "") + f"_s{seed}")
            shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run (recipes refuse another run's checkpoints)
            row = {"phase": "run", "run": name, "seed": seed, "split": a.split, "tag": a.tag, "smoke": a.smoke,
                   "pretrained": fingerprint, "commit": git_commit(),
                   "script_command": relative(" ".join(["benchmarks/sft_experiment.py", *a.argv]))}
            t0 = time.time()
            if flags is None:  # no training: the starting model, scored as the recipe scores a release
                metrics = evaluate_model(a.pretrained, train_file, dev_file, out_dir, seed)
                shutil.rmtree(out_dir, ignore_errors=True)  # nothing was saved there
                row.update(returncode=0, command=None, steps=0, eval_loss=metrics["eval_loss"],
                           eval_token_accuracy=metrics.get("eval_mean_token_accuracy"),
                           eval_conversations=metrics["eval_conversations"], wall_s=round(time.time() - t0, 1))
            else:
                extra = list(flags)
                if name in DP_RUNS:
                    extra += a.extra.split()
                if a.smoke:  # DP: q = 1 (σ calibrated in milliseconds), the logical batch is every unit; 4 rows else
                    units = len({r["user_id"] for r in train_rows}) if "--privacy_unit_column" in flags else len(train_rows)
                    extra += ["--per_device_train_batch_size", str(units if "--epsilon" in flags else 4),
                              "--gradient_accumulation_steps", "1", "--max_steps", "1"]
                cmd = [sys.executable, str(REPO / "recipes" / "sft.py"), "--model_name_or_path", str(a.pretrained),
                       "--train_file", str(train_file), "--validation_file", str(dev_file),
                       "--output_dir", str(out_dir), "--seed", str(seed), "--max_length", str(MAX_LENGTH),
                       "--disable_tqdm", "true", "--report_to", "none", *extra]
                env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(a.threads))
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
                row.update(returncode=proc.returncode, wall_s=round(time.time() - t0, 1),
                           command=relative(" ".join(cmd[1:])),
                           lr_scheduler_type=_flag(cmd, "--lr_scheduler_type", "constant (the recipe's default)"))
                release = out_dir / "release"
                if proc.returncode != 0 or not (release / "privacy.json").is_file():
                    row["stderr_tail"] = relative(proc.stderr[-1500:])
                    _append(a.out, row)
                    print(json.dumps({k: v for k, v in row.items() if k != "stderr_tail"}), flush=True)
                    print(row["stderr_tail"], file=sys.stderr)
                    continue
                row.update(_from_privacy(json.loads((release / "privacy.json").read_text())))
                if name not in DP_RUNS:  # non-private: privacy.json has no B or N; the command's batch, the rows
                    row.update(expected_batch_size=int(_flag(cmd, "--per_device_train_batch_size"))
                               * int(_flag(cmd, "--gradient_accumulation_steps")), dataset_size=len(train_rows))
                t1 = time.time()  # the release scored again as run none scores the starting model: the same scale
                again = evaluate_model(str(release), train_file, dev_file, work / f"{out_dir.name}_rescore", seed)
                row.update(eval_loss_rescored=again["eval_loss"], eval_conversations=again["eval_conversations"],
                           rescore_s=round(time.time() - t1, 1))
                shutil.rmtree(work / f"{out_dir.name}_rescore", ignore_errors=True)
            row["perplexity"] = math.exp(min(row["eval_loss"], 50)) if row.get("eval_loss") is not None else None
            _append(a.out, row)
            print(json.dumps(row), flush=True)


# ----------------------------------------------------------------------------------------------- report


def _fmt(v, d=2) -> str:
    return "—" if v is None else f"{v:,.{d}f}"


def _sig(v) -> str:
    return "—" if v is None else f"{v:g}"


def report(path) -> None:
    rows = [r for r in load_jsonl(path) if r.get("phase") == "run" and r.get("returncode") == 0
            and r.get("perplexity") is not None]
    latest = {}  # the latest row of each (split, smoke, starting model, run, tag, seed)
    for r in rows:
        latest[(r["split"], bool(r.get("smoke")), r.get("pretrained"), r["run"], r.get("tag") or "", r["seed"])] = r
    groups = dict.fromkeys(k[:3] for k in latest)
    if not groups:
        print(f"no finished runs in {path}")
        return
    for g in groups:
        sel = {k[3:]: r for k, r in latest.items() if k[:3] == g}
        # the references of the split: run none (any tag, deterministic: the latest), the fixed non-private run per seed
        nones = [r for (n, _, _), r in sel.items() if n == "none"]
        none = nones[-1]["perplexity"] if nones else None
        nonprivate = {}  # per seed: the untagged run first (its settings are fixed), else a tagged one
        for (n, t, s), r in sorted(sel.items(), key=lambda kv: bool(kv[0][1])):
            if n == "nonprivate":
                nonprivate.setdefault(s, r["perplexity"])
        print(f"\nsplit {g[0]}" + (" (smoke)" if g[1] else "") + f", starting model {g[2]}: held-out assistant-token "
              f"perplexity (exp eval_loss); gain kept = (none − DP)/(none − nonprivate), same seed, and of the means")
        print("| run | tag | seeds | perplexity per seed | mean | gain kept (per seed; of the means) | ε | σ | steps | B "
              "| N | unit | lr | optimizer | wall (s) |")
        print("| --- " * 15 + "|")
        for run_name, tag in dict.fromkeys((n, t) for n, t, _ in sel):
            one = [sel[(run_name, tag, s)] for s in sorted(s for n, t, s in sel if (n, t) == (run_name, tag))]
            ppl = [r["perplexity"] for r in one]
            mean = statistics.fmean(ppl)
            gain = "—"
            if run_name in DP_RUNS and none is not None:
                per = [f"{100 * (none - r['perplexity']) / (none - nonprivate[r['seed']]):.0f} %"
                       if r["seed"] in nonprivate and none > nonprivate[r["seed"]] else "—" for r in one]
                same = [nonprivate[r["seed"]] for r in one if r["seed"] in nonprivate]  # the DP run's seeds
                np_mean = statistics.fmean(same) if same else None
                of_means = f"{100 * (none - mean) / (none - np_mean):.0f} %" if np_mean and none > np_mean else "—"
                gain = f"{' / '.join(per)}; {of_means}"
            last = one[-1]
            print(f"| {run_name} | {tag or '—'} | {', '.join(str(r['seed']) for r in one)} | "
                  f"{' / '.join(_fmt(p) for p in ppl)} | **{_fmt(mean)}** | {gain} | {_fmt(last.get('epsilon'))} | "
                  f"{_fmt(last.get('sigma'), 3)} | {last.get('steps') if last.get('steps') is not None else '—'} | "
                  f"{_fmt(last.get('expected_batch_size'), 0)} | {last.get('dataset_size') or '—'} | "
                  f"{last.get('unit') or ('row' if run_name in DP_RUNS else '—')} | "
                  f"{_sig(last.get('learning_rate'))} | "
                  f"{last.get('optimizer') or '—'} | {_fmt(statistics.fmean(r['wall_s'] for r in one), 0)} |")


# ----------------------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, "sft_experiment", OUT, PRETRAINED, RUNS, SPLITS, "conversations", "recipes/sft.py "
                           "(the DP runs: dp, dp_user)")
    ap.add_argument("--train_rows", type=int, default=3000, help="training conversations (the tune split's too)")
    ap.add_argument("--dev_rows", type=int, default=300, help="held-out conversations (the tune split's too)")
    a = ap.parse_args(argv)

    def smoke(a):
        a.train_rows, a.dev_rows, a.threads = 16, 8, 1
        if a.pretrained == str(PRETRAINED):
            a.pretrained = str(Path(a.work) / "tiny_gpt2")
        if a.phase == "prepare":
            tiny_model(a.pretrained)

    run_experiment(a, argv, {"prepare": prepare, "run": run}, report, smoke)


if __name__ == "__main__":
    main()
