"""Precision: every clipping engine under bf16 autocast (norms and clipped sums in float32), float64 models and a
float64 default dtype (norms and sums in float64), fp16 refused, and ``--clipping auto`` saying what it chose.

Each test here failed on cb9584a: ghost clipping crashed under bf16 autocast (``expected m1 and m2 to have the
same dtype``) and under ``torch.set_default_dtype(torch.float64)`` (``index_add_``: Float vs Double), computed a
float64 model's norms and sums in float32, Opacus hooks clipped bf16 per-sample gradients with a norm rounded to
bf16 (up to 0.8% over C), and ``--clipping auto`` chose its engine silently.
"""

from __future__ import annotations

import math
import copy
import logging

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from hf_dp.models import apply_trainable
from hf_dp.clipping.ghost import NORM_MARGIN, GhostClipper
from hf_dp.optim import make_optimizer
from tests.test_models import _batch, _config, _model, _per_example_grads

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


@pytest.fixture(autouse=True, scope="module")
def _one_thread(single_thread):
    yield


@pytest.fixture
def float64_default():
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def _ghost_sum(model, ids, mask, labels, clip, autocast=False):
    gc = GhostClipper(model)
    try:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            logits = model(input_ids=ids, attention_mask=mask).logits
        F.cross_entropy(logits.float() if autocast else logits, labels, reduction="sum").backward()
        out = gc.clipped_sum(clip)
    finally:
        gc.detach()
    names = {id(p): n for n, p in model.named_parameters()}
    return {names[id(p)]: g for p, g in out.items()}


@pytest.mark.parametrize("arch,mode", [("bert", "all"), ("gpt2", "all"), ("bert", "last_block")])
def test_ghost_under_bf16_autocast_clips_in_float32(arch, mode):
    """Each example's clipped contribution is a float32 vector of norm ≤ C, and the sum is the float32 one up to bf16."""
    config = _config(arch)
    model, _ = apply_trainable(_model(arch), mode)
    model.train()
    ids, mask, labels = _batch(config, batch_size=4, seq_len=7)
    ref = _ghost_sum(copy.deepcopy(model), ids, mask, labels, 1e9)  # float32, unclipped
    clip = 0.5 * min(torch.sqrt(sum(g.pow(2).sum() for g in _ghost_sum(copy.deepcopy(model), ids[i:i + 1], mask[i:i + 1], labels[i:i + 1], 1e9).values())).item() for i in range(4))
    for i in range(4):  # a batch of one: the clipped sum is that example's clipped gradient
        one = _ghost_sum(model, ids[i:i + 1], mask[i:i + 1], labels[i:i + 1], clip, autocast=True)
        assert all(g.dtype == torch.float32 for g in one.values())
        norm = torch.sqrt(sum(g.double().pow(2).sum() for g in one.values())).item()
        assert norm <= clip * (1 + 1e-6)
        assert norm >= clip * (1 - 1e-3)  # clipped, so at C (within the margin)
    got = _ghost_sum(model, ids, mask, labels, 1e9, autocast=True)
    assert set(got) == set(ref)
    flat = lambda d: torch.cat([d[n].reshape(-1) for n in sorted(d)])  # noqa: E731
    assert (flat(got) - flat(ref)).norm() <= 0.05 * flat(ref).norm()  # bf16 forward/backward, float32 sums


def _float64_check(model, config):
    model.train()
    ids, mask, labels = _batch(config, batch_size=4, seq_len=7)
    per = _per_example_grads(copy.deepcopy(model), ids, mask, labels)
    norms = torch.stack([g.reshape(g.shape[0], -1).pow(2).sum(1) for g in per.values()]).sum(0).sqrt()
    clip = float(norms.median())
    c = (clip / (norms * (1 + NORM_MARGIN) + 1e-6)).clamp(max=1.0)  # ghost clipping's clip factor
    got = _ghost_sum(model, ids, mask, labels, clip)
    assert set(got) == set(per)
    for name, g in per.items():
        assert got[name].dtype == torch.float64
        torch.testing.assert_close(got[name], torch.einsum("i,i...->...", c, g), rtol=1e-9, atol=1e-12, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("arch,mode", [("bert", "all"), ("gpt2", "all"), ("bert", "last_block")])
def test_ghost_float64_model_sums_in_float64(arch, mode):
    model, _ = apply_trainable(_model(arch).double(), mode)
    _float64_check(model, _config(arch))


@pytest.mark.parametrize("arch,mode", [("bert", "all"), ("bert", "last_block")])
def test_ghost_with_float64_default_dtype(arch, mode, float64_default):
    model, _ = apply_trainable(_model(arch), mode)
    assert next(model.parameters()).dtype == torch.float64
    _float64_check(model, _config(arch))


def test_hooks_clip_bf16_per_sample_gradients_with_a_float32_norm():
    """Opacus leaves bf16 per-sample gradients under autocast; a norm and clip factor rounded to bf16 overshoot C by up to ~0.8%."""
    torch.manual_seed(0)
    lin = nn.Linear(30, 10, bias=False)
    g = torch.randn(1, 300, generator=torch.Generator().manual_seed(30)).bfloat16()  # bf16 norm and factor: 0.8% over C
    C = 0.5 * float(g.double().norm())
    opt = make_optimizer("dp_sgd", [lin.weight], noise_multiplier=0.0, max_grad_norm=C, expected_batch_size=1, lr=0.1)
    lin.weight.grad_sample = g.view(1, 10, 30)
    assert opt.accumulate() == 1
    s = lin.weight.summed_grad
    assert s.dtype == torch.float32
    assert s.double().norm().item() <= C * (1 + 1e-6)


# ---------------------------------------------------------------------------------------------------------- trainer


def _train(tmp_path, model=None, **kw):
    import transformers

    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    transformers.logging.set_verbosity_error()
    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)
    args = dp_args(tmp_path / "out", max_steps=2, per_device_train_batch_size=8, **kw)
    trainer = DPTrainer(model=model if model is not None else make_model(), args=args, train_dataset=ds, data_collator=make_collator(tok))
    model = trainer.model  # LoRA: the adapted model
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainer.train()
    trained = [n for n, p in model.named_parameters() if p.requires_grad]
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert all(not torch.equal(init[n], p) for n, p in model.named_parameters() if n in trained)
    return trainer


@pytest.mark.parametrize("clipping", ["ghost", "hooks", "auto"])
def test_trainer_refuses_bf16_autocast_and_reduced_precision_weights(tmp_path, clipping):
    """Issue 49's review: under bf16 autocast each example's gradient depends on its micro-batch's padded length and
    shape (1.47 C from one added row beside 256 copies), and bf16 weights sum in bf16: both refused before training."""
    from tests.helpers import make_model

    with pytest.raises(ValueError, match="--bf16 is not supported with DP training"):
        _train(tmp_path, bf16=True, clipping=clipping, trainable="all")
    with pytest.raises(ValueError, match=r"DP training needs the model in float32 \(or float64\), got bfloat16 weights"):
        _train(tmp_path, model=make_model().to(torch.bfloat16), clipping=clipping, trainable="all")


@pytest.mark.parametrize("clipping", ["ghost", "ghost_two_pass", "hooks"])
def test_trainer_float64_default_dtype(tmp_path, clipping, float64_default):
    trainer = _train(tmp_path, clipping=clipping, trainable="all")
    assert trainer.clipping == clipping and next(trainer.model.parameters()).dtype == torch.float64


def test_trainer_float64_model(tmp_path):
    from tests.helpers import make_model

    _train(tmp_path, model=make_model().double(), clipping="ghost", trainable="all")


def test_two_pass_stays_refused_under_bf16(tmp_path):
    with pytest.raises(ValueError, match="--bf16 is not supported with DP training"):
        _train(tmp_path, bf16=True, clipping="ghost_two_pass")


def test_clipping_auto_logs_the_engine_and_why(tmp_path, caplog):
    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)

    def build(**kw):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_dp.trainer"):
            t = DPTrainer(model=make_model(), args=dp_args(tmp_path / "o", max_steps=1, **kw), train_dataset=ds,
                          data_collator=make_collator(tok))
        lines = [r for r in caplog.records if r.name == "hf_dp.trainer" and "--clipping auto" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO, [r.getMessage() for r in caplog.records]
        return t, lines[0].getMessage()

    t, msg = build()
    assert t.clipping == "ghost" and "ghost" in msg
    from hf_dp.clipping.ghost import GhostClipper

    def unsupported(model):
        raise ValueError("ghost clipping does not support trainable layer x (Conv1d)")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GhostClipper, "check_supported", staticmethod(unsupported))
        t, msg = build()
    assert t.clipping == "hooks" and "hooks" in msg and "Conv1d" in msg
    # an explicit choice is not re-announced
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="hf_dp.trainer"):
        DPTrainer(model=make_model(), args=dp_args(tmp_path / "o", max_steps=1, clipping="hooks"), train_dataset=ds,
                  data_collator=make_collator(tok))
    assert not [r for r in caplog.records if "--clipping auto" in r.getMessage()]




@pytest.mark.parametrize("engine", ["ghost", "hooks"])
def test_a_reduced_precision_frozen_base_under_lora_is_refused(tmp_path, engine):
    """Review of issue 51 (finding 1): a causal LM loaded in bfloat16 (transformers keeps a checkpoint's dtype) with
    float32 LoRA adapters was accepted — only trainable parameters were checked — and one row beside 256 short copies
    moved the clipped sum by 1.90 C (0.998 C in float32): the frozen base's forward rounds by the micro-batch's padded
    shape. Now refused before any step, naming a reduced-precision weight; the float32 model trains."""
    from tests import test_sensitivity as S

    for dtype in (torch.bfloat16, torch.float16):
        with pytest.raises(ValueError, match=r"^DP training needs the model in float32 \(or float64\), got "
                                             rf"{str(dtype)[6:]} weights \(such as \S+, frozen or not\)"):
            S.trainer(tmp_path / str(dtype), S.llama().to(dtype), engine, trainable="lora", lora_r=2)
    tr = S.trainer(tmp_path / "f32", S.llama(), engine, trainable="lora", lora_r=2)
    assert tr.clipping == engine


def test_a_base_cast_to_bfloat16_after_the_trainer_was_built_is_refused_at_train(tmp_path):
    """The precision rule holds at every train(), not only when the trainer is built: a frozen base cast to bfloat16
    since then (any public method, any order) is refused before any step."""
    from tests import test_sensitivity as S

    tr = S.trainer(tmp_path, S.llama(), "ghost", trainable="lora", lora_r=2)
    for p in tr.model.parameters():
        if not p.requires_grad:
            p.data = p.data.to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"^DP training needs the model in float32 \(or float64\), got bfloat16"):
        tr.train()
    assert tr.state.global_step == 0


def test_mixed_precision_from_accelerate_is_refused(tmp_path, monkeypatch):
    """A second review: `accelerate launch --mixed_precision bf16` (or an accelerate config) sets
    ACCELERATE_MIXED_PRECISION, which transformers reads into args.mixed_precision while args.bf16 stays False;
    Accelerate then ran every forward under bf16 autocast (one example moved the clipped sum by 2.83 C). Refused when
    the arguments are made, and at train() when set on trainer.args since."""
    from tests import test_sensitivity as S
    from tests.helpers import dp_args

    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")
    with pytest.raises(ValueError, match=r"^mixed precision bf16 \(ACCELERATE_MIXED_PRECISION, from accelerate launch"):
        dp_args(tmp_path / "a", max_steps=1)
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "no")
    tr = S.trainer(tmp_path / "b", S.llama(), "ghost", trainable="lora", lora_r=2)
    tr.args.mixed_precision = "bf16"
    with pytest.raises(ValueError, match=r"^mixed precision bf16 "):
        tr.train()
    assert tr.state.global_step == 0


def test_a_base_cast_by_a_callback_once_training_began_is_refused_before_its_first_step(tmp_path):
    """A second review: a callback's on_train_begin (after train()'s checks) cast the frozen base to bfloat16 and two
    steps trained in it (1.07 C). Every micro-batch now checks the weights before its forward (and the forward's
    output dtype after it: an autocast no weight shows), so no step is taken."""
    from transformers import TrainerCallback

    from tests import test_sensitivity as S

    class Cast(TrainerCallback):
        def on_train_begin(self, args, state, control, model=None, **kw):
            for p in model.parameters():
                if not p.requires_grad:
                    p.data = p.data.to(torch.bfloat16)

    from datasets import Dataset

    from hf_dp import DPTrainer
    from tests.helpers import dp_args

    rows = [[5 + i % 50, 6, 7, 8][: 2 + i % 3] for i in range(256)]
    ds = Dataset.from_dict({"input_ids": [r + [0] * (4 - len(r)) for r in rows],
                            "attention_mask": [[1] * len(r) + [0] * (4 - len(r)) for r in rows],
                            "labels": [r + [-100] * (4 - len(r)) for r in rows]})
    args = dp_args(tmp_path, noise_multiplier=1.0, epsilon=None, max_steps=2, trainable="lora", lora_r=2,
                   per_device_train_batch_size=16, clipping="ghost")
    tr = DPTrainer(model=S.llama(), args=args, train_dataset=ds, callbacks=[Cast()])
    with pytest.raises(ValueError, match=r"^DP training needs the model in float32 \(or float64\), got bfloat16"):
        tr.train()
    assert tr.state.global_step == 0 and tr.dp.ledger.steps == 0


def test_a_forward_that_autocasts_is_refused_in_the_step(tmp_path):
    """A model whose forward enters bf16 autocast has float32 weights: the step refuses its reduced-precision output."""
    from tests import test_sensitivity as S

    model = S.llama()
    forward = model.forward
    model.forward = lambda *a, **kw: _autocast(forward, *a, **kw)
    tr = S.trainer(tmp_path, model, "ghost", trainable="lora", lora_r=2)
    with pytest.raises(ValueError, match=r"(logits in a DP step: it ran in reduced precision|per-example contract)"):
        S.clipped_sum(tr, S.batch([[5, 6, 7]] * 4, True))


def _autocast(forward, *a, **kw):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return forward(*a, **kw)
