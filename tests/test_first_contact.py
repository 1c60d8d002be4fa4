"""Issue 31 (first contact): refusals come before any expensive work — checked by ORDER, not by timing: the data
loader / tokenizer is replaced by one that fails the test if it is reached."""

from __future__ import annotations

import json
import os
import re

import pytest

from tests import test_recipes as _recipes
from tests.test_recipes import _run, _sst2_files, _tiny_argv

glue, tiny_bert = _recipes.glue, _recipes.tiny_bert  # the recipe tests' fixtures (module-scoped)


def _forbid(monkeypatch, glue, *names):
    for name in names:
        def boom(*a, _name=name, **k):
            raise AssertionError(f"{_name} was reached before the refusal")
        monkeypatch.setattr(glue, name, boom)


def test_resume_true_on_an_empty_output_dir_is_refused_before_reading_data(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    _forbid(monkeypatch, glue, "load_raw_datasets", "preprocess")
    data = _sst2_files(tmp_path)
    code, _, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, tmp_path / "empty", "--max_steps", "2",
                                                 "--resume_from_checkpoint", "True"))
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: --resume_from_checkpoint True: nothing to resume"), err[-2000:]
    assert "Traceback" not in err


def test_resume_from_a_folder_that_is_not_a_checkpoint_is_refused_before_reading_data(glue, tiny_bert, tmp_path, capsys,
                                                                                       monkeypatch):
    _forbid(monkeypatch, glue, "load_raw_datasets", "preprocess")
    (tmp_path / "not_a_checkpoint").mkdir()
    code, _, err = _run(glue, capsys, _tiny_argv(tiny_bert, _sst2_files(tmp_path), tmp_path / "o", "--max_steps", "2",
                                                 "--resume_from_checkpoint", str(tmp_path / "not_a_checkpoint")))
    last = err.strip().splitlines()[-1]
    assert code == 2 and "not a complete hf_dp checkpoint" in last, err[-2000:]


def test_an_unloadable_model_is_refused_before_reading_data(glue, tmp_path, capsys, monkeypatch):
    """Offline, a Hub id that is not cached (the default bert-base-cased on a machine without the Hub): the error comes
    before the data is read (it came after loading the data and computing the plan)."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    _forbid(monkeypatch, glue, "load_raw_datasets", "preprocess", "load_model_and_tokenizer")
    code, _, err = _run(glue, capsys, ["--task_name", "sst2", "--train_file", str(_sst2_files(tmp_path)),
                                       "--model_name_or_path", "hf-dp-no-such-org/no-such-model-31",
                                       "--output_dir", str(tmp_path / "o")])
    last = err.strip().splitlines()[-1]
    assert code == 2 and last.startswith("error: could not load model 'hf-dp-no-such-org/no-such-model-31'"), err[-2000:]
    assert "--model_name_or_path minilm" in last


def test_a_resume_with_changed_settings_is_refused_before_tokenizing(glue, tiny_bert, tmp_path, capsys, monkeypatch):
    data = _sst2_files(tmp_path)
    out = tmp_path / "run"
    code, _, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, out, "--max_steps", "2", "--save_steps", "2"))
    assert code == 0, err[-3000:]
    marker = json.loads((out / "checkpoint-2" / "hf_dp_checkpoint.json").read_text())
    assert marker["privacy_spec"]["max_grad_norm"] == pytest.approx(0.1)
    _forbid(monkeypatch, glue, "preprocess")
    for flags, field in ((["--per_sample_max_grad_norm", "0.5"], "max_grad_norm"),
                         (["--noise_multiplier", "2.0"], "noise_multiplier"),
                         (["--per_device_train_batch_size", "8"], "sample_rate")):
        argv = _tiny_argv(tiny_bert, data, out, "--max_steps", "4", "--resume_from_checkpoint", "True")
        for flag, value in zip(flags[::2], flags[1::2]):
            if flag in argv:
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
        code, _, err = _run(glue, capsys, argv)
        last = err.strip().splitlines()[-1]
        assert code == 2 and "refusing to resume" in last and f"{field}: checkpoint" in last, err[-2000:]
        assert "Traceback" not in err


# ------------------------------------------------------------------------------------------ python -m hf_dp.plan


def test_plan_counts_d_from_a_model_and_prints_the_flags_to_run_it(tiny_bert, capsys):
    from transformers import AutoModelForSequenceClassification

    from hf_dp import plan
    from hf_dp.models import apply_trainable

    expected = apply_trainable(AutoModelForSequenceClassification.from_pretrained(tiny_bert), "last_block")[1].num_trainable
    code = plan.main(["--n", "2000", "--epsilon", "3", "--model_name_or_path", tiny_bert, "--batch", "16,128",
                      "--epochs", "1", "--min_steps", "1", "--no_cache"])
    out = capsys.readouterr().out
    assert code == 0
    assert f"d = {expected:,} trainable parameters" in out
    # progress comes first, before the calibration's table
    assert out.index("calibrating σ") < out.index("[1/2] B = 16") < out.index("[2/2] B = 128") < out.index("sigma/B")
    flags = out.split("to train with this plan", 1)[1].splitlines()[1].split()
    b = int(flags[flags.index("--per_device_train_batch_size") + 1]) * int(flags[flags.index("--gradient_accumulation_steps") + 1])
    chosen = int(re.search(r"logical batch B = (\d+)", out).group(1))
    assert b == chosen and flags[flags.index("--learning_rate") + 1] == f"{plan.PLANNED_LR['dp_adamw']:g}"
    assert flags[flags.index("--epsilon") + 1] == "3" and flags[flags.index("--num_train_epochs") + 1] == "1"


def test_plan_counts_other_trainable_sets_and_refuses_both_ways_of_giving_d(tiny_bert, capsys):
    from hf_dp import plan

    last, head = (plan.count_trainable(tiny_bert, t) for t in ("last_block", "head"))
    assert 0 < head < last
    assert plan.main(["--n", "2000", "--epsilon", "3", "--params", "10", "--model_name_or_path", tiny_bert]) == 2
    assert "not both" in capsys.readouterr().err


def test_plan_help_explains_epsilon_and_delta(capsys):
    from hf_dp.plan import cli

    helps = {a.dest: a.help for a in cli.build_parser()._actions}
    assert helps["epsilon"] and "budget" in helps["epsilon"]
    assert helps["delta"] and "1/N" in helps["delta"]


# ------------------------------------------------------------------------------------------ the release a push uploads


def test_push_and_the_push_later_command_upload_only_the_release_files(tmp_path, monkeypatch):
    """README: the release is model, tokenizer, card and privacy.json. On the pre-issue-31 code the push (and the
    push-later command) also uploaded training_args.bin and hf_dp_epsilon_spent.json."""
    import fnmatch
    from types import SimpleNamespace

    from huggingface_hub import HfApi

    from recipes.common import run as run_mod

    release = {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
               "special_tokens_map.json", "README.md", "privacy.json"}
    records = {"training_args.bin", "hf_dp_epsilon_spent.json", "all_results.json", "train_results.json",
               "eval_results.json", "trainer_state.json", "predict_results_sst2.txt"}
    for name in release | records:
        (tmp_path / name).write_text("x")
    (tmp_path / "checkpoint-2").mkdir()
    uploads = []
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **kw: SimpleNamespace(repo_id=repo_id))

    def fake_upload(self, *, repo_id, folder_path, ignore_patterns=None, **kw):
        uploads.append({n for n in os.listdir(folder_path) if not any(fnmatch.fnmatch(n, p) for p in ignore_patterns)})

    monkeypatch.setattr(HfApi, "upload_folder", fake_upload)
    args = SimpleNamespace(hub_model_id="someone/x", hub_private_repo=False, hub_token=None, hub_revision=None)
    assert run_mod.push_folder(str(tmp_path), args)["ok"]
    assert uploads == [release]

    def failing(self, **kw):
        raise OSError("offline")

    monkeypatch.setattr(HfApi, "upload_folder", failing)
    result = run_mod.push_folder(str(tmp_path), args)
    assert not result["ok"]
    patterns = eval(result["command"].split("ignore_patterns=", 1)[1].rsplit(")", 1)[0])  # the command's own list
    assert {n for n in release | records if not any(fnmatch.fnmatch(n, p) for p in patterns)} == release


# ------------------------------------------------------------------------------------------ cards from the Python API


def test_python_api_card_fills_base_model_task_labels_data_and_title(tmp_path):
    """On the pre-issue-31 code a DPTrainer run from the Python API wrote `Base model: not recorded`, `Task: not
    recorded`, `Fine-tuning data: not recorded` and the output folder's name as the title."""
    from datasets import Dataset, DatasetInfo

    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    plain = make_pair_dataset(tok, n=64)
    ds = Dataset.from_dict(plain.to_dict(), info=DatasetInfo(dataset_name="someone/pairs", config_name="small"))
    model = make_model()
    model.config._name_or_path = "someone/tiny-bert"  # as from_pretrained("someone/tiny-bert") records it
    model.config.id2label, model.config.label2id = {0: "different", 1: "same"}, {"different": 0, "same": 1}
    trainer = DPTrainer(model=model, args=dp_args(tmp_path / "out", max_steps=1), train_dataset=ds,
                        data_collator=make_collator(tok))
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    card = (tmp_path / "out" / "README.md").read_text()
    body = card.split("\n---\n", 1)[1]
    assert "- **Base model:** someone/tiny-bert" in body
    assert "- **Task:** sequence classification — labels: different, same" in body
    assert "- **Fine-tuning data:** `someone/pairs` (config `small`), 64 training examples" in body
    title = body.split("\n# ", 1)[1].splitlines()[0]
    assert title == "tiny-bert-dp" and "# out\n" not in card
    assert "not recorded" not in body.split("## Model", 1)[1].split("##", 1)[0]


def test_card_numbers_read_as_the_log_writes_them_and_the_loss_is_explained():
    from hf_dp.hub import render_model_card

    report = {"hf_dp_version": "0", "epsilon": 2.99, "delta": 1e-5, "accountant": "prv", "dataset_size": 8999,
              "steps": 1234, "epochs": 10.241111, "expected_batch_size": 1024.0, "sample_rate": 0.1138,
              "noise_multiplier": 1.79, "max_grad_norm": 0.1}
    card = render_model_card(report, base_model="b", task_name="qnli", eval_results={"eval_accuracy": 0.63,
                                                                                     "eval_loss": 2.07})
    assert "- **Training examples (N):** 8,999" in card and "| steps | 1,234 |" in card
    assert "| expected (logical) batch size | 1,024 |" in card
    assert "q × steps) | 10.2 |" in card and "10.2411" not in card.split("\n---\n", 1)[1]  # the YAML keeps the raw value
    loss_row = [line for line in card.splitlines() if line.startswith("| loss")][0]
    assert "calibration" in loss_row and "2.07" in loss_row


def test_readme_states_the_number_of_misuse_cases_docs_misuse_lists():
    """README said 62 tested cases while docs/misuse.md listed 64 (issue 31 §9)."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    doc = open(os.path.join(root, "docs", "misuse.md"), encoding="utf-8").read()
    first_table = re.split(r"^#{2,3} ", doc, maxsplit=1, flags=re.M)[0]
    rows = len(re.findall(r"^\| `[\w-]+` \|", first_table, flags=re.M))
    readme = open(os.path.join(root, "README.md"), encoding="utf-8").read()
    stated = int(re.search(r"docs/misuse\.md\) \((\d+) tested cases", readme).group(1))
    assert stated == rows, f"README says {stated} tested misuse cases, docs/misuse.md's table has {rows}"


# ------------------------------------------------------------------------------------------ recipe --help


def _help_text(glue, capsys, *argv):
    with pytest.raises(SystemExit) as exc:
        glue.parse_args(list(argv))
    assert exc.value.code == 0
    return capsys.readouterr().out


def test_help_is_short_dp_group_first_with_optim_and_every_dp_field(glue, capsys):
    import dataclasses

    from transformers import TrainingArguments

    from hf_dp import DPTrainingArguments

    text = _help_text(glue, capsys, "--task_name", "qnli", "--help")
    full = _help_text(glue, capsys, "--task_name", "qnli", "--help-all")
    assert len(text.splitlines()) < 450 < len(full.splitlines())  # 932 lines before issue 31
    assert "\n  --fp16 " not in text and "\n  --fp16 " in full and "--help-all" in text
    dp_group = text.split("hf_dp: differential privacy and speed:", 1)[1].split("\ndata (", 1)[0]
    assert dp_group.index("\n  --optim ") < dp_group.index("\n  --epsilon ")
    own = {f.name for f in dataclasses.fields(DPTrainingArguments)} - {f.name for f in dataclasses.fields(TrainingArguments)}
    missing = [name for name in own if f"\n  --{name} " not in dp_group]
    assert not missing, f"DPTrainingArguments fields not in the DP group of --help: {missing}"


def test_qnli_help_says_its_own_usage():
    from tests.test_recipes import _subprocess

    proc = _subprocess("qnli.py", "--help", timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage: python recipes/qnli.py") and "recipes/glue.py [--config" not in proc.stdout


def test_qnli_preset_trains_two_blocks_at_five_epochs_with_the_planners_batch(glue, tmp_path):
    """Issue 31 item 1: the README's command (qnli.py, no batch flags) runs the main job's preset — last_k:2 at a
    5-epoch budget — and the preset's epochs leave the batch to the planner; a user's flags still override it."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("hf_dp_recipe_qnli_preset", _recipes.RECIPES / "qnli.py")
    qnli = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(qnli)
    *_, args = glue.parse_args(["--output_dir", str(tmp_path / "o"), "--epsilon", "3"], defaults=qnli.QNLI_DEFAULTS)
    assert args.trainable == "last_k:2" and args.num_train_epochs == 5.0 and args.cache_frozen_features
    assert "num_train_epochs" not in args._hf_dp_explicit and "trainable" in args._hf_dp_explicit
    from recipes.common.args import PLANNER_KEYS

    assert not PLANNER_KEYS & args._hf_dp_explicit  # the planner chooses B (recipes.common.run.apply_plan)
    *_, mine = glue.parse_args(["--output_dir", str(tmp_path / "o"), "--trainable", "last_block", "--num_train_epochs", "10"],
                     defaults=qnli.QNLI_DEFAULTS)
    assert mine.trainable == "last_block" and mine.num_train_epochs == 10.0 and "num_train_epochs" in mine._hf_dp_explicit


# ------------------------------------------------------------------------------------------ log noise


def test_the_new_heads_load_report_is_one_plain_line_and_other_reports_stay(tmp_path):
    import logging

    from transformers import AutoModelForSequenceClassification, BertConfig, BertModel

    from recipes.common.logs import new_head_line, quiet_load_reports

    config = BertConfig(vocab_size=50, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
    BertModel(config).save_pretrained(str(tmp_path / "body"))  # no classifier: from_pretrained creates a new head
    seen = []

    class Keep(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    quiet_load_reports()
    handler = Keep()
    logging.getLogger("transformers").addHandler(handler)
    try:
        AutoModelForSequenceClassification.from_pretrained(str(tmp_path / "body"), num_labels=2)
    finally:
        logging.getLogger("transformers").removeHandler(handler)
    reports = [m for m in seen if "classifier" in m]
    assert len(reports) == 1 and "\n" not in reports[0] and "\x1b[" not in reports[0] and "|" not in reports[0]
    assert "task head (classifier.bias, classifier.weight) is new" in reports[0]
    other = ("\x1b[1mBertForSequenceClassification LOAD REPORT\x1b[0m from: x\nKey | Status |\n---+---\n"
             "classifier.bias | MISSING |\nbert.encoder.layer.0.attention.self.query.weight | MISSING |\n")
    assert new_head_line(other) is None  # a missing body weight keeps the full report


def test_pin_memory_only_with_an_accelerator_and_metrics_printed_once(glue, tiny_bert, tmp_path, capsys):
    from recipes.common.logs import pin_memory_default

    data = _sst2_files(tmp_path)
    *_, args = glue.parse_args(_tiny_argv(tiny_bert, data, tmp_path / "o", "--max_steps", "1"))
    assert args.dataloader_pin_memory is pin_memory_default()
    *_, args = glue.parse_args(_tiny_argv(tiny_bert, data, tmp_path / "o", "--dataloader_pin_memory", "true"))
    assert args.dataloader_pin_memory is True  # given: kept
    code, out, err = _run(glue, capsys, _tiny_argv(tiny_bert, data, tmp_path / "run", "--max_steps", "1"))
    assert code == 0, err[-3000:]
    assert out.count("eval_accuracy") == 1 and "***** eval metrics *****" not in out
    if not pin_memory_default():
        assert "pin_memory" not in err


def test_the_quick_tiers_slow_list_names_tests_that_exist():
    """README's quick tier (-m "not slow") deselects tests/conftest.py's SLOW_FILES and SLOW_TESTS: a renamed test or
    file would silently move back into the quick tier, so every entry must name something that exists."""
    import re
    from pathlib import Path

    from tests.conftest import SLOW_FILES, SLOW_TESTS

    here = Path(__file__).parent
    names = set()
    for path in here.glob("test_*.py"):
        names.update(re.findall(r"^def (test_\w+)", path.read_text(encoding="utf-8"), re.M))
    assert all((here / f).is_file() for f in SLOW_FILES)
    assert [s for s in SLOW_TESTS if not any(s in n for n in names)] == []
