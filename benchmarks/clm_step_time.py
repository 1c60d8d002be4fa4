"""Issues 29 §5 and 41: the time and memory of a DP step of a causal LM relative to a non-private step, side by side.

A GPT-2 causal LM (``--model`` folder, e.g. the one ``benchmarks/clm_cpu_experiment.py pretrain`` writes, or a fresh
one from ``--config`` with the MiniLM tokenizer's vocabulary — random weights, the same step cost; ``--arch llama`` a
Llama of the same size, RMSNorm and separate q/k/v, tied embeddings), a fixed micro-batch of ``--batch`` rows of ``--length``
tokens, for ``--trainable lora`` and ``all`` (full fine-tuning, tied embeddings included). Modes, each a full
``DPTrainer.training_step`` (forward, loss, backward, clipping) plus the optimizer step:

* ``nonprivate`` — ``--disable_dp`` with torch AdamW (transformers' own loss, the reference of every ratio);
* ``nonprivate_same_loss`` — the same, with the DP modes' per-sequence loss (:func:`hf_dp.models.loss.causal_lm_loss`,
  whose cross-entropy moves fewer logits-sized tensors than transformers' own) averaged over the batch: a DP mode's time
  over this one is the cost of the privacy machinery alone;
* ``dp_ghost`` / ``dp_two_pass`` / ``dp_hooks`` — DP-AdamW with one-pass ghost clipping, two-pass ghost clipping, or
  Opacus' per-sample gradients (noise once per step, ε accounted);
* ``opacus_ghost`` / ``opacus_hooks`` — Opacus 1.6 on its own (issue 41): ``PrivacyEngine.make_private`` with
  ``grad_sample_mode="ghost"`` (its two-backward ghost clipping, the per-sequence mean loss through its
  ``DPLossFastGradientClipping`` with ``shape=``) or ``"hooks"`` (per-sample gradients), torch AdamW, σ = 1, C = 1, the
  same model, trainable set, batch and labels, a plain loop (forward, loss, backward, step). Opacus' ghost clipping
  refuses tied parameters ("Parameter tying is not supported with Ghost Clipping"), so for ``all`` (tied embeddings)
  that row records the refusal and no time.

Each (config, mode) runs in its own subprocess with ``MALLOC_MMAP_THRESHOLD_=65536`` (so RSS follows the live bytes;
peak RSS per mode, sampled every 2 ms, over the RSS after the warm-up step), repetitions interleaved (round r runs every mode once); ratios are against ``nonprivate`` of the same config,
medians over repetitions. The report ends with one line per trainable set: hf_dp's one-pass ghost clipping and
Opacus 1.6's modes as multiples of the non-private time and memory (issue 41's goals: ≤ 1.1× time for LoRA, ≤ 1.3×
for full fine-tuning, ≤ 1.1× memory).

    python benchmarks/clm_step_time.py --model runs/clm_pretrained --reps 3 --steps 3
    python benchmarks/clm_step_time.py --arch llama --reps 3 --steps 3
    python benchmarks/clm_step_time.py --report
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_io import REPO, add_work_option, append_row, as_new_draw, child_result, git_commit, load_jsonl, timed_steps  # noqa: E402

MODES = ["nonprivate", "nonprivate_same_loss", "dp_ghost", "dp_two_pass", "dp_hooks", "opacus_ghost", "opacus_hooks"]
CONFIGS = ["lora", "all"]
OUT = REPO / "benchmarks" / "results" / "clm_step_time.jsonl"
#: RESULTS §10's GPT-2 (tied embeddings; the MiniLM vocabulary, 30,522 words) and a Llama of the same size
GPT2_CONFIG = "n_layer=4,n_embd=128,n_head=4,n_positions=128"
LLAMA_CONFIG = ("hidden_size=128,intermediate_size=512,num_hidden_layers=4,num_attention_heads=4,num_key_value_heads=4,"
                "max_position_embeddings=128,tie_word_embeddings=True")


def _model_and_rows(a):
    """(tokenizer, model, token rows): the ``--model`` folder or a fresh GPT-2 from ``--config``; random rows, seed 0."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(REPO))
    from recipes.common.model import resolve_model_path

    torch.manual_seed(0)
    torch.set_num_threads(a.threads)
    if a.model:
        tok = AutoTokenizer.from_pretrained(a.model)
        model = AutoModelForCausalLM.from_pretrained(a.model)
    else:
        tok = AutoTokenizer.from_pretrained(resolve_model_path("minilm"))
        cfg = AutoConfig.for_model(getattr(a, "arch", "gpt2"))
        cfg.update_from_string(a.config)
        cfg.vocab_size, cfg.pad_token_id = len(tok), tok.pad_token_id
        model = AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(1000, len(tok), (max(4 * a.batch, 64), a.length), generator=g).tolist()
    return tok, model, rows


def child_opacus(a) -> dict:
    """One ``opacus_*`` mode: Opacus 1.6's PrivacyEngine on the same model, trainable set and batch (see the docstring)."""
    import torch
    import torch.nn.functional as F
    from opacus import PrivacyEngine
    from transformers import DataCollatorForLanguageModeling

    tok, model, rows = _model_and_rows(a)
    from hf_dp.models import apply_trainable

    model, _ = apply_trainable(model, a.trainable)
    model.train()
    row = {"trainable": a.trainable, "mode": a.mode, "clipping": a.mode,
           "params": sum(p.numel() for p in model.parameters() if p.requires_grad)}
    batch = DataCollatorForLanguageModeling(tok, mlm=False)([{"input_ids": r} for r in rows[: a.batch]])
    ids, labels = batch["input_ids"], batch["labels"]
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:]  # the model's own shift, as hf_dp's per-sequence loss
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(ids), batch_size=a.batch)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    ghost = a.mode == "opacus_ghost"
    made = PrivacyEngine().make_private(  # (module, optimizer, criterion, loader) for ghost, without the criterion else
        module=model, optimizer=opt, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0, poisson_sampling=False,
        grad_sample_mode="ghost" if ghost else "hooks", criterion=torch.nn.CrossEntropyLoss(ignore_index=-100))
    model, opt, crit = made[0], made[1], (made[2] if ghost else None)

    # one position row per example: Opacus' per-sample gradient of the position embedding needs a batch axis
    positions = torch.arange(ids.shape[1]).expand(ids.shape[0], -1).contiguous()

    def step():
        logits = model(input_ids=ids, position_ids=positions).logits
        flat = logits.reshape(-1, logits.shape[-1])
        if ghost:  # per-sequence mean over the scored tokens, Opacus' own reduction for generative tasks
            loss = crit(flat, shift.reshape(-1), shape=logits.shape)
        else:
            tokens = F.cross_entropy(flat, shift.reshape(-1), ignore_index=-100, reduction="none").view(shift.shape)
            loss = (tokens.sum(1) / (shift != -100).sum(1).clamp_min(1)).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    try:
        step()  # warm-up
    except NotImplementedError as e:  # Opacus' ghost clipping and tied parameters
        return {**row, "step_s": None, "peak_mb": None, "unsupported": str(e)}
    times, peak_extra = timed_steps(step, a.steps)
    return {**row, "step_s": statistics.median(times), "peak_mb": peak_extra}


def child(a) -> dict:
    if a.mode.startswith("opacus_"):
        return child_opacus(a)
    import torch
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling

    tok, model, rows = _model_and_rows(a)
    from hf_dp import DPTrainer, DPTrainingArguments

    data = Dataset.from_dict({"input_ids": rows})
    dp = not a.mode.startswith("nonprivate")
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
    if a.mode == "nonprivate_same_loss":  # the DP modes' per-sequence loss (hf_dp.models.loss), averaged, no DP
        from hf_dp.models.loss import causal_lm_loss

        def same_loss(model, inputs, return_outputs=False, num_items_in_batch=None):
            labels = inputs.pop("labels")
            return causal_lm_loss(model(**inputs).logits, labels, None, inputs.get("attention_mask")).mean()

        tr.compute_loss = same_loss

    def step():
        tr.training_step(tr.model, as_new_draw(tr, batch) if dp else dict(batch))
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
    ap.add_argument("--arch", default="gpt2", help="the model type of a fresh model from --config (gpt2, llama, …)")
    ap.add_argument("--config", default=None, help=f"a fresh model's config (default for gpt2: {GPT2_CONFIG}; for "
                    f"llama: {LLAMA_CONFIG})")
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
    if a.config is None:
        a.config = {"gpt2": GPT2_CONFIG, "llama": LLAMA_CONFIG}.get(a.arch, "")
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
                       "--threads", str(a.threads), "--arch", a.arch, "--config", a.config, "--work", a.work]
                if a.model:
                    cmd += ["--model", a.model]
                # tensors ≥ 64 KiB mmapped and unmapped when freed: RSS then follows the live bytes (benchmarks/step_time.py)
                env = dict(os.environ, HF_HUB_OFFLINE="1", MALLOC_MMAP_THRESHOLD_="65536")
                row = child_result(cmd, env, f"{trainable}/{mode}")
                row.update(rep=rep, batch=a.batch, length=a.length, steps=a.steps, threads=a.threads, run=run_id,
                           model=a.model or f"{a.arch}:{a.config}", commit=git_commit())
                append_row(a.out, row)
    report(a.out, run_id)


def report(path, run_id=None) -> None:
    rows = load_jsonl(path)
    run_id = run_id or (rows[-1]["run"] if rows else None)
    rows = [r for r in rows if r["run"] == run_id]
    print(f"run {run_id}: median step time and live-peak RSS growth over reps; ratio vs nonprivate of the same trainable set")
    print("| trainable | mode | step (s) | × non-private | peak (MB) | × non-private |")
    print("| --- | --- | --- | --- | --- | --- |")
    summary = []
    for trainable in dict.fromkeys(r["trainable"] for r in rows):
        med = {}
        refused = {}
        for mode in dict.fromkeys(r["mode"] for r in rows if r["trainable"] == trainable):
            sel = [r for r in rows if r["trainable"] == trainable and r["mode"] == mode]
            timed = [r for r in sel if r.get("step_s") is not None]
            if not timed:  # Opacus' ghost clipping refuses tied parameters
                refused[mode] = sel[0].get("unsupported", "no time")
                continue
            med[mode] = (statistics.median(r["step_s"] for r in timed), statistics.median(r["peak_mb"] for r in timed))
        ref = med.get("nonprivate")
        for mode, (s, m) in med.items():
            rs = f"{s / ref[0]:.2f}" if ref else "—"
            rm = f"{m / ref[1]:.2f}" if ref and ref[1] > 0 else "—"
            print(f"| {trainable} | {mode} | {s:.3f} | {rs} | {m:.0f} | {rm} |")
        for mode, why in refused.items():
            print(f"| {trainable} | {mode} | refused: {why} | — | — | — |")
        if ref:  # issue 41's goals: one-pass ghost ≤ 1.1× (LoRA) / 1.3× (full) the non-private time, ≤ 1.1× its memory
            def ratio(mode, i):
                return f"{med[mode][i] / ref[i]:.2f}×" if mode in med and ref[i] > 0 else ("refused" if mode in refused else "—")
            goal = {"lora": 1.1, "all": 1.3}.get(trainable)
            same = med.get("nonprivate_same_loss")
            alone = f" ({med['dp_ghost'][0] / same[0]:.2f}× the same loss without DP)" if same and "dp_ghost" in med else ""
            summary.append(f"{trainable}: hf_dp ghost {ratio('dp_ghost', 0)} time" + (f" (goal ≤ {goal}×)" if goal else "") + alone
                           + f", {ratio('dp_ghost', 1)} memory (goal ≤ 1.1×); Opacus 1.6 ghost {ratio('opacus_ghost', 0)} "
                           f"time, {ratio('opacus_ghost', 1)} memory; Opacus hooks {ratio('opacus_hooks', 0)} time, "
                           f"{ratio('opacus_hooks', 1)} memory")
    for line in summary:
        print(line)


if __name__ == "__main__":
    main()
