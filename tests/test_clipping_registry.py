"""The layer registry is ghost clipping's single source of truth: a layer type registered from outside the package
(here, a toy element-wise scale layer) becomes supported — ``check_supported`` accepts it, ``--clipping auto`` picks
ghost, its records and terms come from the registered entry, the clipped sum equals the per-example loop — and is
refused again once unregistered."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_dp.clipping.common import TokenBounds
from hf_dp.clipping import GhostClipper, choose_engine, clip_factors, layer_type_for, register_layer, registered_layers, unregister_layer
from hf_dp.clipping.common import affine_of, cat_records, dense_sq
from hf_dp.clipping.registry import GhostLayerType



#: the public token bounds of these small batches (tight: the rounding allowance of the exact comparisons stays tiny)
TIGHT = TokenBounds(max_length=5, max_tokens=30)

class Scale(nn.Module):
    """y = x ⊙ w + b over the last axis: a trainable layer type ghost clipping does not ship."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(d))
        self.bias = nn.Parameter(torch.randn(d))

    def forward(self, x):
        return x * self.weight + self.bias


class ScaleType(GhostLayerType):
    """Per example: ∇w = Σ_t g_t ⊙ x_t, ∇b = Σ_t g_t (the default instrumentation records (x, g) per call)."""

    name = "scale"
    calls = 0

    def terms(self, layer, scale, affine, dt, work):
        type(self).calls += 1
        m = layer.module
        x, g = cat_records(layer.records, scale, dt)
        gw, gb = (g * x.to(dt)).sum(1), g.sum(1)
        sq = dense_sq(gw, *affine_of(affine, m.weight, dtype=dt)) + dense_sq(gb, *affine_of(affine, m.bias, dtype=dt))

        def clipped(c):
            c = c.to(dt).view(-1, 1)
            return {m.weight: (gw * c).sum(0).to(m.weight.dtype), m.bias: (gb * c).sum(0).to(m.bias.dtype)}

        return sq, clipped


class _GhostRule:  # what choose_engine asks of the update rule
    @staticmethod
    def ghost_compatible():
        return True


@pytest.fixture
def registered():
    assert Scale not in registered_layers()
    register_layer(Scale)(ScaleType)
    ScaleType.calls = 0
    try:
        yield
    finally:
        unregister_layer(Scale)
    assert Scale not in registered_layers()


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), Scale(6), nn.Tanh(), nn.Linear(6, 2))


def _data(b=6, t=5):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, t, 4, generator=g), torch.randn(b, t, 2, generator=g)


def _losses(model, x, y):
    return (model(x) - y).pow(2).sum((1, 2))  # one loss per example


def _reference(model, x, y, clip):
    """Σ_i min(1, C/(‖g_i‖·(1 + 1e-5) + 1e-6)) g_i from one backward per example."""
    params = [p for p in model.parameters() if p.requires_grad]
    per = []
    for i in range(x.shape[0]):
        grads = torch.autograd.grad(_losses(model, x[i : i + 1], y[i : i + 1]).sum(), params)
        per.append(torch.cat([g.reshape(-1) for g in grads]))
    per = torch.stack(per)
    c = clip_factors(per.pow(2).sum(1), clip)
    flat = (per * c[:, None]).sum(0)
    out, offset = {}, 0
    for p in params:
        out[p] = flat[offset : offset + p.numel()].view_as(p)
        offset += p.numel()
    return out, per.norm(dim=1)


def test_an_unregistered_layer_type_is_refused():
    with pytest.raises(ValueError, match=r"ghost clipping does not support trainable layer 1 \(Scale\)"):
        GhostClipper.check_supported(_model())
    name = choose_engine("auto", _model(), optim="dp_sgd", rule_cls=_GhostRule, reduced_precision=False)
    assert name == "hooks"


@pytest.mark.parametrize("two_pass", [False, True], ids=["one_pass", "two_pass"])
def test_a_registered_layer_type_is_clipped_like_the_per_example_loop(registered, two_pass):
    model = _model()
    entries = dict(GhostClipper.check_supported(model))
    assert isinstance(entries[model[1]], ScaleType) and layer_type_for(model[1]) is entries[model[1]]
    assert choose_engine("ghost", model, optim="dp_sgd", rule_cls=_GhostRule, reduced_precision=False) == "ghost"
    x, y = _data()
    _, norms_ref = _reference(model, x, y, 1e9)
    clip = float(norms_ref.median())  # about half the examples are clipped
    ref, _ = _reference(model, x, y, clip)
    gc = GhostClipper(model, bounds=TIGHT, two_pass=two_pass)
    try:
        if two_pass:
            got = gc.two_pass_clipped_sum(_losses(model, x, y), clip)
        else:
            (_losses(model, x, y).sum() * 0.5).backward()
            torch.testing.assert_close(gc.per_example_norms(0.5), norms_ref, rtol=1e-5, atol=1e-6)
            got = gc.clipped_sum(clip, loss_scale=0.5)
    finally:
        gc.detach()
    assert ScaleType.calls > 0  # the terms came from the registered entry
    assert set(got) == set(ref)
    # the ghost norms are upper bounds (inflated by their worst-case rounding, ~1e-5 here), so the clip factors may be
    # that much smaller than the exact ones: the sum is within that of Σ_i c_i ∇ℓ_i
    c = clip_factors(norms_ref.pow(2), clip)
    diff = sum(float((got[p] - r).pow(2).sum()) for p, r in ref.items()) ** 0.5
    assert diff <= 1e-4 * float((c * norms_ref).sum()) + 1e-5 * sum(float(r.pow(2).sum()) for r in ref.values()) ** 0.5


def test_unregistering_makes_the_type_unsupported_again():
    register_layer(Scale)(ScaleType)
    try:
        assert isinstance(layer_type_for(Scale(3)), ScaleType)
        GhostClipper(_model()).detach()
    finally:
        unregister_layer(Scale)
    assert layer_type_for(Scale(3)) is None
    with pytest.raises(ValueError, match="does not support trainable layer"):
        GhostClipper(_model())
