"""recipes.glue_support, the recipes' GLUE data and metrics: loading (local layout, files, Hub offline), checks,
tokenization, metrics."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from recipes.glue_support import (  # noqa: E402
    GLUE_TASKS,
    DataLoadingError,
    build_compute_metrics,
    label_info,
    load_metric_fn,
    load_raw_datasets,
    main_metric_name,
    preprocess,
    sentence_keys,
)

REPO = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("HF_DP_SHARED", REPO.parent / "shared"))
GLUE_DIR = SHARED / "data" / "glue"
needs_glue = pytest.mark.skipif(not (GLUE_DIR / "QNLI" / "train.tsv").is_file(), reason="shared GLUE data not found")

QNLI_HEADER = "index\tquestion\tsentence\tlabel\n"


def _write(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    return str(path)


def _qnli_rows(labels):
    return "".join(
        f'{i}\tWhat is "thing" {i}?\tIt is a "quoted thing, with comma" {i}.\t{lab}\n' for i, lab in enumerate(labels)
    )


def _tiny_glue(tmp_path: Path) -> Path:
    root = tmp_path / "glue"
    _write(root / "QNLI" / "train.tsv", QNLI_HEADER + _qnli_rows(["entailment", "not_entailment", "entailment"]))
    _write(root / "QNLI" / "dev.tsv", QNLI_HEADER + _qnli_rows(["not_entailment", "entailment"]))
    _write(root / "SST-2" / "train.tsv", "sentence\tlabel\nit 's \"great\" \t1\nbad , bad \t0\n")
    _write(root / "SST-2" / "dev.tsv", "sentence\tlabel\nfine \t1\n")
    return root


# ------------------------------------------------------------------------------------------- metadata


def test_task_table_matches_hub_glue():
    assert GLUE_TASKS["qnli"].label_names == ("entailment", "not_entailment")
    assert GLUE_TASKS["qnli"].folder == "QNLI" and GLUE_TASKS["sst2"].folder == "SST-2"
    assert GLUE_TASKS["mnli"].dev_file == "dev_matched.tsv"
    assert GLUE_TASKS["mnli"].validation_split == "validation_matched"
    assert GLUE_TASKS["stsb"].is_regression and GLUE_TASKS["stsb"].num_labels == 1
    assert GLUE_TASKS["mrpc"].metrics == ("accuracy", "f1")
    assert GLUE_TASKS["cola"].metrics == ("matthews_correlation",)
    assert {t.folder for t in GLUE_TASKS.values()} >= {"QNLI", "SST-2", "MRPC", "RTE", "MNLI", "QQP", "CoLA", "STS-B"}


# ------------------------------------------------------------------------------------------- local GLUE layout


def test_data_dir_glue_layout_quotes_and_label_ids(tmp_path):
    root = _tiny_glue(tmp_path)
    raw = load_raw_datasets("qnli", data_dir=str(root))
    assert set(raw) == {"train", "validation"}
    feat = raw["train"].features["label"]
    assert isinstance(feat, datasets.ClassLabel) and feat.names == ["entailment", "not_entailment"]
    assert raw["train"]["label"] == [0, 1, 0] and raw["validation"]["label"] == [1, 0]
    # QUOTE_NONE: quotes and commas survive verbatim
    assert raw["train"][0]["question"] == 'What is "thing" 0?'
    assert raw["train"][0]["sentence"] == 'It is a "quoted thing, with comma" 0.'
    assert "idx" in raw["train"].column_names  # same column name as the Hub dataset

    sst = load_raw_datasets("sst2", data_dir=str(root))
    assert sst["train"]["label"] == [1, 0]
    assert sst["train"].features["label"].names == ["negative", "positive"]
    assert sst["train"][0]["sentence"].startswith('it \'s "great"')


def test_data_dir_missing_task_folder(tmp_path):
    root = _tiny_glue(tmp_path)
    with pytest.raises(DataLoadingError, match=r"RTE.*GLUE layout"):
        load_raw_datasets("rte", data_dir=str(root))
    with pytest.raises(DataLoadingError, match="--task_name"):
        load_raw_datasets(None, data_dir=str(root))


def test_mrpc_original_columns_are_renamed(tmp_path):
    header = "Quality\t#1 ID\t#2 ID\t#1 String\t#2 String\n"
    rows = "1\t1\t2\tA \"said\" it.\tA said it.\n0\t3\t4\tNo.\tYes.\n"
    root = tmp_path / "glue"
    _write(root / "MRPC" / "train.tsv", header + rows)
    _write(root / "MRPC" / "dev.tsv", header + rows)
    raw = load_raw_datasets("mrpc", data_dir=str(root))
    assert raw["train"].column_names[:0] == [] and {"sentence1", "sentence2", "label"} <= set(raw["train"].column_names)
    assert raw["train"]["label"] == [1, 0]
    assert raw["train"][0]["sentence1"] == 'A "said" it.'


def test_cola_has_no_header(tmp_path):
    rows = "gj04\t1\t\tThe sailors rode the breeze clear of the rocks.\ngj04\t0\t*\tThe more we study verbs.\n"
    root = tmp_path / "glue"
    _write(root / "CoLA" / "train.tsv", rows)
    _write(root / "CoLA" / "dev.tsv", rows)
    raw = load_raw_datasets("cola", data_dir=str(root))
    assert len(raw["train"]) == 2 and raw["train"]["label"] == [1, 0]
    assert raw["train"][1]["sentence"] == "The more we study verbs."


@needs_glue
def test_real_shared_qnli_and_sst2():
    raw = load_raw_datasets("qnli", data_dir=str(GLUE_DIR))
    assert len(raw["train"]) == 8999 and len(raw["validation"]) == 5463
    labels = np.array(raw["train"]["label"])
    assert (labels == 0).sum() == 4523 and (labels == 1).sum() == 4476  # entailment / not_entailment (README)
    dev = np.array(raw["validation"]["label"])
    assert (dev == 0).sum() == 2702 and (dev == 1).sum() == 2761
    sst = load_raw_datasets("sst2", data_dir=str(GLUE_DIR))
    assert len(sst["validation"]) == 872 and int(np.sum(sst["validation"]["label"])) == 444


# ------------------------------------------------------------------------------------------- explicit files


@pytest.mark.parametrize("ext", ["csv", "tsv", "json", "jsonl", "parquet"])
def test_train_validation_files_by_extension(tmp_path, ext):
    rows = [{"question": f"q{i}, \"x\"", "sentence": f"s{i}", "label": lab}
            for i, lab in enumerate(["entailment", "not_entailment", "1", "0"])]
    ds = datasets.Dataset.from_list(rows)
    path = tmp_path / f"train.{ext}"
    if ext == "csv":
        ds.to_csv(str(path), index=False)
    elif ext == "tsv":
        _write(path, "question\tsentence\tlabel\n" + "".join(f"{r['question']}\t{r['sentence']}\t{r['label']}\n" for r in rows))
    elif ext == "json":
        path.write_text(json.dumps(rows))
    elif ext == "jsonl":
        ds.to_json(str(path), lines=True)
    else:
        ds.to_parquet(str(path))
    raw = load_raw_datasets("qnli", train_file=str(path), validation_file=str(path))
    assert raw["train"]["label"] == [0, 1, 1, 0]
    assert raw["train"][0]["question"] == 'q0, "x"'


def test_custom_files_without_task(tmp_path):
    path = _write(tmp_path / "t.csv", "text,label\ngood,pos\nbad,neg\nok,pos\n")
    raw = load_raw_datasets(train_file=path, validation_file=path)
    info = label_info(raw)
    assert not info.is_regression and info.label_list == ["neg", "pos"] and info.num_labels == 2
    assert sentence_keys(raw) == ("text", None)


# ------------------------------------------------------------------------------------------- clear errors


def test_missing_text_column_names_the_file(tmp_path):
    path = _write(tmp_path / "bad_cols.tsv", "index\tquestion\tlabel\n0\tq?\tentailment\n")
    with pytest.raises(DataLoadingError) as e:
        load_raw_datasets("qnli", train_file=path, validation_file=path)
    assert "bad_cols.tsv" in str(e.value) and "sentence" in str(e.value) and "missing text column" in str(e.value)


def test_missing_label_column_names_the_file(tmp_path):
    path = _write(tmp_path / "nolabel.tsv", "index\tquestion\tsentence\n0\tq?\ts.\n")
    with pytest.raises(DataLoadingError) as e:
        load_raw_datasets("qnli", train_file=path, validation_file=path)
    assert "nolabel.tsv" in str(e.value) and "missing label column" in str(e.value)


@pytest.mark.parametrize("bad", ["maybe", "2", "-1"])
def test_label_outside_label_set(tmp_path, bad):
    path = _write(tmp_path / "badlab.tsv", QNLI_HEADER + _qnli_rows(["entailment", bad]))
    with pytest.raises(DataLoadingError) as e:
        load_raw_datasets("qnli", train_file=path, validation_file=path)
    msg = str(e.value)
    assert "badlab.tsv" in msg and bad in msg and "outside the label set" in msg and "entailment" in msg


def test_empty_files(tmp_path):
    empty = _write(tmp_path / "empty.tsv", "")
    with pytest.raises(DataLoadingError, match=r"empty\.tsv: the file is empty"):
        load_raw_datasets("qnli", train_file=empty, validation_file=empty)
    header_only = _write(tmp_path / "header.tsv", QNLI_HEADER)
    with pytest.raises(DataLoadingError, match=r"header\.tsv.*empty"):
        load_raw_datasets("qnli", train_file=header_only, validation_file=header_only)


def test_missing_file_and_bad_extension(tmp_path):
    with pytest.raises(DataLoadingError, match="does not exist"):
        load_raw_datasets("qnli", train_file=str(tmp_path / "nope.tsv"))
    txt = _write(tmp_path / "train.txt", "x")
    with pytest.raises(DataLoadingError, match="unsupported extension"):
        load_raw_datasets("qnli", train_file=txt)


def test_unknown_task():
    with pytest.raises(DataLoadingError, match="unknown GLUE task"):
        load_raw_datasets("squad")


def test_hub_unreachable_gives_one_clear_error(monkeypatch):
    def offline(*args, **kwargs):
        try:
            raise FileNotFoundError("Dataset nyu-mll/glue is not cached")
        except FileNotFoundError as inner:
            raise ConnectionError("Couldn't reach 'nyu-mll/glue' on the Hub (OfflineModeIsEnabled)") from inner

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataLoadingError) as e:
        load_raw_datasets("qnli")
    msg = str(e.value)
    assert "could not be reached" in msg and "--data_dir" in msg and "--train_file" in msg


@pytest.mark.skipif(os.environ.get("HF_HUB_OFFLINE") not in ("1", "true", "True"), reason="needs HF_HUB_OFFLINE=1")
def test_hub_offline_real_datasets_error():
    with pytest.raises(DataLoadingError, match="could not be reached"):
        load_raw_datasets("qnli")


# ------------------------------------------------------------------------------------------- tokenization


def _tiny_tokenizer(tmp_path: Path):
    from transformers import BertTokenizer

    words = "what is thing it a quoted with comma great bad fine q s x".split()
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + words + list("abcdefghijklmnopqrstuvwxyz0123456789?.,\"'")
    vf = tmp_path / "vocab.txt"
    vf.write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    # transformers 5 ignores vocab_file= (every word would be [UNK]); pass the vocabulary itself
    tok = BertTokenizer(vocab=str(vf), do_lower_case=True, model_max_length=512)
    assert tok.convert_tokens_to_ids("thing") != tok.unk_token_id
    return tok


def test_preprocess_like_run_glue(tmp_path):
    tok = _tiny_tokenizer(tmp_path)
    raw = load_raw_datasets("qnli", data_dir=str(_tiny_glue(tmp_path)))
    out = preprocess(raw, tok, "qnli", max_seq_length=8, pad_to_max_length=False, max_train_samples=2)
    assert len(out["train"]) == 2 and len(out["validation"]) == 2
    assert set(out["train"].column_names) >= {"input_ids", "attention_mask", "labels"}
    assert "question" not in out["train"].column_names
    assert out["train"]["labels"] == [0, 1]
    assert all(len(x) <= 8 for x in out["train"]["input_ids"])  # truncation
    # pair encoding: two [SEP]
    sep = tok.sep_token_id
    long = preprocess(raw, tok, "qnli", max_seq_length=128, pad_to_max_length=False)
    assert long["train"][0]["input_ids"].count(sep) == 2
    lengths = {len(x) for x in long["train"]["input_ids"]}
    assert max(lengths) < 128  # no padding unless asked
    padded = preprocess(raw, tok, "qnli", max_seq_length=32, pad_to_max_length=True, max_eval_samples=1)
    assert {len(x) for x in padded["train"]["input_ids"]} == {32} and len(padded["validation"]) == 1


def test_preprocess_custom_string_labels(tmp_path):
    tok = _tiny_tokenizer(tmp_path)
    path = _write(tmp_path / "t.csv", "text,label\ngood,pos\nbad,neg\n")
    raw = load_raw_datasets(train_file=path, validation_file=path)
    out = preprocess(raw, tok, None, max_seq_length=16)
    assert out["train"]["labels"] == [1, 0]


# ------------------------------------------------------------------------------------------- metrics


class _P:
    def __init__(self, predictions, label_ids):
        self.predictions, self.label_ids = predictions, label_ids


def test_metrics_formulas_for_each_task():
    from scipy.stats import pearsonr, spearmanr
    from sklearn.metrics import f1_score, matthews_corrcoef

    rng = np.random.default_rng(0)
    labels = rng.integers(0, 2, 200)
    logits = rng.normal(size=(200, 2)) + 2.0 * np.eye(2)[labels]
    preds = logits.argmax(1)
    acc = float((preds == labels).mean())
    m = build_compute_metrics("qnli", backend="sklearn")(_P(logits, labels))
    assert m == {"accuracy": pytest.approx(acc)}
    m = build_compute_metrics("mrpc", backend="sklearn")(_P((logits,), labels))
    assert m["accuracy"] == pytest.approx(acc) and m["f1"] == pytest.approx(f1_score(labels, preds))
    assert m["combined_score"] == pytest.approx((m["accuracy"] + m["f1"]) / 2)
    m = build_compute_metrics("cola", backend="sklearn")(_P(logits, labels))
    assert m["matthews_correlation"] == pytest.approx(matthews_corrcoef(labels, preds))
    y = rng.normal(size=50)
    yhat = y + rng.normal(scale=0.5, size=50)
    m = build_compute_metrics("stsb", backend="sklearn")(_P(yhat[:, None], y))
    assert m["pearson"] == pytest.approx(pearsonr(yhat, y)[0]) and m["spearmanr"] == pytest.approx(spearmanr(yhat, y)[0])
    assert main_metric_name("qnli") == "accuracy" and main_metric_name("stsb") == "pearson"
    assert main_metric_name("cola") == "matthews_correlation" and main_metric_name("mrpc") == "f1"


def test_metrics_auto_falls_back_offline_and_says_so(caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="recipes.glue_support.metrics"):
        cm = build_compute_metrics("qnli")  # evaluate.load needs the Hub; works too if it is reachable/cached
    assert cm.implementation.startswith(("evaluate", "scikit-learn"))
    assert any("hf_dp metrics: using" in r.getMessage() for r in caplog.records)
    labels = np.array([0, 1, 1, 0])
    assert cm(_P(np.eye(2)[[0, 1, 0, 0]], labels)) == {"accuracy": 0.75}


_LOCAL_METRIC = '''
import datasets
import evaluate

class LocalAccuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(description="test", citation="", inputs_description="",
            features=datasets.Features({"predictions": datasets.Value("int64"), "references": datasets.Value("int64")}))
    def _compute(self, predictions, references):
        return {"accuracy": sum(int(p == r) for p, r in zip(predictions, references)) / len(predictions)}
'''


def test_evaluate_path_agrees_with_fallback(tmp_path):
    """evaluate.load of a local metric script works offline; both implementations agree."""
    pytest.importorskip("evaluate")
    script = tmp_path / "local_accuracy" / "local_accuracy.py"
    _write(script, _LOCAL_METRIC)
    fn, desc = load_metric_fn("qnli", backend="evaluate", metric_path=str(script.parent))
    assert desc.startswith("evaluate")
    fb, _ = load_metric_fn("qnli", backend="sklearn")
    rng = np.random.default_rng(1)
    p, r = rng.integers(0, 2, 100), rng.integers(0, 2, 100)
    assert fn(p, r) == pytest.approx(fb(p, r))


def test_evaluate_glue_agrees_when_available():
    """If evaluate's own glue metric can be loaded (Hub or cache), it must match the fallback exactly."""
    evaluate = pytest.importorskip("evaluate")
    try:
        evaluate.load("glue", "mrpc")
    except Exception:
        pytest.skip("evaluate's glue metric is not loadable offline here")
    rng = np.random.default_rng(2)
    p, r = rng.integers(0, 2, 100), rng.integers(0, 2, 100)
    for task in ("mrpc", "cola", "qnli"):
        a, _ = load_metric_fn(task, backend="evaluate")
        b, _ = load_metric_fn(task, backend="sklearn")
        assert a(p, r) == pytest.approx(b(p, r))


def test_glue_text_is_read_verbatim_and_short_rows_are_refused(tmp_path):
    """MNLI-style rows whose text reads as "missing" (n/a, NA, null, None) are kept as text (on 0b9495a datasets'
    csv reader made them None and tokenization died); a row with too few fields names its line."""
    from recipes.glue_support import DataLoadingError, load_raw_datasets

    d = tmp_path / "RTE"
    d.mkdir()
    header = "index\tsentence1\tsentence2\tlabel\n"
    (d / "train.tsv").write_text(header + "0\tn/a\tNA\tentailment\n1\tnull\tNone\tnot_entailment\n")
    (d / "dev.tsv").write_text(header + "0\ta\tb\tentailment\n")
    raw = load_raw_datasets(task_name="rte", data_dir=str(tmp_path))
    rows = raw["train"].to_list()
    assert [(r["sentence1"], r["sentence2"]) for r in rows] == [("n/a", "NA"), ("null", "None")]
    (d / "train.tsv").write_text(header + "0\tn/a\tNA\tentailment\n1\tonly one field\n")
    with pytest.raises(DataLoadingError, match=r"train.tsv: line 3 has 2 tab-separated field\(s\), expected 4"):
        load_raw_datasets(task_name="rte", data_dir=str(tmp_path))
