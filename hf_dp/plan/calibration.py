"""The planner's calibration table and its verdict: what a plan's noise figures mean for the result.

The thresholds on R_run (:data:`CONSTANT_R_RUN`, :data:`CONSTANT_R_RUN_ALL`, measured runs in :data:`CALIBRATION`),
the worst-case warning level (:data:`WARN_R_RUN`), the learning rates of the planner's large batches
(:data:`PLANNED_LR`), which models the calibrated expectation applies to (:func:`calibrated_for`), and the messages a
plan or a run prints. The rows, plans and the start-of-run block are :mod:`hf_dp.plan.plans`; the command line is
:mod:`hf_dp.plan.cli`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

WARN_R_RUN = 1.0
#: The calibrated expectation (issue 31 item 3), from measured runs of the recipes' defaults (MiniLM ``last_block``,
#: dp_adamw at the planned learning rate, C = 0.1, the planner's batch at 10 epochs) on nested random subsets of SST-2
#: and QNLI *train* from 1,000 rows to the full QNLI subset and 8,000 SST-2 rows at ε ∈ {1, 3, 8} (benchmarks/RESULTS.md §0b, raw
#: benchmarks/results/planner_calibration.jsonl, benchmarks/planner_calibration.py). A run "ended at the constant
#: predictor" when its GLUE dev accuracy was less than 3 points above the dev set's majority class. How much R_run a
#: task tolerates depends on the task — on how well its per-example gradients agree, which no public quantity says —
#: so there are two thresholds: at R_run ≥ :data:`CONSTANT_R_RUN` every measured run of the harder task (QNLI, sentence
#: pairs) ended at the constant predictor; at R_run ≥ :data:`CONSTANT_R_RUN_ALL` every measured run of either task did.
#: Empirical thresholds for that model family and those tasks, not bounds (tests/test_plan.py checks them against the
#: raw file).
CONSTANT_R_RUN = 0.75
CONSTANT_R_RUN_ALL = 4.0
#: the measured runs behind the two thresholds, for the messages (the raw file is the source; tests check these)
CALIBRATION = {"hard_task": "QNLI", "easy_task": "SST-2", "easy_learned_up_to": 2.27}
#: what the classifiers' expectation was measured on: the line of a model or task it does not cover names it
CALIBRATED_ON = ("BERT-family sequence classifiers (MiniLM's last block, dp_adamw, C = 0.1) on random subsets of SST-2 "
                 "and QNLI train (1,000 to 8,999 rows) at ε ∈ {1, 3, 8}, benchmarks/RESULTS.md §0b")
#: below :data:`CONSTANT_R_RUN` every measured run of either task learned (at least :data:`LEARNED_POINTS` points
#: above the dev set's majority class): the largest such R_run and, per task, the points above the majority class
#: (tests/test_plan.py checks these against the raw file)
LEARNED_POINTS = 3.0
LEARNED = {"largest_r_run": 0.686, "points": {"QNLI": (6.4, 15.0), "SST-2": (25.7, 30.8)}}
#: Learning rates for the planner's large logical batches (a few dozen to a few hundred steps): what the recipes use
#: when the planner chooses the batch and --learning_rate is not given, and what ``python -m hf_dp.plan`` prints.
#: Chosen on tune splits carved from the *training* rows, never on GLUE dev: dp_adamw on QNLI at the planner's
#: B = 1,024 (benchmarks/RESULTS.md §1, lr grid 1e-3 … 3e-2), the others at B = 256 / 64 steps (§4).
PLANNED_LR: dict[str, float] = {
    "dp_adamw": 1e-2, "dp_adamw_bc": 1e-2, "dp_adam": 1e-2, "dp_adambc": 3e-3, "dp_sgd": 40.0, "dp_sgd_l2": 40.0,
    "dp_macadam": 1e-2,
}

def fmt_e(e: float) -> str:
    return f"{e:g}"


def noisy_message(row, who: str = "this plan") -> str:
    return (
        f"hf_dp plan: {who} is noise-dominated: R_run = √d·σ/(B·√T) = {row.r_run:.3g} > {WARN_R_RUN:g} "
        f"(d = {row.params:,}, σ = {row.sigma:.4g}, B = {row.batch_size}, T = {row.steps}): the noise accumulated over "
        f"the whole run exceeds the largest signal it can accumulate (T·C), i.e. the per-step noise norm √d·σC/B = "
        f"{row.r_step:.3g}·C is more than √T = {math.sqrt(row.steps):.3g} times the clipped signal bound C. A larger "
        "logical batch at the same epochs, more epochs, a larger epsilon or fewer trainable parameters lower it "
        "(python -m hf_dp.plan)"
    )


def constant_message(row, who: str = "this plan", remedies: dict | None = None) -> str:
    """The calibrated expectation of ``row`` (R_run ≥ :data:`CONSTANT_R_RUN`), with what would bring R_run below it."""
    hard, easy = CALIBRATION["hard_task"], CALIBRATION["easy_task"]
    measured = ("(MiniLM's last block, subsets of SST-2 and QNLI train of 1,000 to 8,999 rows, ε ∈ {1, 3, 8}; "
                "benchmarks/RESULTS.md §0b)")
    if row.constant_expected_all:
        text = (f"hf_dp plan: expected result of {who}: the constant predictor. R_run = {row.r_run:.3g} ≥ "
                f"{CONSTANT_R_RUN_ALL:g}, and every measured run at R_run ≥ {CONSTANT_R_RUN_ALL:g} {measured} ended no "
                "better than always predicting the majority class. ")
    else:
        text = (f"hf_dp plan: expected result of {who} on a task as hard as {hard}: the constant predictor. R_run = "
                f"{row.r_run:.3g} ≥ {CONSTANT_R_RUN:g}, and every measured {hard} run at R_run ≥ {CONSTANT_R_RUN:g} "
                f"{measured} ended no better than always predicting the majority class; an easier task ({easy}) still "
                f"learned at R_run up to {CALIBRATION['easy_learned_up_to']:g}. ")
    text += f"What would bring R_run below {CONSTANT_R_RUN:g}: "
    options = []
    if remedies is not None:
        if remedies.get("n"):
            options.append(f"about {remedies['n']:,} training rows (units) at this ε")
        if remedies.get("epsilon"):
            options.append(f"ε = {remedies['epsilon']:g} at this N")
    else:
        options.append("more data or a larger ε (python -m hf_dp.plan shows how much)")
    options.append(f"at most {row.max_params:,} trainable parameters instead of {row.params:,} (a smaller --trainable "
                   "set, e.g. LoRA or fewer blocks)")
    return text + "; or ".join(options)


def calibrated_for(model) -> bool:
    """Whether the calibrated expectation (:data:`CONSTANT_R_RUN`, measured with BERT-family sequence classifiers on
    GLUE classification tasks) applies to ``model``: a BERT-family encoder's sequence classifier with at least two
    classes; not a regression head (its result is no majority-class accuracy), a causal LM, nor other models."""
    config = getattr(model, "config", None)
    kinds = {"bert", "roberta", "distilbert", "xlm-roberta", "electra", "deberta", "deberta-v2", "albert", "mpnet"}
    regression = getattr(config, "problem_type", None) == "regression" or getattr(config, "num_labels", 2) == 1
    return (type(model).__name__.endswith("ForSequenceClassification") and getattr(config, "model_type", None) in kinds
            and not regression)


@dataclass(frozen=True)
class Expectation:
    """What the planner expects of a run before it trains (issue 53 item 3), stated in the start-of-run block and
    compared with the result by the recipes' summary.

    ``kind``: ``"learns"`` (a calibrated classifier below :data:`CONSTANT_R_RUN`), ``"constant_hard"`` (at or above
    it: the constant predictor on a task as hard as QNLI), ``"constant"`` (at or above :data:`CONSTANT_R_RUN_ALL`),
    ``"lm_not_worse"`` / ``"lm_worse"`` / ``"lm_worse_little_gain"`` (the causal-LM verdict,
    :mod:`hf_dp.plan.lm_verdict`), or ``"none"`` (no calibration covers this model or task). ``line``: the sentence
    the block prints (a warning when ``warning``); ``summary``: the expected result in a few words (for the summary);
    ``r_run``: the run's R_run."""

    kind: str
    line: str
    summary: str
    r_run: float | None = None
    warning: bool = False

    @property
    def calibrated(self) -> bool:
        return self.kind != "none"

    @property
    def expects_constant(self) -> bool | None:
        """True / False when the expectation is (not) the constant predictor; None for a causal LM or none."""
        return {"learns": False, "constant_hard": True, "constant": True}.get(self.kind)


def classifier_expectation(row, calibrated: bool, who: str = "this run", remedies: dict | None = None) -> Expectation:
    """The expectation of a sequence classifier's plan ``row`` (a :class:`hf_dp.plan.plans.PlanRow` with d): the
    constant predictor at or above :data:`CONSTANT_R_RUN` (:func:`constant_message`, a warning), else what the measured
    runs below it did; ``calibrated`` False (a model :func:`calibrated_for` does not cover): one line saying so and
    what the calibration is."""
    r = row.r_run
    if not calibrated or not row.params or not math.isfinite(r):
        why = "" if row.params else " (d, the number of trainable parameters, is not known)"
        return Expectation("none", f"hf_dp plan: no calibrated expectation for this model/task{why}: calibrated on "
                                   f"{CALIBRATED_ON}; R_run = {r:.3g} alone does not say whether {who} will learn",
                           f"none (calibrated on {CALIBRATION['easy_task']} and {CALIBRATION['hard_task']} with "
                           "BERT-family classifiers only)", r_run=r if math.isfinite(r) else None)
    if row.constant_expected:
        kind = "constant" if row.constant_expected_all else "constant_hard"
        summary = ("the constant predictor" if kind == "constant" else
                   f"the constant predictor on a task as hard as {CALIBRATION['hard_task']}")
        return Expectation(kind, constant_message(row, who, remedies=remedies), summary, r_run=r, warning=True)
    pts = LEARNED["points"]
    seen = ", ".join(f"{task} +{lo:g} to +{hi:g}" for task, (lo, hi) in pts.items())
    return Expectation(
        "learns",
        f"hf_dp plan: expected result of {who}: at least {LEARNED_POINTS:g} points above the constant predictor on a "
        f"task no harder than {CALIBRATION['hard_task']}: every measured run at R_run < {CONSTANT_R_RUN:g} learned "
        f"({seen} points above the majority class; calibrated on {CALIBRATED_ON}); a harder task (examples whose "
        "gradients agree less) can still end at the constant predictor (the recipes' summary compares)",
        f"at least {LEARNED_POINTS:g} points above the constant predictor on a task no harder than "
        f"{CALIBRATION['hard_task']}", r_run=r)
