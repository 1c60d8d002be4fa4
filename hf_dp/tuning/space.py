"""The search space of a private selection (:mod:`hf_dp.tuning.search`) and the law of its number of trials.

The space: ``--tune "name=v1,v2;name=v1,v2"`` (:func:`parse_space`), a dict ``{flag: [choices]}``, or an optuna-style
function ``trial -> dict`` (:class:`Trial`: every choice uniform, from the trial's own generator); the values typed as
the flag (:func:`draw_configuration`). It may hold flags that do not change the mechanism's q, steps, δ or unit
(learning rate, C, weight decay, warm-up, the rule's flags, ...); a flag that does is refused
(:data:`FIXED_BY_THE_MECHANISM`). The number of trials K: :func:`trial_count` (its law,
:class:`~hf_dp.privacy.selection.TrialCount`).
"""

from __future__ import annotations

import math
import random
import re

from hf_dp.privacy.selection import DISTRIBUTIONS, TrialCount

#: flags a search space may not hold: they define the mechanism (q, steps, δ, the unit), its randomness or the run
FIXED_BY_THE_MECHANISM = (
    "epsilon", "noise_multiplier", "delta", "accountant", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_train_epochs", "max_steps", "privacy_unit_column", "max_rows_per_unit", "public_dataset_size", "dp_seed",
    "secure_rng", "seed",
    "disable_dp", "prior_privacy", "audit_canaries", "output_dir", "resume_from_checkpoint", "save_strategy",
    "load_best_model_at_end", "report_to", "push_to_hub", "optim",
)
_NAME = re.compile(r"^[A-Za-z_]\w*$")


def parse_space(text: str) -> dict[str, list[str]]:
    """``"learning_rate=1e-3,3e-3;per_sample_max_grad_norm=0.1,0.3"`` -> ``{name: [value strings]}``: flags separated
    by ``;``, each ``name=v1,v2,...`` (the values are typed by :func:`typed_space`)."""
    if not isinstance(text, str) or not text.strip():
        raise ValueError("the search space is empty: give --tune \"name=v1,v2;name=v1,v2\" (e.g. "
                         "\"learning_rate=1e-3,3e-3,1e-2;per_sample_max_grad_norm=0.1,0.3\")")
    space: dict[str, list[str]] = {}
    for part in text.split(";"):
        if not part.strip():
            continue
        name, eq, values = part.partition("=")
        name = name.strip()
        choices = [v.strip() for v in values.split(",")]
        if not eq or not _NAME.match(name) or not choices or any(not v for v in choices):
            raise ValueError(f"cannot read the search space entry {part.strip()!r}: write name=v1,v2 (entries separated "
                             "by ';', values by ',', no empty value)")
        if name in space:
            raise ValueError(f"the search space names {name} twice")
        space[name] = choices
    if not space:
        raise ValueError("the search space is empty: give --tune \"name=v1,v2;name=v1,v2\"")
    return space


def _coerce(args, name: str, value):
    """``value`` (a string from the command line, or a Python value) as the type of ``args.name``."""
    current = getattr(args, name)
    if not isinstance(value, str) or isinstance(current, str) or current is None and not _numeric(value):
        return value
    if isinstance(current, bool):
        if value.lower() in ("true", "1", "yes"):
            return True
        if value.lower() in ("false", "0", "no"):
            return False
        raise ValueError(f"--{name} takes true/false in the search space, got {value!r}")
    try:
        if isinstance(current, int) and re.fullmatch(r"[+-]?\d+", value):
            return int(value)
        return float(value)
    except ValueError:
        raise ValueError(f"--{name} takes numbers in the search space, got {value!r}") from None


def _numeric(value: str) -> bool:
    try:
        float(value)
        return True
    except ValueError:
        return False


def check_space_names(args, names) -> None:
    """Refuse a name that is not a flag of ``args``, or one that defines the mechanism."""
    for name in names:
        if name in FIXED_BY_THE_MECHANISM:
            raise ValueError(f"the search space may not hold --{name}: it defines the mechanism (q, steps, delta, the "
                             "unit, the randomness) or the run, which the selection's calibration fixes for every "
                             "trial; tune learning_rate, per_sample_max_grad_norm, weight_decay, warmup, ... instead")
        if not hasattr(args, name) or name.startswith("_"):
            raise ValueError(f"the search space names {name}, which is not a training flag")


class Trial:
    """What an ``hp_space`` function receives (optuna's ``suggest_*`` convention, as HF's ``hp_space`` functions use):
    every choice uniform, from this trial's own random generator."""

    def __init__(self, number: int, rng: random.Random):
        self.number, self._rng, self.params = number, rng, {}

    def suggest_categorical(self, name, choices):
        choices = list(choices)
        if not choices:
            raise ValueError(f"the search space gives {name} no choice")
        self.params[name] = choices[self._rng.randrange(len(choices))]
        return self.params[name]

    def suggest_float(self, name, low, high, *, log=False, step=None):
        if not (math.isfinite(low) and math.isfinite(high)) or low > high or (log and low <= 0):
            raise ValueError(f"the search space gives {name} the range [{low}, {high}] (log={log})")
        if step:
            value = low + step * self._rng.randrange(int(math.floor((high - low) / step)) + 1)
        elif log:
            value = math.exp(self._rng.uniform(math.log(low), math.log(high)))
        else:
            value = self._rng.uniform(low, high)
        self.params[name] = float(value)
        return self.params[name]

    def suggest_int(self, name, low, high, *, step=1, log=False):
        if log:
            value = int(round(math.exp(self._rng.uniform(math.log(low), math.log(high)))))
        else:
            value = low + step * self._rng.randrange((high - low) // step + 1)
        self.params[name] = int(min(max(value, low), high))
        return self.params[name]


def draw_configuration(hp_space, trial: Trial, args) -> dict:
    """The configuration of one trial: ``hp_space(trial)`` (a function, HF's convention) or one uniform choice per
    entry of a dict ``{name: [choices]}`` (strings are typed as the flag)."""
    if callable(hp_space):
        params = hp_space(trial)
        if not isinstance(params, dict):
            raise ValueError("hp_space(trial) must return a dict {flag: value}")
    else:
        params = {name: trial.suggest_categorical(name, choices) for name, choices in hp_space.items()}
    params = {name: _coerce(args, name, value) for name, value in params.items()}
    check_space_names(args, params)
    return params


def describe_space(hp_space) -> dict | str:
    if callable(hp_space):
        return f"function {getattr(hp_space, '__qualname__', repr(hp_space))} (optuna-style suggest_* calls)"
    return {k: list(v) for k, v in hp_space.items()}


def check_space(hp_space, args) -> None:
    if callable(hp_space):
        return
    if not isinstance(hp_space, dict) or not hp_space:
        raise ValueError("the search space is empty: give hp_space={flag: [choices]} or a function trial -> dict")
    for name, choices in hp_space.items():
        if isinstance(choices, (str, bytes)) or not hasattr(choices, "__len__") or len(choices) == 0:
            raise ValueError(f"the search space entry {name} must be a non-empty list of choices, got {choices!r}")
    check_space_names(args, hp_space)
    for name, choices in hp_space.items():
        for value in choices:
            _coerce(args, name, value)


def trial_count(distribution, n_trials, eta=None) -> TrialCount:
    if isinstance(distribution, TrialCount):
        return distribution
    name = str(distribution or "geometric")
    if ":" in name:  # "negative_binomial:0.5"
        name, _, shape = name.partition(":")
        try:
            eta = float(shape)
        except ValueError:
            raise ValueError(f"cannot read the shape in {distribution!r}: write negative_binomial:ETA") from None
    if name not in DISTRIBUTIONS:
        raise ValueError(f"the distribution of the number of trials must be one of {', '.join(sorted(DISTRIBUTIONS))}, "
                         f"got {name!r}")
    if isinstance(n_trials, bool) or not isinstance(n_trials, (int, float)):
        raise ValueError(f"n_trials (the expected number of trials) must be a number >= 1, got {n_trials!r}")
    return TrialCount(name, float(n_trials), eta)
