"""The planner's expected share of the non-private gain for a DP fine-tuning of a pretrained causal LM (LoRA or a few
parameters, an Adam-type rule), from public quantities only.

The quantity
------------
Under an Adam-type rule each coordinate of the noisy averaged gradient is divided by the root of its second moment,
which the noise inflates. With the per-coordinate noise std σC/B and a clipped signal of about a·C/√d per coordinate
(a: how much of a unit's clipped gradient the units have in common), one step moves each coordinate by about
lr·a/√(a² + R_step²) along the signal (R_step = √d·σ/B, :func:`hf_dp.plan.lm_verdict.r_step`). Over T steps the
**signal movement**

    S = lr · T / √(a² + R_step²)      (a = :data:`ALIGNMENT`, fitted: 1; the mean learning rate of the schedule)

is how far the signal carries each coordinate. With a = 1 it is the noise walk's companion: W = S·R_step/√T
(:mod:`hf_dp.plan.lm_verdict`: how far the noise alone walks). S explains what one learning rate could not
(benchmarks/RESULTS.md §10c): at the same lr a user-level run (few units, R_step ≈ 2) moves about half as far as a
row-level run of the same rows (R_step ≈ 0.5), and the measured runs on one text with much to learn kept about the
same share at the same S, whatever their unit, batch, steps or lr.

The prediction
--------------
How much of the non-private gain a run keeps depends on the text as much as on S, and no public quantity says which
text it is, so the planner states the expectation for the kind of text it was calibrated on where it is predictable:
text with **much to learn** (the pretrained model far from it: a register the pretraining never saw) — the share
rises with S and saturates, fitted as

    share ≈ SHARE_MAX · (1 − exp(−S / SHARE_SCALE))

(a, SHARE_MAX, SHARE_SCALE minimising the largest error) on every measured DP run of that kind in the raw file (``benchmarks/results/clm_experiment.jsonl``, corpus ``wiki``:
a GPT-2 pretrained on QNLI's questions, fine-tuned on its Wikipedia sentences; :data:`LM_SHARE` says on how many runs
it rests, tests/test_plan_lm.py refits it from the file and checks every run against it). On text **close to the
pretraining** (SST-2 dev's whole sentences, where non-private fine-tuning gains little) the measured shares of the same
S spread over more than 50 points from seed to seed and fall below zero past S ≈ :data:`LITTLE_GAIN_LAST_GOOD` —
the line says so and predicts nothing there. Empirical, for that model and data: not a bound.

It imports nothing of hf_dp but :mod:`hf_dp.plan.lm_verdict`, whose line it extends (:func:`verdict_and_share`).
"""

from __future__ import annotations

import math

from hf_dp.plan.lm_verdict import lm_verdict

#: a, how much of a unit's clipped gradient the units have in common, per coordinate (fitted with SHARE_MAX and
#: SHARE_SCALE, among 0.25, 0.5, 0.75, 1, 1.5, 2)
ALIGNMENT = 1.0
#: the fitted saturation: the largest share of the non-private gain the measured runs on text with much to learn
#: approach as S grows
SHARE_MAX = 0.68
#: the fitted scale of S over which the share approaches SHARE_MAX
SHARE_SCALE = 0.01375
#: the largest S of the measured runs the fit rests on (beyond it, the planner does not extrapolate)
SHARE_LARGEST_S = 0.034
#: on text close to the pretraining (SST-2 dev's whole sentences): the largest S at which a measured run kept a
#: positive share of the gain; beyond it every one ended worse than no fine-tuning
LITTLE_GAIN_LAST_GOOD = 0.022
#: the S at which the measured runs with much to learn kept about half of the gain (the line names the learning rate
#: that would reach it, and what it did on text close to the pretraining)
HALF_GAIN_S = 0.018
#: the measured runs behind the fit (tests/test_plan_lm.py recomputes these from the raw file)
LM_SHARE = {
    "runs": 30,  # DP runs on text with much to learn, beside the non-private run and run "none" of their model and text
    "largest_error": 0.041,  # the largest |predicted − measured| share over them
}
#: the update rules the prediction is for (an Adam-type step moves each coordinate by about the learning rate)
ADAM_RULES = ("dp_adam", "dp_adamw", "dp_macadam")
#: the mean learning rate of a schedule relative to its peak (warmup aside)
SCHEDULE_MEAN = {"constant": 1.0, "constant_with_warmup": 1.0, "linear": 0.5, "cosine": 0.5}


def signal_move(learning_rate: float, sigma: float, batch_size: float, params: int, steps: int,
                alignment: float = ALIGNMENT) -> float:
    """S = lr·T/√(a² + R_step²), R_step = √d·σ/B (``learning_rate``: the schedule's mean)."""
    r = math.sqrt(params) * float(sigma) / float(batch_size)
    return float(learning_rate) * int(steps) / math.sqrt(alignment ** 2 + r * r)


def learning_rate_for(move: float, sigma: float, batch_size: float, params: int, steps: int,
                      alignment: float = ALIGNMENT) -> float:
    """The constant learning rate whose signal movement is ``move``: S·√(a² + R_step²)/T."""
    r = math.sqrt(params) * float(sigma) / float(batch_size)
    return float(move) * math.sqrt(alignment ** 2 + r * r) / max(1, int(steps))


def predicted_share(move: float, share_max: float = SHARE_MAX, scale: float = SHARE_SCALE) -> float:
    """The expected share of the non-private gain on text with much to learn at signal movement S = ``move``."""
    return share_max * (1.0 - math.exp(-max(0.0, float(move)) / scale))


def share_sentence(*, sigma: float, batch_size: float, params: int, steps: int, learning_rate: float | None,
                   optim: str | None, schedule: str = "constant") -> str | None:
    """The start-of-run sentence with the expected share, or None (not an Adam-type rule, no learning rate, or a
    schedule whose mean rate :data:`SCHEDULE_MEAN` does not know). ``learning_rate``: the peak; ``schedule``: HF's
    ``lr_scheduler_type`` (S reads the schedule's mean rate)."""
    name = str(getattr(optim, "value", optim) or "").lower()
    schedule = str(getattr(schedule, "value", schedule) or "constant")
    if name not in ADAM_RULES or learning_rate is None or schedule not in SCHEDULE_MEAN:
        return None
    mean = SCHEDULE_MEAN[schedule]
    s = signal_move(learning_rate * mean, sigma, batch_size, params, steps)
    basis = (f"fitted on {LM_SHARE['runs']} measured runs, largest error {LM_SHARE['largest_error']:.0%}, "
             f"benchmarks/RESULTS.md §10c")
    if s > SHARE_LARGEST_S:
        head = (f"signal movement S = lr·T/√(a² + R_step²) = {s:.3g} (a = {ALIGNMENT:g}, {schedule} schedule) is beyond "
                f"the measured runs (S ≤ {SHARE_LARGEST_S:g}): no expected share of the non-private gain")
    else:
        head = (f"signal movement S = lr·T/√(a² + R_step²) = {s:.3g} (a = {ALIGNMENT:g}, {schedule} schedule"
                + (f": mean lr {learning_rate * mean:.2g}" if mean != 1.0 else "") + "): expected "
                f"to keep ≈ {predicted_share(s):.0%} of the non-private LoRA gain on text with much to learn "
                f"({basis})")
    if s < HALF_GAIN_S:
        lr = learning_rate_for(HALF_GAIN_S, sigma, batch_size, params, steps) / mean
        head += (f"; a {'peak ' if mean != 1.0 else ''}learning rate of {lr:.2g} would move it S = {HALF_GAIN_S:g} "
                 f"(≈ {predicted_share(HALF_GAIN_S):.0%} "
                 "there); on SST-2 dev a user-level run near that S (lr 1.37e-3 constant, S ≈ 0.020) ended worse than no "
                 "fine-tuning on 2 of 3 seeds")
    close = (f"on text close to the pretraining (little to gain, as SST-2 dev) measured shares at such S spread "
             f"widely between seeds, and every run past S ≈ {LITTLE_GAIN_LAST_GOOD:g} ended worse than no fine-tuning"
             if s <= LITTLE_GAIN_LAST_GOOD else
             f"on text close to the pretraining (little to gain, as SST-2 dev) every measured run past S ≈ "
             f"{LITTLE_GAIN_LAST_GOOD:g} ended worse than no fine-tuning")
    return f"{head}; {close}"


def verdict_and_share(**verdict) -> tuple[bool | None, str]:
    """:func:`hf_dp.plan.lm_verdict.lm_verdict` of the same keywords, its line followed by the expected share of the
    non-private gain (:func:`share_sentence`) where the update rule has one."""
    schedule = verdict.pop("schedule", "constant")  # the share reads the schedule's mean; the walk W its peak
    worse, line = lm_verdict(**verdict)
    share = share_sentence(**{k: verdict.get(k) for k in ("sigma", "batch_size", "params", "steps", "learning_rate",
                                                          "optim")}, schedule=schedule)
    return worse, line if share is None else f"{line}. hf_dp plan (causal LM): {share}"
