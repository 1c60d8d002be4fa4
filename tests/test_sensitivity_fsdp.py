"""The sensitivity the accountant uses, C, under FSDP2 (``--fsdp full_shard``) on two gloo processes (issue 49).

tests/test_sensitivity.py's guarantee, checked where the clipped sum is formed on shards and summed over ranks: one-pass
ghost clipping under FSDP (:class:`hf_dp.clipping.fsdp_ghost.ShardedGhostEngine`, the default there) and two passes
(``--clipping ghost_two_pass``). Each rank builds the FSDP DPTrainer, trains one step (noise zeroed inside
``add_noise``) so that Accelerate shards the model, then runs DPTrainer's own ``training_step`` on hand-built
micro-batches — both ranks the same number of times, so that their collectives stay in step — and reads the sum S the
privatizer would add noise to: every rank's ``p.summed_grad`` is a sharded DTensor holding its shard of the sum over
ranks, gathered with ``full_tensor()``. With D many copies of one 8-token row on *each* rank (or the other
compositions of :func:`compositions`), x one row of the model's maximum length and x' another, placed in one rank's
micro-batch:

* add/remove: ‖S(D + x) − S(D)‖ ≤ C;
* replace: ‖S(D + x) − S(D + x')‖ ≤ 2C.

Before issue 49 the allowance was γ over each rank's micro-batch's own rows × padded length: x joining one rank's
256 copies lowered every copy's clip factor on that rank and moved S by more than C (on 72a3f42: GPT-2 2.04 C, BERT
1.56 C, one pass and two passes alike; after the fix 0.973 C and 0.997 C — x's own clipped share).
"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from two_process import DISTRIBUTED, in_sequence, launch, rank_results  # noqa: E402

import test_sensitivity as sensitivity  # noqa: E402  (the models and the micro-batches of the one-process test)

pytestmark = DISTRIBUTED  # slow: tests/conftest.py SLOW_FILES

C = 1e-4  # every example is clipped: each contributes exactly its clipped share
VOCAB = 64
MAX_LEN = 160  # the models' maximum positions: the long rows' length
COPIES = 256  # copies of the short row on each rank
PER_DEVICE = 160  # the planned micro-batch: the run's public token bound (rows) then covers COPIES + 1 rows of MAX_LEN
CASES = (("gpt2", "ghost"), ("gpt2", "ghost_two_pass"), ("bert", "ghost"), ("bert", "ghost_two_pass"))


def gpt2(seed=0):
    return sensitivity.gpt2(seed, tie=False)  # untied: FSDP under DP refuses parameters shared between modules


MODELS = {"bert": (sensitivity.bert, "BertLayer"), "gpt2": (gpt2, "GPT2Block")}
batch = sensitivity.batch


def rand_rows(g, n, length):
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for _ in range(n)]


def compositions():
    """(name, (rank 0's D rows, labels), (rank 1's D rows, labels), x row, x label, x' row, x' label, x's rank)."""
    g = torch.Generator().manual_seed(0)
    short = rand_rows(g, 1, 8)[0]
    long_, long2 = rand_rows(g, 2, MAX_LEN)
    mixed = [rand_rows(g, 1, 1 + i % 8)[0] for i in range(128)]
    copies = ([short] * COPIES, [0] * COPIES)
    yield f"{COPIES} copies of an 8-token row on each rank + one row of the maximum length on rank 0", copies, copies, long_, 1, long2, 0, 0
    yield "128 different short rows on each rank + one long row on rank 1", (mixed, [i % 2 for i in range(128)]), \
        (mixed[::-1], [i % 2 for i in range(128)]), long_, 1, short, 0, 1
    yield "24 copies of a long row on each rank + one 2-token row on rank 1", ([long_] * 24, [0] * 24), ([long2] * 24, [1] * 24), \
        short[:2], 1, long2[:3], 1, 1
    yield "one row on each rank + one row of the maximum length on rank 0", ([short], [0]), ([long2], [1]), long_, 1, short[:2], 0, 0


def run_case(out: str, rank: int, arch: str, engine: str) -> None:
    """In a worker (both ranks): the FSDP DPTrainer of ``arch`` with ``engine``, one training step (noise zeroed),
    then S(D), S(D + x), S(D + x') of every composition through ``training_step``; rank 0 saves the ratios to C."""
    import time

    from datasets import Dataset
    from torch.distributed.tensor import DTensor

    from hf_dp import DPTrainer
    from hf_dp.privacy.privatizer import PrivateOptimizer
    from helpers import dp_args, drawn

    start = time.perf_counter()
    if not getattr(PrivateOptimizer, "_sensitivity_no_noise", False):  # the step trains the noiseless model
        orig = PrivateOptimizer.add_noise

        def add_noise(self):
            sigma, self.noise_multiplier = self.noise_multiplier, 0.0
            try:
                return orig(self)
            finally:
                self.noise_multiplier = sigma

        PrivateOptimizer.add_noise = add_noise
        PrivateOptimizer._sensitivity_no_noise = True

    make, block = MODELS[arch]
    causal = arch != "bert"
    n = 4 * PER_DEVICE  # B = 2 × PER_DEVICE, q = 1/2
    ids = [[5 + i % 50, 6, 7] for i in range(n)]  # one length: HF's default collator stacks them
    data = {"input_ids": ids, "attention_mask": [[1, 1, 1]] * n,
            "labels": [list(r) for r in ids] if causal else [i % 2 for i in range(n)]}
    args = dp_args(os.path.join(out, f"{arch}-{engine}"), noise_multiplier=1.0, epsilon=None, max_steps=1,
                   trainable="all", per_device_train_batch_size=PER_DEVICE, per_sample_max_grad_norm=C,
                   clipping=engine, fsdp="full_shard", fsdp_config={"transformer_layer_cls_to_wrap": [block]},
                   ddp_backend="gloo", learning_rate=1e-3, logging_steps=100)
    tr = DPTrainer(model=make(), args=args, train_dataset=Dataset.from_dict(data))
    tr.train()  # Accelerate shards the model (fully_shard) and builds the privatizer over the sharded parameters
    model = tr.model_wrapped or tr.model
    model.train()
    opt = tr.dp.optimizer
    assert all(isinstance(p, DTensor) for p in opt.params), "the model was not sharded"

    def clipped_sum(inputs) -> torch.Tensor:
        """S: the sum over both ranks that the privatizer would add noise to, float64 (a collective: both ranks)."""
        opt.discard_pending()
        tr.training_step(model, drawn(tr, inputs))
        s = torch.cat([(p.summed_grad.full_tensor() if isinstance(p.summed_grad, DTensor) else p.summed_grad)
                       .reshape(-1).double() for p in opt.params])
        opt.discard_pending()
        return s

    results = []
    for name, (D0, y0), (D1, y1), x, yx, x2, yx2, where in compositions():
        mine, ys = (D0, y0) if rank == 0 else (D1, y1)
        s_d = clipped_sum(batch(mine, causal, ys))
        if rank == where:
            s_dx = clipped_sum(batch(mine + [x], causal, ys + [yx]))
            s_dx2 = clipped_sum(batch(mine + [x2], causal, ys + [yx2]))
        else:  # the other rank's micro-batch is D's, at each of the three steps
            s_dx = clipped_sum(batch(mine, causal, ys))
            s_dx2 = clipped_sum(batch(mine, causal, ys))
        results.append(dict(name=name, add=float((s_dx - s_d).norm()) / C, replace=float((s_dx - s_dx2).norm()) / C))
    kind = type(tr.clipping_engine).__name__
    torch.save(dict(results=results, engine=kind, clipping=tr.clipping, seconds=time.perf_counter() - start),
               os.path.join(out, f"{arch}-{engine}_rank{rank}.pt"))


def test_adding_or_replacing_one_row_moves_the_fsdp_sum_by_at_most_C(tmp_path):
    bodies = {f"{arch}_{engine}": f"from test_sensitivity_fsdp import run_case\nrun_case(out, rank, {arch!r}, {engine!r})\n"
              for arch, engine in CASES}
    launch(tmp_path, in_sequence(**bodies), timeout=400)
    report, failures = [], []
    for arch, engine in CASES:
        r0, r1 = rank_results(tmp_path, f"{arch}-{engine}_")
        expected = "ShardedGhostEngine" if engine == "ghost" else "TwoPassGhostEngine"
        assert r0["engine"] == expected, (arch, engine, r0["engine"])
        assert [r["add"] for r in r0["results"]] == [r["add"] for r in r1["results"]]  # both gathered the same S
        for r in r0["results"]:
            report.append(f"{arch}/{engine}, {r['name']}: add {r['add']:.6f} C, replace {r['replace']:.6f} C "
                          f"({r0['seconds']:.1f} s)")
            if not r["add"] <= 1.0:
                failures.append(f"{arch}/{engine}, {r['name']}: adding one row moved the clipped sum by {r['add']:.6f} C")
            if not r["replace"] <= 2.0:
                failures.append(f"{arch}/{engine}, {r['name']}: replacing one row moved it by {r['replace']:.6f} C")
    print("\n".join(report))
    assert not failures, "\n".join(failures)
