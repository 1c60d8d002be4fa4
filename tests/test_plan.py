"""The privacy–utility planner (hf_dp.plan): σ from the accountant, the steps arithmetic, the documented
objective and warning, the CLI, and the start-of-run block of a DP run (public quantities only)."""

from __future__ import annotations

import inspect
import json
import logging
import math
import os
import subprocess
import sys
import time

import pytest

from hf_dp import DPTrainer
from hf_dp import plan as planner
from hf_dp.plan import CALIBRATION, CONSTANT_R_RUN, CONSTANT_R_RUN_ALL, WARN_R_RUN, PlanRow, make_plan, planned_steps, recommend, run_block, split_batch
from hf_dp.privacy.accounting import calibrate_noise_multiplier, compute_epsilon
from hf_dp.privacy.sampler import PoissonBatchSampler

from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")

N, EPS, DELTA = 1000, 3.0, 1e-5
BATCHES = (50, 100, 200, 400)
EPOCHS = (1, 2)
ACC = "rdp"  # the grid tests use the faster accountant; the PRV path (the default) is checked on one row


@pytest.fixture(autouse=True)
def no_disk_cache(monkeypatch):
    monkeypatch.setenv(planner.CACHE_ENV, "off")


@pytest.fixture(scope="module")
def grid():
    os.environ[planner.CACHE_ENV] = "off"
    try:
        return make_plan(N, EPS, DELTA, batch_sizes=BATCHES, epochs=EPOCHS, params=20_000, accountant=ACC,
                         disk_cache=False, min_steps=0)
    finally:
        del os.environ[planner.CACHE_ENV]


def test_sigma_is_the_accountants_and_meets_the_target(grid):
    assert len(grid.rows) == len(BATCHES) * len(EPOCHS)
    for r in grid.rows:
        q = r.batch_size / N
        assert r.sample_rate == q
        assert r.sigma == calibrate_noise_multiplier(EPS, DELTA, q, r.steps, ACC)
        assert compute_epsilon(r.sigma, q, r.steps, DELTA, ACC) <= EPS
    prv = planner.plan_row(N, EPS, DELTA, 200, 1, params=10, disk_cache=False)  # the default accountant
    assert prv.sigma == calibrate_noise_multiplier(EPS, DELTA, 0.2, 5, "prv")
    assert compute_epsilon(prv.sigma, 0.2, 5, DELTA, "prv") <= EPS


def test_steps_arithmetic_matches_the_sampler(grid):
    for r in grid.rows:
        assert r.steps == math.ceil(r.epochs * PoissonBatchSampler.steps_for_epoch(r.batch_size / N))
    # round(1/q) steps per epoch, as the trainer plans (e.g. N=8999, B=32 → 281 per epoch)
    assert planned_steps(8999, 32, 10) == 2810 and planned_steps(8999, 2048, 3) == 12
    assert planned_steps(67349, 1024, 3) == 3 * round(67349 / 1024)


def test_noise_monotone_where_claimed(grid):
    for e in EPOCHS:
        rows = sorted((r for r in grid.rows if r.epochs == e), key=lambda r: r.batch_size)
        # at fixed epochs: σ rises with B, σ/B falls, and so does the per-epoch noise σ/√(BN)
        assert all(a.sigma < b.sigma for a, b in zip(rows, rows[1:]))
        assert all(a.noise_per_step > b.noise_per_step for a, b in zip(rows, rows[1:]))
        assert all(a.noise_per_epoch > b.noise_per_epoch for a, b in zip(rows, rows[1:]))
    for b in BATCHES:  # at fixed B more epochs need a larger σ
        one, two = (next(r for r in grid.rows if r.batch_size == b and r.epochs == e) for e in EPOCHS)
        assert two.sigma > one.sigma


def _brute_force(rows, d, min_steps=0):
    best = None
    for r in rows:
        if r.steps < min_steps:
            continue
        value = math.sqrt((1 + d * r.sigma**2 / r.batch_size**2) / r.steps)
        if best is None or (value, r.batch_size) < best[0]:
            best = ((value, r.batch_size), r.batch_size)
    return best[1]


@pytest.mark.parametrize("d", [1, 100, 20_000, 10**6, 10**9])
def test_recommendation_minimises_the_documented_bound(d):
    plan = make_plan(N, EPS, DELTA, batch_sizes=BATCHES, epochs=EPOCHS, params=d, accountant=ACC, disk_cache=False,
                     min_steps=0)
    assert plan.budget_epochs == max(EPOCHS)
    at_budget = [r for r in plan.rows if r.epochs == plan.budget_epochs]
    assert plan.batch_size == _brute_force(at_budget, d)
    for e, row in plan.best_per_epochs().items():
        assert row.batch_size == _brute_force([r for r in plan.rows if r.epochs == e], d)


def test_recommendation_grows_with_d_and_is_deterministic():
    kw = dict(epochs=2, accountant=ACC, disk_cache=False, min_steps=0)
    chosen = [recommend(N, EPS, DELTA, d, batch_sizes=BATCHES, **kw).batch_size for d in (1, 10**4, 10**6, 10**9)]
    assert chosen == sorted(chosen) and chosen[0] == min(BATCHES) and chosen[-1] == max(BATCHES)
    a = recommend(N, EPS, DELTA, 20_000, batch_sizes=BATCHES, **kw)
    b = recommend(N, EPS, DELTA, 20_000, batch_sizes=tuple(reversed(BATCHES)), **kw)
    assert (a.batch_size, a.choice.sigma, a.epochs) == (b.batch_size, b.choice.sigma, 2.0)
    assert f"B = {a.batch_size}" in a.summary()


@pytest.mark.parametrize("min_steps", [10, 20, 1000])
def test_min_steps_floor(min_steps):
    plan = make_plan(N, EPS, DELTA, batch_sizes=BATCHES, epochs=EPOCHS, params=10**9, accountant=ACC,
                     disk_cache=False, min_steps=min_steps)
    at_budget = [r for r in plan.rows if r.epochs == plan.budget_epochs]
    if any(r.steps >= min_steps for r in at_budget):
        assert plan.choice.steps >= min_steps
        assert plan.batch_size == _brute_force(at_budget, 10**9, min_steps)
    else:  # nothing qualifies: the candidate with most steps
        assert plan.batch_size == min(BATCHES)


def test_no_recommendation_without_d():
    plan = make_plan(N, EPS, DELTA, batch_sizes=BATCHES, epochs=(1,), accountant=ACC, disk_cache=False)
    assert plan.choice is None and "--params" in plan.summary()
    assert not any(r.noisy for r in plan.rows)


def _row_with_r_run(target: float) -> PlanRow:
    sigma, b, t = 1.0, 100, 400  # R_run = √d·σ/(B√T) = √d/2000
    d = int((target * b * math.sqrt(t) / sigma) ** 2)
    return PlanRow(batch_size=b, epochs=40.0, steps=t, sample_rate=0.1, sigma=sigma, n=1000, params=d)


@pytest.mark.parametrize("r_run, fires", [(0.5, False), (0.99, False), (1.02, True), (5.0, True)])
def test_warning_fires_above_the_threshold_only(r_run, fires):
    row = _row_with_r_run(r_run)
    assert math.isclose(row.r_run, r_run, rel_tol=1e-3)
    assert row.noisy is fires
    assert math.isclose(row.r_run, row.r_step / math.sqrt(row.steps))
    block, warning = run_block(n=row.n, batch_size=row.batch_size, steps=row.steps, sigma=row.sigma, delta=1e-5,
                               accountant="prv", max_grad_norm=0.1, params=row.params, epsilon=None)
    assert ("noise-dominated" in (warning or "")) is fires
    assert "hf_dp plan" in block and f"σ = {row.sigma:.4g}" in block
    if fires:
        assert f"> {WARN_R_RUN:g}" in warning


@pytest.mark.parametrize("factor", [0.5, 0.98, 1.0, 1.02, 3.0])
def test_the_calibrated_expectation_fires_at_its_threshold_with_a_remedy_in_d(factor):
    """Issue 31 item 3: at R_run ≥ CONSTANT_R_RUN (calibrated in benchmarks/RESULTS.md §0b) the run's block says the
    expected result is the constant predictor and how many trainable parameters would bring R_run below it."""
    row = _row_with_r_run(factor * CONSTANT_R_RUN * 1.0005)  # int(d) rounds down: stay on the intended side
    fires = factor >= 1.0
    assert row.constant_expected is fires
    block, warning = run_block(n=row.n, batch_size=row.batch_size, steps=row.steps, sigma=row.sigma, delta=1e-5,
                               accountant="prv", max_grad_norm=0.1, params=row.params, epsilon=None)
    assert ("expected result of this plan on a task as hard as QNLI: the constant predictor" in (warning or "")) is fires
    smaller = PlanRow(**{**{f: getattr(row, f) for f in ("batch_size", "epochs", "steps", "sample_rate", "sigma", "n")},
                         "params": row.max_params})
    assert not smaller.constant_expected  # the d it names is below the threshold ...
    assert PlanRow(**{**smaller.__dict__, "params": row.max_params + 1}).constant_expected  # ... and the largest such d
    if fires:
        assert f"at most {row.max_params:,} trainable parameters" in warning


@pytest.mark.parametrize("factor", [0.98, 1.02])
def test_above_the_all_tasks_threshold_the_message_says_every_task(factor):
    row = _row_with_r_run(factor * CONSTANT_R_RUN_ALL * 1.0005)
    assert row.constant_expected and row.constant_expected_all is (factor > 1)
    _, warning = run_block(n=row.n, batch_size=row.batch_size, steps=row.steps, sigma=row.sigma, delta=1e-5,
                           accountant="prv", max_grad_norm=0.1, params=row.params, epsilon=None)
    assert ("expected result of this plan: the constant predictor" in warning) is (factor > 1)
    assert ("on a task as hard as QNLI" in warning) is (factor < 1)
    if factor < 1:
        assert f"learned at R_run up to {CALIBRATION['easy_learned_up_to']:g}" in warning


def _calibration_rows():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "benchmarks"
    spec = importlib.util.spec_from_file_location("hf_dp_bench_planner_calibration", root / "planner_calibration.py")
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    rows = [json.loads(line) for line in (root / "results" / "planner_calibration.jsonl").read_text().splitlines() if line]
    return pc, rows


def test_the_thresholds_are_those_of_the_measured_runs():
    """Issue 31 item 3: CONSTANT_R_RUN / CONSTANT_R_RUN_ALL and the message's numbers are what the raw calibration
    file says (benchmarks/results/planner_calibration.jsonl; RESULTS.md §0b): at or above CONSTANT_R_RUN every QNLI
    run ended at the constant predictor and some QNLI run below it learned; at or above CONSTANT_R_RUN_ALL every run
    of both tasks did; SST-2 learned up to CALIBRATION['easy_learned_up_to']."""
    pc, rows = _calibration_rows()
    assert {r["task"] for r in rows} == {"qnli", "sst2"}
    assert {float(r["epsilon_target"]) for r in rows} == {1.0, 3.0, 8.0}
    for task in ("qnli", "sst2"):
        sizes = sorted({r["n"] for r in rows if r["task"] == task})
        assert sizes[0] == 1000 and len(sizes) >= 4, (task, sizes)  # 1,000 rows to the full set
    learned = {t: [r["planned"]["r_run"] for r in rows if r["task"] == t and pc.outcome(r["dev_accuracy"], r["majority"]) == "learned"]
               for t in ("qnli", "sst2")}
    const = [(r["task"], r["planned"]["r_run"]) for r in rows if pc.outcome(r["dev_accuracy"], r["majority"]) == "constant"]
    assert max(learned["qnli"]) < CONSTANT_R_RUN <= min(r for t, r in const if t == "qnli")
    assert max(learned["qnli"] + learned["sst2"]) < CONSTANT_R_RUN_ALL  # every run at or above it: constant ...
    assert {t for t, r in const if r >= CONSTANT_R_RUN_ALL} == {"qnli", "sst2"}  # ... and both tasks have such runs
    assert round(max(learned["sst2"]), 2) == CALIBRATION["easy_learned_up_to"]


def test_the_plan_names_the_data_and_epsilon_that_would_leave_the_constant_predictor():
    n, d = 1000, 3_000_000  # MiniLM-sized trainable set on 1,000 rows at ε = 1: deep in the constant region
    plan = recommend(n, 1.0, 1e-5, d, epochs=10, accountant="rdp", disk_cache=False)
    assert plan.choice.constant_expected
    (constant, *_), remedies = plan.warnings(), plan._remedies()
    assert "the constant predictor" in constant and "§0b" in constant
    for key, value in (("n", remedies["n"]), ("epsilon", remedies["epsilon"])):
        if value is None:
            continue
        bigger = {"n": dict(n=value, epsilon=1.0, delta=min(1e-5, 0.5 / value)), "epsilon": dict(n=n, epsilon=value, delta=1e-5)}[key]
        from hf_dp.plan import plan_row

        row = plan_row(bigger["n"], bigger["epsilon"], bigger["delta"], plan.choice.batch_size, 10, accountant="rdp",
                       params=d, disk_cache=False)
        assert not row.constant_expected, (key, value, row.r_run)
        assert (f"about {value:,} training rows" if key == "n" else f"ε = {value:g} at this N") in constant
    assert remedies["n"] or remedies["epsilon"]


def test_cli_prints_the_table(capsys):
    code = planner.main(["--n", str(N), "--epsilon", "3", "--delta", "1e-5", "--batch", "50,100,200",
                         "--epochs", "1,2", "--params", "20000", "--accountant", ACC, "--min_steps", "0", "--no_cache"])
    out = capsys.readouterr().out
    assert code == 0
    assert "sigma/B" in out and "<- recommended" in out and "recommended at a budget of 2 epoch(s)" in out
    for b in (50, 100, 200):
        assert any(line.split()[:2] == ["2", str(b)] for line in out.splitlines())
    assert planner.main(["--n", "10", "--epsilon", "3"]) == 2  # δ = 1e-5 < 1/N, but no batch fits N = 10
    assert "error:" in capsys.readouterr().err


def test_cli_module_runs(tmp_path):
    env = dict(os.environ, **{planner.CACHE_ENV: str(tmp_path / "sigmas.json")})
    cmd = [sys.executable, "-W", "ignore", "-m", "hf_dp.plan", "--n", "1000", "--epsilon", "3", "--batch", "200",
           "--epochs", "1", "--accountant", "rdp"]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300, check=True).stdout
    assert "sigma/B" in out and "no recommendation" in out
    # σ memoised on disk, keyed by public quantities only
    cached = json.loads((tmp_path / "sigmas.json").read_text())
    assert len(cached) == 1 and list(cached.values())[0] == calibrate_noise_multiplier(3.0, 1e-5, 0.2, 5, "rdp")


def test_split_batch():
    assert split_batch(2048) == (64, 32)
    assert split_batch(32) == (32, 1)
    assert split_batch(256, world_size=2, max_per_device=64) == (64, 2)
    with pytest.raises(ValueError):
        split_batch(100, world_size=3)


def test_run_block_takes_public_quantities_only():
    # calibrated: whether the model is of a family the verdict was calibrated on (its class: public); detail: the
    # table or two lines; sigma_note: the caller's words for a given σ's ε (a selection's trial); causal_lm, optim: the
    # model's head is a causal LM's, the update rule's name and its learning rate (public: the causal-LM verdict,
    # hf_dp.plan.lm_verdict) and its schedule (a flag); bands: --noise_bands of banded_sqrt noise (a flag: public)
    allowed = {"n", "batch_size", "steps", "sigma", "delta", "accountant", "max_grad_norm", "params", "epsilon",
               "calibrated", "detail", "sigma_note", "causal_lm", "optim", "learning_rate", "bands", "schedule"}
    assert set(inspect.signature(run_block).parameters) == allowed


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return make_tokenizer(tmp_path_factory.mktemp("tok"))


def test_trainer_logs_the_block_at_start(tok, tmp_path, caplog, single_thread):
    collator = make_collator(tok)
    blocks = []
    for seed in (0, 1):  # same N, different examples: the block must not change
        ds = make_pair_dataset(tok, n=128, seed=seed)
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_dp"):
            trainer = DPTrainer(model=make_model(), args=dp_args(tmp_path / str(seed)), train_dataset=ds,
                                data_collator=collator)
        found = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_dp plan (public")]
        assert len(found) == 1
        blocks.append(found[0])
    spec = trainer.privacy_spec
    d = sum(p.numel() for p in trainer.model.parameters() if p.requires_grad)
    assert blocks[0] == blocks[1]
    assert f"σ = {spec.noise_multiplier:.4g}" in blocks[0] and f"N = 128, B = 16" in blocks[0]
    assert f"T = {spec.planned_steps} steps" in blocks[0] and f"d = {d:,} trainable" in blocks[0]
    # the block's cost on top of the trainer's own calibration
    t0 = time.perf_counter()
    for _ in range(20):
        run_block(n=128, batch_size=16, steps=spec.planned_steps, sigma=spec.noise_multiplier, delta=1e-5,
                  accountant="prv", max_grad_norm=1.0, params=d, epsilon=8.0)
    assert (time.perf_counter() - t0) / 20 < 0.05


def test_the_constant_predictor_expectation_only_for_the_models_it_was_calibrated_on():
    """Issue 44 §2: "Expected result … on a task as hard as QNLI: the constant predictor" was printed for causal-LM
    runs and for models it was never calibrated on (measured with BERT-family sequence classifiers only)."""
    from transformers import BertConfig, BertForSequenceClassification, GPT2Config, GPT2ForSequenceClassification, GPT2LMHeadModel

    from hf_dp.plan import calibrated_for, run_block

    kw = dict(n=1000, batch_size=32, steps=93, sigma=1.5, delta=1e-5, accountant="prv", max_grad_norm=0.1,
              params=2_000_000, epsilon=3.0)
    _, warning = run_block(**kw)
    assert "constant predictor" in warning
    _, warning = run_block(**kw, calibrated=False)
    assert warning and "constant predictor" not in warning and "noise-dominated" in warning
    tiny = dict(n_layer=1, n_embd=8, n_head=2, vocab_size=20)
    assert calibrated_for(BertForSequenceClassification(BertConfig(hidden_size=8, num_hidden_layers=1,
                                                                   num_attention_heads=2, intermediate_size=8)))
    assert not calibrated_for(GPT2LMHeadModel(GPT2Config(**tiny)))
    assert not calibrated_for(GPT2ForSequenceClassification(GPT2Config(**tiny, pad_token_id=0)))


def test_the_start_of_run_block_is_short_and_says_where_the_full_table_is(tok, tmp_path, caplog, single_thread):
    """Issue 44 §2: every DP run printed ~5 long plan lines. By default one summary line, one line of where to see
    more and one of the noise mechanism (issue 52 item 5); the noise figures and the table at DEBUG (``--log_level
    debug``) or ``detail=True``."""
    kw = dict(n=1000, batch_size=32, steps=93, sigma=1.5, delta=1e-5, accountant="prv", max_grad_norm=0.1,
              params=2_000_000, epsilon=3.0)
    short, _ = run_block(**kw)
    full, _ = run_block(**kw, detail=True)
    lines = short.splitlines()
    assert len(lines) == 3 and all(len(line) <= 200 for line in lines), short
    assert lines[0].startswith("hf_dp plan (public") and "σ = 1.5" in lines[0] and "T = 93 steps" in lines[0]
    assert "R_run" in lines[0] and "--log_level debug" in lines[1] and "python -m hf_dp.plan --n 1000" in lines[1]
    assert lines[2].startswith("  noise: independent") and "--noise_comparison" in lines[2]  # the mechanism in use
    assert "sigma/sqrt(BN)" in full and "R_step" in full and "R_epoch" in full
    ds = make_pair_dataset(tok, n=128, seed=0)
    for level, log_level, want_full in ((logging.INFO, "passive", False), (logging.DEBUG, "passive", True),
                                        (logging.INFO, "debug", True)):
        caplog.clear()
        with caplog.at_level(level, logger="hf_dp"):
            DPTrainer(model=make_model(), args=dp_args(tmp_path / f"{level}{log_level}", log_level=log_level), train_dataset=ds,
                      data_collator=make_collator(tok))
        plan = [r for r in caplog.records if r.getMessage().startswith("hf_dp plan (public")]
        assert len(plan) == 1 and plan[0].levelno == logging.INFO  # the full table at INFO, when asked
        assert ("sigma/sqrt(BN)" in plan[0].getMessage()) is want_full
        # two lines and the noise mechanism's, then the expected result (issue 53 item 3: a line of the block when it
        # is not a warning)
        message = plan[0].getMessage().splitlines()
        assert (len(message) == 4) is not want_full and "expected result of this plan" in message[-1]
        assert message[-2].startswith("  noise: independent")
