"""Where a training row is, in the words of the user's file: errors name "line 6 of chats.jsonl", not "row 5" (a
0-based index into the loaded rows, which is line 6 of a JSON-lines file and line 7 of a CSV file with a header).

:func:`row_position` turns a 0-based row index of data loaded from a file into its line there (JSON lines: the
non-blank lines; CSV/TSV: the row's first line after the header line, read with the csv module so that a quoted CSV field
that spans lines is counted; plain text: one row per line), or "row N (counting from 1)" where there is no line to name (a
parquet file, a JSON array, a Hub dataset). :func:`check_unit_values` is the recipes' check, before any model is
loaded, that every training row names its privacy unit.
"""

from __future__ import annotations

import csv
import math
import os
from typing import Any, Optional


def _jsonl_line(path: str, index: int) -> Optional[int]:
    with open(path, encoding="utf-8", errors="replace") as f:
        first = f.read(1024).lstrip()
        if first.startswith("["):  # a JSON array: rows are not lines
            return None
        f.seek(0)
        seen = -1
        for number, line in enumerate(f, start=1):
            if line.strip():
                seen += 1
                if seen == index:
                    return number
    return None


def _csv_line(path: str, index: int) -> Optional[int]:
    tsv = path.lower().endswith(".tsv")  # as the recipes read it: tab-separated, no quoting (the GLUE files' way)
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        reader = csv.reader(f, delimiter="\t", quoting=csv.QUOTE_NONE) if tsv else csv.reader(f)
        end = 0  # the line the previous record ended on
        for record_index, _ in enumerate(reader, start=-1):  # record -1: the header
            start, end = end + 1, reader.line_num
            if record_index == index:
                return start
    return None


def row_position(index: int, path: Optional[str]) -> str:
    """Where 0-based row ``index`` of the data loaded from ``path`` is, for an error message: "line 6 of chats.jsonl"
    for a JSON-lines, CSV/TSV or text file; otherwise (no file, a parquet file, a JSON array, a line that cannot be
    found) "row 6 (counting from 1)"."""
    if path and os.path.isfile(path):
        lower = path.lower()
        try:
            if lower.endswith((".jsonl", ".json")):
                line = _jsonl_line(path, index)
            elif lower.endswith((".csv", ".tsv")):
                line = _csv_line(path, index)
            elif lower.endswith((".txt", ".text")):
                line = index + 1
            else:
                line = None
        except OSError:
            line = None
        if line is not None:
            return f"line {line:,} of {os.path.basename(path)}"
        return f"row {index + 1:,} of {os.path.basename(path)} (counting from 1)"
    return f"row {index + 1:,} (counting from 1)"


def missing_unit(value: Any) -> bool:
    """No unit: None, NaN, or an empty string."""
    return value is None or (isinstance(value, float) and math.isnan(value)) or (
        isinstance(value, str) and not value.strip())


def check_unit_values(values, column: str, path: Optional[str], error: type = ValueError) -> None:
    """Every training row names its unit (``--privacy_unit_column column``): a single value — a string or a number —,
    not empty. Raises ``error`` naming the first row that does not, by :func:`row_position` (checked before any model
    is loaded; hf_dp's own check would name a 0-based row of the tokenized data, later)."""
    for i, value in enumerate(values):
        if missing_unit(value):
            raise error(f"--privacy_unit_column {column}: {row_position(i, path)} has no unit ({value!r}); every "
                        "training row must name its unit")
        if isinstance(value, (list, dict, tuple)):
            raise error(f"--privacy_unit_column {column}: {row_position(i, path)} has the unit {value!r}, not a single "
                        "value (a string or a number)")
