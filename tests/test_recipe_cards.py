"""Issue 53, "cards that say wrong things": one card per recipe run, rendered by the recipe itself (tiny random models,
two steps), its YAML front matter and text parsed, and what it says checked against what that run did.

glue.py (classification, STS-B-like regression, a sentence-pair task, a LoRA run), clm.py, sft.py (messages from a
jsonl file, prompt/completion rows, --assistant_only_loss false, a user-level run).
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))
from helpers import WORDS, make_tokenizer  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore")

LLAMA = ["--model_type", "llama", "--config_overrides",
         "hidden_size=16,intermediate_size=32,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2"]
GPT2 = ["--model_type", "gpt2", "--config_overrides", "n_layer=2,n_embd=16,n_head=2"]
COMMON = ["--use_cpu", "true", "--report_to", "none", "--disable_tqdm", "true", "--max_steps", "2", "--dp_seed", "0",
          "--save_strategy", "no"]


# ------------------------------------------------------------------------------------------------ data and models


def _say(r: random.Random) -> str:
    return " ".join(r.choice(WORDS) for _ in range(r.randint(2, 5)))


def _jsonl(path: Path, rows: list[dict]) -> str:
    path.write_text("".join(json.dumps(x) + "\n" for x in rows))
    return str(path)


def _tsv(path: Path, header: list[str], rows: list[tuple]) -> str:
    path.write_text("\t".join(header) + "\n" + "".join("\t".join(map(str, x)) + "\n" for x in rows))
    return str(path)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """The tests' 60-word tokenizer, two tiny random BERTs (two labels, one output) and every data file."""
    from transformers import BertConfig, BertForSequenceClassification

    root = tmp_path_factory.mktemp("cards")
    make_tokenizer(root / "tok").save_pretrained(root / "tok")
    for name, labels in (("bert", 2), ("bert1", 1)):
        make_tokenizer(root / name).save_pretrained(root / name)
        config = BertConfig(vocab_size=60, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                            intermediate_size=32, max_position_embeddings=64, num_labels=labels)
        BertForSequenceClassification(config).save_pretrained(root / name)
    r = random.Random(0)

    def chat():
        return [{"role": "user", "content": _say(r)}, {"role": "assistant", "content": _say(r)}]

    _jsonl(root / "chats.jsonl", [{"user_id": f"user{i % 8}", "messages": chat()} for i in range(32)])
    _jsonl(root / "chat_dev.jsonl", [{"messages": chat()} for _ in range(8)])
    _jsonl(root / "pc.jsonl", [{"prompt": _say(r), "completion": " " + _say(r)} for _ in range(32)])
    _jsonl(root / "pc_dev.jsonl", [{"prompt": _say(r), "completion": " " + _say(r)} for _ in range(8)])
    _jsonl(root / "texts.jsonl", [{"text": _say(r) + " " + _say(r)} for _ in range(32)])
    _jsonl(root / "texts_dev.jsonl", [{"text": _say(r)} for _ in range(8)])
    _tsv(root / "sst.tsv", ["sentence", "label"], [(_say(r), i % 2) for i in range(48)])
    _tsv(root / "sst_dev.tsv", ["sentence", "label"], [(_say(r) + " " + _say(r), i % 2) for i in range(12)])
    _tsv(root / "stsb.tsv", ["sentence1", "sentence2", "label"], [(_say(r), _say(r), float(i % 6)) for i in range(48)])
    _tsv(root / "stsb_dev.tsv", ["sentence1", "sentence2", "label"], [(_say(r), _say(r), float(i % 6)) for i in range(12)])
    labels = ["entailment", "not_entailment"]
    _tsv(root / "qnli.tsv", ["question", "sentence", "label"], [(_say(r), _say(r), labels[i % 2]) for i in range(48)])
    _tsv(root / "qnli_dev.tsv", ["question", "sentence", "label"], [(_say(r), _say(r), labels[i % 2]) for i in range(12)])
    return root


def _glue():
    spec = importlib.util.spec_from_file_location("hf_dp_recipe_glue", REPO / "recipes" / "glue.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def _run_glue(files, out, task, model, train, dev, *extra):
    code = _glue().main(["--task_name", task, "--train_file", str(files / train), "--validation_file", str(files / dev),
                         "--model_name_or_path", str(files / model), "--output_dir", str(out), "--noise_multiplier",
                         "1.0", "--per_device_train_batch_size", "16", "--delta", "1e-3", "--trainable", "all",
                         "--logging_steps", "1", "--disable_tqdm", "true", "--dp_seed", "0", "--max_steps", "2",
                         "--max_seq_length", "32", *extra])
    assert code == 0
    return _card(out / "release")


def _run_sft(files, out, train, dev, *extra):
    from recipes import sft

    code = sft.main([*LLAMA, "--tokenizer_name", str(files / "tok"), "--train_file", str(files / train),
                     "--validation_file", str(files / dev), "--output_dir", str(out), "--per_device_train_batch_size",
                     "4", "--max_length", "32", "--epsilon", "3", *COMMON, *extra])
    assert code == 0
    return _card(out / "release")


def _run_clm(files, out, *extra):
    from recipes import clm

    code = clm.main([*GPT2, "--tokenizer_name", str(files / "tok"), "--train_file", str(files / "texts.jsonl"),
                     "--validation_file", str(files / "texts_dev.jsonl"), "--output_dir", str(out),
                     "--per_device_train_batch_size", "4", "--noise_multiplier", "1.0", "--delta", "1e-3", *COMMON,
                     *extra])
    assert code == 0
    return _card(out / "release")


class Card:
    """A release's card, parsed: its front matter, its body (whitespace collapsed: lines wrap anywhere), its sections
    and privacy.json."""

    def __init__(self, folder: Path):
        from hf_dp.hub import parse_front_matter

        self.folder = folder
        self.text = (folder / "README.md").read_text()
        self.front = parse_front_matter(self.text)
        self.raw_body = self.text.split("\n---\n", 1)[1]
        self.body = " ".join(self.raw_body.split())
        self.privacy = json.loads((folder / "privacy.json").read_text())

    def section(self, title: str) -> str:
        part = self.raw_body.split(f"\n## {title}\n", 1)[1]
        return " ".join(part.split("\n## ", 1)[0].split())

    def line(self, start: str) -> str:
        return next(x for x in self.raw_body.splitlines() if x.startswith(start))

    def result(self) -> dict:
        (entry,) = self.front["model-index"]
        (result,) = entry["results"]
        return result

    def metrics(self) -> dict:
        return {m["type"]: m["value"] for m in self.result()["metrics"]}

    def eval_rows(self) -> dict:
        """The Evaluation table: {label: value}."""
        rows = re.findall(r"^\| (.+) \| (\S+) \|$", self.raw_body.split("\n## Evaluation\n", 1)[1].split("\n## ")[0], re.M)
        return {k: v for k, v in rows if k not in ("metric", "---")}


def _card(folder: Path) -> Card:
    return Card(folder)


def _bullets_start_lines(card: Card) -> None:
    """Every bullet of "What the guarantee does not cover" starts its own line (one was glued to the line before)."""
    for line in card.raw_body.splitlines():
        assert not re.search(r"\S- \*\*[A-Z]", line), line


# ------------------------------------------------------------------------------------------------ glue.py


def test_a_glue_classification_card(files, tmp_path):
    """sst2-format local file: the loss is a cross-entropy, the model-index names the task as its config does (lower
    case), the data as the user's file (not GLUE's), every parameter was trained (no "other parameters")."""
    card = _run_glue(files, tmp_path / "cls", "sst2", "bert", "sst.tsv", "sst_dev.tsv")
    assert card.result()["dataset"] == {"name": "sst2 (local files)", "split": "validation"}
    assert "SST2" not in card.text and "GLUE" not in card.front["model-index"][0]["results"][0]["dataset"]["name"]
    assert set(card.metrics()) == {"accuracy"}
    assert "- **Fine-tuning data:** local file sst.tsv, 48 training examples" in card.raw_body
    loss = next(k for k in card.eval_rows() if k.startswith("loss"))
    assert "cross-entropy of the predicted probabilities" in loss
    trained = card.section("Trained parameters")
    assert "Every parameter was trained" in trained and "All other parameters" not in trained
    assert "Evaluation uses the held-out validation data" in card.body and "Not a held-out" not in card.body
    assert "each example joins each step independently with probability q" in card.body
    _bullets_start_lines(card)


def test_an_evaluation_on_training_rows_is_refused_under_dp_and_named_without(files, tmp_path, capsys):
    """Review of issue 51 (finding 3): the card said "Not a held-out evaluation" exactly when a validation row was a
    training row — one bit of membership per validation row, outside the guarantee — and carried metrics of training
    rows. Under DP such a run is refused in one error line before training (no release); without DP it runs and its
    card says the evaluation is not held out."""
    capsys.readouterr()
    argv = ["--task_name", "sst2", "--train_file", str(files / "sst.tsv"), "--validation_file", str(files / "sst.tsv"),
            "--model_name_or_path", str(files / "bert"), "--per_device_train_batch_size", "16", "--trainable", "all",
            "--disable_tqdm", "true", "--max_steps", "2", "--max_seq_length", "32"]
    assert _glue().main([*argv, "--output_dir", str(tmp_path / "dp"), "--epsilon", "3", "--delta", "1e-3"]) == 2
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and "Traceback" not in err
    assert "error: some validation rows also occur in the training data: a DP release must not carry" in err
    assert not (tmp_path / "dp" / "release").exists()
    assert _glue().main([*argv, "--output_dir", str(tmp_path / "np"), "--disable_dp", "--optim", "adamw_torch"]) == 0
    card = _card(tmp_path / "np" / "release")
    assert "Not a held-out evaluation" in card.body and "held-out validation data, which is not part" not in card.body


@pytest.mark.parametrize("copy", [
    lambda t: t.upper(),  # case
    lambda t: "  " + t.replace(" ", "  ") + " \n",  # spacing and line endings
    lambda t: t.replace("e", "\uff45"),  # a full-width letter: the same text in Unicode's NFKC form
])
def test_a_validation_copy_of_a_training_row_that_differs_in_case_or_spacing_is_still_found(copy):
    """The overlap check compared exact strings: a validation copy of a training row in other case, spacing or
    Unicode form passed as held out, and a DP release carried a metric of a training row. Rows and messages (DPO pairs:
    tests/test_dpo_recipe.py)."""
    from datasets import Dataset

    from recipes.common.run import eval_rows_in_training

    rows = {"sentence": ["the film is a quiet triumph", "nothing here works at all"], "label": [1, 0]}
    train = Dataset.from_dict(rows)
    assert eval_rows_in_training(train, Dataset.from_dict({"sentence": [copy(rows["sentence"][1])], "label": [0]}),
                                 ["sentence"])
    assert not eval_rows_in_training(train, Dataset.from_dict({"sentence": ["an other film entirely"], "label": [0]}),
                                     ["sentence"])
    chats = Dataset.from_list([{"messages": [{"role": "user", "content": "hi there"},
                                             {"role": "assistant", "content": "hello to you"}]}])
    held = Dataset.from_list([{"messages": [{"role": "user", "content": copy("hi there")},
                                            {"role": "assistant", "content": copy("hello to you")}]}])
    assert eval_rows_in_training(chats, held, ["messages"])

def test_a_glue_regression_card_says_its_loss_is_the_mse(files, tmp_path):
    """An STS-B-like run (one output): its eval loss is the MSE, never "cross-entropy of the predicted
    probabilities"; the model-index has the correlations, the task in lower case."""
    card = _run_glue(files, tmp_path / "reg", "stsb", "bert1", "stsb.tsv", "stsb_dev.tsv")
    rows = card.eval_rows()
    (loss,) = [k for k in rows if k.startswith("loss")]
    assert "mean squared error" in loss and "cross-entropy" not in card.section("Evaluation")
    # the loss shown is the model's MSE on the evaluation labels (the baseline computes it from the predictions)
    assert float(rows[loss]) == pytest.approx(card.privacy["eval_baseline"]["model_mse"], rel=1e-3)
    assert set(card.metrics()) == {"pearson", "spearmanr", "combined_score"}
    assert card.result()["dataset"]["name"] == "stsb (local files)" and "STSB" not in card.text
    assert "Evaluation uses the held-out validation data" in card.body  # its own dev file


def test_a_glue_pair_task_card(files, tmp_path):
    """A qnli-format pair task with its own dev file: task and model-index in the config's lower case, held-out."""
    card = _run_glue(files, tmp_path / "pair", "qnli", "bert", "qnli.tsv", "qnli_dev.tsv")
    assert card.result()["dataset"]["name"] == "qnli (local files)"
    assert "QNLI" not in card.text and "- **Task:** qnli" in card.raw_body
    assert "- **Fine-tuning data:** local file qnli.tsv, 48 training examples" in card.raw_body
    assert "Evaluation uses the held-out validation data" in card.body and "Not a held-out" not in card.body
    assert "cross-entropy of the predicted probabilities" in card.section("Evaluation")


def test_a_lora_card_says_the_release_is_merged_and_which_weights_changed(files, tmp_path):
    """--trainable lora: the card listed adapter tensors (lora_A/B, a head copy) that the released folder does not
    hold. It says the release is merged and names the released weights the adapter changed; those are exactly the
    weights that differ from the base model, and every other weight is the base's."""
    import torch
    from safetensors.torch import load_file

    card = _run_glue(files, tmp_path / "lora", "qnli", "bert", "qnli.tsv", "qnli_dev.tsv", "--trainable", "lora")
    trained = card.section("Trained parameters")
    assert "The release is merged" in trained and "no adapter tensors" in trained
    trainable = card.privacy["trainable"]
    assert trainable["mode"] == "lora" and trainable["release"].startswith("merged")
    merged = trainable["merged_into"]
    assert merged and all(f"`{n}`" in trained for n in merged)
    released = load_file(str(card.folder / "model.safetensors"))
    base = load_file(str(files / "bert" / "model.safetensors"))
    assert not any("lora_" in k or "modules_to_save" in k for k in released)  # adapter names are not released names
    assert set(merged) <= set(released)
    changed = {k for k in released if not torch.equal(released[k], base[k])}
    assert changed == set(merged), (changed, merged)


# ------------------------------------------------------------------------------------------------ clm.py


def test_a_clm_card_lists_the_eval_loss_and_perplexity_and_says_lora_is_merged(files, tmp_path):
    """clm.py (LoRA by default, a random-init GPT-2): the model-index lists the eval loss and the perplexity; the
    released weights are merged (named), not the adapter's."""
    card = _run_clm(files, tmp_path / "clm")
    metrics = card.metrics()
    assert set(metrics) == {"loss", "perplexity"}
    assert metrics["loss"] == pytest.approx(card.privacy["eval"]["eval_loss"])
    assert "The release is merged" in card.section("Trained parameters")
    assert card.privacy["trainable"]["merged_into"] == ["transformer.h.0.attn.c_attn.weight",
                                                        "transformer.h.1.attn.c_attn.weight"]
    assert "per predicted token of the evaluation text" in next(k for k in card.eval_rows() if k.startswith("loss"))
    _bullets_start_lines(card)


# ------------------------------------------------------------------------------------------------ sft.py


def _no_private_counters(card: Card) -> None:
    """TRL's num_tokens (the training tokens counted so far: a count of private data; 0 under DP) is published nowhere;
    its diagnostics are in the evaluation table with what they are, never model-index results."""
    assert "num_tokens" not in card.text and "eval_num_tokens" not in card.privacy.get("eval", {})
    assert set(card.metrics()) == {"loss"}  # no perplexity computed by sft.py: the eval loss only
    assert card.metrics()["loss"] == pytest.approx(card.privacy["eval"]["eval_loss"])
    rows = card.eval_rows()
    assert any(k.startswith("entropy (TRL's diagnostic") for k in rows)
    assert any(k.startswith("mean_token_accuracy (TRL's diagnostic") for k in rows)


def test_an_sft_card_from_a_messages_jsonl_names_the_file_and_the_users_columns(files, tmp_path):
    card = _run_sft(files, tmp_path / "msgs", "chats.jsonl", "chat_dev.jsonl")
    data = card.line("- **Fine-tuning data:**")
    assert "chats.jsonl" in data and "`user_id`, `messages`" in data, data
    assert "given in Python" not in data and "input_ids" not in card.text and "`labels`" not in card.text
    sft = card.privacy["sft"]
    assert sft["scored_tokens"] == "the assistant's tokens only" and sft["data_kind"] == "messages"
    assert "supervised fine-tuning on conversations" in card.line("- **Task:**")
    loss = next(k for k in card.eval_rows() if k.startswith("loss"))
    assert "per scored token — the assistant's tokens only" in loss and "of the evaluation text" not in loss
    _no_private_counters(card)


def test_an_sft_card_of_prompt_completion_rows_states_the_effective_completion_only_loss(files, tmp_path):
    """completion_only_loss left at TRL's None is in effect on prompt-completion rows: card and privacy.json say
    True, and the rows are not called conversations."""
    card = _run_sft(files, tmp_path / "pc", "pc.jsonl", "pc_dev.jsonl")
    sft = card.privacy["sft"]
    assert sft["completion_only_loss"] is True and sft["scored_tokens"] == "the completion's tokens only"
    assert "completion_only_loss_in_effect" not in sft  # one key, the effective value
    task = card.line("- **Task:**")
    assert "completion_only_loss=True" in task and "completion_only_loss=None" not in card.text
    assert "on prompt-completion rows" in task and "conversation" not in task
    assert "the prompt's tokens and padding are never scored" in task
    data = card.line("- **Fine-tuning data:**")
    assert "pc.jsonl" in data and "`prompt`, `completion`" in data and "input_ids" not in data
    _no_private_counters(card)


def test_an_sft_card_with_assistant_only_loss_false_says_every_token_is_scored(files, tmp_path):
    card = _run_sft(files, tmp_path / "all", "chats.jsonl", "chat_dev.jsonl", "--assistant_only_loss", "false")
    sft = card.privacy["sft"]
    assert sft["assistant_only_loss"] is False and sft["completion_only_loss"] is False
    assert sft["scored_tokens"] == "every token" and "the user's included" in sft["per_example_loss"]
    for text in (card.text, json.dumps(card.privacy)):
        assert "prompt tokens are never scored" not in text and "prompt and padding tokens are never scored" not in text
        assert not re.search(r"(user|prompt|other turns)[^.;]*never scored", text)
    assert "scored tokens: every token (given)" in card.line("- **Task:**")
    loss = next(k for k in card.eval_rows() if k.startswith("loss"))
    assert "per scored token — every token" in loss


def test_a_user_level_sft_card_says_each_unit_joins_each_step(files, tmp_path):
    """--privacy_unit_column user_id: the sampling row says each unit (all rows of one user) joins with probability q;
    C bounds each unit's summed gradient; no line speaks of examples joining."""
    card = _run_sft(files, tmp_path / "users", "chats.jsonl", "chat_dev.jsonl", "--privacy_unit_column", "user_id")
    assert card.privacy["privacy_unit"]["level"] == "unit" and card.privacy["dataset_size"] == 8
    sampling = card.line("| sampling |")
    assert "each unit — all rows with one `user_id` value — joins each step independently with probability q" in sampling
    assert "each example joins" not in card.text
    assert card.line("| per-unit clipping norm C |").endswith("| 0.1 |")
    assert "per-example clipping norm" not in card.text
    data = card.line("- **Fine-tuning data:**")
    assert "chats.jsonl" in data and "`user_id`, `messages`" in data and "32" not in data  # no count of conversations
