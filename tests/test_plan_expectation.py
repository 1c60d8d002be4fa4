"""Issue 53 item 3: the planner always states an expectation before training — calibrated, or one line "no calibrated
expectation for this model/task: calibrated on …" — never silence (R_run 0.27 and 0.619 runs ended as constant
predictors with no line); the recipes' summary compares the result with it. And item 2's planner figure:
``python -m hf_dp.plan ... --plot FILE`` writes a PNG."""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import subprocess
import sys
from pathlib import Path

import pytest

from hf_dp import DPTrainer
from hf_dp import plan as planner
from hf_dp.plan import CALIBRATED_ON, CONSTANT_R_RUN, CONSTANT_R_RUN_ALL, PlanRow, calibrated_for, run_block, run_expectation
from hf_dp.plan.calibration import LEARNED, LEARNED_POINTS
from hf_dp.plan.lm_verdict import not_calibrated_for

from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore")
REPO = Path(__file__).resolve().parents[1]
EXPECTED = "hf_dp plan: expected result of this plan: at least 3 points above the constant predictor"
NONE = "no calibrated expectation for this model/task: calibrated on"


@pytest.fixture(autouse=True)
def no_disk_cache(monkeypatch):
    monkeypatch.setenv(planner.CACHE_ENV, "off")


def _row(r_run: float) -> PlanRow:
    sigma, b, t = 1.0, 100, 400  # R_run = √d·σ/(B√T) = √d/2000
    return PlanRow(batch_size=b, epochs=40.0, steps=t, sample_rate=0.1, sigma=sigma, n=1000,
                   params=int((r_run * 1.0005 * b * math.sqrt(t) / sigma) ** 2))


def _block(r_run: float, **kw):
    row = _row(r_run)
    text, warning = run_block(n=row.n, batch_size=row.batch_size, steps=row.steps, sigma=row.sigma, delta=1e-5,
                              accountant="prv", max_grad_norm=0.1, params=row.params, epsilon=None, **kw)
    return row, text, warning or ""


@pytest.mark.parametrize("r_run", [0.05, 0.27, 0.619, 0.74])
def test_a_calibrated_model_below_the_threshold_is_told_what_to_expect(r_run):
    """The issue's runs (R_run 0.27 and 0.619) printed nothing: now the block's last line states the expectation and
    what it was measured on, and that a harder task can still end at the constant predictor."""
    row, block, warning = _block(r_run)
    assert math.isclose(row.r_run, r_run, rel_tol=2e-3)
    last = block.splitlines()[-1].strip()
    assert last.startswith(EXPECTED) and "QNLI +6.4 to +15, SST-2 +25.7 to +30.8" in last
    assert "calibrated on BERT-family sequence classifiers" in last and "can still end at the constant predictor" in last
    assert "constant predictor." not in warning and NONE not in block  # no warning below the threshold
    exp = run_expectation(n=row.n, batch_size=row.batch_size, steps=row.steps, sigma=row.sigma, params=row.params)
    assert exp.kind == "learns" and exp.expects_constant is False and not exp.warning and exp.line == last


@pytest.mark.parametrize("r_run, kind", [(0.8, "constant_hard"), (2.0, "constant_hard"), (5.0, "constant")])
def test_above_the_threshold_the_expectation_is_the_constant_predictors_warning(r_run, kind):
    row, block, warning = _block(r_run)
    assert "expected result of this plan" in warning and "the constant predictor" in warning
    assert "expected result" not in block and NONE not in block  # said once, as the warning
    exp = run_expectation(n=row.n, batch_size=row.batch_size, steps=row.steps, sigma=row.sigma, params=row.params)
    assert exp.kind == kind and exp.warning and exp.expects_constant is True and exp.line in warning


@pytest.mark.parametrize("r_run", [0.27, 0.619, 2.0, 5.0])
def test_an_uncalibrated_model_gets_one_line_naming_the_calibration(r_run):
    row, block, warning = _block(r_run, calibrated=False)
    lines = [line.strip() for line in block.splitlines() if NONE in line]
    assert len(lines) == 1 and lines[0].startswith("hf_dp plan: no calibrated expectation for this model/task")
    assert CALIBRATED_ON in lines[0] and "constant predictor" not in warning
    assert ("noise-dominated" in warning) is (r_run > 1)  # the worst-case bound still speaks
    exp = run_expectation(n=row.n, batch_size=row.batch_size, steps=row.steps, sigma=row.sigma, params=row.params,
                          calibrated=False)
    assert exp.kind == "none" and not exp.calibrated and exp.expects_constant is None


@pytest.mark.parametrize("r_run", [0.01, 0.3, 0.74, 0.76, 1.5, 3.9, 4.1, 50.0])
@pytest.mark.parametrize("calibrated", [True, False])
@pytest.mark.parametrize("lm", [None, "pretrained", "random", "sgd", "no_lr"])
def test_never_silence(r_run, calibrated, lm):
    """Every start-of-run block, whatever R_run, model or causal-LM setting, states an expected result or that there
    is no calibrated one."""
    kw = {} if lm is None else dict(causal_lm=True, optim="dp_sgd" if lm == "sgd" else "dp_adamw",
                                    learning_rate=None if lm == "no_lr" else 1e-3)
    if lm == "random":
        with not_calibrated_for("the model starts from random weights (--model_type gpt2)"):
            _, block, warning = _block(r_run, calibrated=calibrated, **kw)
    else:
        _, block, warning = _block(r_run, calibrated=calibrated, **kw)
    text = block + "\n" + warning
    stated = ("expected result of this plan" in text or "is expected to make the model worse" in text
              or "is not expected to make the model worse" in text)
    assert stated or "no calibrated expectation for this model/task: calibrated on" in text, text


def test_the_causal_lm_lines_say_no_calibrated_expectation_when_there_is_no_verdict():
    _, block, _ = _block(0.3, causal_lm=True, optim="dp_sgd", learning_rate=1e-3)
    from hf_dp.plan.lm_verdict import LM_CALIBRATION

    runs = LM_CALIBRATION["runs"]
    assert "no causal-LM verdict" in block and NONE + f" {runs} measured DP fine-tuning runs" in block
    with not_calibrated_for("the model starts from random weights (--model_type gpt2)"):
        _, block, warning = _block(0.3, causal_lm=True, optim="dp_adamw", learning_rate=1e-3)
        exp = run_expectation(n=1000, batch_size=100, steps=400, sigma=1.0, params=10_000, causal_lm=True,
                              optim="dp_adamw", learning_rate=1e-3)
    assert block.splitlines()[-1].strip() == (
        "hf_dp plan (causal LM): no verdict: the model starts from random weights (--model_type gpt2), so no calibrated "
        "expectation for this model/task: calibrated on fine-tuning a pretrained causal LM (benchmarks/RESULTS.md §10)")
    assert exp.kind == "none" and "constant predictor" not in warning
    exp = run_expectation(n=1000, batch_size=100, steps=400, sigma=1.0, params=10_000, causal_lm=True,
                          optim="dp_adamw", learning_rate=1e-3)
    assert exp.kind.startswith("lm_") and exp.calibrated and exp.expects_constant is None


def test_regression_heads_and_non_bert_models_are_not_calibrated():
    from transformers import BertConfig, BertForSequenceClassification

    tiny = dict(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    assert calibrated_for(BertForSequenceClassification(BertConfig(**tiny)))
    assert not calibrated_for(BertForSequenceClassification(BertConfig(**tiny, num_labels=1)))
    assert not calibrated_for(BertForSequenceClassification(BertConfig(**tiny, num_labels=3, problem_type="regression")))


def test_the_learned_numbers_are_those_of_the_measured_runs():
    """LEARNED (what the line says the measured runs below CONSTANT_R_RUN did) is the raw calibration file's."""
    root = REPO / "benchmarks"
    spec = importlib.util.spec_from_file_location("hf_dp_bench_pc_expect", root / "planner_calibration.py")
    pc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(pc)
    rows = [json.loads(x) for x in (root / "results" / "planner_calibration.jsonl").read_text().splitlines() if x]
    below = [r for r in rows if r["planned"]["r_run"] < CONSTANT_R_RUN]
    assert below and all(pc.outcome(r["dev_accuracy"], r["majority"]) == "learned" for r in below)
    assert round(max(r["planned"]["r_run"] for r in below), 3) == LEARNED["largest_r_run"]
    for task, name in (("qnli", "QNLI"), ("sst2", "SST-2")):
        points = [100 * (r["dev_accuracy"] - r["majority"]) for r in below if r["task"] == task]
        assert (round(min(points), 1), round(max(points), 1)) == LEARNED["points"][name]
        assert min(points) >= LEARNED_POINTS
    assert CONSTANT_R_RUN < CONSTANT_R_RUN_ALL


def test_the_trainer_keeps_the_expectation_its_block_stated(tmp_path, caplog, single_thread):
    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=128, seed=0)
    with caplog.at_level(logging.INFO, logger="hf_dp"):
        trainer = DPTrainer(model=make_model(), args=dp_args(tmp_path / "run"), train_dataset=ds,
                            data_collator=make_collator(tok))
    block = [r.getMessage() for r in caplog.records if r.getMessage().startswith("hf_dp plan (public")]
    exp = trainer.dp.plan_expectation
    assert len(block) == 1 and exp is not None and exp.kind == "learns"  # a tiny BERT classifier at R_run 0.56
    assert block[0].splitlines()[-1].strip() == exp.line
    off = DPTrainer(model=make_model(), args=dp_args(tmp_path / "off", disable_dp=True, optim="adamw_torch", epsilon=None,
                                                     dp_seed=None), train_dataset=ds,
                    data_collator=make_collator(tok))
    assert off.dp.plan_expectation is None  # no block, nothing to compare


def test_the_api_states_no_calibrated_expectation_for_a_causal_lm_trained_from_scratch(tmp_path, caplog, single_thread):
    """Issue 53: the causal-LM verdict is calibrated on fine-tuning a pretrained causal LM; DPTrainer gave it for a model
    built from a config too (the recipes already said instead, for --model_type, that there is none). Now the API says
    so in one line for a model trained from scratch; a model loaded with from_pretrained (or a deep copy of one, which
    loses transformers' marks on the loaded weights but keeps its config's name) still gets the verdict."""
    import copy

    import torch
    from datasets import Dataset
    from transformers import DataCollatorForLanguageModeling, GPT2Config, GPT2LMHeadModel

    from hf_dp.plan.lm_verdict import FROM_SCRATCH, trained_from_scratch

    tok = make_tokenizer(tmp_path / "tok")
    g = torch.Generator().manual_seed(0)
    rows = [[tok.cls_token_id] + torch.randint(5, len(tok), (int(torch.randint(3, 12, (1,), generator=g)),),
                                               generator=g).tolist() for _ in range(32)]
    data = Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]})
    config = GPT2Config(vocab_size=len(tok), n_positions=32, n_embd=16, n_layer=2, n_head=2, pad_token_id=tok.pad_token_id)

    def plan_lines(model, name):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="hf_dp"):
            trainer = DPTrainer(model=model, args=dp_args(tmp_path / name, learning_rate=0.1, max_steps=4, trainable="all",
                                                          per_device_train_batch_size=8),
                                train_dataset=data, data_collator=DataCollatorForLanguageModeling(tok, mlm=False))
        said = [x.strip() for r in caplog.records for x in r.getMessage().splitlines() if "hf_dp plan (causal LM)" in x]
        return said, trainer.dp.plan_expectation

    scratch = GPT2LMHeadModel(config)
    assert trained_from_scratch(scratch)
    said, expectation = plan_lines(scratch, "scratch")
    assert said == [f"hf_dp plan (causal LM): no verdict: {FROM_SCRATCH}, so no calibrated expectation for this "
                    "model/task: calibrated on fine-tuning a pretrained causal LM (benchmarks/RESULTS.md §10)"], said
    assert expectation.kind == "none" and "trained from scratch" in expectation.line
    GPT2LMHeadModel(config).save_pretrained(tmp_path / "saved")
    pretrained = GPT2LMHeadModel.from_pretrained(tmp_path / "saved")
    for name, model in (("pretrained", pretrained), ("copy", copy.deepcopy(pretrained))):
        assert not trained_from_scratch(model)
        said, expectation = plan_lines(model, name)
        assert len(said) == 1 and said[0].startswith("hf_dp plan (causal LM): R_step = √d·σ/B"), (name, said)
        assert expectation.kind.startswith("lm_")
    with not_calibrated_for("the model starts from random weights (--model_type gpt2)"):  # a recipe's reason stays
        said, _ = plan_lines(GPT2LMHeadModel(config), "recipe")
    assert said and "(--model_type gpt2)" in said[0]


# ------------------------------------------------------------------------------------------ the recipes' summary


def _summary_module():
    from recipes.common import summary as run

    return run


def _Exp(r_run, calibrated=True):  # an Expectation as the trainer keeps it
    row = _row(r_run)
    return run_expectation(n=row.n, batch_size=row.batch_size, steps=row.steps, sigma=row.sigma, params=row.params,
                           calibrated=calibrated)


def _line(exp, metric, constant, at_or_below):
    run = _summary_module()
    baseline = {"compared": {"accuracy": {"model": metric, "constant": constant}}, "at_or_below": at_or_below,
                "sentence": "…"}
    s = {"task": "custom", "metric_name": "accuracy", "metric": metric, "baseline": baseline, "expectation": exp,
         "wall_time": 1.0}
    rows = dict(line.split(" : ", 1) for line in run.summary_block(s).splitlines() if " : " in line)
    return {k.strip(): v for k, v in rows.items()}.get("planner's expectation")


def test_the_summary_compares_the_result_with_the_expectation():
    line = _line(_Exp(0.27), 0.5121, 0.5054, True)  # the case: expected to learn, ended constant
    assert line == ("expected at least 3 points above the constant predictor on a task no harder than QNLI (planner, "
                    "R_run 0.27), got accuracy 0.5121, at the constant predictor (0.5054): below the expectation")
    assert _line(_Exp(0.27), 0.63, 0.5054, False).endswith("above the constant predictor (0.5054): as expected")
    assert _line(_Exp(2.0), 0.52, 0.5054, True).startswith(
        "expected the constant predictor on a task as hard as QNLI (planner, R_run 2)")
    assert _line(_Exp(2.0), 0.52, 0.5054, True).endswith(": as expected")
    assert _line(_Exp(5.0), 0.74, 0.5092, False).endswith(": better than expected")
    none = _line(_Exp(0.27, calibrated=False), 0.6, 0.5, False)
    assert none.startswith("no calibrated expectation: none (calibrated on SST-2 and QNLI") and "got accuracy 0.6" in none
    run = _summary_module()
    assert "planner's expectation" not in run.summary_block({"task": "t", "wall_time": 1.0})  # no block, no row


def test_the_summary_gets_the_trainers_expectation():
    run = _summary_module()

    class T:
        class dp:
            plan_expectation = "stated"

    assert run.planner_expectation(T()) == "stated" and run.planner_expectation(object()) is None


# ------------------------------------------------------------------------------------------ the planner's figure


def test_cli_writes_the_plan_figure(tmp_path):
    pytest.importorskip("matplotlib")
    png = tmp_path / "plan.png"
    proc = subprocess.run([sys.executable, "-m", "hf_dp.plan", "--n", "2500", "--epsilon", "3", "--params", "1923074",
                           "--batch", "128,256,512", "--epochs", "10", "--accountant", "rdp", "--plot", str(png)],
                          capture_output=True, text=True, timeout=300, cwd=REPO,
                          env={**__import__("os").environ, planner.CACHE_ENV: "off"})
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = png.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and 5_000 < len(data) < 150_000
    assert f"figure written to {png}" in proc.stdout
    assert "expected result of even the recommended plan" in proc.stdout  # R_run 0.88 here: the warning


def test_cli_states_the_expectation_below_the_threshold_too(capsys):
    from hf_dp.plan import cli

    assert cli.main(["--n", "8999", "--epsilon", "3", "--params", "1923074", "--batch", "1024", "--epochs", "10",
                     "--accountant", "rdp", "--no_cache"]) == 0
    out = capsys.readouterr().out
    assert "WARNING" not in out and "hf_dp plan: expected result of the recommended plan: at least 3 points" in out
    assert cli.main(["--n", "8999", "--epsilon", "3", "--batch", "1024", "--epochs", "10", "--accountant", "rdp",
                     "--no_cache"]) == 0
    assert "no expected result without d" in capsys.readouterr().out


def test_plot_figure_is_deterministic_and_works_without_d(tmp_path):
    pytest.importorskip("matplotlib")
    from hf_dp.plan import make_plan
    from hf_dp.plan.figure import write_plan_plot

    with_d = make_plan(2500, 3.0, 1e-5, batch_sizes=(128, 512), epochs=(3, 10), params=1_923_074, accountant="rdp",
                       disk_cache=False)
    a, b = write_plan_plot(with_d, tmp_path / "a.png"), write_plan_plot(with_d, tmp_path / "b.png")
    assert Path(a).read_bytes() == Path(b).read_bytes()
    no_d = make_plan(2500, 3.0, 1e-5, batch_sizes=(128, 512), epochs=(3,), accountant="rdp", disk_cache=False)
    assert Path(write_plan_plot(no_d, tmp_path / "c.png")).read_bytes()[:4] == b"\x89PNG"


def test_cli_plot_without_matplotlib_is_one_error_line(tmp_path, monkeypatch, capsys):
    from hf_dp.plan import cli

    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    assert cli.main(["--n", "1000", "--epsilon", "3", "--plot", str(tmp_path / "x.png")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["error: --plot needs matplotlib (pip install matplotlib)"] and not (tmp_path / "x.png").exists()
