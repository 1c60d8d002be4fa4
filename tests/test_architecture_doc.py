"""docs/architecture.md stays true: every path and every ``module.symbol`` it names in backticks exists."""

from __future__ import annotations

import importlib
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(ROOT, "docs", "architecture.md")
PATH_RE = re.compile(r"^(hf_dp|tests|docs|benchmarks|recipes|model_cards)/[\w./-]*$")
NAME_RE = re.compile(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)+$")
CHECKED_ROOTS = ("hf_dp", "DPTrainer", "opacus")


def _spans() -> list[str]:
    with open(DOC, encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"```.*?```", "", text, flags=re.S)  # the layer diagram is not a list of names
    return re.findall(r"`([^`\n]+)`", text)


def _paths() -> list[str]:
    return sorted({s for s in _spans() if PATH_RE.match(s)})


def _names() -> list[str]:
    return sorted({s for s in _spans() if NAME_RE.match(s) and s.split(".")[0] in CHECKED_ROOTS})


def _resolve(name: str):
    parts = name.split(".")
    if parts[0] == "DPTrainer":
        obj = importlib.import_module("hf_dp.trainer").DPTrainer
        for attr in parts[1:]:
            obj = getattr(obj, attr)
        return obj
    for cut in range(len(parts), 0, -1):  # the longest importable module prefix, then attributes
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(name)


def test_the_doc_names_enough_to_be_checked():
    assert len(_paths()) >= 20 and len(_names()) >= 30


@pytest.mark.parametrize("path", _paths())
def test_every_path_exists(path):
    assert os.path.exists(os.path.join(ROOT, path)), f"docs/architecture.md names {path}, which does not exist"


@pytest.mark.parametrize("name", _names())
def test_every_module_symbol_exists(name):
    try:
        _resolve(name)
    except (ImportError, AttributeError) as e:
        pytest.fail(f"docs/architecture.md names `{name}`, which does not resolve: {e}")
