"""recipes/dpo.py (issue 51): DP DPO and DP reward modelling on a tiny preference jsonl, end to end, and its one-line
errors.

A tiny Llama from --model_type/--config_overrides, the tests' 60-word WordPiece tokenizer, prompt/chosen/rejected pairs
of 8 users (and conversational pairs: lists of role/content messages). The run prints ε and the held-out preference
accuracy, the release's privacy.json names the unit and N; what DP refuses is one `error:` line before any model.
"""

from __future__ import annotations

import json
import random
import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from helpers import TINY_LLAMA_ARGS, WORDS, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
LLAMA = TINY_LLAMA_ARGS


def _pairs(path: Path, n: int, users: int, seed: int, conversational: bool = False) -> None:
    r = random.Random(seed)
    say = lambda lo, hi: " ".join(r.choice(WORDS) for _ in range(r.randint(lo, hi)))  # noqa: E731
    with open(path, "w") as f:
        for i in range(n):
            if conversational:
                row = {"prompt": [{"role": "user", "content": say(2, 5)}],
                       "chosen": [{"role": "assistant", "content": say(1, 4)}],
                       "rejected": [{"role": "assistant", "content": say(1, 4)}]}
            else:
                row = {"prompt": say(2, 5), "chosen": " " + say(1, 4), "rejected": " " + say(1, 4)}
            f.write(json.dumps({"user_id": f"user{i % users}", **row}) + "\n")


@pytest.fixture
def files(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    tok.save_pretrained(tmp_path / "tok")
    _pairs(tmp_path / "pairs.jsonl", 32, 8, 0)
    _pairs(tmp_path / "dev.jsonl", 8, 8, 1)
    _pairs(tmp_path / "chats.jsonl", 32, 8, 2, conversational=True)
    return tmp_path


def _run(files, *extra, train="pairs.jsonl"):
    from recipes import dpo

    return dpo.main([*LLAMA, "--tokenizer_name", str(files / "tok"), "--train_file", str(files / train),
                     "--validation_file", str(files / "dev.jsonl"), "--output_dir", str(files / "out"),
                     "--per_device_train_batch_size", "2", "--max_steps", "2", "--max_length", "48",
                     "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true", *extra])


def test_a_user_level_dpo_run_prints_epsilon_and_names_the_users(files, capsys):
    assert _run(files, "--privacy_unit_column", "user_id", "--epsilon", "3") == 0
    captured = capsys.readouterr()
    console = captured.out + captured.err
    assert not re.search(r"\b32/32\b|\b32 (examples|rows|pairs)\b", console), console[-3000:]  # the pair count is private
    assert re.search(r"epsilon spent\s+: [\d.]+ \(target 3\)", captured.out)
    assert "preference accuracy = " in captured.out and "user-level DP over preference pairs" in captured.out
    report = json.loads((files / "out" / "release" / "privacy.json").read_text())
    assert report["privacy_unit"]["column"] == "user_id" and report["privacy_unit"]["num_units"] == 8
    assert report["dataset_size"] == 8 and 0 < report["epsilon"] <= 3 + 1e-6
    assert report["dpo"]["trainer"].startswith("DPDPOTrainer") and "LoRA" in report["dpo"]["reference_model"]


def test_conversational_pairs_and_the_reward_model_mode_run(files, capsys):
    assert _run(files, "--privacy_unit_column", "user_id", "--epsilon", "3", "--output_dir", str(files / "chat"),
                train="chats.jsonl") == 0
    out = capsys.readouterr().out
    assert "chat template: the tokenizer has none" in out
    assert _run(files, "--reward_model", "--epsilon", "3", "--output_dir", str(files / "rm")) == 0
    out = capsys.readouterr().out
    assert "whose reward prefers the chosen answer" in out
    report = json.loads((files / "rm" / "release" / "privacy.json").read_text())
    assert report["reward_model"]["trainer"].startswith("DPRewardTrainer") and report["dataset_size"] == 32
    assert "one pair" in report["privacy_unit"]["description"]


@pytest.mark.parametrize("extra,match", [
    (["--privacy_unit_column", "person"], "error: --privacy_unit_column person: the training data has no column 'person'"),
    (["--loss_type", "aot"], "error: --loss_type aot is not supported with DP"),
    (["--precompute_ref_log_probs", "true"], "error: --precompute_ref_log_probs is not supported with DP"),
])
def test_bad_input_is_one_error_line_before_any_model_is_built(files, capsys, extra, match):
    assert _run(files, "--epsilon", "3", *extra) == 2
    err = capsys.readouterr().err
    assert match in err and "Traceback" not in err
    assert not (files / "out" / "release").exists()


def test_the_training_pairs_are_never_called_held_out(files, capsys):
    from recipes import dpo

    assert _run(files, "--epsilon", "3", "--validation_file", str(files / "pairs.jsonl")) == 2  # the training file
    err = capsys.readouterr().err
    assert "error: --validation_file" in err and "is the training file" in err and "Traceback" not in err
    assert not (files / "out" / "release").exists()
    with pytest.raises(dpo.RecipeError, match="is the training split"):
        dpo._refuse_training_pairs_as_validation(dpo.DpoScriptArguments(dataset_name="d", dataset_test_split="train"))
    rows = (files / "pairs.jsonl").read_text().splitlines()  # some validation pairs are training pairs
    (files / "mixed.jsonl").write_text("\n".join(rows[:3] + (files / "dev.jsonl").read_text().splitlines()) + "\n")
    # under DP refused before training (review of issue 51, finding 3: the card's "Not a held-out evaluation" was a bit
    # of membership per validation pair); without DP the run goes on and nothing calls those pairs held out
    assert _run(files, "--privacy_unit_column", "user_id", "--epsilon", "3", "--validation_file",
                str(files / "mixed.jsonl")) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "error: some validation pairs also occur in the training data" in err
    assert "Traceback" not in err and not (files / "out" / "release").exists()
    assert _run(files, "--disable_dp", "--optim", "adamw_torch", "--validation_file", str(files / "mixed.jsonl"),
                "--overwrite_output_dir", "true") == 0
    captured = capsys.readouterr()
    assert "preference accuracy = " in captured.out and "held-out" not in captured.out
    # no count of the validation pairs (some are training pairs) on any line the recipe prints about them (not HF's
    # metrics dict nor the time line, whose timings may hold an 11 on a loaded machine: "about 11 s ... left")
    about = [ln for ln in captured.out.splitlines()
             if re.search(r"pair|validation|held|accuracy", ln, re.I) and not ln.startswith(("{", "training:"))]
    assert about and not any(re.search(r"\b11\b", ln) for ln in about), about
    card = (files / "out" / "release" / "README.md").read_text()
    assert "Not a held-out evaluation" in card and "not part of the private training set" not in card


@pytest.mark.parametrize("extra, epochs", [
    ((), 1.0),  # DP with one pair per unit: ROW_DP_EPOCHS (RESULTS.md §14)
    (("--privacy_unit_column", "user_id"), 2.0),  # a unit column keeps clm.py's 2
    (("--reward_model",), 2.0),
    (("--disable_dp", "--optim", "adamw_torch"), 2.0),  # the non-private baseline the gain is measured against
    (("--num_train_epochs", "3"), 3.0),  # what the user gives stays
    (("--max_steps", "7"), 2.0),  # a step budget replaces the epochs: they are not touched
])
def test_row_level_dp_dpo_trains_one_epoch_by_default(files, extra, epochs):
    from recipes import dpo

    argv = [*LLAMA, "--train_file", str(files / "pairs.jsonl"), "--output_dir", str(files / "out"), *extra]
    _, _, args = dpo.parse_args(argv)
    assert args.num_train_epochs == epochs
    if "--num_train_epochs" not in extra:  # --help shows the default this command line will run
        shown = re.search(r"--num_train_epochs\b.*?\(default: ([\d.]+)\)", dpo.format_help(*_help_parts(dpo, argv)),
                          re.S)
        assert float(shown.group(1)) == epochs
    given = "--num_train_epochs" in extra  # the command line beats a caller's preset and the config file
    assert dpo.parse_args(argv, defaults={"num_train_epochs": 4})[2].num_train_epochs == (3.0 if given else 4)
    config = files / "c.yaml"
    config.write_text("num_train_epochs: 5\n")
    assert dpo.parse_args([*argv, "--config", str(config)])[2].num_train_epochs == (3.0 if given else 5.0)


def test_the_one_epoch_default_is_what_the_accountant_counts(files, capsys):
    """Row-level DP DPO without --num_train_epochs / --max_steps: 1 epoch planned, calibrated and trained (32 pairs
    at B = 8: 4 steps, where 2 epochs would be 8)."""
    from recipes import dpo

    assert dpo.main([*LLAMA, "--tokenizer_name", str(files / "tok"), "--train_file", str(files / "pairs.jsonl"),
                     "--output_dir", str(files / "out"), "--per_device_train_batch_size", "8", "--max_length", "48",
                     "--epsilon", "3", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true"]) == 0
    report = json.loads((files / "out" / "release" / "privacy.json").read_text())
    assert report["steps"] == 4 and report["dataset_size"] == 32 and report["expected_batch_size"] == 8
    assert 0 < report["epsilon"] <= 3 + 1e-6


@pytest.mark.parametrize("val, overlap", [
    ({"prompt": "A review:", "chosen": " great fun", "rejected": " a bore"}, True),  # the pair itself
    ({"prompt": "a  REVIEW:", "chosen": " Great fun\n", "rejected": " a bore"}, True),  # in other case and spacing
    ({"prompt": "a review:", "chosen": " great fun", "rejected": " dull"}, True),  # a trained (prompt, chosen) sequence
    ({"prompt": "a review:", "chosen": " lovely", "rejected": " great fun"}, True),  # trained as chosen, here rejected
    ({"prompt": "a review:", "chosen": " lovely", "rejected": " dull"}, False),
    ({"prompt": "a film:", "chosen": " great fun", "rejected": " dull"}, False),  # another prompt: another sequence
])
def test_a_validation_pair_that_scores_a_trained_sequence_is_not_held_out(val, overlap):
    """The check compared whole pairs, exactly: a validation pair that shared its prompt and one answer with a training
    pair (or repeated one in other case) passed as held out, and its accuracy and margin measured a trained sequence."""
    from datasets import Dataset

    from recipes.dpo import pairs_in_training

    train = Dataset.from_list([{"prompt": "a review:", "chosen": " great fun", "rejected": " a bore"},
                               {"prompt": "a review:", "chosen": " fine", "rejected": " poor"}])
    assert pairs_in_training(train, Dataset.from_list([val])) is overlap
    inside = Dataset.from_list([{"chosen": "a review: great fun", "rejected": "a review: a bore"}])  # prompt inside
    assert pairs_in_training(inside, Dataset.from_list([{"chosen": "A review: great fun", "rejected": "x"}]))
    # one pair in the two forms TRL reads (the prompt inside the answers, or a column of its own): text and messages
    assert pairs_in_training(train, inside) and pairs_in_training(inside, train)
    user, yes, no = ({"role": r, "content": c} for r, c in (("user", "hi"), ("assistant", "hello"), ("assistant", "go")))
    split = Dataset.from_list([{"prompt": [user], "chosen": [yes], "rejected": [no]}])
    joined = Dataset.from_list([{"chosen": [user, yes], "rejected": [user, no]}])
    assert pairs_in_training(split, joined) and pairs_in_training(joined, split)
    assert not pairs_in_training(split, Dataset.from_list([{"chosen": [yes], "rejected": [no]}]))  # no prompt: other


def _help_parts(dpo, argv):
    """The parser and the parsed flags --help formats for ``argv`` (after the recipe's defaults for this command line)."""
    parser = dpo.make_parser(dpo._reward_mode(argv))
    captured = {}

    def grab(p, peek):
        captured["parts"] = (p, peek)
        return ""

    with pytest.raises(SystemExit):
        from recipes.clm_support.trl import parse_trl_args

        parse_trl_args([*argv, "--help"], None, parser=parser, protocol_defaults=dpo.PROTOCOL_DEFAULTS,
                       optimizer_defaults=dpo.OPTIMIZER_DEFAULTS, run_name=dpo._run_name, format_help=grab,
                       command_defaults=dpo._command_defaults)
    return captured["parts"]


@pytest.mark.parametrize("form", ["--config", "--config=", "file alone"])
def test_a_reward_model_set_in_the_config_file_keeps_two_epochs(files, form):
    """``reward_model: true`` in the YAML file, given as ``--config FILE``, ``--config=FILE`` or as the only argument:
    the reward model's config class and its 2 epochs (the last two forms were read as DPO: 1 epoch)."""
    from recipes import dpo

    config = files / "rm.yaml"
    config.write_text(f"reward_model: true\nepsilon: 3\ntrain_file: {files / 'pairs.jsonl'}\n"
                      f"output_dir: {files / 'out'}\nmodel_type: llama\n")
    argv = {"--config": ["--config", str(config)], "--config=": [f"--config={config}"], "file alone": [str(config)]}[form]
    data_args, _, args = dpo.parse_args(argv)
    assert data_args.reward_model and type(args).__name__ == "DPRewardConfig" and args.num_train_epochs == 2.0


def test_a_dp_dpo_run_resumes_from_its_checkpoint(files, capsys):
    """TRL's DPO preparation gives the tokenized pairs a random 🤗 Datasets fingerprint in every call; the resume check
    compared a hash that included it, so every DP DPO resume was refused as "the training data differ"."""
    common = ("--privacy_unit_column", "user_id", "--noise_multiplier", "1.0", "--save_strategy", "steps",
              "--save_steps", "2")
    assert _run(files, *common) == 0  # 2 steps, a checkpoint at 2
    assert (files / "out" / "checkpoint-2").is_dir()
    capsys.readouterr()
    assert _run(files, *common, "--max_steps", "4", "--resume_from_checkpoint", str(files / "out" / "checkpoint-2")) == 0
    captured = capsys.readouterr()
    assert "training data differ" not in captured.out + captured.err
    report = json.loads((files / "out" / "release" / "privacy.json").read_text())
    assert report["steps"] == 4
