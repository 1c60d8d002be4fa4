"""Issue 53, the parts about recipes/sft.py and the output noise: sft.py as polished as glue.py and clm.py.

* ``--help``: the DP flags first, TRL's SFTConfig flags each marked with what they do under DP (``--packing``
  refused), the recipe's own defaults shown (``--assistant_only_loss`` per data kind, clm.py's lr / schedule / batch).
* Three tracebacks become one ``error:`` line each, before any model is built: ``--assistant_only_loss`` on
  prompt-completion rows; a ``--chat_template_path`` template without ``{% generation %}``; ``--push_to_hub`` offline
  (the model is saved first; one line with the command that pushes it later, exit code 3).
* A run says which chat template it added and why, that the user-level training loss is a per-user sum, and the
  time left even when the run is shorter than one logging interval; it prints no ``pin_memory`` warning; the causal-LM
  verdict is not given for a random-init model; no second card and privacy.json sit at the top of ``--output_dir``.
* Without a batch flag the recipe plans the batch as clm.py does (≈ N/16 units) at the recipe's DP defaults.
* A training row without a unit is named by its line in the file; a pair task's summary puts the best constant
  predictor's F1 beside the model's.

Tiny random Llama from a config and the tests' 60-word WordPiece tokenizer, as tests/test_recipe_sft.py.
"""

from __future__ import annotations

import json
import logging
import random
import re
import sys
import warnings
from pathlib import Path

import pytest

pytest.importorskip("trl")

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
from helpers import TINY_LLAMA_ARGS, WORDS, make_tokenizer  # noqa: E402

LLAMA = TINY_LLAMA_ARGS


def _say(r: random.Random) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(2, 5)))


def _chats(path: Path, n: int, users: int, seed: int) -> None:
    r = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"user_id": f"user{i % users}", "messages": [
                {"role": "user", "content": _say(r)}, {"role": "assistant", "content": _say(r)}]}) + "\n")


@pytest.fixture
def files(tmp_path):
    make_tokenizer(tmp_path / "tok").save_pretrained(tmp_path / "tok")
    _chats(tmp_path / "chats.jsonl", 32, 8, 0)
    _chats(tmp_path / "dev.jsonl", 8, 8, 1)
    r = random.Random(2)
    (tmp_path / "pc.jsonl").write_text("".join(json.dumps({"user_id": f"user{i % 8}", "prompt": _say(r),
                                                            "completion": _say(r)}) + "\n" for i in range(32)))
    (tmp_path / "pc_dev.jsonl").write_text("".join(json.dumps({"prompt": _say(r) + " " + _say(r),
                                                                "completion": _say(r)}) + "\n" for _ in range(8)))
    return tmp_path


def _argv(files, *extra, train="chats.jsonl", dev="dev.jsonl", batch=True):
    return [*LLAMA, "--tokenizer_name", str(files / "tok"), "--train_file", str(files / train),
            "--validation_file", str(files / dev), "--output_dir", str(files / "out"), "--max_length", "32",
            "--max_steps", "2", "--report_to", "none", "--disable_tqdm", "true", "--epsilon", "3",
            *(["--per_device_train_batch_size", "4"] if batch else []), *extra]


def _run(files, capsys, *extra, **kw):
    from recipes import sft

    code = sft.main(_argv(files, *extra, **kw))
    out, err = capsys.readouterr()
    return code, out, err


def _help(capsys, *argv) -> dict[str, str]:
    from recipes import sft

    with pytest.raises(SystemExit) as exc:
        sft.parse_args(list(argv))
    assert exc.value.code == 0
    return capsys.readouterr().out


def _entries(text: str) -> dict[str, str]:
    return {e.split()[0]: " ".join(e.split()) for e in re.split(r"\n  (?=--)", text)[1:]}  # argparse wraps lines


def test_help_marks_dp_and_refused_flags_and_shows_the_recipes_defaults(capsys):
    """Was: 951 lines of HF/TRL help (lately a TypeError: the assistant_only_loss help's {% … %} is an argparse format),
    no DP marks, --assistant_only_loss "default False" although the recipe sets it, --packing not marked refused."""
    text = _help(capsys, "--help")
    full = _help(capsys, "--help-all")
    assert len(text.splitlines()) < 600 < len(full.splitlines())
    assert "\n  --fp16 " not in text and "\n  --fp16 " in full and "--help-all" in text
    heads = [ln.split(" ")[0] for ln in text.splitlines() if ln and not ln.startswith(" ") and ln.endswith(":")]
    assert heads[:6] == ["hf_dp:", "data", "model", "TRL", "recipe:", "training"], heads
    e = _entries(text)
    trl = text.split("\nTRL SFTConfig", 1)[1].split("\nrecipe:", 1)[0]
    assert "\n  --packing " in trl and "\n  --assistant_only_loss " in trl and "\n  --epsilon " not in trl
    assert "[DP: refused if True — --packing is not supported with DP" in e["--packing"]
    assert "[DP: refused if True — --padding_free is not supported with DP" in e["--padding_free"]
    assert "{% generation %}" in e["--assistant_only_loss"]  # argparse's %-formatting no longer breaks it
    assert "(default: per data kind: true on 'messages' data)" in e["--assistant_only_loss"]
    # the recipe's DP defaults (the lr chosen on conversations, the rest clm.py's), not HF's 5e-5 / linear / B 8
    assert "(default: 0.002)" in e["--learning_rate"] and "tune split of conversations" in e["--learning_rate"]
    assert "(default: constant)" in e["--lr_scheduler_type"] and "(default: 2.0)" in e["--num_train_epochs"]
    assert "N/16 units" in e["--per_device_train_batch_size"] and "(default: 16)" in e["--per_device_train_batch_size"]
    assert "(default: lora)" in e["--trainable"] and "(default: 0.1)" in e["--per_sample_max_grad_norm"]
    assert "(default: runs/sft-llama-dp_adamw-eps3)" in _entries(_help(capsys, *LLAMA, "--help"))["--output_dir"]
    assert "upload the release folder <output_dir>/release" in e["--push_to_hub"]


def test_the_recipes_defaults_are_clm_s_and_the_planner_chooses_the_batch(files, capsys):
    """Was: HF's lr 5e-5, linear schedule, B = 8, no planner. Now DP defaults (the lr chosen on conversations, the rest
    clm.py's), and without a batch flag a logical batch of ≈ N/16 units (32 conversations: B = 16, q = 0.5), said in one
    line."""
    from recipes import sft
    from recipes.common.logs import pin_memory_default

    _, _, args = sft.parse_args(_argv(files, batch=False))
    assert (args.learning_rate, str(args.lr_scheduler_type.value), args.warmup_steps) == (2e-3, "constant", 0)
    assert (args.per_device_train_batch_size, args.num_train_epochs, args.trainable) == (16, 2.0, "lora")
    assert args.per_sample_max_grad_norm == 0.1 and str(args.optim) == "dp_adamw"
    assert str(args.save_strategy.value) == "no" and args.dataloader_pin_memory is pin_memory_default()
    code, out, err = _run(files, capsys, batch=False)
    assert code == 0, err[-3000:]
    line = next(x for x in out.splitlines() if x.startswith("planner (causal LM"))
    assert "logical batch B = 16 units" in line and "reused for SFT (the batch was not tuned on conversations)" in line
    assert re.search(r"^sampling rate q\s+: 0\.5$", out, re.M), out[-1500:]


@pytest.mark.parametrize("case", ["not_conversational", "template_without_markers"])
def test_loss_scope_problems_are_one_error_line_before_the_model_is_built(files, capsys, monkeypatch, case):
    """Were tracebacks from inside TRL's SFTTrainer set-up, after the model was built."""
    from recipes import sft

    built = []
    monkeypatch.setattr(sft, "build_model", lambda *a, **k: built.append(1))
    if case == "not_conversational":
        code, _, err = _run(files, capsys, "--assistant_only_loss", "true", train="pc.jsonl", dev="pc_dev.jsonl")
        want = "error: --assistant_only_loss true scores the assistant's turns of conversations, but the training data "
    else:
        (files / "plain.jinja").write_text("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}{{ eos_token }}\n"
                                           "{% endfor %}")
        code, _, err = _run(files, capsys, "--chat_template_path", str(files / "plain.jinja"))
        want = "error: on conversational ('messages') data DPSFTTrainer scores only the assistant's tokens by default"
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(want), err[-3000:]
    assert "Traceback" not in err and not built
    if case == "template_without_markers":
        assert "add {% generation %} … {% endgeneration %} around the assistant's text in" in lines[0]


def test_push_to_hub_offline_saves_then_prints_one_line_with_the_command_that_pushes_later(files, capsys, monkeypatch):
    """Was a traceback when the trainer was built (HF creates the repo there): now as glue.py — train, save the
    release, then one line with the command that pushes it later, exit code 3."""
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    code, out, err = _run(files, capsys, "--push_to_hub", "true", "--hub_model_id", "someone/tiny-sft")
    assert code == 3, err[-3000:]
    release = files / "out" / "release"
    assert (release / "model.safetensors").is_file() and (release / "privacy.json").is_file()
    line = err.strip().splitlines()[-1]
    assert line.startswith(f"error: the model was trained and saved to {release}") and "someone/tiny-sft" in line
    assert "upload_folder" in line and "Traceback" not in err and "hf_dp summary" in out


def test_a_user_level_run_explains_itself_and_prints_no_noise(files, capsys, caplog):
    """One run (user units, checkpoints every step, memory pinning asked for on this CPU machine): the default chat
    template is named with why; the per-user training loss is explained before training; the time left is printed
    although the run is shorter than a logging interval; no pin_memory warning (DPSFTTrainer.evaluate); the plan block
    gives no causal-LM verdict for random weights; no card or privacy.json at the top of --output_dir."""
    from recipes.common.logs import pin_memory_default

    caplog.set_level(logging.INFO, logger="hf_dp.trainer")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, out, err = _run(files, capsys, "--privacy_unit_column", "user_id", "--save_strategy", "steps",
                              "--save_steps", "1", "--dataloader_pin_memory", "true", "--logging_steps", "50")
    assert code == 0, err[-3000:]
    assert "chat template: the tokenizer has none, and conversations need one to become text: using the recipe's " \
           "default (recipes/sft.py DEFAULT_CHAT_TEMPLATE)" in out
    assert "training loss: with --privacy_unit_column user_id the logged 'loss' is per unit, not per conversation" in out
    assert out.index("training loss: with") < out.index("hf_dp summary")
    assert "training: 2 steps planned; the time left is printed once, after the first step (no logging step before " \
           "the end: every 50 steps)" in out
    assert re.search(r"^training: step 1/2 after \d+ s; about \d+ s of training left at this pace", out, re.M), out
    if not pin_memory_default():  # a CPU-only machine: pinning asked for, nothing pinned, nothing said
        assert not [w for w in caught if "pin_memory" in str(w.message)], [str(w.message) for w in caught]
    assert "hf_dp plan (causal LM): no verdict: the model starts from random weights (--model_type llama)" in caplog.text
    assert "R_step = √d·σ/B" not in caplog.text and "noise walk" not in caplog.text
    top = sorted(p.name for p in (files / "out").iterdir())
    assert "README.md" not in top and "privacy.json" not in top, top  # only in release/ and each checkpoint
    assert {"release", "checkpoint-1", "checkpoint-2"} <= set(top)
    assert (files / "out" / "release" / "README.md").is_file() and (files / "out" / "checkpoint-1" / "privacy.json").is_file()


def test_a_row_without_a_unit_is_named_by_its_line_in_the_file(files, capsys):
    """Was "training row 5 has no unit" (0-based, of the prepared rows; line 6 of the file), after the model was built."""
    rows = (files / "chats.jsonl").read_text().splitlines()
    bad = json.loads(rows[5])
    bad["user_id"] = None
    rows[5] = json.dumps(bad)
    (files / "chats.jsonl").write_text("\n".join(rows[:3] + [""] + rows[3:]) + "\n")  # a blank line: not a row
    code, _, err = _run(files, capsys, "--privacy_unit_column", "user_id")
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and lines == ["error: --privacy_unit_column user_id: line 7 of chats.jsonl has no unit (None); "
                                   "every training row must name its unit"], err[-2000:]


def test_row_positions_are_lines_of_the_file(tmp_path):
    from datasets import Dataset

    from recipes import glue
    from recipes.common.args import RecipeError
    from recipes.common.rows import row_position

    csv = tmp_path / "t.csv"
    csv.write_text('text,user\n"two\nlines",a\nb,\n')
    tsv = tmp_path / "t.tsv"
    tsv.write_text('sentence\tlabel\tuser\n"quoted start\t1\tu1\nplain\t0\t\n')
    assert row_position(0, str(csv)) == "line 2 of t.csv" and row_position(1, str(csv)) == "line 4 of t.csv"
    assert row_position(1, str(tsv)) == "line 3 of t.tsv"  # TSV as the recipes read it: no quoting
    assert row_position(4, None) == "row 5 (counting from 1)"
    raw = {"train": Dataset.from_dict({"sentence": ["x", "y"], "label": [1, 0], "user": ["u1", ""]})}
    with pytest.raises(RecipeError, match=r"^--privacy_unit_column user: line 3 of t\.tsv has no unit \(''\)"):
        glue._units(raw, "user", 2, str(tsv))


def test_a_pair_tasks_summary_shows_the_constant_predictors_f1_beside_the_models():
    """Was: "f1 : 0.818" with no word that always predicting the positive class gives 0.812 on MRPC dev."""
    from recipes.common.summary import summary_block
    from recipes.glue_support import constant_baseline

    labels = [1] * 279 + [0] * 129  # MRPC dev: 68.4 % positive
    base = constant_baseline(labels, {"eval_accuracy": 0.70, "eval_f1": 0.818})
    assert base["compared"]["f1"]["constant"] == pytest.approx(2 * 279 / 408 / (1 + 279 / 408))
    assert "f1 0.8180 is above always predicting the positive class (F1 0.8122)" in base["sentence"]
    block = summary_block({"metric_name": "f1", "metric": 0.818, "baseline": base, "task": "mrpc"})
    lines = block.splitlines()
    at = next(i for i, x in enumerate(lines) if re.match(r"^f1\s+: 0\.818$", x))  # the headline stays a number
    assert re.match(r"^f1 of a constant predictor\s+: 0\.8122 \(always the positive class, on the same evaluation "
                    r"labels\)$", lines[at + 1]), block
    assert constant_baseline(labels, {"eval_f1": 0.80})["at_or_below"] is True  # below the constant's F1


@pytest.mark.parametrize("max_steps,logging_steps,strategy,said,estimates", [
    (6, 2, "steps", "the time left is printed at each logging step (every 2 steps)", [2, 4]),
    (3, 50, "steps", "the time left is printed once, after the first step (no logging step before the end: every 50 "
                     "steps)", [1]),
    (3, 500, "epoch", "the time left is printed once, after the first step (logging is not by steps)", [1]),
    (1, 50, "steps", "one step to go: no time left to estimate", []),
])
def test_the_time_left_line_says_when_it_prints_and_does(capsys, max_steps, logging_steps, strategy, said, estimates):
    """Was: "the time left is printed at each logging step (every 50 steps)" in runs that never reached one."""
    from types import SimpleNamespace

    from recipes.common.logs import time_left_callback

    cb = time_left_callback()
    args = SimpleNamespace(logging_steps=logging_steps, logging_strategy=strategy)
    state = SimpleNamespace(global_step=0, max_steps=max_steps, is_world_process_zero=True, logging_steps=logging_steps)
    cb.on_train_begin(args, state, None)
    for step in range(1, max_steps + 1):
        state.global_step = step
        cb.on_step_end(args, state, None)
        if strategy == "steps" and step % logging_steps == 0:
            cb.on_log(args, state, None)
    out = capsys.readouterr().out
    assert f"training: {max_steps} steps planned; {said}" in out
    assert [int(m) for m in re.findall(rf"^training: step (\d+)/{max_steps} after", out, re.M)] == estimates, out


@pytest.mark.parametrize("turns,want", [
    ([], "has no messages: drop it or give it its turns"),
    ([{"role": "user", "content": "w1 w2"}], "has no assistant turn, and only the assistant's tokens are scored"),
])
def test_a_conversation_without_turns_or_without_an_assistant_is_one_error_line(files, capsys, monkeypatch, turns, want):
    """A third review: an empty 'messages' list (an IndexError) or a conversation with no assistant turn (TRL's
    RuntimeError blaming the chat template) were tracebacks after the model was built."""
    from recipes import sft

    built = []
    monkeypatch.setattr(sft, "build_model", lambda *a, **k: built.append(1))
    rows = (files / "chats.jsonl").read_text().splitlines()
    rows[5] = json.dumps({"user_id": "user5", "messages": turns})
    (files / "odd.jsonl").write_text("\n".join(rows) + "\n")
    code, _, err = _run(files, capsys, train="odd.jsonl")
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and "conversation 5 (counting from 0) " + want in lines[0], err[-3000:]
    assert "Traceback" not in err and not built


@pytest.mark.parametrize("flags,want", [
    (["--max_length", "0"], "error: --max_length 0 leaves no token of any row: give a positive length"),
    (["--eos_token", "<nope>"], "error: --eos_token '<nope>' is not a token of the tokenizer's vocabulary"),
    (["--pad_token", "<nope>"], "error: --pad_token '<nope>' is not a token of the tokenizer's vocabulary"),
    (["--dataset_kwargs", '{"skip_prepare_dataset": true}'],
     "error: --dataset_kwargs skip_prepare_dataset uses the training rows as given, and they are not tokenized"),
])
def test_flags_that_would_fail_inside_trl_are_one_error_line_before_the_model(files, capsys, monkeypatch, flags, want):
    """A third review: these were TRL tracebacks (or a line naming the wrong cause) after the model was built."""
    from recipes import sft

    built = []
    monkeypatch.setattr(sft, "build_model", lambda *a, **k: built.append(1))
    code, _, err = _run(files, capsys, *flags)
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert code == 2 and len(lines) == 1 and lines[0].startswith(want), err[-3000:]
    assert "Traceback" not in err and not built

