#!/usr/bin/env python
"""Differentially private fine-tuning on GLUE with hf_dp — a DP version of transformers' run_glue.py.

    python recipes/glue.py --task_name qnli --data_dir /path/to/glue --model_name_or_path minilm \\
        --optim dp_adamw --epsilon 3 --output_dir runs/qnli

Flags are those of ``examples/pytorch/text-classification/run_glue.py`` (``--task_name``, ``--train_file``,
``--max_seq_length`` ...) plus hf_dp's DP flags (``--epsilon``, ``--per_sample_max_grad_norm``, ``--optim dp_*`` ...),
``--data_dir DIR`` (a local folder in the original GLUE layout) and ``--config file.yaml`` (YAML values become
defaults; every command-line flag overrides them). Defaults reproduce the QNLI protocol of seed 000 (see
recipes/README.md for every value and its source).

This file is the GLUE task: its flags and protocol defaults, the classification head, the run. The task-independent
plumbing (layered defaults, ``--help``, model loading, checks, summary, push) is :mod:`recipes.common`; GLUE data and
metrics are :mod:`recipes.glue_support`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# `python recipes/glue.py` from a checkout: make `import recipes.common` (and `import hf_dp`, without installing) work.
_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from recipes.common.args import RecipeError, parse_layered  # noqa: E402
from recipes.common.help import effective_notes  # noqa: E402
from recipes.common.help import format_help as _format_help  # noqa: E402
from recipes.common.logs import time_left_callback  # noqa: E402
from recipes.common.model import MINILM_PACKAGE, ModelArguments, base_model_id, load_pretrained  # noqa: E402,F401
from recipes.common.model import resolve_model_path  # noqa: E402,F401  (tests and users: the preset's folder)
from recipes.common.early import check_model_loadable, check_resume_settings, resume_checkpoint  # noqa: E402
from recipes.common.run import apply_plan, check_privacy_settings, model_sources, push_folder, resume_argument  # noqa: E402
from recipes.common.run import refuse_eval_overlap  # noqa: E402
from recipes.common.summary import planner_expectation, summarize  # noqa: E402
from recipes.common.run import main as run_main  # noqa: E402
from recipes.common.run import release_is_the_product, save_release, write_predictions  # noqa: E402
from recipes.common.run import eval_rows_in_training  # noqa: E402
from recipes.common.rows import check_unit_values  # noqa: E402
from hf_dp.run.data import no_progress_bar  # noqa: E402
from recipes.common.tune import HOLDOUT, TuneArguments, carve_holdout, check_tune, check_tune_score, run_tune  # noqa: E402
from recipes.glue_support import (  # noqa: E402
    GLUE_TASKS,
    DataLoadingError,
    build_compute_metrics,
    constant_baseline,
    get_task,
    label_info,
    load_raw_datasets,
    main_metric_name,
    preprocess,
    regression_baseline,
    sentence_keys,
)

logger = logging.getLogger("hf_dp.recipes.glue")

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

# Learning rates for the planner's large logical batches, used when the planner chooses the batch and --learning_rate
# is not given: hf_dp.plan.PLANNED_LR (their sources there; `python -m hf_dp.plan` prints them with its flags), read
# when needed — importing hf_dp at import time would import Opacus, whose import configures the root logger before
# the recipe's own logging.basicConfig. OPTIMIZER_DEFAULTS stay the protocol's values for a batch size you give yourself.
def _planned_lr() -> dict[str, float]:
    from hf_dp.plan import PLANNED_LR

    return PLANNED_LR


def __getattr__(name: str):  # `glue.PLANNED_LR` (tests, users) without importing hf_dp when this module is imported
    if name == "PLANNED_LR":
        return _planned_lr()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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


@dataclass
class DataTrainingArguments(TuneArguments):  # --tune, --tune_trials, ...: recipes/common/tune.py
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


def make_parser():
    from transformers import HfArgumentParser

    from hf_dp import DPTrainingArguments
    return HfArgumentParser((ModelArguments, DataTrainingArguments, DPTrainingArguments))


def parse_args(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None):
    """Parse ``argv``: recipe defaults < ``defaults`` (e.g. qnli.py) < YAML ``--config`` < command line."""
    return parse_layered(
        argv, defaults, parser=make_parser(), protocol_defaults=PROTOCOL_DEFAULTS,
        optimizer_defaults=OPTIMIZER_DEFAULTS, run_name=lambda peek: peek.task_name or "custom", format_help=format_help,
        planned_lr=_planned_lr(),
    )


def format_help(parser, peek) -> str:
    """``--help``: hf_dp's DP flags, then data, model and the essential training flags with the recipe's effective
    defaults, then the other TrainingArguments flags, each marked with what it does under DP (hf_dp/flags.py)."""
    script = os.path.basename(sys.argv[0]) if os.path.basename(sys.argv[0]) in ("glue.py", "qnli.py") else "glue.py"
    cmd = f"python recipes/{script}"
    return _format_help(
        parser, peek, data_arguments=DataTrainingArguments, model_arguments=ModelArguments,
        data_title="data (as run_glue, plus --data_dir)", model_title="model (as run_glue)",
        notes=effective_notes(OPTIMIZER_DEFAULTS, _planned_lr(), "runs/<task>-<optim>-eps<ε>"),
        extra_groups=[("private hyperparameter selection (--tune; recipes/common/tune.py: --epsilon is the total of "
                       "the whole selection)", [f.name for f in dataclasses.fields(TuneArguments)], None)],
        usage=f"{cmd} [--config FILE.yaml] [flags]   |   {cmd} args.json|args.yaml   |   {cmd} --help-all",
        description=("DP fine-tuning on QNLI: recipes/glue.py with --task_name qnli preset. " if script == "qnli.py"
                     else "") + "Differentially private GLUE fine-tuning (run_glue's flags plus hf_dp's). Defaults are "
                    "the recipe's effective values for this command line; see recipes/README.md.",
    )


def _apply_plan(training_args, model, n_train: int) -> Optional[str]:
    """The planner's logical batch (and :data:`PLANNED_LR`) for the run's epochs or steps when the user set no batch
    size or accumulation (:func:`recipes.common.run.apply_plan`). Returns the lines to print."""
    return apply_plan(training_args, model, n_train, _planned_lr())


# ----------------------------------------------------------------------------------------------- model


def load_model_and_tokenizer(model_args: ModelArguments, data_args: DataTrainingArguments, info):
    """The sequence-classification model (``info.num_labels`` outputs, GLUE's label names), tokenizer and path."""
    from transformers import AutoModelForSequenceClassification

    model, tokenizer, model_path = load_pretrained(
        model_args, AutoModelForSequenceClassification, num_labels=info.num_labels,
        finetuning_task=data_args.task_name,
    )
    if info.label_list is not None:
        model.config.label2id = {name: i for i, name in enumerate(info.label_list)}
        model.config.id2label = {i: name for i, name in enumerate(info.label_list)}
    return model, tokenizer, model_path


# ----------------------------------------------------------------------------------------------- run


def _data_description(data_args: DataTrainingArguments, n_train: Optional[int]) -> str:
    """``n_train``: the number of training rows, or None under --privacy_unit_column (rows are private there; the card
    gives N, the number of units)."""
    task = get_task(data_args.task_name)
    rows = f", {n_train:,} training examples" if n_train is not None else ""
    if data_args.data_dir:
        return f"GLUE {task.folder} from local files in the GLUE layout (not the Hub dataset){rows}"
    if data_args.train_file:
        return f"local file {os.path.basename(data_args.train_file)}{rows}"
    name = data_args.dataset_name or "nyu-mll/glue"
    return f"`{name}` ({data_args.dataset_config_name or (task.name if task else '')}){rows}"


def _units(raw, unit: Optional[str], n_rows: int, path: Optional[str] = None) -> int:
    """N for the planner and the checks: the rows, or under ``--privacy_unit_column`` the distinct units of the first
    ``n_rows`` training rows (what the accountant counts; the number of rows is private there). Every row must name
    its unit: the first that does not is named by its line in ``path`` (the training file), before any model is
    loaded."""
    if unit is None or "train" not in raw:
        return n_rows
    train = raw["train"]
    if unit not in train.column_names:
        raise RecipeError(f"--privacy_unit_column {unit}: the training data has no column '{unit}' "
                          f"(it has {', '.join(train.column_names)})")
    values = train[unit] if n_rows >= len(train) else train.select(range(n_rows))[unit]
    check_unit_values(values, unit, path, RecipeError)
    return len(set(values))


def _eval_overlap(raw, data_args: DataTrainingArguments) -> bool:
    """Whether a validation row's text (its sentence columns) is also a training row's (the first
    ``--max_train_samples`` rows trained on, the first ``--max_eval_samples`` evaluated)."""
    if "train" not in raw or "validation" not in raw:
        return False
    train, dev = raw["train"], raw["validation"]
    if data_args.max_train_samples is not None:
        train = train.select(range(min(len(train), data_args.max_train_samples)))
    if data_args.max_eval_samples is not None:
        dev = dev.select(range(min(len(dev), data_args.max_eval_samples)))
    return eval_rows_in_training(train, dev, [k for k in sentence_keys(raw, data_args.task_name) if k])


def _train_path(data_args: DataTrainingArguments) -> Optional[str]:
    """The training file the rows were read from (for error messages naming a row by its line), or None."""
    if data_args.data_dir and data_args.task_name:
        task = get_task(data_args.task_name)
        return os.path.join(data_args.data_dir, task.folder, "train.tsv") if task is not None else None
    return data_args.train_file


def run(model_args, data_args, training_args) -> dict[str, Any]:
    """Load data and model, train with DP, evaluate, save; return the summary dict."""
    import transformers
    from transformers import DataCollatorWithPadding, default_data_collator

    from hf_dp import DPTrainer
    from hf_dp.hub import write_privacy_artifacts
    from hf_dp.hub.describe import card_fields
    from hf_dp.privacy.selection import HOLDER, plan_context

    start = time.perf_counter()
    transformers.set_seed(training_args.seed)
    local_data = bool(data_args.data_dir or data_args.train_file or data_args.validation_file)
    if local_data:  # before reading local files (offline, an uncached Hub id fails here); Hub data: its own error first
        check_model_loadable(model_args)
    resume = resume_argument(training_args, model_sources(model_args))
    resume_checkpoint(resume, training_args.output_dir)  # --resume_from_checkpoint True with nothing to resume
    # --privacy_unit_column: N is the number of units, and the rows are private (no 🤗 Datasets bar counts them); with
    # --public_dataset_size the actual count is private too
    unit = training_args.privacy_unit_column if training_args.dp_enabled else None
    declared = training_args.dp_enabled and training_args.public_dataset_size is not None
    quiet = no_progress_bar if unit or declared else contextlib.nullcontext
    with quiet():
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
    if not local_data:
        check_model_loadable(model_args)
    n_train = len(raw["train"]) if "train" in raw else 0
    if data_args.max_train_samples is not None:
        n_train = min(n_train, data_args.max_train_samples)
    n_train = _units(raw, unit, n_train, _train_path(data_args))
    check_privacy_settings(training_args, n_train)  # before the model, tokenization and any caching
    # an evaluation on training rows: refused under DP, named in the card without it
    overlap = refuse_eval_overlap(
        training_args, training_args.do_train and training_args.do_eval and _eval_overlap(raw, data_args))
    # --tune: GLUE's own dev set (local GLUE layout or the Hub's nyu-mll/glue) is public data, declared so for scoring
    glue_dev = bool(data_args.task_name) and not data_args.validation_file and not data_args.dataset_name
    tune_space = check_tune(data_args, training_args, resume, public_dev=glue_dev)
    info = label_info(raw, data_args.task_name)
    check_tune_score(data_args, is_regression=info.is_regression)
    carved = carve_holdout(raw, data_args, training_args, data_args.max_train_samples)  # --tune_score private
    if carved is not None:
        n_train = _units(raw, unit, carved)  # (the rows left after the hold-out: no longer the file's lines)
        check_privacy_settings(training_args, n_train)
    model, tokenizer, model_path = load_model_and_tokenizer(model_args, data_args, info)
    planned = _apply_plan(training_args, model, n_train)
    if planned:
        print(planned, flush=True)
        check_privacy_settings(training_args, n_train)
    check_resume_settings(training_args, resume, n_train)  # the checkpoint's σ, C, q, B, N, δ: before tokenizing
    with quiet():
        tokenized = preprocess(
            raw, tokenizer, task_name=data_args.task_name, max_seq_length=data_args.max_seq_length,
            pad_to_max_length=data_args.pad_to_max_length, max_train_samples=data_args.max_train_samples,
            max_eval_samples=data_args.max_eval_samples, max_predict_samples=data_args.max_predict_samples,
            overwrite_cache=data_args.overwrite_cache, keep_train_columns=(unit,) if unit else (),
        )
    holdout = tokenized.pop(HOLDOUT, None)  # --tune_score private: the held-out training rows, scored privately
    collator = default_data_collator if data_args.pad_to_max_length else DataCollatorWithPadding(tokenizer)
    if training_args.dp_max_length is None:  # the rows are truncated to it: the public bound of the rounding allowance
        training_args.dp_max_length = data_args.max_seq_length
    compute_metrics = build_compute_metrics(data_args.task_name, is_regression=info.is_regression)

    # --push_to_hub: train and save locally first, push the saved folder at the end (a failed push loses nothing)
    push = bool(training_args.push_to_hub)
    training_args.push_to_hub = False
    # --tune: this trainer only holds the selection; the single run its σ is planned for is never made (no plan line:
    # each trial prints its own, at the trials' σ)
    with plan_context(HOLDER if training_args.do_train and tune_space is not None else None):
        trainer = DPTrainer(
            model=model, args=training_args,
            train_dataset=tokenized["train"] if training_args.do_train else None,
            eval_dataset=tokenized["validation"] if training_args.do_eval else None,
            processing_class=tokenizer, data_collator=collator, compute_metrics=compute_metrics,
        )
    release_is_the_product(trainer)  # the card and privacy.json in <output_dir>/release only
    trainer.add_callback(time_left_callback())  # one overall estimate: the planned steps, the time left
    # the card fields, for checkpoint cards and the final card alike (no local paths; a Hub dataset only if one was used)
    trainer.base_model_id = base_model_id(model_args.model_name_or_path)
    trainer.task_name = data_args.task_name
    from_hub = not (data_args.data_dir or data_args.train_file)
    trainer.dataset_name = (data_args.dataset_name or ("nyu-mll/glue" if data_args.task_name else None)) if from_hub else None
    if training_args.do_train:
        trainer.data_description = _data_description(
            data_args, None if training_args.privacy_unit_column or declared else len(tokenized["train"]))
    # the card does not call an evaluation held-out when its rows repeat training rows (the same file, say)
    trainer.eval_overlap = overlap
    report: dict[str, Any] = {}
    if training_args.do_train and tune_space is not None:  # the best of K private runs (recipes/common/tune.py)
        best = run_tune(trainer, data_args, tune_space, metric=main_metric_name(data_args.task_name, info.is_regression),
                        model_init=lambda: load_model_and_tokenizer(model_args, data_args, info)[0], holdout=holdout)
        print(f"private selection: kept {best.hyperparameters}", flush=True)
        report = trainer.privacy_report()
    elif training_args.do_train:
        trainer.train(resume_from_checkpoint=resume)
        # (no log_metrics: HF's log line already printed these metrics once; the summary block follows)
        report = trainer.privacy_report()
    eval_metrics: dict[str, Any] = {}
    predictions = None
    if training_args.do_eval:
        eval_metrics = trainer.evaluate()
        predictions = compute_metrics.last_predictions  # the summary's predicted-class spread (before MNLI's _mm)
        if "validation_mismatched" in tokenized:  # MNLI: both evaluation sets, named as run_glue does (…_mm)
            mm = trainer.evaluate(eval_dataset=tokenized["validation_mismatched"])
            eval_metrics.update({f"{k}_mm": v for k, v in mm.items() if k.startswith("eval_")})
    if training_args.do_predict:
        _predict(trainer, tokenized["test"], info, data_args, training_args)

    baseline = None
    if eval_metrics and "labels" in tokenized["validation"].column_names:
        # the best constant predictor on the evaluation labels (never the private training labels' counts or mean)
        labels = tokenized["validation"]["labels"]
        baseline = (regression_baseline(labels, eval_metrics, predictions=predictions) if info.is_regression else
                    constant_baseline(labels, eval_metrics, label_names=info.label_list, predictions=predictions))

    out = None
    if training_args.do_train:
        out = save_release(trainer, training_args)  # <output_dir>/release: the release only, checkpoints beside it
        # (re)write the card with everything the recipe knows: base model, task, data and eval results
        write_privacy_artifacts(
            out, report, base_model=trainer.base_model_id, task_name=data_args.task_name,
            dataset_name=trainer.dataset_name, eval_results=eval_metrics or None,
            data_description=trainer.data_description, baseline=baseline, eval_overlap=trainer.eval_overlap,
            model_description=None if trainer.base_model_id else card_fields(
                trainer.model, trainer.args, trainer.train_dataset)["model_description"],
            log_history=trainer.state.log_history,  # the training-curves PNG (hf_dp.hub.plots): ε and eval metrics
        )
    pushed = None
    if push and out is not None and trainer.is_world_process_zero():
        pushed = push_folder(out, training_args)
    return summarize(data_args.task_name or "custom", training_args, report,
                     main_metric_name(data_args.task_name, info.is_regression), eval_metrics, baseline, start, out, pushed,
                     expectation=planner_expectation(trainer))


def _predict(trainer, test_ds, info, data_args, training_args) -> None:
    """``predict_results_<task>.txt`` as run_glue writes it: the label name, or the score for a regression task."""
    import numpy as np

    def decode(preds):
        if info.is_regression:
            return [f"{p:3.3f}" for p in np.squeeze(preds)]
        return [info.label_list[p] for p in np.argmax(preds, axis=1)]

    write_predictions(trainer, test_ds, training_args.output_dir, data_args.task_name or "custom", decode)


def main(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None) -> int:
    """Entry point; returns the process exit code (0 ok, 2 for usage/data/model errors, shown without traceback)."""
    return run_main(parse_args, run, argv, defaults, user_errors=(DataLoadingError,))


if __name__ == "__main__":
    sys.exit(main())
