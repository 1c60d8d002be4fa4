"""A recipe's command line: layered defaults, ``--config`` files, args files, and which flags the user set.

Layers, lowest first: the recipe's protocol defaults < a preset (e.g. ``recipes/qnli.py``'s ``task_name``) < a YAML
(or JSON) ``--config`` file < the command line. A single ``args.json`` / ``args.yaml`` argument is ``--config`` of
that file (run_glue's ``python run_glue.py args.json``). On top of the layers, defaults that depend on other flags
(output folder, per-optimizer learning rate and weight decay, the frozen-prefix cache, length grouping) are filled in
only where the user set nothing: :func:`parse_layered`. The flags the user set are recorded on the training
arguments as ``_hf_dp_explicit`` (the planner needs them).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any, Callable, Optional

import yaml

ARGS_FILE_SUFFIXES = (".json", ".yaml", ".yml")


class RecipeError(ValueError):
    """A user-facing configuration problem: printed without a traceback, exit code 2."""


def args_file_argv(argv: list[str]) -> list[str]:
    """run_glue's ``python run_glue.py args.json``: a lone .json/.yaml argument is the arguments (``--config FILE``)."""
    if len(argv) == 1 and argv[0].lower().endswith(ARGS_FILE_SUFFIXES) and not argv[0].startswith("-"):
        return ["--config", argv[0]]
    return argv


def extract_config(argv: list[str]) -> tuple[Optional[str], list[str]]:
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


#: run_clm's / run_glue's ``--overwrite_output_dir`` (transformers 5 removed it from ``TrainingArguments``): a recipe flag
OVERWRITE_FLAG = "--overwrite_output_dir"
_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")


def _truth(flag: str, value) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE or text in _FALSE:
        return text in _TRUE
    raise RecipeError(f"{flag} takes true or false, not {value!r}")


def extract_overwrite(argv: list[str]) -> tuple[Optional[bool], list[str]]:
    """Remove ``--overwrite_output_dir [true|false]`` / ``--overwrite_output_dir=…`` from argv: ``(value or None when
    absent, the other arguments)``. transformers 5's ``TrainingArguments`` no longer has the flag that most run_clm and
    run_glue commands carry; the recipes keep its meaning (:func:`recipes.common.run.resume_argument`)."""
    out, value, i = [], None, 0
    while i < len(argv):
        a = argv[i]
        if a == OVERWRITE_FLAG:
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            if nxt is not None and nxt.strip().lower() in _TRUE + _FALSE:
                value, i = _truth(OVERWRITE_FLAG, nxt), i + 2
            else:
                value, i = True, i + 1
            continue
        if a.startswith(OVERWRITE_FLAG + "="):
            value, i = _truth(OVERWRITE_FLAG, a.split("=", 1)[1]), i + 1
            continue
        out.append(a)
        i += 1
    return value, out


def read_config(path: str) -> dict[str, Any]:
    """The flag values of a ``--config`` file: YAML, or JSON for a ``.json`` file."""
    if not os.path.isfile(path):
        raise RecipeError(f"config file {path} does not exist")
    with open(path, encoding="utf-8") as f:
        if path.lower().endswith(".json"):
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


def explicit_dests(parser, argv: list[str]) -> set[str]:
    """The dataclass fields whose flag appears on the command line."""
    given = set()
    for action in parser._actions:
        for opt in action.option_strings:
            if any(a == opt or a.startswith(opt + "=") for a in argv):
                given.add(action.dest)
    return given


def optim_name(optim) -> str:
    return str(getattr(optim, "value", optim))


def optim_variant(optim_args) -> str:
    """The ``variant=`` of ``--optim_args`` (``paper`` when none is given)."""
    for item in str(optim_args or "").replace(" ", "").split(","):
        key, _, value = item.partition("=")
        if key == "variant":
            return value
    return "paper"


def dp_family(name: str, optimizer_defaults: dict[str, Any]) -> str:
    """The DP optimizer whose recipe defaults an HF optimizer's baseline uses (the name itself for DP optimizers)."""
    if name in optimizer_defaults:
        return name
    if name.startswith("adamw"):
        return "dp_adamw"
    if name.startswith("sgd"):
        return "dp_sgd"
    return name


def cacheable(trainable) -> bool:
    """Whether the recipe caches the frozen prefix of this --trainable mode by default (unless --cache_frozen_features
    false): where a prefix stays frozen (``hf_dp.models.suffix_blocks``)."""
    from hf_dp.models import suffix_blocks

    try:
        return suffix_blocks(trainable) is not None
    except ValueError:
        return False  # an invalid mode is refused with its own error when the arguments are checked


#: the batch itself: giving either keeps the batch the user chose; giving neither lets the planner choose it
#: (recipes.common.run.apply_plan). --num_train_epochs and --max_steps are not among them: they are the compute budget
#: the planner chooses the batch for
PLANNER_KEYS = frozenset({"per_device_train_batch_size", "gradient_accumulation_steps"})


def _planner_help_defaults(parser, peek, explicit: set, planned_lr: dict[str, float]) -> None:
    """For ``--help``: when the planner will choose the batch (a DP run with --epsilon, none of :data:`PLANNER_KEYS`
    given), the batch flags' default is the planner's and the learning rate the planned one, as the run will use."""
    if getattr(peek, "disable_dp", False) or getattr(peek, "epsilon", None) is None or PLANNER_KEYS & explicit:
        return
    parser.set_defaults(per_device_train_batch_size="the planner's, printed at start",
                        gradient_accumulation_steps="the planner's, printed at start")
    optim = optim_name(peek.optim)
    if "learning_rate" not in explicit and optim in planned_lr:
        parser.set_defaults(learning_rate=planned_lr[optim])


def parse_layered(
    argv: Optional[list[str]],
    defaults: Optional[dict[str, Any]],
    *,
    parser,
    protocol_defaults: dict[str, Any],
    optimizer_defaults: dict[str, dict[str, Any]],
    run_name: Callable[[Any], str],
    format_help: Callable[[Any, Any], str],
    cache_frozen_by_default: bool = True,
    planned_lr: Optional[dict[str, float]] = None,
    unit_optimizer_defaults: Optional[dict[str, dict[str, Any]]] = None,
    command_defaults: Optional[Callable[[Any], dict[str, Any]]] = None,
):
    """Parse ``argv`` (``sys.argv[1:]`` if None) with ``parser`` (an ``HfArgumentParser`` whose last dataclass is
    ``DPTrainingArguments``): ``protocol_defaults`` < ``defaults`` < YAML ``--config`` < command line, then the
    dependent defaults. ``run_name(peek)`` names the default output folder ``runs/<run_name>-<optim>-eps<ε>``;
    ``format_help(parser, peek)`` is printed for ``--help`` (after every default is in place, so that it shows the
    values this command line would use). ``cache_frozen_by_default=False``: a recipe whose runs cannot use the
    frozen-prefix cache (e.g. one that always trains with a privacy unit column) leaves ``--cache_frozen_features`` at
    its default. ``unit_optimizer_defaults``: per optimizer, the values that replace ``optimizer_defaults``' (and any
    other default, e.g. the schedule) when ``--privacy_unit_column`` is given, for the keys the user did not set.
    Returns the parsed dataclasses."""
    argv = list(sys.argv[1:] if argv is None else argv)
    argv = args_file_argv(argv)
    want_help = any(a in ("-h", "--help", "--help-all") for a in argv)
    parser._hf_dp_help_all = "--help-all" in argv  # --help shows the recipe's flags; --help-all every HF flag too
    argv = [a for a in argv if a not in ("-h", "--help", "--help-all")]
    config_path, argv = extract_config(argv)
    overwrite, argv = extract_overwrite(argv)
    dests = {a.dest for a in parser._actions}
    layered: dict[str, Any] = {k: v for k, v in protocol_defaults.items() if k in dests}
    layered.update(defaults or {})
    yaml_values = read_config(config_path) if config_path else {}
    if "overwrite_output_dir" in yaml_values:
        yaml_overwrite = _truth("overwrite_output_dir", yaml_values.pop("overwrite_output_dir"))
        overwrite = yaml_overwrite if overwrite is None else overwrite
    unknown = sorted(set(yaml_values) - dests)
    if unknown:
        raise RecipeError(f"{config_path}: unknown option(s) {unknown}; use the command-line flag names")
    layered.update(yaml_values)
    # a recipe's preset (qnli.py) counts as set, except its epochs: the planner reports them as the recipe's compute
    # budget, not the user's (it chooses the batch whenever none of PLANNER_KEYS is given: recipes.common.run.apply_plan)
    explicit = set(yaml_values) | explicit_dests(parser, argv) | (set(defaults or {}) - {"num_train_epochs"})
    # HF's meaning of a batch size: B = per_device_train_batch_size × world size (× --gradient_accumulation_steps when
    # given). A recipe default of several accumulation steps goes with the recipe's own per-device batch only: it
    # must not silently multiply the batch the user asked for (clm.py's 8 × 4)
    if "per_device_train_batch_size" in explicit and "gradient_accumulation_steps" not in explicit:
        layered["gradient_accumulation_steps"] = 1

    # --noise_multiplier replaces the protocol's default target epsilon (exactly one of the two is allowed)
    if "noise_multiplier" in explicit and "epsilon" not in explicit and "epsilon" in layered:
        layered["epsilon"] = None
    # output_dir default depends on task/optimizer: peek at them first
    parser.set_defaults(**layered)
    peek, _ = parser.parse_known_args(argv)
    if "output_dir" not in explicit:
        eps = getattr(peek, "epsilon", None)
        tag = f"eps{eps:g}" if isinstance(eps, (int, float)) else "dp"
        layered["output_dir"] = os.path.join("runs", f"{run_name(peek)}-{optim_name(peek.optim)}-{tag}")
        parser.set_defaults(output_dir=layered["output_dir"])
    # γ: the protocol's 1e-8 is seed 000's *paper* value; a variant reproducing other code (--optim_args
    # variant=adam_corr) keeps its own γ (1e-10 in the authors' adam_corr.py) unless --bc_gamma is given
    if "bc_gamma" not in explicit and optim_variant(getattr(peek, "optim_args", None)) != "paper":
        parser.set_defaults(bc_gamma=None)
    # per-optimizer lr / weight decay unless given; a --disable_dp baseline with an HF optimizer takes the defaults of
    # the DP optimizer of its family (adamw_* -> dp_adamw, sgd -> dp_sgd), so that the comparison means something;
    # with a unit column (several rows per unit: fewer, larger units than rows) a recipe's own values replace them
    # where it measured them (clm.py: benchmarks/RESULTS.md §10e)
    family = dp_family(optim_name(peek.optim), optimizer_defaults)
    chosen = dict(optimizer_defaults.get(family, {}))
    if getattr(peek, "privacy_unit_column", None):
        chosen.update((unit_optimizer_defaults or {}).get(family, {}))
    for key, value in chosen.items():
        if key not in explicit:
            parser.set_defaults(**{key: value})
    # a recipe's defaults that depend on this command line (recipes/dpo.py: 1 epoch for DP DPO with one pair per unit),
    # below what the user, a caller's preset and the config file give; --help shows them
    for key, value in (command_defaults(peek) if command_defaults else {}).items():
        if key not in explicit and key not in (defaults or {}):
            parser.set_defaults(**{key: value})
    # the frozen prefix is cached when it can be (last_block, last_k:K, head: hf_dp.models.suffix_blocks): the same
    # per-example gradients, minutes instead of an hour on CPU (benchmarks/RESULTS.md §3); the prefix then runs once in
    # eval mode. --cache_frozen_features false: off. Not under --fsdp (the cache is built with the full model on one rank)
    # nor with --privacy_unit_column (the cache does not keep the unit column; DPTrainer refuses the pair)
    if (cache_frozen_by_default and "cache_frozen_features" not in explicit and cacheable(getattr(peek, "trainable", None))
            and not getattr(peek, "fsdp", None) and not getattr(peek, "privacy_unit_column", None)):
        parser.set_defaults(cache_frozen_features=True)
    # under DP, each Poisson draw is ordered by length before it is cut into micro-batches: the same draws, clipped sum
    # and noise, less padding (benchmarks/RESULTS.md §1(d)). Not for --disable_dp: there HF's group_by_length sampler
    # changes which examples share a batch. --train_sampling_strategy random: off
    if "train_sampling_strategy" not in explicit and not getattr(peek, "disable_dp", False):
        parser.set_defaults(train_sampling_strategy="group_by_length")
    # pinned memory only where batches go to an accelerator (torch warns at every data loader otherwise)
    if "dataloader_pin_memory" not in explicit:
        from .logs import pin_memory_default

        parser.set_defaults(dataloader_pin_memory=pin_memory_default())
    # HF's meaning: --save_steps N saves every N steps (HF's default strategy is "steps"; the recipe's is "no")
    if "save_steps" in explicit and "save_strategy" not in explicit:
        parser.set_defaults(save_strategy="steps")
    if want_help and planned_lr is not None:
        _planner_help_defaults(parser, peek, explicit, planned_lr)
    if want_help:  # after every default above is in place: --help shows the values this command line would use
        print(format_help(parser, peek))
        raise SystemExit(0)
    try:
        *others, training_args = parser.parse_args_into_dataclasses(args=argv)
    except ValueError as exc:  # e.g. DPTrainingArguments' own checks
        raise RecipeError(str(exc)) from None
    training_args._hf_dp_explicit = frozenset(explicit)  # which flags the user set (the planner needs it)
    training_args._hf_dp_overwrite_output_dir = bool(overwrite)  # --overwrite_output_dir (recipes.common.run)
    return (*others, training_args)
