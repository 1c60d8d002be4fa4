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
4. Its score comes from one of two places, which the caller must declare (``score_data``):

   * ``"public"``: ``compute_objective(trainer.evaluate())`` on an eval set the caller declares public data; the choice
     of model is then post-processing for the training data and costs nothing.
   * ``"private"``: a held-out part of the private data (``score_dataset``, default the eval set: rows no trial trains
     on), through a **DP score**: each example's score s_i in [0, 1] (``example_score(logits, labels)``, called on one
     example's ``[1, ...]`` logits and labels at a time so that no row's score reads another row, default the
     accuracy: 1 if the argmax prediction is the label — for a causal LM the sequence's next-token accuracy; a user
     function's values are clipped to [0, 1], NaN counts 0), under ``--privacy_unit_column`` the mean over each unit's
     held-out rows (so one unit moves the sum by at most 1), released as Σ s + N(0, σ_s²) with σ_s =
     ``score_noise_multiplier`` (default :data:`~hf_dp.privacy.selection.DEFAULT_SCORE_NOISE_MULTIPLIER`); the
     trial's score is that noisy sum divided by n, the number of held-out units. **n is treated as public**, as the
     accountant's q = B/N treats the training set's size. Each trial's mechanism is then its training composed with
     this Gaussian (sensitivity 1), and the total of the selection counts it (:mod:`hf_dp.privacy.selection`). The
     noise comes from the trial's randomness source: OS entropy; under ``--dp_seed`` a stream keyed by (seed,
     "selection", "score", trial), which no training stream's key equals; ``--secure_rng``: the OS CSPRNG. No exact
     statistic of the held-out set is computed outside that sum: the trials do not call ``evaluate()`` (no metrics,
     no log line, no ``on_evaluate``/``on_predict`` callback, no tracker), do not evaluate during training
     (``eval_strategy`` "no"; a trial refuses to evaluate the held-out set, e.g. for a callback that sets
     ``control.should_evaluate``), cache it without the frozen-prefix cache's size line (its total token count), read
     it in order with one row per example (else refused, with public numbers only), and the record and the released
     trainer hold the noisy score only. δ must be below 1/(N + n): the held-out rows are private data too.
     ``example_score`` must be a pure function of the one example it is given (state kept across calls can move other
     examples' scores: not detectable). Afterwards the trainer
     refuses ``evaluate()`` and ``predict()`` on that held-out set (the same object, fingerprint or an overlapping
     ``Subset``: :func:`refuse_evaluating_the_score_set`; its bare ``evaluate()`` too when it is the eval set): exact
     metrics of it would reach the logs, the card and ``privacy.json`` outside the guarantee. A copy of its rows is not
     detected; evaluating one publishes exact statistics of private data, as any evaluation of private data does.
5. The trainer then holds the best trial's model (what ``save_model`` writes), its ledger and configuration; its
   ``get_epsilon()`` and ``privacy.json`` report the total, with a ``hyperparameter_selection`` record. It refuses to
   ``train()`` again, and a new DPTrainer on the released model refuses to continue its ledger (the selection's cost
   is not a (σ, q, steps) history the ledger can compose; :func:`hf_dp.run.lineage.adopt_model_ledger`).

What the search space may hold: flags that do not change the mechanism's q, steps, δ or unit (learning rate, C,
weight decay, warm-up, the rule's flags, ...); a flag that does is refused (:data:`FIXED_BY_THE_MECHANISM`).

Tuning on private data *without* this path (several ``train()`` runs compared by hand, or ``load_best_model_at_end``
on private eval data) stays possible and is labelled outside the guarantee, as ``model_selection`` says.
"""

from __future__ import annotations

import contextlib
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

from hf_dp.privacy.randomness import mix, secure_gaussian_like, stream_generator
from hf_dp.privacy.selection import (
    DEFAULT_SCORE_NOISE_MULTIPLIER,
    DISTRIBUTIONS,
    TrialCount,
    calibrate_selection_sigma,
    check_score_noise_multiplier,
)

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


def check_search(trainer, *, hp_space, direction, backend, score_data, model_init, resume_from_checkpoint=None,
                 score_dataset=None, score_noise_multiplier=None, example_score=None, compute_objective=None) -> None:
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
    if score_data not in SCORE_DATA:
        raise ValueError("declare what the trials are scored on: score_data='public' (the eval set is public data, "
                         "so scoring costs no privacy) or 'private' (held-out private data, through a DP score whose "
                         f"cost enters the total); got {score_data!r}")
    if not isinstance(direction, str) or direction not in ("minimize", "maximize"):
        raise ValueError(f"direction must be 'minimize' or 'maximize' (one objective), got {direction!r}")
    if score_data == "public":
        if score_noise_multiplier is not None or example_score is not None:
            raise ValueError("score_noise_multiplier and example_score define a DP score on held-out private data: "
                             "they go with score_data='private' only")
        if score_dataset is None and trainer.eval_dataset is None:
            raise ValueError("hyperparameter_search scores every trial on the eval set: give the DPTrainer an "
                             "eval_dataset (public data)")
    else:
        check_private_score(trainer, score_dataset, score_noise_multiplier, example_score, compute_objective,
                            direction)
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


def check_private_score(trainer, score_dataset, score_noise_multiplier, example_score, compute_objective,
                        direction) -> None:
    """The refusals of ``score_data="private"`` (a DP score on held-out private data), one sentence each."""
    from hf_dp.run.data import check_eval_is_not_train, unit_rows

    args = trainer.args
    heldout = score_dataset if score_dataset is not None else _raw_eval(trainer)
    if heldout is None:
        raise ValueError("score_data='private' scores every trial on held-out private data: give score_dataset= (rows "
                         "of the private data that no trial trains on), or the DPTrainer an eval_dataset of them")
    if isinstance(heldout, dict):
        raise ValueError("score_data='private' scores on one held-out set: give score_dataset= one dataset, not a dict")
    try:
        n = len(heldout)
    except TypeError:
        raise ValueError("the held-out score set must be a sized dataset (its size n divides the noisy sum)") from None
    if n == 0:
        raise ValueError("the held-out score set is empty")
    for train in {id(x): x for x in (trainer._fingerprint_source, trainer.train_dataset) if x is not None}.values():
        try:
            check_eval_is_not_train(heldout, train)
        except ValueError:
            raise ValueError("the held-out score set is (or overlaps) the training set: score on rows no trial trains "
                             "on") from None
    if compute_objective is not None:
        raise ValueError("under score_data='private' a trial's score is the DP mean of example_score over the held-out "
                         "set, not compute_objective(metrics) (exact metrics of private data): give example_score= "
                         "instead")
    if example_score is not None and not callable(example_score):
        raise ValueError(f"example_score must be a function (logits, labels) -> one score in [0, 1] per example, got "
                         f"{example_score!r}")
    if example_score is None:
        config = getattr(trainer.model, "config", None)
        objective = getattr(getattr(trainer, "objective", None), "name", None)
        problem = getattr(config, "problem_type", None)
        if objective != "causal_lm" and (problem in ("regression", "multi_label_classification")
                                         or getattr(config, "num_labels", 2) == 1):
            raise ValueError("the default DP score is the accuracy of one label per example, which a regression or "
                             "multi-label head does not have: give example_score=(logits, labels) -> one score in "
                             "[0, 1] per example")
        if direction != "maximize":
            raise ValueError("the default DP score is the accuracy (higher is better): pass direction='maximize'")
    if score_noise_multiplier is not None:
        check_score_noise_multiplier(score_noise_multiplier)
    if args.dataloader_drop_last:
        raise ValueError("score_data='private' scores every held-out row: drop --dataloader_drop_last")
    units = n
    if args.privacy_unit_column is not None:
        try:
            units = len(unit_rows(heldout, args.privacy_unit_column))
        except ValueError as e:
            raise ValueError(f"the held-out score set: {e}") from None
    spec = getattr(trainer, "privacy_spec", None)
    if spec is not None:  # the held-out rows are private data too: delta < 1/(N + n) over both (N + n >= their union)
        total = int(spec.dataset_size) + int(units)
        if spec.delta >= 1.0 / total:
            raise ValueError(f"delta={spec.delta:g} is not below 1/(N + n) = 1/{total} = {1.0 / total:.3g} (N = "
                             f"{spec.dataset_size} training units, n = {units} held-out units, both private data): such "
                             "a delta allows a mechanism that publishes a whole record; choose a smaller delta")


def _raw_eval(trainer):
    """The eval set the trainer was given (before any frozen-prefix caching)."""
    kwargs = getattr(trainer, "_dp_init_kwargs", {})
    return kwargs["eval_dataset"] if "eval_dataset" in kwargs else trainer.eval_dataset


# ---------------------------------------------------------------------------------------------------
# the DP score (score_data="private")
# ---------------------------------------------------------------------------------------------------
def accuracy(logits, labels):
    """The default per-example score: 1 if the argmax prediction is the label (``[B, C]`` logits, ``[B]`` labels);
    for a causal LM (``[B, T, V]`` logits, ``[B, T]`` labels) the share of the sequence's scored next tokens
    (labels shifted as the model's own loss shifts them, -100 ignored) predicted exactly, 0 with none."""
    import torch

    if labels is None:
        raise ValueError("the held-out score set has no labels: the default DP score (accuracy) needs them")
    if logits.dim() == 3:
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        scored = shift != -100
        hits = (logits.argmax(-1) == shift) & scored
        return hits.sum(1).double() / scored.sum(1).clamp(min=1).double()
    return (logits.argmax(-1) == labels.view(-1)).double()


def heldout_scores(trainer, dataset, example_score=None):
    """Each held-out row's score in [0, 1] (float64, in the dataset's order), from ``trainer``'s model: its own
    prediction steps (no ``evaluate()``/``predict()``: no metrics, logs or callbacks). The score function is called
    on one example at a time (its ``[1, ...]`` logits and labels), so no row's score reads another row. Values outside
    [0, 1] are clipped, NaN counts 0. Exact: for :func:`dp_score` only, never to be released."""
    import torch
    from transformers.trainer_pt_utils import find_batch_size

    score = example_score or accuracy
    args = trainer.args
    if getattr(args, "dataloader_num_workers", 0) and getattr(args, "dataloader_in_order", True) is False:
        raise ValueError("the DP score reads the held-out rows in their order (a unit's rows by position): drop "
                         "--dataloader_in_order false (or --dataloader_num_workers)")
    loader = trainer.get_test_dataloader(dataset)  # the dataset's order (hf_dp's eval sampler), every row
    # each batch must hold one row per example: a full batch, or the last one. The messages hold public numbers only
    # (the batch size, n): a count of rows a collator made would be a statistic of the held-out data
    size = (getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
            or args.eval_batch_size)
    n = len(dataset)
    one_row_each = ("the held-out set's batches must hold exactly one row per example (batches of {size} examples, "
                    "the last one {last}): the DP score needs one row per example, so that one example moves one score "
                    "(a collator or model that makes several rows per example, or drops some, cannot be scored)")
    model = trainer.model
    was_training = model.training
    model.eval()
    out = []
    try:
        with trainer._suffix_ctx():
            for inputs in loader:
                rows = find_batch_size(inputs)
                if rows not in (size, n % size or size):
                    raise ValueError(one_row_each.format(size=size, last=n % size or size))
                _, logits, labels = trainer.prediction_step(model, inputs, prediction_loss_only=False)
                if isinstance(logits, (tuple, list)):
                    logits = logits[0]
                if logits.shape[0] != rows:
                    raise ValueError(one_row_each.format(size=size, last=n % size or size))
                # one call per example (its own logits and labels): a score whose value for one row depended on the
                # batch's other rows would let one example move the sum by up to the batch size, not 1
                values = []
                for i in range(rows):
                    value = torch.as_tensor(score(logits[i:i + 1], _row(labels, i))).detach()
                    if value.numel() != 1:
                        raise ValueError(f"example_score returned {value.numel()} values for one example: it must "
                                         "return one score per example")
                    values.append(value.to("cpu", torch.float64).reshape(()))
                values = torch.stack(values) if values else torch.zeros(0, dtype=torch.float64)
                out.append(torch.nan_to_num(values, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0))
    finally:
        model.train(was_training)
    scores = torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
    if scores.numel() != n:  # rows made or dropped across batches (dataloader_drop_last is refused)
        raise ValueError(one_row_each.format(size=size, last=n % size or size))
    return scores


def _row(labels, i):
    """Example ``i``'s labels (a one-row slice; each tensor of a tuple sliced; ``None`` stays ``None``)."""
    if labels is None:
        return None
    if isinstance(labels, (tuple, list)):
        return type(labels)(_row(x, i) for x in labels)
    return labels[i:i + 1]


def unit_sum(scores, units=None) -> tuple[float, int]:
    """(Σ over units of the unit's mean row score, number of units): one unit moves the sum by at most 1. ``units``:
    the row indices of each unit (``None``: every row its own unit)."""
    if units is None:
        return float(scores.sum()), int(scores.numel())
    return float(sum(float(scores[rows].mean()) for rows in units)), len(units)


def score_noise(sigma: float, *, secure: bool = False, seed: int | None = None, key=()) -> float:
    """One N(0, σ²) draw for a DP score: the OS CSPRNG (``secure``, Opacus' secure-mode construction), else a fresh
    stream: OS entropy, or under ``seed`` (``--dp_seed``) the stream keyed by (seed, "selection", "score", *key)."""
    import torch

    if secure:
        return float(secure_gaussian_like(torch.zeros((), dtype=torch.float64), float(sigma)))
    gen = stream_generator(seed, "selection", "score", *key)
    return float(torch.randn((), generator=gen, dtype=torch.float64)) * float(sigma)


def dp_score(exact_sum: float, n: int, sigma: float, **noise) -> float:
    """The released score: (Σ s + N(0, σ²)) / n (n, the number of held-out units, public)."""
    return (float(exact_sum) + score_noise(sigma, **noise)) / int(n)


def _default_objective(metrics: dict) -> float:
    """HF's ``default_compute_objective`` on the evaluation's own metrics: DPTrainer's ``epsilon`` (which ``log`` adds
    to the dict ``evaluate`` returns) is not a score — with it HF's default would rank every trial by its ε."""
    from transformers.trainer_utils import default_compute_objective

    return default_compute_objective({k: v for k, v in metrics.items() if k != "epsilon"})


def run_search(trainer, *, hp_space, compute_objective, n_trials, direction, backend, model_init,
               distribution="geometric", eta=None, score_data=None, hp_name=None, score_dataset=None,
               score_noise_multiplier=None, example_score=None):
    """The search (see the module docstring). Returns HF's ``BestRun`` (``run_summary``: the trials' configurations
    and scores and K, for the caller's eyes only: they are not part of the release)."""
    from transformers.trainer_utils import BestRun

    check_search(trainer, hp_space=hp_space, direction=direction, backend=backend, score_data=score_data,
                 model_init=model_init, score_dataset=score_dataset, score_noise_multiplier=score_noise_multiplier,
                 example_score=example_score, compute_objective=compute_objective)
    count = trial_count(distribution, n_trials, eta)
    args, spec = trainer.args, trainer.privacy_spec
    private = score_data == "private"
    if private and score_noise_multiplier is None:
        score_noise_multiplier = DEFAULT_SCORE_NOISE_MULTIPLIER
    plan = calibrate_selection_sigma(float(args.epsilon), float(spec.delta), float(spec.sample_rate),
                                     int(spec.planned_steps), count,
                                     score_noise_multiplier=float(score_noise_multiplier) if private else None)
    scoring = _Scoring(trainer, score_dataset, private)
    objective = (example_score or accuracy) if private else (compute_objective or _default_objective)
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
            trial_trainer, folder = _make_trial(trainer, model_init, trial, params, plan, seed, index, scoring)
            if k == 0:  # Poisson's K = 0: nothing is trained, the model_init model is released
                best = (None, index, trial_trainer, params, folder)
                break
            trial_trainer.train()
            steps = trial_trainer.ledger.own_steps
            if steps > plan.steps:
                raise RuntimeError(f"internal error: a trial took {steps} noisy steps, more than the {plan.steps} the "
                                   "selection accounts for")
            if private:  # the DP score: the noisy sum, nothing else of the held-out set leaves this block
                scored = scoring.dataset_for(trial_trainer)
                trial_trainer.private_score_sets = scoring.views(trial_trainer, scored)
                exact, n = unit_sum(heldout_scores(trial_trainer, scored, example_score), scoring.units)
                score = dp_score(exact, n, plan.score_noise_multiplier, secure=bool(args.secure_rng),
                                 seed=args.dp_seed, key=(index,))
                del exact
            else:
                metrics = (trial_trainer.evaluate() if score_dataset is None
                           else trial_trainer.evaluate(scoring.dataset_for(trial_trainer)))
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
                              None if k == 0 else summary[[s["trial"] for s in summary].index(index)]["objective"],
                              heldout_units=scoring.n if private else None,
                              unit_column=args.privacy_unit_column if private else None)
    adopt(trainer, winner, params, record,
          score_sets=(getattr(winner, "private_score_sets", None) or scoring.views(winner)) if private else ())
    shutil.rmtree(folder, ignore_errors=True)
    return BestRun(run_id=str(index), objective=(summary[[s["trial"] for s in summary].index(index)]["objective"]
                                                 if k else None),
                   hyperparameters=dict(params), run_summary={"k_drawn": k, "trials": summary,
                                                              "note": "not part of the release: publishing K or the "
                                                                      "other trials' scores voids the bound"})


class _Scoring:
    """The set the trials are scored on: the eval set, or ``score_dataset`` (cached once with the trainer's frozen
    prefix under ``--cache_frozen_features``); for a DP score, its units and their number n."""

    def __init__(self, trainer, score_dataset, private):
        from hf_dp.run.data import unit_rows

        self.private = private
        self.raw = score_dataset if score_dataset is not None else _raw_eval(trainer)
        self.is_eval_set = score_dataset is None
        if score_dataset is None:
            self.dataset = trainer.eval_dataset  # already cached by the trainer, if it caches
        elif getattr(trainer, "_prefix_cache", False):
            with quiet_cache_log(private):
                self.dataset = trainer.prefix_cache.cache(score_dataset, "score")
        else:
            self.dataset = score_dataset
        self.units, self.n = None, None
        if private:
            col = trainer.args.privacy_unit_column
            self.units = unit_rows(self.raw, col) if col is not None else None
            self.n = len(self.units) if self.units is not None else len(self.raw)

    def dataset_for(self, trial_trainer):
        """The score set as ``trial_trainer`` reads it: the trainer's cache if the trial's frozen prefix is the
        trainer's, else cached anew with the trial's own prefix."""
        if not getattr(trial_trainer, "_prefix_cache", False):
            return self.dataset
        with quiet_cache_log(self.private):
            try:
                return trial_trainer.prefix_cache.cache(self.dataset, "score")
            except ValueError as e:
                if "prefix cache" not in str(e):
                    raise
                return trial_trainer.prefix_cache.cache(self.raw, "score")

    def views(self, trial_trainer, *more) -> tuple:
        """Every form of the held-out set ``trial_trainer`` could evaluate — as given, as cached by the trainer, its own
        eval set when the held-out set is the eval set (a trial with another frozen prefix caches it anew), and
        ``more`` — for :func:`refuse_evaluating_the_score_set`."""
        own = (trial_trainer.eval_dataset,) if self.is_eval_set else ()
        return tuple({id(d): d for d in (self.raw, self.dataset, *own, *more) if d is not None}.values())


class _QuietCacheLog(logging.Filter):
    def filter(self, record) -> bool:
        return not str(record.msg).startswith("hf_dp prefix cache (")


@contextlib.contextmanager
def quiet_cache_log(active: bool = True):
    """Without the frozen-prefix cache's log line: its size is the cached set's total token count × hidden size × the
    dtype's bytes, an exact statistic of the held-out private data a DP score reads (the row count is public)."""
    if not active:
        yield
        return
    log, quiet = logging.getLogger("hf_dp.models.prefix_cache"), _QuietCacheLog()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def _make_trial(trainer, model_init, trial, params, plan, seed, index, scoring=None):
    """A fresh DPTrainer for one trial: a new model, the trainer's data and collator, the trial's flags."""
    folder = _trial_folder()
    args = trainer.args
    changes = dict(params, epsilon=None, noise_multiplier=plan.noise_multiplier, output_dir=folder, seed=seed,
                   save_strategy="no", report_to="none", push_to_hub=False, load_best_model_at_end=False)
    private = scoring is not None and scoring.private
    if private:  # no evaluation during training: the eval set may be the held-out one; the score reads every row in order
        changes.update(eval_strategy="no", eval_on_start=False, dataloader_drop_last=False)
        if hasattr(args, "dataloader_in_order"):
            changes["dataloader_in_order"] = True
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
        # a trial with its own frozen prefix caches the eval set (the held-out one if it is the eval set): no log line
        with quiet_cache_log(private):
            if getattr(trainer, "_prefix_cache", False):  # the trainer's caches, if this model's prefix is theirs
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
    if private:  # the trial refuses to evaluate the held-out set (a callback may set control.should_evaluate)
        t.private_score_sets = scoring.views(t)
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


def selection_record(plan, count, k, hp_space, params, direction, objective, score_data, best_score,
                     heldout_units=None, unit_column=None) -> dict:
    """The ``hyperparameter_selection`` record of ``privacy.json``. K drawn is *not* in it (see
    :mod:`hf_dp.privacy.selection`: publishing it voids the bound). With a DP score, ``best_score`` is the noisy
    score (the only score of the held-out set there is)."""
    private = score_data == "private"
    score = {"objective": getattr(objective, "__qualname__", repr(objective)), "direction": direction,
             "data": ("held-out private data, scored through a DP score whose cost is in the total" if private else
                      "eval set declared public by the caller" if score_data == "public" else score_data),
             "declared_public": score_data == "public", "selected_trial_score": best_score}
    if private:
        sigma = plan.score_noise_multiplier
        score["dp_score"] = {
            "mechanism": ("Gaussian: (sum over held-out units of the unit's per-example score clipped to [0, 1], "
                          "mean over its rows) + N(0, sigma_s^2), divided by the number of held-out units n"),
            "noise_multiplier": sigma, "sensitivity": 1.0, "heldout_units": heldout_units,
            "unit": "row" if unit_column is None else unit_column,
            "score_std": sigma / heldout_units if heldout_units else None,
            "note": ("selected_trial_score is the noisy score; no exact statistic of the held-out data is released; n "
                     "is treated as public, as the training set's size is"),
        }
    return {
        "method": "random stopping: the best of K independent DP runs, K random (Papernot & Steinke 2022)",
        "total_epsilon": plan.total_epsilon,
        "delta": plan.delta,
        "target_epsilon": plan.target_epsilon,
        "per_trial_epsilon": plan.per_trial_epsilon,
        **({"per_trial_training_epsilon": plan.per_trial_training_epsilon} if private else {}),
        "per_trial_noise_multiplier": plan.noise_multiplier,
        "per_trial_sample_rate": plan.sample_rate,
        "per_trial_steps": plan.steps,
        "accountant": ("rdp (dp-accounting RdpAccountant, RepeatAndSelectDpEvent of ComposedDpEvent(training, "
                       "GaussianDpEvent(score)))" if private else "rdp (dp-accounting RdpAccountant, RepeatAndSelectDpEvent)"),
        "trials_distribution": count.describe(),
        "k_drawn": "not published: K is part of the selection's secret randomness (publishing it voids the bound)",
        "search_space": _describe_space(hp_space),
        "selected_hyperparameters": {k_: v for k_, v in params.items()},
        "score": score,
        "note": ("epsilon is the total of the selection: every trial's training" + (" and DP score" if private else "")
                 + " and the choice of the best; the other trials' models, scores and number are not released"),
    }


def adopt(trainer, winner, params, record, score_sets=()) -> None:
    """``trainer`` becomes the winning trial's trainer (its model, ledger, optimizer, state, data and collator) with its
    own output_dir, card fields and the trial's flags; the ledger carries the selection, so the model's config says
    so and no later run continues it as if it were one trial. ``score_sets``: the held-out private set a DP score
    read (as given and as cached), recorded as ``trainer.private_score_sets``: ``evaluate()``/``predict()`` on it are
    refused (:func:`refuse_evaluating_the_score_set`)."""
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
    trainer.private_score_sets = tuple({id(d): d for d in score_sets if d is not None}.values())
    from hf_dp.run import lineage

    lineage.attach(trainer)


def refuse_evaluating_the_score_set(trainer, dataset) -> None:
    """After a ``score_data="private"`` selection: refuse to evaluate (or predict on) the held-out private set its
    trials were scored on — the same object, the same 🤗 Datasets fingerprint, or a ``Subset`` overlapping it (a copy
    of its rows is not detectable) — whose exact metrics would go into the logs, the card and ``privacy.json`` of the
    release, outside the selection's ε (only its noisy score is covered)."""
    from hf_dp.run.data import same_dataset, subset_base

    held = getattr(trainer, "private_score_sets", None) or ()
    if dataset is None or not held:
        return
    for ds in dataset.values() if isinstance(dataset, dict) else [dataset]:
        base, idx = subset_base(ds)
        for h in held:
            h_base, h_idx = subset_base(h)
            if same_dataset(ds, h) or (same_dataset(base, h_base)
                                       and (idx is None or h_idx is None or not set(idx).isdisjoint(h_idx))):
                raise ValueError(
                    "this is (or overlaps) the held-out private data the private selection scored its trials on "
                    "(score_data='private'), whose exact metrics the selection's epsilon does not cover (only its "
                    "noisy score); evaluate on another dataset, e.g. trainer.evaluate(eval_dataset=public_test_set)"
                )


def refuse_train_after_selection(trainer) -> None:
    if getattr(trainer, "hyperparameter_selection", None) is not None:
        raise ValueError("refusing to train: this trainer holds the model a private selection released (total epsilon "
                         f"{trainer.hyperparameter_selection['total_epsilon']:.4g}); further training would not be "
                         "counted in that total; save it, or run a new selection")
