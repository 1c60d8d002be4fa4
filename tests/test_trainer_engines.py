"""DPTrainer's speed paths change nothing but speed: ghost clipping vs Opacus hooks, and training
from the frozen-prefix cache vs the full model, give the same trained model and the same ε."""

import pytest
import torch

from hf_dp import DPTrainer
from tests.helpers import dp_args, drawn, make_collator, make_model, make_pair_dataset, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore:Full backward hook is firing:UserWarning")


def _train(tmp_path, name, model_kw=None, **overrides):
    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=128)
    trainer = DPTrainer(
        model=make_model(seed=0, **(model_kw or {})),
        # the pairs have at most 15 tokens: a tight public bound keeps the engines' rounding allowances (γ of it) tiny
        args=dp_args(tmp_path / name, num_train_epochs=1, **{"dp_max_length": 16, **overrides}),
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


def test_dp_sgd_l2_ghost_and_hooks_train_the_same_model(tmp_path):
    kw = dict(optim="dp_sgd_l2", weight_decay=0.5, learning_rate=0.5)
    t_ghost, p_ghost, m_ghost = _train(tmp_path, "l2ghost", clipping="ghost", **kw)
    t_hooks, p_hooks, m_hooks = _train(tmp_path, "l2hooks", clipping="hooks", **kw)
    assert t_ghost.clipping == "ghost" and t_hooks.clipping == "hooks"
    _assert_same(p_ghost, p_hooks)
    assert t_ghost.get_epsilon() == t_hooks.get_epsilon()
    assert m_ghost["eval_loss"] == pytest.approx(m_hooks["eval_loss"], rel=1e-4)


def test_ghost_and_hooks_train_the_same_model(tmp_path):
    t_ghost, p_ghost, m_ghost = _train(tmp_path, "ghost", clipping="ghost")
    t_hooks, p_hooks, m_hooks = _train(tmp_path, "hooks", clipping="hooks")
    assert t_ghost.clipping == "ghost" and t_hooks.clipping == "hooks"
    assert t_ghost.ghost_clipper is not None and t_hooks.grad_sampler is not None
    _assert_same(p_ghost, p_hooks)
    assert t_ghost.get_epsilon() == t_hooks.get_epsilon()
    assert m_ghost["eval_loss"] == pytest.approx(m_hooks["eval_loss"], rel=1e-4)


def test_auto_clipping_picks_ghost_for_every_registered_optimizer(tmp_path):
    """Every registered rule is ghost-compatible (DP-SGD-L2 and DP-MacAdam through their per-sample
    affine maps), so --clipping auto picks ghost; --clipping hooks still forces the hooks."""
    from hf_dp.optim import DP_OPTIMIZERS

    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)
    for name in DP_OPTIMIZERS:
        t = DPTrainer(model=make_model(), args=dp_args(tmp_path / name, optim=name), train_dataset=ds, data_collator=make_collator(tok))
        assert t.clipping == "ghost", name
    t = DPTrainer(model=make_model(), args=dp_args(tmp_path / "h", optim="dp_macadam", clipping="hooks"), train_dataset=ds, data_collator=make_collator(tok))
    assert t.clipping == "hooks"


@pytest.mark.parametrize("optim,kw", [("dp_macadam", {"learning_rate": 1e-2}), ("dp_macadam", {"learning_rate": 1e-2, "weight_decay": 0.1})])
def test_macadam_ghost_and_hooks_train_the_same_model(tmp_path, optim, kw):
    """MacAdam's per-coordinate centring/scaling through ghost clipping == through Opacus' per-sample
    gradients, over enough steps for the bound b_t to be refreshed (t ≥ 2)."""
    t_ghost, p_ghost, m_ghost = _train(tmp_path, "mghost", clipping="ghost", optim=optim, **kw)
    t_hooks, p_hooks, m_hooks = _train(tmp_path, "mhooks", clipping="hooks", optim=optim, **kw)
    assert t_ghost.clipping == "ghost" and t_hooks.clipping == "hooks"
    assert t_ghost.state.global_step >= 3
    _assert_same(p_ghost, p_hooks, atol=1e-5)
    assert t_ghost.get_epsilon() == t_hooks.get_epsilon()
    assert m_ghost["eval_loss"] == pytest.approx(m_hooks["eval_loss"], rel=1e-4)


@pytest.mark.parametrize("clipping", ["ghost", "ghost_two_pass", "hooks"])
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
    with pytest.raises(ValueError, match=r"--cache_frozen_features needs --trainable last_block \(or last_k:K, or head\)"):
        DPTrainer(model=make_model(), args=dp_args(tmp_path / "c", trainable="all", cache_frozen_features=True), train_dataset=ds, data_collator=make_collator(tok))


@pytest.mark.parametrize("cache", [False, True])
def test_first_token_only_changes_nothing_but_speed(tmp_path, cache):
    """--first_token_only auto (the default) vs off: same trained model, ε and eval loss, with and
    without the cache; with auto the last block really runs on one position during training."""
    from tests.helpers import make_model as mk

    lengths = []

    def hooked():
        m = mk(seed=0)
        m.base_model.encoder.layer[-1].register_forward_hook(lambda _m, _a, out: lengths.append((out if torch.is_tensor(out) else out[0]).shape[1]))
        return m

    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=128)
    results = {}
    for mode in ("auto", "off"):
        lengths.clear()
        trainer = DPTrainer(
            model=hooked(), args=dp_args(tmp_path / mode, num_train_epochs=1, first_token_only=mode, cache_frozen_features=cache),
            train_dataset=ds, eval_dataset=ds.select(range(32)), data_collator=make_collator(tok),
        )
        trainer.train()
        train_lengths = list(lengths)
        metrics = trainer.evaluate()
        results[mode] = ({n: p.detach().clone() for n, p in trainer.model.named_parameters()}, trainer.get_epsilon(), metrics["eval_loss"], train_lengths)
    (p_auto, e_auto, l_auto, len_auto), (p_off, e_off, l_off, len_off) = results["auto"], results["off"]
    assert len_auto and len_off
    assert max(len_off) > 1 and max(len_auto[-5:]) == 1  # training steps: one position with auto
    _assert_same(p_auto, p_off)
    assert e_auto == e_off
    assert l_auto == pytest.approx(l_off, rel=1e-4)


@pytest.mark.parametrize(
    "optim,kw",
    [("dp_adamw", {}), ("dp_sgd_l2", {"weight_decay": 0.1, "trainable": "all", "learning_rate": 1e-2, "gradient_accumulation_steps": 2}),
     ("dp_macadam", {"learning_rate": 1e-2})],
)
def test_ghost_two_pass_and_hooks_train_the_same_model(tmp_path, optim, kw):
    """--clipping ghost_two_pass (norms from a first backward, clipped sum from an ordinary second one)
    trains the same model with the same ε as the Opacus hooks, per-sample affine rules included."""
    t_two, p_two, m_two = _train(tmp_path, "two", clipping="ghost_two_pass", optim=optim, **kw)
    t_hooks, p_hooks, m_hooks = _train(tmp_path, "hooks", clipping="hooks", optim=optim, **kw)
    assert t_two.clipping == "ghost_two_pass" and t_two.ghost_clipper.two_pass and t_hooks.clipping == "hooks"
    assert t_two.state.global_step >= 3
    # the hooks clip each example to C/(1 + γ), γ its share of the float32 sum's rounding over the run's public token
    # bound (6e-5 here); MacAdam's per-coordinate scale in ghost clipping carries no such share (hf_dp.clipping.ghost)
    _assert_same(p_two, p_hooks, atol=3e-5 if optim == "dp_macadam" else 1e-5)
    assert t_two.get_epsilon() == t_hooks.get_epsilon()
    assert m_two["eval_loss"] == pytest.approx(m_hooks["eval_loss"], rel=1e-4)
    logged = [[h["loss"] for h in t.state.log_history if "loss" in h] for t in (t_two, t_hooks)]
    assert logged[0] and logged[0] == pytest.approx(logged[1], rel=1e-4)  # the (unclipped) training loss, as logged


@pytest.mark.parametrize("clipping", ["ghost", "ghost_two_pass", "hooks"])
def test_empty_micro_batch_contributes_nothing(tmp_path, clipping):
    """The placeholder row of an empty Poisson micro-batch adds nothing to the clipped sum — also for a rule
    with a per-sample offset (DP-SGD-L2: v_i = g_i + λθ), where a zero-gradient row would otherwise add
    clip(λθ) and a neighbouring dataset's sum could differ by up to 2C."""
    from hf_dp.trainer import _EMPTY_KEY

    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)
    collator = make_collator(tok)
    trainer = DPTrainer(
        model=make_model(seed=0), args=dp_args(tmp_path / clipping, optim="dp_sgd_l2", weight_decay=0.5, clipping=clipping),
        train_dataset=ds, data_collator=collator,
    )
    trainer.create_optimizer_and_scheduler(num_training_steps=10)
    opt = trainer.dp.optimizer
    trainer.model.train()

    def summed_after(batch):
        for p in opt.params:
            p.summed_grad = None
        trainer.training_step(trainer.model, drawn(trainer, batch))
        return [p.summed_grad for p in opt.params]

    full = collator([ds[i] for i in range(4)])
    assert all(s is not None for s in summed_after(full))  # the control: a real micro-batch contributes
    placeholder = collator([ds[0]])
    placeholder[_EMPTY_KEY] = True
    assert all(s is None for s in summed_after(placeholder))
    if clipping == "ghost_two_pass":
        assert all(p.grad is None for p in opt.params)


@pytest.mark.parametrize("layers", [2, 3])
@pytest.mark.parametrize("clipping", ["ghost", "hooks"])
def test_last_k_prefix_cache_trains_the_same_model(tmp_path, clipping, layers):
    """--trainable last_k:2 (with 2 layers every block: the cache holds the embeddings' output; with 3 the cache holds
    block 0's output): training from the cache == training the full model, with both clipping engines; the two last
    blocks really train, what is below them does not."""
    kw = dict(model_kw={"num_hidden_layers": layers}, clipping=clipping, trainable="last_k:2")
    t_cache, p_cache, m_cache = _train(tmp_path, "k2cache", cache_frozen_features=True, **kw)
    t_full, p_full, m_full = _train(tmp_path, "k2full", **kw)
    assert t_cache._prefix_cache and t_cache.train_dataset.suffix_blocks == 2
    assert t_cache.trainable_info.suffix_blocks == 2
    _assert_same(p_cache, p_full)
    assert t_cache.get_epsilon() == t_full.get_epsilon()
    assert m_cache["eval_loss"] == pytest.approx(m_full["eval_loss"], rel=1e-4)
    before = make_model(seed=0, num_hidden_layers=layers).state_dict()
    for name in (f"bert.encoder.layer.{layers - 2}.attention.self.query.weight", f"bert.encoder.layer.{layers - 1}.output.dense.weight"):
        assert not torch.allclose(p_cache[name], before[name]), name  # trained
    frozen = ["bert.embeddings.word_embeddings.weight"] + [n for n in before if n.startswith("bert.encoder.layer.0.") and layers == 3]
    for name in frozen:
        torch.testing.assert_close(p_cache[name], before[name], msg=name)


def test_a_prefix_cache_built_for_other_blocks_is_refused(tmp_path):
    """A CachedFeatures passed as the training set must hold the input of the blocks --trainable runs from the cache."""
    from hf_dp.models import apply_trainable
    from hf_dp.models.prefix_cache import build_prefix_cache

    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)
    model, _ = apply_trainable(make_model(), "last_block")
    cache = build_prefix_cache(model, ds, make_collator(tok), suffix_blocks=1)
    with pytest.raises(ValueError, match=r"the train dataset is a prefix cache of the input of the last 1 block\(s\), but "
                                         r"--trainable last_k:2 runs the last 2 from the cache"):
        DPTrainer(model=make_model(), args=dp_args(tmp_path / "x", trainable="last_k:2", cache_frozen_features=True),
                  train_dataset=cache)


@pytest.mark.parametrize("other", ["depth", "weights", "eval_depth"])
def test_a_prefix_cache_of_another_model_is_refused_before_any_build(tmp_path, other, monkeypatch):
    """The cache's K is not enough (review of 1ba8099): a K = 1 cache of a 3-block model holds the input of block 2,
    the trainer's 2-block model runs block 1 from it, and training would go on silently on the wrong states; a cache of
    another checkpoint of the same shape likewise.  Refused with one error (the cache's prefix signature), and — when
    the bad cache is an eval set — before the (slow) training-set cache is built."""
    from hf_dp.models import apply_trainable
    from hf_dp.models import prefix_cache
    from hf_dp.models.prefix_cache import build_prefix_cache

    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=32)
    cut_from = make_model(num_hidden_layers=3) if other in ("depth", "eval_depth") else make_model(seed=7)
    cache = build_prefix_cache(apply_trainable(cut_from, "last_block")[0], ds, make_collator(tok), suffix_blocks=1)
    builds = []
    real_build = prefix_cache.build_prefix_cache
    monkeypatch.setattr("hf_dp.models.cache_manager.build_prefix_cache", lambda *a, **k: builds.append(k.get("name")) or real_build(*a, **k))
    sets = dict(train_dataset=ds, eval_dataset=cache) if other == "eval_depth" else dict(train_dataset=cache)
    which = "eval" if other == "eval_depth" else "train"
    with pytest.raises(ValueError, match=rf"the {which} dataset is a prefix cache of BertForSequenceClassification \(model_type=.bert.\) "
                                         r"bert\.encoder\.layer\[\d\] of \d blocks, prefix weights [0-9a-f]{16}, but this "
                                         r"model's cached prefix is .*rebuild it from this model"):
        DPTrainer(model=make_model(), args=dp_args(tmp_path / "x", cache_frozen_features=True),
                  data_collator=make_collator(tok), **sets)
    assert builds == []


def test_a_prefix_cache_of_the_same_frozen_prefix_is_accepted(tmp_path):
    """The signature covers the frozen prefix only: a cache built on the unfrozen model (or another head) is the same
    cache, and is accepted."""
    from hf_dp.models.prefix_cache import build_prefix_cache

    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=32)
    unfrozen = make_model()
    torch.nn.init.normal_(unfrozen.classifier.weight)  # another head: not part of the prefix
    cache = build_prefix_cache(unfrozen, ds, make_collator(tok), suffix_blocks=1)
    trainer = DPTrainer(model=make_model(), args=dp_args(tmp_path / "x", cache_frozen_features=True, max_steps=1),
                        train_dataset=cache)
    assert trainer.train_dataset is cache
    trainer.train()
    assert trainer.ledger.steps == 1


@pytest.mark.parametrize("resume_seed", [0, 7])
def test_resume_with_cached_prefix_checks_the_caches_against_the_checkpoints_weights(tmp_path, resume_seed):
    """Review of 31a21a3: the caches are built at __init__ from the model given, and HF loads the checkpoint's weights
    (frozen prefix included) only inside train(); resuming a checkpoint of another prefix went on silently on stale
    states.  Now refused after the load, before any step; the same model resumes as before."""
    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)
    out = tmp_path / "out"
    kw = dict(cache_frozen_features=True, max_steps=4, save_strategy="steps", save_steps=2, epsilon=None,
              noise_multiplier=1.0)
    first = DPTrainer(model=make_model(seed=0), args=dp_args(out, **kw), train_dataset=ds, eval_dataset=ds.select(range(8)),
                      data_collator=make_collator(tok))
    first.train()
    again = DPTrainer(model=make_model(seed=resume_seed), args=dp_args(out, **{**kw, "max_steps": 6}), train_dataset=ds,
                      eval_dataset=ds.select(range(8)), data_collator=make_collator(tok))
    if resume_seed == 0:
        again.train(resume_from_checkpoint=True)
        assert again.state.global_step == 6
    else:
        with pytest.raises(ValueError, match=r"resuming from .*checkpoint-4: the train dataset is a prefix cache of .*"
                                             r"but this model's cached prefix is .*pass the model the checkpoint was "
                                             r"trained from"):
            again.train(resume_from_checkpoint=True)
        assert sorted(d.name for d in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4"]  # no step taken


def test_prefix_signature_is_the_same_for_the_same_bits_in_another_layout():
    """Review of 31a21a3: a float sum depends on the summation order (CPU vs GPU, memory layout); the signature hashes
    the exact bits, so a model moved or re-laid out keeps it, and one changed weight changes it."""
    from hf_dp.models import apply_trainable
    from hf_dp.models.prefix_cache import prefix_signature

    model, _ = apply_trainable(make_model(num_hidden_layers=3), "last_block")
    before = prefix_signature(model)
    for p in model.parameters():
        if p.dim() == 2:
            p.data = p.data.t().contiguous().t()  # same values, column-major
    assert prefix_signature(model) == before
    with torch.no_grad():
        model.classifier.weight.add_(1.0)  # the head is not part of the prefix
    assert prefix_signature(model) == before
    with torch.no_grad():
        w = model.bert.embeddings.word_embeddings.weight
        w[[0, 1]] = w[[1, 0]]  # a permutation of rows: same float sums, other bits
    assert prefix_signature(model) != before
