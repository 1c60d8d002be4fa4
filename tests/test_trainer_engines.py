"""DPTrainer's speed paths change nothing but speed: ghost clipping vs Opacus hooks, and training
from the frozen-prefix cache vs the full model, give the same trained model and the same ε."""

import pytest
import torch

from hf_dp import DPTrainer
from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


def _train(tmp_path, name, **overrides):
    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=128)
    trainer = DPTrainer(
        model=make_model(seed=0),
        args=dp_args(tmp_path / name, num_train_epochs=1, **overrides),
        train_dataset=ds,
        eval_dataset=ds.select(range(32)),
        data_collator=make_collator(tok),
    )
    trainer.train()
    metrics = trainer.evaluate()
    params = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer, params, metrics


def _assert_same(a, b, atol=1e-5):
    assert a.keys() == b.keys()
    for n in a:
        torch.testing.assert_close(a[n], b[n], atol=atol, rtol=1e-4, msg=lambda m: f"{n}: {m}")


def test_ghost_and_hooks_train_the_same_model(tmp_path):
    t_ghost, p_ghost, m_ghost = _train(tmp_path, "ghost", clipping="ghost")
    t_hooks, p_hooks, m_hooks = _train(tmp_path, "hooks", clipping="hooks")
    assert t_ghost.clipping == "ghost" and t_hooks.clipping == "hooks"
    assert t_ghost.ghost_clipper is not None and t_hooks.grad_sampler is not None
    _assert_same(p_ghost, p_hooks)
    assert t_ghost.get_epsilon() == t_hooks.get_epsilon()
    assert m_ghost["eval_loss"] == pytest.approx(m_hooks["eval_loss"], rel=1e-4)


def test_auto_clipping_falls_back_to_hooks_where_ghost_cannot_apply(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)
    t = DPTrainer(model=make_model(), args=dp_args(tmp_path / "a", optim="dp_sgd_l2", weight_decay=0.1), train_dataset=ds, data_collator=make_collator(tok))
    assert t.clipping == "hooks"
    with pytest.raises(ValueError, match="--clipping ghost cannot apply: dp_macadam transforms per-example gradients"):
        DPTrainer(model=make_model(), args=dp_args(tmp_path / "b", optim="dp_macadam", clipping="ghost"), train_dataset=ds, data_collator=make_collator(tok))


@pytest.mark.parametrize("clipping", ["ghost", "hooks"])
def test_frozen_prefix_cache_trains_the_same_model(tmp_path, clipping):
    t_cache, p_cache, m_cache = _train(tmp_path, "cache", clipping=clipping, cache_frozen_features=True)
    t_full, p_full, m_full = _train(tmp_path, "full", clipping=clipping)
    assert t_cache._prefix_cache and not t_full._prefix_cache
    assert len(t_cache.train_dataset) == len(t_full.train_dataset)  # same N, so the same q and δ check
    assert t_cache.privacy_spec == t_full.privacy_spec
    _assert_same(p_cache, p_full)
    assert t_cache.get_epsilon() == t_full.get_epsilon()
    assert m_cache["eval_loss"] == pytest.approx(m_full["eval_loss"], rel=1e-4)
    assert t_cache.privacy_report()["cache_frozen_features"] is True
    # the saved model is the plain full model and works on raw inputs
    t_cache.save_model(str(tmp_path / "saved"))
    from transformers import AutoModelForSequenceClassification

    reloaded = AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "saved")).eval()
    ids = torch.tensor([[2, 10, 11, 3, 12, 3]])
    t_cache.model.eval()
    torch.testing.assert_close(reloaded(input_ids=ids).logits, t_cache.model(input_ids=ids).logits)


def test_cache_requires_a_frozen_prefix(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)
    with pytest.raises(ValueError, match="--cache_frozen_features needs --trainable last_block"):
        DPTrainer(model=make_model(), args=dp_args(tmp_path / "c", trainable="all", cache_frozen_features=True), train_dataset=ds, data_collator=make_collator(tok))
