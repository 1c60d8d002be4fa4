"""Issue 44 items 3, 5, 6, 8: run_clm / run_glue habits, quiet logs, time to the first step, the release folder.

* a batch size given is the batch trained: clm.py's default of 4 accumulation steps goes with its own per-device
  batch only (``--per_device_train_batch_size 16`` trains B = 16, not 64);
* ``--overwrite_output_dir`` (in most run_clm commands; transformers 5 dropped it) is accepted: it deletes the earlier
  run's checkpoints, records and release and starts a new run — without it such a folder is refused;
* the model's config is read before the data: offline, an uncached Hub id is one error line naming what to pass;
* the release is its own folder, ``<output_dir>/release``: model, tokenizer, card, privacy.json — no checkpoint, no
  hf_dp record, no ``training_args.bin``;
* LoRA on GPT-2 raises neither peft's ``fan_in_fan_out`` warning nor transformers' ``is_gradient_checkpointing`` one;
* the frozen-prefix cache of the eval set is built when first evaluated, not before the first training step.
(One rank logs under torchrun: ``tests/test_recipe_clm.py::test_two_gloo_processes_run_the_recipe_over_user_units``.)
"""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_recipe_clm import GPT2, _run, _summary, _tiny, _user_files  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")


@pytest.fixture(scope="module")
def clm():
    from recipes import clm as module

    return module


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from helpers import make_tokenizer

    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d).save_pretrained(str(d))
    return str(d)


def _batch(training_args) -> int:
    return training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps


def test_a_batch_size_given_is_the_batch_clm_trains(clm, tok_dir):
    base = [*GPT2, "--tokenizer_name", tok_dir, "--output_dir", "unused"]
    own = clm.parse_args(base)[2]
    assert _batch(own) == 16  # the recipe's own micro-batch, 16 per device; its planner then sets the accumulation
    clm.lm_batch_plan(own, 4000)
    assert _batch(own) == 256  # ≈ N/16 units
    given = clm.parse_args([*base, "--per_device_train_batch_size", "16"])[2]
    assert given.gradient_accumulation_steps == 1 and _batch(given) == 16  # was 64: a default accumulation stayed
    assert clm.lm_batch_plan(given, 4000) is None and _batch(given) == 16  # a batch given: the planner stays out
    both = clm.parse_args([*base, "--per_device_train_batch_size", "16", "--gradient_accumulation_steps", "2"])[2]
    assert _batch(both) == 32


@pytest.mark.parametrize("flag", [["--overwrite_output_dir"], ["--overwrite_output_dir", "True"],
                                  ["--overwrite_output_dir=true"]])
def test_overwrite_output_dir_is_accepted_by_both_recipes(clm, tok_dir, flag):
    from recipes import glue

    args = clm.parse_args([*GPT2, "--tokenizer_name", tok_dir, "--output_dir", "unused", *flag])[2]
    assert args._hf_dp_overwrite_output_dir is True
    args = glue.parse_args(["--task_name", "qnli", "--output_dir", "unused", *flag])[2]
    assert args._hf_dp_overwrite_output_dir is True
    assert clm.parse_args([*GPT2, "--tokenizer_name", tok_dir, "--output_dir", "u"])[2]._hf_dp_overwrite_output_dir is False


def test_overwrite_output_dir_deletes_the_earlier_run_only(clm, tok_dir, tmp_path, caplog):
    from recipes.common.args import RecipeError
    from recipes.common.run import resume_argument

    out = tmp_path / "out"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "checkpoint-2" / "privacy.json").write_text(json.dumps({"epsilon": 1.5}))
    (out / "hf_dp_epsilon_spent.json").write_text("{}")
    (out / "release").mkdir()
    (out / "release" / "privacy.json").write_text("{}")
    (out / "notes.txt").write_text("mine")
    argv = [*GPT2, "--tokenizer_name", tok_dir, "--output_dir", str(out)]
    with pytest.raises(RecipeError, match="holds checkpoints of an earlier run"):
        resume_argument(clm.parse_args(argv)[2])
    with pytest.raises(RecipeError, match="pass one of the two"):
        resume_argument(clm.parse_args([*argv, "--overwrite_output_dir", "--resume_from_checkpoint", "True"])[2])
    assert (out / "checkpoint-2").is_dir()
    with caplog.at_level("WARNING"):
        assert resume_argument(clm.parse_args([*argv, "--overwrite_output_dir"])[2]) is None
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]
    assert "ε = 1.5" in caplog.text and "checkpoint-2" in caplog.text


def test_the_model_config_is_read_before_the_data(clm, tok_dir, tmp_path, capsys, monkeypatch):
    def no_data(*a, **k):
        raise AssertionError("the data was read before the model's config")

    monkeypatch.setattr(clm, "load_raw_datasets", no_data)
    train, dev = _user_files(tmp_path)
    code, _, err = _run(clm, capsys, ["--model_name_or_path", "no-such-org/no-such-causal-lm", "--train_file", train,
                                      "--validation_file", dev, "--output_dir", str(tmp_path / "o")])
    last = err.strip().splitlines()[-1]
    assert code == 2 and "Traceback" not in err
    assert last.startswith("error: could not load the config 'no-such-org/no-such-causal-lm'"), err[-2000:]
    assert "--model_type gpt2" in last and "local causal-LM folder" in last


def test_the_release_is_its_own_folder_and_overwrite_starts_again(clm, tok_dir, tmp_path, capsys, caplog):
    train, dev = _user_files(tmp_path)
    out = tmp_path / "run"
    argv = _tiny(tok_dir, train, dev, out, "--privacy_unit_column", "user_id", "--save_strategy", "steps",
                 "--save_steps", "1")
    code, stdout, err = _run(clm, capsys, argv)
    assert code == 0, err[-3000:]
    release = out / "release"
    assert _summary(stdout)["saved to"] == str(release)
    names = {p.name for p in release.iterdir()}
    assert {"config.json", "model.safetensors", "README.md", "privacy.json", "tokenizer_config.json"} <= names
    assert not [n for n in names if n.startswith(("checkpoint-", "hf_dp_")) or n == "training_args.bin"], names
    beside = {p.name for p in out.iterdir()}
    assert "checkpoint-2" in beside and "hf_dp_epsilon_spent.json" in beside and "config.json" not in beside
    # the title names the run, not the subfolder
    assert "# release" not in (release / "README.md").read_text()
    code, _, err = _run(clm, capsys, argv)  # a second fresh run into that folder: refused, nothing deleted
    assert code == 2 and "holds checkpoints of an earlier run" in err and (out / "checkpoint-2").is_dir()
    code, stdout, err = _run(clm, capsys, [*argv, "--overwrite_output_dir"])
    assert code == 0, err[-3000:]
    assert "--overwrite_output_dir: deleted the earlier run's checkpoint-1, checkpoint-2" in caplog.text
    assert json.loads((release / "privacy.json").read_text())["steps"] == 2  # the new run's, not the sum of both


def test_lora_on_gpt2_raises_no_needless_warning():
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_dp.models import apply_trainable

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=60, n_positions=32))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        peft_model, _ = apply_trainable(model, "lora")
    messages = [str(w.message) for w in caught]
    assert not [m for m in messages if "fan_in_fan_out" in m or "is_gradient_checkpointing" in m], messages
    assert peft_model.peft_config["default"].fan_in_fan_out is True  # GPT-2's Conv1D layout, said to peft up front


def test_the_eval_cache_is_built_when_first_evaluated(tmp_path, monkeypatch):
    from hf_dp import DPTrainer
    from hf_dp.models import cache_manager
    from hf_dp.models.prefix_cache import CachedFeatures
    from helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    built = []
    real = cache_manager.build_prefix_cache
    monkeypatch.setattr(cache_manager, "build_prefix_cache",
                        lambda *a, **k: built.append(k.get("name")) or real(*a, **k))
    tok = make_tokenizer(tmp_path / "tok")
    train, evalset = make_pair_dataset(tok, n=32, seed=0), make_pair_dataset(tok, n=24, seed=1)
    args = dp_args(tmp_path / "out", cache_frozen_features=True, max_steps=2, epsilon=None, noise_multiplier=1.0)
    trainer = DPTrainer(model=make_model(seed=0), args=args, train_dataset=train, eval_dataset=evalset,
                        data_collator=make_collator(tok))
    assert built == ["train"] and trainer.eval_dataset is evalset  # nothing built for evaluation before training
    trainer.train()
    assert built == ["train"]
    first = trainer.evaluate()
    assert built == ["train", "eval"] and isinstance(trainer.eval_dataset, CachedFeatures)
    assert trainer.evaluate()["eval_loss"] == pytest.approx(first["eval_loss"])
    assert built == ["train", "eval"]  # built once


def test_the_planner_cli_times_the_whole_command_and_explains_its_epochs(tmp_path, monkeypatch, capsys):
    """It ended "(0.0 s)" after 124 s: only the (cached) σ calibration was timed, not counting d from the model."""
    import re
    import time

    from hf_dp.plan import cli

    monkeypatch.setenv("HF_DP_PLAN_CACHE", str(tmp_path / "sigma.json"))

    def slow_count(*a, **k):
        time.sleep(1.0)  # loading the model to count d
        return 5000

    monkeypatch.setattr(cli, "count_trainable", slow_count)
    argv = ["--n", "2000", "--epsilon", "3", "--batch", "16,64", "--epochs", "1,3", "--model_name_or_path", "m"]
    assert cli.main(argv) == 0  # a cold σ cache
    capsys.readouterr()
    assert cli.main(argv) == 0  # warm: the calibration itself takes ~0 s
    out = capsys.readouterr().out
    assert float(re.search(r"^\(([\d.]+) s\)$", out, re.M).group(1)) >= 1.0
    assert "the epochs are a compute budget, not a privacy choice: 3 = the largest of --epochs" in out


def test_overwrite_output_dir_refuses_to_delete_the_model_it_would_load(clm, tok_dir, tmp_path, capsys):
    """Issue 49 item 6: --overwrite_output_dir with --model_name_or_path inside --output_dir (the release of an earlier
    run, output_dir/release) deleted the model before loading it. Refused in one error line, nothing deleted."""
    from transformers import AutoTokenizer, GPT2Config, GPT2LMHeadModel

    train, dev = _user_files(tmp_path)
    out = tmp_path / "run"
    release = out / "release"
    (out / "checkpoint-2").mkdir(parents=True)
    (out / "hf_dp_epsilon_spent.json").write_text("{}")
    tok = AutoTokenizer.from_pretrained(tok_dir)
    GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=len(tok), n_positions=64)).save_pretrained(release)
    tok.save_pretrained(release)
    (release / "privacy.json").write_text("{}")
    before = sorted(str(p.relative_to(out)) for p in out.rglob("*"))
    argv = ["--model_name_or_path", str(release), "--train_file", train, "--validation_file", dev, "--output_dir",
            str(out), "--per_device_train_batch_size", "4", "--noise_multiplier", "1.0", "--delta", "1e-3",
            "--max_steps", "1", "--disable_tqdm", "true", "--overwrite_output_dir"]
    code, _, err = _run(clm, capsys, argv)
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err, err[-3000:]
    assert lines[-1] == (f"error: --model_name_or_path {release} lies inside --output_dir {out}, which "
                         "--overwrite_output_dir clears (the earlier run's checkpoints, records and release) before the "
                         "model is loaded: copy the model out of that folder first, or choose another --output_dir"), lines[-1]
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before  # nothing deleted
    # the output_dir itself is refused alike (its records would be cleared and the new run written into the model)
    code, _, err = _run(clm, capsys, [*argv[:-1], "--output_dir", str(release), "--overwrite_output_dir"])
    assert code == 2 and f"error: --model_name_or_path {release} lies inside --output_dir {release}, which" in err
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*")) == before
