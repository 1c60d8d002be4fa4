#!/usr/bin/env python
"""Differentially private causal language modelling with hf_dp — a DP version of transformers' run_clm.py.

    python recipes/clm.py --model_type gpt2 --config_overrides n_layer=2,n_embd=64,n_head=2 --tokenizer_name minilm \\
        --train_file train.jsonl --validation_file dev.jsonl --privacy_unit_column user_id --epsilon 3 \\
        --output_dir runs/clm

Flags are those of ``examples/pytorch/language-modeling/run_clm.py`` (``--model_name_or_path``, ``--model_type``,
``--config_overrides``, ``--tokenizer_name``, ``--train_file``, ``--validation_file``, ``--dataset_name``,
``--block_size``, ``--max_train_samples`` ...) plus ``--text_column``, the sampling flags and hf_dp's DP flags
(``--epsilon``, ``--per_sample_max_grad_norm``, ``--optim dp_*``, ``--trainable``, ``--privacy_unit_column`` ...).

What differs from run_clm, and why (recipes/README.md, "Causal language modelling"):

* **The unit of privacy.** Without ``--privacy_unit_column`` each input row (a document) is one unit: the recipe adds
  the column ``document`` (the row's index) and a row longer than ``--block_size`` becomes several blocks that share
  it, so that the whole document is clipped together. With ``--privacy_unit_column user_id`` a unit is every row of
  one user: the user's texts are concatenated and cut into blocks. No block ever holds two units' tokens (run_clm
  packs the whole corpus into full blocks); the last block of a unit is padded by the collator
  (``DataCollatorForLanguageModeling(mlm=False)``, right padding), and padding is never scored.
* **Defaults**: LoRA (``--trainable lora``), ``--block_size`` min(128, the model's and the tokenizer's maximum).
* **After training**: eval_loss and perplexity = exp(eval_loss) on the validation file (not private data), and a few
  sampled continuations of a fixed public prompt with a fixed generation seed (post-processing of the released model:
  no privacy cost), in the summary. The release folder, ``<output_dir>/release``, holds the model (LoRA merged), the
  tokenizer, ``privacy.json`` and the model card, nothing else (checkpoints and run records stay in output_dir).

The task-independent plumbing (layered defaults, ``--help``, checks, resume, summary, push) is :mod:`recipes.common`;
data, model, metrics and sampling of this task are :mod:`recipes.clm_support`.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

# `python recipes/clm.py` from a checkout: make `import recipes.common` (and `import hf_dp`, without installing) work.
_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from recipes.clm_support import (  # noqa: E402
    DOCUMENT_COLUMN,
    ClmModelArguments,
    add_document_ids,
    build_model,
    check_text_column,
    check_unit_column,
    choose_block_size,
    count_units,
    drop_empty_texts,
    evaluation_blocks,
    load_config_and_tokenizer,
    load_raw_datasets,
    no_progress_bar,
    sample_continuations,
    training_blocks,
    verdict_scope,
    with_perplexity,
)
from recipes.common.args import RecipeError, parse_layered  # noqa: E402
from recipes.common.help import effective_notes  # noqa: E402
from recipes.common.help import format_help as _format_help  # noqa: E402
from recipes.common.logs import time_left_callback, unit_loss_line  # noqa: E402
from recipes.common.model import base_model_id  # noqa: E402
from recipes.common.run import (check_privacy_settings, model_sources, public_size, push_folder,  # noqa: E402
                                release_is_the_product, resume_argument)
from recipes.common.run import refuse_eval_overlap, save_release  # noqa: E402
from recipes.common.summary import planner_expectation, summarize  # noqa: E402
from recipes.common.run import main as run_main  # noqa: E402
from recipes.glue_support.tasks import DataLoadingError  # noqa: E402

logger = logging.getLogger("hf_dp.recipes.clm")

#: what the card names as the task
TASK = "causal language modeling"

# Recipe defaults (recipes/README.md, "Causal language modelling"; chosen on a public tune split, benchmarks/RESULTS.md
# §10b): LoRA adapters, dp_adamw at lr 5e-4 constant (with --privacy_unit_column 2e-3 decaying linearly:
# UNIT_OPTIMIZER_DEFAULTS, §10e), a logical batch of about N/16 units (:func:`lm_batch_plan`: 16 per device × the
# accumulation that makes it), 2 epochs (≈ 32 steps), ε = 3, δ = 1e-5 (must be < 1/N), C = 0.1, and each block's loss
# its token sum over the block size (--lm_loss_weighting token: every token weighs the same, as in the non-private
# loss; §10f).
PROTOCOL_DEFAULTS: dict[str, Any] = {
    "per_device_train_batch_size": 16,
    "per_device_eval_batch_size": 16,
    "gradient_accumulation_steps": 1,
    "num_train_epochs": 2.0,
    "optim": "dp_adamw",
    "epsilon": 3.0,
    "delta": 1e-5,
    "per_sample_max_grad_norm": 0.1,
    "lm_loss_weighting": "token",
    "accountant": "prv",
    "trainable": "lora",
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

# Per-optimizer learning rate / weight decay when neither the command line nor the YAML sets them: dp_adamw / dp_adam
# 5e-4, chosen on the public tune split at the default batch (benchmarks/RESULTS.md §10b: 1e-3 and more made the model
# worse on whole sentences); the others are the GLUE recipe's values (recipes/README.md), not tuned for language
# modelling (dp_adamw_bc at 1e-3 and 5e-3 ended worse there); weight decay 0 (LoRA adapters start at zero).
OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {
    "dp_adamw": {"learning_rate": 5e-4, "weight_decay": 0.0},
    "dp_adamw_bc": {"learning_rate": 1e-3, "weight_decay": 0.0},
    "dp_adam": {"learning_rate": 5e-4, "weight_decay": 0.0},
    "dp_adambc": {"learning_rate": 1e-3, "weight_decay": 0.0},
    "dp_sgd": {"learning_rate": 40.0, "weight_decay": 0.0},
    "dp_sgd_l2": {"learning_rate": 40.0, "weight_decay": 0.0},
    "dp_macadam": {"learning_rate": 1e-3, "weight_decay": 0.0},
}

# With --privacy_unit_column (a unit is every row of one user: at the default q ≈ 1/16, with users of about 4 rows as
# in the tune corpora, about 4 × fewer units per step than rows, so each step's noise is larger against the signal)
# dp_adamw / dp_adam take a larger peak learning rate that decays linearly to 0. Chosen at user level on two public
# tune corpora, one close to the pretraining and one with much to learn (benchmarks/RESULTS.md §10e): the largest peak
# rate that kept half of the first corpus's gain on each of 3 tune seeds (2.5e-3 kept 40 % on one). On dev it keeps
# 86–93 % of SST-2's gain (5e-4 constant: 44–66 %) and 49–51 % of the second corpus's (5e-4 constant: 28 %); a
# constant 1.37e-3 made SST-2 worse than no fine-tuning on 2 seeds of 3.
UNIT_OPTIMIZER_DEFAULTS: dict[str, dict[str, Any]] = {
    "dp_adamw": {"learning_rate": 2e-3, "lr_scheduler_type": "linear"},
    "dp_adam": {"learning_rate": 2e-3, "lr_scheduler_type": "linear"},
}

#: the planner's batch comes with the optimizer's default learning rate (tuned at that batch, above)
PLANNED_LR: dict[str, float] = {}
#: the default logical batch is about 1/LM_STEPS_PER_EPOCH of the units: q ≈ 1/16, about 16 steps per epoch
LM_STEPS_PER_EPOCH = 16


def lm_batch_plan(training_args, n_units: int, steps_per_epoch: int = LM_STEPS_PER_EPOCH,
                  source: str = "the recipe's setting chosen on a public tune split (benchmarks/RESULTS.md §10b)") -> Optional[str]:
    """When the user set neither ``--per_device_train_batch_size`` nor ``--gradient_accumulation_steps`` (a DP run with
    ``--epsilon``): the logical batch B ≈ N/``steps_per_epoch`` units — per_device × world × the accumulation
    k = round(N/steps_per_epoch / (per_device × world)), at least 1 — so q ≈ 1/steps_per_epoch. clm.py's 16 (the default
    2 epochs are ≈ 32 steps) was chosen on a public tune split (benchmarks/RESULTS.md §10b: at ε = 3 on 4,000 SST-2
    phrases, B = 256 with lr 5e-4 beat no fine-tuning where B = 64, the §10 setting, and larger learning rates made the
    model worse); dpo.py passes its own (RESULTS §14). The same q for a unit column (B users). ``source``: where the
    setting comes from, in the printed line. Returns the line to print, None when the user's batch stands."""
    from recipes.common.args import PLANNER_KEYS

    explicit = getattr(training_args, "_hf_dp_explicit", frozenset())
    if (not training_args.dp_enabled or training_args.epsilon is None or PLANNER_KEYS & explicit
            or not training_args.do_train or n_units <= 0):
        return None
    declared = training_args.public_dataset_size is not None
    n_units = public_size(training_args, n_units)  # --public_dataset_size: the declared N, never the actual count
    m = int(getattr(training_args, "audit_canaries", None) or 0)  # DPTrainer samples N + m units
    n = n_units + m
    micro = training_args.per_device_train_batch_size * max(1, training_args.world_size)
    k = max(1, round(n / steps_per_epoch / micro))
    training_args.gradient_accumulation_steps = k
    b = micro * k
    if m:  # the canaries ride on top: q ≈ 1/16 of all N + m units, so the real units keep q ≈ 1/16
        training_args._hf_dp_canaries_on_top = True
    units = (f"N = {n_units:,}" + (" (declared public size)" if declared else "")
             + (f" + {m:,} canary units" if m else ""))
    return (f"planner (causal LM, no batch size given): logical batch B = {b:,} units ({training_args.per_device_train_batch_size}"
            f" per device × {max(1, training_args.world_size)} process(es) × {k} accumulation steps ≈ N/{steps_per_epoch}"
            f"{' (at least one micro-batch)' if micro * k > n / steps_per_epoch * 1.5 else ''}, {units}, q = {b / n:.4g}), "
            f"{source}; --per_device_train_batch_size / --gradient_accumulation_steps override")


@dataclass
class DataTrainingArguments:
    dataset_name: Optional[str] = field(
        default=None, metadata={"help": "A datasets name (offline: only what is in the local datasets cache)"})
    dataset_config_name: Optional[str] = field(default=None, metadata={"help": "Its configuration"})
    train_file: Optional[str] = field(
        default=None, metadata={"help": "Training data: .txt (one example per line, column 'text'), .json/.jsonl, "
                                        ".csv/.tsv or .parquet"})
    validation_file: Optional[str] = field(
        default=None, metadata={"help": "Evaluation data (same formats) for eval_loss and perplexity; public or held "
                                        "out, never the training rows"})
    text_column: str = field(default="text", metadata={"help": "The column holding the text"})
    block_size: Optional[int] = field(
        default=None, metadata={"help": "Tokens per block: longer units are cut into blocks (default: min(128, the "
                                        "model's and the tokenizer's maximum length))"})
    max_train_samples: Optional[int] = field(
        default=None, metadata={"help": "Keep the first N training rows (input rows, before blocks; run_clm counts "
                                        "blocks)"})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N evaluation rows"})
    overwrite_cache: bool = field(default=False, metadata={"help": "Re-run tokenization"})
    keep_linebreaks: bool = field(default=True, metadata={"help": "Keep line breaks of .txt rows (as run_clm)"})
    sample_prompt: str = field(
        default="the movie", metadata={"help": "A fixed public prompt (never training text) whose sampled "
                                               "continuations the summary shows"})
    num_samples: int = field(default=3, metadata={"help": "How many continuations to sample (0: none)"})
    sample_max_new_tokens: int = field(default=20, metadata={"help": "Tokens per sampled continuation"})
    generation_seed: int = field(default=0, metadata={"help": "Seed of the sampling (the samples are reproducible)"})


# ----------------------------------------------------------------------------------------------- arguments


def make_parser():
    from transformers import HfArgumentParser

    from hf_dp import DPTrainingArguments
    return HfArgumentParser((ClmModelArguments, DataTrainingArguments, DPTrainingArguments))


def _run_name(peek) -> str:
    if peek.model_type:
        return f"clm-{peek.model_type}"
    name = peek.model_name_or_path or peek.config_name or "model"
    return f"clm-{os.path.basename(os.path.normpath(name))}"


def parse_args(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None):
    """Parse ``argv``: recipe defaults < ``defaults`` < YAML ``--config`` < command line. The frozen-prefix cache is
    never on by default: every run trains with a privacy unit column, which the cache does not keep."""
    return parse_layered(
        argv, defaults, parser=make_parser(), protocol_defaults=PROTOCOL_DEFAULTS,
        optimizer_defaults=OPTIMIZER_DEFAULTS, run_name=_run_name, format_help=format_help,
        cache_frozen_by_default=False, unit_optimizer_defaults=UNIT_OPTIMIZER_DEFAULTS,
    )


def format_help(parser, peek) -> str:
    notes = effective_notes(OPTIMIZER_DEFAULTS, PLANNED_LR, "runs/clm-<model>-<optim>-eps<ε>")
    notes["learning_rate"] = ("(recipe default depends on --optim — " + ", ".join(
        f"{k} {v['learning_rate']:g}" for k, v in OPTIMIZER_DEFAULTS.items()) + "; with --privacy_unit_column " + ", ".join(
        f"{k} {v['learning_rate']:g}" for k, v in UNIT_OPTIMIZER_DEFAULTS.items()) + "; shown for this command line)")
    notes["lr_scheduler_type"] = ("(recipe default: constant, no warm-up; with --privacy_unit_column and "
                                  f"{' or '.join(UNIT_OPTIMIZER_DEFAULTS)}: linear, a decay to 0 — the schedules the "
                                  "recipe's learning rates were chosen with; shown for this command line)")
    notes["cache_frozen_features"] = "(recipe default: off — every run trains with a privacy unit column)"
    notes["privacy_unit_column"] = (f"(recipe default: each input row is one unit, column '{DOCUMENT_COLUMN}' = its "
                                    "index; a row longer than --block_size becomes several blocks of that unit)")
    return _format_help(
        parser, peek, data_arguments=DataTrainingArguments, model_arguments=ClmModelArguments,
        data_title="data (as run_clm, plus --text_column and the sampled continuations)",
        model_title="model (as run_clm)", notes=notes,
        usage="python recipes/clm.py [--config FILE.yaml] [flags]   |   python recipes/clm.py args.json|args.yaml",
        description="Differentially private causal language modelling (run_clm's flags plus hf_dp's). Defaults are "
                    "the recipe's effective values for this command line; see recipes/README.md.",
    )


# ----------------------------------------------------------------------------------------------- data


def _sources(data_args: DataTrainingArguments) -> dict[str, str]:
    if data_args.train_file or data_args.validation_file:
        return {k: v for k, v in (("train", data_args.train_file), ("validation", data_args.validation_file)) if v}
    return {split: f"{data_args.dataset_name}[{split}]" for split in ("train", "validation")}


def _data_description(data_args: DataTrainingArguments, unit_column: str, user_unit: bool, n_units: int,
                      block_size: int, declared: bool = False) -> str:
    """The card's description of the training data: public facts only (N, the unit, the block length — never a count of
    blocks or tokens, which depends on the private texts' lengths). ``declared``: N is ``--public_dataset_size``."""
    if data_args.train_file:
        source = f"local file {os.path.basename(data_args.train_file)} (column `{data_args.text_column}`)"
    else:
        source = f"`{data_args.dataset_name}`" + (f" ({data_args.dataset_config_name})" if data_args.dataset_config_name else "")
    n = f"{n_units:,}" + (" (a declared public size)" if declared else "")
    unit = (f"{n} privacy units (`{unit_column}`; each unit's texts concatenated and cut into blocks)" if user_unit
            else f"{n} documents, each one privacy unit (a row longer than a block is cut into several)")
    return f"{source}: {unit}; blocks of at most {block_size} tokens, never packed across units"


def _refuse_training_file_as_validation(data_args: DataTrainingArguments, training_args) -> None:
    """The perplexity is a non-private number about the validation data: the training file itself is refused."""
    a, b = data_args.train_file, data_args.validation_file
    if training_args.do_train and training_args.do_eval and a and b and os.path.isfile(a) and os.path.isfile(b) \
            and os.path.samefile(a, b):
        raise RecipeError(f"--validation_file {b} is the training file: its perplexity would be a non-private "
                          "statistic of the private training data; evaluate on public or held-out data")


def _warn_overlap(train, validation, text_column: str, training_args) -> bool:
    """Validation texts that also occur in the training rows: their perplexity is not held out (and not private).
    Refused under DP (:func:`refuse_eval_overlap`); without DP returns whether any does (the card says so). How many is
    not said: a count of private training texts."""
    seen = set(train[text_column])
    if refuse_eval_overlap(training_args, any(t in seen for t in validation[text_column]), "texts"):
        logger.warning("some validation rows also occur in the training data: the perplexity on them is not a held-out "
                       "metric, and not a private one (the card says so); evaluate on text disjoint from the training data")
        return True
    return False


# ----------------------------------------------------------------------------------------------- run


def run(model_args, data_args, training_args) -> dict[str, Any]:
    """Load data and model, train with DP, evaluate, sample, save; return the summary dict."""
    import transformers
    from transformers import DataCollatorForLanguageModeling

    from hf_dp import DPTrainer
    from hf_dp.clipping.hooks import unwrap_for_save
    from hf_dp.hub import write_privacy_artifacts
    from hf_dp.hub.describe import card_fields

    start = time.perf_counter()
    transformers.set_seed(training_args.seed)
    explicit = getattr(training_args, "_hf_dp_explicit", frozenset())
    _refuse_training_file_as_validation(data_args, training_args)
    # the config and the tokenizer before any data is read: offline, a Hub id that is not cached is refused at once
    config, tokenizer, pretrained_path = load_config_and_tokenizer(model_args)
    # a unit column: no bar over the rows (their number is private); several processes: one writes the cache
    with training_args.main_process_first(desc="loading the data"), (
            no_progress_bar() if training_args.privacy_unit_column or training_args.public_dataset_size is not None
            else contextlib.nullcontext()):
        raw = load_raw_datasets(
            train_file=data_args.train_file, validation_file=data_args.validation_file,
            dataset_name=data_args.dataset_name, dataset_config_name=data_args.dataset_config_name,
            cache_dir=model_args.cache_dir, keep_linebreaks=data_args.keep_linebreaks,
        )
    sources = _sources(data_args)
    if training_args.do_train and "train" not in raw:
        raise RecipeError("--do_train needs training data (--train_file, or a dataset with a 'train' split)")
    if training_args.do_eval and "validation" not in raw:
        if "do_eval" in explicit:
            raise RecipeError("--do_eval needs validation data (--validation_file, or a dataset with a 'validation' "
                              "split)")
        logger.warning("no validation data (--validation_file): no eval_loss or perplexity")
        training_args.do_eval = False
    check_text_column(raw, data_args.text_column, sources)
    resume = resume_argument(training_args, model_sources(model_args))

    user_unit = training_args.privacy_unit_column is not None
    unit_column = training_args.privacy_unit_column or DOCUMENT_COLUMN
    train = n_units = shown_units = None
    if training_args.do_train:
        train = raw["train"]
        if data_args.max_train_samples is not None:
            train = train.select(range(min(len(train), data_args.max_train_samples)))
        # the unit column, checked on the training rows before anything is tokenized (one error line)
        check_unit_column(train, training_args.privacy_unit_column, data_args.text_column, sources.get("train", "train"))
        if not user_unit:
            train = add_document_ids(train)
        train = drop_empty_texts(train, data_args.text_column, sources.get("train", "train"), count_is_private=user_unit or training_args.public_dataset_size is not None)
        n_units = count_units(train, unit_column)
        shown_units = public_size(training_args, n_units)  # what the plan, the card and the summary name
        check_privacy_settings(training_args, n_units)  # N = the units; before the model and any tokenization
    validation, overlap = None, False
    if training_args.do_eval:
        validation = raw["validation"]
        if data_args.max_eval_samples is not None:
            validation = validation.select(range(min(len(validation), data_args.max_eval_samples)))
        validation = drop_empty_texts(validation, data_args.text_column, sources.get("validation", "validation"))
        if train is not None:
            overlap = _warn_overlap(train, validation, data_args.text_column, training_args)

    block_size = choose_block_size(data_args.block_size, config, tokenizer)
    model = build_model(model_args, config, tokenizer, pretrained_path)
    if training_args.do_train:
        planned = lm_batch_plan(training_args, n_units)
        if planned:
            print(planned, flush=True)
            check_privacy_settings(training_args, n_units)

    train_blocks = eval_blocks = None
    with training_args.main_process_first(desc="cutting the texts into blocks"):
        if train is not None:
            train_blocks = training_blocks(train, tokenizer, data_args.text_column, unit_column, block_size,
                                           pack_units=user_unit, overwrite_cache=data_args.overwrite_cache)
        if validation is not None:
            eval_blocks = evaluation_blocks(validation, tokenizer, data_args.text_column, block_size,
                                            overwrite_cache=data_args.overwrite_cache)
    if train_blocks is not None:
        training_args.privacy_unit_column = unit_column  # the trainer's unit: the user's column or each document
    collator = DataCollatorForLanguageModeling(tokenizer, mlm=False)
    if training_args.dp_max_length is None:  # blocks of at most block_size tokens: the rounding allowance's public bound
        training_args.dp_max_length = block_size

    # --push_to_hub: train and save locally first, push the saved folder at the end (a failed push loses nothing)
    push = bool(training_args.push_to_hub)
    training_args.push_to_hub = False
    # the start-of-run block (logged as the trainer is built) gives the planner's causal-LM verdict once, and only for
    # a pretrained model: a model from --model_type starts from random weights, which the verdict was not calibrated on
    with verdict_scope(model_args):
        trainer = DPTrainer(
            model=model, args=training_args, train_dataset=train_blocks, eval_dataset=eval_blocks,
            processing_class=tokenizer, data_collator=collator,
        )
    release_is_the_product(trainer)  # the card and privacy.json in <output_dir>/release only
    trainer.add_callback(time_left_callback())  # one overall estimate: the planned steps, the time left
    # the card fields (no local paths; a Hub dataset only if one was used)
    trainer.base_model_id = base_model_id(model_args.model_name_or_path) if model_args.model_name_or_path else None
    trainer.task_name = TASK
    trainer.dataset_name = None if (data_args.train_file or data_args.validation_file) else data_args.dataset_name
    if train_blocks is not None:
        trainer.data_description = _data_description(data_args, unit_column, user_unit, shown_units, block_size,
                                                     declared=training_args.public_dataset_size is not None)
    report: dict[str, Any] = {}
    if training_args.do_train:
        if user_unit and (line := unit_loss_line(training_args, "block", "blocks")):
            print(line, flush=True)  # the logged training loss is per user, eval_loss per token: why they differ
        train_result = trainer.train(resume_from_checkpoint=resume)
        trainer.log_metrics("train", train_result.metrics)
        report = trainer.privacy_report()
    eval_metrics: dict[str, Any] = {}
    if eval_blocks is not None:
        eval_metrics = with_perplexity(trainer.evaluate())
        trainer.log_metrics("eval", eval_metrics)

    # post-processing of the trained model: a public prompt, a fixed seed — no privacy cost
    # (under FSDP the sharded model itself — every rank generates in step; a PEFT model cannot be copied to merge there)
    samples = sample_continuations(
        trainer.model if trainer.is_fsdp_enabled else unwrap_for_save(trainer.model), tokenizer, data_args.sample_prompt, num=data_args.num_samples,
        max_new_tokens=data_args.sample_max_new_tokens, seed=data_args.generation_seed,
    )

    out = None
    if training_args.do_train:
        out = save_release(trainer, training_args)  # <output_dir>/release: LoRA merged, DP or not (DPTrainer.save_model)
        if trainer.is_world_process_zero():  # the card with everything the recipe knows (task, data, eval results)
            write_privacy_artifacts(
                out, report, base_model=trainer.base_model_id, task_name=TASK, dataset_name=trainer.dataset_name,
                eval_results=eval_metrics or None, data_description=trainer.data_description,
                model_name=os.path.basename(os.path.normpath(training_args.output_dir)), eval_overlap=overlap,
                random_init=not model_args.model_name_or_path,
                model_description=None if trainer.base_model_id else card_fields(
                    trainer.model, trainer.args, trainer.train_dataset)["model_description"],
                log_history=trainer.state.log_history,  # the training-curves PNG (hf_dp.hub.plots)
            )
    pushed = None
    if push and out is not None and trainer.is_world_process_zero():
        pushed = push_folder(out, training_args)

    extra: list[tuple[str, Any]] = []
    if train_blocks is not None:
        # N only: the number of rows or blocks depends on the private texts (their number per unit, their lengths)
        unit = (f"'{unit_column}': {shown_units:,} units" if user_unit
                else f"each input row (column '{DOCUMENT_COLUMN}'): {shown_units:,} documents")
        extra.append(("privacy unit", f"{unit}, cut into blocks of <= {block_size} tokens"))
    if eval_metrics:
        extra.append(("eval loss", eval_metrics.get("eval_loss")))
    if samples:
        extra.append(("samples", f"{len(samples)} continuations of {data_args.sample_prompt!r}, generation seed "
                                 f"{data_args.generation_seed} (post-processing of the released model: no privacy cost)"))
        extra += [(f"sample {i}", text) for i, text in enumerate(samples, start=1)]
    summary = summarize(TASK, training_args, report, "perplexity", eval_metrics, None, start, out, pushed,
                        extra_rows=extra, expectation=planner_expectation(trainer))
    summary.update(samples=samples, block_size=block_size, num_units=shown_units, unit_column=unit_column)
    return summary


def main(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None) -> int:
    """Entry point; returns the process exit code (0 ok, 2 for usage/data/model errors, shown without traceback)."""
    return run_main(parse_args, run, argv, defaults, user_errors=(DataLoadingError,))


if __name__ == "__main__":
    sys.exit(main())
