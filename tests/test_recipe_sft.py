"""recipes/sft.py (issue 40): DP SFT on a messages jsonl with one user = one unit, end to end, and its one-line errors.

A tiny Llama from --model_type/--config_overrides, the tests' 60-word WordPiece tokenizer (no chat template: the
recipe sets its default one), synthetic conversations of 8 users. The run prints eval_loss, privacy.json names the
unit with N = 8 users, and the card says "user-level DP over conversations"; a missing unit column and a packing flag
are one `error:` line before any model is loaded.
"""

from __future__ import annotations

import json
import re
import random
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


def _chats(path: Path, n: int, users: int, seed: int) -> None:
    r = random.Random(seed)
    with open(path, "w") as f:
        for i in range(n):
            say = lambda: " ".join(r.choice(WORDS) for _ in range(r.randint(2, 5)))  # noqa: E731
            f.write(json.dumps({"user_id": f"user{i % users}", "messages": [
                {"role": "user", "content": say()}, {"role": "assistant", "content": say()}]}) + "\n")


@pytest.fixture
def files(tmp_path):
    tok = make_tokenizer(tmp_path / "tok")
    tok.save_pretrained(tmp_path / "tok")
    _chats(tmp_path / "chats.jsonl", 32, 8, 0)
    _chats(tmp_path / "dev.jsonl", 8, 8, 1)
    return tmp_path


def _run(files, *extra):
    from recipes import sft

    return sft.main([*LLAMA, "--tokenizer_name", str(files / "tok"), "--train_file", str(files / "chats.jsonl"),
                     "--validation_file", str(files / "dev.jsonl"), "--output_dir", str(files / "out"),
                     "--per_device_train_batch_size", "4", "--max_steps", "2", "--max_length", "32",
                     "--save_strategy", "no", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true",
                     *extra])


def test_a_user_level_sft_run_prints_eval_loss_and_names_the_users(files, capsys):
    assert _run(files, "--privacy_unit_column", "user_id", "--epsilon", "3") == 0
    captured = capsys.readouterr()
    out = captured.out
    # 32 training conversations of 8 users: under user-level DP the number of conversations is private, so no
    # progress bar (data loading, TRL's preparation) or line may print it
    console = captured.out + captured.err
    assert not re.search(r"\b32/32\b|\b32 (examples|rows|conversations)\b", console), console[-3000:]
    assert "eval_loss = " in out and "user-level DP over conversations" in out
    report = json.loads((files / "out" / "release" / "privacy.json").read_text())
    assert report["privacy_unit"]["column"] == "user_id" and report["privacy_unit"]["num_units"] == 8
    assert report["dataset_size"] == 8 and report["sft"]["assistant_only_loss"] is True  # messages: assistant only
    assert "user-level DP over conversations" in (files / "out" / "release" / "README.md").read_text()
    assert "generation" in (files / "out" / "release" / "chat_template.jinja").read_text()  # the default template ships with it


def test_do_train_false_scores_the_model_as_loaded_and_trains_nothing(files, capsys):
    """HF's --do_train false keeps its meaning: no step, no release, the held-out conversations scored (before, sft.py
    ignored the flag: it trained and saved a release, at a batch the planner had skipped)."""
    assert _run(files, "--epsilon", "3", "--do_train", "false") == 0
    out = capsys.readouterr().out
    assert "no training: --do_train false" in out and "eval_loss = " in out
    assert not (files / "out" / "release").exists()
    # what it cannot do: one error line each, before any model is built
    from recipes import sft

    for extra, match in ((["--push_to_hub", "true", "--hub_model_id", "me/x"], "error: --do_train false trains nothing"),
                         (["--validation_file", ""], "error: --do_train false needs held-out data")):
        argv = [a for a in [*LLAMA, "--tokenizer_name", str(files / "tok"), "--train_file", str(files / "chats.jsonl"),
                            "--validation_file", str(files / "dev.jsonl"), "--output_dir", str(files / "out2"),
                            "--max_length", "32", "--use_cpu", "true", "--report_to", "none", "--epsilon", "3",
                            "--do_train", "false"]]
        if extra[0] == "--validation_file":
            i = argv.index("--validation_file")
            del argv[i:i + 2]
        else:
            argv += extra
        assert sft.main(argv) == 2
        err = capsys.readouterr().err
        lines = [x for x in err.splitlines() if x.startswith("error:")]
        assert len(lines) == 1 and lines[0].startswith(match) and "a new llama model" not in err, err[-2000:]


@pytest.mark.parametrize("extra,match", [
    (["--privacy_unit_column", "person"], "error: --privacy_unit_column person: the training data has no column 'person'"),
    (["--packing", "true"], "error: --packing is not supported with DP"),
])
def test_bad_input_is_one_error_line_before_any_model_is_built(files, capsys, extra, match):
    assert _run(files, "--epsilon", "3", *extra) == 2
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("error:")]
    assert len(lines) == 1 and lines[0].startswith(match), err[-2000:]
    assert "a new llama model" not in err


@pytest.mark.distributed
def test_two_gloo_processes_run_dp_sft_over_user_units(files):
    """torchrun, 2 processes (DDP, gloo): DPSFTTrainer trains over user units; q = B·world / N_users."""
    import subprocess

    from two_process import env, gloo_available, torchrun

    if not gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    out = files / "ddp"
    cmd = [*torchrun(), str(HERE.parent / "recipes" / "sft.py"), *LLAMA, "--tokenizer_name", str(files / "tok"),
           "--train_file", str(files / "chats.jsonl"), "--validation_file", str(files / "dev.jsonl"),
           "--output_dir", str(out), "--per_device_train_batch_size", "2", "--max_steps", "2", "--max_length", "32",
           "--save_strategy", "no", "--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true",
           "--ddp_backend", "gloo", "--privacy_unit_column", "user_id", "--epsilon", "3"]
    proc = subprocess.run(cmd, env=env(), cwd=str(files), capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "eval_loss = " in proc.stdout
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    assert privacy["privacy_unit"]["num_units"] == 8 and privacy["steps"] == 2
    assert privacy["sample_rate"] == pytest.approx(2 * 2 / 8)  # B = 2 per device x 2 processes, over N = 8 users


@pytest.mark.parametrize("val, overlap", [
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Hello there"}], True),  # a prefix, in other case
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello there"},
      {"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"},
      {"role": "user", "content": "wait"}, {"role": "assistant", "content": "yes?"}], True),  # extends a training one
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "good day"}], False),  # another answer
    ([{"role": "user", "content": "bye"}, {"role": "assistant", "content": "see you"}], False),  # another context
])
def test_a_validation_conversation_that_scores_a_trained_turn_is_not_held_out(val, overlap):
    """The check compared whole conversations: one that was a prefix (or an extension) of a training conversation
    passed as held out, and its loss measured trained assistant turns."""
    from datasets import Dataset

    from recipes.sft import turns_in_training

    train = Dataset.from_list([{"messages": [{"role": "user", "content": "hi"},
                                             {"role": "assistant", "content": "hello there"},
                                             {"role": "user", "content": "bye"},
                                             {"role": "assistant", "content": "see you"}]}])
    assert turns_in_training(train, Dataset.from_list([{"messages": val}])) is overlap
    assert not turns_in_training(train, Dataset.from_list([{"prompt": "hi", "completion": " hello there"}]))
    # the same turns in TRL's prompt-completion form (the messages before the last assistant turn as the prompt)
    as_pc = Dataset.from_list([{"prompt": val[:-1], "completion": val[-1:]}])
    assert turns_in_training(train, as_pc) is overlap and turns_in_training(as_pc, train) is overlap


def test_a_dp_sft_run_resumes_from_its_checkpoint(files, capsys):
    """A DP SFT run resumes from its checkpoint (the data check passes on the same conversations, as DPO's must too)."""
    common = ("--privacy_unit_column", "user_id", "--noise_multiplier", "1.0", "--save_strategy", "steps",
              "--save_steps", "2")
    assert _run(files, *common) == 0  # 2 steps, a checkpoint at 2
    capsys.readouterr()
    assert _run(files, *common, "--max_steps", "4", "--resume_from_checkpoint", str(files / "out" / "checkpoint-2")) == 0
    captured = capsys.readouterr()
    assert "training data differ" not in captured.out + captured.err
    assert json.loads((files / "out" / "release" / "privacy.json").read_text())["steps"] == 4
