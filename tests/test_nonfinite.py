"""Non-finite and overflowing per-example contributions (issue 27, item 6): whatever an example's loss — NaN, ±inf,
or a finite but huge value such as a regression label of 1e19 — every clipping engine (ghost, ghost_two_pass, the
Opacus hooks) adds to the clipped sum a finite vector of norm ≤ C for it, and the other examples of its micro-batch
keep their clipped contributions. An example whose clipped vector's squared norm is not finite in the engines'
precision (NaN, inf, or ‖v_i‖ ≥ 2^64 ≈ 1.8e19 in float32) contributes exactly 0; a representable one is clipped
like any other, also when the float32 ghost-norm products of its records overflow.

The DPTrainer tests make the bad label inside a data collator (from a ``target`` column and a ``poison`` flag), so
they keep exercising the engines when DPTrainer refuses non-finite values in a dataset's label column."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from transformers import DataCollatorWithPadding

from hf_dp.clipping.common import TokenBounds
from hf_dp import DPTrainer
from hf_dp.clipping.ghost import GhostClipper, clip_factors
from hf_dp.clipping.hooks import attach_grad_sampler
from hf_dp.models.loss import per_example_loss
from hf_dp.optim import make_optimizer
from tests.helpers import dp_args, drawn, make_model, make_pair_dataset, make_tokenizer


#: the public token bounds of these small batches (tight: the rounding allowance of the exact comparisons stays tiny)
TIGHT = TokenBounds(max_length=16, max_tokens=64)

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

ENGINES = ("ghost", "ghost_two_pass", "hooks")
C = 1.0
#: labels whose example must contribute exactly 0 (the bias gradient alone, 2|x − y|, is ≥ 2e19 > 2^64 for the
#: finite ones; 1e30 and −1e38 also make the float32 loss inf)
ZERO = {"nan": math.nan, "inf": math.inf, "-inf": -math.inf, "1e19": 1e19, "1e30": 1e30, "-1e38": -1e38, "3e38": 3e38}
#: labels whose example's gradient is finite and representable (‖∇ℓ‖ ≈ 16|y| here): clipped to norm C
CLIPPED = {"1e12": 1e12, "1e17": 1e17, "-1e17": -1e17}
INPUTS = ("input_ids", "token_type_ids", "attention_mask")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _inputs(tok, n=4):
    ds = make_pair_dataset(tok, n=8)
    pad = DataCollatorWithPadding(tok, padding="max_length", max_length=16)
    return pad([{k: ds[i][k] for k in INPUTS} for i in range(n)])


def _bert():
    model = make_model(seed=0, num_labels=1)  # a regression head: MSE per example
    model.train()
    return model


def _named(model, out):
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g.detach().double() for p, g in out.items()}


def _clipped_sum(engine, model, batch, labels, clip=C):
    """{name: Σ_i c_i ∇ℓ_i} of one micro-batch through ``engine`` (a fresh copy of ``model``; no noise)."""
    model = copy.deepcopy(model)
    model.train()
    if engine == "hooks":
        handle = attach_grad_sampler(model)
        opt = make_optimizer("dp_sgd", model.parameters(), noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=1.0, lr=0.1)
        try:
            losses = per_example_loss(model(**batch).logits, labels, model.config)
            losses.sum().backward()
            assert opt.accumulate() == labels.shape[0]
            return _named(model, {p: p.summed_grad for p in opt.params})
        finally:
            handle.detach()
    gc = GhostClipper(model, bounds=TIGHT, two_pass=engine == "ghost_two_pass")
    try:
        losses = per_example_loss(model(**batch).logits, labels, model.config)
        if gc.two_pass:
            return _named(model, gc.two_pass_clipped_sum(losses, clip))
        losses.sum().backward()
        return _named(model, gc.clipped_sum(clip))
    finally:
        gc.detach()


def _norm(d):
    return math.sqrt(sum(float(v.pow(2).sum()) for v in d.values()))


def _assert_finite(d, what="clipped sum"):
    bad = [n for n, v in d.items() if not bool(torch.isfinite(v).all())]
    assert not bad, f"non-finite {what} for {bad}"


def _assert_sums_close(got, want, rtol=1e-5):
    scale = max(float(v.abs().max()) for v in want.values())
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=rtol, atol=rtol * scale, msg=lambda m: f"{n}: {m}")


LABELS = torch.tensor([0.3, -0.5, 1.2, 0.7])


def _drop(batch, row):
    keep = [i for i in range(batch["input_ids"].shape[0]) if i != row]
    return {k: v[keep] for k, v in batch.items()}


# ----- engine level ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("bad", list(ZERO), ids=list(ZERO))
@pytest.mark.parametrize("engine", ENGINES)
def test_a_non_finite_or_overflowing_example_contributes_nothing(tok, engine, bad):
    """One row with label NaN / ±inf / ≥ 1e19: the clipped sum is finite and equals the clipped sum of the other
    rows alone (the same padded inputs without that row)."""
    model, batch = _bert(), _inputs(tok)
    labels = LABELS.clone()
    labels[1] = ZERO[bad]
    got = _clipped_sum(engine, model, batch, labels)
    _assert_finite(got)
    _assert_sums_close(got, _clipped_sum(engine, model, _drop(batch, 1), LABELS[[0, 2, 3]]))


@pytest.mark.parametrize("engine", ENGINES)
def test_a_huge_finite_example_in_a_batch_is_clipped_like_a_large_one(tok, engine):
    """A label of ±1e17 (gradient ≈ 1.6e18: finite, squared norm representable) is clipped to norm C in the
    direction of its gradient — the same contribution as a label of ±1e4 — next to ordinary rows."""
    model, batch = _bert(), _inputs(tok)
    for y in (1e17, -1e17):
        huge, large = LABELS.clone(), LABELS.clone()
        huge[1], large[1] = y, math.copysign(1e4, y)
        got = _clipped_sum(engine, model, batch, huge)
        _assert_finite(got)
        _assert_sums_close(got, _clipped_sum(engine, model, batch, large), rtol=1e-4)


@pytest.mark.parametrize("engine", ENGINES)
def test_each_huge_or_non_finite_example_contributes_at_most_C(tok, engine):
    """Batches of one: each example's clipped contribution is finite with norm ≤ C(1 + 1e-6); a representable
    huge gradient is clipped to C (not dropped), one that is not (or NaN/inf) contributes exactly 0."""
    model, batch = _bert(), _inputs(tok, n=1)
    ref = _clipped_sum(engine, model, batch, torch.tensor([1e4]))
    assert _norm(ref) == pytest.approx(C, rel=2e-5)
    for name, y in {**CLIPPED, "1e18": 1e18, **ZERO}.items():
        got = _clipped_sum(engine, model, batch, torch.tensor([y]))
        _assert_finite(got)
        assert _norm(got) <= C * (1 + 1e-6), name
        if name in CLIPPED:
            _assert_sums_close(got, ref if y > 0 else {n: -v for n, v in ref.items()}, rtol=1e-4)
        elif name in ZERO:
            assert _norm(got) == 0.0, name


class _TokenSum(nn.Module):
    """out_i = Σ_{t,o} (W x_{i,t})_o (no bias): every output gradient entry of example i is 2(out_i − y_i)."""

    def __init__(self, d):
        super().__init__()
        self.lin = nn.Linear(d, d, bias=False)

    def forward(self, x):
        return self.lin(x).sum((1, 2))


def _token_sum_clipped(engine, model, x, y, clip):
    """The clipped sum of ``model.lin.weight`` for squared-error losses (out_i − y_i)² through ``engine``."""
    m = copy.deepcopy(model)
    if engine == "hooks":
        handle = attach_grad_sampler(m)
        opt = make_optimizer("dp_sgd", m.parameters(), noise_multiplier=0.0, max_grad_norm=clip, expected_batch_size=1.0, lr=0.1)
        try:
            ((m(x) - y) ** 2).sum().backward()
            opt.accumulate()
            return m.lin.weight.summed_grad.double()
        finally:
            handle.detach()
    gc = GhostClipper(m, bounds=TIGHT, two_pass=engine == "ghost_two_pass")
    try:
        losses = (m(x) - y) ** 2
        if gc.two_pass:
            return gc.two_pass_clipped_sum(losses, clip)[m.lin.weight].double()
        losses.sum().backward()
        return gc.clipped_sum(clip)[m.lin.weight].double()
    finally:
        gc.detach()


@pytest.mark.parametrize("engine", ENGINES)
def test_ghost_norms_do_not_overflow_when_the_gradient_is_representable(engine):
    """Row 1 has tiny activations (2⁻¹⁴·u) and output gradients of −1e20: the float32 ghost-norm products
    (g_t·g_s ≈ 8e40) overflow, but its gradient −1e20·1 (x_1 + x_2)ᵀ (norm ≈ 1e17) is finite and representable. It
    must be clipped to norm C in its own direction — as the Opacus hooks do — not dropped, and row 0 keep its
    contribution. (Two positions and d = 8: the ghost-norm path, not the materialising one.)"""
    torch.manual_seed(0)
    d = 8
    u = torch.tensor([1.0, 2.0, -1.0, 3.0, 0.5, -2.0, 1.5, 4.0])
    x = torch.randn(2, 2, d)
    x[1, 0] = x[1, 1] = 2.0**-14 * u
    model = _TokenSum(d)
    with torch.no_grad():
        out = model(x)
        y = torch.stack([out[0] + 0.8, out[1] + 5e19])  # output gradients 2(out − y): −1.6 and −1e20
    clip = 0.5

    def run(rows):
        return _token_sum_clipped(engine, model, x[rows], y[rows], clip)

    got = run([0, 1])
    assert bool(torch.isfinite(got).all())
    want = -clip * torch.outer(torch.ones(d), u).double() / (math.sqrt(d) * u.double().norm())
    torch.testing.assert_close(got - run([0]), want, rtol=0, atol=2e-5 * clip)
    alone = run([1])
    torch.testing.assert_close(alone, want, rtol=0, atol=2e-5 * clip)
    assert float(alone.norm()) <= clip * (1 + 1e-6)


@pytest.mark.parametrize("engine", ENGINES)
def test_an_example_with_non_finite_activations(engine):
    """Row 1's input is inf (a forward overflow, not a label): one pass and the hooks give it a zero contribution;
    two passes cannot (autograd's weight gradient multiplies its zeroed output gradient by inf) and refuse with
    an error instead of returning NaN."""
    torch.manual_seed(0)
    x = torch.randn(3, 2, 4)
    x[1, 0, 2] = math.inf
    y = torch.tensor([0.5, 0.1, -0.3])
    model = _TokenSum(4)

    def run(rows):
        return _token_sum_clipped(engine, model, x[rows], y[rows], C)

    if engine == "ghost_two_pass":
        with pytest.raises(RuntimeError, match="activations are not finite"):
            run([0, 1, 2])
        return
    got = run([0, 1, 2])
    assert bool(torch.isfinite(got).all())
    torch.testing.assert_close(got, run([0, 2]), rtol=1e-6, atol=1e-7)


def test_clip_factors_give_non_finite_norms_a_zero_factor():
    sq = torch.tensor([4.0, math.nan, math.inf, 0.25, -1e-12])
    c = clip_factors(sq, 1.0)
    assert bool(torch.isfinite(c).all())
    assert c[1] == 0 and c[2] == 0 and c[3] == 1 and c[4] == 1
    assert float(c[0]) * 2.0 <= 1.0


# ----- through DPTrainer ---------------------------------------------------------------------------------------
class PoisonCollator:
    """Pads the inputs and sets ``labels`` from the ``target`` column, replacing the target of every row whose
    ``poison`` flag is set by ``bad``: the bad label exists only inside the collator."""

    def __init__(self, tok, bad=math.nan):
        self.pad = DataCollatorWithPadding(tok, padding="max_length", max_length=16)
        self.bad = bad

    def __call__(self, rows):
        batch = self.pad([{k: r[k] for k in INPUTS} for r in rows])
        batch["labels"] = torch.tensor([self.bad if r["poison"] else r["target"] for r in rows], dtype=torch.float32)
        return batch


#: DPTrainer's per-example contract probe (hf_dp/run/contract.py) runs compute_loss on the first training rows; NaN
#: gradients there would be compared with themselves (NaN != NaN), so the poisoned rows start after them
PROBE_ROWS = 16


def _regression_dataset(tok, n, poison_every=0):
    """Finite regression targets in ``labels`` (what DPTrainer checks) and ``target`` (what the collator reads);
    ``poison`` flags every ``poison_every``-th row after the first PROBE_ROWS."""
    ds = make_pair_dataset(tok, n=n)
    target = [float(y) + 0.1 * (i % 5) for i, y in enumerate(ds["labels"])]
    poison = [int(poison_every > 0 and i >= PROBE_ROWS and i % poison_every == 0) for i in range(n)]
    ds = ds.remove_columns("labels").add_column("labels", target)
    return ds.add_column("target", target).add_column("poison", poison)


def _trainer(tmp_path, tok, ds, clipping, bad=math.nan, **overrides):
    kw = dict(clipping=clipping, remove_unused_columns=False, per_sample_max_grad_norm=C)
    kw.update(overrides)
    return DPTrainer(model=make_model(seed=0, num_labels=1), args=dp_args(tmp_path, **kw), train_dataset=ds,
                     data_collator=PoisonCollator(tok, bad))


@pytest.mark.parametrize("optim", ["dp_adamw", "dp_sgd_l2", "dp_macadam"])
@pytest.mark.parametrize("clipping", ENGINES)
def test_trainer_step_with_a_bad_label_adds_what_the_other_rows_add(tmp_path, tok, clipping, optim):
    """DPTrainer.training_step on a micro-batch whose row 1 gets a NaN / ±inf / huge label in the collator: the
    clipped sum it adds equals that of the micro-batch without row 1 — also for the rules with a per-sample map
    (DP-SGD-L2: g_i + λθ, a zeroed row adds no λθ either; DP-MacAdam: a per-coordinate scale); an ordinary large
    label (1e4) does add a vector of the clip norm."""
    ds = _regression_dataset(tok, 32)  # q = 1/2
    extra = {"weight_decay": 0.5} if optim == "dp_sgd_l2" else {}
    trainer = _trainer(tmp_path / f"{clipping}-{optim}", tok, ds, clipping, optim=optim, **extra)
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    opt, collator = trainer.dp.optimizer, trainer.data_collator
    trainer.model.train()

    def summed_after(rows, bad):
        collator.bad = bad
        for p in opt.params:
            p.summed_grad = None
        trainer.training_step(trainer.model, drawn(trainer, collator(rows)))
        return {n: p.summed_grad.detach().double().clone() for n, p in zip(range(len(opt.params)), opt.params)}

    rows = [dict(ds[i]) for i in range(4)]
    rows[1]["poison"] = 1
    without = summed_after([rows[0], rows[2], rows[3]], math.nan)
    for name, bad in ZERO.items():
        got = summed_after(rows, bad)
        _assert_finite(got)
        _assert_sums_close(got, without)
    large = summed_after(rows, 1e4)
    assert _norm({n: large[n] - without[n] for n in large}) == pytest.approx(opt.max_grad_norm, rel=1e-3)  # clip space


@pytest.mark.parametrize("clipping", ENGINES)
def test_train_with_bad_labels_in_every_batch_releases_a_finite_model(tmp_path, tok, clipping):
    """Every 4th row's label (after the first PROBE_ROWS) is 1e30, resp. -1e38, inside the collator — finite labels,
    so no check refuses them, but their squared gradient norms overflow float32: train() releases a finite model,
    the same for both (those rows contribute nothing either way; same --dp_seed, so the same batches and noise). A NaN
    label made by the collator is refused before any step (hf_dp.run.contract.check_every_row: a refusal at the step
    that draws the row would reveal it)."""
    ds = _regression_dataset(tok, 64, poison_every=4)
    params = {}
    for name, bad in (("1e30", 1e30), ("-1e38", -1e38)):
        trainer = _trainer(tmp_path / f"{clipping}-{name}", tok, ds, clipping, bad=bad, num_train_epochs=1)
        before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        trainer.train()
        assert trainer.state.global_step >= 3
        params[name] = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
        _assert_finite(params[name], "trained parameters")
        assert any(not torch.equal(before[n], params[name][n]) for n in before)
    for n in params["1e30"]:
        torch.testing.assert_close(params["1e30"][n], params["-1e38"][n], rtol=1e-5, atol=1e-6)
    trainer = _trainer(tmp_path / f"{clipping}-nan", tok, ds, clipping, bad=math.nan, num_train_epochs=1)
    with pytest.raises(ValueError, match=r"^the data collator makes a NaN or infinite label for training row \d+"):
        trainer.train()
    assert trainer.state.global_step == 0
