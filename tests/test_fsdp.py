"""DP under FSDP2 (``--fsdp full_shard``, two-pass ghost clipping) on two CPU processes (gloo): hf_dp.clipping.sharding.

Two launches, one FSDP and one DDP (same ``--dp_seed``), each training one job after another in the same processes:
full fine-tuning (``full``) and LoRA (``lora``, ``--trainable lora``); the FSDP launch then resumes a LoRA checkpoint.

* the same ``--dp_seed`` with the noise switched off (inside ``add_noise`` only, as the audit's ``no_noise``):
  FSDP and DDP train the same model up to float rounding, for full fine-tuning and for LoRA, at the same ε; the
  release (gathered from the shards; for LoRA merged) loads with ``from_pretrained`` as a plain model, with its card
  and privacy.json, equal to the DDP release;
* the FSDP run's noise, drawn by the privatizer, recorded and taken out again: every rank adds noise to its own shard only — the shards of each
  parameter tile it exactly, each coordinate drawn once — with std σC, from the stream keyed by
  (seed, step, parameter, shard offset); ε equals the one-process ε for the same global batch;
* LoRA under FSDP with its checkpoint (noise on, sharded state dict): a run stopped at its checkpoint and resumed ends
  with the uninterrupted run's weights, ε and step count (as tests/test_fsdp_checkpoint.py for full fine-tuning).

Each launch is ``python -m torch.distributed.run --nproc_per_node 2`` (tests/two_process.py).
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_process import DISTRIBUTED, launch  # noqa: E402

N, PER_DEVICE, GA, STEPS, SEED = 64, 2, 2, 4, 28  # SEED: a --dp_seed whose draws leave a micro-batch empty (asserted below)
CKPT_N, CKPT_SIGMA = 16, 1.0  # the LoRA checkpoint runs: B = 2 × 2 × 2 = 8, 2 steps per epoch (checkpoint at step 2)

WORKER = r"""
    from hf_dp import DPTrainer
    from hf_dp.privacy.privatizer import PrivateOptimizer, _local, _shard_offset
    from helpers import StopAt, dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer
    from test_fsdp import shard_noise_checks
    from torch.distributed.tensor import DTensor
    from two_process import count_placeholders

    mode, jobs, lora_checkpoint = {mode!r}, {jobs!r}, {lora_checkpoint!r}
    NOISE = ["on"]  # the current job's: "off", "recorded" or "on" (the privatizer as it is)
    shards = []  # per step: [(offset, noise on this rank's shard)] per parameter
    orig = PrivateOptimizer.add_noise
    def add_noise(self):
        if NOISE[0] == "on":
            return orig(self)
        if NOISE[0] == "off":  # the privatizer adds N(0, (0·C)²); the optimizer keeps its σ between steps
            sigma, self.noise_multiplier = self.noise_multiplier, 0.0
            try:
                return orig(self)
            finally:
                self.noise_multiplier = sigma
        # "recorded": the real draw on each shard is recorded, then taken out again (so the run trains the noiseless model)
        before = [_local(p.summed_grad).clone() for p in self.params]
        step = self.step_index
        r = orig(self)
        shards.append((step, [(_shard_offset(p.grad), (_local(p.grad) - b).clone(), tuple(p.shape)) for p, b in zip(self.params, before)]))
        for p, b in zip(self.params, before):
            _local(p.grad).copy_(b)
        return r
    PrivateOptimizer.add_noise = add_noise

    placeholders = count_placeholders()

    # during train(): FSDP2's all-gathers and reduce-scatters, the backward passes (HF's) and two passes' norms passes (pass 1)
    import torch.distributed.fsdp._fully_shard._fsdp_param_group as fsdp_groups
    from hf_dp.clipping.ghost import GhostClipper
    COUNTS = dict(gathers=0, reduces=0, backward=0, norms_pass=0)
    def counting(name, fn):
        def wrapped(*a, **k):
            COUNTS[name] += 1
            return fn(*a, **k)
        return wrapped
    fsdp_groups.foreach_all_gather = counting("gathers", fsdp_groups.foreach_all_gather)
    fsdp_groups.foreach_reduce = counting("reduces", fsdp_groups.foreach_reduce)
    torch.autograd.backward = counting("backward", torch.autograd.backward)
    GhostClipper.norms_pass = counting("norms_pass", GhostClipper.norms_pass)

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    ds = make_pair_dataset(tok, n={n})

    def make_trainer(output_dir, trainable, dataset=ds, config=None, callbacks=(), clipping=None, **overrides):
        kw = dict(epsilon=8.0, logging_steps=2)
        if mode == "fsdp":
            kw.update(fsdp="full_shard", fsdp_config=dict({{"transformer_layer_cls_to_wrap": ["BertLayer"]}}, **(config or {{}})))
        kw.update(overrides)
        args = dp_args(
            output_dir, optim="dp_adamw", learning_rate=1e-2, accountant="rdp", per_device_train_batch_size={per_device},
            gradient_accumulation_steps={ga}, max_steps={steps}, ddp_backend="gloo", dp_seed={seed}, trainable=trainable,
            clipping=clipping or ("auto" if mode == "fsdp" else "ghost_two_pass"), **kw,
        )
        return DPTrainer(model=make_model(), args=args, train_dataset=dataset, data_collator=make_collator(tok),
                         processing_class=tok, callbacks=list(callbacks))

    def summary(trainer):
        return dict(
            params={{n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone() for n, p in trainer.model.named_parameters()}},
            epsilon=trainer.get_epsilon(), names=[n for n, p in trainer.model.named_parameters() if p.requires_grad],
            history=list(trainer.ledger.accountant.history), ledger_steps=trainer.ledger.steps,
            global_step=trainer.state.global_step, resumed_from=trainer.resumed_from,
        )

    for name, trainable, noise, clipping in jobs:
        NOISE[0] = noise
        shards.clear()
        placeholders.clear()
        unit_kw = {{}}
        if name == "units":  # three rows per user; C so small that every unit's summed gradient is clipped
            unit_kw = dict(dataset=ds.add_column("user", [i // 3 for i in range(len(ds))]), privacy_unit_column="user",
                           per_sample_max_grad_norm=1e-3)
        trainer = make_trainer(os.path.join(out, name, "run"), trainable, clipping=clipping, **unit_kw)
        COUNTS.update(gathers=0, reduces=0, backward=0, norms_pass=0)
        trainer.train()
        counts = dict(COUNTS)
        result = summary(trainer)
        from torch.distributed.fsdp import FSDPModule
        result.update(counts=counts, fsdp_units=sum(isinstance(m, FSDPModule) for m in trainer.model.modules()))
        trainer.save_model(os.path.join(out, name, "release"))
        NOISE[0] = "on"  # shard_noise_checks runs the privatizer as it is
        result.update(
            shards=list(shards), clipping=trainer.clipping, wrapped=type(trainer.model_wrapped).__name__,
            spec=trainer.privacy_spec.as_dict(), placeholders=len(placeholders),
            sharded=[isinstance(p, DTensor) for p in trainer.model.parameters()],
            shard_noise=shard_noise_checks() if mode == "fsdp" and name == "full" else None,
        )
        torch.save(result, os.path.join(out, f"{{name}}_rank{{rank}}.pt"))

    if lora_checkpoint:  # LoRA under FSDP, the noise on: uninterrupted (U), stopped at its checkpoint (A), resumed (R)
        NOISE[0] = "on"
        small = make_pair_dataset(tok, n={ckpt_n})

        def ckpt_run(output_dir, resume=None, callbacks=(), save=True):
            trainer = make_trainer(
                os.path.join(out, "lora_ckpt", output_dir), "lora", dataset=small, callbacks=callbacks,
                config={{"state_dict_type": "SHARDED_STATE_DICT"}}, epsilon=None, noise_multiplier={ckpt_sigma},
                logging_steps=1, save_strategy="steps" if save else "no", save_steps=2, save_total_limit=None,
            )
            trainer.train(resume_from_checkpoint=resume)
            return summary(trainer)

        results = dict(U=ckpt_run("u", save=False), A=ckpt_run("a", callbacks=[StopAt(2)]))
        results["R"] = ckpt_run("a", resume=True)
        torch.save(results, os.path.join(out, f"lora_ckpt_rank{{rank}}.pt"))
    """

pytestmark = DISTRIBUTED

JOBS = {"fsdp": [("full", "all", "recorded", None), ("lora", "lora", "off", None), ("full_two_pass", "all", "off", "ghost_two_pass"),
                 ("units", "all", "off", None)],
        "ddp": [("full", "all", "off", None), ("lora", "lora", "off", None), ("units", "all", "off", None)]}


def _run(tmp_path, mode: str) -> dict:
    """One launch: each job of ``JOBS[mode]`` (and, under FSDP, the LoRA checkpoint runs); {job: (rank 0's, rank 1's)}."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    jobs = JOBS[mode]
    launch(tmp_path, WORKER.format(mode=mode, jobs=jobs, lora_checkpoint=mode == "fsdp", n=N, per_device=PER_DEVICE,
                                   ga=GA, steps=STEPS, seed=SEED, ckpt_n=CKPT_N, ckpt_sigma=CKPT_SIGMA), timeout=420)
    names = [name for name, *_ in jobs] + (["lora_ckpt"] if mode == "fsdp" else [])
    return {name: tuple(torch.load(tmp_path / f"{name}_rank{r}.pt", weights_only=False) for r in (0, 1)) for name in names}


@pytest.fixture(scope="module")
def launches(tmp_path_factory):
    """The FSDP launch (full fine-tuning: noise drawn, recorded and taken out again; LoRA: noise zeroed; LoRA's
    checkpoint runs: noise on) and the DDP launch (noise zeroed), same --dp_seed."""
    base = tmp_path_factory.mktemp("fsdp_runs")
    return base, _run(base / "fsdp", "fsdp"), _run(base / "ddp", "ddp")


@pytest.fixture(scope="module")
def runs(launches):
    """Full fine-tuning: FSDP's rank 0 and rank 1, DDP's rank 0."""
    base, fsdp, ddp = launches
    return base, fsdp["full"][0], fsdp["full"][1], ddp["full"][0]


def test_fsdp_trains_the_ddp_model_and_releases_a_plain_model(runs):
    tmp_path, f0, f1, d0 = runs
    assert f0["wrapped"].startswith("FSDP") and all(f0["sharded"]), f0["wrapped"]
    assert d0["wrapped"] == "DistributedDataParallel"
    assert f0["clipping"] == "ghost"  # --clipping auto under FSDP: one backward (hf_dp.clipping.fsdp_ghost)
    assert d0["clipping"] == "ghost_two_pass"
    # an empty micro-batch on one rank (its placeholder row runs the backward, weighted 0) kept the ranks in step
    assert f0["placeholders"] + f1["placeholders"] > 0
    from helpers import make_model

    init = dict(make_model().named_parameters())
    moved = max((f0["params"][n] - init[n]).abs().max().item() for n in f0["names"])
    assert moved > 1e-3  # it trained
    for n in f0["params"]:
        torch.testing.assert_close(f0["params"][n], f1["params"][n], rtol=0, atol=0)
        # (up to float rounding: the clip factors carry the rounding allowance of the run's public token bounds)
        torch.testing.assert_close(f0["params"][n], d0["params"][n], rtol=1e-5, atol=3e-6, msg=lambda m: f"{n}: {m}")
    assert f0["epsilon"] == d0["epsilon"] <= 8.0 and f0["history"] == d0["history"]

    # the release: a plain PreTrainedModel folder with the card and privacy.json, the weights FSDP trained
    import json

    from transformers import AutoModelForSequenceClassification

    release = tmp_path / "fsdp" / "full" / "release"
    assert (release / "README.md").is_file() and (release / "privacy.json").is_file()
    report = json.loads((release / "privacy.json").read_text())
    assert abs(float(report["epsilon"]) - f0["epsilon"]) < 1e-9 * max(1.0, f0["epsilon"])
    model = AutoModelForSequenceClassification.from_pretrained(release)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.architectures == ["BertForSequenceClassification"]
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.detach(), f0["params"][n], rtol=0, atol=0, msg=lambda m: f"{n}: {m}")


def test_fsdp_two_pass_trains_the_ddp_model_and_the_one_pass_model(launches):
    """--clipping ghost_two_pass under FSDP (kept for when the one-pass records do not fit): the same --dp_seed, the
    noise zeroed — the model of DDP and of one-pass FSDP up to float rounding, at the same ε."""
    _, fsdp, ddp = launches
    t0, t1 = fsdp["full_two_pass"]
    f0, d0 = fsdp["full"][0], ddp["full"][0]
    assert t0["clipping"] == "ghost_two_pass" and t0["wrapped"].startswith("FSDP") and all(t0["sharded"])
    assert t0["placeholders"] + t1["placeholders"] > 0
    for n in t0["params"]:
        torch.testing.assert_close(t0["params"][n], t1["params"][n], rtol=0, atol=0)
        torch.testing.assert_close(t0["params"][n], d0["params"][n], rtol=1e-5, atol=3e-6, msg=lambda m: f"{n}: {m}")
        torch.testing.assert_close(t0["params"][n], f0["params"][n], rtol=1e-5, atol=3e-6, msg=lambda m: f"{n}: {m}")
    assert t0["epsilon"] == d0["epsilon"] and t0["history"] == d0["history"]


def test_fsdp_privacy_units_train_the_ddp_model(launches):
    """--privacy_unit_column under FSDP (one pass, the default): each user's rows clipped as one unit (C so small that
    every unit is clipped) and the ranks' draws over users — the same --dp_seed, the noise zeroed: DDP's model at the
    same ε (clipping rows instead of users would sum up to three times C per user and train another model)."""
    _, fsdp, ddp = launches
    u0, u1 = fsdp["units"]
    d0 = ddp["units"][0]
    assert u0["clipping"] == "ghost" and u0["wrapped"].startswith("FSDP") and all(u0["sharded"])
    assert u0["spec"] == d0["spec"] and u0["epsilon"] == d0["epsilon"] and u0["history"] == d0["history"]
    assert u0["spec"]["dataset_size"] == -(-N // 3)  # the accountant's N counts users
    moved = False
    for n in u0["params"]:
        torch.testing.assert_close(u0["params"][n], u1["params"][n], rtol=0, atol=0)
        torch.testing.assert_close(u0["params"][n], d0["params"][n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        moved |= not torch.equal(u0["params"][n], fsdp["full"][0]["params"][n])
    assert moved


def test_fsdp_one_pass_runs_one_backward_and_gathers_each_unit_at_most_twice(launches):
    """One-pass ghost clipping under FSDP (the default): one backward per micro-batch and no norms pass, at most two
    all-gathers of each FSDP unit per micro-batch (forward, backward) — fewer than two passes, which gather every
    unit once more for the norms' backward — and no reduce-scatter of FSDP's own: the backward computes no parameter
    gradient (the normalisation layers' included), the clipped sums are summed into the shards once, after it."""
    _, fsdp, _ = launches
    one, two = fsdp["full"][0], fsdp["full_two_pass"][0]
    micro_batches = STEPS * GA  # per rank: every rank runs every micro-batch, an empty one included
    assert one["fsdp_units"] == two["fsdp_units"] > 2
    assert one["counts"]["backward"] == two["counts"]["backward"] == micro_batches
    assert one["counts"]["norms_pass"] == 0 and two["counts"]["norms_pass"] == micro_batches
    assert 0 < one["counts"]["gathers"] <= 2 * one["fsdp_units"] * micro_batches
    assert two["counts"]["gathers"] > one["counts"]["gathers"], (one["counts"], two["counts"])
    assert one["counts"]["reduces"] == 0 and two["counts"]["reduces"] > 0, (one["counts"], two["counts"])


def test_fsdp_noise_is_drawn_once_per_coordinate_on_each_shard(runs, tmp_path):
    _, r0, r1, _ = runs
    spec = r0["spec"]
    std = spec["noise_multiplier"] * spec["max_grad_norm"]
    from helpers import make_model

    numel = sum(p.numel() for p in make_model().parameters())
    assert len(r0["shards"]) == len(r1["shards"]) == STEPS
    from hf_dp.privacy.randomness import stream_generator

    draws = []
    for (s0, a), (s1, b) in zip(r0["shards"], r1["shards"]):
        assert s0 == s1
        assert len(a) == len(b) == len(r0["names"])
        for index, ((o0, z0, shape), (o1, z1, shape1)) in enumerate(zip(a, b)):
            assert shape == shape1
            shape = torch.Size(shape)
            # the two shards tile the parameter: rank 0 from offset 0, rank 1 right after it, nothing drawn twice
            assert o0 == 0 and o1 == z0.numel() and z0.numel() + z1.numel() == shape.numel(), (index, o0, o1, shape)
            draws.append(torch.cat([z0.reshape(-1), z1.reshape(-1)]))
            # each shard's stream is keyed by (seed, step, parameter, offset) (hf_dp.privacy.privatizer._add_shard_noise)
            for offset, z in ((o0, z0), (o1, z1)):
                if z.numel():
                    gen = stream_generator(SEED, "fsdp_noise", s0, index, offset)
                    torch.testing.assert_close(z, torch.normal(0.0, std, size=z.shape, generator=gen), rtol=0, atol=1e-6)
            if z0.numel() and z0.shape == z1.shape:
                assert not torch.equal(z0, z1)
    z = torch.cat(draws)
    assert z.numel() == STEPS * numel
    assert abs(z.std().item() / std - 1) < 0.03 and abs(z.mean().item()) < 0.03 * std  # 25 160 draws: ±1% (1σ)

    # ε equals a one-process run with the same global batch (per_device × 2, same accumulation): the mechanism it
    # plans, and the accountant's ε for STEPS steps of it
    import transformers

    from hf_dp import DPTrainer
    from hf_dp.privacy.accounting import compute_epsilon
    from helpers import dp_args, make_collator, make_pair_dataset, make_tokenizer

    transformers.logging.set_verbosity_error()
    tok = make_tokenizer(tmp_path / "tok_single")
    args = dp_args(tmp_path / "single", optim="dp_adamw", learning_rate=1e-2, epsilon=8.0, accountant="rdp",
                   per_device_train_batch_size=PER_DEVICE * 2, gradient_accumulation_steps=GA, max_steps=STEPS,
                   logging_steps=100, trainable="all", clipping="ghost_two_pass")
    single = DPTrainer(model=make_model(), args=args, train_dataset=make_pair_dataset(tok, n=N),
                       data_collator=make_collator(tok))
    assert single.privacy_spec.as_dict() == spec
    assert r0["history"] == r1["history"] == [(spec["noise_multiplier"], spec["sample_rate"], STEPS)]
    eps = compute_epsilon(spec["noise_multiplier"], spec["sample_rate"], STEPS, spec["delta"], spec["accountant"])
    assert r0["epsilon"] == r1["epsilon"] == pytest.approx(eps, rel=1e-12)


# ------------------------------------------------------------------------------------------------------------------
# the privatizer on shards alone (no trainer), run by the FSDP launch's processes after training (saves a launch)
# ------------------------------------------------------------------------------------------------------------------
def shard_noise_checks() -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from hf_dp.optim import make_optimizer
    from hf_dp.privacy.privatizer import _local

    mesh = init_device_mesh("cpu", (2,))
    results = {}
    for name, kw in {"secure": dict(secure_mode=True), "seeded": dict(noise_seed=5), "entropy": {}}.items():
        full = torch.zeros(101, 3)  # 101 rows: uneven shards (51 + 50)
        p = torch.nn.Parameter(distribute_tensor(full, mesh, [Shard(0)]))
        opt = make_optimizer("dp_sgd", [p], lr=1.0, noise_multiplier=2.0, max_grad_norm=0.5, expected_batch_size=1.0, **kw)
        noise = []
        for _ in range(40):
            p.summed_grad = distribute_tensor(torch.zeros(101, 3), mesh, [Shard(0)])
            opt.privatize()
            noise.append(_local(p.grad).clone())
        results[name] = torch.stack(noise)
    # a parameter FSDP did not shard (replicated) is refused: its noise would be drawn on every rank
    q = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)]))
    r = torch.nn.Parameter(distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()]))
    opt = make_optimizer("dp_sgd", [q, r], lr=1.0, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=1.0)
    q.summed_grad = distribute_tensor(torch.zeros(4, 2), mesh, [Shard(0)])
    r.summed_grad = distribute_tensor(torch.zeros(4, 2), mesh, [Replicate()])
    try:
        opt.privatize()
        results["replicated"] = "accepted"
    except RuntimeError as e:
        results["replicated"] = str(e)
    # one-pass ghost clipping's reduce-scatter into FSDP2's layout (hf_dp.clipping.fsdp_ghost): uneven rows (101, 3 →
    # 51 + 50), a vector, a matrix with one row (rank 1 holds nothing), one float64 tensor; each rank's full-size sum
    import torch.distributed as dist

    from hf_dp.clipping.fsdp_ghost import reduce_scatter_to_shards

    shapes = [(101, 3), (7,), (1, 4), (5, 2)]
    params = [torch.nn.Parameter(distribute_tensor(torch.zeros(s, dtype=torch.float64 if i == 3 else torch.float32), mesh,
                                                   [Shard(0)])) for i, s in enumerate(shapes)]
    gen = torch.Generator().manual_seed(100 + dist.get_rank())
    mine = [torch.randn(s, generator=gen, dtype=p.dtype) for s, p in zip(shapes, params)]
    for method in ("reduce_scatter", "all_reduce"):  # NCCL's default, gloo's default
        got = reduce_scatter_to_shards(list(zip(params, mine)), method=method)
        results[method] = dict(mine=mine, local=[_local(got[p]).clone() for p in params],
                               same_layout=[got[p].placements == p.placements and got[p].shape == p.shape and
                                            _local(got[p]).shape == _local(p).shape for p in params])
    # the ranks' loss scales must agree (their gradients are summed before each undoes its own)

    from hf_dp.clipping import sharding

    sharding.check_loss_scale_agrees(0.25)
    try:
        sharding.check_loss_scale_agrees(0.25 * (1 + dist.get_rank()))
        results["scales"] = "accepted"
    except RuntimeError as e:
        results["scales"] = str(e)
    return results


def test_shard_noise_streams_secure_seeded_and_entropy(runs):
    """Each rank's noise covers its own rows only, std σC per coordinate, independent across ranks and steps, with
    --secure_rng (OS CSPRNG), --dp_seed and OS entropy alike; a parameter left unsharded is refused."""
    r0, r1 = runs[1]["shard_noise"], runs[2]["shard_noise"]
    std = 2.0 * 0.5  # σC; expected batch 1, so p.grad = summed + noise
    for name in ("secure", "seeded", "entropy"):
        a, b = r0[name], r1[name]
        assert a.shape == (40, 51, 3) and b.shape == (40, 50, 3), name  # each rank: its own rows, nothing else
        z = torch.cat([a.reshape(40, -1), b.reshape(40, -1)], dim=1)  # 40 steps × 303 coordinates
        assert abs(z.std().item() / std - 1) < 0.04, (name, z.std().item())  # 12 120 draws: ±0.6% (1σ)
        per_coordinate = z.std(dim=0)  # over steps: every coordinate is drawn, every step
        assert (per_coordinate > 0.3 * std).all(), name
        assert not torch.equal(a[:, :50], b[:, :50]) and not torch.equal(a[0], a[1]), name  # ranks, steps: fresh draws
        c = torch.corrcoef(torch.stack([a[:, :50].reshape(-1), b.reshape(-1)]))[0, 1].abs().item()
        assert c < 0.1, (name, c)
    assert r0["replicated"].startswith("under FSDP every trainable parameter must be sharded")
    # one-pass ghost clipping's reduction into the shards (reduce-scatter, or all-reduce and each rank its rows):
    # each rank holds its torch.chunk rows of the sum over ranks, in the parameter's layout
    for method in ("reduce_scatter", "all_reduce"):
        a, b = r0[method], r1[method]
        assert all(a["same_layout"]) and all(b["same_layout"]), method
        for x, y, la, lb in zip(a["mine"], b["mine"], a["local"], b["local"]):
            chunks = torch.chunk(x + y, 2, dim=0)
            torch.testing.assert_close(la, chunks[0], rtol=0, atol=0)
            torch.testing.assert_close(lb, chunks[1] if len(chunks) > 1 else (x + y)[:0], rtol=0, atol=0)
    assert r0["scales"] == r1["scales"] and r0["scales"].startswith("the ranks scaled their losses differently")


# ------------------------------------------------------------------------------------------------------------------
# LoRA (--trainable lora) under FSDP: DDP's model at the same ε, the merged release, the checkpoint
# ------------------------------------------------------------------------------------------------------------------
def _plain_name(name: str) -> str:
    """The plain model's name of a LoRA model's frozen parameter (PEFT's prefix and wrappers dropped)."""
    return name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", ".")


def test_fsdp_lora_trains_the_ddp_model_at_the_same_epsilon(launches):
    """--trainable lora, the same --dp_seed, the noise zeroed: under FSDP (adapters and head sharded, one-pass ghost
    clipping) the adapters and the head end as under DDP up to float rounding, the frozen weights untouched, same ε."""
    _, fsdp, ddp = launches
    f0, f1 = fsdp["lora"]
    d0 = ddp["lora"][0]
    assert f0["wrapped"].startswith("FSDP") and all(f0["sharded"]), f0["wrapped"]
    assert d0["wrapped"] == "DistributedDataParallel"
    assert f0["clipping"] == "ghost" and d0["clipping"] == "ghost_two_pass"
    assert f0["names"] == d0["names"] and all(".lora_" in n or ".modules_to_save." in n for n in f0["names"])
    assert f0["params"].keys() == d0["params"].keys()
    from helpers import make_model

    init = dict(make_model().named_parameters())
    trained, frozen = set(f0["names"]), set()
    for n in f0["params"]:
        torch.testing.assert_close(f0["params"][n], f1["params"][n], rtol=0, atol=0)  # both ranks gathered the same
        if n in trained:
            torch.testing.assert_close(f0["params"][n], d0["params"][n], rtol=1e-5, atol=1e-6, msg=lambda m: f"{n}: {m}")
        else:  # frozen: the initial weights, under FSDP as under DDP
            torch.testing.assert_close(f0["params"][n], init[_plain_name(n)], rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
            torch.testing.assert_close(d0["params"][n], init[_plain_name(n)], rtol=0, atol=0, msg=lambda m: f"{n}: {m}")
            frozen.add(_plain_name(n))
    assert frozen == init.keys()  # every base weight (the head's original too) checked
    lora_b = [n for n in trained if ".lora_B." in n]
    assert len(lora_b) >= 4 and min(f0["params"][n].abs().max().item() for n in lora_b) > 1e-3  # B trained away from 0
    assert f0["epsilon"] == d0["epsilon"] <= 8.0 and f0["history"] == d0["history"] and f0["spec"] == d0["spec"]
    assert f0["ledger_steps"] == d0["ledger_steps"] == STEPS


def test_fsdp_lora_release_is_the_merged_plain_model_equal_to_ddps(launches):
    """--trainable lora under FSDP: the release is the plain model with W + (α/r)·B·A merged from the gathered weights
    (hf_dp.clipping.sharding.plain_release), not an adapter folder, and it equals DDP's release (hf_dp's merge without FSDP)."""
    base, fsdp, _ = launches
    r0 = fsdp["lora"][0]
    import json

    from transformers import AutoModelForSequenceClassification

    release, ddp_release = base / "fsdp" / "lora" / "release", base / "ddp" / "lora" / "release"
    for folder in (release, ddp_release):
        assert not (folder / "adapter_config.json").exists() and (folder / "privacy.json").is_file(), folder
        assert (folder / "README.md").is_file(), folder
    assert sorted(os.listdir(release)) == sorted(os.listdir(ddp_release))
    epsilons = [float(json.loads((f / "privacy.json").read_text())["epsilon"]) for f in (release, ddp_release)]
    assert epsilons[0] == epsilons[1] and abs(epsilons[0] - r0["epsilon"]) < 1e-9 * max(1.0, r0["epsilon"])
    model = AutoModelForSequenceClassification.from_pretrained(release)
    assert type(model).__name__ == "BertForSequenceClassification"
    assert model.config.architectures == ["BertForSequenceClassification"]
    got, full, merged = dict(model.named_parameters()), r0["params"], 0
    for name, p in got.items():
        stem, leaf = ("base_model.model." + name).rsplit(".", 1)
        if stem + ".lora_A.default.weight" in full:  # a LoRA-wrapped linear layer
            expected = full[f"{stem}.base_layer.{leaf}"]
            if leaf == "weight":
                delta = full[stem + ".lora_B.default.weight"] @ full[stem + ".lora_A.default.weight"] * (16 / 8)  # α/r
                assert delta.abs().max() > 0  # B trained away from 0
                expected = expected + delta
                merged += 1
            torch.testing.assert_close(p.detach(), expected, rtol=0, atol=1e-7)
        else:  # untouched base weights, or the trained head (PEFT's modules_to_save copy)
            key = stem + ".modules_to_save.default." + leaf
            torch.testing.assert_close(p.detach(), full[key if key in full else stem + "." + leaf], rtol=0, atol=0)
    assert merged >= 4
    # DDP's release: the same plain model (every tensor of the state dict) up to float rounding
    ddp_model = AutoModelForSequenceClassification.from_pretrained(ddp_release)
    assert type(ddp_model) is type(model) and ddp_model.config.architectures == model.config.architectures
    mine, theirs = model.state_dict(), ddp_model.state_dict()
    assert mine.keys() == theirs.keys()
    for name, t in mine.items():
        torch.testing.assert_close(t, theirs[name], rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def test_fsdp_lora_resumed_from_its_checkpoint_equals_the_uninterrupted_run(launches):
    """LoRA under FSDP, the noise on, SHARDED_STATE_DICT: a run stopped at its checkpoint (step 2, an epoch's end) and
    resumed ends with the uninterrupted run's adapters and head, ε and step count; the checkpoint's model part holds
    the adapters and the head only (HF's adapter_only save), each rank's shards."""
    base, fsdp, _ = launches
    r0, r1 = fsdp["lora_ckpt"]
    u, a, res = r0["U"], r0["A"], r0["R"]
    assert a["global_step"] == a["ledger_steps"] == 2 and a["resumed_from"] is None  # A stopped at its checkpoint
    assert str(res["resumed_from"]).endswith(os.path.join("a", "checkpoint-2"))
    assert res["global_step"] == u["global_step"] == STEPS and res["ledger_steps"] == u["ledger_steps"] == STEPS
    q = PER_DEVICE * GA * 2 / CKPT_N
    assert res["epsilon"] == u["epsilon"] and res["history"] == u["history"] == [(CKPT_SIGMA, q, STEPS)]
    trained = u["names"]
    assert trained == res["names"] and all(".lora_" in n or ".modules_to_save." in n for n in trained)
    assert max((res["params"][k] - a["params"][k]).abs().max().item() for k in trained) > 1e-3  # R trained past step 2
    for k in u["params"]:
        torch.testing.assert_close(res["params"][k], u["params"][k], rtol=1e-5, atol=1e-6, msg=lambda m: f"{k}: {m}")
        assert torch.equal(r0["R"]["params"][k], r1["R"]["params"][k])  # both ranks gathered the same model
    assert r1["R"]["ledger_steps"] == STEPS and r1["R"]["epsilon"] == res["epsilon"]

    import torch.distributed.checkpoint as dcp

    ckpt = base / "fsdp" / "lora_ckpt" / "a" / "checkpoint-2"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(ckpt / "pytorch_model_fsdp_0"))
    saved = set(dcp.FileSystemReader(str(ckpt / "pytorch_model_fsdp_0")).read_metadata().state_dict_metadata)
    assert saved and all(".lora_" in k or ".classifier." in k for k in saved), sorted(saved)
