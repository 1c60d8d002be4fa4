"""``--tune``: private hyper-parameter selection in a recipe (``DPTrainer.hyperparameter_search``, :mod:`hf_dp.tuning.search`).

    --tune "learning_rate=1e-3,3e-3,1e-2;per_sample_max_grad_norm=0.1,0.3" [--tune_trials 4]
           [--tune_distribution geometric|logarithmic|negative_binomial:ETA|poisson] [--tune_eval_public true]
           [--tune_score private [--tune_holdout_fraction 0.1] [--tune_score_noise_multiplier 20]]

The recipe runs a random number K of full DP runs (mean ``--tune_trials``), each with one value per flag drawn
uniformly from the lists, scores each and keeps the best; ``--epsilon`` is the **total** of the whole selection (each
run gets the σ that makes the total meet it). Where the score comes from (``--tune_score``):

* ``public`` (default): the validation set, which must be public data: GLUE's own dev set is (the recipe declares it
  so, and the card says it); for any other validation data pass ``--tune_eval_public true`` only if it is public.
* ``private``: a held-out part of the *training* data — each training row goes to it with probability
  ``--tune_holdout_fraction`` (default 0.1) by an independent coin from fresh randomness (OS entropy; ``--secure_rng``:
  the OS CSPRNG; ``--dp_seed``: a stream of its own keyed by the seed); hf_dp saves neither the coins nor the split
  (the 🤗 Datasets tokenization cache may hold the tokenized held-out rows, as it holds every training row); the runs
  train on the other rows (N is their number) and are scored by a DP score of their accuracy on the held-out rows (Gaussian noise σ_s =
  ``--tune_score_noise_multiplier``, default 20, on the number of correct predictions: :mod:`hf_dp.tuning.private_score`), whose
  cost is in the total. The validation set is then only evaluated, after the selection, as without ``--tune``.

Everything is checked before the model is loaded.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from .args import RecipeError

#: the split the held-out rows of ``--tune_score private`` are put in (tokenized with the others)
HOLDOUT = "tune_holdout"
DEFAULT_HOLDOUT_FRACTION = 0.1


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
    tune_score: str = field(default="public", metadata={"help": (
        "With --tune: what the runs are scored on: 'public' (the validation set, declared public) or 'private' (a "
        "held-out part of the training rows, through a DP score of the accuracy whose cost is in --epsilon's total)")})
    tune_holdout_fraction: Optional[float] = field(default=None, metadata={"help": (
        "With --tune_score private: each training row is held out for scoring with this probability, by an "
        "independent random coin (default 0.1)")})
    tune_score_noise_multiplier: Optional[float] = field(default=None, metadata={"help": (
        "With --tune_score private: sigma_s, the Gaussian noise on the number of correct held-out predictions "
        "(sensitivity 1; default 20: the score's std is 20/n on n held-out rows)")})


def check_tune(tune_args, training_args, resume, *, public_dev: bool) -> Optional[dict]:
    """Before the model is loaded: the search space read and checked against the flags, the flags that cannot go with
    a selection refused (one sentence each). Returns the space (``{flag: [value strings]}``) or None without --tune."""
    from hf_dp.tuning.space import check_space_names, parse_space, trial_count

    if not tune_args.tune:
        if tune_args.tune is not None:
            raise RecipeError("--tune is empty: give \"flag=v1,v2;flag=v1,v2\"")
        if (tune_args.tune_score != "public" or tune_args.tune_holdout_fraction is not None
                or tune_args.tune_score_noise_multiplier is not None):
            raise RecipeError("--tune_score, --tune_holdout_fraction and --tune_score_noise_multiplier go with --tune")
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
    if training_args.load_best_model_at_end:
        raise RecipeError("--tune chooses among runs; --load_best_model_at_end (choosing among checkpoints on the "
                          "validation set, not counted) cannot go with it")
    if tune_args.tune_score not in ("public", "private"):
        raise RecipeError(f"--tune_score is 'public' (the validation set) or 'private' (held-out training rows, DP "
                          f"score), got {tune_args.tune_score!r}")
    if tune_args.tune_score == "private":
        return _check_private_score(tune_args, training_args, space)
    if tune_args.tune_holdout_fraction is not None or tune_args.tune_score_noise_multiplier is not None:
        raise RecipeError("--tune_holdout_fraction and --tune_score_noise_multiplier go with --tune_score private")
    if not training_args.do_train or not training_args.do_eval:
        raise RecipeError("--tune trains and scores every run: it needs --do_train and --do_eval (the validation set)")
    public = tune_args.tune_eval_public if tune_args.tune_eval_public is not None else public_dev
    if not public:
        raise RecipeError("--tune scores every run on the validation set, which must be public data for the score to "
                          "cost nothing: pass --tune_eval_public true if it is (GLUE's own dev set is declared public "
                          "automatically)")
    return space


def _check_private_score(tune_args, training_args, space):
    from hf_dp.privacy.selection import DEFAULT_SCORE_NOISE_MULTIPLIER, check_score_noise_multiplier, check_score_share
    from hf_dp.tuning.space import trial_count

    if not training_args.do_train:
        raise RecipeError("--tune trains every run: it needs --do_train")
    f = tune_args.tune_holdout_fraction
    if f is not None and (isinstance(f, bool) or not isinstance(f, (int, float)) or not 0 < f < 1):
        raise RecipeError(f"--tune_holdout_fraction is the probability that a training row is held out: a number in "
                          f"(0, 1), got {f!r}")
    try:  # sigma_s, and its share of the total (which does not depend on the training's q and steps)
        sigma = tune_args.tune_score_noise_multiplier
        check_score_noise_multiplier(DEFAULT_SCORE_NOISE_MULTIPLIER if sigma is None else sigma)
        if training_args.delta is not None:
            check_score_share(DEFAULT_SCORE_NOISE_MULTIPLIER if sigma is None else sigma, float(training_args.epsilon),
                              float(training_args.delta), trial_count(tune_args.tune_distribution, tune_args.tune_trials))
    except ValueError as e:
        raise RecipeError(f"--tune_{e}") from None
    if tune_args.tune_eval_public is not None:
        raise RecipeError("--tune_eval_public declares the validation set public for --tune_score public; with "
                          "--tune_score private the runs are scored on held-out training rows")
    if training_args.privacy_unit_column is not None:
        raise RecipeError("--tune_score private holds out rows, not units: it cannot go with --privacy_unit_column "
                          "(score on a public validation set, or call hyperparameter_search with score_dataset=)")
    return space


def check_tune_score(tune_args, *, is_regression: bool) -> None:
    """Before the model is loaded: the DP score is the accuracy, which a regression task does not have."""
    if tune_args.tune and tune_args.tune_score == "private" and is_regression:
        raise RecipeError("--tune_score private scores the runs by their held-out accuracy, which a regression task "
                          "does not have: use --tune_score public")


def holdout_coins(n: int, training_args):
    """``n`` independent uniforms in [0, 1) for the hold-out coins: the OS CSPRNG (``--secure_rng``), a stream keyed
    by ``--dp_seed`` (its own key, no other stream's), or OS entropy — not saved by hf_dp."""
    import torch

    from hf_dp.privacy.randomness import csprng_uniform, stream_generator

    if training_args.secure_rng:
        return csprng_uniform(n) - 2.0**-53  # (0, 1] -> [0, 1)
    gen = stream_generator(training_args.dp_seed, "selection", "holdout")
    return torch.rand(n, generator=gen, dtype=torch.float64)


def carve_holdout(raw, tune_args, training_args, max_train_samples=None):
    """``--tune_score private``: ``raw["train"]`` (its first ``max_train_samples`` rows, as the recipe would keep)
    split by an independent coin per row into the rows the runs train on (``raw["train"]``) and the held-out rows
    (``raw[HOLDOUT]``). Returns the number of training rows, or None without a private score."""
    if not tune_args.tune or tune_args.tune_score != "private":
        return None
    train = raw["train"]
    if max_train_samples is not None:
        train = train.select(range(min(len(train), max_train_samples)))
    fraction = tune_args.tune_holdout_fraction if tune_args.tune_holdout_fraction is not None else DEFAULT_HOLDOUT_FRACTION
    held = (holdout_coins(len(train), training_args) < fraction).tolist()
    keep = [i for i, h in enumerate(held) if not h]
    out = [i for i, h in enumerate(held) if h]
    if not keep or not out:
        raise RecipeError(f"--tune_holdout_fraction {fraction:g} of {len(train):,} training rows left "
                          f"{'no training row' if not keep else 'no held-out row'}: change the fraction")
    raw["train"], raw[HOLDOUT] = train.select(keep), train.select(out)
    return len(keep)


def run_tune(trainer, tune_args, space: dict, *, model_init, metric: str, holdout=None):
    """The selection on ``trainer`` (which then holds the best run's model); returns HF's ``BestRun``. With
    ``--tune_score private``, ``holdout`` is the (tokenized) held-out part of the training rows."""
    if tune_args.tune_score == "private":
        best = trainer.hyperparameter_search(
            hp_space=space, n_trials=tune_args.tune_trials, direction="maximize", backend="dp_random_stopping",
            model_init=model_init, distribution=tune_args.tune_distribution, score_data="private",
            score_dataset=holdout, score_noise_multiplier=tune_args.tune_score_noise_multiplier,
        )
        fraction = (tune_args.tune_holdout_fraction if tune_args.tune_holdout_fraction is not None
                    else DEFAULT_HOLDOUT_FRACTION)
        trainer.hyperparameter_selection["score"]["dp_score"]["heldout_split"] = (
            f"each training row held out with probability {fraction:g} by an independent random coin (the split not saved by hf_dp); "
            "the runs trained on the other rows")
        return best
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
