"""Two CPU processes (gloo) train one DP model: identical weights, noise once per step, same ε as one process.

One worker script, launched once for both tests with ``python -m torch.distributed.run --nproc_per_node 2``
(tests/two_process.py), runs the DDP run and then every clipping engine. Each rank writes what it saw to
``rank{r}.pt`` (``engines_rank{r}.pt``); the tests compare them and check ε against a one-process run with the same
global batch (per_device × 2 processes vs per_device·2 × 1 process).

Configuration: per_device 1, gradient accumulation 2, 2 processes ⇒ B = 4, N = 128 ⇒ q = 1/32, so
each rank draws ~2 rows per step split in 2 micro-batches: empty micro-batches (the placeholder row
with zero loss, which keeps DDP's ranks in step) occur often and are counted.
"""

from __future__ import annotations

import hashlib
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_process import DISTRIBUTED, in_sequence, launch, rank_results  # noqa: E402

pytestmark = DISTRIBUTED

N, PER_DEVICE, GA, STEPS, SEED = 128, 1, 2, 10, 3

WORKER = r"""
    from hf_dp.privacy.privatizer import PrivateOptimizer as DPOptimizer  # its add_noise draws the noise
    from hf_dp import DPTrainer
    from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer, StepCounter
    from two_process import count_placeholders, record_draws

    names = {{}}  # id(param) -> name, filled once the model exists
    noise_calls, first_noise, first_grad = [], {{}}, {{}}
    orig_add_noise = DPOptimizer.add_noise
    def counting_add_noise(self):
        noise_calls.append(1)
        out = orig_add_noise(self)
        if len(noise_calls) == 1:  # the noise z of step 1: p.grad = summed_grad + z
            for p in self.params:
                first_noise[names[id(p)]] = (p.grad - p.summed_grad.view_as(p)).detach().clone()
        return out
    DPOptimizer.add_noise = counting_add_noise

    drawn = record_draws()  # the indices of every micro-batch this rank drew, in order

    class FirstGrad(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, **kw):
            if not first_grad:  # the privatized gradient of step 1, as the update rule received it
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        first_grad[n.removeprefix("module.")] = p.grad.detach().clone()

    placeholders = count_placeholders()

    import hashlib
    key_seen = []  # a hash of the sampler's shared key (OS entropy, rank 0's) as each step begins
    class KeySeen(transformers.TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            key_seen.append(hashlib.sha256(str(trainer.dp.sampling_key).encode()).hexdigest())

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    ds = make_pair_dataset(tok, n={n})
    counter = StepCounter()
    args = dp_args(
        os.path.join(out, "run"), optim="dp_adamw", learning_rate=1e-2, epsilon=8.0, accountant="rdp",
        per_device_train_batch_size={per_device}, gradient_accumulation_steps={ga}, max_steps={steps},
        logging_steps=5, ddp_backend="gloo", dp_seed=None,
    )
    model = make_model()
    names.update({{id(p): n for n, p in model.named_parameters()}})
    trainer = DPTrainer(
        model=model, args=args, train_dataset=ds, data_collator=make_collator(tok), callbacks=[counter, FirstGrad(), KeySeen()]
    )
    assert args.world_size == 2, args.world_size
    trainer.train()
    opt = trainer.dp.optimizer
    torch.save(
        dict(
            rank=rank,
            world_size=args.world_size,
            params={{n: p.detach().clone() for n, p in model.named_parameters()}},
            trainable=sorted(n for n, p in model.named_parameters() if p.requires_grad),
            epsilon=trainer.get_epsilon(),
            history=list(trainer.ledger.accountant.history),
            spec=trainer.privacy_spec.as_dict(),
            steps=counter.optimizer_steps,
            noise_calls=len(noise_calls),
            generator_is_none=opt.generator is None,
            placeholders=len(placeholders),
            first_noise=first_noise,
            first_grad=first_grad,
            first_step_indices=[i for b in drawn[:{ga}] for i in b],
            draws=[list(b) for b in drawn],
            key_seen=key_seen, key_after=trainer.dp.sampling_key,
            wrapped=type(trainer.model_wrapped).__name__,
            log_history=trainer.state.log_history,
        ),
        os.path.join(out, f"rank{{rank}}.pt"),
    )
    """


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """One 2-process launch for both tests: the DDP run of WORKER, then every clipping engine (ENGINE_WORKER), each
    in a function of its own; {"run": (rank 0's, rank 1's), "engines": (rank 0's, rank 1's)}."""
    base = tmp_path_factory.mktemp("ddp")
    launch(base, in_sequence(
        ddp_run=WORKER.format(n=N, per_device=PER_DEVICE, ga=GA, steps=STEPS),
        engines=ENGINE_WORKER.format(n=E_N, per_device=E_PER_DEVICE, ga=E_GA, steps=E_STEPS, seed=E_SEED, engines=ENGINES),
    ), timeout=400)
    return {"run": rank_results(base), "engines": rank_results(base, "engines_")}


def test_two_process_ranks_share_one_draw_and_balance_it(launched):
    """OS entropy (no --dp_seed): both ranks draw with rank 0's key of this train() (the same at every step, forgotten
    afterwards) and take disjoint shares of the one draw, whose sizes differ by at most one row in every step (each
    rank drawing its own shard, they differ by a Poisson fluctuation and the slower rank sets the pace)."""
    r0, r1 = launched["run"]
    assert len(set(r0["key_seen"])) == 1 and r0["key_seen"] == r1["key_seen"] and len(r0["key_seen"]) == STEPS
    assert r0["key_seen"][0] != hashlib.sha256(b"None").hexdigest()
    assert r0["key_after"] is None and r1["key_after"] is None
    assert min(len(r0["draws"]), len(r1["draws"])) >= STEPS * GA  # (the loader may fetch one batch ahead)
    for t in range(STEPS):
        mine = [[i for b in r["draws"][t * GA : (t + 1) * GA] for i in b] for r in (r0, r1)]
        assert not set(mine[0]) & set(mine[1]) and all(len(set(m)) == len(m) for m in mine)
        assert abs(len(mine[0]) - len(mine[1])) <= 1, (t, mine)


def test_two_process_gloo_run(launched, tmp_path):
    r0, r1 = launched["run"]

    assert r0["world_size"] == r1["world_size"] == 2
    assert r0["wrapped"] == "DistributedDataParallel"
    # the same model on every rank, and it trained
    assert r0["params"].keys() == r1["params"].keys()
    for name in r0["params"]:
        assert torch.equal(r0["params"][name], r1["params"][name]), f"{name} differs across ranks"
    from helpers import make_model

    init = dict(make_model().named_parameters())
    assert all(not torch.equal(r0["params"][n], init[n]) for n in r0["trainable"])
    assert all(torch.equal(r0["params"][n], init[n]) for n in r0["params"] if n not in r0["trainable"])
    # noise is drawn once per logical batch: on rank 0 only
    assert r0["steps"] == r1["steps"] == STEPS
    assert r0["noise_calls"] == STEPS and r1["noise_calls"] == 0
    assert r1["generator_is_none"] and not r0["generator_is_none"]
    # the empty-micro-batch placeholder path was exercised (and DDP stayed in step)
    assert r0["placeholders"] + r1["placeholders"] > 0
    # both ranks account the same mechanism: B = per_device × GA × world, q = B/N
    b = PER_DEVICE * GA * 2
    for r in (r0, r1):
        assert r["spec"]["expected_batch_size"] == b and r["spec"]["sample_rate"] == b / N
        assert r["history"] == [(r["spec"]["noise_multiplier"], b / N, STEPS)]
        assert "grad_norm" not in str(r["log_history"])
    assert r0["epsilon"] == r1["epsilon"] <= 8.0

    # step 1 is exactly (Σ over both ranks' draws of clip_C(∇ℓ_i) + z) / B, z drawn on rank 0 only
    from hf_dp.models import apply_trainable
    from helpers import make_collator, make_pair_dataset, make_tokenizer

    assert not r1["first_noise"] and r0["first_noise"].keys() == set(r0["trainable"])
    assert r0["first_grad"].keys() == r1["first_grad"].keys() == set(r0["trainable"])
    for n in r0["first_grad"]:
        assert torch.equal(r0["first_grad"][n], r1["first_grad"][n])
    drawn = r0["first_step_indices"] + r1["first_step_indices"]
    assert not set(r0["first_step_indices"]) & set(r1["first_step_indices"])
    tok = make_tokenizer(tmp_path / "tok_ref")
    ds = make_pair_dataset(tok, n=N)
    collate = make_collator(tok)
    ref_model, _ = apply_trainable(make_model(), "last_block")
    ref_model.train()
    params = {n: p for n, p in ref_model.named_parameters() if p.requires_grad}
    clipped_sum = {n: torch.zeros_like(p) for n, p in params.items()}
    for i in drawn:
        batch = collate([ds[i]])
        labels = batch.pop("labels")
        loss = torch.nn.functional.cross_entropy(ref_model(**batch).logits, labels, reduction="sum")
        grads = torch.autograd.grad(loss, list(params.values()))
        norm = torch.sqrt(sum((g.double() ** 2).sum() for g in grads)).item()
        factor = min(1.0, 1.0 / (norm + 1e-6))  # C = 1 (Opacus' clip factor)
        for n, g in zip(params, grads):
            clipped_sum[n] += g * factor
    for n in params:
        signal = r0["first_grad"][n] * b - r0["first_noise"][n]
        torch.testing.assert_close(signal, clipped_sum[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{n}: {m}")

    # ε equals a one-process run with the same global batch (per_device × 2, same GA): the mechanism it plans, and
    # the accountant's ε for STEPS steps of it
    import transformers

    from hf_dp import DPTrainer
    from hf_dp.privacy.accounting import compute_epsilon
    from helpers import dp_args, make_collator, make_pair_dataset, make_tokenizer

    transformers.logging.set_verbosity_error()
    tok = make_tokenizer(tmp_path / "tok_single")
    args = dp_args(
        tmp_path / "single", optim="dp_adamw", learning_rate=1e-2, epsilon=8.0, accountant="rdp",
        per_device_train_batch_size=PER_DEVICE * 2, gradient_accumulation_steps=GA, max_steps=STEPS,
        logging_steps=100,
    )  # fmt: skip
    single = DPTrainer(model=make_model(), args=args, train_dataset=make_pair_dataset(tok, n=N),
                       data_collator=make_collator(tok))
    spec = single.privacy_spec.as_dict()
    assert spec == r0["spec"]
    assert r0["history"] == [(spec["noise_multiplier"], spec["sample_rate"], STEPS)]
    eps = compute_epsilon(spec["noise_multiplier"], spec["sample_rate"], STEPS, spec["delta"], spec["accountant"])
    assert r0["epsilon"] == pytest.approx(eps, rel=1e-12)


# ------------------------------------------------------------------------------------------------------------------
# every clipping engine under DDP: ghost clipping with several processes
# ------------------------------------------------------------------------------------------------------------------
E_N, E_PER_DEVICE, E_GA, E_STEPS, E_SEED = 64, 1, 2, 4, 11
ENGINES = ["hooks", "ghost", "ghost_two_pass", "auto"]

ENGINE_WORKER = r"""
    import logging
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
    from torch.nn.parallel import DistributedDataParallel as DDP
    from hf_dp import DPTrainer
    from hf_dp.privacy.privatizer import PrivateOptimizer
    from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer
    from two_process import count_placeholders

    reducer_calls = []  # DDP's own gradient all-reduce, bucket by bucket (a comm hook on every DDP made here)
    orig_init = DDP.__init__
    def init(self, *a, **kw):
        orig_init(self, *a, **kw)
        def counting(state, bucket):
            reducer_calls.append(1)
            return allreduce_hook(None, bucket)
        self.register_comm_hook(None, counting)
    DDP.__init__ = init

    noise_calls = []
    orig_add_noise = PrivateOptimizer.add_noise
    def counting_add_noise(self):
        noise_calls.append(1)
        return orig_add_noise(self)
    PrivateOptimizer.add_noise = counting_add_noise

    placeholders = count_placeholders()

    auto_lines = []
    class Grab(logging.Handler):
        def emit(self, record):
            if "--clipping auto" in record.getMessage():
                auto_lines.append(record.getMessage())
    logging.getLogger("hf_dp.trainer").addHandler(Grab(level=logging.INFO))
    logging.getLogger("hf_dp.trainer").setLevel(logging.INFO)

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    ds = make_pair_dataset(tok, n={n})
    results = {{}}
    for clipping in {engines!r} + ["non-private"]:
        del reducer_calls[:], noise_calls[:], placeholders[:]
        private = clipping != "non-private"
        args = dp_args(
            os.path.join(out, clipping), optim="dp_sgd" if private else "sgd", learning_rate=0.5, noise_multiplier=1.0, epsilon=None,
            accountant="rdp", per_device_train_batch_size={per_device}, gradient_accumulation_steps={ga},
            max_steps={steps}, logging_steps=100, ddp_backend="gloo", dp_seed={seed}, trainable="all",
            clipping=clipping if private else "auto", disable_dp=not private,
        )
        model = make_model()
        trainer = DPTrainer(model=model, args=args, train_dataset=ds, data_collator=make_collator(tok))
        assert args.world_size == 2, args.world_size
        trainer.train()
        results[clipping] = dict(
            params={{n: p.detach().clone() for n, p in model.named_parameters()}},
            wrapped=type(trainer.model_wrapped).__name__,
            reducer_calls=len(reducer_calls),
            noise_calls=len(noise_calls),
            placeholders=len(placeholders),
            engine=getattr(trainer, "clipping", None),
            epsilon=trainer.get_epsilon() if private else None,
            spec=trainer.privacy_spec.as_dict() if private else None,
            steps=trainer.state.global_step,
        )
    torch.save(dict(results=results, auto_lines=auto_lines), os.path.join(out, f"engines_rank{{rank}}.pt"))
    """


def test_two_process_every_clipping_engine_trains_the_same_model(launched, tmp_path):
    """Ghost clipping (one and two passes) under DDP trains the model the Opacus hooks train, with the same dp_seed
    (same Poisson draws and noise): no DDP gradient all-reduce, noise once on rank 0, ε of one process."""
    r0, r1 = launched["engines"]
    res0, res1 = r0["results"], r1["results"]
    from helpers import make_model

    init = dict(make_model().named_parameters())
    for name in ENGINES:
        a, b = res0[name], res1[name]
        assert a["wrapped"] == "DistributedDataParallel" and a["steps"] == E_STEPS
        assert a["engine"] == ("ghost" if name == "auto" else name)
        for n in a["params"]:  # the same model on both ranks, trained
            assert torch.equal(a["params"][n], b["params"][n]), f"{name}: {n} differs across ranks"
        assert all(not torch.equal(a["params"][n], init[n]) for n in a["params"])
        # DDP's reducer all-reduced nothing (every micro-batch's forward ran in no_sync); the privatizer's one
        # all-reduce per logical batch carried the noisy clipped sum; the noise was drawn on rank 0 only
        assert a["reducer_calls"] == b["reducer_calls"] == 0, name
        assert a["noise_calls"] == E_STEPS and b["noise_calls"] == 0, name
        # the same mechanism is accounted on both ranks, and as one process with the same global batch
        assert a["spec"] == b["spec"] and a["epsilon"] == b["epsilon"]
    assert res0["non-private"]["reducer_calls"] > 0  # the counting hook does see a plain DDP run's all-reduce
    # empty micro-batches happened (placeholder row, zero loss) and did not break the step
    assert sum(res0[e]["placeholders"] + res1[e]["placeholders"] for e in ENGINES) > 0
    # same dp_seed ⇒ same draws and noise: every engine trains the model the hooks train (float rounding)
    ref = res0["hooks"]["params"]
    for name in ["ghost", "ghost_two_pass", "auto"]:
        for n, p in res0[name]["params"].items():
            torch.testing.assert_close(p, ref[n], rtol=1e-4, atol=1e-5, msg=lambda m: f"{name} vs hooks, {n}: {m}")
    # --clipping auto chose ghost with two processes, and said so once per rank
    assert len(r0["auto_lines"]) == len(r1["auto_lines"]) == 1 and "chose ghost" in r0["auto_lines"][0]

    # ε equals a one-process run with the same global batch (per_device × 2, same GA)
    from hf_dp import DPTrainer
    from hf_dp.privacy.accounting import compute_epsilon
    from helpers import dp_args, make_collator, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(tmp_path / "tok_single")
    single = DPTrainer(
        model=make_model(), train_dataset=make_pair_dataset(tok, n=E_N), data_collator=make_collator(tok),
        args=dp_args(tmp_path / "single", optim="dp_sgd", noise_multiplier=1.0, epsilon=None, accountant="rdp",
                     per_device_train_batch_size=E_PER_DEVICE * 2, gradient_accumulation_steps=E_GA, max_steps=E_STEPS,
                     trainable="all"),
    )  # fmt: skip
    spec = single.privacy_spec.as_dict()
    for name in ENGINES:
        assert res0[name]["spec"] == spec
        eps = compute_epsilon(spec["noise_multiplier"], spec["sample_rate"], E_STEPS, spec["delta"], spec["accountant"])
        assert res0[name]["epsilon"] == pytest.approx(eps, rel=1e-12)
