"""Issue 29 §5: private fine-tuning of a causal LM at CPU scale, with the unit of privacy a row or a (synthetic) user.

No pretrained causal LM can be downloaded here, so the experiment builds one:

1. ``prepare``: public text = the questions and Wikipedia sentences of QNLI (train + dev, ../shared/data/glue/QNLI);
   private text = SST-2's movie-review sentences (a seeded subset of train, ``--private_rows``), written as
   ``train.jsonl`` (4,000 sentences by default: a DP step of this 30k-vocabulary model takes seconds on this CPU) with a
   synthetic ``user_id`` (each user gets 1 + Geometric(p = 1/4) sentences, mean 4, seeded: the
   users are made up, and said so), and SST-2 dev as ``dev.jsonl``.
2. ``pretrain``: a small GPT-2 (``--config``; the offline MiniLM WordPiece tokenizer) trained non-privately on the
   public text with plain ``transformers.Trainer`` (blocks packed across sentences: it is public), saved to
   ``runs/clm_pretrained`` (not committed).
3. ``finetune``: ``recipes/clm.py`` from that folder on the private text — no fine-tuning (evaluation only),
   non-private, DP ε = 3 row-level, DP ε = 3 user-level — each writing a row (dev perplexity, ε, σ, steps, wall time,
   command) to the results file as it finishes.

    python benchmarks/clm_cpu_experiment.py prepare
    python benchmarks/clm_cpu_experiment.py pretrain
    python benchmarks/clm_cpu_experiment.py finetune --runs none,nonprivate,row,user
    python benchmarks/clm_cpu_experiment.py --report
    python benchmarks/clm_cpu_experiment.py --calibration   # the DP runs beside the planner's causal-LM verdict

Each fine-tuning row records the pretrained model's fingerprint (``pretrained``: its weights' SHA-256, 16 hex digits)
and the public quantities of the planner's causal-LM verdict (d = ``trainable_params``, ``optimizer``,
``learning_rate``, C, σ, B, steps): ``--calibration`` and tests/test_plan_lm.py compare each DP run with run ``none``
of the *same* pretrained model and split — after a new ``pretrain``, run ``none`` again.

Smoke run (tests/test_benchmark_smoke.py): ``--smoke`` shrinks every size so that all three phases take seconds.
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import REPO, git_commit, load_jsonl  # noqa: E402
from clm_calibration import calibration_report  # noqa: E402,F401  (--calibration)

GLUE = REPO.parent / "shared" / "data" / "glue"
WORK = REPO / "runs" / "clm_experiment"
WORK_WIKI = REPO / "runs" / "clm_experiment_wiki"
OUT = REPO / "benchmarks" / "results" / "clm_experiment.jsonl"
CONFIG = "n_layer=4,n_embd=128,n_head=4,n_positions=128"


def _tsv(path: Path) -> list[dict]:
    with open(path, newline="", encoding="utf-8") as f:
        return list(csv.DictReader(f, delimiter="\t", quoting=csv.QUOTE_NONE))


def prepare(a) -> None:
    if a.corpus == "wiki":
        return prepare_wiki(a)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    public = []
    for split in ("train", "dev"):
        for row in _tsv(GLUE / "QNLI" / f"{split}.tsv"):
            public += [row["question"], row["sentence"]]
    rng = random.Random(a.seed)
    sst = [r["sentence"].strip() for r in _tsv(GLUE / "SST-2" / "train.tsv") if r["sentence"].strip()]
    rng.shuffle(sst)
    private = sst[: a.private_rows]
    rows, user = _with_users(private, rng)
    # the tune split (issue 39): SST-2 training sentences disjoint from the private ones, standing in for them when
    # the recipe's defaults are chosen, scored on other held-out training sentences — never on the private rows or dev
    tune_train, tune_users = _with_users(sst[a.private_rows: 2 * a.private_rows], random.Random(a.seed + 1))
    tune_dev = [{"text": t} for t in sst[2 * a.private_rows: 2 * a.private_rows + a.dev_rows]]
    # SST-2 dev holds whole sentences (19.5 words on average), the training rows mostly phrases (9.4): the scored tune
    # text is held-out training sentences of at least 12 words (mean ≈ 17), closer to whole sentences
    long = [t for t in sst[2 * a.private_rows + a.dev_rows:] if len(t.split()) >= 12][: a.dev_rows]
    tune_long = [{"text": t} for t in long]
    # held-out whole sentences (ending in . ! or ?, >= 8 words): SST-2's training rows are the phrases of the parse
    # trees of whole review sentences, SST-2 dev the whole sentences themselves
    whole = [t for t in sst[2 * a.private_rows + a.dev_rows:] if t.endswith((" .", " !", " ?")) and len(t.split()) >= 8]
    tune_sent = [{"text": t} for t in whole[: a.dev_rows]]
    dev = [{"text": r["sentence"].strip()} for r in _tsv(GLUE / "SST-2" / "dev.tsv")][: a.dev_rows]
    if a.smoke:
        public = public[:400]
    (work / "public.txt").write_text("\n".join(public) + "\n", encoding="utf-8")
    for name, data in (("train.jsonl", rows), ("dev.jsonl", dev), ("tune_train.jsonl", tune_train),
                       ("tune_dev.jsonl", tune_dev), ("tune_long.jsonl", tune_long), ("tune_sent.jsonl", tune_sent)):
        with open(work / name, "w", encoding="utf-8") as f:
            for r in data:
                f.write(json.dumps(r) + "\n")
    print(f"public sentences {len(public):,}; private rows {len(rows):,} of {user:,} synthetic users; dev {len(dev):,}; "
          f"tune split {len(tune_train):,} rows of {tune_users:,} users, tune dev {len(tune_dev):,}")


def prepare_wiki(a) -> None:
    """The corpus with much to learn (issue 54): public text = QNLI's *questions* only (train + dev); private text =
    QNLI's Wikipedia *sentences* (declarative, 26 words on average, against the questions' 10) — the same topics in
    another register, so a model pretrained on the questions has much to gain on them. The distinct sentences, shuffled
    (seeded), are cut into disjoint parts: ``train.jsonl`` (``--private_rows``, with synthetic users), ``dev.jsonl``
    (``--dev_rows``), and the tune split ``tune_train.jsonl`` / ``tune_dev.jsonl`` of the same sizes, on which defaults
    are chosen (never on train or dev)."""
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    rows = [r for split in ("train", "dev") for r in _tsv(GLUE / "QNLI" / f"{split}.tsv")]
    public = sorted({r["question"].strip() for r in rows if r["question"].strip()})
    sentences = sorted({r["sentence"].strip() for r in rows if r["sentence"].strip()} - set(public))
    rng = random.Random(a.seed)
    rng.shuffle(public)
    rng.shuffle(sentences)
    n, m = a.private_rows, a.dev_rows
    if 2 * (n + m) > len(sentences):
        raise SystemExit(f"error: {len(sentences):,} distinct sentences cannot give 2 × ({n:,} + {m:,}) disjoint rows")
    train, users = _with_users(sentences[:n], rng)
    dev = [{"text": t} for t in sentences[n: n + m]]
    tune_train, tune_users = _with_users(sentences[n + m: 2 * n + m], random.Random(a.seed + 1))
    tune_dev = [{"text": t} for t in sentences[2 * n + m: 2 * (n + m)]]
    if a.smoke:
        public = public[:400]
    (work / "public.txt").write_text("\n".join(public) + "\n", encoding="utf-8")
    for name, data in (("train.jsonl", train), ("dev.jsonl", dev), ("tune_train.jsonl", tune_train),
                       ("tune_dev.jsonl", tune_dev)):
        with open(work / name, "w", encoding="utf-8") as f:
            for r in data:
                f.write(json.dumps(r) + "\n")
    print(f"public questions {len(public):,}; private sentences {len(train):,} of {users:,} synthetic users; dev "
          f"{len(dev):,}; tune split {len(tune_train):,} rows of {tune_users:,} users, tune dev {len(tune_dev):,}")


def _with_users(texts, rng) -> tuple[list[dict], int]:
    """Rows with a synthetic ``user_id``: each user gets 1 + Geometric(p = 1/4) consecutive sentences (mean 4)."""
    rows, user = [], 0
    while len(rows) < len(texts):
        k = 1
        while rng.random() >= 0.25:  # 1 + Geometric(1/4): mean 4 sentences per user
            k += 1
        for text in texts[len(rows): len(rows) + k]:
            rows.append({"text": text, "user_id": f"user{user:05d}"})
        user += 1
    return rows, user


def pretrain(a) -> None:
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling, Trainer, TrainingArguments

    sys.path.insert(0, str(REPO))
    from recipes.common.model import resolve_model_path

    torch.manual_seed(a.seed)
    work = Path(a.work)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    cfg = AutoConfig.for_model("gpt2")
    cfg.update_from_string(a.config)
    cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = len(tok), tok.pad_token_id, tok.cls_token_id, tok.sep_token_id
    model = AutoModelForCausalLM.from_config(cfg)
    texts = (work / "public.txt").read_text(encoding="utf-8").splitlines()
    ids = tok(texts, add_special_tokens=False)["input_ids"]
    stream = [t for row in ids for t in row + [tok.sep_token_id]]
    L = a.block_size
    blocks = [stream[i: i + L] for i in range(0, len(stream) - L + 1, L)]
    ds = Dataset.from_dict({"input_ids": blocks})
    args = TrainingArguments(
        output_dir=str(work / "pretrain_ckpt"), per_device_train_batch_size=a.batch, num_train_epochs=a.epochs,
        learning_rate=a.lr, warmup_steps=min(100, max(1, len(blocks) // a.batch // 10)), weight_decay=0.01,
        lr_scheduler_type="cosine", logging_steps=50, save_strategy="no", report_to=[], use_cpu=True,
        seed=a.seed, disable_tqdm=True, dataloader_num_workers=0, max_steps=a.max_steps or -1,
    )
    t0 = time.time()
    Trainer(model=model, args=args, train_dataset=ds, data_collator=DataCollatorForLanguageModeling(tok, mlm=False)).train()
    wall = time.time() - t0
    dest = Path(a.pretrained)
    model.save_pretrained(dest)
    tok.save_pretrained(dest)
    info = {"phase": "pretrain", "corpus": a.corpus, "config": a.config, "block_size": L, "blocks": len(blocks), "tokens": len(blocks) * L,
            "epochs": a.epochs, "max_steps": a.max_steps, "command": " ".join(sys.argv), "batch": a.batch, "lr": a.lr, "seed": a.seed, "wall_s": round(wall, 1),
            "params": sum(p.numel() for p in model.parameters()), "commit": git_commit(), "smoke": a.smoke}
    (dest / "pretrain_info.json").write_text(json.dumps(info, indent=1))
    _append(a.out, info)
    print(json.dumps(info))


#: the logical batch: 64 rows (row level: 16 × 4 accumulation) or 16 users of mean 4 rows (4 × 4); the same learning
#: rate for every run, fixed before any run (not tuned on the private data)
ROWS_B = ["--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "4"]
USERS_B = ["--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "4"]
LR = ["--learning_rate", "2e-3"]
RUNS = {
    # name: extra flags of recipes/clm.py
    "none": ["--disable_dp", "--optim", "adamw_torch", "--do_train", "false"],
    "nonprivate": ["--disable_dp", "--optim", "adamw_torch", *ROWS_B, *LR],
    "row": ["--epsilon", "3", *ROWS_B, *LR],
    "user": ["--epsilon", "3", "--privacy_unit_column", "user_id", *USERS_B, *LR],
    # the recipe's own defaults (issue 39): no batch, learning rate or optimizer flag; --extra adds a candidate's flags
    "dp": [],
    "dp_user": ["--privacy_unit_column", "user_id"],
    # score an already fine-tuned release (--pretrained <output_dir>/release) on the split's scored text
    "eval": ["--disable_dp", "--optim", "adamw_torch", "--do_train", "false"],
}


def pretrained_id(folder) -> str | None:
    """A fingerprint of the pretrained model (the first 16 hex digits of its weights file's SHA-256): the rows of one
    pretrained model are compared with its own run ``none`` (the planner's causal-LM calibration)."""
    import hashlib

    for name in ("model.safetensors", "pytorch_model.bin"):
        path = Path(folder) / name
        if path.exists():
            h = hashlib.sha256()
            with open(path, "rb") as f:
                for chunk in iter(lambda: f.read(1 << 20), b""):
                    h.update(chunk)
            return h.hexdigest()[:16]
    return None


def finetune(a) -> None:
    work = Path(a.work)
    pretrained = pretrained_id(a.pretrained)
    train, dev = {"tune": ("tune_train.jsonl", "tune_dev.jsonl"), "tune_long": ("tune_train.jsonl", "tune_long.jsonl"),
                  "tune_sent": ("tune_train.jsonl", "tune_sent.jsonl"),
                  "dev": ("train.jsonl", "dev.jsonl")}[a.split]
    for name in a.runs.split(","):
        out_dir = work / f"ft_{name}" if a.split == "dev" and not a.tag else work / f"ft_{a.split}_{name}_{a.tag}_s{a.seed}"
        shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run (recipes refuse another run's checkpoints)
        cmd = [sys.executable, str(REPO / "recipes" / "clm.py"), "--model_name_or_path", str(a.pretrained),
               "--train_file", str(work / train), "--validation_file", str(work / dev),
               "--text_column", "text", "--block_size", str(a.ft_block_size), "--output_dir", str(out_dir),
               "--seed", str(a.seed), "--num_train_epochs", str(a.ft_epochs),
               *RUNS[name], *a.extra.split()]
        t0 = time.time()
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, HF_HUB_OFFLINE="1"))
        wall = time.time() - t0
        row = {"phase": "finetune", "corpus": a.corpus, "run": name, "split": a.split, "tag": a.tag, "returncode": proc.returncode,
               "wall_s": round(wall, 1),
               "command": " ".join(cmd[1:]), "commit": git_commit(), "seed": a.seed, "smoke": a.smoke,
               "pretrained": pretrained}
        privacy = out_dir / "release" / "privacy.json"  # the recipe saves the release in <output_dir>/release
        if privacy.exists():
            rep = json.loads(privacy.read_text())
            hyper = (rep.get("optimizer") or {}).get("hyperparameters") or {}
            ev = rep.get("eval", {})
            row.update(eval_loss=ev.get("eval_loss"), perplexity=ev.get("eval_perplexity") or (
                math.exp(ev["eval_loss"]) if ev.get("eval_loss") is not None else None),
                epsilon=rep.get("epsilon"), noise_multiplier=rep.get("noise_multiplier"), steps=rep.get("steps"),
                expected_batch_size=rep.get("expected_batch_size"), dataset_size=rep.get("dataset_size"),
                unit=(rep.get("privacy_unit") or {}).get("column"), trainable=(rep.get("trainable") or {}).get("mode"),
                # what the planner's causal-LM verdict reads (hf_dp.plan.lm_verdict): d, the update rule, lr, C, epochs
                trainable_params=(rep.get("trainable") or {}).get("trainable_params"),
                optimizer=(rep.get("optimizer") or {}).get("name"),
                learning_rate=hyper.get("lr"), lr_scheduler_type=hyper.get("lr_scheduler_type"),
                max_grad_norm=rep.get("max_grad_norm"), planned_steps=rep.get("planned_steps"), epochs=rep.get("epochs"))
        if row.get("perplexity") is None:  # no release (evaluation only): the summary's line
            import re

            m = re.search(r"perplexity\W+([0-9][0-9.,]*)", proc.stdout + proc.stderr)
            if m:
                row["perplexity"] = float(m.group(1).replace(",", ""))
        if proc.returncode != 0:
            row["stderr_tail"] = proc.stderr[-1500:]
        _append(a.out, row)
        print(json.dumps({k: v for k, v in row.items() if k != "stderr_tail"}))


def report(path) -> None:
    rows = load_jsonl(path)
    print("| run | dev perplexity | ε | σ | steps | B | N | unit | wall (s) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        if r.get("phase") == "finetune":
            f = lambda v, d=2: "—" if v is None else (f"{v:.{d}f}" if isinstance(v, float) else str(v))  # noqa: E731
            print(f"| {r['run']} | {f(r.get('perplexity'))} | {f(r.get('epsilon'))} | {f(r.get('noise_multiplier'))} | "
                  f"{f(r.get('steps'))} | {f(r.get('expected_batch_size'), 0)} | {f(r.get('dataset_size'))} | "
                  f"{r.get('unit') or 'row'} | {r['wall_s']} |")


def _append(path, row) -> None:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(row) + "\n")


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("phase", nargs="?", choices=["prepare", "pretrain", "finetune"])
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--corpus", choices=("sst2", "wiki"), default="sst2",
                    help="sst2: pretrain on QNLI's questions and sentences, fine-tune on SST-2 sentences (little to "
                         "gain); wiki: pretrain on QNLI's questions only, fine-tune on its Wikipedia sentences (much to "
                         "gain; its own --work and --pretrained folders by default)")
    ap.add_argument("--work", default=None)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--pretrained", default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--private_rows", type=int, default=None, help="4,000 (sst2), 5,000 (wiki)")
    ap.add_argument("--dev_rows", type=int, default=872)
    ap.add_argument("--config", default=CONFIG)
    ap.add_argument("--block_size", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--max_steps", type=int, default=0)
    ap.add_argument("--runs", default="none,nonprivate,row,user")
    ap.add_argument("--ft_block_size", type=int, default=64)
    ap.add_argument("--ft_epochs", type=float, default=2.0)
    ap.add_argument("--extra", default="", help="more recipes/clm.py flags, one string")
    ap.add_argument("--split", choices=("dev", "tune", "tune_long", "tune_sent"), default="dev",
                    help="tune: fine-tune on the tune split and score on its held-out sentences (choosing defaults); "
                         "tune_long: the same, scored on held-out sentences of >= 12 words; tune_sent: scored on "
                         "held-out whole sentences (ending in . ! ?, >= 8 words); "
                         "dev: the private rows, scored on SST-2 dev")
    ap.add_argument("--tag", default="", help="a name for this configuration in the results file")
    ap.add_argument("--calibration", action="store_true",
                    help="print the measured DP runs beside the planner's causal-LM verdict (hf_dp.plan.lm_verdict)")
    a = ap.parse_args(argv)
    wiki = a.corpus == "wiki"
    a.work = a.work or str(WORK_WIKI if wiki else WORK)
    a.pretrained = a.pretrained or str(REPO / "runs" / ("clm_pretrained_questions" if wiki else "clm_pretrained"))
    a.private_rows = a.private_rows or (5000 if wiki else 4000)
    if a.calibration:
        return calibration_report(a.out)
    if a.report:
        return report(a.out)
    if a.smoke:
        a.private_rows, a.dev_rows, a.config, a.max_steps, a.ft_epochs = 64, 16, "n_layer=1,n_embd=16,n_head=2,n_positions=64", 2, 1.0
        a.extra = (a.extra + " --max_steps 2 --per_device_train_batch_size 4 --gradient_accumulation_steps 2").strip()
    {"prepare": prepare, "pretrain": pretrain, "finetune": finetune}[a.phase](a)


if __name__ == "__main__":
    main()
