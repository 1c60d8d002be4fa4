"""Optimizer step cost: each DP update rule vs torch.optim.AdamW(foreach=True) on the same parameters.

Rows: ``torch_adamw`` (the reference, ``foreach=True``), ``torch_adamw_fused`` (torch's fused CPU/CUDA
kernel, for scale), every DP rule as DPTrainer builds it, and ``<rule>_chain`` (``fused=False``: the
transform chain) for the rules that run torch's fused Adam/AdamW kernel by default.

Measures only the update (``rule.step()`` on a fixed privatized gradient in ``p.grad``), i.e. what the
optimizer adds on top of the privatizer; interleaved repetitions, median and spread, one process.
The parameters are the trainable set of the paper's configuration on all-MiniLM-L6-v2 (last block +
pooler + head: the shapes, random values), so no model download is needed.

    python benchmarks/optimizer_step.py [--reps 30] [--inner 20]

(``--hidden`` / ``--intermediate``, default MiniLM's 384 / 1536, only shrink a smoke run: tests/test_benchmark_smoke.py.)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_dp.optim import DP_OPTIMIZERS, make_optimizer
from hf_dp.optim.registry import get_entry


def minilm_last_block_shapes(hidden=384, inter=1536, labels=2):
    block = [(hidden, hidden), (hidden,)] * 4 + [(hidden,), (hidden,)]  # q,k,v,o (+bias), LN
    block += [(inter, hidden), (inter,), (hidden, inter), (hidden,), (hidden,), (hidden,)]
    return block + [(hidden, hidden), (hidden,), (labels, hidden), (labels,)]


def build(name, shapes):
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in shapes]
    if name.startswith("torch_adamw"):
        kind = "fused" if name.endswith("_fused") else "foreach"
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **{kind: True})
        step = opt.step
    else:
        extra = {}
        if name.endswith("_chain"):  # the transform chain of a rule that runs torch's fused kernel by default
            name, extra = name[: -len("_chain")], {"fused": False}
        opt = make_optimizer(name, params, noise_multiplier=1.0, max_grad_norm=0.1, expected_batch_size=256, lr=1e-3, weight_decay=0.01 if name != "dp_sgd_l2" else 0.0, noise_seed=0, **extra)
        if hasattr(opt.rule, "clamp_rate_every"):
            opt.rule.clamp_rate_every = 10  # as DPTrainer does with --logging_steps 10 (the BC diagnostic)
        step = opt.rule.step
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    return step


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--inner", type=int, default=20)
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--intermediate", type=int, default=1536)
    a = ap.parse_args(argv)
    shapes = minilm_last_block_shapes(a.hidden, a.intermediate)
    fusable = [n for n in DP_OPTIMIZERS if getattr(get_entry(n).rule_cls, "fusable", lambda: False)()]
    names = ["torch_adamw", "torch_adamw_fused", *DP_OPTIMIZERS, *(f"{n}_chain" for n in fusable)]
    steps = {n: build(n, shapes) for n in names}
    for n in names:  # warm-up
        for _ in range(3):
            steps[n]()
    times = {n: [] for n in names}
    for _ in range(a.reps):
        for n in names:  # interleaved
            t0 = time.perf_counter()
            for _ in range(a.inner):
                steps[n]()
            times[n].append((time.perf_counter() - t0) / a.inner)
    base = statistics.median(times["torch_adamw"])
    nparams = sum(torch.Size(s).numel() for s in shapes)
    print(f"# optimizer step cost, {nparams:,} params (MiniLM last block + pooler + head), torch {torch.__version__}, threads {torch.get_num_threads()}")
    print("| optimizer | median ms/step | IQR ms | ratio vs torch AdamW(foreach) |")
    print("| --- | --- | --- | --- |")
    for n in names:
        ts = sorted(times[n])
        q1, q3 = ts[len(ts) // 4], ts[(3 * len(ts)) // 4]
        med = statistics.median(ts)
        print(f"| {n} | {med * 1e3:.3f} | {(q3 - q1) * 1e3:.3f} | {med / base:.2f}× |")


if __name__ == "__main__":
    main()
