"""Ghost norms are upper bounds: no example contributes more than C, whatever its records.

The per-layer squared norms come from float32 records (inputs and loss-scaled output gradients). Two ways they used
to come out short of the exact norm, letting an example through with c_i·‖G_i‖ > C:

* the loss scale s stays in the records and is undone once at the end, so with s ≪ 1 the squares of the output
  gradients (∝ s²) underflow to 0 in float32 while the clipped sum f(c/s) does not;
* the Gram form Σ_{t,s} (a_t·a_s)(g_t·g_s) sums terms of both signs whose float32 error is relative to
  (Σ_t ‖a_t‖‖g_t‖)², not to the result: one input repeated with output gradients of alternating sign cancels it to
  (nearly) 0.

The property test draws adversarial records (magnitudes from 1e-20 to 1e18, repeated inputs, alternating gradients,
loss scales 1e-6..1e6) and checks c_i·‖G_i‖ ≤ C for G_i recomputed in float64 from the same records, for every norm
path: linear Gram form (narrow and chunked-wide), linear per-example gradients materialised for the norm only and for
norm and sum, embedding, LayerNorm.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from hf_dp.clipping.ghost import GhostClipper, clip_factors

C = 1.0


def _norm(out: dict) -> float:
    return torch.sqrt(sum(v.double().pow(2).sum() for v in out.values())).item()


@pytest.mark.parametrize("scale,x_mag", [(6e-5, 1e18), (1e-6, 5e18)])
@pytest.mark.parametrize("affine", [False, True], ids=["plain", "identity_affine"])
def test_a_tiny_loss_scale_cannot_lift_an_example_above_C(affine, scale, x_mag):
    """A trainable Linear on attacker-sized features (~1e18) followed by LayerNorm (gradient ∝ 1/|x|): the records'
    output gradients are ~s·1e-18, their float32 squares underflow; one example still contributes ≤ C (the
    identity affine map takes the path that divides the records by s first)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.LayerNorm(8, elementwise_affine=False), nn.Linear(8, 3))
    model[2].requires_grad_(False)
    clip = GhostClipper(model)
    x = torch.randn(1, 4, 8) * x_mag  # one example, 4 tokens (Gram form)
    (model(x).sum() * scale).backward()
    out = clip.clipped_sum(C, loss_scale=scale, affine={model[0].weight: (None, 1.0)} if affine else None)
    assert _norm(out) <= C * (1 + 1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_gram_cancellation_cannot_lift_an_example_above_C(seed):
    """One input repeated (up to 1e-3 noise) with output gradients of alternating sign, ‖a_t‖‖g_t‖ ≈ 250·C per
    token: the float32 Gram form cancels to (nearly) nothing; the contribution stays ≤ C."""
    torch.manual_seed(seed)
    d, T = 256, 128
    lin = nn.Linear(d, d, bias=False)
    clip = GhostClipper(nn.Sequential(lin))
    a = torch.randn(d)
    x = (a + 1e-3 * torch.randn(T, d)).unsqueeze(0)
    u = torch.randn(d)
    w = torch.tensor([(-1.0) ** t for t in range(T)]) + 1e-2 * torch.randn(T)
    (lin(x) @ u * w).sum().backward()
    assert _norm(clip.clipped_sum(C)) <= C * (1 + 1e-6)


# ----- property test: every norm path, adversarial records ------------------------------------------------------
def _exact_sq(kind: str, module: nn.Module, records: list, scale: float) -> torch.Tensor:
    """‖G_i‖² [B] in float64 from the layer's records (one call), the loss scale divided out exactly."""
    x, g = records[0][0], records[0][1].double() / scale
    if kind == "embedding":
        G = torch.zeros(g.shape[0], module.num_embeddings, g.shape[-1], dtype=torch.float64)
        for i in range(g.shape[0]):
            G[i].index_add_(0, x[i], g[i])
        return G.pow(2).sum((1, 2))
    if kind == "layernorm":  # the layer's own (float32) normalised input, as autograd uses it
        xhat = F.layer_norm(x, module.normalized_shape, eps=module.eps).double()
        return (g * xhat).sum(1).pow(2).sum(1) + g.sum(1).pow(2).sum(1)
    sq = torch.einsum("bto,bti->boi", g, x.double()).pow(2).sum((1, 2))
    return sq + g.sum(1).pow(2).sum(1) if module.bias is not None else sq


CASES = {  # kind, module factory, tokens, materialize_bytes
    "linear_gram": ("linear", lambda: nn.Linear(16, 12), 8, 0),
    "linear_gram_wide": ("linear", lambda: nn.Linear(300, 280, bias=False), 16, 0),
    "linear_materialised_norms": ("linear", lambda: nn.Linear(4, 3), 32, 0),
    "linear_materialised_sum": ("linear", lambda: nn.Linear(16, 12), 8, 1 << 20),
    "embedding": ("embedding", lambda: nn.Embedding(5, 16), 12, 0),
    "layernorm": ("layernorm", lambda: nn.LayerNorm(16), 8, 0),
}


def _draw(gen: torch.Generator, kind: str, module: nn.Module, B: int, T: int):
    """(layer input, output-gradient weights W) of one adversarial micro-batch: per example a magnitude, inputs one
    vector repeated with little or no noise (or independent), W one direction with alternating signs (or random)."""
    def pick(options):
        return options[int(torch.randint(len(options), (1,), generator=gen))]

    def mags(lo, hi):
        return 10 ** torch.empty(B, 1, 1).uniform_(lo, hi, generator=gen)

    if kind == "embedding":
        x = torch.randint(0, pick([1, 2, 5]), (B, T), generator=gen)
        d_out = module.embedding_dim
    else:
        d = module.in_features if kind == "linear" else module.normalized_shape[0]
        noise = pick([0.0, 1e-6, 1e-3, 1.0])
        x = (torch.randn(B, 1, d, generator=gen) + noise * torch.randn(B, T, d, generator=gen)) * mags(-20, 18)
        if kind == "layernorm":
            x = x + pick([0.0, 1e4]) * x.abs().amax((1, 2), keepdim=True)  # a large common offset
        d_out = module.out_features if kind == "linear" else d
    signs = torch.tensor([(-1.0) ** t for t in range(T)]).view(1, T, 1)
    if pick([True, False]):
        W = torch.randn(B, 1, d_out, generator=gen) * (signs + pick([0.0, 1e-3, 1e-2]) * torch.randn(B, T, 1, generator=gen))
    else:
        W = torch.randn(B, T, d_out, generator=gen)
    return x, W * mags(-25, 15)


@pytest.mark.parametrize("case", list(CASES))
def test_every_example_contributes_at_most_C(case):
    kind, factory, T, materialize = CASES[case]
    gen = torch.Generator().manual_seed(sum(map(ord, case)))
    torch.manual_seed(0)
    module = factory()
    clip = GhostClipper(nn.Sequential(module), materialize_bytes=materialize)
    try:
        for _ in range(40):
            scale = float(10 ** torch.empty(()).uniform_(-6, 6, generator=gen))
            x, W = _draw(gen, kind, module, 3, T)
            (module(x) * W).sum().mul(scale).backward()
            exact = _exact_sq(kind, module, clip.layers[0].records, scale)
            sq, _ = clip._collect(scale)  # the norms clipped_sum uses
            c = clip_factors(sq, C).double()
            worst = (c * exact.sqrt()).nan_to_num(0.0)  # c_i = 0 for an overflowing example
            assert bool((worst <= C * (1 + 1e-6)).all()), (scale, worst.tolist())
            clip.clear()
    finally:
        clip.detach()


def test_hooks_norms_are_not_short_of_the_exact_ones():
    """Opacus' materialised per-sample gradients: one large entry among many small ones, whose float32 squares a
    float32 norm partly loses (its accumulator holding ~1 drops 1e-8's), so c_i = C/‖v_i‖ came out too large."""
    from hf_dp.optim import make_optimizer

    n = 1 << 22
    p = nn.Parameter(torch.zeros(n))
    opt = make_optimizer("dp_sgd", [p], noise_multiplier=0.0, max_grad_norm=0.5, expected_batch_size=1.0, lr=0.1)
    gs = torch.full((1, n), 1e-4)
    gs[0, 0] = 1.0
    p.grad_sample = gs
    assert opt.accumulate() == 1
    assert p.summed_grad.double().norm().item() <= 0.5 * (1 + 1e-6)


def test_norms_use_full_float32_matmuls_under_tf32(monkeypatch):
    """The rounding bounds assume float32's unit roundoff: with TF32 (or bf16 passes) allowed for float32 matmuls
    (``--tf32``, ``torch.set_float32_matmul_precision("high")``), the ghost norms still run at "highest"."""
    import hf_dp.clipping.linear as linear

    seen = []
    real = linear.gram64

    def spy(x):
        seen.append((torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32))
        return real(x)

    monkeypatch.setattr(linear, "gram64", spy)
    before = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")
    try:
        lin = nn.Linear(8, 8)
        clip = GhostClipper(nn.Sequential(lin))
        lin(torch.randn(2, 3, 8)).sum().backward()
        clip.clipped_sum(C)
        assert torch.get_float32_matmul_precision() == "high"  # restored
    finally:
        torch.set_float32_matmul_precision(before)
    assert seen and all(s == ("highest", False) for s in seen)
