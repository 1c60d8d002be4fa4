"""What the TRL recipes (``recipes/sft.py``, ``recipes/dpo.py``) share: TRL's script flags for data and model (plus
run_clm's), the parser with one error line when TRL is missing, the layered parse with ``--use_peft``, the data loading
with the unit-column checks, and the model config and tokenizer (an EOS token for BERT-style tokenizers)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from hf_dp.run.data import no_progress_bar
from recipes.common.args import RecipeError, parse_layered
from recipes.common.rows import check_unit_values
from recipes.glue_support.tasks import DataLoadingError

from .data import load_raw_datasets
from .model import ClmModelArguments, load_config_and_tokenizer


@dataclass
class TrlScriptArguments:
    """TRL's script data flags, plus local files (a recipe redefines ``train_file`` / ``validation_file`` for its help
    text; the field order stays)."""

    dataset_name: Optional[str] = field(default=None, metadata={"help": "A datasets name (offline: the local cache only)"})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "The dataset's configuration name"})
    dataset_train_split: str = field(default="train", metadata={"help": "The training split"})
    dataset_test_split: str = field(default="validation", metadata={"help": "The evaluation split (not private data)"})
    train_file: Optional[str] = field(default=None, metadata={"help": "json/jsonl/csv training rows"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Held-out rows"})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N training rows"})


@dataclass
class TrlModelArguments:
    """TRL's model flags that DP keeps and run_clm's (a recipe adds ``use_peft`` with its help text)."""

    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "A causal LM folder (or Hub id)"})
    model_type: Optional[str] = field(default=None, metadata={"help": "A new model of this type (llama, gpt2, ...)"})
    config_overrides: Optional[str] = field(default=None, metadata={"help": "With --model_type, e.g. hidden_size=64"})
    config_name: Optional[str] = field(default=None, metadata={"help": "Config name or path, if not the model's"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Tokenizer name or path; minilm = offline"})
    model_revision: str = field(default="main", metadata={"help": "Model version (branch, tag or commit)"})


def trl_parser(data_arguments, model_arguments, config_class: Callable[[], type]):
    """An ``HfArgumentParser`` over the data, model and TRL config dataclasses; ``config_class()`` imports the config
    (the ``sft`` extra, TRL, not installed: one error line)."""
    from transformers import HfArgumentParser

    try:
        config = config_class()
    except ImportError as exc:
        raise RecipeError(str(exc)) from None  # the sft extra (TRL) is not installed: one line
    return HfArgumentParser((data_arguments, model_arguments, config))


def parse_trl_args(argv: list[str], defaults: Optional[dict[str, Any]], *, parser, protocol_defaults, optimizer_defaults,
                   run_name, format_help, command_defaults=None):
    """:func:`recipes.common.args.parse_layered` without the frozen-prefix cache by default (LoRA; a unit column, which
    the cache does not keep); an argparse usage error is one line; ``--use_peft`` = ``--trainable lora``."""
    try:
        data_args, model_args, args = parse_layered(
            argv, defaults, parser=parser, protocol_defaults=protocol_defaults,
            optimizer_defaults=optimizer_defaults, run_name=run_name, format_help=format_help,
            cache_frozen_by_default=False, command_defaults=command_defaults)
    except SystemExit as exc:  # argparse's own usage errors were printed already
        if exc.code:
            raise RecipeError("the command line could not be parsed (see the usage line above)") from None
        raise
    if model_args.use_peft:
        if "trainable" in args._hf_dp_explicit and args.trainable != "lora":
            raise RecipeError(f"--use_peft trains LoRA adapters; it cannot be combined with --trainable {args.trainable}")
        args.trainable = "lora"
    return data_args, model_args, args


def load_trl_data(data_args, args, check_columns: Callable[[Any, str], str]):
    """``(train, dev, kind)``: the files or the dataset's splits, ``--max_train_samples``, ``check_columns(ds, what)``
    (the kind of the training rows), the unit column dropped from the validation rows and checked on the training
    rows. Under a unit column without 🤗 Datasets' bars (they print the number of rows, private under user-level DP)."""
    quiet = args.dp_enabled and (args.privacy_unit_column or args.public_dataset_size is not None)
    with no_progress_bar() if quiet else contextlib.nullcontext():
        if data_args.train_file or data_args.validation_file:
            raw = load_raw_datasets(data_args.train_file, data_args.validation_file)
            train, dev = raw.get("train"), raw.get("validation")
        else:
            raw = load_raw_datasets(dataset_name=data_args.dataset_name, dataset_config_name=data_args.dataset_config)
            train, dev = raw.get(data_args.dataset_train_split), raw.get(data_args.dataset_test_split)
        if train is None:
            raise DataLoadingError("no training data: pass --train_file (or --dataset_name with a train split)")
        if data_args.max_train_samples is not None:
            train = train.select(range(min(len(train), data_args.max_train_samples)))
        kind = check_columns(train, "training")
        col = args.privacy_unit_column
        if dev is not None:
            check_columns(dev, "validation")
            if col in dev.column_names:
                dev = dev.remove_columns(col)
        if col is not None and args.dp_enabled:
            if col not in train.column_names:
                raise DataLoadingError(f"--privacy_unit_column {col}: the training data has no column '{col}' (it has "
                                       f"{sorted(train.column_names)})")
            # every row names its unit; the first that does not is named by its line in the file (hf_dp's own check
            # comes later and counts the prepared rows from 0)
            check_unit_values(train[col], col, data_args.train_file, DataLoadingError)
    return train, dev, kind


def count_trl_units(train, args) -> int:
    """N for the planner and the checks: the distinct units under --privacy_unit_column, else the rows (before TRL's
    preparation, which may drop rows: the trainer counts the prepared set)."""
    col = args.privacy_unit_column if args.dp_enabled else None
    return len(set(train[col])) if col else len(train)


def load_trl_config_and_tokenizer(model_args, args):
    """``(clm_args, config, tokenizer, path)`` as run_clm loads them; a BERT-style tokenizer (minilm) without an EOS
    token gets its [SEP] as one (it ends each message or answer)."""
    clm_args = ClmModelArguments(model_name_or_path=model_args.model_name_or_path, model_type=model_args.model_type,
                                 config_overrides=model_args.config_overrides, config_name=model_args.config_name,
                                 tokenizer_name=model_args.tokenizer_name, model_revision=model_args.model_revision,
                                 trust_remote_code=args.trust_remote_code)
    config, tokenizer, path = load_config_and_tokenizer(clm_args)
    if tokenizer.eos_token is None:
        tokenizer.eos_token = tokenizer.sep_token
        config.eos_token_id = tokenizer.eos_token_id
    return clm_args, config, tokenizer, path


__all__ = ["TrlScriptArguments", "TrlModelArguments", "trl_parser", "parse_trl_args", "load_trl_data",
           "count_trl_units", "load_trl_config_and_tokenizer"]
