"""Issue 53 item 2: every release carries a picture — ε spent and the evaluation metrics against steps, from the log
history (hf_dp.hub.plots) — referenced from its card. The training loss is never drawn: the card tells the reader it is
not protected and not to publish it (docs/guarantee.md, "Not private")."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path

import pytest

from hf_dp.hub import parse_front_matter, render_model_card, write_privacy_artifacts
from hf_dp.hub.plots import PLOT_NAME, curves, write_training_plot

from tests.test_card import EVAL, KW, REPORT

PNG = b"\x89PNG\r\n\x1a\n"


def _history(steps: int = 120, every: int = 10, eval_every: int = 40) -> list[dict]:
    """A log history as DPTrainer writes it: training logs (loss, learning_rate, epsilon), evaluations (eval_*,
    epsilon) and the closing train summary (train_loss, …)."""
    out = []
    for s in range(every, steps + 1, every):
        out.append({"loss": 5.0 + s / 1000, "learning_rate": 0.01, "bc_clamp_rate": 0.1, "epoch": s / 40, "step": s,
                    "epsilon": 0.25 * s ** 0.5})
        if s % eval_every == 0:
            out.append({"eval_loss": 0.7 - s / 1000, "eval_accuracy": 0.5 + s / 600, "eval_runtime": 1.5,
                        "eval_samples_per_second": 100.0, "eval_steps_per_second": 3.0, "epoch": s / 40, "step": s,
                        "epsilon": 0.25 * s ** 0.5})
    out.append({"train_runtime": 60.0, "train_samples_per_second": 10.0, "train_loss": 9.99, "epoch": 3.0,
                "step": steps, "total_flos": 1.0})
    return out


def test_the_curves_are_epsilon_and_the_eval_metrics_never_the_training_loss():
    eps, metrics = curves(_history())
    assert [s for s, _ in eps] == list(range(10, 121, 10)) and eps[-1][1] == pytest.approx(0.25 * 120 ** 0.5)
    assert set(metrics) == {"loss", "accuracy"}  # eval_loss and eval_accuracy; no runtime or throughput
    assert [s for s, _ in metrics["loss"]] == [40, 80, 120] and metrics["loss"][0][1] == pytest.approx(0.66)
    # nothing of the training logs: their loss, learning rate, clamp rate and the train summary
    train_values = {e["loss"] for e in _history() if "loss" in e} | {9.99, 0.01, 0.1}
    assert not any(v in train_values for points in metrics.values() for _, v in points)


def test_a_release_has_the_png_and_its_card_shows_it(tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_privacy_artifacts(tmp_path / "release", REPORT, log_history=_history(), **KW)
    png = tmp_path / "release" / PLOT_NAME
    data = png.read_bytes()
    assert paths[PLOT_NAME] == str(png) and data[:8] == PNG and 5_000 < len(data) < 100_000  # a few tens of KB
    card = (tmp_path / "release" / "README.md").read_text()
    assert card == Path(paths["README.md"]).read_text()
    assert re.search(r"^!\[ε spent and the evaluation metrics against training steps\]\(training_curves\.png\)$", card, re.M)
    section = card.split("## Training curves", 1)[1].split("\n## ", 1)[0]
    assert "`loss`, `accuracy`" in section and "ε spent (from the accountant: public numbers only)" in section
    assert "The training loss is not plotted" in section and "not protected" in section
    # placed with the results, before the exclusions; the rest of the card unchanged and its metadata still parses
    assert card.index("## Evaluation") < card.index("## Training curves") < card.index("## What the guarantee does not")
    whole = card[card.index("## Training curves"):card.index("## What the guarantee does not")]
    assert card.replace(whole, "") == render_model_card(REPORT, **KW)
    assert parse_front_matter(card)["differential_privacy"]["epsilon"] == REPORT["epsilon"]


def test_the_png_is_deterministic(tmp_path):
    pytest.importorskip("matplotlib")
    write_training_plot(_history(), tmp_path / "a")
    write_training_plot(_history(), tmp_path / "b")
    a, b = (tmp_path / "a" / PLOT_NAME).read_bytes(), (tmp_path / "b" / PLOT_NAME).read_bytes()
    assert a == b and b"Software" not in a and b"matplotlib" not in a.lower()


def test_epsilon_alone_without_evaluations_and_nothing_without_either(tmp_path):
    pytest.importorskip("matplotlib")
    history = [e for e in _history() if not any(k.startswith("eval_") for k in e)]
    plot = write_training_plot(history, tmp_path)
    assert plot.epsilon and plot.metrics == () and (tmp_path / PLOT_NAME).is_file()
    # a log without ε or evaluations (a non-private run that never evaluated): no picture, and no stale one
    assert write_training_plot([{"loss": 1.0, "step": 5}], tmp_path) is None and not (tmp_path / PLOT_NAME).exists()
    write_privacy_artifacts(tmp_path / "r", REPORT, log_history=[{"loss": 1.0, "step": 5}], **KW)
    assert "Training curves" not in (tmp_path / "r" / "README.md").read_text()


def test_non_private_card_caption(tmp_path):
    pytest.importorskip("matplotlib")
    history = [{k: v for k, v in e.items() if k != "epsilon"} for e in _history()]
    write_privacy_artifacts(tmp_path, {"hf_dp_version": "0.1.0", "differential_privacy": False},
                            log_history=history, eval_results=EVAL)
    card = (tmp_path / "README.md").read_text()
    assert "](training_curves.png)" in card and "ε spent" not in card.split("## Training curves", 1)[1]


def test_without_the_log_history_the_card_is_as_before(tmp_path):
    paths = write_privacy_artifacts(tmp_path, REPORT, **KW)
    assert set(paths) == {"privacy.json", "README.md"} and not (tmp_path / PLOT_NAME).exists()
    assert (tmp_path / "README.md").read_text() == render_model_card(REPORT, **KW)


def test_matplotlib_missing_skips_the_picture_with_one_line(tmp_path, monkeypatch, caplog):
    for name in [m for m in sys.modules if m == "matplotlib" or m.startswith("matplotlib.")]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib -> ImportError
    with caplog.at_level(logging.INFO, logger="hf_dp"):
        paths = write_privacy_artifacts(tmp_path, REPORT, log_history=_history(), **KW)
    assert set(paths) == {"privacy.json", "README.md"} and not (tmp_path / PLOT_NAME).exists()
    assert "training_curves.png" not in (tmp_path / "README.md").read_text()
    lines = [r.getMessage() for r in caplog.records if "matplotlib" in r.getMessage()]
    assert lines == ["hf_dp: matplotlib is not installed: the release has no training_curves.png (pip install matplotlib)"]


# ------------------------------------------------------------------------------ a recipe's release, end to end


@pytest.mark.filterwarnings("ignore")
def test_the_glue_recipes_release_has_the_picture_and_the_summary_compares(tmp_path, capsys):
    """recipes/glue.py on a tiny random BERT: the release folder holds the PNG its card shows (ε and the eval metrics
    of the run), and the summary puts the planner's expectation beside the result."""
    pytest.importorskip("matplotlib")
    from tests.test_recipes import GLUE_DIR, _load_recipe, _summary

    if not (GLUE_DIR / "SST-2" / "train.tsv").is_file():
        pytest.skip("shared GLUE data not found")
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizer

    model = tmp_path / "tiny_bert"
    model.mkdir()
    words = "the a of to is it that this film movie good bad great fun dull story".split()
    (model / "vocab.txt").write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words) + "\n")
    BertTokenizer(vocab=str(model / "vocab.txt"), do_lower_case=True, model_max_length=64).save_pretrained(str(model))
    BertForSequenceClassification(BertConfig(vocab_size=5 + len(words), hidden_size=16, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=16, max_position_embeddings=64,
                                             num_labels=2)).save_pretrained(str(model))
    out = tmp_path / "out"
    code = _load_recipe().main(["--task_name", "sst2", "--data_dir", str(GLUE_DIR), "--model_name_or_path", str(model),
                                "--max_train_samples", "64", "--max_eval_samples", "32", "--max_seq_length", "16",
                                "--per_device_train_batch_size", "16", "--num_train_epochs", "2", "--epsilon", "3",
                                "--eval_strategy", "steps", "--eval_steps", "4", "--logging_steps", "2",
                                "--output_dir", str(out), "--dp_seed", "0"])
    text = capsys.readouterr().out
    assert code == 0
    release = out / "release"
    png = (release / PLOT_NAME).read_bytes()
    assert png[:8] == PNG and len(png) < 100_000
    card = (release / "README.md").read_text()
    assert "](training_curves.png)" in card and "`accuracy`" in card.split("## Training curves", 1)[1]
    row = _summary(text)["planner's expectation"]
    assert row.startswith("expected ") or row.startswith("no calibrated expectation")
    assert "(planner, R_run" in row and "got accuracy" in row


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("recipe", ["clm", "sft"])
def test_the_causal_lm_recipes_releases_have_the_picture(recipe, tmp_path_factory, tmp_path):
    """clm.py rewrites the card with the log history; sft.py's release is DPSFTTrainer's own save: both show the PNG."""
    pytest.importorskip("matplotlib")
    if recipe == "sft":
        pytest.importorskip("trl")
    import tests.test_recipe_cards as rc

    files = rc.files.__wrapped__(tmp_path_factory) if hasattr(rc.files, "__wrapped__") else None
    if files is None:
        pytest.skip("tests/test_recipe_cards.py's data fixture is not reachable")
    card = (rc._run_clm(files, tmp_path / "out") if recipe == "clm" else
            rc._run_sft(files, tmp_path / "out", "chats.jsonl", "chat_dev.jsonl"))
    png = (card.folder / PLOT_NAME).read_bytes()
    assert png[:8] == PNG and len(png) < 100_000
    assert "](training_curves.png)" in card.text and "The training loss is not plotted" in card.text
