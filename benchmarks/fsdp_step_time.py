"""FSDP2 under DP: per-rank memory of parameters + gradients + optimizer state, and step time, 2 gloo processes.

Each mode is one ``torchrun --nproc_per_node 2`` launch, full fine-tuning of the same random BERT (``--hidden``,
``--layers``, vocabulary 8 000, no dropout), per-rank batch ``--batch`` of ``--length`` tokens (fixed length), float32,
Adam(W) with the same learning rate:

* ``dp_fsdp``            — ``DPTrainer`` with ``--fsdp full_shard`` (FSDP2), ``--clipping auto``: one-pass ghost
  clipping, the clipped sums reduce-scattered into the shards (``hf_dp.clipping.fsdp_ghost``), noise on each rank's
  shard, dp_adamw, Poisson batches (expected ``--batch`` per rank);
* ``dp_fsdp_two_pass``   — the same with ``--clipping ghost_two_pass`` (a second backward; no layer records kept);
* ``nonprivate_fsdp``    — ``--fsdp full_shard`` with ``--disable_dp`` (HF's own FSDP2 training), adamw_torch;
* ``dp_ddp``             — DDP, ``--clipping auto`` (one-pass ghost), dp_adamw;
* ``opacus_ghost_fsdp``  — Opacus 1.6's ghost clipping under FSDP2 as it ships it: ``FSDP2Wrapper`` (each module with
  parameters its own ``fully_shard`` unit), ``PrivacyEngine.make_private(grad_sample_mode="ghost_fsdp")``, its
  Poisson ``DPDataLoader`` (expected ``--batch`` per rank), AdamW, noise multiplier 1, a plain PyTorch loop;
* ``nonprivate_fsdp_plain`` — the same plain loop and ``FSDP2Wrapper`` wrapping without Opacus (``torch.optim.AdamW``,
  fixed batches): the non-private reference of Opacus' own path.

Memory: each rank's bytes of its *local* parameters, gradients (``p.grad`` when the optimizer steps: the privatized
gradient under DP) and optimizer state (Adam's two moments), summed over tensors (shards under FSDP); the report
takes the larger rank. Beside it, each rank's peak resident set (``ru_maxrss``, libraries included: it shows what
one pass's layer records add against two passes, not a per-tensor count). Time: rank 0's wall time per optimizer
step (HF's step callbacks; in the plain loops forward, backward and step, the batch already loaded), median after
``--warmup`` steps. The DP modes draw Poisson batches (each rank's size varies, the larger one sets the pace), the
non-private ones fixed batches.

Every mode runs ``--reps`` times, interleaved (mode 1, mode 2, …, mode 1, mode 2, …); a mode's time is the median
over its repetitions, and each time ratio is the median over repetitions of the ratio within that repetition: time
against ``nonprivate_fsdp`` (and, for Opacus, also against ``nonprivate_fsdp_plain``), memory against ``dp_ddp``. The
JSON holds every repetition's raw numbers, the command and the commit.

    python benchmarks/fsdp_step_time.py --hidden 256 --layers 4 --batch 8 --length 64 --steps 12 --reps 3 \
        --json benchmarks/results/fsdp_step_time.json

``--smoke``: ``dp_fsdp`` and ``opacus_ghost_fsdp``, tiny sizes, two steps, one repetition
(tests/test_benchmark_smoke.py): it checks the code runs.
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
MODES = ["dp_fsdp", "dp_fsdp_two_pass", "nonprivate_fsdp", "dp_ddp", "opacus_ghost_fsdp", "nonprivate_fsdp_plain"]
PLAIN_MODES = ("opacus_ghost_fsdp", "nonprivate_fsdp_plain")

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_io import add_work_option, git_commit, work_dir  # noqa: E402


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
    if mode in PLAIN_MODES:
        return plain_worker(mode, model, ds, batch, steps, warmup, out, rank)
    private = mode.startswith("dp_")
    kw = dict(fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": ["BertLayer"]}) if "_fsdp" in mode else {}
    if private:
        kw.update(optim="dp_adamw", noise_multiplier=1.0, clipping="ghost_two_pass" if mode.endswith("two_pass") else "auto",
                  trainable="all", train_sampling_strategy="random")
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
        json.dump(dict(mode=mode, rank=rank, median_s_per_step=statistics.median(timed), steps=len(timed), peak_rss_mb=_peak_rss_mb(),
                       wrapped=type(trainer.model_wrapped).__name__, clipping=getattr(trainer, "clipping", None), **memory), f)
    _close_group()


def _close_group() -> None:
    """Both ranks leave together and close the process group: a rank exiting while gloo's threads still serve the
    other one aborts now and then ("terminate called without an active exception")."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def _peak_rss_mb() -> float:
    """This process's peak resident set (MB): everything, libraries included — for comparing modes, not a budget."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _local_bytes(t) -> int:
    t = t.to_local() if hasattr(t, "to_local") else t
    return t.numel() * t.element_size()


def plain_worker(mode: str, model, ds, batch: int, steps: int, warmup: int, out: str, rank: int) -> None:
    """A plain PyTorch loop under FSDP2 with Opacus' wrapping (``FSDP2Wrapper``): with Opacus 1.6's ghost clipping
    (``opacus_ghost_fsdp``) or without privacy (``nonprivate_fsdp_plain``)."""
    import time

    import torch
    import torch.distributed as dist
    from opacus.utils.fsdp_utils import FSDP2Wrapper
    from torch.utils.data import DataLoader, TensorDataset
    from torch.utils.data.distributed import DistributedSampler

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    data = TensorDataset(torch.tensor(ds["input_ids"]), torch.tensor(ds["labels"]))
    model.train()
    model = FSDP2Wrapper(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    criterion = torch.nn.CrossEntropyLoss()
    if mode == "opacus_ghost_fsdp":
        from opacus import PrivacyEngine

        loader = DataLoader(data, batch_size=batch * world)  # Opacus: q = 1/len(loader), expected `batch` per rank
        engine = PrivacyEngine()
        model, optimizer, criterion, loader = engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, criterion=criterion, noise_multiplier=1.0,
            max_grad_norm=1.0, grad_sample_mode="ghost_fsdp", poisson_sampling=True)
    else:
        loader = DataLoader(data, batch_size=batch, sampler=DistributedSampler(data, shuffle=True, seed=0), drop_last=True)
    times, memory = [], {}
    batches = iter(loader)
    for _ in range(steps):
        ids, labels = next(batches)
        t0 = time.perf_counter()
        # contiguous position and token-type ids: Opacus' embedding norm sampler views its ids (BERT's defaults are
        # an expanded buffer, which it cannot view)
        pos = torch.arange(ids.shape[1]).expand_as(ids).contiguous()
        loss = criterion(model(input_ids=ids, position_ids=pos, token_type_ids=torch.zeros_like(ids)).logits, labels)
        loss.backward()
        optimizer.step()
        times.append(time.perf_counter() - t0)
        if not memory:
            inner = getattr(optimizer, "original_optimizer", optimizer)
            params = [p for p in model.parameters() if p.requires_grad]
            state = [v for s in inner.state.values() for v in s.values() if torch.is_tensor(v) and v.dim() > 0]
            memory.update(params=sum(_local_bytes(p) for p in params),
                          grads=sum(_local_bytes(p.grad) for p in params if p.grad is not None),
                          optimizer=sum(_local_bytes(v) for v in state))
        optimizer.zero_grad(set_to_none=True)
    timed = times[warmup:] or times
    with open(os.path.join(out, f"{mode}_rank{rank}.json"), "w") as f:
        json.dump(dict(mode=mode, rank=rank, median_s_per_step=statistics.median(timed), steps=len(timed), peak_rss_mb=_peak_rss_mb(),
                       wrapped=type(getattr(model, "_module", model)).__name__, clipping="opacus ghost_fsdp" if mode == "opacus_ghost_fsdp" else None,
                       **memory), f)
    dist.barrier()
    dist.destroy_process_group()


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


def _ratio_rows(reps: list[dict], modes: list[str]) -> dict:
    """Per mode: the medians over repetitions of its time, its memory, and of each ratio within a repetition."""
    out = {}
    for mode in modes:
        runs = [rep[mode] for rep in reps]

        def ratios(ref: str, key: str) -> float | None:
            vals = [rep[mode][key] / rep[ref][key] for rep in reps if ref in rep and rep[ref][key]]
            return statistics.median(vals) if vals else None

        out[mode] = dict(
            mode=mode, wrapped=runs[0]["wrapped"], clipping=runs[0]["clipping"],
            median_s_per_step=statistics.median(r["median_s_per_step"] for r in runs),
            s_per_step_reps=[r["median_s_per_step"] for r in runs],
            **{k: max(r[k] for r in runs) for k in ("params", "grads", "optimizer", "state_mb")},
            peak_rss_mb=statistics.median(r["peak_rss_mb"] for r in runs),
            memory_ratio_vs_dp_ddp=ratios("dp_ddp", "state_mb"),
            time_ratio_vs_nonprivate_fsdp=ratios("nonprivate_fsdp", "median_s_per_step"),
            time_ratio_vs_nonprivate_fsdp_plain=ratios("nonprivate_fsdp_plain", "median_s_per_step"),
        )
    return out


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--length", type=int, default=64)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3, help="repetitions of every mode, interleaved")
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
        a.hidden, a.layers, a.batch, a.length, a.steps, a.warmup, a.reps = 16, 1, 2, 8, 2, 0, 1
        a.modes = "dp_fsdp,opacus_ghost_fsdp"
    modes = a.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"error: unknown --modes {unknown}; choose from {MODES}")
    reps = []
    with tempfile.TemporaryDirectory(dir=work_dir(a.work)) as out:
        for rep in range(a.reps):  # interleaved: every mode once per repetition
            rows = {}
            for mode in modes:
                run_out = os.path.join(out, f"rep{rep}")
                os.makedirs(run_out, exist_ok=True)
                ranks = launch(mode, a, run_out)
                rows[mode] = dict(mode=mode, wrapped=ranks[0]["wrapped"], clipping=ranks[0].get("clipping"),
                                  median_s_per_step=ranks[0]["median_s_per_step"],
                                  peak_rss_mb=max(r["peak_rss_mb"] for r in ranks),
                                  **{k: max(r[k] for r in ranks) for k in ("params", "grads", "optimizer")})
                rows[mode]["state_mb"] = (rows[mode]["params"] + rows[mode]["grads"] + rows[mode]["optimizer"]) / 2**20
            reps.append(rows)
    table = _ratio_rows(reps, modes)
    fmt = lambda x: "-" if x is None else f"{x:.2f}"  # noqa: E731
    print(f"{a.reps} repetition(s), interleaved; medians (ratios: median over repetitions of the ratio within one)")
    print("| mode | wrapped | clipping | params+grads+optimizer per rank (MB) | vs dp_ddp | peak RSS per rank (MB) | s/step "
          "| vs nonprivate_fsdp | vs nonprivate_fsdp_plain |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    summary = []
    for mode in modes:
        r = table[mode]
        print(f"| {mode} | {r['wrapped']} | {r['clipping'] or '-'} | {r['state_mb']:.2f} | {fmt(r['memory_ratio_vs_dp_ddp'])} | "
              f"{r['peak_rss_mb']:.0f} | {r['median_s_per_step']:.3f} | {fmt(r['time_ratio_vs_nonprivate_fsdp'])} | "
              f"{fmt(r['time_ratio_vs_nonprivate_fsdp_plain'])} |")
        summary.append(r)
    if a.json:
        os.makedirs(os.path.dirname(os.path.abspath(a.json)), exist_ok=True)
        command = "python benchmarks/fsdp_step_time.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(a.json, "w") as f:
            dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                                   text=True).stdout.strip() != ""
            json.dump(dict(args=vars(a), command=command, commit=git_commit(), uncommitted_changes=dirty, rows=summary,
                           raw_reps=reps), f, indent=1)
    return summary


if __name__ == "__main__":
    main()
