"""A recipe's ``--help``: hf_dp's DP flags first, then data, model and the essential training flags with the recipe's
effective defaults for this command line, then the other ``TrainingArguments`` flags, each marked with what it does
under DP (from the registry ``hf_dp/flags.py``)."""

from __future__ import annotations

from typing import Any, Iterable, Optional, Sequence

# HF flags whose values are DP choices: shown in the DP group, at the top (with every DPTrainingArguments field, read
# from the dataclass: flags other work adds appear there without being listed here)
DP_GROUP_HF_FLAGS = ("optim", "optim_args")

# the HF flags a recipe user sets most, shown in their own group right after the DP, data and model groups
TRAINING_ESSENTIALS = ("output_dir", "optim", "learning_rate", "lr_scheduler_type", "warmup_steps", "weight_decay",
                       "per_device_train_batch_size", "gradient_accumulation_steps", "num_train_epochs", "max_steps",
                       "seed", "do_train", "do_eval", "do_predict", "save_strategy", "save_steps",
                       "resume_from_checkpoint", "push_to_hub", "hub_model_id", "disable_tqdm")


#: flags whose transformers help text says what they do in a plain Trainer, not in a recipe: the recipe's meaning
RECIPE_HELP = {
    "push_to_hub": "After training, upload the release folder <output_dir>/release (the model with LoRA merged, the "
                   "tokenizer, the model card and privacy.json; no checkpoints, no run records) to the Hub repo "
                   "--hub_model_id. The model is saved first: if the push fails "
                   "(offline, no token, no network) the run ends with one error line holding the command that pushes "
                   "the saved folder later, exit code 3. Nothing is pushed during training (the recipe ignores "
                   "--hub_strategy)",
    "hub_model_id": "The Hub repo (user/name) --push_to_hub uploads the release folder to (default: the name of the "
                    "--output_dir folder)",
}


def effective_notes(optimizer_defaults: dict[str, dict[str, float]], planned_lr: dict[str, float],
                    output_dir_pattern: str) -> dict[str, str]:
    """The notes appended to flags whose recipe default depends on the command line."""
    return {
        "output_dir": f"(recipe default: {output_dir_pattern}, shown for this command line)",
        "learning_rate": "(recipe default depends on --optim — " + ", ".join(
            f"{k} {v['learning_rate']:g}" for k, v in optimizer_defaults.items()) + "; shown for this command line. "
            "When the planner chooses the batch: " + ", ".join(f"{k} {v:g}" for k, v in planned_lr.items()) + ")",
        "lr_scheduler_type": "(recipe default: constant, no warm-up — the schedule the recipe's learning rates were "
                             "chosen with; HF's default is a linear decay)",
        "weight_decay": "(recipe default depends on --optim — " + ", ".join(
            f"{k} {v['weight_decay']:g}" for k, v in optimizer_defaults.items()) + "; shown for this command line)",
        "per_device_train_batch_size": "(with --epsilon and neither the batch size nor the accumulation given, the "
                                       "planner chooses the logical batch; see recipes/README.md)",
        "num_train_epochs": "(the compute budget at which the planner chooses the batch when no batch size is given; "
                            "so is --max_steps)",
        "cache_frozen_features": "(recipe default: True for --trainable last_block, last_k:K and head, else False)",
        "train_sampling_strategy": "(recipe default with DP: group_by_length — each Poisson draw ordered by length "
                                   "before it is cut into micro-batches; same draws and noise, less padding)",
    }


def format_help(parser, peek, *, data_arguments: type, model_arguments: type, data_title: str, model_title: str,
                notes: dict[str, str], usage: str, description: str,
                extra_groups: Sequence[tuple[str, Iterable[str], Optional[dict]]] = ()) -> str:
    """The help text of ``parser`` (an ``HfArgumentParser`` over ``model_arguments``, ``data_arguments`` and
    ``DPTrainingArguments``, its defaults already set for this command line; ``peek``: the arguments parsed so far),
    regrouped: DP, data, model, the ``extra_groups``, recipe (``--config``), essential training flags, other
    ``TrainingArguments`` flags. ``extra_groups``: ``(title, flag names, registry)`` — flags of their own group (e.g.
    glue.py's ``--tune*``, TRL's ``SFTConfig`` flags), each marked from ``registry`` (the format of
    :data:`hf_dp.flags.FLAGS`; None: unmarked) with what it does under DP."""
    import argparse
    import dataclasses

    from transformers import TrainingArguments

    from hf_dp import DPTrainingArguments
    from hf_dp.flags import help_note

    hf_names = {f.name for f in dataclasses.fields(TrainingArguments)}
    dp_names = {f.name for f in dataclasses.fields(DPTrainingArguments)} - hf_names
    groups: dict[str, Any] = {
        "dp": parser.add_argument_group("hf_dp: differential privacy and speed"),
        "data": parser.add_argument_group(data_title),
        "model": parser.add_argument_group(model_title),
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
    groups["recipe"].add_argument("--overwrite_output_dir", action="store_true",
                                  help="start a new run in an --output_dir that holds an earlier run: its checkpoints, "
                                  "hf_dp records and release are deleted first (run_clm's flag; transformers 5 dropped "
                                  "it from TrainingArguments); refused, before anything is deleted, when the model, config "
                                  "or tokenizer folder lies inside it. Without it such a folder is refused, or resumed "
                                  "with --resume_from_checkpoint True")
    extra = {}  # flag name -> (its group's key, its registry)
    for i, (title, names, registry) in enumerate(extra_groups):
        groups[f"extra{i}"] = parser.add_argument_group(title)
        extra.update({n: (f"extra{i}", registry) for n in names})
    data_names = {f.name for f in dataclasses.fields(data_arguments)}
    model_names = {f.name for f in dataclasses.fields(model_arguments)}
    for action in list(parser._actions):
        if isinstance(action, argparse._HelpAction) or action.dest == "config":
            continue
        name = action.dest
        registry = None
        if name in extra:
            key, registry = extra[name]
        elif name in dp_names or name in DP_GROUP_HF_FLAGS:
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
        if name in RECIPE_HELP:  # transformers' text says what a plain Trainer does: the recipe's meaning instead
            action.help = RECIPE_HELP[name]
        extra_notes = [notes.get(name)]
        if getattr(peek, "disable_dp", False) is False:
            if registry is not None:
                extra_notes.append(help_note(name, registry))
            elif name in hf_names:
                extra_notes.append(help_note(name))
        note = " ".join(n for n in extra_notes if n).replace("%", "%%")  # argparse formats help with %
        if note:
            action.help = f"{action.help or ''} {note}".strip()
    if not getattr(parser, "_hf_dp_help_all", False):  # --help: the recipe's flags; --help-all: HF's others too
        hidden = len(groups["hf"]._group_actions)
        for action in groups["hf"]._group_actions:
            parser._actions.remove(action)
        groups["hf"]._group_actions.clear()
        groups["hf"].description = (
            f"{hidden} more transformers TrainingArguments flags (logging, evaluation, saving, hardware, Hub, …) work "
            "as in transformers, each marked with what it does under DP: see them with --help-all, or "
            "docs/privacy_flags.md")
        groups["hf"].title = "other transformers TrainingArguments (not shown)"
    order = [groups[k] for k in ("dp", "data", "model", *(f"extra{i}" for i in range(len(extra_groups))), "recipe",
                                 "train", "hf")]
    parser._action_groups = order + [g for g in parser._action_groups if g not in order and g._group_actions]
    parser._action_groups = [g for g in parser._action_groups if g._group_actions or g.description]
    parser.usage = usage
    parser.description = description
    return parser.format_help()
