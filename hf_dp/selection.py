"""Private hyper-parameter selection: ``DPTrainer.hyperparameter_search(backend="dp_random_stopping")``.

The best of a random number K of full DP runs is released, and the reported ε is the **total** of the selection
(Papernot & Steinke 2022; the accounting, the theorems and why K stays secret: :mod:`hf_dp.privacy.selection`):

1. K is drawn from a distribution fixed in advance (``distribution``: ``geometric`` (default), ``logarithmic``,
   ``negative_binomial`` with ``eta``, ``poisson``; mean ``n_trials``), from OS entropy (``--dp_seed``: from the seed).
2. The per-trial σ is calibrated (for the run's q and steps) so that the selection's total ε at δ is ≤ ``--epsilon``.
3. Each trial is a fresh DP run: a new model from ``model_init``, a new trainer with the configuration drawn
   (uniformly, with fresh randomness) from ``hp_space``, ``--noise_multiplier`` = that σ, new Poisson draws and noise
   (OS entropy; under ``--dp_seed`` each trial's streams are keyed by a seed of its own), a different HF ``seed``,
   its files in a temporary folder that is deleted, no tracker (``report_to`` none), no checkpoint.
4. Its score is ``compute_objective(trainer.evaluate())`` on the eval set, which the caller must declare public
   (``score_data="public"``): its choice of model is then post-processing for the training data. A score on held-out
   *private* data would need a DP score whose cost enters the total; that is not implemented and refused.
5. The trainer then holds the best trial's model (what ``save_model`` writes), its ledger and configuration; its
   ``get_epsilon()`` and ``privacy.json`` report the total, with a ``hyperparameter_selection`` record. It refuses to
   ``train()`` again, and a new DPTrainer on the released model refuses to continue its ledger (the selection's cost
   is not a (σ, q, steps) history the ledger can compose; :func:`hf_dp.lineage.adopt_model_ledger`).

What the search space may hold: flags that do not change the mechanism's q, steps, δ or unit (learning rate, C,
weight decay, warm-up, the rule's flags, ...); a flag that does is refused (:data:`FIXED_BY_THE_MECHANISM`).

Tuning on private data *without* this path (several ``train()`` runs compared by hand, or ``load_best_model_at_end``
on private eval data) stays possible and is labelled outside the guarantee, as ``model_selection`` says.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import random
import re
import secrets
import shutil
import tempfile
import weakref

from hf_dp.privacy.randomness import mix
from hf_dp.privacy.selection import DISTRIBUTIONS, TrialCount, calibrate_selection_sigma

logger = logging.getLogger(__name__)

BACKEND = "dp_random_stopping"
SCORE_DATA = ("public", "private")

#: flags a search space may not hold: they define the mechanism (q, steps, δ, the unit), its randomness or the run
FIXED_BY_THE_MECHANISM = (
    "epsilon", "noise_multiplier", "delta", "accountant", "per_device_train_batch_size", "gradient_accumulation_steps",
    "num_train_epochs", "max_steps", "privacy_unit_column", "max_rows_per_unit", "dp_seed", "secure_rng", "seed",
    "disable_dp", "prior_privacy", "audit_canaries", "output_dir", "resume_from_checkpoint", "save_strategy",
    "load_best_model_at_end", "report_to", "push_to_hub", "optim",
)
_NAME = re.compile(r"^[A-Za-z_]\w*$")


# ---------------------------------------------------------------------------------------------------
# the search space
# ---------------------------------------------------------------------------------------------------
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


def _describe_space(hp_space) -> dict | str:
    if callable(hp_space):
        return f"function {getattr(hp_space, '__qualname__', repr(hp_space))} (optuna-style suggest_* calls)"
    return {k: list(v) for k, v in hp_space.items()}


def _check_space(hp_space, args) -> None:
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


# ---------------------------------------------------------------------------------------------------
# the search
# ---------------------------------------------------------------------------------------------------
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


def check_search(trainer, *, hp_space, direction, backend, score_data, model_init, resume_from_checkpoint=None) -> None:
    """Every refusal of a search, in one sentence, before any model is built or trained."""
    args = trainer.args
    if backend not in (None, BACKEND):
        raise ValueError(f"under DP hyperparameter_search runs backend={BACKEND!r} only: an adaptive search (optuna, "
                         "ray) over private runs has no accounted cost; got backend=" + repr(backend))
    if getattr(trainer, "hyperparameter_selection", None) is not None:
        raise ValueError("this trainer already holds the result of a private selection; make a new DPTrainer")
    if getattr(trainer, "_selection_started", False):
        raise ValueError("a private selection already ran on this trainer (and failed or was interrupted): its trials "
                         "spent privacy that a second search would not count; make a new DPTrainer")
    if model_init is None:
        raise ValueError("hyperparameter_search needs model_init= (a function returning a fresh model): every trial "
                         "trains a fresh model")
    if score_data == "private":
        raise ValueError("score_data='private' (a DP score on held-out private data, whose cost would enter the "
                         "total) is not implemented; score on an eval set that is public and say so with "
                         "score_data='public'")
    if score_data != "public":
        raise ValueError("declare what the trials are scored on: score_data='public' (the eval set is public data, "
                         f"so scoring costs no privacy); got {score_data!r}")
    if trainer.eval_dataset is None:
        raise ValueError("hyperparameter_search scores every trial on the eval set: give the DPTrainer an "
                         "eval_dataset (public data)")
    if not isinstance(direction, str) or direction not in ("minimize", "maximize"):
        raise ValueError(f"direction must be 'minimize' or 'maximize' (one objective), got {direction!r}")
    if args.epsilon is None:
        raise ValueError("private selection calibrates each trial's sigma for the total: give --epsilon (the total "
                         "target), not --noise_multiplier")
    if resume_from_checkpoint not in (None, False) or getattr(args, "resume_from_checkpoint", None):
        raise ValueError("a private selection cannot resume: each trial is a fresh run from model_init; drop "
                         "--resume_from_checkpoint")
    if args.load_best_model_at_end:
        raise ValueError("--load_best_model_at_end chooses among a trial's checkpoints on the eval set, which the "
                         "selection does not count; drop it (the selection chooses among trials)")
    if args.world_size > 1:
        raise ValueError("private selection runs in one process: every rank would draw its own number of trials and "
                         "configurations; run hyperparameter_search without torchrun / accelerate launch")
    if getattr(args, "audit_canaries", None):
        raise ValueError("--audit_canaries audits one run; it cannot be combined with a private selection")
    if getattr(trainer, "ledger", None) is not None and trainer.ledger.own_steps > 0:
        raise ValueError(f"this trainer already took {trainer.ledger.own_steps} noisy steps (train() was called); a "
                         "private selection starts from a fresh DPTrainer, whose own model is not trained")
    if getattr(trainer, "ledger", None) is not None and trainer.ledger.prior:
        raise ValueError("this model carries the ledger of earlier DP runs on this data; a private selection starts "
                         "from a model without one (or give --prior_privacy separate if the data differ)")
    _check_space(hp_space, args)


def _default_objective(metrics: dict) -> float:
    """HF's ``default_compute_objective`` on the evaluation's own metrics: DPTrainer's ``epsilon`` (which ``log`` adds
    to the dict ``evaluate`` returns) is not a score — with it HF's default would rank every trial by its ε."""
    from transformers.trainer_utils import default_compute_objective

    return default_compute_objective({k: v for k, v in metrics.items() if k != "epsilon"})


def run_search(trainer, *, hp_space, compute_objective, n_trials, direction, backend, model_init,
               distribution="geometric", eta=None, score_data=None, hp_name=None):
    """The search (see the module docstring). Returns HF's ``BestRun`` (``run_summary``: the trials' configurations
    and scores and K, for the caller's eyes only: they are not part of the release)."""
    from transformers.trainer_utils import BestRun

    check_search(trainer, hp_space=hp_space, direction=direction, backend=backend, score_data=score_data,
                 model_init=model_init)
    count = trial_count(distribution, n_trials, eta)
    args, spec = trainer.args, trainer.privacy_spec
    plan = calibrate_selection_sigma(float(args.epsilon), float(spec.delta), float(spec.sample_rate),
                                     int(spec.planned_steps), count)
    objective = compute_objective or _default_objective
    trainer._selection_started = True  # a failed or interrupted search spent budget too: no second search here
    seeded = args.dp_seed is not None
    rng = random.Random(mix(args.dp_seed, "selection", "k")) if seeded else random.SystemRandom()
    k = count.sample(rng.random)
    logger.info("hf_dp: private selection: %s trials on average (%s), sigma=%.4g per trial (epsilon %.3g each alone), "
                "total epsilon %.4g at delta %g", count.mean, count.name, plan.noise_multiplier, plan.per_trial_epsilon,
                plan.total_epsilon, plan.delta)
    trainer._selection_models = [weakref.ref(trainer.model)]  # to refuse a model_init that returns a used model
    best = None  # (score, index, trainer, params)
    summary = []
    sign = 1.0 if direction == "maximize" else -1.0
    for index in range(max(k, 1)):
        config_rng = random.Random(mix(args.dp_seed, "selection", "config", index)) if seeded else random.Random(secrets.randbits(64))
        trial = Trial(index, config_rng)
        params = draw_configuration(hp_space, trial, args)
        seed = config_rng.randrange(2**31)
        folder = None
        try:
            trial_trainer, folder = _make_trial(trainer, model_init, trial, params, plan, seed, index)
            if k == 0:  # Poisson's K = 0: nothing is trained, the model_init model is released
                best = (None, index, trial_trainer, params, folder)
                break
            trial_trainer.train()
            steps = trial_trainer.ledger.own_steps
            if steps > plan.steps:
                raise RuntimeError(f"internal error: a trial took {steps} noisy steps, more than the {plan.steps} the "
                                   "selection accounts for")
            metrics = trial_trainer.evaluate()
            score = float(objective(metrics))
        except BaseException:  # nothing of the search is left on disk
            if folder is not None:
                shutil.rmtree(folder, ignore_errors=True)
            if best is not None:
                _discard(best)
            raise
        summary.append({"trial": index, "hyperparameters": dict(params), "objective": score})
        comparable = sign * score if math.isfinite(score) else -math.inf
        if best is None or comparable > best[0]:  # ties: the earlier trial (trials are i.i.d.)
            if best is not None:
                _discard(best)
            best = (comparable, index, trial_trainer, params, folder)
        else:
            _discard((None, index, trial_trainer, params, folder))
        del trial_trainer
        gc.collect()
    _, index, winner, params, folder = best
    record = selection_record(plan, count, k, hp_space, params, direction, objective, score_data,
                              None if k == 0 else summary[[s["trial"] for s in summary].index(index)]["objective"])
    adopt(trainer, winner, params, record)
    shutil.rmtree(folder, ignore_errors=True)
    return BestRun(run_id=str(index), objective=(summary[[s["trial"] for s in summary].index(index)]["objective"]
                                                 if k else None),
                   hyperparameters=dict(params), run_summary={"k_drawn": k, "trials": summary,
                                                              "note": "not part of the release: publishing K or the "
                                                                      "other trials' scores voids the bound"})


def _make_trial(trainer, model_init, trial, params, plan, seed, index):
    """A fresh DPTrainer for one trial: a new model, the trainer's data and collator, the trial's flags."""
    folder = _trial_folder()
    args = trainer.args
    changes = dict(params, epsilon=None, noise_multiplier=plan.noise_multiplier, output_dir=folder, seed=seed,
                   save_strategy="no", report_to="none", push_to_hub=False, load_best_model_at_end=False)
    if args.dp_seed is not None:  # each trial's Poisson and noise streams are its own
        changes["dp_seed"] = mix(args.dp_seed, "selection", "trial", index) % (2**31)
    trial_args = dataclasses.replace(args, **changes)
    model = model_init(trial) if _arity(model_init) == 1 else model_init()
    if model is None:
        raise RuntimeError("model_init returned None")
    if any(ref() is model for ref in trainer._selection_models):
        shutil.rmtree(folder, ignore_errors=True)
        raise ValueError("model_init returned a model an earlier trial trained: every trial must start from a fresh "
                         "model (e.g. from_pretrained inside model_init)")
    trainer._selection_models.append(weakref.ref(model))
    kwargs = dict(trainer._dp_init_kwargs)
    try:
        t = None
        if getattr(trainer, "_prefix_cache", False):  # the trainer's frozen-prefix caches, if this model's prefix is theirs
            try:
                t = type(trainer)(model=model, args=trial_args, train_dataset=trainer.train_dataset,
                                  **dict(kwargs, eval_dataset=trainer.eval_dataset))
            except ValueError as e:
                if "prefix cache" not in str(e):
                    raise
                model = model_init(trial) if _arity(model_init) == 1 else model_init()
        if t is None:
            t = type(trainer)(model=model, args=trial_args, train_dataset=trainer._fingerprint_source, **kwargs)
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    t.selection_trial = index
    spec = t.privacy_spec
    if t.ledger.prior:  # the model carries earlier DP runs on this data: the selection's total would not count them
        shutil.rmtree(folder, ignore_errors=True)
        raise ValueError("model_init returned a model that carries the ledger of earlier DP runs on this data; every "
                         "trial must start from a model without one (the base model)")
    if (spec.sample_rate, spec.planned_steps, spec.noise_multiplier, spec.delta) != (
            plan.sample_rate, plan.steps, plan.noise_multiplier, plan.delta):  # pragma: no cover - a defence
        shutil.rmtree(folder, ignore_errors=True)
        raise RuntimeError(f"internal error: a trial plans (q, steps, sigma, delta) = {(spec.sample_rate, spec.planned_steps, spec.noise_multiplier, spec.delta)}, "
                           f"not the selection's {(plan.sample_rate, plan.steps, plan.noise_multiplier, plan.delta)}")
    return t, folder


def _trial_folder() -> str:
    """A new temporary folder for one trial's files (deleted when the trial is decided)."""
    return tempfile.mkdtemp(prefix="hf_dp_trial_")


def _arity(fn) -> int:
    import inspect

    try:
        return len([p for p in inspect.signature(fn).parameters.values()
                    if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)])
    except (TypeError, ValueError):
        return 0


def _discard(entry) -> None:
    """A losing trial leaves nothing: its folder is deleted, its model and trainer dropped."""
    shutil.rmtree(entry[4], ignore_errors=True)


def selection_record(plan, count, k, hp_space, params, direction, objective, score_data, best_score) -> dict:
    """The ``hyperparameter_selection`` record of ``privacy.json``. K drawn is *not* in it (see
    :mod:`hf_dp.privacy.selection`: publishing it voids the bound)."""
    return {
        "method": "random stopping: the best of K independent DP runs, K random (Papernot & Steinke 2022)",
        "total_epsilon": plan.total_epsilon,
        "delta": plan.delta,
        "target_epsilon": plan.target_epsilon,
        "per_trial_epsilon": plan.per_trial_epsilon,
        "per_trial_noise_multiplier": plan.noise_multiplier,
        "per_trial_sample_rate": plan.sample_rate,
        "per_trial_steps": plan.steps,
        "accountant": "rdp (dp-accounting RdpAccountant, RepeatAndSelectDpEvent)",
        "trials_distribution": count.describe(),
        "k_drawn": "not published: K is part of the selection's secret randomness (publishing it voids the bound)",
        "search_space": _describe_space(hp_space),
        "selected_hyperparameters": {k_: v for k_, v in params.items()},
        "score": {"objective": getattr(objective, "__qualname__", repr(objective)), "direction": direction,
                  "data": "eval set declared public by the caller" if score_data == "public" else score_data,
                  "declared_public": score_data == "public", "selected_trial_score": best_score},
        "note": ("epsilon is the total of the selection: every trial's training and the choice of the best; the other "
                 "trials' models, scores and number are not released"),
    }


def adopt(trainer, winner, params, record) -> None:
    """``trainer`` becomes the winning trial's trainer (its model, ledger, optimizer, state, data and collator) with its
    own output_dir, card fields and the trial's flags; the ledger carries the selection, so the model's config says
    so and no later run continues it as if it were one trial."""
    own = {k: v for k, v in trainer.__dict__.items() if k not in winner.__dict__}  # e.g. the recipe's card fields
    args = trainer.args
    for name, value in params.items():
        setattr(args, name, value)
    args.seed = winner.args.seed
    trainer.__dict__.update(winner.__dict__)
    trainer.__dict__.update(own)
    trainer.args = args
    trainer.hyperparameter_selection = record
    trainer.privacy_spec = dataclasses.replace(trainer.privacy_spec, target_epsilon=record["target_epsilon"])
    trainer.ledger.meta["hyperparameter_selection"] = {
        "total_epsilon": record["total_epsilon"], "delta": record["delta"],
        "per_trial_epsilon": record["per_trial_epsilon"], "trials_distribution": record["trials_distribution"],
    }
    from hf_dp import lineage

    lineage.attach(trainer)


def refuse_train_after_selection(trainer) -> None:
    if getattr(trainer, "hyperparameter_selection", None) is not None:
        raise ValueError("refusing to train: this trainer holds the model a private selection released (total epsilon "
                         f"{trainer.hyperparameter_selection['total_epsilon']:.4g}); further training would not be "
                         "counted in that total; save it, or run a new selection")
