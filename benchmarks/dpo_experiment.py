"""Issue 51 item 5: DP preference tuning (DPO, and a reward model) at CPU scale, from public text only.

The starting model is §10b's small GPT-2 (``benchmarks/clm_cpu_experiment.py pretrain --max_steps 350`` writes it to
``runs/clm_pretrained``: pretrained on QNLI's public text, the offline MiniLM WordPiece tokenizer). The preference
property is a movie review's sentiment, which held-out pairs can score:

1. ``prepare``: pairs of a fixed prompt (``A positive movie review:``), a positive SST-2 sentence as the chosen answer
   and a negative one as the rejected answer (../shared/data/glue/SST-2, read as clm_cpu_experiment.py reads it). From
   SST-2 train (distinct rows of at least ``--min_words`` words): ``train.jsonl`` (``--train_pairs``) with a synthetic
   ``user_id`` (each made-up user gets 1 + Geometric(1/4) consecutive pairs, seeded, as clm_cpu_experiment.py makes
   users), a disjoint tune split for choosing defaults (``tune_train.jsonl``, same size and users, and
   ``tune_dev.jsonl``: held-out training rows that are whole sentences, ending in . ! or ?, as SST-2 dev's are); from
   SST-2 dev, ``dev.jsonl`` (every negative sentence paired with a positive one: 428 pairs). The tune split's rows are
   SST-2 phrases, some of them parts of the same review sentence: it chooses defaults, it reports nothing.
2. ``run --runs start,nonprivate,row,user,reward_nonprivate,reward_row --seeds 0,1,2 --split dev|tune``: each run but
   ``start`` is ``recipes/dpo.py`` as a subprocess with its defaults (LoRA, dp_adamw at lr 5e-4, B ≈ N/125 units,
   1 epoch at row level and 2 at user level, C = 0.1, β = 0.1; the reward model: B ≈ N/16, 2 epochs; ``--max_length 128``, the model's positions): ``nonprivate`` = ``--disable_dp --optim
   adamw_torch``, ``row`` = ε = 3 with one pair per unit, ``user`` = ε = 3 with ``--privacy_unit_column user_id``,
   ``reward_*`` the recipe's ``--reward_model`` mode (TRL's RewardTrainer: a one-output sequence classifier on the same
   model). ``start`` trains nothing: the starting model scored as it is. Each run's release (``<output_dir>/release``,
   LoRA merged into the weights) is scored on the held-out pairs (``dev.jsonl``, or ``tune_dev.jsonl`` with
   ``--split tune``), with the starting model as the reference, on the completion tokens only (TRL 1.16's tokenization
   of the pair: the prompt's tokens are never scored):

   * ``accuracy``: the share of pairs whose implicit DPO reward margin β·(log π(y_c|x) − log π_ref(y_c|x)) −
     β·(log π(y_r|x) − log π_ref(y_r|x)) is > 0, exact ties counted 1/2 (the starting model: 0.5 exactly);
     for a reward model, reward(x, y_c) > reward(x, y_r);
   * ``margin``: the mean of that margin (the reward difference for a reward model);
   * ``likelihood_accuracy``: the share of pairs with log π(y_c|x) > log π(y_r|x) (summed over the completion tokens;
     ties 1/2): informative for the starting model too (none for a reward model).

   Each finished run appends one JSON line to ``benchmarks/results/dpo_experiment.jsonl`` (the metrics, ε, σ, steps,
   B, N, wall seconds, the exact command, the commit, the starting model's fingerprint, TRL's own evaluation numbers
   from privacy.json beside ours).
   Ablations: ``--noise_multiplier S`` runs the DP runs at σ = S instead of ε = 3 (with a tiny S and a large
   ``--per_sample_max_grad_norm`` in ``--extra``: what the noise and the clipping each cost); ``--trajectory N`` saves
   a checkpoint every N steps and scores each (one row per checkpoint, ``"checkpoint": K``; the report leaves them out).
3. ``--report``: per run the seeds, their mean, and for a DP run the share of the non-private gain it closes,
   (acc_DP − 0.5)/(acc_nonprivate − 0.5) per seed (``reward_row`` against ``reward_nonprivate``).

    python benchmarks/clm_cpu_experiment.py prepare && python benchmarks/clm_cpu_experiment.py pretrain --max_steps 350
    python benchmarks/dpo_experiment.py prepare
    python benchmarks/dpo_experiment.py run --runs start,nonprivate,row,user,reward_nonprivate,reward_row --seeds 0,1,2
    python benchmarks/dpo_experiment.py --report

``--smoke`` (tests/test_benchmark_smoke.py): a tiny random GPT-2 from a config (with the MiniLM tokenizer) stands in for
the pretrained folder, a few pairs, one step per run at q = 1.
"""

from __future__ import annotations

import json
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
from clm_cpu_experiment import GLUE, _append, _tsv, _with_users, pretrained_id  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "dpo_experiment.jsonl"
PRETRAINED = REPO / "runs" / "clm_pretrained"  # what clm_cpu_experiment.py pretrain writes
PROMPT = "A positive movie review:"
MAX_LENGTH = 128  # the pretrained GPT-2's positions (clm_cpu_experiment.CONFIG: n_positions=128)
SMOKE_CONFIG = "n_layer=1,n_embd=16,n_head=2,n_positions=128"
SPLITS = {"dev": ("train.jsonl", "dev.jsonl"), "tune": ("tune_train.jsonl", "tune_dev.jsonl")}
RUNS = {
    # name: recipes/dpo.py flags (None: no training, the starting model scored as it is)
    "start": None,
    "nonprivate": ["--disable_dp", "--optim", "adamw_torch"],
    "row": ["--epsilon", "3"],
    "user": ["--epsilon", "3", "--privacy_unit_column", "user_id"],
    "reward_nonprivate": ["--reward_model", "--disable_dp", "--optim", "adamw_torch"],
    "reward_row": ["--reward_model", "--epsilon", "3"],
}
#: a DP run and the non-private run whose gain it is measured against
BASELINE = {"row": "nonprivate", "user": "nonprivate", "reward_row": "reward_nonprivate"}


# ----------------------------------------------------------------------------------------------- prepare


def _pairs(pos: list[str], neg: list[str]) -> list[dict]:
    return [{"prompt": PROMPT, "chosen": " " + c, "rejected": " " + r} for c, r in zip(pos, neg)]


def _whole(t: str) -> bool:
    return t.endswith((" .", " !", " ?"))


def prepare(a) -> None:
    work = Path(a.work)
    for name in ("train.tsv", "dev.tsv"):
        if not (GLUE / "SST-2" / name).is_file():
            raise UsageError(f"SST-2 not found: {GLUE / 'SST-2' / name} is missing (the shared GLUE folder)")
    work.mkdir(parents=True, exist_ok=True)
    rng = random.Random(a.seed)
    labels: dict[str, str] = {}
    for r in _tsv(GLUE / "SST-2" / "train.tsv"):
        t = r["sentence"].strip()
        if len(t.split()) >= a.min_words:
            labels.setdefault(t, r["label"])
    pos = sorted(t for t, y in labels.items() if y == "1")
    neg = sorted(t for t, y in labels.items() if y == "0")
    rng.shuffle(pos)
    rng.shuffle(neg)
    n = a.train_pairs
    if 2 * n + a.tune_dev_pairs > min(len(pos), len(neg)):
        raise UsageError(f"--train_pairs {n}: SST-2 train has {min(len(pos), len(neg)):,} sentences of each label with "
                         f">= {a.min_words} words, fewer than 2 x {n} + {a.tune_dev_pairs} (train, tune, tune dev)")
    train, users = _with_users(_pairs(pos[:n], neg[:n]), rng)
    tune, tune_users = _with_users(_pairs(pos[n:2 * n], neg[n:2 * n]), random.Random(a.seed + 1))
    # held out of both: whole sentences (as SST-2 dev's), so that the tune split is scored on text like dev's
    tune_dev = _pairs([t for t in pos[2 * n:] if _whole(t)][: a.tune_dev_pairs],
                      [t for t in neg[2 * n:] if _whole(t)][: a.tune_dev_pairs])
    dev_rows = _tsv(GLUE / "SST-2" / "dev.tsv")
    dpos = [r["sentence"].strip() for r in dev_rows if r["label"] == "1"]
    dneg = [r["sentence"].strip() for r in dev_rows if r["label"] == "0"]
    random.Random(a.seed + 2).shuffle(dpos)
    dev = _pairs(dpos, dneg)[: a.dev_pairs]
    for name, data in (("train.jsonl", [{**r["text"], "user_id": r["user_id"]} for r in train]), ("dev.jsonl", dev),
                       ("tune_train.jsonl", [{**r["text"], "user_id": r["user_id"]} for r in tune]),
                       ("tune_dev.jsonl", tune_dev)):
        with open(work / name, "w", encoding="utf-8") as f:
            for r in data:
                f.write(json.dumps(r) + "\n")
    info = {"phase": "prepare", "train_pairs": len(train), "train_users": users, "tune_pairs": len(tune),
            "tune_users": tune_users, "tune_dev_pairs": len(tune_dev), "dev_pairs": len(dev), "min_words": a.min_words,
            "prompt": PROMPT, "seed": a.seed, "smoke": a.smoke}
    (work / "prepare_info.json").write_text(json.dumps(info, indent=1))
    print(f"train {len(train):,} pairs of {users:,} synthetic users; tune {len(tune):,} pairs of {tune_users:,} users, "
          f"tune dev {len(tune_dev):,} pairs; dev {len(dev):,} pairs (SST-2 dev)")


def tiny_model(folder) -> str:
    """``--smoke``'s starting model: a random GPT-2 from :data:`SMOKE_CONFIG` with the MiniLM tokenizer, saved as
    clm_cpu_experiment.py's pretrain saves its model."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO))
    from recipes.common.model import resolve_model_path

    folder = Path(folder)
    if (folder / "config.json").is_file():
        return str(folder)
    tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
    cfg = AutoConfig.for_model("gpt2")
    cfg.update_from_string(SMOKE_CONFIG)
    cfg.vocab_size, cfg.pad_token_id, cfg.bos_token_id, cfg.eos_token_id = len(tok), tok.pad_token_id, tok.cls_token_id, tok.sep_token_id
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return str(folder)


# ----------------------------------------------------------------------------------------------- evaluation


def read_pairs(path) -> list[dict]:
    return load_jsonl(path)


def _tokenizer(folder):
    """The tokenizer as recipes/dpo.py loads it (a BERT-style tokenizer's [SEP] as its EOS)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(folder)
    if tok.eos_token is None:
        tok.eos_token = tok.sep_token
    return tok


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def pair_ids(tok, pair: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt, chosen, rejected) token ids as TRL 1.16's DPOTrainer prepares a text pair: EOS appended to each
    answer, prompt and prompt + answer tokenized, the completion starting where they diverge."""
    eos = tok.eos_token
    c = pair["chosen"] if pair["chosen"].endswith(eos) else pair["chosen"] + eos
    r = pair["rejected"] if pair["rejected"].endswith(eos) else pair["rejected"] + eos
    p = tok(text=pair["prompt"])["input_ids"]
    pc, pr = tok(text=pair["prompt"] + c)["input_ids"], tok(text=pair["prompt"] + r)["input_ids"]
    n = min(_prefix(p, pc), _prefix(p, pr))
    return p[:n], pc[n:], pr[n:]


def _batches(seqs: list[tuple[list[int], int]], size: int, pad: int, max_length: int):
    """Right-padded batches of (ids, prompt length), cut to ``max_length`` (TRL's keep_start): (ids, mask, labels)."""
    import torch

    for i in range(0, len(seqs), size):
        part = [(ids[:max_length], k) for ids, k in seqs[i: i + size]]
        t = max(len(ids) for ids, _ in part)
        ids = torch.full((len(part), t), pad, dtype=torch.long)
        mask = torch.zeros((len(part), t), dtype=torch.long)
        labels = torch.full((len(part), t), -100, dtype=torch.long)
        for j, (row, k) in enumerate(part):
            ids[j, : len(row)] = torch.tensor(row)
            mask[j, : len(row)] = 1
            labels[j, k: len(row)] = ids[j, k: len(row)]  # the completion's tokens only
        yield ids, mask, labels


def completion_logps(model, seqs, pad: int, max_length: int, batch: int = 32) -> list[float]:
    """Σ over each sequence's completion tokens of log p(token | the tokens before it)."""
    import torch

    out = []
    model.eval()
    with torch.no_grad():
        for ids, mask, labels in _batches(seqs, batch, pad, max_length):
            logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
            target = labels[:, 1:]
            lp = torch.log_softmax(logits, -1).gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
            out += (lp * (target != -100)).double().sum(1).tolist()
    return out


def _share(diffs: list[float]) -> float:
    """The share of values > 0, exact ties (0) counted 1/2."""
    return sum(1.0 if d > 0 else 0.5 if d == 0 else 0.0 for d in diffs) / len(diffs)


def evaluate_dpo(policy, reference, tok, pairs: list[dict], beta: float, max_length: int = MAX_LENGTH,
                 cache: dict | None = None) -> dict:
    """The held-out preference accuracy, mean implicit-reward margin and likelihood accuracy of ``policy`` (a causal
    LM) against ``reference`` (the starting model; the same object: every implicit reward is 0) on ``pairs``.
    ``cache``: the reference's log-probabilities of these pairs, kept there for the next policy."""
    ids = [pair_ids(tok, p) for p in pairs]
    seqs = [(p + c, len(p)) for p, c, _ in ids] + [(p + r, len(p)) for p, _, r in ids]
    ref = (cache or {}).get(id(reference))
    if ref is None:
        ref = completion_logps(reference, seqs, tok.pad_token_id, max_length)
        if cache is not None:
            cache[id(reference)] = ref
    pol = ref if policy is reference else completion_logps(policy, seqs, tok.pad_token_id, max_length)
    n = len(pairs)
    margins = [beta * ((pol[i] - ref[i]) - (pol[n + i] - ref[n + i])) for i in range(n)]
    return {"accuracy": _share(margins), "margin": statistics.fmean(margins),
            "likelihood_accuracy": _share([pol[i] - pol[n + i] for i in range(n)]),
            "logp_chosen": statistics.fmean(pol[:n]), "logp_rejected": statistics.fmean(pol[n:]),
            "ties": sum(m == 0 for m in margins), "pairs": n}


def evaluate_reward(model, tok, pairs: list[dict], batch: int = 32) -> dict:
    """A reward model's held-out pair accuracy (reward(chosen) > reward(rejected), ties 1/2) and mean reward margin;
    each answer scored as TRL's RewardTrainer prepares it: prompt + answer + EOS."""
    import torch

    eos = tok.eos_token
    seqs = [(tok(text=p["prompt"] + (p[k] if p[k].endswith(eos) else p[k] + eos))["input_ids"], 0)
            for k in ("chosen", "rejected") for p in pairs]
    scores = []
    model.eval()
    with torch.no_grad():
        for ids, mask, _ in _batches(seqs, batch, tok.pad_token_id, 10**9):
            scores += model(input_ids=ids, attention_mask=mask).logits[:, 0].double().tolist()
    n = len(pairs)
    diffs = [scores[i] - scores[n + i] for i in range(n)]
    return {"accuracy": _share(diffs), "margin": statistics.fmean(diffs), "likelihood_accuracy": None,
            "ties": sum(d == 0 for d in diffs), "pairs": n}


# ----------------------------------------------------------------------------------------------- runs


def run(a) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    work = Path(a.work)
    names, seeds, train_file, dev_file = run_inputs(
        a, RUNS, SPLITS, "dpo_experiment.py", "run 'python benchmarks/clm_cpu_experiment.py prepare' and 'pretrain "
        "--max_steps 350' first (it writes runs/clm_pretrained)")
    torch.set_num_threads(a.threads)
    pairs = read_pairs(dev_file)
    tok = _tokenizer(a.pretrained)
    start = AutoModelForCausalLM.from_pretrained(a.pretrained)
    fingerprint = pretrained_id(a.pretrained)
    train_rows = load_jsonl(train_file)
    reference_logps: dict = {}  # the starting model's log-probabilities of the held-out pairs, computed once
    for seed in seeds:
        for name in names:
            flags = RUNS[name]
            row = {"phase": "run", "run": name, "seed": seed, "split": a.split, "tag": a.tag, "smoke": a.smoke,
                   "pretrained": fingerprint, "commit": git_commit(),
                   "script_command": relative(" ".join(["benchmarks/dpo_experiment.py", *a.argv]))}
            t0 = time.time()
            if flags is None:  # the starting model against itself: every implicit reward is 0
                row.update(returncode=0, command=None, wall_s=0.0, beta=a.beta)
                policy = start
            else:
                out_dir = work / (f"{a.split}_{name}" + (f"_{a.tag}" if a.tag else "") + f"_s{seed}")
                shutil.rmtree(out_dir, ignore_errors=True)  # a fresh run (recipes refuse another run's checkpoints)
                extra = list(flags)
                if a.noise_multiplier is not None and "--epsilon" in extra:  # a fixed σ instead of ε = 3 (ablations)
                    i = extra.index("--epsilon")
                    extra[i: i + 2] = ["--noise_multiplier", f"{a.noise_multiplier:g}"]
                if a.smoke:  # DP: q = 1 (σ calibrated in milliseconds), the logical batch is every unit; 4 pairs else
                    units = len({r["user_id"] for r in train_rows}) if "--privacy_unit_column" in flags else len(train_rows)
                    extra += ["--per_device_train_batch_size", str(units if "--epsilon" in flags else 4),
                              "--gradient_accumulation_steps", "1"]
                if a.trajectory and "--reward_model" not in flags:  # a checkpoint every N steps, scored below
                    extra += ["--save_steps", str(a.trajectory)]
                cmd = [sys.executable, str(REPO / "recipes" / "dpo.py"), "--model_name_or_path", str(a.pretrained),
                       "--train_file", str(train_file), "--validation_file", str(dev_file),
                       "--output_dir", str(out_dir), "--seed", str(seed), "--max_length", str(MAX_LENGTH),
                       *([] if "--reward_model" in flags else ["--beta", f"{a.beta:g}"]),
                       "--disable_tqdm", "true", "--report_to", "none", *extra, *a.extra.split()]
                env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS=str(a.threads))
                proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=env)
                row.update(returncode=proc.returncode, wall_s=round(time.time() - t0, 1), command=relative(" ".join(cmd[1:])))
                release = out_dir / "release"
                if proc.returncode != 0 or not (release / "config.json").is_file():
                    row["stderr_tail"] = relative(proc.stderr[-1500:])
                    _append(a.out, row)
                    print(json.dumps({k: v for k, v in row.items() if k != "stderr_tail"}), flush=True)
                    print(row["stderr_tail"], file=sys.stderr)
                    continue
                rep = json.loads((release / "privacy.json").read_text())
                ev = rep.get("eval") or {}
                reward = "--reward_model" in flags
                row.update(epsilon=rep.get("epsilon"), sigma=rep.get("noise_multiplier"), steps=rep.get("steps"),
                           expected_batch_size=rep.get("expected_batch_size"), dataset_size=rep.get("dataset_size"),
                           unit=(rep.get("privacy_unit") or {}).get("column"),
                           trainable=(rep.get("trainable") or {}).get("mode"),
                           trainable_params=(rep.get("trainable") or {}).get("trainable_params"),
                           optimizer=(rep.get("optimizer") or {}).get("name"),
                           learning_rate=((rep.get("optimizer") or {}).get("hyperparameters") or {}).get("lr"),
                           beta=None if reward else (rep.get("dpo") or {}).get("beta", a.beta),
                           # TRL's own evaluation (strict >: a tie counts 0), beside ours
                           trl_accuracy=ev.get("eval_accuracy" if reward else "eval_rewards/accuracies"),
                           trl_margin=ev.get("eval_margin" if reward else "eval_rewards/margins"),
                           trl_logp_chosen=ev.get("eval_logps/chosen"), trl_logp_rejected=ev.get("eval_logps/rejected"))
                cls = AutoModelForSequenceClassification if reward else AutoModelForCausalLM
                policy = cls.from_pretrained(release)
                if a.trajectory and not reward:
                    trajectory(a, out_dir, row, start, tok, pairs, reference_logps)
            t1 = time.time()
            if "--reward_model" in (flags or []):
                row.update(evaluate_reward(policy, tok, pairs))
            else:
                row.update(evaluate_dpo(policy, start, tok, pairs, row["beta"], cache=reference_logps))
            row["eval_s"] = round(time.time() - t1, 1)
            _append(a.out, row)
            print(json.dumps(row), flush=True)


def trajectory(a, out_dir: Path, row: dict, start, tok, pairs, cache: dict) -> None:
    """Score each ``checkpoint-K`` of a run saved with ``--trajectory`` (its LoRA adapter on the starting model,
    merged; a checkpoint of full weights as it is) on the held-out pairs: one row per checkpoint, ``"checkpoint": K``
    (the report leaves them out; the last row of the run is its release)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    for ck in sorted(out_dir.glob("checkpoint-*"), key=lambda p: int(p.name.rsplit("-", 1)[1])):
        if (ck / "adapter_config.json").is_file():
            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(a.pretrained), ck).merge_and_unload()
        else:
            model = AutoModelForCausalLM.from_pretrained(ck)
        ev = evaluate_dpo(model, start, tok, pairs, row["beta"], cache=cache)
        point = {k: row[k] for k in ("phase", "run", "seed", "split", "tag", "smoke", "pretrained", "commit",
                                     "script_command", "sigma", "steps", "expected_batch_size")}
        _append(a.out, {**point, "checkpoint": int(ck.name.rsplit("-", 1)[1]), **ev})
        print(json.dumps({"checkpoint": ck.name, "accuracy": ev["accuracy"], "margin": ev["margin"]}),
              flush=True)


# ----------------------------------------------------------------------------------------------- report


def _fmt(v, d=3) -> str:
    return "—" if v is None else f"{v:.{d}f}"


def _sig(v) -> str:
    return "—" if v is None else f"{v:.3g}"


def report(path, split: str | None = None) -> None:
    rows = [r for r in load_jsonl(path) if r.get("phase") == "run" and r.get("returncode") == 0
            and r.get("accuracy") is not None and r.get("checkpoint") is None]
    latest = {}  # the latest row of each (split, tag, smoke, run, seed)
    for r in rows:
        latest[(r["split"], r.get("tag") or "", bool(r.get("smoke")), r["run"], r["seed"])] = r
    groups = dict.fromkeys(k[:3] for k in latest)
    if split:
        groups = {g: None for g in groups if g[0] == split}
    if not groups:
        print(f"no finished runs in {path}")
        return
    for g in groups:
        sel = {k[3:]: r for k, r in latest.items() if k[:3] == g}
        seeds = sorted({s for _, s in sel})
        runs = [n for n in RUNS if any(k[0] == n for k in sel)]
        print(f"\nsplit {g[0]}" + (f", tag {g[1]}" if g[1] else "") + (" (smoke)" if g[2] else "")
              + ": held-out preference accuracy (implicit reward margin > 0, ties 1/2; a reward model: reward(chosen) > "
              "reward(rejected)); gain closed = (acc − 0.5)/(acc_nonprivate − 0.5), same seed")
        print("| run | " + " | ".join(f"seed {s}" for s in seeds) + " | mean | mean margin | likelihood acc. (mean) | "
              "gain closed (per seed) | ε | σ | steps | B | N | wall (s) |")
        print("| --- " * (len(seeds) + 11) + "|")
        for n in runs:
            acc = {s: sel[(n, s)]["accuracy"] for s in seeds if (n, s) in sel}
            one = [sel[(n, s)] for s in seeds if (n, s) in sel]
            gains = []
            base = BASELINE.get(n)
            for s in seeds:  # the same tag's baseline, else the untagged one (the recipe's non-private defaults)
                b = sel.get((base, s)) or latest.get((g[0], "", g[2], base, s))
                if base is None:
                    break
                if s not in acc or b is None or b["accuracy"] <= 0.5:
                    gains.append("—")
                else:
                    gains.append(f"{100 * (acc[s] - 0.5) / (b['accuracy'] - 0.5):.0f} %")
            lik = [r["likelihood_accuracy"] for r in one if r.get("likelihood_accuracy") is not None]
            last = one[-1]

            def mean_of(key):
                vals = [r[key] for r in one if r.get(key) is not None]
                return statistics.fmean(vals) if vals else None

            print(f"| {n} | " + " | ".join(_fmt(acc.get(s)) for s in seeds)
                  + f" | **{_fmt(statistics.fmean(acc.values()))}** | {_sig(mean_of('margin'))} | "
                  f"{_fmt(statistics.fmean(lik)) if lik else '—'} | {' / '.join(gains) if gains else '—'} | "
                  f"{_fmt(last.get('epsilon'), 2)} | {_fmt(last.get('sigma'), 3)} | {last.get('steps') or '—'} | "
                  f"{_fmt(last.get('expected_batch_size'), 0)} | {last.get('dataset_size') or '—'} | "
                  f"{_fmt(mean_of('wall_s'), 0)} |")


# ----------------------------------------------------------------------------------------------- main


def main(argv=None) -> None:
    ap = experiment_parser(__doc__, "dpo_experiment", OUT, PRETRAINED, RUNS, SPLITS, "pairs", "recipes/dpo.py")
    ap.add_argument("--train_pairs", type=int, default=2000, help="training pairs (the tune split's too)")
    ap.add_argument("--tune_dev_pairs", type=int, default=428, help="held-out pairs of the tune split")
    ap.add_argument("--dev_pairs", type=int, default=428, help="held-out pairs from SST-2 dev (428: all of them)")
    ap.add_argument("--min_words", type=int, default=8, help="SST-2 train rows shorter than this are left out")
    ap.add_argument("--beta", type=float, default=0.1, help="DPO's β (TRL's default)")
    ap.add_argument("--trajectory", type=int, default=0, metavar="N",
                    help="save a checkpoint every N steps and score each on the held-out pairs (DPO runs)")
    ap.add_argument("--noise_multiplier", type=float, default=None,
                    help="DP runs at this σ instead of ε = 3 (ablations: what the noise costs, what clipping costs)")
    a = ap.parse_args(argv)

    def smoke(a):
        a.train_pairs, a.tune_dev_pairs, a.dev_pairs, a.threads = 16, 16, 16, 1
        if a.pretrained == str(PRETRAINED):
            a.pretrained = str(Path(a.work) / "tiny_gpt2")
        if a.phase == "prepare":
            tiny_model(a.pretrained)
        a.extra = (a.extra + " --max_steps 1").strip()

    run_experiment(a, argv, {"prepare": prepare, "run": run}, report, smoke)


if __name__ == "__main__":
    main()
