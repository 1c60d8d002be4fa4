"""A privacy–utility planner: which logical batch size B for a given compute budget, and how noisy.

``python -m hf_dp.plan --n 8999 --epsilon 3 --delta 1e-5 --params 1923074`` prints, for candidate logical batch
sizes B and epochs E, the noise multiplier σ that the accountant calibrates for (ε, δ, q = B/N, steps), the number
of steps and the noise of the averaged gradient, and recommends the B that minimises the documented objective at a
fixed compute budget. Every :class:`DPTrainer` run logs its own row at start, in a few lines (the block with the noise
figures and the table with ``--log_level debug``).

Only public quantities enter: N (the dataset size, which DP-SGD's accountant uses anyway), B, E, ε, δ, the
accountant, the clip norm C and the number d of trainable parameters. No training data is read.

The quantities (all in units of C, the clip norm)
------------------------------------------------
One DP step adds N(0, σ²C²) to the sum of the B clipped gradients and divides by B, so the averaged gradient carries
noise of std **σC/B per coordinate** (``noise_per_step`` = σ/B) and of norm ≈ **√d·σC/B**. Its signal, the mean of
clipped gradients, has norm ≤ C. Hence

* ``R_step = √d·σ/B``: per-step noise norm / the largest possible signal norm (C). It is a *lower* bound on the
  per-step noise-to-signal ratio: the mean clipped gradient is shorter than C whenever examples disagree.
* Over T steps the signal adds up linearly (≤ T·C, if the direction stayed fixed) and the independent noise in
  quadrature (√T·√d·σC/B), so ``R_run = √d·σ/(B·√T) = R_step/√T``: the noise accumulated over the whole run
  relative to the best-case accumulated signal. ``R_epoch = √d·σ/(B·√(N/B)) = √d·σ/√(B·N)`` is the same over one
  epoch; these make configurations with different B and E comparable (linear learning-rate scaling: at a fixed
  number of epochs, η ∝ B keeps the per-epoch signal fixed, and what then differs between batch sizes is R_epoch).

The objective (what "recommended" means)
----------------------------------------
Compute ∝ the number of per-example gradients, E·N, so a *fixed compute budget* is a fixed E; the choice left is B,
and then T = E·round(N/B) steps. Minimising σ/B alone is degenerate: the accountant makes σ/B fall monotonically in B
at fixed E all the way to B = N (measured, ``recipes/README.md``), where only E steps remain. The planner minimises
the standard bound for SGD on a convex C-Lipschitz loss with the privatized gradient (unbiased, second moment
≤ C² + dσ²C²/B²; as in the analysis of Bassily, Smith & Thakurta 2014; Bubeck 2015, §6.1):

    E[f(θ̄_T)] − f* ≤ D·C·√((1 + d·σ²/B²) / T)   (optimal constant step size),

i.e. it minimises ``bound = √((1 + R_step²)/T) = √(1/T + R_run²)`` over the candidate B at the given E: the first
term (optimisation: fewer steps at larger B) against the second (noise: falls with B at fixed E). Ties go to the
smaller B. Candidates that leave fewer than ``min_steps`` steps (:data:`MIN_STEPS` = 50) are shown but not chosen
(unless none has that many; then the one with most steps): the convex bound is happy with a handful of steps, real
fine-tuning with Adam-type rules (bias-corrected moment estimates, a schedule) is not — this floor is a practical
guard, not part of the bound. The bound is worst case in the dimension (isotropic noise against a signal that may live in few
directions; Li et al. 2022, "When does differentially private learning not suffer in high dimensions?"), so it errs
towards larger batches — the direction DP practice also points to at a fixed number of epochs (De et al. 2022,
"Unlocking high-accuracy differentially private image classification through scale"; Li et al. 2022, "Large language
models can be strong differentially private learners"; Sander et al. 2023, "TAN without a burn").

The warning
-----------
``R_run > 1`` (:data:`WARN_R_RUN`): the noise accumulated over the whole run is larger than the largest signal the
run can accumulate (T·C, every clipped gradient of norm C pointing the same way for all T steps), i.e. the per-step
noise norm is more than √T times the clipped signal bound. Then the noise term of the bound exceeds what one noiseless
step gives, and no learning-rate schedule can fix it: only a larger B at the same compute, more epochs, a larger ε
or fewer trainable parameters can. As the bound, the criterion is worst case in d: a run above 1 may still learn
(the useful signal lives in few directions), a run below 1 is not noise-dominated even in the worst case.

The package: :mod:`hf_dp.plan.plans` (rows, plans, the start-of-run block), :mod:`hf_dp.plan.calibration` (the
calibration table and the verdict), :mod:`hf_dp.plan.lm_verdict` (a pretrained causal LM's verdict: is DP fine-tuning
expected to end worse than no fine-tuning? the noise walk lr·√T·R_step/√(1 + R_step²) against thresholds measured
on causal-LM runs), :mod:`hf_dp.plan.lm_share` (the share of the non-private gain a causal-LM plan is expected to
keep on text with much to learn, from its signal movement lr·T/√(a² + R_step²)),
:mod:`hf_dp.plan.noise` (``--noise_comparison``: the noise banded_sqrt would leave in the trajectory at a plan, relative
to independent noise, and which to use), :mod:`hf_dp.plan.noise_line` (the start-of-run block's line on the noise
mechanism), :mod:`hf_dp.plan.cli` (the command line).
"""

from hf_dp.plan.calibration import (
    CALIBRATED_ON,
    CALIBRATION,
    CONSTANT_R_RUN,
    CONSTANT_R_RUN_ALL,
    PLANNED_LR,
    WARN_R_RUN,
    Expectation,
    calibrated_for,
)
from hf_dp.plan.cli import count_trainable, flags_for, main
from hf_dp.plan.lm_verdict import calibration_scope, trained_from_scratch
from hf_dp.plan.plans import (
    CACHE_ENV,
    DEFAULT_BATCH_SIZES,
    DEFAULT_EPOCHS,
    MIN_STEPS,
    Plan,
    PlanRow,
    format_table,
    make_plan,
    noise_multiplier,
    plan_row,
    planned_steps,
    recommend,
    run_block,
    run_expectation,
    split_batch,
)

__all__ = [
    "DEFAULT_BATCH_SIZES", "DEFAULT_EPOCHS", "WARN_R_RUN", "CONSTANT_R_RUN", "CONSTANT_R_RUN_ALL", "MIN_STEPS", "PlanRow", "Plan", "planned_steps", "noise_multiplier",
    "plan_row", "make_plan", "recommend", "split_batch", "run_block", "main", "PLANNED_LR", "count_trainable",
    "flags_for", "calibrated_for", "CALIBRATION", "CACHE_ENV", "format_table", "Expectation", "run_expectation",
    "CALIBRATED_ON", "calibration_scope", "trained_from_scratch",
]
