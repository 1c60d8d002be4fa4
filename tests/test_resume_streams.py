"""Two resumes from checkpoints of one ``--dp_seed`` run never draw the same noise or the same Poisson batches.

Run U saves checkpoint-2 and checkpoint-4. R2 resumes checkpoint-2 (its ledger counts U's 2 steps past it: it starts
at ledger step 4); R4 resumes checkpoint-4 (a clean continuation: ledger step 4 too). Before the fix both keyed their
seeded streams by the ledger step alone, so both drew the same noise vector at step 4 (the difference of the two
released models' updates noise-free, while the ledger counts them as independent releases) and the same batches. Now
a resume that is not a clean continuation keys its streams by an id of its own (``ledger.meta["stream_tag"]``); a
clean continuation keeps the run's streams (tests/test_fsdp_checkpoint.py: the resumed run equals the uninterrupted
one under FSDP).
"""

from __future__ import annotations

import pytest
import torch

from hf_dp import DPTrainer

from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer, spy_draws_and_noise

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture
def spies(monkeypatch):
    """Every Poisson draw (list of indices, in order) and every noise vector added (flattened, in order)."""
    return spy_draws_and_noise(monkeypatch)


def _seeded_runs(tmp_path, draws, noises):
    """run(out, max_steps, resume=None, **flags) -> (trainer, its Poisson draws, its noise vectors): a --dp_seed 7 run
    on 32 rows, B = 8, a checkpoint every 2 steps."""
    tok = make_tokenizer(tmp_path / "tok")
    ds, collator = make_pair_dataset(tok, n=32, seed=0), make_collator(tok)

    def run(out, max_steps, resume=None, **kw):
        del draws[:], noises[:]
        args = dp_args(str(tmp_path / out), epsilon=None, noise_multiplier=1.0, max_steps=max_steps,
                       per_device_train_batch_size=8, dp_seed=7, save_strategy="steps", save_steps=2,
                       save_total_limit=None, **kw)
        t = DPTrainer(model=make_model(), args=args, train_dataset=ds, data_collator=collator)
        t.train(resume_from_checkpoint=resume)
        return t, list(draws), list(noises)

    return run


def test_two_resumes_of_one_seeded_run_draw_different_noise_and_batches(spies, tmp_path):
    draws, noises = spies
    run = _seeded_runs(tmp_path, draws, noises)

    run("U", 4)
    # ignore_data_skip: each resume's first draws are the first steps it trains (none skipped by HF)
    r2, d2, n2 = run("R2", 6, resume=str(tmp_path / "U" / "checkpoint-2"), ignore_data_skip=True)
    r4, d4, n4 = run("R4", 6, resume=str(tmp_path / "U" / "checkpoint-4"), ignore_data_skip=True)
    assert r2.dp.lineage.resumed_ledger_steps == 2 and r4.dp.lineage.resumed_ledger_steps == 4
    assert r2.ledger.steps == 4 + 4 and r4.ledger.steps == 4 + 2  # both trained their first step at ledger step 4
    assert len(n2) == 4 and len(n4) == 2 and len(d2) >= 4 and len(d4) >= 2
    assert n2[0].shape == n4[0].shape
    # the noise of step 4 differs (old code: the same draw, equal up to the rounding of grad - summed_grad)
    assert not torch.allclose(n2[0], n4[0], atol=1e-3)
    # different batches: the draws of step 4 (old code: identical, as every later draw of the same stream)
    assert d2[:2] != d4[:2]
    assert r2.ledger.meta.get("stream_tag") is not None  # U took steps past checkpoint-2: a branch of its own
    assert r4.ledger.meta.get("stream_tag") is None  # a clean continuation of U keeps U's streams


def test_two_resumes_of_a_checkpoint_they_cannot_record_in_draw_different_noise(spies, tmp_path, monkeypatch):
    """A checkpoint folder the resumes cannot write their record into (read-only, another user's): neither sees the
    other, so neither can tell it is not the only continuation. Each must then key its streams by its own id — before
    the fix both kept the run's streams and drew the same noise and batches from the same model at the same step."""
    from hf_dp.run import spent

    draws, noises = spies
    run = _seeded_runs(tmp_path, draws, noises)

    run("U", 4)
    monkeypatch.setattr(spent, "write_resume_record", lambda checkpoint, record: False)  # not writable
    ckpt = str(tmp_path / "U" / "checkpoint-4")
    a, da, na = run("A", 6, resume=ckpt, ignore_data_skip=True)
    b, db, nb = run("B", 6, resume=ckpt, ignore_data_skip=True)
    assert a.dp.lineage.resumed_ledger_steps == b.dp.lineage.resumed_ledger_steps == 4 and len(na) == len(nb) == 2
    assert not torch.allclose(na[0], nb[0], atol=1e-3)
    assert da[:2] != db[:2]
    assert a.ledger.meta.get("stream_tag") not in (None, b.ledger.meta.get("stream_tag"))


def test_a_continuation_that_is_not_a_resume_does_not_replay_a_clean_resume(spies, tmp_path):
    """U trains 4 steps (checkpoint-4). R resumes checkpoint-4, a clean continuation: U's streams from ledger step 4.
    T2, a new trainer given U's trained model (its ledger carries U's 4 steps, so it also first steps at ledger step 4,
    from the same weights) is not a resume, so nothing tags its streams: it draws R's batches and R's noise at the same
    ledger step, with another optimizer state and learning-rate schedule (the same held for a second ``U.train()``:
    the same batches; under FSDP, whose noise is keyed by the step, the same noise too). Now such a train() tags its
    streams (hf_dp.run.lineage.before_train)."""
    draws, noises = spies
    tok = make_tokenizer(tmp_path / "tok")
    ds, collator = make_pair_dataset(tok, n=32, seed=0), make_collator(tok)

    def trainer(out, max_steps, model=None, **kw):
        args = dp_args(str(tmp_path / out), epsilon=None, noise_multiplier=1.0, max_steps=max_steps,
                       per_device_train_batch_size=8, dp_seed=7, **kw)
        return DPTrainer(model=model if model is not None else make_model(), args=args, train_dataset=ds,
                         data_collator=collator)

    u = trainer("U", 4, save_strategy="steps", save_steps=2, save_total_limit=None)
    u.train()
    del draws[:], noises[:]
    r = trainer("R", 6, save_strategy="no", ignore_data_skip=True)
    r.train(resume_from_checkpoint=str(tmp_path / "U" / "checkpoint-4"))
    dr, nr = list(draws), list(noises)
    del draws[:], noises[:]
    t2 = trainer("T2", 2, model=u.model, save_strategy="no")
    t2.train()
    assert r.ledger.steps == t2.ledger.steps == 6 and len(nr) == len(noises) == 2
    assert draws[:2] != dr[:2]
    assert not torch.allclose(noises[0], nr[0], atol=1e-3)
