"""``DPTrainer`` with ``--noise_mechanism banded_sqrt`` (issue 52): a run stopped at a checkpoint and resumed, through
HF's data skip, ends at the accountant's ε for ⌈T/b⌉ rounds; its checkpoint holds no noise of the correlation buffer;
the resumed run starts a new correlation segment (its first noise is the seeded stream's z, scaled, its second the
recursion on it); privacy.json and the card name the mechanism; a resume with another b (or independent noise) is
refused."""

from __future__ import annotations

import json
import math

import pytest
import torch

from hf_dp import DPTrainer
from hf_dp.privacy.accounting import compute_epsilon
from hf_dp.privacy.randomness import stream_generator
from hf_dp.hub.card import parse_front_matter

from tests.helpers import StopAt, dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer, spy_draws_and_noise

pytestmark = pytest.mark.filterwarnings("ignore")

SIGMA, B, N, SEED = 1.0, 8, 32, 7


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    tok = make_tokenizer(tmp_path_factory.mktemp("tok"))
    return make_pair_dataset(tok, n=N, seed=0), make_collator(tok)


def _trainer(data, out, bands=2, mechanism="banded_sqrt", callbacks=(), **kw):
    ds, collator = data
    kw = {"save_strategy": "steps", "save_steps": 3, "save_total_limit": None, "epsilon": None,
          "noise_multiplier": SIGMA, **kw}
    args = dp_args(str(out), max_steps=7, per_device_train_batch_size=B, dp_seed=SEED, noise_mechanism=mechanism,
                   noise_bands=bands, **kw)
    return DPTrainer(model=make_model(), args=args, train_dataset=ds, data_collator=collator, callbacks=list(callbacks))


def _tensors(obj):
    if torch.is_tensor(obj):
        yield obj
    elif isinstance(obj, dict):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def test_a_banded_run_stopped_and_resumed(data, tmp_path, monkeypatch):
    draws, noises = spy_draws_and_noise(monkeypatch)
    first = _trainer(data, tmp_path / "run", callbacks=[StopAt(3)])
    first.train()
    q = B / N
    assert first.ledger.steps == 3 and first.get_epsilon() == compute_epsilon(SIGMA, q, 3, 1e-5, "prv", 2)
    parts = first.dp.sampler.partitions
    for t, batch in enumerate(draws):  # one micro-batch per step: only the step's partition
        assert all(int(parts[i]) == t % 2 for i in batch)
    opt = first.dp.optimizer
    assert opt.correlation is not None and len(opt.correlation.buffered()) == len(opt.params)  # b − 1 = 1 per tensor

    # the checkpoint holds the rule's state (Adam's two moments per tensor) and nothing of the noise buffer
    ckpt = tmp_path / "run" / "checkpoint-3"
    saved = torch.load(ckpt / "optimizer.pt", weights_only=False)
    shapes = [tuple(p.shape) for p in opt.params]
    same_shape = [t for t in _tensors(saved) if tuple(t.shape) in shapes and t.numel() > 1]
    assert len(same_shape) == 2 * len(shapes)
    assert len([t for t in _tensors(saved["rule"]) if tuple(t.shape) in shapes and t.numel() > 1]) == 2 * len(shapes)
    assert "correlation" not in json.dumps(saved["hf_dp"], default=str)

    # resumed through HF's data skip (3 of the epoch's 4 batches): the draws stay on their steps' partitions
    del draws[:], noises[:]
    resumed = _trainer(data, tmp_path / "run")
    resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.ledger.steps == 7 and resumed.ledger.meta.get("stream_tag") is None  # a clean continuation
    assert resumed.get_epsilon() == compute_epsilon(SIGMA, q, 7, 1e-5, "prv", 2) == compute_epsilon(SIGMA, 2 * q, 4, 1e-5)
    assert resumed.ledger.accountant.history == [(SIGMA, 2 * q, 4)]
    assert len(noises) == 4
    # a new segment: step 3's noise is the seeded stream's z scaled by σ·C·s, step 4's the recursion on it
    ropt = resumed.dp.optimizer
    s = math.sqrt(1 + 0.25)
    gen = stream_generator(SEED, "noise", 3)
    z3 = torch.cat([torch.normal(0.0, SIGMA * 1.0 * s, size=p.shape, generator=gen).reshape(-1) for p in ropt.params])
    z4 = torch.cat([torch.normal(0.0, SIGMA * 1.0 * s, size=p.shape, generator=gen).reshape(-1) for p in ropt.params])
    assert torch.allclose(noises[0], z3, atol=1e-5)
    assert torch.allclose(noises[1], z4 - 0.5 * z3, atol=1e-5)
    assert not torch.allclose(noises[1], z4, atol=1e-2)

    # privacy.json and the card name the mechanism
    resumed.save_model(str(tmp_path / "release"))
    report = json.loads((tmp_path / "release" / "privacy.json").read_text())
    assert report["noise_mechanism"] == "banded_sqrt" and report["sampling"] == "cyclic_poisson"
    cn = report["correlated_noise"]
    assert cn["bands"] == 2 and cn["coefficients"] == [1.0, 0.5] and cn["column_norm"] == pytest.approx(s)
    assert "cyclic Poisson: 2 partitions by a hash of each unit, rate 2*q" in cn["sampling"]
    assert "rate min(1, 2*q), ceil(T/2) rounds" in cn["accounting"] and "Choquette-Choo" in cn["accounting"]
    run = report["ledger"]["runs"][-1]
    assert (run["noise_mechanism"], run["noise_bands"], run["steps"], run["history"]) == ("banded_sqrt", 2, 7, [[SIGMA, 2 * q, 4]])
    card = (tmp_path / "release" / "README.md").read_text()
    assert "banded square root" in card and "⌈7/2⌉ rounds" in card and "cyclic Poisson" in card
    meta = parse_front_matter(card)["differential_privacy"]
    assert meta["noise_mechanism"] == "banded_sqrt" and meta["noise_bands"] == 2 and meta["sampling"] == "cyclic_poisson"

    # a resume with another b, or with independent noise, is refused
    with pytest.raises(ValueError, match=r"refusing to resume: .*noise_bands: checkpoint 2 vs now 4"):
        _trainer(data, tmp_path / "run", bands=4).train(resume_from_checkpoint=str(ckpt))
    with pytest.raises(ValueError, match=r"refusing to resume: .*noise_mechanism: checkpoint 'banded_sqrt' vs now 'independent'"):
        _trainer(data, tmp_path / "run", bands=1, mechanism="independent").train(resume_from_checkpoint=str(ckpt))


def test_an_independent_runs_report_keeps_its_fields(data, tmp_path):
    t = _trainer(data, tmp_path / "plain", bands=1, mechanism="independent", save_strategy="no")
    t.train()
    report = t.privacy_report()
    assert report["noise_mechanism"] == "independent" and report["sampling"] == "poisson"
    assert "correlated_noise" not in report and "noise_mechanism" not in report["ledger"]["runs"][-1]
    assert t.dp.sampler.partitions is None and t.dp.optimizer.correlation is None


def test_private_selection_is_refused_with_banded_noise(data, tmp_path):
    t = _trainer(data, tmp_path / "search", save_strategy="no", epsilon=3.0, noise_multiplier=None)
    with pytest.raises(ValueError, match=r"^private selection is not supported with --noise_bands 2 yet"):
        t.hyperparameter_search(hp_space={"learning_rate": [1e-3, 1e-2]}, n_trials=2, direction="maximize",
                                model_init=make_model, score_data="public")


def test_the_recipes_early_resume_check_reads_the_mechanism(tmp_path):
    """recipes/common/early.py compares the checkpoint's recorded spec with the flags before tokenizing: a marker of an
    hf_dp before correlated noise (no noise fields) is an independent run; banded flags are refused against it."""
    from hf_dp.privacy.planning import plan_mechanism
    from hf_dp.run.checkpointing import write_marker
    from recipes.common.early import check_resume_settings
    from recipes.common.args import RecipeError

    args = dp_args(tmp_path, epsilon=None, noise_multiplier=1.0, max_steps=8, per_device_train_batch_size=8, do_train=True)
    spec = plan_mechanism(n=N, per_device_batch=8, accumulation=1, world_size=1, delta=1e-5, epsilon=None,
                          noise_multiplier=1.0, max_grad_norm=1.0, accountant="prv", max_steps=8, num_train_epochs=2)[0]
    ckpt = tmp_path / "checkpoint-2"
    ckpt.mkdir()
    old = {k: v for k, v in spec.as_dict().items() if k not in ("noise_mechanism", "noise_bands")}
    write_marker(str(ckpt), {"privacy_spec": old, "global_step": 2}, hash_files=False)
    check_resume_settings(args, str(ckpt), N)  # accepted
    banded_args = dp_args(tmp_path, epsilon=None, noise_multiplier=1.0, max_steps=8, per_device_train_batch_size=8,
                          do_train=True, noise_mechanism="banded_sqrt", noise_bands=2)
    with pytest.raises(RecipeError, match=r"noise_mechanism: checkpoint 'independent' vs now 'banded_sqrt', noise_bands"):
        check_resume_settings(banded_args, str(ckpt), N)


class _DrawsAhead:
    """A loader that fetches the next micro-batch before handing out the current one (as Accelerate's
    ``DataLoaderShard`` does to spot the last batch): the next step's draw happens while this step still runs."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __getattr__(self, name):
        return getattr(self.loader, name)

    def __iter__(self):
        it = iter(self.loader)
        try:
            current = next(it)
        except StopIteration:
            return
        for nxt in it:
            yield current
            current = nxt
        yield current


def test_a_loader_that_draws_ahead_is_refused(data, tmp_path, monkeypatch):
    """Without the per-batch tag, such a loader would train step t+1 on partition t mod b's draw (a unit of one
    partition could then enter two consecutive steps, inside one band), and the sampler's last draw would still
    carry step t's number when step t is noised: each micro-batch's own tag catches it."""
    t = _trainer(data, tmp_path / "ahead", save_strategy="no")
    original = DPTrainer.get_train_dataloader
    monkeypatch.setattr(DPTrainer, "get_train_dataloader", lambda self: _DrawsAhead(original(self)))
    with pytest.raises(RuntimeError, match="was drawn for step 0 .*draws batches ahead"):
        t.train()


def test_the_collator_may_not_set_the_phase_key(data):
    from hf_dp.run.data import PHASE_KEY, EmptySafeCollator

    ds, collator = data
    bad = EmptySafeCollator(lambda rows: dict(collator(rows), **{PHASE_KEY: 3}), ds)
    with pytest.raises(ValueError, match=f"returned the key '{PHASE_KEY}'"):
        bad([ds[0]])


def test_rows_changed_in_place_between_two_trains_are_refused(data, tmp_path):
    """A training set that is not a 🤗 Dataset (a list of rows) re-ordered in place after a train(): the same object,
    but the partitions computed at construction no longer belong to the rows at their positions, so units would change
    partition inside one correlation segment. The next train() reads the rows again and refuses."""
    import random

    ds, collator = data
    rows = [dict(ds[i]) for i in range(len(ds))]
    args = dp_args(str(tmp_path / "inplace"), max_steps=2, per_device_train_batch_size=B, dp_seed=SEED, epsilon=None,
                   noise_multiplier=SIGMA, noise_mechanism="banded_sqrt", noise_bands=2, save_strategy="no")
    t = DPTrainer(model=make_model(), args=args, train_dataset=rows, data_collator=collator)
    t.train()
    random.Random(1).shuffle(rows)
    with pytest.raises(ValueError, match="training set's rows changed since the DPTrainer was built"):
        t.train()
