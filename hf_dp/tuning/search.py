"""Private hyper-parameter selection: ``DPTrainer.hyperparameter_search(backend="dp_random_stopping")``.

The best of a random number K of full DP runs is released, and the reported ε is the **total** of the selection
(Papernot & Steinke 2022; the accounting, the theorems and why K stays secret: :mod:`hf_dp.privacy.selection`):

1. K is drawn from a distribution fixed in advance (``distribution``: ``geometric`` (default), ``logarithmic``,
   ``negative_binomial`` with ``eta``, ``poisson``; mean ``n_trials``), from OS entropy (``--dp_seed``: from the seed).
2. The per-trial σ is calibrated (for the run's q and steps) so that the selection's total ε at δ is ≤ ``--epsilon``.
3. Each trial is a fresh DP run: a new model from ``model_init``, a new trainer with the configuration drawn
   (uniformly, with fresh randomness) from ``hp_space``, ``--noise_multiplier`` = that σ, ``--accountant rdp`` (the
   accountant of the total: the ε a trial logs is the record's ``per_trial_epsilon``), new Poisson draws and noise
   (OS entropy; under ``--dp_seed`` each trial's streams are keyed by a seed of its own, the 256-bit hash
   :func:`~hf_dp.privacy.randomness.derived_seed` of (seed, "selection", "trial", index)), a different HF ``seed``,
   its files in a temporary folder that is deleted, no tracker (``report_to`` none), no checkpoint.
4. Its score comes from one of two places, which the caller must declare (``score_data``):

   * ``"public"``: ``compute_objective(trainer.evaluate())`` on an eval set the caller declares public data; the choice
     of model is then post-processing for the training data and costs nothing.
   * ``"private"``: a held-out part of the private data (``score_dataset``, default the eval set: rows no trial trains
     on), through a **DP score** whose cost the selection's total counts: the sum over held-out units of each unit's
     per-example score in [0, 1] plus N(0, σ_s²), divided by n (:mod:`hf_dp.tuning.private_score`, which also says what
     of the held-out set is never computed or released, and why the trainer then refuses to evaluate it).
5. The trainer then holds the best trial's model (what ``save_model`` writes), its ledger and configuration; its
   ``get_epsilon()`` and ``privacy.json`` report the total, with a ``hyperparameter_selection`` record. It refuses to
   ``train()`` again, and a new DPTrainer on the released model refuses to continue its ledger (the selection's cost
   is not a (σ, q, steps) history the ledger can compose; :func:`hf_dp.run.lineage.adopt_model_ledger`).

The search space and the law of K: :mod:`hf_dp.tuning.space` (a flag that changes the mechanism's q, steps, δ or unit
is refused there: :data:`~hf_dp.tuning.space.FIXED_BY_THE_MECHANISM`).

Tuning on private data *without* this path (several ``train()`` runs compared by hand, or ``load_best_model_at_end``
on private eval data) stays possible and is labelled outside the guarantee, as ``model_selection`` says.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import math
import random
import secrets
import shutil
import tempfile
import weakref

from hf_dp.privacy.randomness import derived_seed
from hf_dp.privacy.selection import DEFAULT_SCORE_NOISE_MULTIPLIER, calibrate_selection_sigma, plan_context
from hf_dp.tuning import private_score
from hf_dp.tuning.space import Trial, check_space, describe_space, draw_configuration, trial_count

logger = logging.getLogger(__name__)

BACKEND = "dp_random_stopping"
SCORE_DATA = ("public", "private")


def check_search(args, dp, *, hp_space, direction, backend, score_data, model_init, eval_dataset=None, raw_eval=None,
                 train_sets=(), model=None, objective=None, resume_from_checkpoint=None, score_dataset=None,
                 score_noise_multiplier=None, example_score=None, compute_objective=None) -> None:
    """Every refusal of a search, in one sentence, before any model is built or trained. ``args`` and ``dp`` (the
    :class:`~hf_dp.run.state.PrivacyState`) are the trainer's; ``eval_dataset`` its eval set; ``raw_eval``,
    ``train_sets``, ``model`` and ``objective`` what :func:`hf_dp.tuning.private_score.check_private_score` reads."""
    if backend not in (None, BACKEND):
        raise ValueError(f"under DP hyperparameter_search runs backend={BACKEND!r} only: an adaptive search (optuna, "
                         "ray) over private runs has no accounted cost; got backend=" + repr(backend))
    if dp.selection.record is not None:
        raise ValueError("this trainer already holds the result of a private selection; make a new DPTrainer")
    if dp.selection.started:
        raise ValueError("a private selection already ran on this trainer (and failed or was interrupted): its trials "
                         "spent privacy that a second search would not count; make a new DPTrainer")
    if dp.spec is not None and dp.spec.bands > 1:
        raise ValueError(f"private selection is not supported with --noise_bands {dp.spec.bands} yet (each trial's sigma "
                         "is calibrated for DP-SGD's Poisson sampling); use --noise_mechanism independent")
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
        if score_dataset is None and eval_dataset is None:
            raise ValueError("hyperparameter_search scores every trial on the eval set: give the DPTrainer an "
                             "eval_dataset (public data)")
    else:
        private_score.check_private_score(args, dp.spec, score_dataset, score_noise_multiplier, example_score,
                                          compute_objective, direction, eval_dataset=raw_eval, train_sets=train_sets,
                                          model=model, objective=objective)
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
    if dp.ledger is not None and dp.ledger.own_steps > 0:
        raise ValueError(f"this trainer already took {dp.ledger.own_steps} noisy steps (train() was called); a "
                         "private selection starts from a fresh DPTrainer, whose own model is not trained")
    if dp.ledger is not None and dp.ledger.prior:
        raise ValueError("this model carries the ledger of earlier DP runs, which this run's ledger counts; a private "
                         "selection starts from a model without one (or give --prior_privacy separate if this training "
                         "data share no example with theirs)")
    check_space(hp_space, args)


def _default_objective(metrics: dict) -> float:
    """HF's ``default_compute_objective`` on the evaluation's own metrics: DPTrainer's ``epsilon`` (which ``log`` adds
    to the dict ``evaluate`` returns) is not a score — with it HF's default would rank every trial by its ε."""
    from transformers.trainer_utils import default_compute_objective

    return default_compute_objective({k: v for k, v in metrics.items() if k != "epsilon"})


def run_search(trainer, *, hp_space, compute_objective, n_trials, direction, backend, model_init,
               distribution="geometric", eta=None, score_data=None, hp_name=None, score_dataset=None,
               score_noise_multiplier=None, example_score=None):
    """The search (see the module docstring). Returns HF's ``BestRun`` (``run_summary``: the trials' configurations
    and scores and K, for the caller's eyes only: they are not part of the release). It takes the trainer: it builds
    each trial as ``type(trainer)(...)``, trains and evaluates them, and makes the trainer the winner."""
    from transformers.trainer_utils import BestRun

    from hf_dp.run import lineage

    args, dp = trainer.args, trainer.dp
    raw = private_score.raw_eval(trainer._dp_init_kwargs, trainer.eval_dataset)
    check_search(args, dp, hp_space=hp_space, direction=direction, backend=backend, score_data=score_data,
                 model_init=model_init, eval_dataset=trainer.eval_dataset, raw_eval=raw,
                 train_sets=(trainer._fingerprint_source, trainer.train_dataset), model=trainer.model,
                 objective=trainer.objective, score_dataset=score_dataset,
                 score_noise_multiplier=score_noise_multiplier, example_score=example_score,
                 compute_objective=compute_objective)
    count = trial_count(distribution, n_trials, eta)
    spec = dp.spec
    private = score_data == "private"
    if private and score_noise_multiplier is None:
        score_noise_multiplier = DEFAULT_SCORE_NOISE_MULTIPLIER
    plan = calibrate_selection_sigma(float(args.epsilon), float(spec.delta), float(spec.sample_rate),
                                     int(spec.planned_steps), count,
                                     score_noise_multiplier=float(score_noise_multiplier) if private else None)
    scoring = private_score.Scoring(  # the trainer's cache of its eval set (built now if not yet)
        score_dataset, private, raw_eval=raw, eval_set=trainer._eval_cache() if score_dataset is None else None,
        prefix_cache=trainer.prefix_cache if trainer._prefix_cache else None, unit_column=args.privacy_unit_column)
    objective = (example_score or private_score.accuracy) if private else (compute_objective or _default_objective)
    dp.selection.started = True  # a failed or interrupted search spent budget too: no second search here
    seeded = args.dp_seed is not None
    rng = random.Random(derived_seed(args.dp_seed, "selection", "k")) if seeded else random.SystemRandom()
    k = count.sample(rng.random)
    # one accountant for every ε of the selection: its total is an RDP bound (dp-accounting), so each trial's own ε
    # (its plan line, its logs, the released trial's ledger and card) is RDP too, not a PRV figure beside it
    single = (f"; the plan logged when this trainer was made (σ = {spec.noise_multiplier:.4g}) is a single run's, "
              "which the selection does not make" if dp.plan_announced else "")
    logger.info("hf_dp: private selection: %s trials on average (%s), σ = %.4g per trial (ε %.3g each alone (rdp)), "
                "calibrated so that the total ε is %.4g at δ %g (rdp, the best of K trials)%s", count.mean, count.name,
                plan.noise_multiplier, plan.per_trial_epsilon, plan.total_epsilon, plan.delta, single)
    dp.selection.models = [weakref.ref(trainer.model)]  # to refuse a model_init that returns a used model
    best = None  # (score, index, trainer, params)
    summary = []
    sign = 1.0 if direction == "maximize" else -1.0
    for index in range(max(k, 1)):
        config_rng = (random.Random(derived_seed(args.dp_seed, "selection", "config", index)) if seeded
                      else random.Random(secrets.randbits(256)))
        trial = Trial(index, config_rng)
        params = draw_configuration(hp_space, trial, args)
        seed = config_rng.randrange(2**31)
        folder = None
        try:
            with plan_context(f"per trial (rdp, as the selection's total ε {plan.total_epsilon:.3g})"):
                trial_trainer, folder = _make_trial(trainer, model_init, trial, params, plan, seed, index, scoring)
            if k == 0:  # Poisson's K = 0: nothing is trained, the model_init model is released
                best = (None, index, trial_trainer, params, folder)
                break
            trial_trainer.train()
            steps = trial_trainer.dp.ledger.own_steps
            if steps > plan.steps:
                raise RuntimeError(f"internal error: a trial took {steps} noisy steps, more than the {plan.steps} the "
                                   "selection accounts for")
            trial_cache = trial_trainer.prefix_cache if trial_trainer._prefix_cache else None  # its frozen prefix's
            if private:  # the DP score: the noisy sum, nothing else of the held-out set leaves this block
                scored = scoring.dataset_for(trial_cache)
                trial_trainer.dp.selection.score_sets = scoring.views(trial_trainer.eval_dataset, scored)
                exact, n = private_score.unit_sum(private_score.heldout_scores(trial_trainer, scored, example_score),
                                                  scoring.units)
                score = private_score.dp_score(exact, n, plan.score_noise_multiplier, secure=bool(args.secure_rng),
                                 seed=args.dp_seed, key=(index,))
                del exact
            else:
                metrics = (trial_trainer.evaluate() if score_dataset is None
                           else trial_trainer.evaluate(scoring.dataset_for(trial_cache)))
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
    score_sets = (winner.dp.selection.score_sets or scoring.views(winner.eval_dataset)) if private else ()
    winner_seed = winner.args.seed
    trainer._adopt_trial(winner)  # its model, state (dp), data and collator; the trainer's own args (hf_dp.trainer)
    adopt(trainer.dp, trainer.args, params, winner_seed, record, score_sets=score_sets)
    lineage.attach(trainer.dp, trainer.model, trainer._train_fingerprint)
    shutil.rmtree(folder, ignore_errors=True)
    return BestRun(run_id=str(index), objective=(summary[[s["trial"] for s in summary].index(index)]["objective"]
                                                 if k else None),
                   hyperparameters=dict(params), run_summary={"k_drawn": k, "trials": summary,
                                                              "note": "not part of the release: publishing K or the "
                                                                      "other trials' scores voids the bound"})


def _make_trial(trainer, model_init, trial, params, plan, seed, index, scoring=None):
    """A fresh DPTrainer for one trial: a new model, the trainer's data and collator, the trial's flags. It takes the
    trainer: the trial is ``type(trainer)(...)``, built from the trainer's own construction arguments."""
    folder = _trial_folder()
    args = trainer.args
    changes = dict(params, epsilon=None, noise_multiplier=plan.noise_multiplier, accountant="rdp", output_dir=folder, seed=seed,
                   save_strategy="no", report_to="none", push_to_hub=False, load_best_model_at_end=False)
    private = scoring is not None and scoring.private
    if private:  # no evaluation during training: the eval set may be the held-out one; the score reads every row in order
        changes.update(eval_strategy="no", eval_on_start=False, dataloader_drop_last=False)
        if hasattr(args, "dataloader_in_order"):
            changes["dataloader_in_order"] = True
    if args.dp_seed is not None:  # each trial's Poisson and noise streams are its own, keyed by the whole seed
        changes["dp_seed"] = derived_seed(args.dp_seed, "selection", "trial", index)
    trial_args = dataclasses.replace(args, **changes)
    model = model_init(trial) if _arity(model_init) == 1 else model_init()
    if model is None:
        raise RuntimeError("model_init returned None")
    if any(ref() is model for ref in trainer.dp.selection.models):
        shutil.rmtree(folder, ignore_errors=True)
        raise ValueError("model_init returned a model an earlier trial trained: every trial must start from a fresh "
                         "model (e.g. from_pretrained inside model_init)")
    trainer.dp.selection.models.append(weakref.ref(model))
    kwargs = dict(trainer._dp_init_kwargs)
    try:
        t = None
        # a trial with its own frozen prefix caches the eval set (the held-out one if it is the eval set): no log line
        with private_score.quiet_cache_log(private):
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
    t.dp.selection.trial = index
    if private:  # the trial refuses to evaluate the held-out set (a callback may set control.should_evaluate)
        t.dp.selection.score_sets = scoring.views(t.eval_dataset)
    spec = t.dp.spec
    if t.dp.ledger.prior:  # the model carries earlier DP runs (counted unless separate): the selection's total would not
        shutil.rmtree(folder, ignore_errors=True)
        raise ValueError("model_init returned a model that carries the ledger of earlier DP runs, which its ledger "
                         "counts; every trial must start from a model without one (the base model)")
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
        "search_space": describe_space(hp_space),
        "selected_hyperparameters": {k_: v for k_, v in params.items()},
        "score": score,
        "note": ("epsilon is the total of the selection: every trial's training" + (" and DP score" if private else "")
                 + " and the choice of the best; the other trials' models, scores and number are not released"),
    }


def adopt(dp, args, params, seed, record, score_sets=()) -> None:
    """The selection's result in the holder's state, once the trainer has become the winning trial's
    (``DPTrainer._adopt_trial``: its model, state ``dp``, optimizer, data and collator, with its own output_dir and
    card fields): ``args``, the trainer's own arguments, take the trial's flags (``params``) and HF ``seed``; the ledger
    carries the selection, so the model's config says so (:func:`hf_dp.run.lineage.attach`, after this) and no later
    run continues it as if it were one trial. ``score_sets``: the held-out private set a DP score read (as given and
    as cached), recorded as ``dp.selection.score_sets``: ``evaluate()``/``predict()`` on it are refused
    (:func:`hf_dp.tuning.private_score.refuse_evaluating_the_score_set`)."""
    for name, value in params.items():
        setattr(args, name, value)
    args.seed = seed
    dp.selection.record = record
    dp.selection.started = True  # the holder's search spent the budget: no second search (the winner's state came in)
    dp.mechanism = dp.mechanism.with_target_epsilon(record["target_epsilon"])
    dp.ledger.meta["hyperparameter_selection"] = {
        "total_epsilon": record["total_epsilon"], "delta": record["delta"],
        "per_trial_epsilon": record["per_trial_epsilon"], "trials_distribution": record["trials_distribution"],
    }
    dp.selection.score_sets = tuple({id(d): d for d in score_sets if d is not None}.values())


def refuse_train_after_selection(selection) -> None:
    """Refuse ``train()`` on the holder of a private selection's result (``selection``: its ``dp.selection``)."""
    if selection.record is not None:
        raise ValueError("refusing to train: this trainer holds the model a private selection released (total epsilon "
                         f"{selection.record['total_epsilon']:.4g}); further training would not be "
                         "counted in that total; save it, or run a new selection")
