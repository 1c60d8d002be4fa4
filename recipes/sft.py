#!/usr/bin/env python
"""Differentially private supervised fine-tuning on conversations with hf_dp and TRL — a DP version of TRL's ``sft``
script (needs the ``sft`` extra: ``pip install -e ".[sft]"``).

    python recipes/sft.py --model_type llama --config_overrides hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2 \\
        --tokenizer_name minilm --train_file chats.jsonl --validation_file chats_dev.jsonl \\
        --privacy_unit_column user_id --epsilon 3 --output_dir runs/sft

Flags: TRL's sft script's (``--dataset_name``, ``--dataset_config``, ``--dataset_train_split``,
``--dataset_test_split``, ``--model_name_or_path``, ``--use_peft``, ``--lora_r``, ``--lora_alpha``), every flag of
TRL's ``SFTConfig`` (``--max_length``, ``--assistant_only_loss``, ``--completion_only_loss``, ...), run_clm's
``--model_type`` / ``--config_overrides`` / ``--tokenizer_name`` (a tiny model from a config, offline) and
``--train_file`` / ``--validation_file`` (json/jsonl/csv with a ``messages`` column, or ``prompt`` / ``completion``
columns), plus hf_dp's DP flags (``--epsilon``, ``--per_sample_max_grad_norm``, ``--privacy_unit_column``, ...).

What the recipe decides (recipes/README.md, "Supervised fine-tuning"):

* **The loss.** Conversations (``messages``) are scored on the assistant's tokens only: ``--assistant_only_loss`` is
  on unless given (``DPSFTConfig``'s default, per data kind); prompt-completion rows on the completion only (TRL's
  ``completion_only_loss``). Each conversation's loss is the mean over its scored tokens (hf_dp.sft).
* **The chat template.** A tokenizer without one (``--tokenizer_name minilm``) gets :data:`DEFAULT_CHAT_TEMPLATE`
  (``role: text`` lines, the assistant's text inside ``{% generation %}``); ``--chat_template_path`` sets another.
* **The unit.** ``--privacy_unit_column user_id``: all conversations of one user are one unit (N = users).
* **After training**: eval_loss on the validation data (not private), printed; the output folder holds the model
  (LoRA merged), the tokenizer (with its chat template), ``privacy.json`` and the model card.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

_REPO = Path(__file__).resolve().parents[1]
if str(_REPO) not in sys.path:
    sys.path.insert(0, str(_REPO))

from recipes.clm_support import ClmModelArguments, build_model, load_config_and_tokenizer, load_raw_datasets  # noqa: E402
from recipes.common.args import RecipeError  # noqa: E402
from recipes.common.model import base_model_id  # noqa: E402
from recipes.common.run import main as run_main  # noqa: E402
from recipes.common.run import save_release  # noqa: E402
from hf_dp.run.data import no_progress_bar  # noqa: E402
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


@dataclass
class SftScriptArguments:
    """TRL's sft script's data flags, plus local files."""

    dataset_name: Optional[str] = field(default=None, metadata={"help": "A datasets name (offline: the local cache only)"})
    dataset_config: Optional[str] = field(default=None, metadata={"help": "The dataset's configuration name"})
    dataset_train_split: str = field(default="train", metadata={"help": "The training split"})
    dataset_test_split: str = field(default="validation", metadata={"help": "The evaluation split (not private data)"})
    train_file: Optional[str] = field(default=None, metadata={"help": "json/jsonl/csv: 'messages' or 'prompt'/'completion'"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Held-out conversations for eval_loss"})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Keep the first N training rows"})


@dataclass
class SftModelArguments:
    """TRL's model flags that DP keeps (``--use_peft``; the rank is DPSFTConfig's ``--lora_r``) and run_clm's."""

    model_name_or_path: Optional[str] = field(default=None, metadata={"help": "A causal LM folder (or Hub id)"})
    model_type: Optional[str] = field(default=None, metadata={"help": "A new model of this type (llama, gpt2, ...)"})
    config_overrides: Optional[str] = field(default=None, metadata={"help": "With --model_type, e.g. hidden_size=64"})
    config_name: Optional[str] = field(default=None, metadata={"help": "Config name or path, if not the model's"})
    tokenizer_name: Optional[str] = field(default=None, metadata={"help": "Tokenizer name or path; minilm = offline"})
    model_revision: str = field(default="main", metadata={"help": "Model version (branch, tag or commit)"})
    use_peft: bool = field(default=False, metadata={"help": "LoRA adapters (= --trainable lora; rank --lora_r)"})


def parse_args(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None):
    from transformers import HfArgumentParser

    try:
        from hf_dp.sft import DPSFTConfig
    except ImportError as exc:
        raise RecipeError(str(exc)) from None  # the sft extra (TRL) is not installed: one line

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = HfArgumentParser((SftScriptArguments, SftModelArguments, DPSFTConfig))
    try:
        data_args, model_args, args = parser.parse_args_into_dataclasses(args=argv)
    except SystemExit as exc:  # argparse's own usage errors were printed already
        if exc.code:
            raise RecipeError("the command line could not be parsed (see the usage line above)") from None
        raise
    if model_args.use_peft:
        if "--trainable" in argv and args.trainable != "lora":
            raise RecipeError(f"--use_peft trains LoRA adapters; it cannot be combined with --trainable {args.trainable}")
        args.trainable = "lora"
    given = {a.split("=")[0] for a in argv if a.startswith("--")}
    return data_args, model_args, args, given


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
    return kind


def _load_data(data_args: SftScriptArguments, args):
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
    kind = _check_columns(train, args, "training")
    if dev is not None:
        _check_columns(dev, args, "validation")
        if args.privacy_unit_column in dev.column_names:
            dev = dev.remove_columns(args.privacy_unit_column)
    col = args.privacy_unit_column
    if col is not None and not args.disable_dp and col not in train.column_names:
        raise DataLoadingError(f"--privacy_unit_column {col}: the training data has no column '{col}' (it has "
                               f"{sorted(train.column_names)})")
    return train, dev, kind


def run(data_args: SftScriptArguments, model_args: SftModelArguments, args, given: set) -> dict[str, Any]:
    from hf_dp.sft import DPSFTTrainer
    from hf_dp.sft.config import resolve_loss_scope

    start = time.time()
    # before any model is loaded; under a unit column without 🤗 Datasets' bars (they print the number of
    # conversations, private under user-level DP)
    with no_progress_bar() if args.dp_enabled and (args.privacy_unit_column or args.public_dataset_size is not None) \
            else contextlib.nullcontext():
        train, dev, kind = _load_data(data_args, args)
    clm_args = ClmModelArguments(model_name_or_path=model_args.model_name_or_path, model_type=model_args.model_type,
                                 config_overrides=model_args.config_overrides, config_name=model_args.config_name,
                                 tokenizer_name=model_args.tokenizer_name, model_revision=model_args.model_revision,
                                 trust_remote_code=args.trust_remote_code)
    config, tokenizer, path = load_config_and_tokenizer(clm_args)
    if tokenizer.eos_token is None:  # a BERT-style tokenizer (minilm): its [SEP] ends each message
        tokenizer.eos_token = tokenizer.sep_token
        config.eos_token_id = tokenizer.eos_token_id
    if getattr(tokenizer, "chat_template", None) is None and args.chat_template_path is None and kind != "text":
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
    # --assistant_only_loss unless given: on for messages (the assistant's tokens only), off for prompt-completion rows
    # (completion_only_loss scores the completion); a template that cannot mark the assistant's tokens: one error line
    resolve_loss_scope(args, train[0], tokenizer)
    model = build_model(clm_args, config, tokenizer, path)
    trainer = DPSFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=dev, processing_class=tokenizer)
    trainer.base_model_id = base_model_id(model_args.model_name_or_path) if model_args.model_name_or_path else None
    trainer.train()
    metrics = trainer.evaluate() if dev is not None else {}
    eval_loss = metrics.get("eval_loss")
    if eval_loss is not None:
        print(f"eval_loss = {eval_loss:.4f} (perplexity {math.exp(min(eval_loss, 50)):.2f}) on {len(dev)} held-out "
              "conversations", flush=True)
    out = save_release(trainer, args)  # <output_dir>/release: the release only (LoRA merged), checkpoints beside it
    report = trainer.privacy_report()
    unit = report.get("privacy_unit") or {}
    return {
        "task": f"supervised fine-tuning ({kind}; {unit.get('description', 'non-private')})" if args.dp_enabled
        else f"supervised fine-tuning ({kind}; non-private baseline)",
        "optimizer": str(args.optim), "epsilon": report.get("epsilon"), "target_epsilon": report.get("target_epsilon"),
        "delta": report.get("delta"), "noise_multiplier": report.get("noise_multiplier"),
        "max_grad_norm": report.get("max_grad_norm"), "sample_rate": report.get("sample_rate"),
        "steps": report.get("steps"), "metric_name": "eval_loss", "metric": eval_loss,
        "wall_time": time.time() - start, "output_dir": out, "report": report,
    }


def main(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None) -> int:
    """Entry point; returns the process exit code (0 ok, 2 for usage/data/model errors, shown without traceback)."""
    return run_main(parse_args, run, argv, defaults, user_errors=(DataLoadingError,))


if __name__ == "__main__":
    sys.exit(main())
