"""--audit_canaries m --audit_kind gradient (hf_dp.audit.canaries): white-box canaries inside a real DPTrainer run.
Each canary is a unit of the sampler and the accountant (N = real + m whatever the draw); a drawn canary's row has a
model loss of 0 and its gradient s·u_k (s = 1000 C) is clipped with the privatizer's C of that moment and summed with
the batch before the one noise; each step's privatized gradient is projected on every u_k (x_kt, in units of C) and the
score is Σ_t log(1 − q + q·exp((x_kt − ½)/σ²)). Checked here against an independent reconstruction from the sampler's
draws, step by step (no noise), with the clip × 10 break, the secrecy of the draw, the refusals, and the command line
(python -m hf_dp.audit --one_run --canary_kind gradient) flagging no noise and noise ÷ 10 but not the real run."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from hf_dp.audit import canaries as hooks
from hf_dp.audit.canary_kinds import GradientDirections

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one intra-op thread (tests/conftest.py)

N_REAL, LENGTH = 48, 8


def _real_rows():
    import datasets

    rng = np.random.default_rng(0)
    x = rng.integers(5, 100, size=(N_REAL, LENGTH))
    return datasets.Dataset.from_dict({"input_ids": x.tolist(), "attention_mask": np.ones_like(x).tolist(),
                                       "labels": (x[:, 0] < 50).astype(int).tolist()})


def _trainer(tmp_path, steps=3, optim="dp_sgd", **kw):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from hf_dp import DPTrainer, DPTrainingArguments

    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=512, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=2))
    args = dict(output_dir=str(tmp_path), optim=optim, noise_multiplier=2.0, per_sample_max_grad_norm=1.0,
                learning_rate=1e-2, per_device_train_batch_size=37, max_steps=steps, trainable="all", report_to=[],
                use_cpu=True, disable_tqdm=True, save_strategy="no", logging_strategy="no", delta=1e-5,
                audit_canaries=100, audit_canary_length=LENGTH, audit_kind="gradient")
    args.update(kw)
    return DPTrainer(model=model, args=DPTrainingArguments(**args), train_dataset=_real_rows())


def _instrumented(tr, monkeypatch):
    """No noise (the audit's zero_noise on the privatizer), the sampler's index lists recorded, the scores captured."""
    from hf_dp.audit.trainer_path import ReplayBatchSampler, noise_off

    tr.add_callback(noise_off(tr.dp))
    tr.dp.sampler = ReplayBatchSampler(tr.dp.sampler)
    seen = {"steps": []}
    real_scores, real_projections = hooks.gradient_scores, hooks.step_projections

    def capture(state):
        seen["scores"] = real_scores(state)
        seen["projection_sum"] = state.projection_sum.copy()
        seen["sizes"] = list(state.directions.sizes)
        return seen["scores"]

    def record_step(state, optimizer):
        x = real_projections(state, optimizer)
        seen["steps"].append(x.copy())
        return x

    monkeypatch.setattr(hooks, "gradient_scores", capture)
    monkeypatch.setattr(hooks, "step_projections", record_step)
    return seen


def _expected(tr, seen, key, bits, clip):
    """Per step t, ⟨clip·Σ_{k drawn at t} u_k, u_j⟩ (in units of C) for every canary j, rebuilt from the recorded draws
    and the key: an (steps, m) array, and the times each canary was drawn."""
    state = tr.dp.audit
    rows = np.flatnonzero(bits)
    dirs = GradientDirections(state.m, seen["sizes"], key=key)
    per_step, draws = [], np.zeros(state.m)
    for batch in tr.dp.sampler.recorded:
        total = np.zeros(dirs.d)
        for r in batch:
            if r >= N_REAL:
                k = rows[r - N_REAL]
                draws[k] += 1
                idx, vals = dirs.direction(k)
                total[idx] += clip * vals
        per_step.append([total[dirs.direction(j)[0]] @ dirs.direction(j)[1] for j in range(state.m)])
    return np.array(per_step), draws


def _llr(x, q, sigma):
    """log p₁(x)/p₀(x), p₀ = N(0, σ²), p₁ = (1 − q)·N(0, σ²) + q·N(1, σ²): written out here, not imported."""
    return np.log((1 - q) + q * np.exp((np.asarray(x) - 0.5) / sigma**2))


@pytest.mark.parametrize("clipping", ["ghost", "hooks"])
def test_gradient_canaries_go_through_the_clipped_sum(tmp_path, monkeypatch, clipping):
    """Without noise, each canary's score is C·(times drawn)/B plus the other canaries' overlap (rebuilt here from the
    sampler's draws and the directions' key) plus the real rows' projection (small: |·| < 0.5 C/B); N and q count all
    m canaries; both engines."""
    tr = _trainer(tmp_path, clipping=clipping)
    state = tr.dp.audit
    key, bits = state.key, state.canaries.included
    assert tr.privacy_spec.dataset_size == N_REAL + 100 and tr.clipping == clipping
    assert len(tr.train_dataset) == N_REAL + int(bits.sum())
    seen = _instrumented(tr, monkeypatch)
    tr.train()
    want, draws = _expected(tr, seen, key, bits, clip=1.0)
    assert draws.sum() >= 10 and not draws[~bits].any()  # excluded canaries are never drawn as rows
    steps = np.array(seen["steps"])
    assert steps.shape == want.shape == (3, 100)
    # step by step, the rest is the real rows' projection on u_k (seen up to 0.21 C; a canary drawn is 1 C)
    assert np.abs(steps - want).max() < 0.5, np.abs(steps - want).max()
    assert np.allclose(seen["projection_sum"], steps.sum(axis=0), rtol=0, atol=1e-9)
    # the score: each step's log-likelihood ratio at the planned q and σ, summed
    q, sigma = tr.privacy_spec.sample_rate, tr.privacy_spec.noise_multiplier
    assert np.allclose(seen["scores"], _llr(steps, q, sigma).sum(axis=0), rtol=1e-12, atol=1e-12)
    drawn, never = draws > 0, draws == 0
    assert seen["scores"][drawn].min() > seen["scores"][never].max()  # no noise: the drawn canaries stand out
    rec = tr.audit_record
    assert rec["kind"] == "white-box" and rec["score"] == hooks.GRADIENT_SCORE and rec["canaries"] == 100
    g = rec["gaussian_dp"]
    assert g["confidence"] == rec["confidence"] == 0.95 and g["delta"] == 1e-5 and g["mu_lower_bound"] >= 0


def test_a_wider_clip_in_the_engine_reaches_the_canaries(tmp_path, monkeypatch):
    """The clip × 10 break (C × 10 during the engine's call; hf_dp.audit.one_run.partial_break) lets 10 C of every
    canary through: the canaries are clipped where the examples are, not on a side channel."""
    from hf_dp.audit.one_run import partial_break

    tr = _trainer(tmp_path)
    partial_break(tr.dp, "clip_x10")
    key, bits = tr.dp.audit.key, tr.dp.audit.canaries.included
    seen = _instrumented(tr, monkeypatch)
    tr.train()
    want, _ = _expected(tr, seen, key, bits, clip=10.0)
    assert np.abs(np.array(seen["steps"]) - want).max() < 2.0


def _bit_encodings(bits) -> list[bytes]:
    import json

    out = []
    for b in (np.asarray(bits, bool), ~np.asarray(bits, bool)):
        out += ["".join("1" if x else "0" for x in b).encode(), np.packbits(b).tobytes(),
                np.packbits(b, bitorder="little").tobytes(), json.dumps(b.tolist()).encode(),
                json.dumps(b.astype(int).tolist()).encode(), json.dumps(np.flatnonzero(b).tolist()).encode(),
                str(b.astype(int).tolist()).encode(), str(np.flatnonzero(b).tolist()).encode()]
    return out


def test_the_draw_stays_in_memory(tmp_path):
    """The bits, the rows' canary ids and the tagged loader are never pickled, written or kept: after train() they are
    dropped (with the directions' key and the gradient sum); no file under output_dir (checkpoint included) holds them;
    a second train() and a new training loader are refused."""
    import json

    tr = _trainer(tmp_path, steps=2, save_strategy="steps", save_steps=1)
    state = tr.dp.audit
    bits = state.canaries.included
    loader = tr.get_train_dataloader()
    for obj in (state, loader.dataset):
        with pytest.raises(TypeError, match="pickled"):
            pickle.dumps(obj)
    tr.train()
    assert state.row_canary is None and state.key is None and state.directions is None
    assert state.score_sum is None and state.projection_sum is None and state._projector is None
    # the loader built before train() holds no canary id any more
    assert {loader.dataset[i][hooks.CANARY_KEY] for i in range(N_REAL, len(loader.dataset))} <= {-1}
    tr.save_model()
    privacy = json.loads((tmp_path / "privacy.json").read_text())
    assert privacy["audit"]["kind"] == "white-box" and "gaussian_dp" in privacy["audit"]
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any("checkpoint-1" in str(p) for p in files)
    for path in files:
        data = path.read_bytes()
        for enc in _bit_encodings(bits):
            assert enc not in data, (path, enc[:40])
    with pytest.raises(ValueError, match="one train"):
        tr.train()
    with pytest.raises(ValueError, match="one train"):
        tr.get_train_dataloader()


def test_refusals_in_one_sentence(tmp_path):
    from hf_dp import DPTrainingArguments

    with pytest.raises(ValueError, match="--audit_kind must be one of input, gradient"):
        DPTrainingArguments(output_dir=str(tmp_path), optim="dp_sgd", noise_multiplier=1.0, audit_canaries=100,
                            audit_kind="weights")
    tr = _trainer(tmp_path, steps=1, optim="dp_sgd_l2", weight_decay=0.1)
    with pytest.raises(ValueError, match="per-sample transform"):
        tr.train()
    assert tr.ledger.steps == 0  # refused before any noisy step


def _rows(out: str) -> dict:
    rows = {}
    for line in out.splitlines():
        f = line.split()
        if len(f) > 16 and f[1] == "gradient":
            rows[f[2]] = dict(eps_lower=float(f[9]), eps_claim=float(f[10]), verdict=f[12], eps_gdp=float(f[15]), gdp=f[16])
    return rows


def test_command_line_one_run_gradient_flags_no_noise_and_a_tenth_of_the_noise(capsys):
    """python -m hf_dp.audit --one_run --canary_kind gradient: 100 canaries, 100 real rows, q = 0.5, 10 steps, σ = 5
    (claim 1.29): no noise and noise ÷ 10 are VIOLATIONs (by the assumption-free bound; seen 99/100 and 49/50 guesses
    right, ε̂ 2.67 and 1.94), the real run is ok by both estimates (seen 34/50, ε̂ 0.03)."""
    from hf_dp.audit.many_runs import main

    code = main(["--one_run", "--canary_kind", "gradient", "--variant", "real,no_noise,noise_div10", "--canaries", "100",
                 "--background", "100", "--steps", "10", "--sample_rate", "0.5", "--noise_multiplier", "5"])
    out = capsys.readouterr().out
    rows = _rows(out)
    assert code == 0 and set(rows) == {"real", "no_noise", "noise_div10"}, out
    assert rows["real"]["verdict"] == "ok" and rows["real"]["gdp"] == "ok", out
    for v in ("no_noise", "noise_div10"):
        assert rows[v]["verdict"] == "VIOLATION", out


@pytest.mark.parametrize("kind", ["gradient", "input"])
def test_under_a_unit_column_the_logged_example_count_is_units_plus_canaries(tmp_path, kind):
    """HF logs ``num_examples`` and derives ``train_samples_per_second`` (train metrics, trainer_state.json) from it:
    with canaries under --privacy_unit_column it must be the public N = units + m, never the private row count. Two
    training sets with the same 20 users, one row each or five rows each, must report the same number."""
    import datasets
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    from hf_dp import DPTrainer, DPTrainingArguments

    def rows(rows_per_user):
        rng = np.random.default_rng(0)
        n = 20 * rows_per_user
        x = rng.integers(5, 100, size=(n, 8))
        return datasets.Dataset.from_dict({"input_ids": x.tolist(), "attention_mask": np.ones_like(x).tolist(),
                                           "labels": (x[:, 0] < 50).astype(int).tolist(),
                                           "user": [f"u{i // rows_per_user}" for i in range(n)]})

    seen = []
    for per_user in (1, 5):
        torch.manual_seed(0)
        model = BertForSequenceClassification(BertConfig(
            vocab_size=512, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
            max_position_embeddings=32, num_labels=2))
        args = DPTrainingArguments(
            output_dir=str(tmp_path / f"out{per_user}"), optim="dp_sgd", noise_multiplier=2.0,
            per_sample_max_grad_norm=1.0, per_device_train_batch_size=20, max_steps=1, trainable="all", report_to=[],
            use_cpu=True, disable_tqdm=True, save_strategy="no", logging_strategy="no", audit_canaries=100,
            audit_canary_length=8, audit_kind=kind, privacy_unit_column="user", remove_unused_columns=False)
        tr = DPTrainer(model=model, args=args, train_dataset=rows(per_user))
        seen.append((tr.num_units, tr.num_examples(tr.get_train_dataloader())))
    assert seen[0] == seen[1] == (120, 120), seen


def test_the_step_likelihood_ratio_sees_more_than_the_summed_projection():
    """The score's statistic on the mechanism it models (each step: x = N(0, σ²), plus 1 with probability q for an
    included canary), the main job's q, σ and T: the per-step log-likelihood ratio separates included from excluded
    canaries better than the summed projection Σ_t x_t (area under the ROC curve), and it equals the closed form."""
    from hf_dp.audit.canary_kinds import step_log_likelihood_ratio

    rng = np.random.default_rng(42)
    m, q, sigma, T = 4000, 0.0576, 1.1, 90
    included = rng.random(m) < 0.5
    x = ((rng.random((m, T)) < q) & included[:, None]) + sigma * rng.standard_normal((m, T))
    llr = step_log_likelihood_ratio(x, q, sigma)
    assert np.allclose(llr, _llr(x, q, sigma), rtol=1e-12, atol=1e-12)

    def auc(score):
        rank = np.argsort(np.argsort(score)) + 1
        n1 = included.sum()
        return (rank[included].sum() - n1 * (n1 + 1) / 2) / (n1 * (m - n1))

    a_sum, a_llr = auc(x.sum(axis=1)), auc(llr.sum(axis=1))
    assert a_llr > a_sum + 0.01 and a_sum > 0.55, (a_llr, a_sum)
    # no noise claimed (σ = 0): the sum itself; a huge x does not overflow
    assert np.array_equal(step_log_likelihood_ratio(x[:2], q, 0.0), x[:2])
    assert np.isfinite(step_log_likelihood_ratio(np.array([1e6, -1e6]), q, sigma)).all()


@pytest.mark.parametrize("kind", ["input", "gradient"])
def test_an_exception_in_train_drops_the_draw_and_refuses_another_train(tmp_path, kind):
    """A train() that raises (here a callback at the first step) drops the inclusion bits and the gradient scores at
    once (before, they survived, and a second train() reused the same draw and added to the same scores)."""
    from transformers import TrainerCallback

    class Boom(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            raise RuntimeError("boom")

    tr = _trainer(tmp_path, steps=3, audit_kind=kind)
    tr.add_callback(Boom())
    with pytest.raises(RuntimeError, match="boom"):
        tr.train()
    st = tr.dp.audit
    assert st.trained and st.canaries._included is None and st.row_canary is None and st.score_sum is None
    assert st._projector is None and getattr(tr, "audit_record", None) is None  # no audit of a failed run
    with pytest.raises(ValueError, match="one train"):
        tr.train()
