"""Two CPU processes (gloo) train one DP model: identical weights, noise once per step, same ε as one process.

The worker script is written to ``tmp_path`` and launched with ``python -m torch.distributed.run
--nproc_per_node 2``. Each rank writes what it saw to ``rank{r}.pt``; the test compares them and
checks ε against a one-process run with the same global batch (per_device × 2 processes vs
per_device·2 × 1 process).

Configuration: per_device 1, gradient accumulation 2, 2 processes ⇒ B = 4, N = 128 ⇒ q = 1/32, so
each rank draws ~2 rows per step split in 2 micro-batches: empty micro-batches (the placeholder row
with zero loss, which keeps DDP's ranks in step) occur often and are counted.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
sys.path.insert(0, HERE)

N, PER_DEVICE, GA, STEPS, SEED = 128, 1, 2, 10, 3

WORKER = textwrap.dedent(
    r"""
    import json, os, sys, warnings
    warnings.filterwarnings("ignore")
    os.environ["HF_HUB_OFFLINE"] = "1"
    sys.path.insert(0, {tests!r})
    import torch
    torch.set_num_threads(1)
    import transformers
    transformers.logging.set_verbosity_error()
    from hf_dp.privacy.privatizer import PrivateOptimizer as DPOptimizer  # its add_noise draws the noise
    import hf_dp.trainer as trainer_module
    from hf_dp import DPTrainer
    from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer, StepCounter

    out = sys.argv[1]
    rank = int(os.environ["RANK"])

    from hf_dp.privacy.sampler import PoissonBatchSampler

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

    drawn = []  # the indices of every micro-batch this rank drew, in order
    orig_iter = PoissonBatchSampler.__iter__
    def recording_iter(self):
        for batch in orig_iter(self):
            drawn.append(list(batch))
            yield batch
    PoissonBatchSampler.__iter__ = recording_iter

    class FirstGrad(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, model=None, **kw):
            if not first_grad:  # the privatized gradient of step 1, as the update rule received it
                for n, p in model.named_parameters():
                    if p.requires_grad:
                        first_grad[n.removeprefix("module.")] = p.grad.detach().clone()

    placeholders = []
    orig_call = trainer_module._EmptySafeCollator.__call__
    def counting_call(self, features):
        if len(features) == 0:
            placeholders.append(1)
        return orig_call(self, features)
    trainer_module._EmptySafeCollator.__call__ = counting_call

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
        model=model, args=args, train_dataset=ds, data_collator=make_collator(tok), callbacks=[counter, FirstGrad()]
    )
    assert args.world_size == 2, args.world_size
    trainer.train()
    opt = trainer._dp_optimizer
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
            wrapped=type(trainer.model_wrapped).__name__,
            log_history=trainer.state.log_history,
        ),
        os.path.join(out, f"rank{{rank}}.pt"),
    )
    """
)


def _free_port() -> int:
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gloo_available() -> bool:
    import torch.distributed as dist

    return dist.is_available() and dist.is_gloo_available()


@pytest.mark.distributed
@pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
@pytest.mark.skipif(not _gloo_available(), reason="torch.distributed with the gloo backend is not available")
def test_two_process_gloo_run(tmp_path):
    script = tmp_path / "worker.py"
    script.write_text(WORKER.format(tests=HERE, n=N, per_device=PER_DEVICE, ga=GA, steps=STEPS))
    env = dict(os.environ, HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([REPO, env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--nnodes", "1",
        "--master_addr", "127.0.0.1", "--master_port", str(_free_port()), str(script), str(tmp_path),
    ]  # fmt: skip
    # own session, so that on a timeout the launcher *and* its workers (this test's processes only) are ended
    proc = subprocess.Popen(
        cmd, env=env, cwd=str(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        _, stderr = proc.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        pytest.fail(f"the 2-process run timed out:\n{stderr[-4000:]}")
    if proc.returncode != 0:
        low = stderr.lower()
        if "gloo" in low and ("not available" in low or "unsupported" in low):
            pytest.skip("gloo backend unusable here")
        pytest.fail(f"torchrun failed ({proc.returncode}):\n{stderr[-6000:]}")
    r0 = torch.load(tmp_path / "rank0.pt", weights_only=False)
    r1 = torch.load(tmp_path / "rank1.pt", weights_only=False)

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
    assert all(i % 2 == 0 for i in r0["first_step_indices"]) and all(i % 2 == 1 for i in r1["first_step_indices"])
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

    # ε equals a one-process run with the same global batch (per_device × 2, same GA)
    import transformers

    from hf_dp import DPTrainer
    from helpers import dp_args, make_collator, make_pair_dataset, make_tokenizer

    transformers.logging.set_verbosity_error()
    tok = make_tokenizer(tmp_path / "tok_single")
    ds = make_pair_dataset(tok, n=N)
    args = dp_args(
        tmp_path / "single", optim="dp_adamw", learning_rate=1e-2, epsilon=8.0, accountant="rdp",
        per_device_train_batch_size=PER_DEVICE * 2, gradient_accumulation_steps=GA, max_steps=STEPS,
        logging_steps=100,
    )  # fmt: skip
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = DPTrainer(model=make_model(), args=args, train_dataset=ds, data_collator=make_collator(tok))
        single.train()
    finally:
        torch.set_num_threads(threads)
    assert single.privacy_spec.as_dict() == r0["spec"]
    assert single.ledger.accountant.history == r0["history"]
    assert single.get_epsilon() == r0["epsilon"]
