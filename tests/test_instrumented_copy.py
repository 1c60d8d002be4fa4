"""A copy of a model a DPTrainer instrumented is a model of its own (issue 49, item 5).

On 72a3f42 ghost clipping's forward patches bound the original module (``_m=m`` in ``linear.py``, ``embedding.py``
and ``registry.without_parameter_gradients``): ``copy.deepcopy`` of an instrumented model computed with the
original's weights (its logits 1.27 off a clean model with the copy's weights), a plain backward on the copy left
its parameters without gradients and put them on the original's, and ``torch.save(model)`` failed on the local
functions the engines install. Here, for every engine on a tiny BERT and a tiny GPT-2 (tied embeddings): the copy's
logits are a clean model's with the copy's weights, a plain backward gives the copy's parameters the plain autograd
gradients and leaves the original's untouched, the original still trains under its DPTrainer, and ``torch.save``
of the instrumented model (and of the copy) writes a model that loads and computes as a clean one."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from datasets import Dataset
from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel

from hf_dp import DPTrainer
from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")

ENGINES = ("ghost", "ghost_two_pass", "hooks")


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def _gpt2(tok):
    torch.manual_seed(0)
    cfg = GPT2Config(vocab_size=len(tok), n_positions=64, n_embd=16, n_layer=2, n_head=2, resid_pdrop=0.0,
                     embd_pdrop=0.0, attn_pdrop=0.0, pad_token_id=tok.pad_token_id, bos_token_id=tok.cls_token_id,
                     eos_token_id=tok.sep_token_id)
    return GPT2LMHeadModel(cfg)


def _lm_data(tok, n=48):
    g = torch.Generator().manual_seed(0)
    rows = [[tok.cls_token_id] + torch.randint(5, len(tok), (int(torch.randint(3, 12, (1,), generator=g)),),
                                               generator=g).tolist() + [tok.sep_token_id] for _ in range(n)]
    return Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})


def _setup(arch, tok, clipping, out):
    """(DPTrainer with ``clipping`` attached to a fresh model, a training batch, a clean model factory)."""
    if arch == "bert":
        ds, collate, fresh = make_pair_dataset(tok, n=64), make_collator(tok), make_model
    else:
        tok.padding_side = "right"
        ds, collate, fresh = _lm_data(tok), DataCollatorForLanguageModeling(tok, mlm=False), lambda: _gpt2(tok)
    args = dp_args(out, trainable="all", clipping=clipping, max_steps=1, epsilon=None, noise_multiplier=1.0,
                   per_device_train_batch_size=8, logging_steps=100)
    trainer = DPTrainer(model=fresh(), args=args, train_dataset=ds, data_collator=collate)
    assert trainer.clipping == clipping
    return trainer, collate([ds[i] for i in range(6)]), fresh


def _clean_like(fresh, model):
    clean = fresh()
    clean.load_state_dict(model.state_dict())
    return clean


def _plain_grads(model, batch):
    model.zero_grad(set_to_none=True)
    model.train()
    model(**batch).loss.backward()
    return {n: p.grad for n, p in model.named_parameters()}


def _check_is_its_own_model(copied, original, fresh, batch):
    """The copy computes with its own weights and gets the plain autograd gradients; the original gets none."""
    with torch.no_grad():  # the copy's weights made to differ from the original's
        for p in copied.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    clean = _clean_like(fresh, copied)
    for m in (copied, clean):
        m.train()  # training mode, gradients on: where the instrumentation records
    got, want = copied(**batch).logits, clean(**batch).logits
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), float((got - want).abs().max())
    original.zero_grad(set_to_none=True)
    grads, clean_grads = _plain_grads(copied, batch), _plain_grads(clean, batch)
    for name, g in grads.items():
        assert g is not None, f"{name}: the copy's parameter got no gradient"
        assert torch.allclose(g, clean_grads[name], atol=1e-6, rtol=1e-4), name
    assert all(p.grad is None for p in original.parameters()), "the copy's backward reached the original"
    assert not any(hasattr(p, "grad_sample") and p.grad_sample is not None for p in copied.parameters())


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
@pytest.mark.parametrize("clipping", ENGINES)
def test_a_deepcopy_of_an_instrumented_model_is_its_own_model(arch, clipping, tok, tmp_path):
    trainer, batch, fresh = _setup(arch, tok, clipping, tmp_path / "out")
    original = trainer.model
    before = {n: p.detach().clone() for n, p in original.named_parameters()}
    copied = copy.deepcopy(original)
    _check_is_its_own_model(copied, original, fresh, batch)
    assert all(torch.equal(p, before[n]) for n, p in original.named_parameters())
    # a plain Trainer-like loop on the copy trains every one of its parameters
    opt = torch.optim.SGD(copied.parameters(), lr=0.1)
    start = {n: p.detach().clone() for n, p in copied.named_parameters()}
    _plain_grads(copied, batch)
    opt.step()
    assert all(not torch.equal(p, start[n]) for n, p in copied.named_parameters() if p.grad is not None and p.grad.any())
    assert sum(not torch.equal(p, start[n]) for n, p in copied.named_parameters()) > 0.9 * len(start)
    assert all(torch.equal(p, before[n]) for n, p in original.named_parameters())
    # the original still trains under its DPTrainer, the copy's use having left nothing in its step
    trainer.train()
    assert trainer.ledger.steps == 1
    assert any(not torch.equal(p, before[n]) for n, p in original.named_parameters())
    # and a copy made after training is its own model too
    _check_is_its_own_model(copy.deepcopy(original), original, fresh, batch)


@pytest.mark.parametrize("arch", ["bert", "gpt2"])
@pytest.mark.parametrize("clipping", ENGINES)
def test_torch_save_of_an_instrumented_model_loads_as_a_plain_model(arch, clipping, tok, tmp_path):
    trainer, batch, fresh = _setup(arch, tok, clipping, tmp_path / "out")
    original = trainer.model
    for model in (original, copy.deepcopy(original)):
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        _check_is_its_own_model(loaded, original, fresh, batch)
    trainer.train()  # saving it left the original instrumented
    assert trainer.ledger.steps == 1
    # trained, the model carries its ledger (hf_dp.run.lineage): a saved copy keeps it, as a deep copy does
    buf = io.BytesIO()
    torch.save(original, buf)
    buf.seek(0)
    for loaded in (torch.load(buf, weights_only=False), copy.deepcopy(original)):
        _check_is_its_own_model(loaded, original, fresh, batch)
        again = DPTrainer(model=loaded, args=trainer.args, train_dataset=trainer.train_dataset,
                          data_collator=trainer.data_collator)
        assert again.ledger.steps == 1


@pytest.mark.parametrize("clipping", ENGINES)
def test_a_copy_records_nothing_for_the_originals_engine_and_takes_an_engine_of_its_own(clipping, tok, tmp_path):
    """The copy's forward and backward while the original's engine records (inside a DP step) leave nothing in that
    engine (no records, no per-sample gradients), and a DPTrainer on the copy instruments and trains it afresh (on
    72a3f42 the hooks engine refused it: 'A grad sampler is already attached')."""
    trainer, batch, fresh = _setup("bert", tok, clipping, tmp_path / "out")
    original = trainer.model
    copied = copy.deepcopy(original)
    engine = trainer.clipping_engine
    with engine.active(trainer.create_optimizer()):
        grads = _plain_grads(copied, batch)
        if engine.clipper is not None:
            assert all(not layer.records and not layer.calls for layer in engine.clipper.layers)
        assert all(getattr(p, "grad_sample", None) is None and p.grad is None for p in original.parameters())
    clean_grads = _plain_grads(_clean_like(fresh, copied), batch)
    assert all(torch.allclose(g, clean_grads[n], atol=1e-6, rtol=1e-4) for n, g in grads.items())
    copied.zero_grad(set_to_none=True)
    ds, collate = trainer.train_dataset, trainer.data_collator
    args = dp_args(tmp_path / "copy", trainable="all", clipping=clipping, max_steps=2, epsilon=None,
                   noise_multiplier=1.0, per_device_train_batch_size=8, logging_steps=100)
    second = DPTrainer(model=copied, args=args, train_dataset=ds, data_collator=collate)
    before = {n: p.detach().clone() for n, p in copied.named_parameters()}
    kept = {n: p.detach().clone() for n, p in original.named_parameters()}
    second.train()
    assert second.ledger.steps == 2
    assert any(not torch.equal(p, before[n]) for n, p in copied.named_parameters())
    assert all(torch.equal(p, kept[n]) for n, p in original.named_parameters())
