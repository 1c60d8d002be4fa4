"""The layers of causal LMs under every clipping engine (issue 29): tiny ``GPT2LMHeadModel`` (Conv1D, LayerNorm,
its input embedding tied to ``lm_head``) and ``LlamaForCausalLM`` (Linear, transformers' ``LlamaRMSNorm``, with
and without ``tie_word_embeddings``), float32 and float64, trainable ``last_block`` / ``all`` / ``lora``.

For each: ``--clipping auto`` picks one-pass ghost clipping (RMSNorm and the tied pair are supported), the
entries ``GhostClipper.check_supported`` gives are the expected ones, and every engine's clipped sum — per row
(``units=None``) and per unit — equals clipping the per-row autograd gradients (the causal-LM per-sequence loss,
computed inline). Under bf16 autocast each unit's one-pass ghost contribution stays ≤ C. RMSNorm classes are
matched by name and verified by a probe: a class named like one that computes something else is refused (and
``auto`` falls back to the hooks); ``torch.nn.RMSNorm`` and Gemma's (1 + w) variant are clipped exactly.
"""

from __future__ import annotations

import copy
import logging

import pytest
import torch
from torch import nn

from hf_dp.clipping.common import TokenBounds
from hf_dp.clipping import GhostClipper, choose_engine, clip_factors
from hf_dp.clipping.rmsnorm import HFRMSNormType, RMSNormType
from hf_dp.clipping.tied import TiedEmbeddingType
from hf_dp.models import apply_trainable
from hf_dp.optim.dp_sgd import DPSGD
from tests.test_unit_clipping import (
    ENGINES,
    UNITS,
    assert_sums_close,
    engine_sum,
    flat,
    gpt2,
    llama,
    make_batch,
    median_clip,
    reference,
)


#: the public token bounds of these small batches (tight: the rounding allowance of the exact comparisons stays tiny)
TIGHT = TokenBounds(max_length=7, max_tokens=42)

pytestmark = [pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning:peft")]

MODELS = {"gpt2": lambda dt: gpt2(dt), "llama_tied": lambda dt: llama(dt, tie=True), "llama": lambda dt: llama(dt, tie=False)}


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


def build(arch, mode, dtype=torch.float64):
    model, _ = apply_trainable(MODELS[arch](dtype), mode)
    model.train()
    return model


def _tied_params(model):
    emb = model.get_input_embeddings()
    out = model.get_output_embeddings()
    return emb.weight.requires_grad and out is not None and out.weight is emb.weight


@pytest.mark.parametrize("mode", ["last_block", "all", "lora"])
@pytest.mark.parametrize("arch", list(MODELS))
def test_auto_chooses_one_pass_ghost_with_the_expected_entries(arch, mode, caplog):
    """Every trainable layer of these models is supported: ``auto`` picks ghost; a trainable tied embedding is one
    TiedEmbeddingType entry (the output layer has none of its own); each Llama RMSNorm is matched by name and
    verified; the hooks are what ``--clipping hooks`` gets."""
    model = build(arch, mode, torch.float32)
    entries = GhostClipper.check_supported(model)
    modules = [m for m, _ in entries]
    kind = {id(m): type(t) for m, t in entries}
    tied = _tied_params(model)
    if tied:
        emb = model.get_input_embeddings()
        assert kind[id(emb)] is TiedEmbeddingType
        assert all(m is not model.get_output_embeddings() for m in modules)
    assert not any(isinstance(t, TiedEmbeddingType) for _, t in entries) or tied
    assert tied == (arch != "llama" and mode == "all")  # last_block leaves the vocabulary matrices frozen (hf_dp.models.freezing)
    norms = [m for m in modules if type(m).__name__ == "LlamaRMSNorm"]
    assert bool(norms) == (arch.startswith("llama") and mode != "lora")
    assert all(kind[id(m)] is HFRMSNormType and HFRMSNormType.variant(m) == "weight" for m in norms)
    with caplog.at_level(logging.INFO):
        assert choose_engine("auto", model, optim="dp_sgd", rule_cls=DPSGD, reduced_precision=False) == "ghost"
    assert "chose ghost" in caplog.text
    assert choose_engine("ghost_two_pass", model, optim="dp_sgd", rule_cls=DPSGD, reduced_precision=False) == "ghost_two_pass"
    assert choose_engine("hooks", model, optim="dp_sgd", rule_cls=DPSGD, reduced_precision=False) == "hooks"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("mode", ["last_block", "all", "lora"])
@pytest.mark.parametrize("arch", list(MODELS))
@pytest.mark.parametrize("engine", ENGINES)
def test_clipped_sums_equal_the_per_row_loop(engine, arch, mode, dtype):
    """Per row and per unit (units of 1–4 rows, left padding), the engine's clipped sum is that of the per-row
    autograd gradients; about half the rows (units) are clipped."""
    model = build(arch, mode, dtype)
    batch = make_batch(side="left")
    rtol = 1e-7 if dtype == torch.float64 else 2e-4
    for units in (list(range(len(UNITS))), UNITS):
        clip = median_clip(model, batch, units)
        want, norms, _ = reference(model, batch, units, clip, engine)
        assert bool((norms > 1.01 * clip).any()) and bool((norms < 0.99 * clip).any())
        got = engine_sum(engine, model, batch, units, clip)
        assert_sums_close(got, want, rtol=rtol)
        assert all(g.dtype == dtype for g in got.values())


@pytest.mark.parametrize("arch", list(MODELS))
def test_one_pass_ghost_under_bf16_autocast_keeps_each_unit_within_C(arch):
    """bf16 autocast, every parameter trainable: each unit's clipped contribution (the unit alone in its micro-batch)
    is a float32 vector of norm ≤ C, at C when it is clipped; the batch's sum is the float32 one up to bf16."""
    model = build(arch, "all", torch.float32)
    batch = make_batch(side="right")
    clip = 0.5 * float(reference(model, batch, UNITS, 1e9, "ghost")[1].min())  # every unit is clipped
    for u in range(max(UNITS) + 1):
        idx = [i for i, x in enumerate(UNITS) if x == u]
        one = engine_sum("ghost", model, {k: v[idx] for k, v in batch.items()}, [0] * len(idx), clip, autocast=True)
        assert all(g.dtype == torch.float32 for g in one.values())
        norm = float(flat(one).norm())
        assert clip * (1 - 2e-3) <= norm <= clip * (1 + 1e-6), (u, norm, clip)
    got = engine_sum("ghost", model, batch, UNITS, 1e9, autocast=True)
    ref = engine_sum("ghost", model, batch, UNITS, 1e9)
    assert float((flat(got) - flat(ref)).norm()) <= 0.05 * float(flat(ref).norm())


# ----- RMSNorm matching ----------------------------------------------------------------------------------------
class CenteredRMSNorm(nn.Module):
    """Named like an RMSNorm, but subtracts the mean (a LayerNorm without bias)."""

    def __init__(self, d, eps=1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.variance_epsilon = eps

    def forward(self, x):
        x = x - x.mean(-1, keepdim=True)
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)


class EpsFreeRMSNorm(CenteredRMSNorm):
    """Declares an ε its forward does not use."""

    def forward(self, x):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True))


class GatedRMSNorm(CenteredRMSNorm):
    def forward(self, x, gate):
        return self.weight * x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon) * gate


def _net(norm):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), norm, nn.Tanh(), nn.Linear(6, 2))


@pytest.mark.parametrize("norm,match", [(CenteredRMSNorm(6), "named like an RMSNorm"), (EpsFreeRMSNorm(6), "named like an RMSNorm"),
                                        (GatedRMSNorm(6), "does not support trainable layer")], ids=["centered", "eps_free", "gated"])
def test_a_class_named_rmsnorm_that_computes_something_else_is_refused(norm, match):
    model = _net(norm)
    with pytest.raises(ValueError, match=match):
        GhostClipper.check_supported(model)
    assert choose_engine("auto", model, optim="dp_sgd", rule_cls=DPSGD, reduced_precision=False) == "hooks"


def _gemma_norm(d):
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm

    norm = GemmaRMSNorm(d, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(0.5 * torch.randn(d))
    return norm


def _torch_norm(d):
    norm = nn.RMSNorm(d, eps=None)
    with torch.no_grad():
        norm.weight.copy_(1 + 0.5 * torch.randn(d))
    return norm


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("make,kind,variant", [(_gemma_norm, HFRMSNormType, "one_plus_weight"), (_torch_norm, RMSNormType, None)],
                         ids=["gemma", "torch"])
def test_gemma_and_torch_rmsnorm_are_clipped_exactly(make, kind, variant, two_pass):
    torch.manual_seed(0)
    model = _net(make(6))
    entries = dict(GhostClipper.check_supported(model))
    assert type(entries[model[1]]) is kind
    if variant:
        assert HFRMSNormType.variant(model[1]) == variant
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(6, 5, 4, generator=g), torch.randn(6, 5, 2, generator=g)

    def losses(m, xi, yi):
        return (m(xi) - yi).pow(2).sum((1, 2))

    params = [p for p in model.parameters()]
    per = torch.stack([torch.cat([t.reshape(-1) for t in torch.autograd.grad(losses(model, x[i:i + 1], y[i:i + 1]).sum(), params)])
                       for i in range(6)])
    clip = float(per.norm(dim=1).median())
    want = (per * clip_factors(per.pow(2).sum(1), clip)[:, None]).sum(0)
    m = copy.deepcopy(model)
    gc = GhostClipper(m, bounds=TIGHT, two_pass=two_pass)
    try:
        if two_pass:
            out = gc.two_pass_clipped_sum(losses(m, x, y), clip)
        else:
            losses(m, x, y).sum().backward()
            out = gc.clipped_sum(clip)
    finally:
        gc.detach()
    got = torch.cat([out[p].reshape(-1) for p in m.parameters()])
    # the ghost norms are upper bounds (inflated by their worst-case rounding, ~1e-5 here), so the clip factors may
    # be that much smaller than the exact ones: the sum is within that of Σ_i c_i v_i
    c = clip_factors(per.pow(2).sum(1), clip)
    assert float((got - want).norm()) <= 1e-4 * float((c * per.norm(dim=1)).sum()) + 1e-5 * float(want.norm())


# ----- hooks: Opacus' embedding grad sampler and padding_idx -----------------------------------------------------
def test_hooks_give_the_padding_row_no_gradient_from_the_embedding():
    """A loss that reaches the padding positions (as a left-padded causal LM's does: its first real token is scored
    from the last padding position): autograd gives row ``padding_idx`` no gradient from the embedding, and so do the
    hooks' per-sample gradients — Opacus' own sampler would add the padding positions' output gradients there."""
    from opacus.grad_sample.embedding import compute_embedding_grad_sample

    from hf_dp.clipping.hooks import attach_grad_sampler

    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(10, 4, padding_idx=0), nn.Linear(4, 3))
    ids = torch.tensor([[0, 0, 3, 4], [5, 6, 0, 0], [7, 0, 8, 9]])
    target = torch.randn(3, 4, 3)

    def losses(m, x, y):
        return (m(x) - y).pow(2).sum((1, 2))

    want = torch.stack([torch.autograd.grad(losses(model, ids[i:i + 1], target[i:i + 1]).sum(), model[0].weight)[0] for i in range(3)])
    assert float(want[:, 0].abs().max()) == 0.0
    handle = attach_grad_sampler(model)
    try:
        losses(model, ids, target).sum().backward()
        got = model[0].weight.grad_sample
    finally:
        handle.detach()
    torch.testing.assert_close(got, want)
    # the case arises: Opacus' own sampler puts the padding positions' output gradients into row 0
    g = torch.ones(3, 4, 4)
    assert float(compute_embedding_grad_sample(model[0], [ids], g)[model[0].weight][:, 0].abs().max()) > 0


# ----- tied embeddings: a toy pair with a head bias, padding_idx and a per-coordinate affine map ----------------
class _TiedToy(nn.Module):
    def __init__(self, vocab=9, d=5, bias=True):
        super().__init__()
        self.emb = nn.Embedding(vocab, d, padding_idx=0)
        self.mid = nn.Linear(d, d)
        self.head = nn.Linear(d, vocab, bias=bias)
        self.head.weight = self.emb.weight

    def forward(self, ids):
        return self.head(torch.tanh(self.mid(self.emb(ids))))


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
@pytest.mark.parametrize("kind", ["plain", "affine"])
def test_tied_pair_is_clipped_exactly(kind, two_pass):
    """‖G_e + G_h‖² with the cross term, a head bias of its own, ``padding_idx`` (the padding row gets the head's
    gradient only) and, for ``affine``, a per-coordinate (o, s) on the tied weight: norms and clipped sums equal
    clipping the per-example autograd gradients."""
    torch.manual_seed(0)
    model = _TiedToy()
    entries = dict(GhostClipper.check_supported(model))
    assert type(entries[model.emb]) is TiedEmbeddingType and model.head not in entries
    g = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 9, (6, 7), generator=g)
    ids[:, :2] = 0  # padding, whose output gradient is not zero here
    target = torch.randn(6, 7, 9, generator=g)

    def losses(m, x, y):
        return (m(x) - y).pow(2).sum((1, 2))

    params = list(model.parameters())
    per = [torch.autograd.grad(losses(model, ids[i:i + 1], target[i:i + 1]).sum(), params) for i in range(6)]
    affine = {}
    if kind == "affine":
        w = model.emb.weight
        affine = {w: (0.1 * torch.randn(w.shape, generator=g), 0.5 + torch.rand(w.shape, generator=g)),
                  model.head.bias: (None, 3.0)}

    def v_of(p, t):
        o, s = affine.get(p, (None, None))
        t = t if o is None else t + o
        return t if s is None else t * s
    vec = torch.stack([torch.cat([v_of(p, t).reshape(-1) for p, t in zip(params, gr)]) for gr in per])
    clip = float(vec.norm(dim=1).median())
    c = clip_factors(vec.pow(2).sum(1), clip)
    want = (vec * c[:, None]).sum(0)
    m = copy.deepcopy(model)
    aff = {dict(zip(map(id, params), m.parameters()))[id(p)]: v for p, v in affine.items()}
    gc = GhostClipper(m, bounds=TIGHT, two_pass=two_pass)
    try:
        if two_pass:
            ls = losses(m, ids, target)
            sq = gc.norms_pass(ls, affine=aff)
            c2 = clip_factors(sq, clip)
            (ls * c2).sum().backward()
            out = gc.grads_after_backward(c2, 1.0, affine=aff)
        else:
            losses(m, ids, target).sum().backward()
            sq = gc.per_example_norms(affine=aff).pow(2)
            out = gc.clipped_sum(clip, affine=aff)
    finally:
        gc.detach()
    exact_sq = vec.pow(2).sum(1)
    # upper bounds: their rounding allowance counts both members' calls at the public length (Workspace.bound_layer)
    torch.testing.assert_close(sq.to(exact_sq.dtype), exact_sq, rtol=2e-5, atol=1e-6)
    got = torch.cat([out[p].reshape(-1) for p in m.parameters()])
    # the ghost norms are upper bounds (inflated by their rounding bound, ~1e-6 here), so the clip factors may be
    # that much smaller than the exact ones: the sum is within that of Σ_i c_i v_i
    slack = 1e-5 * float((c * vec.norm(dim=1)).sum())
    assert float((got - want).norm()) <= slack + 1e-5 * float(want.norm())


def test_other_shared_parameters_are_refused_in_one_sentence():
    """An embedding tied to two output layers, or an embedding sharing its table with a non-Linear layer: refused
    with the way out (``--clipping hooks``); ``auto`` takes the hooks."""
    model = _TiedToy()
    model.head2 = nn.Linear(5, 9, bias=False)
    model.head2.weight = model.emb.weight
    with pytest.raises(ValueError, match=r"shared between modules \(emb and head and head2\).*use --clipping hooks"):
        GhostClipper.check_supported(model)
    assert choose_engine("auto", model, optim="dp_sgd", rule_cls=DPSGD, reduced_precision=False) == "hooks"
    other = nn.ModuleDict({"a": nn.Embedding(4, 4), "b": nn.Embedding(4, 4)})
    other["b"].weight = other["a"].weight
    with pytest.raises(ValueError, match="only an nn.Embedding whose weight is also an nn.Linear's weight"):
        GhostClipper.check_supported(other)
