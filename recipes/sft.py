#!/usr/bin/env python
"""Differentially private supervised fine-tuning on conversations with hf_dp and TRL — a DP version of TRL's ``sft``
script (needs the ``sft`` extra: ``pip install -e ".[sft]"``).

    python recipes/sft.py --model_type llama --config_overrides hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2 \\
        --tokenizer_name minilm --train_file chats.jsonl --validation_file chats_dev.jsonl \\
        --privacy_unit_column user_id --epsilon 3 --output_dir runs/sft

Flags: TRL's sft script's (``--dataset_name``, ``--dataset_config``, ``--dataset_train_split``,
``--dataset_test_split``, ``--model_name_or_path``, ``--use_peft``, ``--lora_r``, ``--lora_alpha``,
``--lora_target_modules``), every flag of TRL's ``SFTConfig`` (``--max_length``, ``--assistant_only_loss``,
``--completion_only_loss``, ...), run_clm's ``--model_type`` / ``--config_overrides`` / ``--tokenizer_name`` (a tiny
model from a config, offline) and
``--train_file`` / ``--validation_file`` (json/jsonl/csv with a ``messages`` column, or ``prompt`` / ``completion``
columns), plus hf_dp's DP flags (``--epsilon``, ``--per_sample_max_grad_norm``, ``--privacy_unit_column``, ...), and
``--config FILE.yaml`` as the other recipes. ``--help`` shows the DP flags first, each TRL flag marked with what it does
under DP (``hf_dp.sft.config.SFT_FLAGS``: ``--packing`` refused, ...), and the recipe's defaults for the command line.

What the recipe decides (recipes/README.md, "Supervised fine-tuning"; docs/sft.md):

* **The DP defaults.** LoRA adapters (``--trainable lora``), dp_adamw at lr 2e-3 (:data:`SFT_ADAM_LR`), a constant
  schedule without warm-up, C = 0.1, 2 epochs, ε = 3, δ = 1e-5, and — with ``--epsilon`` and no batch flag — a logical
  batch of about N/16 units (16 per device × the accumulation that makes it: q ≈ 1/16, ≈ 32 steps; printed at start).
  The learning rate was chosen on a public tune split of conversations (benchmarks/RESULTS.md §10d: QNLI questions
  answered by their Wikipedia sentences, from a GPT-2 pretrained on the questions); the rest are ``recipes/clm.py``'s
  defaults for LoRA on a causal LM (§10b). HF's own defaults — lr 5e-5, a linear decay, B = 8 — are what the README
  warns against under DP.
* **The loss.** Conversations (``messages``) are scored on the assistant's tokens only: ``--assistant_only_loss`` is
  on unless given (``DPSFTConfig``'s default, per data kind); prompt-completion rows on the completion only (TRL's
  ``completion_only_loss``). Each conversation's loss is the mean over its scored tokens (hf_dp.sft).
* **The chat template.** A tokenizer without one (``--tokenizer_name minilm``) gets :data:`DEFAULT_CHAT_TEMPLATE`
  (``role: text`` lines, the assistant's text inside ``{% generation %}``), said in one line; ``--chat_template_path``
  sets another.
* **The unit.** ``--privacy_unit_column user_id``: all conversations of one user are one unit (N = users). The
  training loss is then logged per user (the sum over the user's conversations): one line at the start says so.
* **Before any model is loaded**, one ``error:`` line each for what cannot run (a missing unit column or unit, a TRL
  flag DP refuses, ``--assistant_only_loss`` on data that is not conversational, a chat template without
  ``{% generation %}`` markers), as glue.py and clm.py.
* **After training**: eval_loss on the validation data (not private), printed; ``<output_dir>/release`` holds the model
  (LoRA merged), the tokenizer (with its chat template), ``privacy.json`` and the model card, nothing else;
  ``--push_to_hub`` uploads that folder, and a failed push is one line with the command that pushes it later.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from recipes.clm import LM_STEPS_PER_EPOCH, lm_batch_plan  # noqa: E402
from recipes.clm import OPTIMIZER_DEFAULTS as CLM_OPTIMIZER_DEFAULTS  # noqa: E402
from recipes.clm import PROTOCOL_DEFAULTS as CLM_PROTOCOL_DEFAULTS  # noqa: E402
from recipes.clm_support import build_model, verdict_scope  # noqa: E402
from recipes.clm_support.trl import (TrlModelArguments, TrlScriptArguments, count_trl_units,  # noqa: E402
                                     load_trl_config_and_tokenizer, load_trl_data, parse_trl_args, trl_parser)
from recipes.common.args import RecipeError  # noqa: E402
from recipes.common.help import effective_notes  # noqa: E402
from recipes.common.help import format_help as _format_help  # noqa: E402
from recipes.common.logs import time_left_callback, unit_loss_line  # noqa: E402
from recipes.common.model import base_model_id  # noqa: E402
from recipes.common.run import (check_privacy_settings, data_description, eval_rows_in_training, fingerprint,  # noqa: E402
                                model_sources, push_folder, refuse_eval_overlap, release_is_the_product,
                                resume_argument, save_release)
from recipes.common.run import main as run_main  # noqa: E402
from recipes.common.summary import planner_expectation, summarize  # noqa: E402
from recipes.glue_support.tasks import DataLoadingError  # noqa: E402

logger = logging.getLogger("hf_dp.recipes.sft")

#: the chat template a tokenizer without one gets: one "role: text" line per message, each closed by the EOS token;
#: the assistant's text and its EOS inside {% generation %} (what TRL's assistant_only_loss scores)
DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}{{ message['role'] }}: "
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{{ eos_token }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{{ eos_token }}{% endif %}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)

# Recipe defaults: recipes/clm.py's for LoRA on a causal LM (benchmarks/RESULTS.md §10b) — LoRA, constant schedule,
# C = 0.1, 2 epochs, ε = 3, δ = 1e-5, without a batch flag a logical batch of ≈ N/16 units (clm.lm_batch_plan) — but
# dp_adamw / dp_adam at lr 2e-3, chosen on a public tune split of conversations (RESULTS §10d)
PROTOCOL_DEFAULTS: dict[str, Any] = {k: v for k, v in CLM_PROTOCOL_DEFAULTS.items() if k != "lm_loss_weighting"}  # TRL's own loss
#: the Adam-type rules' learning rate for conversations (RESULTS §10d: on the tune split of QNLI conversations 2e-3 kept
#: 64 % (one conversation per unit) and 48 % (per user) of the non-private gain, clm.py's 5e-4 37 % and 19 %; 4e-3
#: kept more there, but its noise walk is past the threshold where every measured run on text close to the
#: pretraining ended worse than no fine-tuning, hf_dp.plan.lm_verdict)
SFT_ADAM_LR = 2e-3
#: per optimizer (when --learning_rate / --weight_decay are not given): clm.py's, dp_adamw / dp_adam at SFT_ADAM_LR
OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {
    k: dict(v, **({"learning_rate": SFT_ADAM_LR} if k in ("dp_adamw", "dp_adam") else {}))
    for k, v in CLM_OPTIMIZER_DEFAULTS.items()}


@dataclass
class SftScriptArguments(TrlScriptArguments):
    """TRL's sft script's data flags, plus local files."""

    train_file: Optional[str] = field(default=None, metadata={"help": "json/jsonl/csv: 'messages' or 'prompt'/'completion'"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Held-out conversations for eval_loss"})


@dataclass
class SftModelArguments(TrlModelArguments):
    """TRL's model flags that DP keeps (``--use_peft``; the rank is DPSFTConfig's ``--lora_r``) and run_clm's."""

    use_peft: bool = field(default=False, metadata={"help": "LoRA adapters (= --trainable lora, the recipe's default; "
                                                            "rank --lora_r)"})


# ----------------------------------------------------------------------------------------------- arguments


def _sft_config():
    from hf_dp.sft import DPSFTConfig

    return DPSFTConfig


def make_parser():
    return trl_parser(SftScriptArguments, SftModelArguments, _sft_config)


def _run_name(peek) -> str:
    if peek.model_type:
        return f"sft-{peek.model_type}"
    name = peek.model_name_or_path or peek.config_name or "model"
    return f"sft-{os.path.basename(os.path.normpath(name))}"


def parse_args(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None):
    """Parse ``argv``: recipe defaults < ``defaults`` < YAML ``--config`` < command line (recipes.common.args). The
    frozen-prefix cache is never on by default (LoRA; a unit column, which the cache does not keep)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    return parse_trl_args(argv, defaults, parser=make_parser(), protocol_defaults=PROTOCOL_DEFAULTS,
                          optimizer_defaults=OPTIMIZER_DEFAULTS, run_name=_run_name, format_help=format_help)


def format_help(parser, peek) -> str:
    """``--help``: hf_dp's DP flags, the data and model flags, TRL's SFTConfig flags each marked with what it does under
    DP (hf_dp.sft.config.SFT_FLAGS), then the essential training flags with the recipe's defaults for this command
    line; the other TrainingArguments flags with --help-all."""
    from hf_dp.sft.config import SFT_FLAGS, sft_fields

    notes = effective_notes(OPTIMIZER_DEFAULTS, {}, "runs/sft-<model>-<optim>-eps<ε>")
    notes["learning_rate"] = ("(recipe default depends on --optim — " + ", ".join(
        f"{k} {v['learning_rate']:g}" for k, v in OPTIMIZER_DEFAULTS.items()) + "; shown for this command line. "
        "dp_adamw / dp_adam's chosen on a public tune split of conversations, benchmarks/RESULTS.md §10d; the others "
        "clm.py's)")
    notes["per_device_train_batch_size"] = (
        f"(recipe default: 16 per device; with --epsilon and neither this nor --gradient_accumulation_steps given, the "
        f"accumulation that makes the logical batch ≈ N/{LM_STEPS_PER_EPOCH} units, q ≈ 1/{LM_STEPS_PER_EPOCH}, printed "
        "at start: clm.py's setting)")
    notes["num_train_epochs"] = f"(recipe default: 2, ≈ {2 * LM_STEPS_PER_EPOCH} steps at the default batch)"
    notes["cache_frozen_features"] = "(recipe default: off — LoRA trains inside every block)"
    notes["privacy_unit_column"] = ("(recipe default: each training row — a conversation — is one unit; with a unit "
                                    "column the logged training loss is per unit, the sum over its conversations)")
    notes["chat_template_path"] = ("(recipe default: the tokenizer's chat template; a tokenizer without one gets the "
                                   "recipe's 'role: text' template with the assistant's text in {% generation %})")
    if getattr(peek, "assistant_only_loss", None) is None:
        # what --help shows (it exits before parsing): the recipe decides from the data, not TRL's False
        parser.set_defaults(assistant_only_loss="per data kind: true on 'messages' data")
    trl_title = ("TRL SFTConfig (as TRL's sft script; [DP: ...] = what the flag does under DP, from "
                 "hf_dp/sft/config.py and docs/sft.md; unmarked = safe)")
    return _format_help(
        parser, peek, data_arguments=SftScriptArguments, model_arguments=SftModelArguments,
        data_title="data (as TRL's sft script, plus --train_file / --validation_file)",
        model_title="model (as TRL's sft script, plus run_clm's --model_type / --config_overrides)", notes=notes,
        extra_groups=[(trl_title, sft_fields(), SFT_FLAGS)],
        usage="python recipes/sft.py [--config FILE.yaml] [flags]   |   python recipes/sft.py args.json|args.yaml   |   "
              "python recipes/sft.py --help-all",
        description="Differentially private supervised fine-tuning with TRL (TRL's sft flags plus hf_dp's). Defaults "
                    "are the recipe's effective values for this command line; see recipes/README.md and docs/sft.md.",
    )


# ----------------------------------------------------------------------------------------------- data


#: what the training rows are, per data kind (:func:`_check_columns`), as the card says it
DATA_KINDS = {"messages": "conversations ('messages': role/content turns)",
              "prompt_completion": "prompt-completion rows", "text": "plain text (column `{field}`)"}


def _check_columns(ds, args, what: str) -> str:
    cols = set(ds.column_names)
    if "messages" in cols:
        kind = "messages"
    elif {"prompt", "completion"} <= cols:
        kind = "prompt_completion"
    elif args.dataset_text_field in cols:
        kind = "text"
    else:
        raise DataLoadingError(f"the {what} data has no 'messages' column, no 'prompt'/'completion' columns and no "
                               f"'{args.dataset_text_field}' column (it has {sorted(cols)})")
    if (args.dataset_kwargs or {}).get("skip_prepare_dataset") and "input_ids" not in cols:
        raise DataLoadingError(f"--dataset_kwargs skip_prepare_dataset uses the {what} rows as given, and they are not "
                               "tokenized (no 'input_ids' column): drop it so that TRL prepares them, or give token ids")
    if kind == "messages":  # else TRL's traceback after the model is built (an IndexError, or blaming the template)
        assistant_only = args.assistant_only_loss is not False  # None: on for conversations (resolve_loss_scope)
        for i, turns in enumerate(ds["messages"]):
            if not turns:
                raise DataLoadingError(f"the {what} data's conversation {i} (counting from 0) has no messages: drop it "
                                       "or give it its turns")
            if assistant_only and not any(isinstance(t, dict) and t.get("role") == "assistant" for t in turns):
                raise DataLoadingError(
                    f"the {what} data's conversation {i} (counting from 0) has no assistant turn, and only the "
                    "assistant's tokens are scored (--assistant_only_loss, the default for conversations), so it would "
                    "train on nothing: drop it, or pass --assistant_only_loss false to score every turn")
    return kind


def _check_special_tokens(tokenizer, args) -> None:
    """``--eos_token`` / ``--pad_token`` must be tokens of the vocabulary (else TRL's traceback after the model)."""
    vocab = tokenizer.get_vocab()
    for flag in ("eos_token", "pad_token"):
        value = getattr(args, flag, None)
        if value is not None and value not in vocab:
            raise DataLoadingError(f"--{flag} {value!r} is not a token of the tokenizer's vocabulary: give one of its "
                                   f"tokens (the tokenizer's own {flag} is {getattr(tokenizer, flag, None)!r})")


def _template_line(tokenizer, args) -> str:
    scored = ("the assistant's text and its end token inside {% generation %}, the tokens that are scored"
              if args.assistant_only_loss else "the assistant's text marked with {% generation %}")
    return (f"chat template: the tokenizer has none, and conversations need one to become text: using the recipe's "
            f"default (recipes/sft.py DEFAULT_CHAT_TEMPLATE): one 'role: text' line per message, each ended by "
            f"{tokenizer.eos_token!r}, {scored}; the release ships it (chat_template.jinja). --chat_template_path "
            "FILE.jinja sets another")


# ----------------------------------------------------------------------------------------------- run


def run(data_args: SftScriptArguments, model_args: SftModelArguments, args) -> dict[str, Any]:
    """Load data and model, train with DP, evaluate, save, push; return the summary dict."""
    import transformers

    from hf_dp.sft import DPSFTTrainer
    from hf_dp.sft.config import resolve_loss_scope

    start = time.perf_counter()
    transformers.set_seed(args.seed)
    if args.max_length is not None and args.max_length < 1:  # else "the training dataset is empty", after the model
        raise RecipeError(f"--max_length {args.max_length} leaves no token of any row: give a positive length (or none)")
    # before any model is loaded (without 🤗 Datasets' bars under a unit column: they print the number of conversations)
    train, dev, kind = load_trl_data(data_args, args, lambda ds, what: _check_columns(ds, args, what))
    if not args.do_train:
        _check_evaluate_only(args, dev)
    resume = resume_argument(args, model_sources(model_args))
    # N: the units, else the rows (before TRL's preparation, which drops a conversation left with no scored token:
    # DPTrainer counts the prepared set)
    n_units = count_trl_units(train, args)
    check_privacy_settings(args, n_units)  # δ < 1/N, B ≤ N, σ calibratable: before the model and TRL's preparation
    overlap = refuse_eval_overlap(args, dev is not None and (eval_rows_in_training(
        train, dev, ("messages", "prompt", "completion", args.dataset_text_field)) or turns_in_training(train, dev)))
    clm_args, config, tokenizer, path = load_trl_config_and_tokenizer(model_args, args)
    from trl.data_utils import is_conversational

    default_template = (getattr(tokenizer, "chat_template", None) is None and args.chat_template_path is None
                        and is_conversational(train[0]))
    if default_template:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    # --assistant_only_loss unless given: on for messages (the assistant's tokens only), off for prompt-completion rows
    # (completion_only_loss scores the completion); the flag on data that is not conversational, or a template that
    # cannot mark the assistant's tokens: one error line (hf_dp.sft.config.resolve_loss_scope), before the model
    resolve_loss_scope(args, train[0], tokenizer)
    if default_template:
        print(_template_line(tokenizer, args), flush=True)
    _check_special_tokens(tokenizer, args)
    model = build_model(clm_args, config, tokenizer, path)
    planned = lm_batch_plan(args, n_units)  # ≈ N/16 units when no batch flag is given (clm.py's setting)
    if planned:
        print(planned + "; clm.py's setting for LoRA on a causal LM, reused for SFT (the batch was not tuned on "
              "conversations)", flush=True)
        check_privacy_settings(args, n_units)
    if not args.do_train:  # --do_train false: the model scored as it is on the held-out conversations, nothing saved
        return _evaluate_only(model, args, train, dev, tokenizer, start)

    # --push_to_hub: train and save locally first, push the release folder at the end (a failed push loses nothing)
    push = bool(args.push_to_hub)
    args.push_to_hub = False
    # the start-of-run block (logged as the trainer is built): the causal-LM verdict only for a pretrained model
    with verdict_scope(model_args):
        trainer = DPSFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=dev, processing_class=tokenizer)
    release_is_the_product(trainer)  # the card and privacy.json in <output_dir>/release only
    trainer.add_callback(time_left_callback())  # one overall estimate: the planned steps, the time left
    trainer.base_model_id = base_model_id(model_args.model_name_or_path) if model_args.model_name_or_path else None
    # the card: where the data came from and the user's own columns (not TRL's tokenized ones); an evaluation that
    # repeats training rows is not called held-out
    trainer.dataset_name = None if data_args.train_file else data_args.dataset_name
    trainer.data_description = data_description(
        train.column_names, DATA_KINDS[kind].format(field=args.dataset_text_field), train_file=data_args.train_file,
        dataset_name=data_args.dataset_name, dataset_config=data_args.dataset_config, split=data_args.dataset_train_split)
    trainer.eval_overlap = overlap
    line = unit_loss_line(args, "conversation" if kind == "messages" else "row",
                          "conversations" if kind == "messages" else "rows")
    if line:
        print(line, flush=True)  # the logged training loss is per user, eval_loss per token: why they differ
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate() if dev is not None else {}
    eval_loss = metrics.get("eval_loss")
    if eval_loss is not None:
        print(f"eval_loss = {eval_loss:.4f} (perplexity {math.exp(min(eval_loss, 50)):.2f}) on {len(dev)} held-out "
              "conversations", flush=True)
    out = save_release(trainer, args)  # <output_dir>/release: the release only (LoRA merged), checkpoints beside it
    pushed = push_folder(out, args) if push and trainer.is_world_process_zero() else None
    report = trainer.privacy_report()
    unit = report.get("privacy_unit") or {}
    task = (f"supervised fine-tuning ({kind}; {unit.get('description', 'non-private')})" if args.dp_enabled
            else f"supervised fine-tuning ({kind}; non-private baseline)")
    summary = summarize(task, args, report, "loss", metrics, None, start, out, pushed,
                        expectation=planner_expectation(trainer))
    summary["metric_name"] = "eval_loss"
    return summary


def _conversations(rows):
    """Each row as the conversation SFT scores: ``messages``, or a conversational ``prompt`` + ``completion`` joined
    (TRL's prompt-completion form); rows of plain text yield nothing (the whole-row check covers them)."""
    cols = rows.column_names
    if "messages" in cols:
        yield from (m for m in rows["messages"] if isinstance(m, list))
    if "prompt" in cols and "completion" in cols:
        for p, c in zip(rows["prompt"], rows["completion"]):
            if isinstance(p, list) and isinstance(c, list):
                yield p + c


def _scored_turns(rows) -> set[bytes]:
    """Each assistant turn of each conversation with every message before it — the sequences SFT scores — as a running
    digest of the messages' :func:`recipes.common.run.comparable` form (32 bytes a turn, linear in the text)."""
    import hashlib

    out: set[bytes] = set()
    for messages in _conversations(rows):
        h = hashlib.sha256()
        for m in messages:
            key = fingerprint(m, h)
            if isinstance(m, dict) and m.get("role") == "assistant":
                out.add(key)
    return out


def turns_in_training(train, dev) -> bool:
    """Whether a validation conversation scores an assistant turn, with the same messages before it, that a training
    conversation scores (one is a prefix of the other, or one is in ``messages`` form and the other prompt +
    completion): its loss would measure a trained turn, so the evaluation is not held out. Only whether (a count is
    private)."""
    return bool(_scored_turns(train) & _scored_turns(dev))


def _check_evaluate_only(args, dev) -> None:
    """``--do_train false``, before the model is loaded: one error line for what an evaluation-only run cannot do."""
    if dev is None:
        raise RecipeError("--do_train false needs held-out data to score (--validation_file, or a dataset with a "
                          "test split): there is nothing else to do without training")
    if args.push_to_hub:
        raise RecipeError("--do_train false trains nothing and writes no release: there is nothing to push "
                          "(--push_to_hub)")


def _evaluate_only(model, args, train, dev, tokenizer, start: float) -> dict[str, Any]:
    """``--do_train false`` (HF's meaning: no training): the model as loaded, scored on the held-out conversations with
    the recipe's own loss scope; no release is written (:func:`_check_evaluate_only` refused what it cannot do)."""
    from hf_dp.sft import DPSFTTrainer

    # no step is taken: nothing private is used or spent. TRL's trainer needs a training set (it reads the data kind
    # from it): one row, never trained on, under a trainer without DP (no plan, no sampling, no ledger)
    args.disable_dp = True
    trainer = DPSFTTrainer(model=model, args=args, train_dataset=train.select([0]), eval_dataset=dev,
                           processing_class=tokenizer)
    metrics = trainer.evaluate()
    eval_loss = metrics.get("eval_loss")
    if eval_loss is not None:
        print(f"eval_loss = {eval_loss:.4f} (perplexity {math.exp(min(eval_loss, 50)):.2f}) on {len(dev)} held-out "
              "conversations (no training: --do_train false)", flush=True)
    summary = summarize("supervised fine-tuning (evaluation only: --do_train false)", args, {}, "loss", metrics, None,
                        start, None, None)
    summary["metric_name"] = "eval_loss"
    return summary


def main(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None) -> int:
    """Entry point; returns the process exit code (0 ok, 2 for usage/data/model errors, shown without traceback, 3 when
    the model was saved but the Hub push failed)."""
    return run_main(parse_args, run, argv, defaults, user_errors=(DataLoadingError,))


if __name__ == "__main__":
    sys.exit(main())
