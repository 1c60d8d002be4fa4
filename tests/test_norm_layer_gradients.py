"""One-pass ghost clipping computes no autograd gradient for the normalisation layers' own parameters (LayerNorm,
``torch.nn.RMSNorm``, transformers' per-family RMSNorm): their per-example gradients come from the records, so the
weight-gradient products autograd would form are waste — and under FSDP2 each such gradient is one more
reduce-scatter per unit per micro-batch (``tests/test_fsdp.py`` counts none). The clipped sums still equal the
per-example loop, also when the layer's input needs no gradient (a trainable norm after frozen layers), and the
layer's output is the same as without ghost clipping."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_dp.clipping import GhostClipper, clip_factors


def _llama_rmsnorm(d):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    return LlamaRMSNorm(d, eps=1e-6)


NORMS = {"layernorm": lambda d: nn.LayerNorm(d), "torch_rmsnorm": lambda d: nn.RMSNorm(d, eps=1e-6), "llama_rmsnorm": _llama_rmsnorm}


def _model(norm, frozen_input=False):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 6), NORMS[norm](6), nn.Tanh(), nn.Linear(6, 2)).double()
    with torch.no_grad():  # weights away from their initial 1 / 0, so every term matters
        for p in model[1].parameters():
            p.add_(torch.randn_like(p) * 0.3)
    if frozen_input:  # the norm's input needs no gradient: only the norm (and the head) train
        model[0].requires_grad_(False)
    return model


def _data(b=6, t=5):
    g = torch.Generator().manual_seed(1)
    return torch.randn(b, t, 4, generator=g, dtype=torch.float64), torch.randn(b, t, 2, generator=g, dtype=torch.float64)


def _losses(model, x, y):
    return (model(x) - y).pow(2).sum((1, 2))


def _reference(model, x, y, clip):
    params = [p for p in model.parameters() if p.requires_grad]
    per = torch.stack([torch.cat([g.reshape(-1) for g in torch.autograd.grad(_losses(model, x[i : i + 1], y[i : i + 1]).sum(), params)])
                       for i in range(x.shape[0])])
    c = clip_factors(per.pow(2).sum(1), clip)
    flat = (per * c[:, None]).sum(0)
    return dict(zip(params, flat.split([p.numel() for p in params]))), per.norm(dim=1)


@pytest.mark.parametrize("frozen_input", [False, True], ids=["input_with_grad", "input_without_grad"])
@pytest.mark.parametrize("norm", list(NORMS))
def test_one_pass_leaves_the_norm_parameters_without_autograd_gradients_and_clips_exactly(norm, frozen_input):
    model = _model(norm, frozen_input)
    x, y = _data()
    _, norms_ref = _reference(model, x, y, 1e9)
    clip = float(norms_ref.median())
    ref, _ = _reference(model, x, y, clip)
    with torch.no_grad():
        plain = model(x)
    gc = GhostClipper(model)
    try:
        out = model(x)
        torch.testing.assert_close(out, plain, rtol=0, atol=0)  # the same forward
        assert out.requires_grad
        (out - y).pow(2).sum((1, 2)).sum().backward()
        norm_params = list(model[1].parameters())
        assert norm_params and all(p.grad is None for p in norm_params), "autograd computed the norm layer's gradient"
        torch.testing.assert_close(gc.per_example_norms(), norms_ref, rtol=1e-6, atol=1e-9)
        got = gc.clipped_sum(clip)
    finally:
        gc.detach()
    assert set(got) == set(ref)
    for p, r in ref.items():
        torch.testing.assert_close(got[p].reshape(-1), r, rtol=1e-6, atol=1e-9)
    assert all(p.requires_grad for p in model[1].parameters())  # the parameters themselves are untouched


@pytest.mark.parametrize("norm", list(NORMS))
def test_outside_training_and_after_detach_the_norm_is_its_own_forward(norm):
    model = _model(norm)
    x, _ = _data()
    with torch.no_grad():
        plain = model(x)
    gc = GhostClipper(model)
    try:
        model.eval()
        out = model(x)  # eval: the layer's own forward, gradients as usual
        torch.testing.assert_close(out, plain, rtol=0, atol=0)
        out.sum().backward()
        assert all(p.grad is not None for p in model[1].parameters())
        assert not any(layer.records for layer in gc.layers)
    finally:
        gc.detach()
    model.train()
    model.zero_grad(set_to_none=True)
    model(x).sum().backward()  # instrumentation removed: autograd's gradients again
    assert all(p.grad is not None for p in model[1].parameters())
    assert "forward" not in model[1].__dict__


def test_a_model_under_a_dptrainer_trains_as_usual_outside_its_training_steps(tmp_path):
    """DPTrainer's one-pass ghost clipping records (and skips autograd's weight gradients of linear, embedding and
    normalisation layers) only inside its training_step: the same model object differentiated anywhere else — a
    plain Trainer, a --disable_dp baseline, a user's own loop, before or after train() — gets every gradient."""
    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)
    collate = make_collator(tok)
    model = make_model()
    trainer = DPTrainer(model=model, args=dp_args(tmp_path / "run", trainable="all", clipping="ghost", max_steps=2,
                                                  per_device_train_batch_size=8, logging_steps=1),
                        train_dataset=ds, data_collator=collate)
    assert trainer.clipping == "ghost"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]

    def plain_backward():
        model.train()
        model.zero_grad(set_to_none=True)
        batch = collate([ds[i] for i in range(4)])
        batch.pop("labels")
        model(**batch).logits.sum().backward()
        missing = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
        model.zero_grad(set_to_none=True)
        return missing

    assert trainable and plain_backward() == []
    trainer.train()  # the DP steps record as before
    assert trainer.state.global_step == 2 and trainer.ledger.steps == 2
    assert plain_backward() == []
