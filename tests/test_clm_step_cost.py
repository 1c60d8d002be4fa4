"""The cost of a causal LM's DP step (issue 41): what the per-example loss and the ghost clipping of a tied LM head
allocate, counted op by op (no timing): neither makes a tensor the size of the logits beyond what the model's own
loss makes, so the DP step's extra work over a non-private one is the ghost norms' Gram products, not copies of the
[B, T, vocab] logits or of their gradient. The values stay exact (the ghost tests compare them with per-example
references)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from hf_dp.clipping import GhostClipper
from hf_dp.models.loss import causal_lm_loss, token_cross_entropy
import transformers as T


class _BigOutputs(TorchDispatchMode):
    """Records the ops that write a new tensor of at least ``numel`` elements (views of their inputs not counted)."""

    def __init__(self, numel: int):
        super().__init__()
        self.numel, self.ops = numel, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        inputs = {t.untyped_storage().data_ptr() for t in (*args, *kwargs.values()) if torch.is_tensor(t)}
        if any(torch.is_tensor(o) and o.numel() >= self.numel and o.untyped_storage().data_ptr() not in inputs for o in outs):
            self.ops.append(str(func))
        return out


def _logits_sized_ops(loss_fn, logits, labels):
    z = logits.clone().requires_grad_()
    with _BigOutputs(logits.numel()) as mode:
        loss_fn(z, labels).sum().backward()
    return mode.ops


def _models_own_loss(logits, labels):  # transformers' ForCausalLMLoss, per token (the shift, then flat rows)
    shift = F.pad(labels, (0, 1), value=-100)[:, 1:]
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), shift.reshape(-1), ignore_index=-100, reduction="none")


def test_the_per_example_causal_lm_loss_writes_one_logits_sized_tensor():
    """Before issue 41 the loss ran on a [B, vocab, T] view: one copy of the logits forward and one of their gradient
    backward (about twice the LM head's own time on CPU, and the LoRA DP step's whole extra cost) on top of the three
    logits-sized tensors of the model's own loss (log-softmax, the NLL's gradient, the log-softmax's gradient). Now the
    gradient of the logits is the only one (the forward keeps a log-sum-exp per token)."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 12, 50, generator=g)
    labels = torch.randint(0, 50, (4, 12), generator=g)
    labels[1, 8:] = -100
    ours = _logits_sized_ops(causal_lm_loss, logits, labels)
    own = _logits_sized_ops(_models_own_loss, logits, labels)
    assert len(ours) == 1 and len(own) == 3, (ours, own)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_token_cross_entropy_equals_torchs_values_and_gradients(dtype):
    """Values and gradients of :func:`token_cross_entropy` are F.cross_entropy's (ignore_index -100, no reduction),
    for large and ignored logits too; without a graph it is F.cross_entropy itself."""
    g = torch.Generator().manual_seed(3)
    z = (torch.randn(37, 29, generator=g, dtype=torch.float64) * 30).to(dtype)  # rows over several chunks, large logits
    y = torch.randint(0, 29, (37,), generator=g)
    y[[0, 5, 36]] = -100
    w = torch.rand(37, generator=g, dtype=dtype)
    a, b = z.clone().requires_grad_(), z.clone().requires_grad_()
    ours = token_cross_entropy(a, y)
    ref = F.cross_entropy(b, y, ignore_index=-100, reduction="none")
    (ours * w).sum().backward()
    (ref * w).sum().backward()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(ours, ref, **tol)
    torch.testing.assert_close(a.grad, b.grad, **tol)
    assert bool((ours[[0, 5, 36]] == 0).all()) and bool((a.grad[[0, 5, 36]] == 0).all())
    torch.testing.assert_close(token_cross_entropy(z, y), F.cross_entropy(z, y, ignore_index=-100, reduction="none"))


def test_ghost_clipping_of_a_tied_lm_head_makes_no_logits_sized_tensor():
    """After the backward, the norms and the clipped sum of GPT-2 with its embedding tied to the LM head read the
    head's recorded output gradient [B, T, vocab] (its Gram products and one matmul) but write nothing of its size:
    no division by the loss scale (undone once on the [B] norms and the clip factors), no c-weighted copy of it (c
    goes into the head's input), no per-example gradients materialised ([B, vocab, d], as large when T = d: the Gram
    products cost as many multiply-adds and ran 2-3x faster)."""
    torch.manual_seed(0)
    V, B, L = 1000, 4, 16  # L = n_embd
    model = T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=16, n_layer=1, n_head=2, n_positions=L, resid_pdrop=0.0,
                                           embd_pdrop=0.0, attn_pdrop=0.0)).train()
    clipper = GhostClipper(model)
    ids = torch.randint(0, V, (B, L), generator=torch.Generator().manual_seed(1))
    logits = model(input_ids=ids).logits
    (causal_lm_loss(logits, ids).sum() * 0.25).backward()  # a loss scale, as DPTrainer's 1/B
    with _BigOutputs(B * L * V) as mode:
        out = clipper.clipped_sum(1.0, loss_scale=0.25)
    assert mode.ops == []
    assert model.transformer.wte.weight in out
