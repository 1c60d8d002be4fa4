"""Two CPU processes (gloo) under FSDP2 (``--fsdp full_shard``, tiny BERT) with ``--noise_mechanism banded_sqrt``
(issue 52 item 1, "per shard"): each rank correlates the noise of its own shards, and keeps only those.

One launch trains two runs, one after the other, ``--dp_seed`` set, the noise on (nothing taken out): b = 2 (with a
sharded checkpoint at its last step) and b = 3, T = 8 steps each (T not a multiple of 3). The noise each rank adds to
its shards is recorded at every step (the difference the privatizer makes to the rank's local shard of the clipped
sum), and asserted:

* **the buffer** (:class:`hf_dp.privacy.banded.BandedNoise`) of each rank holds, for each parameter with a non-empty
  local shard, its last b − 1 noises on that shard: plain tensors shaped as the local shard (no full-parameter copy, no
  DTensor), equal to what the rank added at steps T − 1, …, T − b + 1, nothing for a parameter whose shard is empty;
  the ranks' shards tile every parameter; the sharded checkpoint holds the update rule's state and the ledger, nothing
  of the buffer;
* **the recursion**: z_t = (n_t + Σ_{k=1}^{min(t, b−1)} c_k n_{t−k}) / (σ·C·s), rebuilt from the recorded noises n of
  each shard, is the shard's own keyed stream (seed, "fsdp_noise", step, parameter, shard offset) exactly, and over all
  coordinates (≈ 25 000 per rank: 8 steps × ≈ 3 170) white: mean ≈ 0, std ≈ 1, lag-1 … lag-b autocorrelations ≈ 0,
  each within K = 5 standard errors of the statistic for its count (mean 1/√n, std 1/√(2n), a correlation of m pairs
  1/√m: ±0.03 to ±0.04 here; a false failure ~6·10⁻⁷ per statistic); the two ranks' z uncorrelated;
* **negative controls** (the same criterion): the noise taken as independent (no recursion undone: n_t/(σ·C·s)) has the
  lag-1 autocorrelation of w = M⁻¹z from the segment's start (−0.49 for b = 2, −0.37 for b = 3: measured −0.50 and
  −0.37), and the recursion undone with the other rank's earlier noise (not the shard's own) has std ≈ 1.25 — both
  fail it;
* both ranks end with the same full model; ε is the accountant's at ⌈T/b⌉ rounds at rate b·q; both ranks hold the
  segment's position; each rank's share of step t's draw is from partition t mod b;
* a resume of the b = 2 run from its checkpoint starts a new segment on every shard (its first noise the keyed draw
  itself): the checkpoint carried nothing of the buffer. (The resume builds a new privatizer, so this does not
  exercise ``PrivateOptimizer.load_state_dict``'s own reset of the segment.)

Measured (one launch, ≈ 20 s on 2 CPU cores): z std − 1 within ±0.014, lag-1 … lag-3 within ±0.021, the ranks' z
correlation −0.006 (b = 2) and −0.009 (b = 3).
"""

from __future__ import annotations

import math
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from two_process import DISTRIBUTED, launch, rank_results  # noqa: E402

pytestmark = DISTRIBUTED  # slow: tests/conftest.py SLOW_FILES

N, PER_DEVICE, STEPS, SIGMA, SEED = 64, 4, 8, 1.0, 40  # B = 2 × 4 = 8, q = 1/8: b·q ≤ 3/8
RUNS = ((2, True), (3, False))  # (b, save a checkpoint at step T)
# 3 labels: the head's rows split unevenly (2 + 1); one token type (the rows' token_type_ids dropped): its embedding's
# single row on rank 0, rank 1's shard of it empty
MODEL = dict(num_labels=3, type_vocab_size=1)
MORE = 3  # steps of the run resumed from the b = 2 run's checkpoint at step T
K = 5.0  # standard errors allowed for each whiteness statistic

WORKER = r"""
    from torch.distributed.tensor import DTensor
    from hf_dp import DPTrainer
    from hf_dp.privacy.privatizer import PrivateOptimizer, _local, _shard_offset
    from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer
    from two_process import record_draws

    noises = []  # per noisy step: (ledger step, [(shard offset, noise added to this rank's shard)] per parameter)
    orig = PrivateOptimizer.add_noise
    def recording_add_noise(self):
        before = [_local(p.summed_grad).clone() for p in self.params]
        step = self.step_index
        result = orig(self)
        noises.append((step, [(_shard_offset(p.grad), (_local(p.grad) - b).clone()) for p, b in zip(self.params, before)]))
        return result
    PrivateOptimizer.add_noise = recording_add_noise
    drawn = record_draws()

    tok = make_tokenizer(os.path.join(out, f"tok{{rank}}"))
    ds = make_pair_dataset(tok, n={n}).remove_columns("token_type_ids")
    def run(bands, save, name, max_steps, resume=None):
        noises.clear()
        drawn.clear()
        config = {{"transformer_layer_cls_to_wrap": ["BertLayer"], "state_dict_type": "SHARDED_STATE_DICT"}}
        args = dp_args(
            os.path.join(out, f"b{{bands}}"), optim="dp_adamw", learning_rate=1e-2, epsilon=None,
            noise_multiplier={sigma}, accountant="rdp", per_device_train_batch_size={per_device}, max_steps=max_steps,
            logging_steps=100, ddp_backend="gloo", dp_seed={seed} + bands, trainable="all", fsdp="full_shard",
            fsdp_config=config, noise_mechanism="banded_sqrt", noise_bands=bands,
            save_strategy="steps" if save else "no", save_steps={steps}, save_total_limit=None,
        )
        trainer = DPTrainer(model=make_model(**{model!r}), args=args, train_dataset=ds, data_collator=make_collator(tok),
                            processing_class=tok)
        trainer.train(resume_from_checkpoint=resume)
        opt = trainer.dp.optimizer
        names = {{id(p): n for n, p in trainer.model.named_parameters()}}
        torch.save(dict(
            wrapped=type(trainer.model).__name__, names=[names.get(id(p)) for p in opt.params],
            full_shapes=[tuple(p.shape) for p in opt.params], local_shapes=[tuple(_local(p).shape) for p in opt.params],
            offsets=[_shard_offset(p) for p in opt.params], noises=list(noises),
            buffer={{k: [(type(t).__name__, t.detach().clone()) for t in ts] for k, ts in opt.correlation._previous.items()}},
            n_buffered=len(opt.correlation.buffered()), position=opt.correlation.position,
            std=opt.noise_std_of_mean, clip=opt.max_grad_norm, expected_batch=opt.expected_batch_size,
            params={{n: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
                    for n, p in trainer.model.named_parameters()}},
            epsilon=trainer.get_epsilon(), steps=trainer.ledger.steps, history=list(trainer.ledger.accountant.history),
            stream_tag=trainer.ledger.meta.get("stream_tag"), spec=trainer.privacy_spec.as_dict(),
            partitions=trainer.dp.sampler.partitions.tolist(), draws=[list(b) for b in drawn],
            resumed_from=trainer.resumed_from,
        ), os.path.join(out, f"{{name}}_rank{{rank}}.pt"))

    for bands, save in {runs!r}:
        run(bands, save, f"b{{bands}}", {steps})
        if save:  # resumed from its checkpoint at step T for {more} more steps: a new correlation segment
            run(bands, False, f"b{{bands}}resumed", {steps} + {more}, resume=True)
    """


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    base = tmp_path_factory.mktemp("fsdp_banded")
    launch(base, WORKER.format(n=N, per_device=PER_DEVICE, steps=STEPS, sigma=SIGMA, seed=SEED, runs=RUNS, model=MODEL,
                                more=MORE), timeout=300)
    results = {b: rank_results(base, f"b{b}_") for b, _ in RUNS}
    results.update({f"{b}resumed": rank_results(base, f"b{b}resumed_") for b, save in RUNS if save})
    return base, results


# ------------------------------------------------------------------------------------------------------------------
# the statistics
# ------------------------------------------------------------------------------------------------------------------
def stacked(r) -> torch.Tensor:
    """[T, this rank's coordinates]: the noise the rank added at each step, its shards of every parameter in order."""
    steps = [s for s, _ in r["noises"]]
    assert steps == list(range(STEPS)), steps
    return torch.stack([torch.cat([n.reshape(-1).double() for _, n in rec]) for _, rec in r["noises"]])


def undo(noise: torch.Tensor, coefficients, scale: float, earlier: torch.Tensor | None = None) -> torch.Tensor:
    """z_t = (n_t + Σ_{k=1}^{min(t, b−1)} c_k e_{t−k}) / scale for every row t of ``noise`` [T, coordinates]; e, the
    earlier noises the recursion is undone with, are ``noise`` itself unless ``earlier`` is given (a negative control)."""
    earlier = noise if earlier is None else earlier
    z = noise.clone()
    for t in range(noise.shape[0]):
        for k, c in enumerate(coefficients[1:], start=1):
            if t - k >= 0:
                z[t] += c * earlier[t - k]
    return z / scale


def whiteness(z: torch.Tensor, lags: int) -> dict:
    """Mean, std and lag-1 … lag-``lags`` autocorrelations over all coordinates of z [T, coordinates] (pairs within a
    coordinate, ``lags`` steps apart), each with the tolerance of K standard errors for its count under i.i.d. N(0, 1)
    (mean: 1/√n; std: 1/√(2n); a correlation of m pairs: 1/√m)."""
    n = z.numel()
    out = {"mean": (z.mean().item(), K / math.sqrt(n)), "std-1": (z.std().item() - 1, K / math.sqrt(2 * n))}
    for lag in range(1, lags + 1):
        a, b = z[lag:].reshape(-1), z[:-lag].reshape(-1)
        out[f"lag{lag}"] = (torch.corrcoef(torch.stack([a, b]))[0, 1].item(), K / math.sqrt(a.numel()))
    return out


def white(stats: dict) -> bool:
    return all(abs(v) < tol for v, tol in stats.values())


def show(stats: dict) -> str:
    return ", ".join(f"{k} {v:+.4f} (tol {tol:.4f})" for k, (v, tol) in stats.items())


def naive_lag1(bands: int) -> float:
    """The lag-1 correlation, pooled over steps 1 … T − 1 and coordinates, of w = M⁻¹z (z i.i.d. N(0, 1), the segment
    starting at step 0): Cov(w_t, w_s) = Σ_{m ≤ min(t, s)} d_{t−m} d_{s−m}, d the impulse response of M⁻¹."""
    from hf_dp.privacy.banded import inverse_impulse

    d = inverse_impulse(bands, STEPS - 1)

    def cov(t, u):
        return sum(d[t - m] * d[u - m] for m in range(min(t, u) + 1))

    pairs = range(1, STEPS)
    return sum(cov(t, t - 1) for t in pairs) / math.sqrt(sum(cov(t, t) for t in pairs) * sum(cov(t - 1, t - 1) for t in pairs))


def aligned(shapes0, shapes1) -> tuple[torch.Tensor, torch.Tensor]:
    """Column indices into two ranks' :func:`stacked` noises: for each parameter, the first min(n0, n1) coordinates of
    each rank's shard (the same positions within the shards)."""
    idx0, idx1, start0, start1 = [], [], 0, 0
    for s0, s1 in zip(shapes0, shapes1):
        a, b = math.prod(s0), math.prod(s1)
        m = min(a, b)
        idx0.append(torch.arange(start0, start0 + m))
        idx1.append(torch.arange(start1, start1 + m))
        start0, start1 = start0 + a, start1 + b
    return torch.cat(idx0), torch.cat(idx1)


# ------------------------------------------------------------------------------------------------------------------
# the tests
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bands", [b for b, _ in RUNS])
def test_each_rank_buffers_its_own_shards_only(launched, bands):
    from helpers import make_model

    r0, r1 = launched[1][bands]
    assert r0["wrapped"].startswith("FSDP") and None not in r0["names"] and r0["names"] == r1["names"]
    model = dict(make_model(**MODEL).named_parameters())
    total = sum(p.numel() for p in model.values())
    assert [model[n].shape for n in r0["names"]] == [torch.Size(s) for s in r0["full_shapes"]]
    for index, full in enumerate(r0["full_shapes"]):  # the two shards tile each parameter: rank 0 first, no overlap
        n0, n1 = math.prod(r0["local_shapes"][index]), math.prod(r1["local_shapes"][index])
        assert n0 + n1 == math.prod(full) and r0["offsets"][index] == 0 and r1["offsets"][index] == n0, index
    for r in (r0, r1):
        local = [math.prod(s) for s in r["local_shapes"]]
        assert set(r["buffer"]) == {i for i, n in enumerate(local) if n > 0}  # nothing for an empty shard
        held = 0
        for index, tensors in r["buffer"].items():
            assert len(tensors) == bands - 1, (index, len(tensors))  # the last b − 1 noises, no more
            for k, (kind, t) in enumerate(tensors):  # most recent first: the noise added at step T − 1 − k
                assert kind == "Tensor" and tuple(t.shape) == r["local_shapes"][index], (index, kind, t.shape)
                step, record = r["noises"][STEPS - 1 - k]
                offset, added = record[index]
                assert step == STEPS - 1 - k and offset == r["offsets"][index]
                torch.testing.assert_close(t, added, rtol=0, atol=1e-5)
                held += t.numel()
        assert r["n_buffered"] == sum(len(ts) for ts in r["buffer"].values())
        assert held == (bands - 1) * sum(local) < (bands - 1) * total  # this rank's coordinates only
    assert sum(math.prod(s) for s in r0["local_shapes"]) + sum(math.prod(s) for s in r1["local_shapes"]) == total
    # even shards, uneven ones (the head) and an empty one on rank 1 (the token type embedding): all layouts covered
    uneven = [r0["names"][i] for i in range(len(r0["names"])) if r0["local_shapes"][i] != r1["local_shapes"][i]]
    assert {"classifier.weight", "classifier.bias", "bert.embeddings.token_type_embeddings.weight"} <= set(uneven), uneven
    assert r1["local_shapes"][r0["names"].index("bert.embeddings.token_type_embeddings.weight")] == (0, 16)


def test_the_checkpoint_holds_no_noise_buffer(launched):
    import io
    import json

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    base, runs = launched
    r0 = runs[2][0]
    folder = base / "b2" / f"checkpoint-{STEPS}" / "hf_dp_optimizer_fsdp"
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(os.listdir(folder))
    metadata = dcp.FileSystemReader(str(folder)).read_metadata()
    tensors = {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    shapes = [tuple(s) for s in r0["full_shapes"]]
    # Adam's two moments per parameter (full shape, each rank its shard), besides scalars; no other tensor at all
    moments = [k for k, s in tensors.items() if k.startswith("optimizer.state.") and s in shapes and math.prod(s) > 1]
    assert len(moments) == 2 * len(shapes), sorted(tensors)
    assert all(math.prod(s) <= 1 for k, s in tensors.items() if k not in moments), sorted(tensors)
    assert not any(w in k for k in metadata.state_dict_metadata for w in ("correlation", "previous", "noise"))
    whole = base / "optimizer_whole.pt"
    dcp_to_torch_save(str(folder), str(whole))
    saved = torch.load(whole, weights_only=False)
    extras = torch.load(io.BytesIO(saved["hf_dp"]), weights_only=True)
    assert "correlation" not in json.dumps(extras, default=str) and extras["ledger"] is not None

    def tensors_in(o):
        if torch.is_tensor(o):
            yield o
        elif isinstance(o, dict):
            for v in o.values():
                yield from tensors_in(v)
        elif isinstance(o, (list, tuple)):
            for v in o:
                yield from tensors_in(v)

    assert not list(tensors_in(extras))


@pytest.mark.parametrize("bands", [b for b, _ in RUNS])
def test_each_shards_noise_follows_the_banded_recursion_on_its_own_stream(launched, bands):
    from hf_dp.privacy import banded
    from hf_dp.privacy.randomness import stream_generator

    r0, r1 = launched[1][bands]
    coefficients, s = banded.bsr_coefficients(bands), banded.column_norm(bands)
    assert r0["clip"] == r1["clip"] == 1.0
    scale = SIGMA * r0["clip"] * s
    # exact: every shard's rebuilt z is its own stream, keyed by (seed, "fsdp_noise", step, parameter, shard offset)
    for r in (r0, r1):
        assert r["stream_tag"] is None  # a fresh run: the key has no tag
        for index, shape in enumerate(r["local_shapes"]):
            if math.prod(shape) == 0:
                assert all(rec[index][1].numel() == 0 for _, rec in r["noises"])
                continue
            shard = torch.stack([rec[index][1].double() for _, rec in r["noises"]])
            z = undo(shard, coefficients, 1.0)
            for t in range(STEPS):
                gen = stream_generator(SEED + bands, "fsdp_noise", t, index, r["offsets"][index])
                expected = torch.normal(0.0, scale, size=shape, generator=gen).double()
                torch.testing.assert_close(z[t], expected, rtol=0, atol=2e-5, msg=lambda m: f"{index} step {t}: {m}")
    # statistical: the rebuilt z is white on each rank (all its coordinates), and the ranks' z are uncorrelated
    n0, n1 = stacked(r0), stacked(r1)
    z0, z1 = undo(n0, coefficients, scale), undo(n1, coefficients, scale)
    for z in (z0, z1, torch.cat([z0, z1], dim=1)):
        stats = whiteness(z, bands)
        assert white(stats), show(stats)
    # the same positions of both ranks' shards of each parameter (the first min(shard sizes) coordinates of each)
    idx0, idx1 = aligned(r0["local_shapes"], r1["local_shapes"])
    a, b = z0[:, idx0].reshape(-1), z1[:, idx1].reshape(-1)
    cross = torch.corrcoef(torch.stack([a, b]))[0, 1].item()
    assert abs(cross) < K / math.sqrt(a.numel()) and not torch.equal(a, b), cross

    # negative controls, on the same criterion: the noise taken as independent is detectably correlated across steps
    # (its lag-1 correlation the banded mechanism's: w = M⁻¹z from the segment's start, pooled over the T − 1 pairs)
    expected = naive_lag1(bands)
    for n in (n0, n1):
        naive = whiteness(n / scale, bands)
        assert not white(naive) and abs(naive["lag1"][0]) > 8 * naive["lag1"][1], show(naive)
        assert abs(naive["lag1"][0] - expected) < 2 * naive["lag1"][1], (expected, show(naive))
    # ... and undoing the recursion with the other rank's earlier noise (not this shard's own) is not standard normal
    wrong = whiteness(undo(n0[:, idx0], coefficients, scale, earlier=n1[:, idx1]), bands)
    assert not white(wrong) and wrong["std-1"][0] > 0.15, show(wrong)
    print(f"\nb={bands}: z rank 0: {show(whiteness(z0, bands))}\n      z rank 1: {show(whiteness(z1, bands))}\n"
          f"      ranks' z correlation {cross:+.4f}; independent-noise control: {show(whiteness(n0 / scale, bands))}\n"
          f"      other rank's history control: {show(wrong)}")


@pytest.mark.parametrize("bands", [b for b, _ in RUNS])
def test_same_model_epsilon_of_ceil_t_over_b_rounds_and_cyclic_partitions(launched, bands):
    from hf_dp.privacy import banded
    from hf_dp.privacy.accounting import compute_epsilon

    r0, r1 = launched[1][bands]
    from helpers import make_model

    init = dict(make_model(**MODEL).named_parameters())
    assert r0["params"].keys() == init.keys()
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    assert max((r0["params"][k] - init[k]).abs().max().item() for k in init) > 1e-3  # it trained
    q = 2 * PER_DEVICE / N
    assert r0["spec"]["sample_rate"] == q and r0["spec"] == r1["spec"]
    rounds = -(-STEPS // bands)
    assert r0["steps"] == r1["steps"] == STEPS and r0["history"] == r1["history"] == [(SIGMA, bands * q, rounds)]
    eps = compute_epsilon(SIGMA, q, STEPS, 1e-5, "rdp", bands)
    assert r0["epsilon"] == r1["epsilon"] == eps == compute_epsilon(SIGMA, bands * q, rounds, 1e-5, "rdp")
    assert eps != compute_epsilon(SIGMA, q, STEPS, 1e-5, "rdp")  # not the independent mechanism's T rounds at q
    # both ranks hold the segment's position and the same noise figure for the update rule
    assert r0["position"] == r1["position"] == STEPS and r0["std"] == r1["std"]
    assert r0["std"] == pytest.approx(SIGMA * 1.0 * banded.marginal_std_factor(bands, STEPS - 1) / (2 * PER_DEVICE), rel=1e-12)
    # each rank's share of step t's draw (one micro-batch per step) is from partition t mod b
    assert r0["partitions"] == r1["partitions"] and set(r0["partitions"]) == set(range(bands))
    rows = 0
    for r in (r0, r1):
        assert len(r["draws"]) >= STEPS
        for t, batch in enumerate(r["draws"][:STEPS]):
            assert all(r["partitions"][i] == t % bands for i in batch), (t, batch)
            rows += len(batch)
    assert rows > STEPS  # the draws were not (nearly) all empty


def test_a_resume_from_the_sharded_checkpoint_starts_a_new_segment_on_each_shard(launched):
    """b = 2 resumed from its checkpoint at step T: nothing of the noise was saved, so each shard's first noise after
    the resume is its keyed stream's draw itself (not the recursion on the noise of step T − 1), the next ones the
    recursion within the new segment; ε counts all T + MORE steps (⌈(T + MORE)/2⌉ rounds at 2q); the same model on
    both ranks; the draws stay on their steps' partitions."""
    from hf_dp.privacy import banded
    from hf_dp.privacy.accounting import compute_epsilon
    from hf_dp.privacy.randomness import stream_generator

    first, resumed = launched[1][2], launched[1]["2resumed"]
    coefficients, scale = banded.bsr_coefficients(2), SIGMA * 1.0 * banded.column_norm(2)
    matched_old_segment = 0
    for f, r in zip(first, resumed):
        assert str(r["resumed_from"]).endswith(f"checkpoint-{STEPS}") and r["stream_tag"] is None  # a clean continuation
        assert [s for s, _ in r["noises"]] == list(range(STEPS, STEPS + MORE))
        assert r["position"] == MORE and r["local_shapes"] == f["local_shapes"] and r["offsets"] == f["offsets"]
        for index, shape in enumerate(r["local_shapes"]):
            if math.prod(shape) == 0:
                continue
            shard = torch.stack([rec[index][1].double() for _, rec in r["noises"]])
            z = undo(shard, coefficients, 1.0)  # the new segment starts at step T
            for j in range(MORE):
                gen = stream_generator(SEED + 2, "fsdp_noise", STEPS + j, index, r["offsets"][index])
                expected = torch.normal(0.0, scale, size=shape, generator=gen).double()
                torch.testing.assert_close(z[j], expected, rtol=0, atol=2e-5, msg=lambda m: f"{index} step {j}: {m}")
            # continuing the old segment would have added −c_1·(the noise of step T − 1) to the first draw
            old = f["noises"][STEPS - 1][1][index][1].double()
            matched_old_segment += torch.allclose(shard[0], z[0] - coefficients[1] * old.reshape(shard[0].shape), atol=1e-3)
            (kind, held), = r["buffer"][index]
            assert kind == "Tensor" and torch.allclose(held.double(), shard[-1], atol=1e-5)
    assert matched_old_segment == 0
    r0, r1 = resumed
    for name, p in r0["params"].items():
        assert torch.equal(p, r1["params"][name]), name
    total, q = STEPS + MORE, 2 * PER_DEVICE / N
    assert r0["steps"] == r1["steps"] == total and r0["history"] == r1["history"] == [(SIGMA, 2 * q, -(-total // 2))]
    assert r0["epsilon"] == r1["epsilon"] == compute_epsilon(SIGMA, q, total, 1e-5, "rdp", 2)
    for r in resumed:
        assert len(r["draws"]) >= MORE
        for j, batch in enumerate(r["draws"][:MORE]):
            assert all(r["partitions"][i] == (STEPS + j) % 2 for i in batch), (STEPS + j, batch)
