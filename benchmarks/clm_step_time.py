"""Issue 29 §5: the time and memory of a DP step of a causal LM relative to a non-private step, side by side.

A GPT-2 causal LM (``--model`` folder, e.g. the one ``benchmarks/clm_cpu_experiment.py pretrain`` writes, or a fresh
one from ``--config`` with the MiniLM tokenizer's vocabulary), a fixed micro-batch of ``--batch`` rows of ``--length``
tokens, for ``--trainable lora`` and ``all`` (full fine-tuning, tied embeddings included). Modes, each a full
``DPTrainer.training_step`` (forward, loss, backward, clipping) plus the optimizer step:

* ``nonprivate`` — ``--disable_dp`` with torch AdamW;
* ``dp_ghost`` / ``dp_two_pass`` / ``dp_hooks`` — DP-AdamW with one-pass ghost clipping, two-pass ghost clipping, or
  Opacus' per-sample gradients (noise once per step, ε accounted).

Each (config, mode) runs in its own subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (so RSS follows the live bytes;
peak RSS per mode, sampled every 2 ms, over the RSS after the warm-up step), repetitions interleaved (round r runs every mode once); ratios are against ``nonprivate`` of the same config,
medians over repetitions.

    python benchmarks/clm_step_time.py --model runs/clm_pretrained --reps 3 --steps 3
    python benchmarks/clm_step_time.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import REPO, add_work_option, git_commit, load_jsonl, timed_steps  # noqa: E402

MODES = ["nonprivate", "dp_ghost", "dp_two_pass", "dp_hooks"]
CONFIGS = ["lora", "all"]
OUT = REPO / "benchmarks" / "results" / "clm_step_time.jsonl"


def child(a) -> dict:
    import torch
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, DataCollatorForLanguageModeling

    sys.path.insert(0, str(REPO))
    from hf_dp import DPTrainer, DPTrainingArguments
    from recipes.common.model import resolve_model_path

    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    if a.model:
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model)
    else:
        tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
        cfg = AutoConfig.for_model("gpt2")
        cfg.update_from_string(a.config)
        cfg.vocab_size, cfg.pad_token_id = len(tok), tok.pad_token_id
        model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(1000, len(tok), (max(4 * a.batch, 64), a.length), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": rows})
    dp = a.mode != "nonprivate"
    kw = dict(output_dir=os.path.join(a.work, f"{a.trainable}_{a.mode}"), per_device_train_batch_size=a.batch,
              max_steps=a.steps + 1, trainable=a.trainable, report_to=[], use_cpu=True, disable_tqdm=True,
              save_strategy="no", learning_rate=1e-3, dataloader_num_workers=0)
    if dp:
        kw.update(optim="dp_adamw", noise_multiplier=1.0, per_sample_max_grad_norm=1.0, delta=1e-5,
                  clipping={"dp_ghost": "ghost", "dp_two_pass": "ghost_two_pass", "dp_hooks": "hooks"}[a.mode])
    else:
        kw.update(optim="adamw_torch", disable_dp=True)
    tr = DPTrainer(model=model, args=DPTrainingArguments(**kw), train_dataset=data,
                   data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
    tr.create_optimizer()
    batch = tr._prepare_inputs(dict(DataCollatorForLanguageModeling(tok, mlm=False)([{"input_ids": r} for r in rows[: a.batch]])))
    tr.model.train()
    tr.current_gradient_accumulation_steps = 1  # set by HF's training loop, which this benchmark does not run
    if dp:  # the trainer's planned logical batch is per_device × accumulation: one micro-batch per step here
        tr._check_contract = lambda: None

    def step():
        tr.training_step(tr.model, dict(batch))
        tr.optimizer.step()
        tr.optimizer.zero_grad(set_to_none=True)

    step()  # warm-up
    times, peak_extra = timed_steps(step, a.steps)
    return {"trainable": a.trainable, "mode": a.mode, "step_s": statistics.median(times), "peak_mb": peak_extra,
            "params": sum(p.numel() for p in tr.model.parameters() if p.requires_grad),
            "clipping": getattr(tr, "clipping", None)}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--config", default="n_layer=4,n_embd=128,n_head=4,n_positions=128")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--child", action="store_true")
    ap.add_argument("--trainable", default="lora")
    ap.add_argument("--mode", default="nonprivate")
    add_work_option(ap, "clm_step_time")
    a = ap.parse_args(argv)
    if a.report:
        return report(a.out)
    if a.child:
        print("RESULT " + json.dumps(child(a)))
        return
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    run_id = time.strftime("%Y-%m-%dT%H:%M:%S")
    for rep in range(a.reps):
        for trainable in a.configs.split(","):
            for mode in a.modes.split(","):
                cmd = [sys.executable, __file__, "--child", "--trainable", trainable, "--mode", mode,
                       "--batch", str(a.batch), "--length", str(a.length), "--steps", str(a.steps),
                       "--threads", str(a.threads), "--config", a.config, "--work", a.work]
                if a.model:
                    cmd += ["--model", a.model]
                # tensors ≥ 64 KiB mmapped and unmapped when freed: RSS then follows the live bytes (benchmarks/step_time.py)
                env = dict(os.environ, HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="65536")
                proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
                line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
                if line is None:
                    raise SystemExit(f"{trainable}/{mode} failed:\n{proc.stderr[-3000:]}")
                row = json.loads(line[7:])
                row.update(rep=rep, batch=a.batch, length=a.length, steps=a.steps, threads=a.threads, run=run_id,
                           model=a.model or a.config, commit=git_commit())
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                print(json.dumps(row), flush=True)
    report(a.out, run_id)


def report(path, run_id=None) -> None:
    rows = load_jsonl(path)
    run_id = run_id or (rows[-1]["run"] if rows else None)
    rows = [r for r in rows if r["run"] == run_id]
    print(f"run {run_id}: median step time and live-peak RSS growth over reps; ratio vs nonprivate of the same trainable set")
    print("| trainable | mode | step (s) | × non-private | peak (MB) | × non-private |")
    print("| --- | --- | --- | --- | --- | --- |")
    for trainable in dict.fromkeys(r["trainable"] for r in rows):
        med = {}
        for mode in dict.fromkeys(r["mode"] for r in rows if r["trainable"] == trainable):
            sel = [r for r in rows if r["trainable"] == trainable and r["mode"] == mode]
            med[mode] = (statistics.median(r["step_s"] for r in sel), statistics.median(r["peak_mb"] for r in sel))
        ref = med.get("nonprivate")
        for mode, (s, m) in med.items():
            rs = f"{s / ref[0]:.2f}" if ref else "—"
            rm = f"{m / ref[1]:.2f}" if ref and ref[1] > 0 else "—"
            print(f"| {trainable} | {mode} | {s:.3f} | {rs} | {m:.0f} | {rm} |")


if __name__ == "__main__":
    main()
