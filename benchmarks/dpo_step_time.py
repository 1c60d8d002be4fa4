"""Issue 51 item 5: the time and memory of a DP DPO step against the non-private DPO step of the same trainer and data.

``DPDPOTrainer`` (recipes/dpo.py's trainer) on a fixed micro-batch of ``--batch`` preference pairs — each pair's chosen
and rejected sequences (prompt + answer) through the policy, and through the reference (LoRA: the model with its adapter
disabled; full fine-tuning: a frozen copy) — for ``--trainable lora`` and ``all``. The model: a ``--model`` folder
(e.g. ``runs/clm_pretrained``, which ``benchmarks/clm_cpu_experiment.py pretrain`` writes) or a fresh GPT-2 from
``--config`` with the MiniLM tokenizer's vocabulary (random weights, the same step cost), as
``benchmarks/clm_step_time.py`` builds it. The pairs: ``--pairs FILE`` (a prompt/chosen/rejected jsonl, e.g. the
``train.jsonl`` that ``benchmarks/dpo_experiment.py prepare`` writes; its first ``--batch`` pairs) or synthetic ones
(``dpo_experiment.PROMPT`` and two answers of ``--words`` words drawn from the tokenizer's vocabulary). Modes, each
``training_step`` (forward of the policy and of the reference, loss, backward, and under DP clipping) plus the optimizer
step (under DP: the noise):

* ``nonprivate`` — ``--disable_dp`` with torch AdamW: TRL's ``DPOTrainer`` step unchanged (its loss and its fused,
  chunked LM-head log-probabilities), the reference of every ratio;
* ``dp_ghost`` / ``dp_two_pass`` / ``dp_hooks`` — DP-AdamW, σ = 1, C = 0.1, one pair = one unit, with one-pass ghost
  clipping (the default), two-pass ghost clipping or per-example gradients (hooks).

Each (trainable set, mode) runs in its own subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (RSS follows the live
bytes; peak RSS growth over the RSS before the timed steps, sampled every 2 ms: ``bench_io.timed_steps``), one warm-up
step, then ``--steps`` timed steps (median); repetitions interleaved (round r runs every mode once, ``--reps``). The
report gives each mode's median time and peak, and its ratios to ``nonprivate`` of the same trainable set and
repetition (medians over repetitions, and each repetition's time ratio).

    python benchmarks/dpo_step_time.py --model runs/clm_pretrained --pairs runs/dpo_experiment/train.jsonl --reps 3
    python benchmarks/dpo_step_time.py --report

``--smoke`` (tests/test_benchmark_smoke.py): a 1-layer GPT-2, 2 pairs of 4 words, one step, one repetition.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import REPO, add_work_option, append_row, as_new_draw, child_result, git_commit, load_jsonl, timed_steps  # noqa: E402
from clm_step_time import GPT2_CONFIG, _model_and_rows  # noqa: E402
from dpo_experiment import MAX_LENGTH, PROMPT  # noqa: E402

MODES = ["nonprivate", "dp_ghost", "dp_two_pass", "dp_hooks"]
CONFIGS = ["lora", "all"]
CLIPPING = {"dp_ghost": "ghost", "dp_two_pass": "ghost_two_pass", "dp_hooks": "hooks"}
OUT = REPO / "benchmarks" / "results" / "dpo_step_time.jsonl"
SMOKE_CONFIG = "n_layer=1,n_embd=16,n_head=2,n_positions=128"


def synthetic_pairs(tok, n: int, words: int, seed: int = 0) -> list[dict]:
    """``n`` pairs: the experiment's prompt, two answers of ``words`` whole words of the tokenizer's vocabulary."""
    vocab = sorted(w for w in tok.get_vocab() if w.isalpha() and w.islower() and len(w) > 2)
    r = random.Random(seed)
    say = lambda: " " + " ".join(r.choice(vocab) for _ in range(words))  # noqa: E731
    return [{"prompt": PROMPT, "chosen": say(), "rejected": say()} for _ in range(n)]


def child(a) -> dict:
    """One (trainable set, mode): the trainer, the micro-batch, a warm-up step, ``a.steps`` timed steps."""
    from datasets import Dataset

    tok, model, _ = _model_and_rows(argparse.Namespace(**{**vars(a), "length": 1}))  # (its random rows unused)
    from hf_dp.dpo import DPDPOConfig, DPDPOTrainer

    if tok.eos_token is None:  # as recipes/dpo.py: a BERT-style tokenizer's [SEP] ends each answer
        tok.eos_token = tok.sep_token
        model.config.eos_token_id = tok.eos_token_id
    if a.pairs:
        pairs = [{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in load_jsonl(a.pairs)[: a.batch]]
    else:
        pairs = synthetic_pairs(tok, a.batch, a.words)
    dp = a.mode != "nonprivate"
    kw = dict(output_dir=os.path.join(a.work, f"{a.trainable}_{a.mode}"), per_device_train_batch_size=a.batch,
              max_steps=a.steps + 1, trainable=a.trainable, report_to="none", use_cpu=True, disable_tqdm=True,
              save_strategy="no", learning_rate=5e-4, dataloader_num_workers=0, max_length=MAX_LENGTH, beta=0.1)
    if dp:
        kw.update(optim="dp_adamw", noise_multiplier=1.0, per_sample_max_grad_norm=0.1, delta=1e-5,
                  clipping=CLIPPING[a.mode])
    else:
        kw.update(optim="adamw_torch", disable_dp=True)
    tr = DPDPOTrainer(model=model, args=DPDPOConfig(**kw), train_dataset=Dataset.from_list(pairs), processing_class=tok)
    tr.create_optimizer()
    features = [{k: tr.train_dataset[i][k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")}
                for i in range(len(tr.train_dataset))]
    batch = tr._prepare_inputs(dict(tr.get_train_dataloader().collate_fn(features)))
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by HF's training loop, which this benchmark does not run
    if dp:  # the planned logical batch is per_device × accumulation: one micro-batch per step here
        tr._check_contract = lambda: None

    def step():
        tr.training_step(tr.model, as_new_draw(tr, batch) if dp else dict(batch))
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    times, peak_extra = timed_steps(step, a.steps)
    tokens = sum(len(f["prompt_ids"]) * 2 + len(f["chosen_ids"]) + len(f["rejected_ids"]) for f in features)
    return {"trainable": a.trainable, "mode": a.mode, "step_s": statistics.median(times), "peak_mb": peak_extra,
            "params": sum(p.numel() for p in tr.model.parameters() if p.requires_grad), "pairs": len(features),
            "tokens": tokens, "clipping": getattr(tr, "clipping", None) if dp else None,
            "reference": tr._reference or "TRL's (non-private run)"}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="a causal LM folder (default: a fresh GPT-2 from --config)")
    ap.add_argument("--arch", default="gpt2", help="the model type of a fresh model from --config")
    ap.add_argument("--config", default=GPT2_CONFIG, help=f"a fresh model's config (default {GPT2_CONFIG}, §10's GPT-2)")
    ap.add_argument("--pairs", default=None, help="a prompt/chosen/rejected jsonl (its first --batch pairs)")
    ap.add_argument("--batch", type=int, default=16, help="pairs per micro-batch (recipes/dpo.py's per-device default)")
    ap.add_argument("--words", type=int, default=16, help="words per synthetic answer")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--smoke", action="store_true", help="a 1-layer GPT-2, 2 pairs of 4 words, 1 step, 1 repetition")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--trainable", default="lora", help=argparse.SUPPRESS)
    ap.add_argument("--mode", default="nonprivate", help=argparse.SUPPRESS)
    add_work_option(ap, "dpo_step_time")
    a = ap.parse_args(argv)
    if a.report:
        return report(a.out)
    bad = [m for m in a.modes.split(",") if m not in MODES] + [c for c in a.configs.split(",") if c not in CONFIGS]
    if bad or (a.pairs and not os.path.isfile(a.pairs)) or min(a.batch, a.steps, a.reps, a.words) < 1:
        why = (f"unknown mode or trainable set {', '.join(bad)} (modes: {', '.join(MODES)}; sets: {', '.join(CONFIGS)})"
               if bad else f"--pairs {a.pairs}: no such file" if a.pairs and not os.path.isfile(a.pairs)
               else "--batch, --steps, --reps and --words must be at least 1")
        print(f"error: {why}", file=sys.stderr)
        raise SystemExit(2)
    if a.smoke:
        a.config, a.batch, a.words, a.steps, a.reps, a.model = SMOKE_CONFIG, 2, 4, 1, 1, None
    if a.child:
        print("RESULT " + json.dumps(child(a)))
        return
    os.makedirs(os.path.dirname(os.path.abspath(a.out)), exist_ok=True)
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")
    for rep in range(a.reps):
        for trainable in a.configs.split(","):
            for mode in a.modes.split(","):
                cmd = [sys.executable, __file__, "--child", "--trainable", trainable, "--mode", mode,
                       "--batch", str(a.batch), "--words", str(a.words), "--steps", str(a.steps),
                       "--threads", str(a.threads), "--arch", a.arch, "--config", a.config, "--work", a.work]
                cmd += ["--model", a.model] if a.model else []
                cmd += ["--pairs", a.pairs] if a.pairs else []
                # tensors ≥ 64 KiB mmapped and unmapped when freed: RSS then follows the live bytes (clm_step_time.py)
                env = dict(os.environ, HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS=str(a.threads))
                row = child_result(cmd, env, f"{trainable}/{mode}")
                row.update(rep=rep, batch=a.batch, steps=a.steps, threads=a.threads, run=run_id, smoke=a.smoke,
                           model=a.model or f"{a.arch}:{a.config}", pairs_file=a.pairs, words=None if a.pairs else a.words,
                           commit=git_commit())
                append_row(a.out, row)
    report(a.out, run_id)


def report(path, run_id=None) -> None:
    rows = load_jsonl(path)
    run_id = run_id or (rows[-1]["run"] if rows else None)
    rows = [r for r in rows if r["run"] == run_id]
    if not rows:
        print(f"no rows in {path}")
        return
    r0 = rows[0]
    print(f"run {run_id} ({r0['model']}, {r0['pairs']} pairs, {r0['tokens']} tokens per micro-batch, {r0['threads']} "
          f"thread(s), {max(r['rep'] for r in rows) + 1} repetition(s)): medians over repetitions; ratios against "
          "nonprivate of the same trainable set and repetition")
    print("| trainable | mode | step (s) | × non-private | per repetition | live peak MB | × non-private |")
    print("| --- | --- | ---: | ---: | --- | ---: | ---: |")
    for trainable in dict.fromkeys(r["trainable"] for r in rows):
        mine = [r for r in rows if r["trainable"] == trainable]
        ref = {r["rep"]: r for r in mine if r["mode"] == "nonprivate"}
        for mode in dict.fromkeys(r["mode"] for r in mine):
            sel = [r for r in mine if r["mode"] == mode]
            t = [r["step_s"] / ref[r["rep"]]["step_s"] for r in sel if r["rep"] in ref]
            m = [r["peak_mb"] / ref[r["rep"]]["peak_mb"] for r in sel if r["rep"] in ref and ref[r["rep"]]["peak_mb"] > 0]
            print(f"| {trainable} | {mode} | {statistics.median(r['step_s'] for r in sel):.3f} | "
                  f"{f'{statistics.median(t):.2f}' if t else '—'} | {' / '.join(f'{x:.2f}' for x in t) or '—'} | "
                  f"{statistics.median(r['peak_mb'] for r in sel):.0f} | {f'{statistics.median(m):.2f}' if m else '—'} |")


if __name__ == "__main__":
    main()
