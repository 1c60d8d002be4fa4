"""``--tune``: private hyper-parameter selection in a recipe (``DPTrainer.hyperparameter_search``, :mod:`hf_dp.selection`).

    --tune "learning_rate=1e-3,3e-3,1e-2;per_sample_max_grad_norm=0.1,0.3" [--tune_trials 4]
           [--tune_distribution geometric|logarithmic|negative_binomial:ETA|poisson] [--tune_eval_public true]

The recipe runs a random number K of full DP runs (mean ``--tune_trials``), each with one value per flag drawn
uniformly from the lists, scores each on the validation set and keeps the best; ``--epsilon`` is the **total** of the
whole selection (each run gets the σ that makes the total meet it). The validation set must be public data: GLUE's own
dev set is (the recipe declares it so, and the card says it); for any other validation data pass
``--tune_eval_public true`` only if it is public. Everything is checked before the model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .args import RecipeError


@dataclass
class TuneArguments:
    tune: Optional[str] = field(default=None, metadata={"help": (
        "Private hyper-parameter selection (hf_dp): 'flag=v1,v2;flag=v1,v2', e.g. "
        "'learning_rate=1e-3,3e-3,1e-2;per_sample_max_grad_norm=0.1,0.3'. A random number K of full DP runs, each "
        "with values drawn from these lists, scored on the (public) validation set; the best is saved and --epsilon "
        "is the total of the whole selection (Papernot & Steinke 2022)")})
    tune_trials: float = field(default=4.0, metadata={"help": "With --tune: the expected number of runs E[K] (>= 1)"})
    tune_distribution: str = field(default="geometric", metadata={"help": (
        "With --tune: the distribution of K: geometric, logarithmic (more budget per run, heavier tail), "
        "negative_binomial:ETA, or poisson (K = 0 possible: the untrained model is saved)")})
    tune_eval_public: Optional[bool] = field(default=None, metadata={"help": (
        "With --tune: declare the validation set public, so that scoring the runs on it costs no privacy (automatic "
        "for GLUE's own dev set; required for --validation_file or a Hub dataset)")})


def check_tune(tune_args, training_args, resume, *, public_dev: bool) -> Optional[dict]:
    """Before the model is loaded: the search space read and checked against the flags, the flags that cannot go with
    a selection refused (one sentence each). Returns the space (``{flag: [value strings]}``) or None without --tune."""
    from hf_dp.selection import check_space_names, parse_space, trial_count

    if not tune_args.tune:
        if tune_args.tune is not None:
            raise RecipeError("--tune is empty: give \"flag=v1,v2;flag=v1,v2\"")
        return None
    space = parse_space(tune_args.tune)
    check_space_names(training_args, space)
    trial_count(tune_args.tune_distribution, tune_args.tune_trials)
    if not training_args.dp_enabled:
        raise RecipeError("--tune is private selection: it needs DP (drop --disable_dp)")
    if training_args.epsilon is None:
        raise RecipeError("--tune calibrates each run's noise so that the selection's total meets --epsilon: give "
                          "--epsilon, not --noise_multiplier")
    if resume is not None:
        raise RecipeError("--tune cannot resume (every run starts fresh from the base model): drop "
                          "--resume_from_checkpoint")
    if not training_args.do_train or not training_args.do_eval:
        raise RecipeError("--tune trains and scores every run: it needs --do_train and --do_eval (the validation set)")
    if training_args.load_best_model_at_end:
        raise RecipeError("--tune chooses among runs; --load_best_model_at_end (choosing among checkpoints on the "
                          "validation set, not counted) cannot go with it")
    public = tune_args.tune_eval_public if tune_args.tune_eval_public is not None else public_dev
    if not public:
        raise RecipeError("--tune scores every run on the validation set, which must be public data for the score to "
                          "cost nothing: pass --tune_eval_public true if it is (GLUE's own dev set is declared public "
                          "automatically)")
    return space


def run_tune(trainer, tune_args, space: dict, *, model_init, metric: str):
    """The selection on ``trainer`` (which then holds the best run's model); returns HF's ``BestRun``."""
    key = f"eval_{metric}"
    lower_is_better = metric in ("mse", "loss")

    def objective(metrics: dict) -> float:
        return float(metrics[key])

    objective.__qualname__ = key
    return trainer.hyperparameter_search(
        hp_space=space, compute_objective=objective, n_trials=tune_args.tune_trials,
        direction="minimize" if lower_is_better else "maximize", backend="dp_random_stopping", model_init=model_init,
        distribution=tune_args.tune_distribution, score_data="public",
    )
