"""FSDP2 under DP: per-rank memory of parameters + gradients + optimizer state, and step time, 2 gloo processes.

Each mode is one ``torchrun --nproc_per_node 2`` launch of ``DPTrainer`` (the whole HF/Accelerate path), full
fine-tuning (``--trainable all``) of a random BERT (``--hidden``, ``--layers``, vocabulary 8 000), per-rank batch
``--batch`` of ``--length`` tokens (fixed length), float32:

* ``dp_fsdp``          — ``--fsdp full_shard`` (FSDP2), two-pass ghost clipping, noise on each rank's shard, dp_adamw;
* ``nonprivate_fsdp``  — ``--fsdp full_shard`` with ``--disable_dp`` (HF's own FSDP2 training), adamw_torch;
* ``dp_ddp``           — DDP, two-pass ghost clipping (the same clipping as ``dp_fsdp``), dp_adamw.

Memory: each rank's bytes of its *local* parameters, gradients (``p.grad`` when the optimizer steps: the privatized
gradient under DP) and optimizer state (Adam's two moments), summed over tensors (shards under FSDP); the report
takes the larger rank. Time: rank 0's wall time per optimizer step (HF callbacks), median after ``--warmup`` steps.
Ratios: memory against ``dp_ddp``, time against ``nonprivate_fsdp``, from the same run.

    python benchmarks/fsdp_step_time.py --hidden 256 --layers 4 --batch 8 --length 64 --steps 12 --json results/fsdp_step_time.json

``--smoke``: ``dp_fsdp`` only, tiny sizes, two steps (tests/test_benchmark_smoke.py): it checks the code runs.
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

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODES = ["dp_fsdp", "nonprivate_fsdp", "dp_ddp"]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_io import add_work_option, work_dir  # noqa: E402


def worker(mode: str, hidden: int, layers: int, batch: int, length: int, steps: int, warmup: int, out: str) -> None:
    import time
    import warnings

    warnings.filterwarnings("ignore")
    import torch
    import transformers
    from datasets import Dataset
    from transformers import BertConfig, BertForSequenceClassification, TrainerCallback

    from hf_dp import DPTrainer, DPTrainingArguments

    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    rank = int(os.environ["RANK"])
    torch.manual_seed(0)
    cfg = BertConfig(vocab_size=8000, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                     intermediate_size=4 * hidden, max_position_embeddings=max(64, length), num_labels=2,
                     hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    model = BertForSequenceClassification(cfg)
    n = 4096
    g = torch.Generator().manual_seed(1)
    ds = Dataset.from_dict({"input_ids": torch.randint(5, 8000, (n, length), generator=g).tolist(),
                            "labels": torch.randint(0, 2, (n,), generator=g).tolist()})
    private = mode.startswith("dp_")
    kw = dict(fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": ["BertLayer"]}) if mode.endswith("fsdp") else {}
    if private:
        kw.update(optim="dp_adamw", noise_multiplier=1.0, clipping="ghost_two_pass", trainable="all",
                  train_sampling_strategy="random")
    else:
        kw.update(optim="adamw_torch", disable_dp=True, trainable="all")
    args = DPTrainingArguments(
        output_dir=os.path.join(out, f"run_{mode}"), per_device_train_batch_size=batch, max_steps=steps, learning_rate=1e-4,
        report_to=[], use_cpu=True, ddp_backend="gloo", save_strategy="no", disable_tqdm=True, logging_steps=10**6,
        dataloader_num_workers=0, seed=0, **kw,
    )

    def local_bytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    times, memory = [], {}

    class Probe(TrainerCallback):
        def on_step_begin(self, a, state, control, **k):
            self.t0 = time.perf_counter()

        def on_step_end(self, a, state, control, **k):
            times.append(time.perf_counter() - self.t0)

        def on_optimizer_step(self, a, state, control, model=None, optimizer=None, **k):  # before HF's zero_grad
            if not memory:
                params = [p for p in model.parameters() if p.requires_grad]
                opt = getattr(optimizer, "optimizer", optimizer)
                state_tensors = [v for s in getattr(opt, "state", {}).values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
                if not state_tensors and hasattr(opt, "rule"):  # the DP rule keeps Adam's moments
                    state_tensors = [v for s in opt.rule.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
                memory.update(params=sum(local_bytes(p) for p in params),
                              grads=sum(local_bytes(p.grad) for p in params if p.grad is not None),
                              optimizer=sum(local_bytes(v) for v in state_tensors))

    trainer = DPTrainer(model=model, args=args, train_dataset=ds, callbacks=[Probe()])
    trainer.train()
    timed = times[warmup:] or times
    with open(os.path.join(out, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(dict(mode=mode, rank=rank, median_s_per_step=statistics.median(timed), steps=len(timed),
                       wrapped=type(trainer.model_wrapped).__name__, **memory), f)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(mode: str, a, out: str) -> list[dict]:
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
           "--master_port", str(_free_port()), os.path.abspath(__file__), "--worker", mode, "--out", out,
           "--hidden", str(a.hidden), "--layers", str(a.layers), "--batch", str(a.batch), "--length", str(a.length),
           "--steps", str(a.steps), "--warmup", str(a.warmup)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} failed:\n{proc.stderr[-4000:]}")
    return [json.load(open(os.path.join(out, f"{mode}_rank{r}.json"))) for r in (0, 1)]


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--json", default=None)
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None, help=argparse.SUPPRESS)
    add_work_option(ap, "fsdp_step_time")
    a = ap.parse_args(argv)
    if a.worker:
        worker(a.worker, a.hidden, a.layers, a.batch, a.length, a.steps, a.warmup, a.out)
        return []
    if a.smoke:
        a.hidden, a.layers, a.batch, a.length, a.steps, a.warmup, a.modes = 16, 1, 2, 8, 2, 0, "dp_fsdp"
    modes = a.modes.split(",")
    rows = {}
    with tempfile.TemporaryDirectory(dir=work_dir(a.work)) as out:
        for mode in modes:
            ranks = launch(mode, a, out)
            rows[mode] = dict(mode=mode, wrapped=ranks[0]["wrapped"], median_s_per_step=ranks[0]["median_s_per_step"],
                              **{k: max(r[k] for r in ranks) for k in ("params", "grads", "optimizer")})
            rows[mode]["state_mb"] = (rows[mode]["params"] + rows[mode]["grads"] + rows[mode]["optimizer"]) / 2**20
    ref_mem = rows.get("dp_ddp", {}).get("state_mb")
    ref_time = rows.get("nonprivate_fsdp", {}).get("median_s_per_step")
    summary = []
    print("| mode | wrapped | params+grads+optimizer per rank (MB) | vs dp_ddp | s/step | vs nonprivate_fsdp |")
    print("| --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        r = rows[mode]
        r["memory_ratio_vs_dp_ddp"] = r["state_mb"] / ref_mem if ref_mem else None
        r["time_ratio_vs_nonprivate_fsdp"] = r["median_s_per_step"] / ref_time if ref_time else None
        fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
        print(f"| {mode} | {r['wrapped']} | {r['state_mb']:.2f} | {fmt(r['memory_ratio_vs_dp_ddp'])} | "
              f"{r['median_s_per_step']:.3f} | {fmt(r['time_ratio_vs_nonprivate_fsdp'])} |")
        summary.append(r)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        with open(a.json, "w") as f:
            json.dump(dict(args=vars(a), rows=summary), f, indent=1)
    return summary


if __name__ == "__main__":
    main()
