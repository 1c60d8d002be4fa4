"""GLUE data for the hf_dp recipes: loading (Hub, local GLUE folder, or your own files), checks, tokenization.

Flag names and meanings follow transformers' ``examples/pytorch/text-classification/run_glue.py``
(``--task_name``, ``--dataset_name``, ``--train_file``, ``--max_seq_length``, ``--pad_to_max_length``,
``--max_train_samples`` ...). hf_dp adds ``--data_dir DIR``: a folder in the original GLUE layout
(``DIR/QNLI/train.tsv``, ``DIR/QNLI/dev.tsv`` ...), read through ``datasets``' csv builder.

Every loading path goes through :func:`datasets.load_dataset`; labels are converted to the integer ids of the
Hub ``nyu-mll/glue`` dataset (QNLI: entailment=0, not_entailment=1) and stored as a ``ClassLabel`` so the result
looks like the Hub dataset whichever source it came from.
"""

from __future__ import annotations

import csv
import logging
import math
import os
from dataclasses import dataclass
from typing import Any

import datasets

from .tasks import HUB_GLUE_DATASET, MISMATCHED, DataLoadingError, GlueTask, get_task

logger = logging.getLogger(__name__)

_EXTENSION_BUILDERS = {
    ".csv": "csv",
    ".tsv": "csv",
    ".json": "json",
    ".jsonl": "json",
    ".parquet": "parquet",
}

_HUB_HELP = (
    "pass --data_dir DIR (a folder in the GLUE layout, e.g. DIR/QNLI/train.tsv and DIR/QNLI/dev.tsv) "
    "or --train_file/--validation_file (csv, tsv, json, jsonl or parquet)"
)


# --------------------------------------------------------------------------------------------- loading


def _is_unreachable_error(exc: BaseException) -> bool:
    """True when ``exc`` (or anything in its cause chain) means "the Hub could not be reached"."""
    try:  # huggingface_hub's own errors, when importable
        from huggingface_hub.errors import LocalEntryNotFoundError, OfflineModeIsEnabled

        hub_errors: tuple[type, ...] = (LocalEntryNotFoundError, OfflineModeIsEnabled)
    except Exception:  # pragma: no cover - very old huggingface_hub
        hub_errors = ()
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, (ConnectionError, TimeoutError) + hub_errors):
            return True
        text = str(exc)
        if "Couldn't reach" in text or "OfflineModeIsEnabled" in text or "offline mode" in text.lower():
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _load(builder: str, data_files: dict[str, str], cache_dir: str | None, **kwargs) -> datasets.DatasetDict:
    try:
        return datasets.load_dataset(builder, data_files=data_files, cache_dir=cache_dir, **kwargs)
    except DataLoadingError:
        raise
    except Exception as exc:  # empty files, broken rows, ...: report the file(s) and the reason
        files = ", ".join(path for path in data_files.values())
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        for path in data_files.values():
            if os.path.isfile(path) and os.path.getsize(path) == 0:
                raise DataLoadingError(f"{path}: the file is empty") from exc
        if "corresponds to no data" in reason:
            raise DataLoadingError(f"{files}: the file is empty (no data rows, only a header?)") from exc
        raise DataLoadingError(f"could not read {files}: {type(exc).__name__}: {reason}") from exc


def _load_one_file(split: str, path: str, cache_dir: str | None, task: GlueTask | None) -> datasets.Dataset:
    if not os.path.isfile(path):
        raise DataLoadingError(f"{split} file {path} does not exist")
    if os.path.getsize(path) == 0:
        raise DataLoadingError(f"{path}: the file is empty")
    lower = path.lower()
    ext = ".jsonl" if lower.endswith(".jsonl") else os.path.splitext(lower)[1]
    if ext not in _EXTENSION_BUILDERS:
        raise DataLoadingError(f"{path}: unsupported extension {ext!r}; use one of {sorted(_EXTENSION_BUILDERS)}")
    builder = _EXTENSION_BUILDERS[ext]
    kwargs: dict[str, Any] = {}
    if ext in (".tsv", ".csv"):
        # text verbatim: pandas would read "n/a", "NA", "null", "None" and empty fields as missing values
        kwargs.update(keep_default_na=False, na_filter=False)
    if ext == ".tsv":
        kwargs.update(delimiter="\t", quoting=csv.QUOTE_NONE)
        headerless = task is not None and task.column_names is not None
        if headerless:
            kwargs.update(column_names=list(task.column_names))
            _check_no_header(path, task)
        _check_tsv_rows(path, len(task.column_names) if headerless else None)
    if ext == ".json":
        _check_json_layout(path)
    ds = _load(builder, {split: path}, cache_dir, **kwargs)[split]
    return ds


def _check_no_header(path: str, task: "GlueTask") -> None:
    """GLUE's CoLA files have no header row: a first line naming the columns would be read as an example."""
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline().rstrip("\r\n").split("\t")
    names = {"label", "sentence", "source", "original_label", "index"}
    if any(field.strip().lower() in names for field in first):
        raise DataLoadingError(
            f"{path}: the first line looks like a header ({first}); GLUE's {task.folder} file is headerless "
            f"(columns {list(task.column_names)}): remove the header line"
        )


def _check_json_layout(path: str) -> None:
    """A ``.json`` file must be a list of records, a dict of columns, or JSON Lines — not a dict of records keyed by
    id (``datasets`` would fail with a message listing every key)."""
    import json

    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except ValueError:
        return  # JSON Lines (or invalid JSON: datasets' own message)
    if isinstance(data, dict) and data and all(isinstance(v, dict) for v in data.values()):
        raise DataLoadingError(
            f"{path}: a JSON object of {len(data)} records keyed by id; use JSON Lines (one object per line), a JSON "
            "list of objects, or an object of columns (each a list)"
        )


def _check_tsv_rows(path: str, expected: int | None) -> None:
    """Every row of a TSV file has as many tab-separated fields as the header (or ``expected`` for GLUE's
    headerless files): a short row would otherwise become missing (or silently shifted) text."""
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        for number, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")
            if number == 1 and expected is None:
                expected = line.count("\t") + 1
                continue
            if not line:
                continue
            fields = line.count("\t") + 1
            if fields != expected:
                raise DataLoadingError(
                    f"{path}: line {number} has {fields} tab-separated field(s), expected {expected}"
                    + (" (as the header)" if number > 1 else "")
                )


def load_raw_datasets(
    task_name: str | None = None,
    dataset_name: str | None = None,
    dataset_config_name: str | None = None,
    data_dir: str | None = None,
    train_file: str | None = None,
    validation_file: str | None = None,
    test_file: str | None = None,
    cache_dir: str | None = None,
) -> datasets.DatasetDict:
    """Load GLUE (or your own) data as a ``DatasetDict`` with splits ``train``/``validation`` (and ``test``).

    Priority, as in run_glue.py: ``data_dir`` (hf_dp's local GLUE folder) → explicit files → ``dataset_name`` →
    the Hub GLUE dataset for ``task_name``. Labels are converted to the Hub dataset's integer ids.
    Raises :class:`DataLoadingError` with an actionable message on any failure.
    """
    task = get_task(task_name)
    sources: dict[str, str] = {}
    if data_dir is not None:
        if task is None:
            raise DataLoadingError("--data_dir needs --task_name (it selects the folder, e.g. DIR/QNLI)")
        folder = _task_folder(data_dir, task)
        files = {"train": "train.tsv", "validation": task.dev_file, "test": task.test_file}
        explicit = {"train": train_file, "validation": validation_file, "test": test_file}
        parts = {}
        for split, name in files.items():
            path = explicit[split] or os.path.join(folder, name)
            if os.path.isfile(path):
                parts[split] = _load_one_file(split, path, cache_dir, task)
                sources[split] = path
            elif split != "test":
                raise DataLoadingError(
                    f"{path} not found: --data_dir expects the GLUE layout DIR/{task.folder}/{{train.tsv,{task.dev_file}}}"
                )
        if task.dev_mismatched_file and validation_file is None:
            path = os.path.join(folder, task.dev_mismatched_file)
            if os.path.isfile(path):
                parts[MISMATCHED] = _load_one_file(MISMATCHED, path, cache_dir, task)
                sources[MISMATCHED] = path
        raw = datasets.DatasetDict(parts)
    elif train_file is not None or validation_file is not None or test_file is not None:
        explicit = {"train": train_file, "validation": validation_file, "test": test_file}
        parts = {}
        for split, path in explicit.items():
            if path is not None:
                parts[split] = _load_one_file(split, path, cache_dir, task)
                sources[split] = path
        raw = datasets.DatasetDict(parts)
    else:
        name = dataset_name
        config = dataset_config_name
        if name is None:
            if task is None:
                raise DataLoadingError(f"no data given: pass --task_name (GLUE from the Hub), or {_HUB_HELP}")
            name, config = HUB_GLUE_DATASET, task.name
        try:
            raw = datasets.load_dataset(name, config, cache_dir=cache_dir)
        except Exception as exc:
            if _is_unreachable_error(exc):
                raise DataLoadingError(
                    f"the Hugging Face Hub could not be reached to download {name!r}"
                    f"{f' ({config})' if config else ''}; to use local data, {_HUB_HELP}"
                ) from exc
            raise DataLoadingError(f"could not load dataset {name!r} ({config}): {type(exc).__name__}: {exc}") from exc
        sources = {split: f"{name}[{split}]" for split in raw}
        if task is not None and task.validation_split in raw and task.validation_split != "validation":
            raw["validation"] = raw[task.validation_split]
            sources["validation"] = f"{name}[{task.validation_split}]"
        keep = ("train", "validation", "test") + ((task.mismatched_split,) if task is not None and task.mismatched_split else ())
        raw = datasets.DatasetDict({k: v for k, v in raw.items() if k in keep})
    return _normalize(raw, task, sources)


def _task_folder(data_dir: str, task: GlueTask) -> str:
    for candidate in (task.folder, task.folder.lower(), task.name, task.name.upper()):
        folder = os.path.join(data_dir, candidate)
        if os.path.isdir(folder):
            return folder
    if os.path.isfile(os.path.join(data_dir, "train.tsv")):  # DIR is already the task folder
        return data_dir
    raise DataLoadingError(
        f"{os.path.join(data_dir, task.folder)} not found: --data_dir expects the GLUE layout "
        f"DIR/{task.folder}/{{train.tsv,{task.dev_file}}}"
    )


# --------------------------------------------------------------------------------------------- checks


def _normalize(raw: datasets.DatasetDict, task: GlueTask | None, sources: dict[str, str]) -> datasets.DatasetDict:
    """Rename original GLUE columns, check columns and labels, convert labels to the Hub's ids."""
    if "train" not in raw and "validation" not in raw and "test" not in raw:
        raise DataLoadingError("no train, validation or test data was given")
    out = {}
    for split, ds in raw.items():
        src = sources.get(split, split)
        if task is not None:
            renames = {a: b for a, b in {**task.rename, "index": "idx"}.items()
                       if a in ds.column_names and b not in ds.column_names}
            if renames:
                ds = ds.rename_columns(renames)
        if len(ds) == 0:
            raise DataLoadingError(f"{src}: the file is empty (no data rows)")
        needs_label = split != "test"
        if task is not None:
            missing = [c for c in task.text_columns if c not in ds.column_names]
            if missing:
                raise DataLoadingError(
                    f"{src}: missing text column(s) {missing} for task {task.name!r} "
                    f"(expected {list(task.text_columns)}; found {ds.column_names})"
                )
        if "label" not in ds.column_names:
            if needs_label:
                raise DataLoadingError(f"{src}: missing label column 'label' (found {ds.column_names})")
        else:
            ds = _convert_labels(ds, task, src, allow_unlabeled=(split == "test"))
        out[split] = ds
    result = datasets.DatasetDict(out)
    if task is None:
        _check_custom_text_columns(result, sources)
    return result


def _convert_labels(ds: datasets.Dataset, task: GlueTask | None, src: str, allow_unlabeled: bool) -> datasets.Dataset:
    feature = ds.features["label"]
    if task is None:
        return ds
    if task.is_regression:
        values = ds["label"]
        bad = [v for v in values if not _is_number(v)]
        if bad:
            raise DataLoadingError(f"{src}: task {task.name!r} needs numeric labels (a score); found {bad[:3]!r}")
        return ds.cast_column("label", datasets.Value("float32"))
    names = task.label_names
    assert names is not None
    if isinstance(feature, datasets.ClassLabel):
        if list(feature.names) == list(names):
            return ds
        # same label set in another order: go through the names
        to_name = feature.names
        ds = ds.map(lambda b: {"label": [to_name[i] if i >= 0 else -1 for i in b["label"]]}, batched=True,
                    features=datasets.Features({**ds.features, "label": datasets.Value("string")}))
    index = {n: i for i, n in enumerate(names)}

    def to_id(v):
        if v is None:
            return None
        if isinstance(v, str):
            s = v.strip()
            if s in index:
                return index[s]
            try:
                v = float(s) if "." in s else int(s)
            except ValueError:
                return None
        if isinstance(v, float):
            if math.isnan(v) or v != int(v):
                return None
            v = int(v)
        if isinstance(v, int) and (0 <= v < len(names) or (allow_unlabeled and v == -1)):
            return v
        return None

    values = ds["label"]
    ids = [to_id(v) for v in values]
    bad = sorted({repr(values[i]) for i, x in enumerate(ids) if x is None})
    if bad:
        allowed = list(names) + list(range(len(names)))
        first = next(i for i, x in enumerate(ids) if x is None)
        raise DataLoadingError(
            f"{src}: label(s) {', '.join(bad[:5])}{' ...' if len(bad) > 5 else ''} outside the label set of task "
            f"{task.name!r} (allowed: {allowed}); first bad row is data row {first + 1}"
        )
    ds = ds.remove_columns("label").add_column("label", ids)
    if allow_unlabeled and any(i == -1 for i in ids):
        return ds.cast_column("label", datasets.Value("int64"))
    return ds.cast_column("label", datasets.ClassLabel(names=list(names)))


def _is_number(v) -> bool:
    if isinstance(v, bool):
        return False
    if isinstance(v, (int, float)):
        return not math.isnan(float(v))
    try:
        return not math.isnan(float(v))
    except (TypeError, ValueError):
        return False


def _check_custom_text_columns(raw: datasets.DatasetDict, sources: dict[str, str]) -> None:
    for split, ds in raw.items():
        if not [c for c in ds.column_names if c != "label"]:
            raise DataLoadingError(f"{sources.get(split, split)}: no text column besides 'label'")


# --------------------------------------------------------------------------------------------- labels, keys


@dataclass
class LabelInfo:
    is_regression: bool
    label_list: list[str] | None
    num_labels: int


def label_info(raw: datasets.DatasetDict, task_name: str | None = None) -> LabelInfo:
    """Number of labels / names / regression flag, as run_glue.py derives them."""
    task = get_task(task_name)
    if task is not None:
        return LabelInfo(task.is_regression, None if task.is_regression else list(task.label_names), task.num_labels)
    ds = raw["train"] if "train" in raw else raw["validation"]
    feature = ds.features["label"]
    if isinstance(feature, datasets.ClassLabel):
        return LabelInfo(False, list(feature.names), feature.num_classes)
    is_regression = getattr(feature, "dtype", "") in ("float32", "float64")
    if is_regression:
        return LabelInfo(True, None, 1)
    labels = sorted({v for split in raw.values() if "label" in split.column_names for v in split["label"] if v != -1})
    return LabelInfo(False, [str(v) for v in labels], len(labels))


def sentence_keys(raw: datasets.DatasetDict, task_name: str | None = None) -> tuple[str, str | None]:
    task = get_task(task_name)
    if task is not None:
        return task.sentence1_key, task.sentence2_key
    ds = raw["train"] if "train" in raw else next(iter(raw.values()))
    non_label = [n for n in ds.column_names if n != "label"]
    if "sentence1" in non_label and "sentence2" in non_label:
        return "sentence1", "sentence2"
    if len(non_label) >= 2:
        return non_label[0], non_label[1]
    return non_label[0], None


# --------------------------------------------------------------------------------------------- tokenization


def preprocess(
    raw: datasets.DatasetDict,
    tokenizer,
    task_name: str | None = None,
    max_seq_length: int = 128,
    pad_to_max_length: bool = False,
    max_train_samples: int | None = None,
    max_eval_samples: int | None = None,
    max_predict_samples: int | None = None,
    label_to_id: dict[Any, int] | None = None,
    overwrite_cache: bool = False,
    num_proc: int | None = None,
    keep_train_columns: tuple[str, ...] = (),
) -> datasets.DatasetDict:
    """Tokenize like run_glue.py: truncation to ``max_seq_length``, padding only with ``pad_to_max_length``.

    ``max_*_samples`` keep the first N rows (run_glue semantics). Returns splits with ``input_ids``,
    ``attention_mask`` (``token_type_ids`` when the tokenizer makes them) and ``labels``; raw text columns are dropped.
    For custom files whose labels are not yet ids, ``label_to_id`` maps them (built from the label list if omitted).
    ``keep_train_columns``: raw columns the training split keeps (the ``--privacy_unit_column``).
    """
    if max_seq_length > tokenizer.model_max_length:
        logger.warning(
            "max_seq_length (%d) is larger than the tokenizer's model_max_length (%d); using %d",
            max_seq_length, tokenizer.model_max_length, tokenizer.model_max_length,
        )
        max_seq_length = tokenizer.model_max_length
    key1, key2 = sentence_keys(raw, task_name)
    info = label_info(raw, task_name)
    needs_mapping = False
    if not info.is_regression and "train" in raw and "label" in raw["train"].column_names:
        needs_mapping = not isinstance(raw["train"].features["label"], datasets.ClassLabel) and get_task(task_name) is None
    if needs_mapping and label_to_id is None:
        label_to_id = {v: i for i, v in enumerate(sorted({v for s in raw.values() if "label" in s.column_names for v in s["label"] if v != -1}))}
    padding = "max_length" if pad_to_max_length else False

    def fn(batch):
        texts = (batch[key1],) if key2 is None else (batch[key1], batch[key2])
        result = tokenizer(*texts, padding=padding, max_length=max_seq_length, truncation=True)
        if "label" in batch:
            if label_to_id is not None:
                result["labels"] = [label_to_id[v] if v != -1 else -1 for v in batch["label"]]
            else:
                result["labels"] = batch["label"]
        return result

    limits = {"train": max_train_samples, "validation": max_eval_samples, MISMATCHED: max_eval_samples, "test": max_predict_samples}
    out = {}
    for split, ds in raw.items():
        limit = limits.get(split)
        if limit is not None:
            ds = ds.select(range(min(len(ds), limit)))
        keep = keep_train_columns if split == "train" else ()
        out[split] = ds.map(
            fn, batched=True, remove_columns=[c for c in ds.column_names if c not in keep],
            load_from_cache_file=not overwrite_cache,
            num_proc=num_proc, desc=f"Running tokenizer on {split}",
        )
    return datasets.DatasetDict(out)
