#!/usr/bin/env python
"""Differentially private preference tuning with hf_dp and TRL — a DP version of TRL's ``dpo`` script, with a
``--reward_model`` mode for TRL's ``reward`` script (needs the ``sft`` extra: ``pip install -e ".[sft]"``).

    python recipes/dpo.py --model_type llama --config_overrides hidden_size=64,intermediate_size=128,num_hidden_layers=2,num_attention_heads=2,num_key_value_heads=2 \\
        --tokenizer_name minilm --train_file pairs.jsonl --validation_file pairs_dev.jsonl \\
        --privacy_unit_column user_id --epsilon 3 --output_dir runs/dpo

Flags: TRL's dpo script's (``--dataset_name``, ``--dataset_config``, ``--dataset_train_split``,
``--dataset_test_split``, ``--model_name_or_path``, ``--use_peft``), every flag of TRL's ``DPOConfig`` (``--beta``,
``--loss_type``, ``--max_length``, ...; with ``--reward_model``: ``RewardConfig``'s), run_clm's ``--model_type`` /
``--config_overrides`` / ``--tokenizer_name`` (a tiny model from a config, offline) and ``--train_file`` /
``--validation_file`` (json/jsonl/csv with ``prompt`` / ``chosen`` / ``rejected`` columns, or ``chosen`` / ``rejected``
with the prompt inside; json/jsonl may hold conversational pairs: lists of role/content messages), plus hf_dp's DP
flags (``--epsilon``, ``--per_sample_max_grad_norm``, ``--privacy_unit_column``, ...), and ``--config FILE.yaml``.
``--help`` shows the DP flags first and each TRL flag marked with what it does under DP (hf_dp/dpo/config.py).

What the recipe decides (docs/dpo.md):

* **One pair = one example**; ``--privacy_unit_column user_id``: all pairs of one user are one unit (N = users).
* **The DP defaults**: LoRA (``--trainable lora``; the reference model is then the base model with the adapter
  disabled, no second copy), dp_adamw at lr 5e-4, a constant schedule, C = 0.1, ε = 3, δ = 1e-5 (clm.py's),
  and — with ``--epsilon`` and no batch flag — a logical batch of about N/125 units (:data:`DPO_STEPS_PER_EPOCH`, at
  least 16 per device), the batch chosen for DPO on a public tune split (benchmarks/RESULTS.md §14); 1 epoch with
  one pair per unit (:data:`ROW_DP_EPOCHS`: ≈ 125 steps), 2 with ``--privacy_unit_column``, ``--reward_model`` or
  ``--disable_dp`` (clm.py's); ``--reward_model`` keeps clm.py's N/16 (≈ 32 steps: better than B 16 for it on the
  tune split).
* **The chat template.** A tokenizer without one gets :data:`DEFAULT_CHAT_TEMPLATE` (``role: text`` lines) for
  conversational pairs, said in one line.
* **Before any model is loaded**, one ``error:`` line each for what cannot run (missing columns, a missing unit, a TRL
  flag or loss type DP refuses, the training file as ``--validation_file`` or the training split as
  ``--dataset_test_split``).
* **After training**: on the validation pairs (not private), the share of pairs whose implicit reward (DPO) or reward
  (``--reward_model``) prefers the chosen answer, and the mean margin, printed. Validation pairs that score a sequence
  a training pair scores (:func:`pairs_in_training`) are refused under DP before any model is loaded; without DP they
  are not called held-out (one warning, the card says so, no count). ``<output_dir>/release`` holds the
  model (LoRA merged), the tokenizer, ``privacy.json`` and the card.
"""

from __future__ import annotations

import logging
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
from recipes.clm_support import verdict_scope  # noqa: E402
from recipes.clm_support.trl import (TrlModelArguments, TrlScriptArguments, count_trl_units,  # noqa: E402
                                     load_trl_config_and_tokenizer, load_trl_data, parse_trl_args, trl_parser)
from recipes.clm_support import build_model as build_causal_lm  # noqa: E402
from recipes.common.args import RecipeError, args_file_argv, extract_config, read_config  # noqa: E402
from recipes.common.help import effective_notes  # noqa: E402
from recipes.common.help import format_help as _format_help  # noqa: E402
from recipes.common.logs import time_left_callback  # noqa: E402
from recipes.common.model import base_model_id  # noqa: E402
from recipes.common.run import (check_privacy_settings, fingerprint, refuse_eval_overlap, model_sources,  # noqa: E402
                                push_folder, release_is_the_product, resume_argument, save_release)
from recipes.common.summary import summarize  # noqa: E402
from recipes.common.run import main as run_main  # noqa: E402
from recipes.glue_support.tasks import DataLoadingError  # noqa: E402

logger = logging.getLogger("hf_dp.recipes.dpo")

#: the chat template a tokenizer without one gets for conversational pairs: one "role: text" line per message, each
#: ended by the EOS token; the prompt rendered alone (with the generation prompt) is a prefix of prompt + answer
DEFAULT_CHAT_TEMPLATE = ("{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}{{ eos_token }}\n"
                         "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}")

# clm.py's defaults for LoRA on a causal LM (chosen on plain text, benchmarks/RESULTS.md §10b), with DPO's own batch
PROTOCOL_DEFAULTS: dict[str, Any] = {k: v for k, v in CLM_PROTOCOL_DEFAULTS.items() if k != "lm_loss_weighting"}  # TRL's own loss
#: DPO's default logical batch without a batch flag: ≈ N/125 units (16 per device at least: q ≈ 1/125; 2 epochs ≈
#: 250 steps), chosen on the tune split of benchmarks/dpo_experiment.py (RESULTS.md §14): clm.py's N/16 gave
#: 32 steps, after which DPO had barely moved the model even at ε = 50; 250 steps at lr 5e-4 scored best of the plans
#: tried. The reward model (--reward_model) keeps clm.py's N/16 (it scored better than B 16 on the tune split).
DPO_STEPS_PER_EPOCH = 125
#: DP DPO with one pair per unit trains 1 epoch (≈ 125 steps at B ≈ N/125) unless --num_train_epochs or --max_steps is
#: given; a unit column, --reward_model and --disable_dp keep clm.py's 2. On the tune split (RESULTS.md §14) 1 epoch
#: scored at least as well as 2 over 5 seeds (0.537 against 0.529 over 4), at half the steps and a smaller σ; the
#: gap is within the runs' spread (about 2.4 points per run), the compute is not.
ROW_DP_EPOCHS = 1.0
OPTIMIZER_DEFAULTS: dict[str, dict[str, float]] = {k: dict(v) for k, v in CLM_OPTIMIZER_DEFAULTS.items()}


@dataclass
class DpoScriptArguments(TrlScriptArguments):
    """TRL's dpo script's data flags, plus local files and the reward-model mode."""

    train_file: Optional[str] = field(default=None, metadata={"help": "json/jsonl/csv: prompt/chosen/rejected pairs"})
    validation_file: Optional[str] = field(default=None, metadata={"help": "Held-out pairs for the preference accuracy"})
    reward_model: bool = field(default=False, metadata={"help": "Train a reward model (a sequence classifier with one "
                                                               "output) on the pairs, as TRL's reward script, instead "
                                                               "of DPO"})


@dataclass
class DpoModelArguments(TrlModelArguments):
    """TRL's model flags that DP keeps (``--use_peft``) and run_clm's."""

    use_peft: bool = field(default=False, metadata={"help": "LoRA adapters (= --trainable lora, the recipe's default)"})


# ----------------------------------------------------------------------------------------------- arguments


def _reward_mode(argv: list[str]) -> bool:
    """``--reward_model`` on the command line, else in the config file (``--config FILE``, ``--config=FILE`` or the
    file alone): it chooses the config class."""
    config, argv = extract_config(args_file_argv(argv))
    for i, a in enumerate(argv):
        if a == "--reward_model":
            nxt = argv[i + 1] if i + 1 < len(argv) else ""
            return nxt.lower() not in ("false", "0", "no")
        if a.startswith("--reward_model="):
            return a.split("=", 1)[1].lower() not in ("false", "0", "no")
    return bool(config and read_config(config).get("reward_model", False))


def _config_class(reward: bool):
    def load():
        from hf_dp.dpo import DPDPOConfig, DPRewardConfig

        return DPRewardConfig if reward else DPDPOConfig
    return load


def make_parser(reward: bool = False):
    return trl_parser(DpoScriptArguments, DpoModelArguments, _config_class(reward))


def _run_name(peek) -> str:
    kind = "reward" if getattr(peek, "reward_model", False) else "dpo"
    name = peek.model_type or os.path.basename(os.path.normpath(peek.model_name_or_path or peek.config_name or "model"))
    return f"{kind}-{name}"


def parse_args(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None):
    """Parse ``argv``: recipe defaults < ``defaults`` < YAML ``--config`` < command line (recipes.common.args)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    reward = _reward_mode(argv)
    return parse_trl_args(argv, defaults, parser=make_parser(reward), protocol_defaults=PROTOCOL_DEFAULTS,
                          optimizer_defaults=OPTIMIZER_DEFAULTS, run_name=_run_name, format_help=format_help,
                          command_defaults=_command_defaults)


def _command_defaults(peek) -> dict[str, Any]:
    """:data:`ROW_DP_EPOCHS` for DP DPO with one pair per unit, unless a step budget (``--max_steps`` > 0) is given."""
    if (getattr(peek, "reward_model", False) or getattr(peek, "disable_dp", False)
            or getattr(peek, "privacy_unit_column", None) or getattr(peek, "max_steps", -1) > 0):
        return {}
    return {"num_train_epochs": ROW_DP_EPOCHS}


def format_help(parser, peek) -> str:
    """``--help``: the DP flags, the data and model flags, TRL's DPOConfig (RewardConfig) flags each marked with what it
    does under DP, then the essential training flags with the recipe's defaults for this command line."""
    from trl import DPOConfig, RewardConfig

    from hf_dp.dpo.config import DPO_FLAGS, REWARD_FLAGS, new_fields

    reward = bool(getattr(peek, "reward_model", False))
    notes = effective_notes(OPTIMIZER_DEFAULTS, {}, "runs/dpo-<model>-<optim>-eps<ε>")
    notes["learning_rate"] = ("(recipe default depends on --optim — " + ", ".join(
        f"{k} {v['learning_rate']:g}" for k, v in OPTIMIZER_DEFAULTS.items()) + "; clm.py's values for LoRA on a "
        "causal LM; dp_adamw's 5e-4 scored best with DPO's batch on the tune split, RESULTS.md §14)")
    notes["per_device_train_batch_size"] = (
        f"(recipe default: 16 pairs per device; with --epsilon and no batch flag, the accumulation that makes the "
        f"logical batch ≈ N/{LM_STEPS_PER_EPOCH if reward else DPO_STEPS_PER_EPOCH} units (at least one micro-batch), "
        "printed at start)")
    notes["num_train_epochs"] = ("(recipe default: 1 under DP with one pair per unit (≈ 125 steps at the planned batch, "
                                 "RESULTS.md §14); 2 with --privacy_unit_column, --reward_model or --disable_dp)")
    notes["privacy_unit_column"] = "(recipe default: each pair — prompt, chosen and rejected answers — is one unit)"
    title = f"TRL {'RewardConfig' if reward else 'DPOConfig'} ([DP: ...] = what the flag does under DP, docs/dpo.md)"
    fields = new_fields(RewardConfig if reward else DPOConfig)
    return _format_help(
        parser, peek, data_arguments=DpoScriptArguments, model_arguments=DpoModelArguments,
        data_title="data (as TRL's dpo script, plus --train_file / --validation_file / --reward_model)",
        model_title="model (as TRL's dpo script, plus run_clm's --model_type / --config_overrides)", notes=notes,
        extra_groups=[(title, fields, REWARD_FLAGS if reward else DPO_FLAGS)],
        usage="python recipes/dpo.py [--reward_model] [--config FILE.yaml] [flags]   |   python recipes/dpo.py --help-all",
        description="Differentially private preference tuning with TRL (DPO, or a reward model with --reward_model), "
                    "one preference pair = one example; see docs/dpo.md.")


# ----------------------------------------------------------------------------------------------- data


def _scored(rows) -> set[bytes]:
    """The sequences a DPO policy or a reward model scores in these pairs — prompt + chosen and prompt + rejected, as
    TRL joins them (text, or messages; the answer alone where the prompt is inside it) — each a digest of its
    :func:`recipes.common.run.comparable` form, so that a pair with its prompt inside its answers and the same pair with
    a prompt column are one."""
    cols = rows.column_names
    prompts = rows["prompt"] if "prompt" in cols else [None] * len(rows)
    return {fingerprint(_joined(p, a)) for col in ("chosen", "rejected") if col in cols
            for p, a in zip(prompts, rows[col])}


def _joined(prompt, answer):
    if prompt is None:
        return answer
    if isinstance(prompt, list) and isinstance(answer, list):
        return prompt + answer
    return f"{prompt}{answer}" if isinstance(prompt, str) and isinstance(answer, str) else [prompt, answer]


def pairs_in_training(train, dev) -> bool:
    """Whether a validation pair scores a sequence a training pair scores (its prompt with its chosen or its rejected
    answer, up to case, spacing and Unicode form): its preference accuracy and margin would then measure a trained
    sequence, so the evaluation is not held out. Only whether (a count is private)."""
    return bool(_scored(train) & _scored(dev))


def _check_columns(ds, what: str) -> str:
    cols = set(ds.column_names)
    if not {"chosen", "rejected"} <= cols:
        raise DataLoadingError(f"the {what} data needs 'chosen' and 'rejected' columns (and 'prompt', unless the "
                               f"prompt is inside them); it has {sorted(cols)}")
    return "conversational" if isinstance(ds[0]["chosen"], list) else "text"


def _refuse_training_pairs_as_validation(data_args: DpoScriptArguments) -> None:
    """The preference accuracy is a non-private number about the validation pairs: the training file (or split)
    itself is refused (as recipes/clm.py refuses it)."""
    a, b = data_args.train_file, data_args.validation_file
    if a and b and os.path.isfile(a) and os.path.isfile(b) and os.path.samefile(a, b):
        raise RecipeError(f"--validation_file {b} is the training file: its preference accuracy would be a non-private "
                          "statistic of the private training pairs; evaluate on public or held-out pairs")
    if not (a or b) and data_args.dataset_test_split == data_args.dataset_train_split:
        raise RecipeError(f"--dataset_test_split {data_args.dataset_test_split} is the training split: its preference "
                          "accuracy would be a non-private statistic of the private training pairs; evaluate on a "
                          "held-out split")


def _load_data(data_args: DpoScriptArguments, args):
    _refuse_training_pairs_as_validation(data_args)
    return load_trl_data(data_args, args, _check_columns)


def _build_model(reward: bool, clm_args, config, tokenizer, path):
    if not reward:
        return build_causal_lm(clm_args, config, tokenizer, path)
    import torch
    from transformers import AutoModelForSequenceClassification

    config.num_labels = 1
    if path is None:
        return AutoModelForSequenceClassification.from_config(config)
    return AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=torch.float32)


# ----------------------------------------------------------------------------------------------- run


def run(data_args: DpoScriptArguments, model_args: DpoModelArguments, args) -> dict[str, Any]:
    """Load the pairs and the model, train with DP, evaluate, save, push; return the summary dict."""
    import transformers

    from hf_dp.dpo import DPDPOTrainer, DPRewardTrainer

    start = time.perf_counter()
    transformers.set_seed(args.seed)
    reward = data_args.reward_model
    train, dev, kind = _load_data(data_args, args)
    resume = resume_argument(args, model_sources(model_args))
    n_units = count_trl_units(train, args)
    check_privacy_settings(args, n_units)  # δ < 1/N, B ≤ N, σ calibratable: before the model and TRL's preparation
    overlap = refuse_eval_overlap(args, dev is not None and pairs_in_training(train, dev), "pairs")
    clm_args, config, tokenizer, path = load_trl_config_and_tokenizer(model_args, args)
    if kind == "conversational" and getattr(tokenizer, "chat_template", None) is None:
        tokenizer.chat_template = DEFAULT_CHAT_TEMPLATE
        print("chat template: the tokenizer has none, and conversational pairs need one: using the recipe's default "
              "(recipes/dpo.py DEFAULT_CHAT_TEMPLATE): one 'role: text' line per message", flush=True)
    model = _build_model(reward, clm_args, config, tokenizer, path)
    if reward:  # ≈ N/16 units when no batch flag is given (clm.py's setting)
        planned = lm_batch_plan(args, n_units, source="clm.py's setting for LoRA on a causal LM, reused for the reward "
                                "model (it scored better than B 16 on a public tune split, benchmarks/RESULTS.md §14)")
    else:  # ≈ N/125 units (DPO_STEPS_PER_EPOCH)
        planned = lm_batch_plan(args, n_units, steps_per_epoch=DPO_STEPS_PER_EPOCH,
                                source="the recipe's setting for DPO, chosen on a public tune split (benchmarks/RESULTS.md §14)")
    if planned:
        print(planned, flush=True)
        check_privacy_settings(args, n_units)
    push = bool(args.push_to_hub)
    args.push_to_hub = False
    with verdict_scope(model_args):
        cls = DPRewardTrainer if reward else DPDPOTrainer
        trainer = cls(model=model, args=args, train_dataset=train, eval_dataset=dev, processing_class=tokenizer)
    release_is_the_product(trainer)
    trainer.add_callback(time_left_callback())
    trainer.base_model_id = base_model_id(model_args.model_name_or_path) if model_args.model_name_or_path else None
    # the card: the user's own columns, not TRL's tokenized ones
    trainer.dataset_name = None if data_args.train_file else data_args.dataset_name
    trainer.data_description = (f"{kind} preference pairs from {'local files' if data_args.train_file else 'the dataset'}"
                                f" (columns {', '.join(f'`{c}`' for c in train.column_names)})")
    # without DP an evaluation that scores trained sequences is not called held-out (the card says so); how many is not
    # said; under DP it was refused before the model was loaded
    trainer.eval_overlap = overlap
    if overlap:
        logger.warning("some validation pairs also occur in the training data: the preference accuracy on them is not a "
                       "held-out metric, and not a private one (the card says so); evaluate on pairs disjoint from the "
                       "training data")
    trainer.train(resume_from_checkpoint=resume)
    metrics = trainer.evaluate() if dev is not None else {}
    accuracy = metrics.get("eval_accuracy" if reward else "eval_rewards/accuracies")
    margin = metrics.get("eval_margin" if reward else "eval_rewards/margins")
    if accuracy is not None:
        what = "reward" if reward else "implicit reward (β·log π/π_ref)"
        pairs = ("validation pairs, some of them training pairs (not held out)," if overlap
                 else f"{len(dev)} held-out pairs")
        print(f"preference accuracy = {accuracy:.4f} (the share of {pairs} whose {what} prefers the chosen answer), "
              f"mean margin {margin:.4g}", flush=True)
    out = save_release(trainer, args)
    pushed = push_folder(out, args) if push and trainer.is_world_process_zero() else None
    report = trainer.privacy_report()
    unit = report.get("privacy_unit") or {}
    task = (f"{'reward modelling' if reward else 'DPO'} on preference pairs ({kind}; "
            f"{unit.get('description', 'one pair = one unit') if args.dp_enabled else 'non-private baseline'})")
    metrics = {**metrics, "eval_preference_accuracy": accuracy} if accuracy is not None else metrics
    summary = summarize(task, args, report, "preference_accuracy", metrics, None, start, out, pushed,
                        extra_rows=[("validation mean margin" if overlap else "held-out mean margin", margin)]
                        if margin is not None else ())
    return summary


def main(argv: Optional[list[str]] = None, defaults: Optional[dict[str, Any]] = None) -> int:
    """Entry point; returns the process exit code (0 ok, 2 for usage/data/model errors, 3 when the push failed)."""
    return run_main(parse_args, run, argv, defaults, user_errors=(DataLoadingError,))


if __name__ == "__main__":
    sys.exit(main())
