"""Model card (README.md) and privacy.json: content, YAML front matter, round trip, template from an install."""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import yaml

from hf_dp.hub import parse_front_matter, render_model_card, template_source, write_privacy_artifacts

REPO = Path(__file__).resolve().parents[1]

REPORT = {
    "hf_dp_version": "0.1.0", "epsilon": 2.97, "delta": 1e-05, "target_epsilon": 3.0, "accountant": "prv",
    "noise_multiplier": 0.83, "max_grad_norm": 0.1, "sample_rate": 0.0035, "expected_batch_size": 32,
    "dataset_size": 8999, "steps": 843, "epochs": 3.0, "sampling": "poisson",
    "unit_of_privacy": "one training example (add/remove)", "secure_rng": False,
    "optimizer": {"name": "dp_adamw", "hyperparameters": {"lr": 0.001, "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.01}},
    "trainable": {"mode": "last_block", "trainable_params": 1900000, "total_params": 22700000,
                  "names": ["bert.encoder.layer.5.output.dense.weight", "classifier.weight"]},
}
EVAL = {"eval_accuracy": 0.7926, "eval_loss": 0.51, "eval_runtime": 12.5, "eval_samples_per_second": 400.0, "epoch": 3.0}
KW = dict(base_model="bert-base-cased", task_name="qnli", dataset_name="nyu-mll/glue", eval_results=EVAL)

DP_KEYS = ("epsilon", "delta", "target_epsilon", "accountant", "noise_multiplier", "max_grad_norm", "sample_rate",
           "expected_batch_size", "steps", "epochs", "sampling", "unit_of_privacy")


def test_front_matter_parses_and_numbers_equal_report():
    card = render_model_card(REPORT, **KW)
    meta = parse_front_matter(card)
    assert meta == yaml.safe_load(card.split("---\n")[1])
    assert meta["license"] == "apache-2.0"
    assert meta["base_model"] == "bert-base-cased"
    assert meta["datasets"] == ["nyu-mll/glue"]
    assert {"differential-privacy", "hf_dp", "dp_adamw"} <= set(meta["tags"])
    dp = meta["differential_privacy"]
    for key in DP_KEYS:
        assert dp[key] == REPORT[key], key
        assert type(dp[key]) is type(REPORT[key]), key
    (entry,) = meta["model-index"]
    (result,) = entry["results"]
    # the dataset's own lower-case config name (issue 53: the model-index upper-cased GLUE task names)
    assert result["dataset"] == {"name": "glue qnli", "type": "nyu-mll/glue", "config": "qnli", "split": "validation"}
    metrics = {m["type"]: m["value"] for m in result["metrics"]}
    assert metrics == {"accuracy": 0.7926}  # loss / runtime are not results


def test_card_body_states_guarantee_optimizer_parameters_and_exclusions():
    card = render_model_card(REPORT, **KW)
    body = card.split("\n---\n", 1)[1]
    for text in ("(2.97, 1e-05)-differential privacy", "one training example", "poisson", "| sampling rate q | 0.0035 |",
                 "| noise multiplier σ | 0.83 |", "| per-example clipping norm C | 0.1 |", "| steps | 843 |",
                 "| epochs (expected passes over the data, q × steps) | 3 |", "| accountant | prv |", "`dp_adamw`", "| lr | 0.001 |", "| betas | 0.9, 0.999 |",
                 "| weight_decay | 0.01 |", "`last_block`", "1,900,000 of 22,700,000", "classifier.weight",
                 "| accuracy | 0.7926 |", "hf_dp 0.1.0", "bert-base-cased"):
        assert text in body, text
    exclusions = body.split("## What the guarantee does not cover", 1)[1]
    for text in ("Pre-training data", "Hyper-parameter tuning", "tokenizer / vocabulary", "training loss"):
        assert text in exclusions, text
    assert "{{" not in card and "{%" not in card


def test_non_private_report_is_flagged():
    card = render_model_card({"hf_dp_version": "0.1.0", "differential_privacy": False}, base_model="m", task_name="sst2",
                             dataset_name=None, eval_results=None)
    meta = parse_front_matter(card)
    assert "differential_privacy" not in meta and "model-index" not in meta
    assert "WITHOUT differential privacy" in card


def test_minimal_report_renders():
    report = {k: REPORT[k] for k in ("epsilon", "delta", "noise_multiplier", "max_grad_norm", "sample_rate", "steps")}
    card = render_model_card(report)
    meta = parse_front_matter(card)
    assert meta["differential_privacy"]["epsilon"] == 2.97 and meta["license"] == "apache-2.0"


def test_privacy_json_round_trip_and_readme(tmp_path):
    report = copy.deepcopy(REPORT)
    paths = write_privacy_artifacts(tmp_path / "out", report, **KW, model_name="my-model")
    assert report == REPORT  # not mutated
    with open(paths["privacy.json"], encoding="utf-8") as f:
        saved = json.load(f)
    assert saved == {**REPORT, "eval": EVAL}
    readme = Path(paths["README.md"]).read_text(encoding="utf-8")
    assert readme == render_model_card(REPORT, **KW, model_name="my-model")
    assert parse_front_matter(readme)["model-index"][0]["name"] == "my-model"
    # without eval results there is no "eval" key: privacy.json is exactly the report
    write_privacy_artifacts(tmp_path / "noeval", REPORT)
    assert json.loads((tmp_path / "noeval" / "privacy.json").read_text()) == REPORT


def test_template_is_found_from_checkout():
    text, where = template_source()
    assert "{{ front_matter }}" in text and where.endswith("model_card.md.j2")
    assert (REPO / "model_cards" / "model_card.md.j2").is_file()


# ------------------------------------------------------------------------------------ installed (non-editable)

PACKAGE_DATA_SNIPPET = '''
[tool.setuptools.package-dir]
"hf_dp.model_cards" = "model_cards"

[tool.setuptools.package-data]
"hf_dp.model_cards" = ["*.j2"]
'''


def _subpackages(root: Path) -> list[str]:
    return sorted(
        ".".join(p.parent.relative_to(root).parts) for p in (root / "hf_dp").rglob("__init__.py")
        if "__pycache__" not in p.parts
    )


def _with_snippet(pyproject: str, packages: list[str]) -> str:
    """The pyproject the lead is asked to adopt: explicit package list + model_cards → hf_dp.model_cards."""
    if '"hf_dp.model_cards" = "model_cards"' in pyproject:
        return pyproject
    listing = ", ".join(f'"{p}"' for p in packages + ["hf_dp.model_cards"])
    explicit = f"[tool.setuptools]\npackages = [{listing}]\n" + PACKAGE_DATA_SNIPPET
    new, n = re.subn(r"\[tool\.setuptools\.packages\.find\]\ninclude = \[[^\]]*\]\n", explicit, pyproject)
    assert n == 1, "pyproject.toml layout changed; update the snippet"
    return new


def test_pyproject_lists_every_subpackage():
    text = (REPO / "pyproject.toml").read_text()
    if '"hf_dp.model_cards" = "model_cards"' not in text:
        pytest.skip("package-dir snippet not adopted in pyproject.toml yet (the wheel test applies it to a copy)")
    listed = set(re.findall(r'"(hf_dp[\w.]*)"', text.split("packages = [", 1)[1].split("]", 1)[0]))
    missing = set(_subpackages(REPO)) - listed
    assert not missing, f"add {sorted(missing)} to [tool.setuptools] packages in pyproject.toml"


@pytest.mark.slow
def test_template_found_in_installed_wheel(tmp_path):
    """Build a wheel from a copy of the repo, install it (unpacked) elsewhere and render a card from there."""
    src = tmp_path / "src"
    src.mkdir()
    shutil.copytree(REPO / "hf_dp", src / "hf_dp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "model_cards", src / "model_cards", ignore=shutil.ignore_patterns("__pycache__"))
    (src / "pyproject.toml").write_text(_with_snippet((REPO / "pyproject.toml").read_text(), _subpackages(REPO)))
    (src / "README.md").write_text((REPO / "README.md").read_text() if (REPO / "README.md").is_file() else "hf_dp\n")
    wheels = tmp_path / "wheels"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", str(src), "-w", str(wheels)],
        capture_output=True, text=True, timeout=300,
    )
    if proc.returncode != 0 and "No module named pip" in proc.stderr:
        pytest.skip("pip not available")
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = wheels.glob("hf_dp-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "hf_dp/model_cards/model_card.md.j2" in names and "hf_dp/hub/card.py" in names
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    code = (
        "import json, hf_dp, hf_dp.hub.card as c\n"
        "text, where = c.template_source()\n"
        f"card = c.render_model_card({REPORT!r}, base_model='b', task_name='qnli', dataset_name=None, eval_results=None)\n"
        "print(json.dumps({'file': hf_dp.__file__, 'where': where, 'eps': c.parse_front_matter(card)['differential_privacy']['epsilon']}))\n"
    )
    env = {**os.environ, "PYTHONPATH": str(site)}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    info = json.loads(out.stdout.strip().splitlines()[-1])
    assert info["file"].startswith(str(site))
    assert info["where"] == "hf_dp.model_cards/model_card.md.j2"  # importlib.resources, not the checkout
    assert info["eps"] == REPORT["epsilon"]


# ------------------------------------------------------------------------------------ non-private run (issue 15.7)


def test_non_private_run_card_and_privacy_json_say_non_private_once(tmp_path):
    """A --disable_dp run: privacy.json and README.md say non-private (once), claim no ε, carry no
    differential-privacy tag or -dp- title, and record the real optimizer and trainable set."""
    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    ds = make_pair_dataset(tok, n=64)
    args = dp_args(tmp_path / "bert-tiny-sst2", optim="adamw_torch", disable_dp=True, epsilon=None, max_steps=2,
                   trainable="last_block")
    trainer = DPTrainer(model=make_model(), args=args, train_dataset=ds, data_collator=make_collator(tok))
    trainer.train()
    out = tmp_path / "saved"
    trainer.save_model(str(out))
    privacy = json.loads((out / "privacy.json").read_text())
    assert privacy["differential_privacy"] is False
    assert not {"epsilon", "delta", "noise_multiplier", "target_epsilon", "accountant"} & set(privacy)
    assert privacy["optimizer"]["name"] == "adamw_torch"
    assert privacy["optimizer"]["hyperparameters"]["lr"] == args.learning_rate
    info = trainer.trainable_info
    assert privacy["trainable"]["mode"] == "last_block"
    assert privacy["trainable"]["trainable_params"] == info.num_trainable > 0
    assert privacy["trainable"]["names"] == list(info.trainable_names)

    for card in ((out / "README.md").read_text(), render_model_card(privacy, base_model="bert-tiny", task_name="sst2")):
        meta = parse_front_matter(card)
        body = card.split("\n---\n", 1)[1]
        assert "differential-privacy" not in meta["tags"] and "differential_privacy" not in meta
        assert "adamw_torch" in meta["tags"]
        title = body.split("\n# ", 1)[1].splitlines()[0]
        assert "-dp-" not in title and "dp" not in title.split("-")
        low = body.lower()
        assert low.count("differential privacy") == 1 and "without differential privacy" in low
        assert low.count("non-private") == 1
        for claim in ("ε", "epsilon", "(ε, δ)", "differentially private", "guarantee does not cover", "with **differential privacy**"):
            assert claim not in body, claim
        assert "`adamw_torch`" in body and "`unknown`" not in body
        assert "`last_block`" in body and "Not recorded" not in body
        assert f"{info.num_trainable:,}" in body
    assert "# bert-tiny-sst2\n" in render_model_card(privacy, base_model="bert-tiny", task_name="sst2")


@pytest.mark.parametrize("labels,accuracy,warned", [
    ([0] * 55 + [1] * 45, 0.55, True),     # exactly the majority rate: no better than always predicting class 0
    ([0] * 55 + [1] * 45, 0.495, True),    # below it (the old main job: 0.4959 against 0.5054)
    ([0] * 55 + [1] * 45, 0.61, False),    # above it
    ([1] * 10 + [-1] * 90, 0.9, True),     # unlabelled rows (-1) do not count: the rate is 1.0
])
def test_constant_baseline_in_card_and_privacy_json(tmp_path, labels, accuracy, warned):
    """Issue 16 §1: the card says plainly when the model is no better than the majority class of the evaluation set."""
    from recipes.glue_support import constant_baseline

    ev = {**EVAL, "eval_accuracy": accuracy}
    base = constant_baseline(labels, ev, label_names=["entailment", "not_entailment"])
    expected_rate = max(labels.count(0), labels.count(1)) / sum(1 for x in labels if x >= 0)
    assert base["majority_rate"] == pytest.approx(expected_rate) and base["at_or_below"] is warned
    write_privacy_artifacts(tmp_path, REPORT, **{**KW, "eval_results": ev}, baseline=base)
    card = (tmp_path / "README.md").read_text()
    assert ("does no better than a constant predictor" in card) is warned
    assert f"{expected_rate:.4f} of the evaluation set" in card
    assert json.loads((tmp_path / "privacy.json").read_text())["eval_baseline"]["at_or_below"] is warned


def test_constant_baseline_mcc_and_nothing_to_compare():
    from recipes.glue_support import constant_baseline

    assert constant_baseline([0, 1, 1], {"eval_matthews_correlation": 0.0})["at_or_below"] is True
    assert constant_baseline([0, 1, 1], {"eval_matthews_correlation": 0.2})["at_or_below"] is False
    assert constant_baseline([0.3, 1.2], {"eval_pearson": 0.5}) is None  # regression
    assert constant_baseline([0, 1], {"eval_loss": 0.5}) is None  # no comparable metric


# ------------------------------------------------------------------------------------------ issue 44 item 1, issue 38 item 2


def _model_section(card: str) -> str:
    return card.split("## Model\n", 1)[1].split("\n## ", 1)[0]


def test_the_task_and_data_lines_are_separate_lines():
    """Issue 44 §1: every card rendered "- **Task:** qnli- **Fine-tuning data:** …" on one line."""
    for kw in (KW, {**KW, "task_description": "sequence classification — labels: a, b"}, {**KW, "task_name": None}):
        lines = _model_section(render_model_card(REPORT, **kw)).splitlines()
        task = [x for x in lines if x.startswith("- **Task:**")]
        data = [x for x in lines if x.startswith("- **Fine-tuning data:**")]
        assert len(task) == 1 and len(data) == 1 and "Fine-tuning" not in task[0], lines


def test_a_causal_lm_card_explains_its_loss_in_language_model_words():
    card = render_model_card({**REPORT, "objective": "causal_lm"}, task_name="causal language modeling",
                             eval_results={"eval_loss": 3.2, "eval_perplexity": 24.5})
    loss_row = [x for x in card.splitlines() if x.startswith("| loss")][0]
    assert "per predicted token" in loss_row and "perplexity" in loss_row and "label" not in loss_row
    classifier = render_model_card(REPORT, **KW)
    assert "use the label" in [x for x in classifier.splitlines() if x.startswith("| loss")][0]


def test_a_random_init_model_is_not_described_as_pretrained():
    card = render_model_card(REPORT, random_init=True, model_description="`GPT2LMHeadModel` (model_type `gpt2`)",
                             task_name="causal language modeling", eval_results=EVAL)
    body = card.split("\n---\n", 1)[1]
    assert "- **Base model:** none: `GPT2LMHeadModel` (model_type `gpt2`), initialised at random" in body
    assert "pre-trained values" not in body and "initial (random) values" in body
    assert "anything the base model memorized" not in body and "not recorded" not in _model_section(card).split(
        "Fine-tuning")[0]
    assert "# GPT2LMHeadModel-dp\n" in body


def test_evaluation_overlapping_the_training_data_is_not_called_held_out():
    """Issue 44 §1: the card said "held-out data, not part of the private training set" after the console warned that
    validation rows also occur in the training data."""
    card = render_model_card(REPORT, **KW, eval_overlap=True)
    assert "held-out validation data, which is not part of the private training set" not in card
    assert "Not a held-out evaluation" in card and "also occur in the training data" in card
    assert "Evaluation uses the held-out validation data" in render_model_card(REPORT, **KW)


def _api_trainer(tmp_path, **overrides):
    from datasets import Dataset, DatasetInfo

    from hf_dp import DPTrainer
    from tests.helpers import dp_args, make_collator, make_model, make_pair_dataset, make_tokenizer

    tok = make_tokenizer(tmp_path / "tok")
    plain = make_pair_dataset(tok, n=70)
    rows = plain.to_dict()
    if overrides.get("privacy_unit_column"):
        rows["user_id"] = [i % 16 for i in range(70)]  # 16 units of 4 or 5 rows
    info = overrides.pop("info", True)
    ds = Dataset.from_dict(rows, info=DatasetInfo(dataset_name="someone/pairs") if info else None)
    trainer = DPTrainer(model=make_model(), args=dp_args(tmp_path / "out", max_steps=1, **overrides), train_dataset=ds,
                        data_collator=make_collator(tok))
    trainer.train()
    trainer.save_model(str(tmp_path / "out"))
    return (tmp_path / "out" / "README.md").read_text()


def test_a_unit_level_card_names_no_row_count(tmp_path):
    """Issue 38 §2: under --privacy_unit_column the card printed the training set's row count (70 rows, 16 units);
    the number of rows is private there (one unit's removal changes it by its rows)."""
    card = _api_trainer(tmp_path, privacy_unit_column="user_id")
    privacy = json.loads((tmp_path / "out" / "privacy.json").read_text())
    assert privacy["dataset_size"] == 16
    assert not re.search(r"\b70\b", card), [x for x in card.splitlines() if re.search(r"\b70\b", x)]
    assert "- **Privacy units (N):** 16" in card


def test_a_python_api_card_without_hub_info_says_what_is_known(tmp_path):
    """Issue 44 §1: cards from the Python API were titled "hf_dp-model" with base model, task and data "not recorded";
    a model built from a config was described as pre-trained."""
    card = _api_trainer(tmp_path, info=False)
    body = card.split("\n---\n", 1)[1]
    section = _model_section(card)
    assert "not recorded" not in section and "hf_dp-model" not in card
    assert "# BertForSequenceClassification-dp\n" in body
    assert "- **Base model:** none: `BertForSequenceClassification` (model_type `bert`), initialised at random" in section
    assert "- **Task:** sequence classification (2 labels)" in section
    assert "columns `input_ids`, `token_type_ids`, `attention_mask`, `labels`" in section
    assert "- **Training examples (N):** 70" in section and "pre-trained values" not in body


def test_the_verdict_uses_the_planners_rule_and_prints_the_predicted_class_spread():
    """Issue 44 §9: "above the constant predictor" was said of a model that predicts one class for 98 % of the rows and
    beats the majority by one point, while the planner's calibration counts < 3 points above the majority as
    constant."""
    from recipes.glue_support import constant_baseline

    labels = [0] * 50 + [1] * 50
    preds = [0] * 98 + [1] * 2
    base = constant_baseline(labels, {"eval_accuracy": 0.51}, label_names=["yes", "no"], predictions=preds)
    assert base["at_or_below"] is True and base["predicted_shares"] == {"yes": 0.98, "no": 0.02}
    assert base["sentence"].startswith("NO BETTER THAN A CONSTANT PREDICTOR")
    assert "less than 3 points above" in base["sentence"] and "'yes' 98.0 %, 'no' 2.0 %" in base["sentence"]
    learned = constant_baseline(labels, {"eval_accuracy": 0.53}, predictions=[0, 1] * 50)
    assert learned["at_or_below"] is False and "is above" in learned["sentence"]


def test_a_regression_baseline_predicts_the_evaluation_mean_not_the_training_mean():
    from recipes.glue_support import regression_baseline

    base = regression_baseline([1.0, 3.0, 5.0, 3.0], {"eval_pearson": 0.6}, predictions=[1.5, 3.0, 4.5, 3.0])
    assert base["eval_mean"] == 3.0 and base["constant_mse"] == 2.0 and base["model_mse"] == pytest.approx(0.125)
    assert base["at_or_below"] is False and "not the training mean" in base["sentence"]
    assert regression_baseline([1.0, 3.0], {"eval_pearson": -0.1})["at_or_below"] is True
