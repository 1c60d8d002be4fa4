"""Ghost clipping (one backward pass) gives exactly Opacus' clipped per-example sum."""

import copy

import pytest
import torch
import torch.nn.functional as F

from hf_dp.clipping.common import TokenBounds
from hf_dp.models import apply_trainable
from hf_dp.clipping import linear
from hf_dp.clipping.ghost import GhostClipper, clip_factors
from tests.test_models import ARCHS, _batch, _config, _model, _per_example_grads


#: the public token bounds of these small batches (tight: the rounding allowance of the exact comparisons stays tiny)
TIGHT = TokenBounds(max_length=16, max_tokens=96)

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


def _reference_clipped(model, ids, mask, labels, clip):
    """Σ_i min(1, C/(‖g_i‖+1e-6)) g_i from a loop of one backward per example (no Opacus)."""
    per = _per_example_grads(model, ids, mask, labels)
    norms = torch.stack([g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    c = (clip / (norms + 1e-6)).clamp(max=1.0)
    return {n: torch.einsum("i,i...->...", c, g) for n, g in per.items()}, norms


def _ghost(model, ids, mask, labels, clip, loss_scale, materialize_bytes=256 * 2**20, two_pass=False, affine=None):
    gc = GhostClipper(model, bounds=TIGHT, materialize_bytes=materialize_bytes, two_pass=two_pass)
    try:
        logits = model(input_ids=ids, attention_mask=mask).logits
        if two_pass:
            losses = F.cross_entropy(logits, labels, reduction="none")
            sq = gc.norms_pass(losses, affine=affine)
            assert all(p.grad is None for p in model.parameters())  # pass 1 computes no parameter gradient
            c = clip_factors(sq, clip)
            ((losses * c).sum() * loss_scale).backward()
            assert sq.dtype == torch.float64  # upper bounds of the squared norms, kept in float64
            norms, out = sq.sqrt().float(), gc.grads_after_backward(c, loss_scale, affine=affine)
        else:
            (F.cross_entropy(logits, labels, reduction="sum") * loss_scale).backward()
            norms = gc.per_example_norms(loss_scale, affine=affine)
            out = gc.clipped_sum(clip, loss_scale=loss_scale, affine=affine)
    finally:
        gc.detach()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g for p, g in out.items()}, norms


def _check(arch, mode, materialize_bytes=256 * 2**20, two_pass=False):
    config = _config(arch)
    model, _ = apply_trainable(_model(arch), mode)
    model.train()
    ids, mask, labels = _batch(config, batch_size=5, seq_len=7)
    ref_model = copy.deepcopy(model)
    _, norms_ref = _reference_clipped(ref_model, ids, mask, labels, 1e9)
    clip = float(norms_ref.median())  # about half the examples are clipped
    ref, _ = _reference_clipped(ref_model, ids, mask, labels, clip)
    got, norms = _ghost(model, ids, mask, labels, clip, loss_scale=0.25, materialize_bytes=materialize_bytes, two_pass=two_pass)
    torch.testing.assert_close(norms, norms_ref, rtol=1e-4, atol=1e-6)
    scale = max(r.abs().max().item() for r in ref.values())
    assert set(got) == set(ref)
    for name, r in ref.items():
        atol = max(1e-4 * r.abs().max().item(), 1e-7 * scale)
        torch.testing.assert_close(got[name], r, atol=atol, rtol=1e-4, msg=lambda m: f"{name}: {m}")
    # the custom linear did not compute the (non-private) weight gradients during backward; two-pass: the
    # gradients of pass 2 were taken out of .grad
    lin = [m for m in model.modules() if isinstance(m, torch.nn.Linear) and m.weight.requires_grad]
    assert lin and all(m.weight.grad is None for m in lin)


@pytest.mark.parametrize("materialize_bytes", [256 * 2**20, 0], ids=["materialize", "ghost_norms"])
@pytest.mark.parametrize("arch", [a for a in ARCHS if a != "deberta-v2"])
def test_ghost_equals_per_example_loop_last_block(arch, materialize_bytes):
    _check(arch, "last_block", materialize_bytes)


def test_ghost_refuses_layers_applied_to_batch_shared_inputs():
    config = _config("deberta-v2")
    model, _ = apply_trainable(_model("deberta-v2"), "last_block")
    model.train()
    ids, mask, _ = _batch(config)
    gc = GhostClipper(model, bounds=TIGHT)
    with pytest.raises(ValueError, match="shared by the whole batch"):
        model(input_ids=ids, attention_mask=mask)
    gc.detach()


@pytest.mark.parametrize("materialize_bytes", [256 * 2**20, 0, 20_000], ids=["materialize", "ghost_norms", "mixed"])
@pytest.mark.parametrize("arch", ["bert", "gpt2"])
def test_ghost_equals_per_example_loop_all_params_incl_embeddings(arch, materialize_bytes):
    _check(arch, "all", materialize_bytes)


@pytest.mark.parametrize("arch,mode", [("bert", "last_block"), ("bert", "all"), ("gpt2", "all"), ("roberta", "all"), ("albert", "all"), ("electra", "last_block")])
def test_two_pass_ghost_equals_per_example_loop(arch, mode):
    """Two passes (norms from a backward that computes no parameter gradient, then an ordinary backward of
    Σ c_i ℓ_i): the same norms and clipped sum as the per-example loop."""
    _check(arch, mode, materialize_bytes=0, two_pass=True)


def test_two_pass_keeps_no_records_and_refuses_misuse():
    config = _config("bert")
    model, _ = apply_trainable(_model("bert"), "all")
    model.train()
    ids, mask, labels = _batch(config, batch_size=4, seq_len=6)
    gc = GhostClipper(model, bounds=TIGHT, two_pass=True)
    try:
        with pytest.raises(ValueError, match="forward"):
            gc.norms_pass(torch.zeros(4, requires_grad=True))
        losses = F.cross_entropy(model(input_ids=ids, attention_mask=mask).logits, labels, reduction="none")
        with pytest.raises(RuntimeError, match="norms_pass"):
            gc.clipped_sum(1.0)
        sq = gc.norms_pass(losses)
        assert sq.shape == (4,) and bool((sq > 0).all())
        assert all(not layer.records and layer.calls == 0 for layer in gc.layers)  # dropped as they were used
        # a forward whose loss ignores a trainable layer (the classifier): pass 1 says so
        with pytest.raises(ValueError, match="got no gradient in pass 1"):
            gc.norms_pass(model.bert(ids, attention_mask=mask).last_hidden_state.sum((1, 2)))
    finally:
        gc.detach()


def test_two_pass_refuses_reduced_precision():
    """Pass 2 would sum the clipped per-example gradients in bf16 across examples: refused, with the reason."""
    config = _config("bert")
    model, _ = apply_trainable(_model("bert"), "last_block")
    model.train()
    ids, mask, _ = _batch(config)
    gc = GhostClipper(model, bounds=TIGHT, two_pass=True)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16), pytest.raises(ValueError, match="needs float32 layers"):
            model(input_ids=ids, attention_mask=mask)
        model.to(torch.bfloat16)
        with pytest.raises(ValueError, match="needs float32 layers"):
            model(input_ids=ids, attention_mask=mask)
    finally:
        gc.detach()


@pytest.mark.parametrize("materialize_bytes", [256 * 2**20, 0, "two_pass"], ids=["materialize", "ghost_norms", "two_pass"])
@pytest.mark.parametrize("arch,mode", [("bert", "last_block"), ("bert", "all"), ("gpt2", "all"), ("roberta", "last_block")])
@pytest.mark.parametrize("kind", ["offset", "affine", "scalar_scale"])
def test_ghost_with_affine_equals_clipping_the_transformed_vectors(arch, mode, materialize_bytes, kind):
    """Per-example vectors v_i = (g_i + o) ⊙ s — DP-SGD-L2 (o = λθ on some parameters), DP-MacAdam
    (o = −m̂, s = 1/b per coordinate; or s = 1/b_0 scalar at its first step): ghost clipping's norms
    and clipped sum equal clipping the explicit per-example vectors."""
    config = _config(arch)
    model, _ = apply_trainable(_model(arch), mode)
    model.train()
    ids, mask, labels = _batch(config, batch_size=5, seq_len=7)
    named = dict(model.named_parameters())
    per = _per_example_grads(copy.deepcopy(model), ids, mask, labels)
    gen = torch.Generator().manual_seed(1)
    if kind == "offset":  # DP-SGD-L2: λθ on weights only (as HF's no-decay groups do), λ large enough to matter
        aff_by_name = {n: (0.3 * named[n].detach(), None) for n in per if n.endswith("weight") and "LayerNorm" not in n}
    elif kind == "affine":  # MacAdam-like: every parameter, per-coordinate centre and scale
        # one scale for all (per-parameter ones would blow up e.g. the key bias, whose gradient is ~0)
        size = float(torch.cat([g.abs().flatten() for g in per.values()]).mean())
        aff_by_name = {n: (-g.mean(0) + 0.1 * size * torch.randn(g.shape[1:], generator=gen),
                           1.0 / (size * (0.5 + torch.rand(g.shape[1:], generator=gen)))) for n, g in per.items()}
    else:
        aff_by_name = {n: (None, 7.0) for n in per}

    def transform(n, g):
        o, sc = aff_by_name.get(n, (None, None))
        g = g if o is None else g + o.unsqueeze(0)
        return g if sc is None else g * (sc if isinstance(sc, float) else sc.unsqueeze(0))

    v = {n: transform(n, g) for n, g in per.items()}
    norms_ref = torch.stack([x.reshape(x.shape[0], -1).pow(2).sum(1) for x in v.values()]).sum(0).sqrt()
    clip = float(norms_ref.median())
    c = (clip / (norms_ref + 1e-6)).clamp(max=1.0)
    ref = {n: torch.einsum("i,i...->...", c, x) for n, x in v.items()}

    affine = {named[n]: a for n, a in aff_by_name.items()}
    two_pass = materialize_bytes == "two_pass"
    got, norms = _ghost(model, ids, mask, labels, clip, 1.0, 0 if two_pass else materialize_bytes, two_pass=two_pass, affine=affine)
    torch.testing.assert_close(norms, norms_ref, rtol=1e-4, atol=1e-6)
    assert set(got) == set(ref) and aff_by_name
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, atol=max(1e-4 * r.abs().max().item(), 1e-7), rtol=1e-4, msg=lambda m: f"{name}: {m}")


def test_detach_restores_plain_forward():
    config = _config("bert")
    model, _ = apply_trainable(_model("bert"), "last_block")
    ids, mask, _ = _batch(config)
    model.eval()
    before = model(input_ids=ids, attention_mask=mask).logits
    gc = GhostClipper(model, bounds=TIGHT)
    assert model(input_ids=ids, attention_mask=mask).logits.equal(before)  # eval path is the normal forward
    gc.detach()
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert model(input_ids=ids, attention_mask=mask).logits.equal(before)


def test_unsupported_layer_is_refused():
    model = torch.nn.Sequential(torch.nn.Conv1d(2, 2, 3), torch.nn.Flatten(), torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="ghost clipping does not support trainable layer"):
        GhostClipper(model, bounds=TIGHT)


def test_shared_parameter_is_refused():
    a = torch.nn.Linear(3, 3)
    b = torch.nn.Linear(3, 3)
    b.weight = a.weight
    with pytest.raises(ValueError, match="shared between modules"):
        GhostClipper(torch.nn.Sequential(a, b))


def test_ghost_refused_for_rules_that_transform_per_example_gradients():
    """A rule with a per-sample transform that is not a declared affine map cannot take a ghost
    clipped sum; DP-SGD-L2 and DP-MacAdam declare theirs."""
    from hf_dp.optim import DP_OPTIMIZERS, make_optimizer
    from hf_dp.optim.dp_sgd import DPSGD
    from hf_dp.optim.registry import get_entry
    from hf_dp.privacy import PrivateOptimizer

    class Squash(DPSGD):
        def to_clip_space(self, params, grad_samples):
            return [torch.tanh(g) for g in grad_samples]

    lin = torch.nn.Linear(3, 2)
    assert not Squash.ghost_compatible()
    opt = PrivateOptimizer(Squash(lin.parameters(), lr=0.1), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4)
    with pytest.raises(ValueError, match="ghost clipping cannot apply"):
        opt.add_clipped_sum({p: torch.zeros_like(p) for p in lin.parameters()})
    assert all(get_entry(name).rule_cls.ghost_compatible() for name in DP_OPTIMIZERS)
    l2 = make_optimizer("dp_sgd_l2", lin.parameters(), noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=4, weight_decay=0.1)
    aff = l2.rule.per_sample_affine(l2.params)
    assert set(map(id, aff)) == {id(p) for p in lin.parameters()}
    for p, (o, sc) in aff.items():
        torch.testing.assert_close(o, 0.1 * p.detach())
        assert sc is None


@pytest.mark.parametrize("materialize_bytes", [256 * 2**20, 0], ids=["materialize", "ghost_norms"])
def test_one_example_contribution_never_exceeds_C_even_with_large_offsets(materialize_bytes):
    """The sensitivity bound itself: with one example per batch, ‖clipped sum‖ ≤ C (to float32
    rounding), also when the per-sample affine map's offset dwarfs the result (cancellation in the
    expanded norm) and the example sits right at the clipping threshold."""
    config = _config("bert")
    model, _ = apply_trainable(_model("bert"), "last_block")
    model.train()
    ids, mask, labels = _batch(config, batch_size=6, seq_len=7)
    named = dict(model.named_parameters())
    gen = torch.Generator().manual_seed(3)
    per = _per_example_grads(copy.deepcopy(model), ids, mask, labels)
    gc = GhostClipper(model, bounds=TIGHT, materialize_bytes=materialize_bytes)
    try:
        for i in range(ids.shape[0]):
            for big in (1.0, 30.0):
                # o = -(g_i) + a small residual: v_i = (g_i + o) ⊙ s is small while o ⊙ s is large
                aff = {named[n]: (-(g[i]) * (1 + 0.01 * big) + 1e-3 * torch.randn(g.shape[1:], generator=gen),
                                  big * (0.5 + torch.rand(g.shape[1:], generator=gen))) for n, g in per.items()}
                logits = model(input_ids=ids[i : i + 1], attention_mask=mask[i : i + 1]).logits
                gc.clear()
                F.cross_entropy(logits, labels[i : i + 1], reduction="sum").backward()
                norm = float(gc.per_example_norms(affine=aff)[0])
                out = gc.clipped_sum(norm * 0.999, affine=aff)  # C just below the norm: clipped to C
                total = torch.sqrt(sum(v.double().pow(2).sum() for v in out.values()))
                assert float(total) <= norm * 0.999 * (1 + 1e-6), (i, big, float(total), norm)
    finally:
        gc.detach()


def _spy_single_query(monkeypatch):
    """Record what the single-query factorisation returned (None = rejected, generic path used)."""
    seen = []
    orig = linear._single_query

    def spy(a, g, head_size):
        out = orig(a, g, head_size)
        seen.append(out)
        return out

    monkeypatch.setattr(linear, "_single_query", spy)
    return seen


@pytest.mark.parametrize("arch", ["bert", "roberta", "electra"])  # the first-token block's architectures in ARCHS
def test_single_query_fast_path_of_the_first_token_block_is_exact(arch, monkeypatch):
    """With the first-token-only last block, the key/value projections take the factorised path (their
    output gradients are rank one per head) and norms and clipped sums still equal the per-example loop."""
    from hf_dp.models.first_token import first_token_forward

    config = _config(arch)
    model, _ = apply_trainable(_model(arch), "last_block")
    model.train()
    ids, mask, labels = _batch(config, batch_size=5, seq_len=7)  # rows 1 and 3 padded
    ref_model = copy.deepcopy(model)
    _, norms_ref = _reference_clipped(ref_model, ids, mask, labels, 1e9)
    clip = float(norms_ref.median())
    ref, _ = _reference_clipped(ref_model, ids, mask, labels, clip)
    seen = _spy_single_query(monkeypatch)
    with first_token_forward(model) as active:
        assert active
        got, norms = _ghost(model, ids, mask, labels, clip, loss_scale=0.25, materialize_bytes=0)
    assert len(seen) == 4 and all(s is not None for s in seen)  # key and value, for the norms and the sums
    torch.testing.assert_close(norms, norms_ref, rtol=1e-4, atol=1e-6)
    scale = max(r.abs().max().item() for r in ref.values())
    for name, r in ref.items():
        torch.testing.assert_close(got[name], r, atol=max(1e-4 * r.abs().max().item(), 1e-7 * scale), rtol=1e-4, msg=name)


def test_single_query_fast_path_holds_with_attention_dropout(monkeypatch):
    """Attention dropout scales each key/value position by a per-head scalar: still rank one, still taken."""
    from hf_dp.models.first_token import first_token_forward
    from tests.test_models import _model as make

    config = _config("bert")
    model, _ = apply_trainable(make("bert"), "last_block")
    model.bert.encoder.layer[-1].attention.self.dropout.p = 0.5
    model.train()
    ids, mask, labels = _batch(config, batch_size=5, seq_len=7)
    seen = _spy_single_query(monkeypatch)
    with first_token_forward(model) as active:
        assert active
        _ghost(model, ids, mask, labels, 1.0, loss_scale=1.0, materialize_bytes=0)
    assert seen and all(s is not None for s in seen)


def test_single_query_hint_is_checked_not_trusted(monkeypatch):
    """A layer wrongly declared single-query (its output gradient is not rank one per head) falls back
    to the generic ghost norms: norms and clipped sums stay exact."""
    from hf_dp.models.hints import single_query_heads

    torch.manual_seed(0)
    lin = torch.nn.Linear(4, 6)
    model = torch.nn.Sequential(lin)
    x = torch.randn(5, 7, 4)
    target = torch.randn(5, 7, 6)
    per = []
    for i in range(5):
        lin.zero_grad()
        (lin(x[i : i + 1]) - target[i : i + 1]).pow(2).sum().backward()
        per.append(torch.cat([lin.weight.grad.reshape(-1), lin.bias.grad]))
    per = torch.stack(per)
    norms_ref = per.norm(dim=1)
    clip = float(norms_ref.median())
    c = (clip / (norms_ref + 1e-6)).clamp(max=1.0)
    ref = (per * c[:, None]).sum(0)
    seen = _spy_single_query(monkeypatch)
    gc = GhostClipper(model, bounds=TIGHT)
    try:
        with single_query_heads(3):
            out = model(x)
        (out - target).pow(2).sum().backward()
        norms = gc.per_example_norms()
        got = gc.clipped_sum(clip)
    finally:
        gc.detach()
    assert seen and all(s is None for s in seen)  # rejected
    torch.testing.assert_close(norms, norms_ref, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(torch.cat([got[lin.weight].reshape(-1), got[lin.bias]]), ref, rtol=1e-4, atol=1e-5 * float(ref.abs().max()))
