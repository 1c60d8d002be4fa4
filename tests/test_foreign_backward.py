"""What runs on the model outside DPTrainer's training steps never enters a noisy step: a callback's own forward and
backward between micro-batches (two passes used to sum its gradient unclipped into the next step, the Opacus hooks to
clip its rows into it — rows that were never Poisson-drawn), and a second DPTrainer on a model that an earlier one
instrumented (the earlier one's Opacus hooks used to add every example's clipped gradient a second time). With the same
--dp_seed each run's noisy sums equal those of the same run without the interference."""

from __future__ import annotations

import pytest
import torch
from transformers import TrainerCallback

from hf_dp import DPTrainer
from hf_dp.privacy.privatizer import PrivateOptimizer
from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")
C = 1e-3


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    return make_pair_dataset(tok, n=96), make_collator(tok)


@pytest.fixture
def sums(monkeypatch):
    """The clipped sum of every logical step, as the privatizer is about to noise it."""
    out = []
    original = PrivateOptimizer.privatize

    def spy(self):
        self.accumulate()  # (what privatize itself does first)
        out.append(torch.cat([p.summed_grad.detach().reshape(-1).clone() for p in self.params]))
        return original(self)

    monkeypatch.setattr(PrivateOptimizer, "privatize", spy)
    return out


class Meddler(TrainerCallback):
    """A user's callback that runs a plain forward and backward on the model (training mode) at ``where``."""

    def __init__(self, model, batch, where):
        self.model, self.batch, self.where = model, batch, where

    def _go(self):
        self.model.train()
        (self.model(**self.batch).loss * 1e3).backward()

    def on_step_begin(self, args, state, control, **kw):
        if self.where == "step_begin":
            self._go()

    def on_substep_end(self, args, state, control, **kw):
        if self.where == "substep_end":
            self._go()


def _trainer(tmp_path, name, model, ds, collate, clipping, ga=1, callbacks=()):
    args = dp_args(tmp_path / name, trainable="all", clipping=clipping, max_steps=3, epsilon=None, noise_multiplier=1.0,
                   per_sample_max_grad_norm=C, per_device_train_batch_size=8, gradient_accumulation_steps=ga,
                   logging_steps=100, dp_seed=5)
    return DPTrainer(model=model, args=args, train_dataset=ds, data_collator=collate, callbacks=list(callbacks))


@pytest.mark.parametrize("where", ["step_begin", "substep_end"])
@pytest.mark.parametrize("clipping", ["ghost", "ghost_two_pass", "hooks"])
def test_a_callbacks_own_backward_never_enters_a_noisy_step(clipping, where, data, sums, tmp_path):
    ds, collate = data
    ga = 2 if where == "substep_end" else 1
    _trainer(tmp_path, "plain", make_model(), ds, collate, clipping, ga).train()
    clean = list(sums)
    sums.clear()
    model = make_model()
    batch = collate([ds[i] for i in range(8)])
    tr = _trainer(tmp_path, "meddled", model, ds, collate, clipping, ga, callbacks=[Meddler(model, batch, where)])
    tr.train()
    assert tr.clipping == clipping and len(sums) == len(clean) == 3
    for step, (got, ref) in enumerate(zip(sums, clean)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-9, msg=lambda m: f"step {step}: {m}")


@pytest.mark.parametrize("first", ["hooks", "ghost", "ghost_two_pass"])
def test_a_second_dptrainer_on_the_same_model_counts_each_example_once(first, data, sums, tmp_path):
    ds, collate = data
    _trainer(tmp_path, "fresh", make_model(), ds, collate, "ghost").train()
    clean = list(sums)
    sums.clear()
    model = make_model()
    _trainer(tmp_path, "earlier", model, ds, collate, first)  # built, never trained (an earlier attempt)
    _trainer(tmp_path, "later", model, ds, collate, "ghost").train()
    assert len(sums) == len(clean) == 3
    for step, (got, ref) in enumerate(zip(sums, clean)):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-9, msg=lambda m: f"step {step}: {m}")


def test_an_earlier_dptrainers_clipper_records_nothing_while_another_trains(data, tmp_path):
    """Two ghost DPTrainers on one model: while the later one trains, the earlier one's instrumentation (paused per
    clipper) keeps no records — they would hold every layer's activations of every step until it trains itself."""
    ds, collate = data
    model = make_model()
    earlier = _trainer(tmp_path, "earlier", model, ds, collate, "ghost")
    later = _trainer(tmp_path, "later", model, ds, collate, "ghost")
    later.train()
    assert later.state.global_step == 3
    assert sum(len(layer.records) for layer in earlier.ghost_clipper.layers) == 0
    earlier.train()  # and it still trains, on its own records
    assert earlier.state.global_step == 3


def test_the_batch_checks_apply_only_inside_dp_steps():
    """The refusal of a frozen BatchNorm in training mode (batch statistics mix examples) guards DP steps; with the
    instrumentation paused (outside DPTrainer's training steps) the model runs as it is."""
    from torch import nn

    from hf_dp.clipping import GhostClipper

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    model[1].requires_grad_(False)
    gc = GhostClipper(model)
    try:
        x = torch.randn(6, 4)
        with pytest.raises(RuntimeError, match="runs in training mode under DP training"):
            model(x)
        gc.pause(True)
        model(x).sum().backward()
        assert all(p.grad is not None for p in model.parameters() if p.requires_grad)
        gc.pause(False)
        with pytest.raises(RuntimeError, match="runs in training mode under DP training"):
            model(x)
    finally:
        gc.detach()
