"""Unit-level clipping (issue 29): with ``units`` (row r belongs to privacy unit units[r]) every engine — one-pass
ghost, two-pass ghost, the Opacus hooks — adds for unit u exactly c_u·v_u, v_u = (Σ_{r∈u} ∇ℓ_r + o) ⊙ s, c_u from
‖v_u‖ (0 when not finite). Checked against one autograd backward per row on a float64 causal LM (GPT-2 with its tied
input/output embedding, every parameter trainable), units of 1–4 rows of very different lengths, padded right and
left: the clipped sums and norms, each unit's own contribution (the sum with the unit minus the sum without it),
the sensitivity (removing a unit moves the sum by ≤ C, replacing it by ≤ 2C), a non-finite row (its whole unit adds
exactly 0, the others are unchanged), the affine rules (DP-SGD-L2, DP-MacAdam: the map applied once per unit),
the single-query hint (dropped when a unit has several rows) and ``units=None`` (bit-identical to no argument).

The helpers here (tiny models, batches, the inline causal-LM loss, the per-row reference and the engine harness)
are shared with ``tests/test_clm_layers.py``."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
import transformers as T

from hf_dp.clipping import clip_factors, make_engine
from hf_dp.clipping.common import TokenBounds
from hf_dp.optim import make_optimizer

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")

ENGINES = ("ghost", "ghost_two_pass", "hooks")
VOCAB = 40
T_LEN = 12
#: row lengths (tokens before padding): very different, one row with a single token (no scored token: loss 0)
LENGTHS = [12, 2, 7, 3, 11, 1, 5, 9]
#: unit of each row: unit 2 has 4 rows (0, 2, 5, 7), unit 0 two, units 1 and 3 one each; not in row order
UNITS = [2, 0, 2, 1, 3, 2, 0, 2]


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


# ----- models, batches, the loss ------------------------------------------------------------------------------
def gpt2(dtype=torch.float64, seed=0, tie=True):
    torch.manual_seed(seed)
    cfg = T.GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=2, n_head=2, n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0,
                       attn_pdrop=0.0, bos_token_id=1, eos_token_id=1, pad_token_id=0, tie_word_embeddings=tie)
    model = T.GPT2LMHeadModel(cfg).to(dtype)
    model.train()
    return model


def llama(dtype=torch.float64, seed=0, tie=True):
    torch.manual_seed(seed)
    cfg = T.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                        num_key_value_heads=1, max_position_embeddings=64, tie_word_embeddings=tie, bos_token_id=1,
                        eos_token_id=1, pad_token_id=0)  # (eager attention in float64 gives NaN for left padding)
    model = T.LlamaForCausalLM(cfg).to(dtype)
    with torch.no_grad():  # RMSNorm weights start at 1: make them differ per coordinate
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.add_(0.3 * torch.randn(p.shape, dtype=p.dtype))
    model.train()
    return model


def make_batch(lengths=LENGTHS, side="right", seed=1, t_len=T_LEN):
    """input_ids / attention_mask / position_ids (counted from each row's first token) / labels (-100 at padding),
    as DataCollatorForLanguageModeling(mlm=False) and DPTrainer give them."""
    g = torch.Generator().manual_seed(seed)
    B = len(lengths)
    ids = torch.randint(2, VOCAB, (B, t_len), generator=g)
    mask = torch.zeros(B, t_len, dtype=torch.long)
    for i, n in enumerate(lengths):
        if side == "right":
            mask[i, :n] = 1
        else:
            mask[i, t_len - n:] = 1
    ids[mask == 0] = 0
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1).clamp_min(0),
            "labels": ids.masked_fill(mask == 0, -100)}


def rows(batch, keep):
    keep = list(keep)
    return {k: v[keep] for k, v in batch.items()}


def clm_losses(logits, labels):
    """Each sequence's mean next-token cross-entropy over its scored tokens (labels shifted as the model's own loss
    shifts them), 0 for a sequence without one; float32 (float64 for a float64 model)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:]
    tokens = F.cross_entropy(logits.transpose(1, 2), shift, ignore_index=-100, reduction="none")
    return tokens.sum(1) / (shift != -100).sum(1).clamp_min(1).to(tokens.dtype)


def losses_of(model, batch, row_weights=None):
    out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], position_ids=batch["position_ids"])
    losses = clm_losses(out.logits, batch["labels"])
    return losses if row_weights is None else losses * row_weights


def trainable(model):
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def per_row_grads(model, batch):
    """{name: [B, *shape]}: one backward per row (the row alone, same padding)."""
    named = trainable(model)
    out = {n: [] for n, _ in named}
    for i in range(batch["input_ids"].shape[0]):
        grads = torch.autograd.grad(losses_of(model, rows(batch, [i])).sum(), [p for _, p in named], allow_unused=True)
        for (n, p), g in zip(named, grads):
            out[n].append(torch.zeros_like(p) if g is None else g.detach())
    return {n: torch.stack(v) for n, v in out.items()}


# ----- optimizers (the rule's per-sample map) -----------------------------------------------------------------
def make_opt(model, optim, clip, hp=None):
    """The privatizer (σ = 0) on ``model``'s trainable parameters; DP-MacAdam with a non-trivial public state
    (centre m̂ and per-coordinate bound b, as after a few steps)."""
    opt = make_optimizer(optim, [p for _, p in trainable(model)], noise_multiplier=0.0, max_grad_norm=clip,
                         expected_batch_size=1.0, lr=0.1, **(hp or {}))
    if optim == "dp_macadam":
        g = torch.Generator().manual_seed(7)
        for n, p in trainable(model):
            st = opt.rule.state[p]
            st["step"] = 2
            st["exp_avg"] = (0.02 * torch.randn(p.shape, generator=g, dtype=torch.float64)).to(p.dtype)
            st["bound"] = (0.05 * (0.5 + torch.rand(p.shape, generator=g, dtype=torch.float64))).to(p.dtype)
    return opt


def reference(model, batch, units, clip, engine, optim="dp_sgd", hp=None):
    """(Σ_u c_u v_u by name, ‖v_u‖ [U], {name: c_u v_u [U, …]}) from the per-row loop: v_u the rule's clip-space map
    of Σ_{r∈u} ∇ℓ_r, c_u by the engine's formula (ghost: with NORM_MARGIN; hooks: Opacus')."""
    model = copy.deepcopy(model)
    per = per_row_grads(model, batch)
    opt = make_opt(model, optim, clip, hp)
    units = torch.as_tensor(units)
    U = int(units.max()) + 1
    names = [n for n, _ in trainable(model)]
    summed = [torch.zeros(U, *per[n].shape[1:], dtype=per[n].dtype).index_add_(0, units, per[n]) for n in names]
    v = dict(zip(names, opt.rule.to_clip_space([p for _, p in trainable(model)], summed)))
    sq = sum(x.reshape(U, -1).double().pow(2).sum(1) for x in v.values())
    C = opt.max_grad_norm
    c = clip_factors(sq, C) if engine.startswith("ghost") else (C / (sq.sqrt() + 1e-6)).clamp(max=1.0)
    each = {n: c.view(-1, *([1] * (x.dim() - 1))).to(x.dtype) * x for n, x in v.items()}
    return {n: x.sum(0) for n, x in each.items()}, sq.sqrt(), each


def engine_sum(engine, model, batch, units, clip, optim="dp_sgd", hp=None, loss_scale=0.5, row_weights=None,
               autocast=False, norms=False):
    """{name: clipped sum in clip space} of one micro-batch through the engine (DPTrainer's calls: before_backward,
    a backward of loss_scale·Σ, after_backward), on a fresh copy of ``model``; with ``norms`` (one-pass ghost) also
    the clipper's per-unit norms."""
    model = copy.deepcopy(model)
    opt = make_opt(model, optim, clip, hp)
    ids = batch["input_ids"]  # the bounds of this batch's own shape (a run's are public constants of its plan)
    eng = make_engine(engine, model, bounds=TokenBounds(ids.shape[1], ids.numel()))
    u = None if units is None else torch.as_tensor(units)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            losses = losses_of(model, batch, row_weights)
        losses = eng.before_backward(losses, opt, units=u)
        (losses.sum() * loss_scale).backward()
        got_norms = eng.clipper.per_example_norms(loss_scale, affine=opt.rule.per_sample_affine(opt.params), units=u) if norms else None
        eng.after_backward(opt, loss_scale, batch["input_ids"].shape[0], units=u)
        names = {id(p): n for n, p in model.named_parameters()}
        out = {names[id(p)]: p.summed_grad.detach().clone() for p in opt.params}
    finally:
        if eng.clipper is not None:
            eng.clipper.detach()
        if eng.grad_sampler is not None:
            eng.grad_sampler.detach()
    return (out, got_norms) if norms else out


def flat(d):
    return torch.cat([d[n].reshape(-1).double() for n in sorted(d)])


def assert_sums_close(got, want, rtol=1e-6):
    assert set(got) == set(want)
    scale = float(flat(want).abs().max())
    for n in want:
        torch.testing.assert_close(got[n].double(), want[n].double(), rtol=rtol, atol=rtol * scale, msg=lambda m: f"{n}: {m}")


def unit_rows(units, u):
    return [i for i, x in enumerate(units) if x == u]


def renumber(units):
    """Units numbered 0..U'-1 in order of first appearance (what DPTrainer passes for a subset of rows)."""
    seen: dict = {}
    return [seen.setdefault(x, len(seen)) for x in units]


def median_clip(model, batch, units, engine="ghost", optim="dp_sgd", hp=None):
    _, norms, _ = reference(model, batch, units, 1e9, engine, optim, hp)
    return float(norms.median())


# ----- tests --------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("engine", ENGINES)
def test_each_unit_contributes_its_clipped_summed_gradient(engine, side):
    """The clipped sum and (one pass) the per-unit norms equal the per-row loop's; and each unit's own contribution —
    the sum with the unit minus the sum without its rows — is clip_C(Σ_{r∈u} ∇ℓ_r), of norm ≤ C: removing a unit
    moves the sum by at most C, replacing its rows by others (different lengths) by at most 2C."""
    model, batch = gpt2(), make_batch(side=side)
    clip = median_clip(model, batch, UNITS)  # about half the units are clipped
    want, norms_ref, each = reference(model, batch, UNITS, clip, engine)
    if engine == "ghost":
        got, norms = engine_sum(engine, model, batch, UNITS, clip, norms=True)
        torch.testing.assert_close(norms.double(), norms_ref, rtol=1e-7, atol=1e-9)
    else:
        got = engine_sum(engine, model, batch, UNITS, clip)
    assert_sums_close(got, want)
    assert bool((norms_ref > clip * 1.01).any()) and bool((norms_ref < clip * 0.99).any())
    other = make_batch(lengths=[3, 10, 6, 12, 1, 8, 4, 2], side=side, seed=5)
    for u in range(max(UNITS) + 1):
        keep = [i for i, x in enumerate(UNITS) if x != u]
        without = engine_sum(engine, model, rows(batch, keep), renumber([UNITS[i] for i in keep]), clip)
        diff = {n: got[n].double() - without[n].double() for n in got}
        assert_sums_close(diff, {n: x[u] for n, x in each.items()}, rtol=1e-6)
        assert float(flat(diff).norm()) <= clip * (1 + 1e-6)
        # neighbouring by replacement: unit u's rows become other rows (other tokens and lengths)
        replaced = {k: v.clone() for k, v in batch.items()}
        for i in unit_rows(UNITS, u):
            for k in replaced:
                replaced[k][i] = other[k][i]
        swapped = engine_sum(engine, model, replaced, UNITS, clip)
        assert float((flat(swapped) - flat(got)).norm()) <= 2 * clip * (1 + 1e-6)


@pytest.mark.parametrize("bad", [math.nan, math.inf], ids=["nan", "inf"])
@pytest.mark.parametrize("engine", ENGINES)
def test_a_non_finite_row_zeroes_its_whole_unit_and_nothing_else(engine, bad):
    """Row 2's loss is NaN (inf): its unit (rows 0, 2, 5, 7) contributes exactly 0 and the other units keep their
    contributions — the sum equals the sum of the batch without that unit's rows."""
    model, batch = gpt2(), make_batch()
    clip = median_clip(model, batch, UNITS)
    w = torch.ones(len(UNITS), dtype=torch.float64)
    w[2] = bad  # (not row 5: it has no scored token, so its output gradients are exact zeros whatever its weight)
    got = engine_sum(engine, model, batch, UNITS, clip, row_weights=w)
    assert bool(torch.isfinite(flat(got)).all())
    keep = [i for i, x in enumerate(UNITS) if x != UNITS[2]]
    assert_sums_close(got, engine_sum(engine, model, rows(batch, keep), renumber([UNITS[i] for i in keep]), clip))
    alone = engine_sum(engine, model, rows(batch, unit_rows(UNITS, 2)), [0, 0, 0, 0], clip, row_weights=w[unit_rows(UNITS, 2)])
    assert float(flat(alone).abs().max()) == 0.0


@pytest.mark.parametrize("optim,hp", [("dp_sgd_l2", {"weight_decay": 0.5}), ("dp_macadam", None)], ids=["dp_sgd_l2", "dp_macadam"])
@pytest.mark.parametrize("engine", ENGINES)
def test_affine_rules_map_each_unit_once(engine, optim, hp):
    """DP-SGD-L2 (v_u = Σ_r ∇ℓ_r + λθ) and DP-MacAdam (v_u = (Σ_r ∇ℓ_r − m̂)/b, per coordinate, clipped to 1): the
    clipped sum in clip space equals clipping the per-unit vectors of the per-row loop — the offset enters once per
    unit, not once per row."""
    model, batch = gpt2(), make_batch(side="left")
    clip = median_clip(model, batch, UNITS, engine, optim, hp) if optim != "dp_macadam" else 1.0
    want, norms_ref, _ = reference(model, batch, UNITS, clip, engine, optim, hp)
    assert bool((norms_ref > 1.01 * (1.0 if optim == "dp_macadam" else clip)).any())
    if engine == "ghost":
        got, norms = engine_sum(engine, model, batch, UNITS, clip, optim, hp, norms=True)
        torch.testing.assert_close(norms.double(), norms_ref, rtol=1e-7, atol=1e-9)
    else:
        got = engine_sum(engine, model, batch, UNITS, clip, optim, hp)
    assert_sums_close(got, want)
    # the rows as units of their own give a different sum (the offset would enter once per row)
    per_row, _, _ = reference(model, batch, list(range(len(UNITS))), clip, engine, optim, hp)
    assert float((flat(per_row) - flat(want)).norm()) > 1e-3 * float(flat(want).norm())


@pytest.mark.parametrize("engine", ENGINES)
def test_units_none_is_unchanged_and_singleton_units_match(engine):
    """``units=None`` and units 0..B−1 in row order take the same path (bit-identical); singleton units in another
    order give the same sum up to rounding (each row is still its own unit)."""
    model, batch = gpt2(), make_batch()
    B = len(LENGTHS)
    clip = median_clip(model, batch, list(range(B)))
    none = engine_sum(engine, model, batch, None, clip)
    ident = engine_sum(engine, model, batch, list(range(B)), clip)
    assert all(torch.equal(none[n], ident[n]) for n in none)
    perm = engine_sum(engine, model, batch, [3, 1, 7, 0, 2, 6, 4, 5], clip)
    assert_sums_close(perm, none)
    assert_sums_close(none, reference(model, batch, list(range(B)), clip, engine)[0])


@pytest.mark.parametrize("units", [[0, 0, 1, 1, 1], [4, 2, 0, 3, 1]], ids=["several_rows", "permuted_singletons"])
def test_single_query_hint_with_units(units, monkeypatch):
    """The first-token-only last block declares its key/value projections single-query: with several rows per unit
    the hint is dropped (a unit's rows have different queries); with one row per unit (in any order) it is kept.
    Either way the sums equal the per-row loop's."""
    from hf_dp.clipping import linear
    from hf_dp.clipping.ghost import GhostClipper
    from hf_dp.models import apply_trainable
    from hf_dp.models.first_token import first_token_forward
    from tests.test_models import _batch, _config, _model, _per_example_grads

    config = _config("bert")
    model, _ = apply_trainable(_model("bert"), "last_block")
    model.train()
    ids, mask, labels = _batch(config, batch_size=5, seq_len=7)
    u = torch.tensor(units)
    per = _per_example_grads(copy.deepcopy(model), ids, mask, labels)
    U = int(u.max()) + 1
    summed = {n: torch.zeros(U, *g.shape[1:]).index_add_(0, u, g) for n, g in per.items()}
    sq = sum(g.reshape(U, -1).pow(2).sum(1) for g in summed.values())
    clip = float(sq.sqrt().median())
    c = clip_factors(sq, clip)
    want = {n: torch.einsum("u,u...->...", c, g) for n, g in summed.items()}
    seen = []
    orig = linear._single_query
    monkeypatch.setattr(linear, "_single_query", lambda a, g, hs: seen.append(1) or orig(a, g, hs))
    gc = GhostClipper(model)
    try:
        with first_token_forward(model) as active:
            assert active
            logits = model(input_ids=ids, attention_mask=mask).logits
        F.cross_entropy(logits, labels, reduction="sum").backward()
        got = gc.clipped_sum(clip, units=u)
    finally:
        gc.detach()
    assert bool(seen) == (len(set(units)) == len(units))
    names = {id(p): n for n, p in model.named_parameters()}
    got = {names[id(p)]: g for p, g in got.items()}
    assert_sums_close(got, want, rtol=1e-4)


def test_malformed_units_are_refused():
    """Units must number 0..U−1, every value present, one per row: otherwise one ValueError sentence (a unit index
    that skipped a value would silently drop nothing, but a wrong length would mis-attribute rows)."""
    from hf_dp.clipping.common import UnitIndex

    for bad, match in (([0, 2, 2], "every value present"), ([0, 1], "2 entries for a micro-batch of 3"),
                       ([0, -1, 1], "negative"), (torch.tensor([0.0, 1.0, 1.0]), "integer")):
        with pytest.raises(ValueError, match=match):
            UnitIndex(torch.as_tensor(bad), 3)
    model = gpt2(torch.float32)
    opt = make_opt(model, "dp_sgd", 1.0)
    for p in opt.params:
        p.grad_sample = torch.zeros(3, *p.shape)
    with pytest.raises(ValueError, match="every value present"):
        opt.accumulate(units=torch.tensor([0, 2, 2]))
    with pytest.raises(ValueError, match="2 entries for 3 rows"):
        opt.accumulate(units=torch.tensor([0, 1]))
