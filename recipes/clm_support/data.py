"""Causal-LM data for ``recipes/clm.py``: loading, the checks before tokenizing, and the blocks.

* Loading: ``--train_file`` / ``--validation_file`` — ``.txt`` (one example per line, column ``text``, through
  ``datasets``' ``text`` builder), ``.json`` / ``.jsonl`` / ``.csv`` / ``.tsv`` / ``.parquet`` (through
  ``datasets``' loaders, with the GLUE recipe's file checks: :func:`recipes.glue_support.data._load_one_file`) — or
  ``--dataset_name`` (``datasets.load_dataset``; offline, only what is in the local cache).
* Checks, before anything is tokenized: the text column exists and holds text; ``--privacy_unit_column`` exists in the
  training data and names a unit on every row (one :class:`DataLoadingError` sentence naming the columns that exist).
* Units: without ``--privacy_unit_column`` each input row (a document) is its own unit — :func:`add_document_ids`
  adds the column :data:`DOCUMENT_COLUMN` (the row's index). With it, a unit is every row sharing its value.
* Blocks (:func:`training_blocks`, :func:`evaluation_blocks`): a document's tokens are cut into pieces of at most
  ``block_size`` tokens that all keep its unit id (never packed with another row); with a unit column, a unit's texts
  are concatenated (a separator — the tokenizer's eos, else sep — between two texts that do not already end with it)
  and cut the same way: packing within a unit only, so that each block belongs to exactly one unit. The last block of
  a unit is shorter; the collator pads it. Evaluation rows are cut the same way, one row at a time, without units.

run_clm.py instead concatenates the whole corpus and cuts it into full blocks (dropping the remainder): a block there
mixes several rows, which would put two people's text into one example. Here no block crosses a unit boundary.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from typing import Any, Optional

import datasets

from hf_dp.run.data import no_progress_bar  # noqa: F401  (re-exported: the recipe's unit-level data steps)
from recipes.glue_support.data import _load_one_file
from recipes.glue_support.tasks import DataLoadingError

logger = logging.getLogger(__name__)

#: the unit column the recipe adds when no --privacy_unit_column is given: each input row's index (a document)
DOCUMENT_COLUMN = "document"
TEXT_SUFFIXES = (".txt", ".text")
FILE_SUFFIXES = TEXT_SUFFIXES + (".json", ".jsonl", ".csv", ".tsv", ".parquet")


# --------------------------------------------------------------------------------------------- loading


def _load_text_file(split: str, path: str, cache_dir: Optional[str], keep_linebreaks: bool) -> datasets.Dataset:
    if not os.path.isfile(path):
        raise DataLoadingError(f"{split} file {path} does not exist")
    if os.path.getsize(path) == 0:
        raise DataLoadingError(f"{path}: the file is empty")
    try:
        return datasets.load_dataset("text", data_files={split: path}, cache_dir=cache_dir,
                                     keep_linebreaks=keep_linebreaks)[split]
    except Exception as exc:  # unreadable encoding, ...: name the file and the reason
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataLoadingError(f"could not read {path}: {type(exc).__name__}: {reason}") from exc


def _load_file(split: str, path: str, cache_dir: Optional[str], keep_linebreaks: bool) -> datasets.Dataset:
    lower = path.lower()
    if lower.endswith(TEXT_SUFFIXES):
        return _load_text_file(split, path, cache_dir, keep_linebreaks)
    if not lower.endswith(FILE_SUFFIXES):
        raise DataLoadingError(f"{path}: unsupported extension; use one of {list(FILE_SUFFIXES)}")
    return _load_one_file(split, path, cache_dir, None)


def load_raw_datasets(
    train_file: Optional[str] = None,
    validation_file: Optional[str] = None,
    dataset_name: Optional[str] = None,
    dataset_config_name: Optional[str] = None,
    cache_dir: Optional[str] = None,
    keep_linebreaks: bool = True,
) -> datasets.DatasetDict:
    """``train`` and/or ``validation`` splits from files (priority, as run_clm) or from ``datasets``. Any failure is one
    :class:`DataLoadingError` sentence naming the file or dataset."""
    if train_file is not None or validation_file is not None:
        parts = {}
        for split, path in (("train", train_file), ("validation", validation_file)):
            if path is not None:
                parts[split] = _load_file(split, path, cache_dir, keep_linebreaks)
        return datasets.DatasetDict(parts)
    if dataset_name is None:
        raise DataLoadingError("no data given: pass --train_file (txt, json, jsonl or csv; --validation_file for the "
                               "perplexity) or --dataset_name")
    config = f" ({dataset_config_name})" if dataset_config_name else ""
    try:
        raw = datasets.load_dataset(dataset_name, dataset_config_name, cache_dir=cache_dir)
    except Exception as exc:  # not in the local cache, no network, unknown name...: one sentence, no traceback
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataLoadingError(
            f"could not load dataset {dataset_name!r}{config} ({type(exc).__name__}: {reason}); without the Hugging "
            "Face Hub only datasets already in the local cache load: pass --train_file/--validation_file instead"
        ) from exc
    if not isinstance(raw, datasets.DatasetDict):
        raw = datasets.DatasetDict({"train": raw})
    kept = {k: v for k, v in raw.items() if k in ("train", "validation")}
    if not kept:
        raise DataLoadingError(f"dataset {dataset_name!r}{config} has no 'train' or 'validation' split "
                               f"(it has {sorted(raw)})")
    return datasets.DatasetDict(kept)


# --------------------------------------------------------------------------------------------- checks


def _is_text_feature(feature: Any) -> bool:
    return isinstance(feature, datasets.Value) and feature.dtype in ("string", "large_string", "null")


def check_text_column(raw: datasets.DatasetDict, text_column: str, sources: dict[str, str]) -> None:
    """Every split has ``text_column`` and it holds text (strings; empty and null rows are dropped later)."""
    for split, ds in raw.items():
        src = sources.get(split, split)
        if text_column not in ds.column_names:
            raise DataLoadingError(
                f"{src}: no text column '{text_column}' (it has {ds.column_names}); pass --text_column NAME"
            )
        feature = ds.features[text_column]
        if not _is_text_feature(feature):
            raise DataLoadingError(
                f"{src}: column '{text_column}' holds {getattr(feature, 'dtype', type(feature).__name__)} values, not "
                "text; pass --text_column NAME of the text column"
            )
        if len(ds) == 0:
            raise DataLoadingError(f"{src}: no data rows")


def _missing_unit(value: Any) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value)) or (
        isinstance(value, str) and not value.strip())


def check_unit_column(train: datasets.Dataset, column: Optional[str], text_column: str, source: str) -> None:
    """``--privacy_unit_column``: a column of the training data, not the text, with a unit on every row. Without it,
    the recipe's own :data:`DOCUMENT_COLUMN` must not clash with a column of the data."""
    columns = train.column_names
    if column is None:
        if DOCUMENT_COLUMN in columns:
            raise DataLoadingError(
                f"{source} has a column '{DOCUMENT_COLUMN}', the name of the recipe's own unit column (each row's "
                f"index when no --privacy_unit_column is given); pass --privacy_unit_column {DOCUMENT_COLUMN} to make "
                "it the unit, or rename it"
            )
        return
    if column not in columns:
        raise DataLoadingError(
            f"--privacy_unit_column {column}: {source} has no column '{column}' (its columns: {columns})"
        )
    if column == text_column:
        raise DataLoadingError(f"--privacy_unit_column {column} is the text column; name the column that says whose "
                               f"text each row is (the columns: {columns})")
    for i, value in enumerate(train[column]):
        if _missing_unit(value):
            raise DataLoadingError(
                f"--privacy_unit_column {column}: data row {i + 1} of {source} has no unit ({value!r}); every training "
                f"row must name its unit (the columns: {columns})"
            )


def drop_empty_texts(ds: datasets.Dataset, text_column: str, source: str, count_is_private: bool = False) -> datasets.Dataset:
    """Rows whose text is null or only whitespace (a blank line of a .txt file) hold no token to learn from: dropped
    (each row's own content decides, so this is the same for any neighbouring dataset). ``count_is_private``: the
    log line does not say how many (rows of a unit-level training set are private)."""
    keep = [i for i, t in enumerate(ds[text_column]) if t is not None and t.strip()]
    if len(keep) < len(ds):
        if count_is_private:
            logger.info("%s: empty rows skipped", source)
        else:
            logger.info("%s: %d empty row(s) skipped", source, len(ds) - len(keep))
        ds = ds.select(keep)
    if len(ds) == 0:
        raise DataLoadingError(f"{source}: every row's text is empty")
    return ds


def add_document_ids(train: datasets.Dataset) -> datasets.Dataset:
    """The default unit: each input row (document) is one unit, identified by its row index in the training file."""
    return train.add_column(DOCUMENT_COLUMN, list(range(len(train))))


def count_units(train: datasets.Dataset, column: str) -> int:
    """N: the number of distinct units (what the accountant counts), before anything is tokenized."""
    return len({v for v in train[column]})


# --------------------------------------------------------------------------------------------- blocks


def _separator_id(tokenizer) -> Optional[int]:
    for token_id in (tokenizer.eos_token_id, tokenizer.sep_token_id):
        if token_id is not None:
            return int(token_id)
    return None


def _tokenize(tokenizer, texts: list[str]) -> list[list[int]]:
    # verbose=False: a long document's "longer than the maximum length" warning does not apply (it is cut into blocks)
    return tokenizer(texts, add_special_tokens=True, return_attention_mask=False, return_token_type_ids=False,
                     verbose=False)["input_ids"]


def _cut(ids: list[int], block_size: int) -> list[list[int]]:
    return [ids[i:i + block_size] for i in range(0, len(ids), block_size)]


def _blocks_columns(blocks: list[list[int]]) -> dict[str, list]:
    return {"input_ids": blocks, "attention_mask": [[1] * len(b) for b in blocks]}


def evaluation_blocks(ds: datasets.Dataset, tokenizer, text_column: str, block_size: int,
                      overwrite_cache: bool = False) -> datasets.Dataset:
    """Each row's tokens cut into blocks of at most ``block_size`` (no units, nothing packed across rows)."""

    def fn(batch):
        blocks = [b for ids in _tokenize(tokenizer, batch[text_column]) for b in _cut(ids, block_size)]
        return _blocks_columns(blocks)

    return ds.map(fn, batched=True, remove_columns=ds.column_names, load_from_cache_file=not overwrite_cache,
                  desc="Cutting the evaluation rows into blocks")


def training_blocks(train: datasets.Dataset, tokenizer, text_column: str, unit_column: str, block_size: int,
                    pack_units: bool, overwrite_cache: bool = False) -> datasets.Dataset:
    """The training blocks, each with its unit in ``unit_column``.

    ``pack_units=False`` (the unit is the row, :data:`DOCUMENT_COLUMN`): each row's tokens cut into blocks of at most
    ``block_size``. ``pack_units=True`` (``--privacy_unit_column``): each unit's texts, in file order, concatenated
    with a separator and cut into blocks — packing within the unit only."""
    if not pack_units:
        def per_row(batch):
            out: dict[str, list] = {"input_ids": [], "attention_mask": [], unit_column: []}
            for ids, unit in zip(_tokenize(tokenizer, batch[text_column]), batch[unit_column]):
                blocks = _cut(ids, block_size)
                out["input_ids"] += blocks
                out["attention_mask"] += [[1] * len(b) for b in blocks]
                out[unit_column] += [unit] * len(blocks)
            return out

        with no_progress_bar():  # its total is the number of documents, private under --public_dataset_size
            return train.map(per_row, batched=True, remove_columns=train.column_names,
                             load_from_cache_file=not overwrite_cache, desc="Cutting the training documents into blocks")

    with no_progress_bar():  # its total is the number of rows, private under unit-level DP
        tokenized = train.map(
            lambda batch: {"input_ids": _tokenize(tokenizer, batch[text_column])}, batched=True,
            remove_columns=[c for c in train.column_names if c != unit_column], load_from_cache_file=not overwrite_cache,
        )
    sep = _separator_id(tokenizer)
    streams: dict[Any, list[int]] = {}  # unit -> its tokens, units in order of first appearance
    for unit, ids in zip(tokenized[unit_column], tokenized["input_ids"]):
        stream = streams.setdefault(unit, [])
        if stream and sep is not None and stream[-1] != sep:
            stream.append(sep)
        stream.extend(ids)
    units, blocks = [], []
    for unit, stream in streams.items():
        for block in _cut(stream, block_size):
            units.append(unit)
            blocks.append(block)
    out = datasets.Dataset.from_dict({**_blocks_columns(blocks), unit_column: units})
    if out.features[unit_column] != train.features[unit_column]:
        out = out.cast_column(unit_column, train.features[unit_column])
    return out

