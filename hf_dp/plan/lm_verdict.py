"""The planner's verdict for fine-tuning a pretrained causal LM: is DP fine-tuning at this N, ε, d, learning rate
expected to end worse than no fine-tuning at all (the pretrained model's perplexity)?

The quantity
------------
``R_step = √d·σ/B`` (units of C) is one step's noise norm on the averaged gradient relative to the largest signal norm
C — per coordinate, the noise std σC/B relative to C/√d, the size of a clipped signal of norm C spread evenly over the
d trainable coordinates. An Adam-type rule divides each coordinate by the root of its second-moment estimate, so a
coordinate moves by about the learning rate per step, and the noise's share of that move is at least
R_step/√(1 + R_step²) (the signal per coordinate being at most C/√d). Over T steps these random moves add up in
quadrature: the **noise walk**

    W = lr · √T · R_step / √(1 + R_step²)

is the typical distance each trainable coordinate is pushed by the noise alone over the run, in parameter units
(the peak learning rate: a decaying schedule walks less). Unlike R_run = R_step/√T (which calibrates the
classifiers' expectation, :mod:`hf_dp.plan.calibration`, and falls with more steps), W grows with the steps and the
learning rate: at ε = 3 the LoRA runs of benchmarks/RESULTS.md §10 had R_run 0.13 (no warning) and ended worse than
the pretrained model (perplexity 959 against 893), and at the same R_step the learning rate decided the outcome
(a 25× larger lr turned a gain into a loss).

The calibration
---------------
Measured DP fine-tunings of a small pretrained causal LM (benchmarks/clm_cpu_experiment.py; raw rows
``benchmarks/results/clm_experiment.jsonl``, each DP run beside run ``none`` of the same pretrained model and
evaluation text). Whether a run beats no fine-tuning also depends on how much the task has to gain, which no public
quantity says — the same plan (B = 64, lr 2e-3, 124 steps) ended worse scored on SST-2 dev, where even non-private
fine-tuning gained little (893 → 873), and better scored on held-out SST-2 training phrases, where the pretrained
model was far off (1,945) — so, as for the classifiers, there are two thresholds per family of update rules
(:data:`FAMILIES`): at W ≥ :data:`LM_WORSE_WALK` every measured run ended worse, whatever the text; at W ≥
:data:`LM_WORSE_WALK_LITTLE_GAIN` every measured run scored on text with as little to gain as SST-2 dev (whole review
sentences: the splits :data:`LITTLE_GAIN_SPLITS`) ended worse. Below a threshold the measured runs of the texts it
does not speak for went both ways, and the verdict says so instead of guessing: between the two thresholds on text
with more to gain, below the second on whole sentences (there, runs at W 0.0012–0.0101 ended better or worse: at
W = 0.0069 the same plan ended 77 % of the gain better and 14–31 % worse, by seed; benchmarks/RESULTS.md §10c).
:data:`LM_CALIBRATION` says on how many runs they rest
(tests/test_plan_lm.py checks both against the raw file). A family with no threshold gets no verdict, only the
numbers. Empirical, for that model and data: not bounds.

This module imports nothing of hf_dp.
"""

from __future__ import annotations

import contextlib
import contextvars
import math

#: the update rules' families. Adam-type rules normalise each coordinate; the bias-corrected dp_adambc / dp_adamw_bc
#: take the noise's variance out of the denominator, which makes noise-dominated steps larger (measured: the same W
#: hurts them sooner), so they are a family of their own; SGD's step is proportional to the noise itself, so its walk
#: is another quantity (no verdict)
FAMILIES = {
    "dp_adam": "adam", "dp_adamw": "adam", "dp_macadam": "adam", "dp_adambc": "adam_bc", "dp_adamw_bc": "adam_bc",
    "dp_sgd": "sgd", "dp_sgd_l2": "sgd",
}
#: per family: the noise walk W at and above which every measured run ended worse than no fine-tuning (any text)
LM_WORSE_WALK: dict[str, float] = {"adam": 0.08, "adam_bc": 0.035}
#: per family: the W at and above which every measured run on text with as little to gain as SST-2 dev ended worse
#: (a family without runs there has none)
LM_WORSE_WALK_LITTLE_GAIN: dict[str, float] = {"adam": 0.0158, "adam_bc": 0.002}
#: the evaluation splits of the raw file that have "as little to gain as SST-2 dev": whole review sentences (SST-2 dev;
#: held-out whole training sentences), where the pretrained model is closest (another corpus's splits are named
#: "<corpus>:<split>" in the calibration: the Wikipedia corpus of RESULTS §10c has much to gain)
LITTLE_GAIN_SPLITS = ("dev", "tune_sent")
#: the measured runs behind the thresholds (the raw file is the source; tests check these numbers)
LM_CALIBRATION = {
    "runs": 107,  # measured DP runs with a run "none" of the same pretrained model and scored text
    "scorings": 127,  # (run, scored text) pairs: most runs were scored on several texts
    "worse": 27,  # of the scorings: more than LM_TIE above no fine-tuning's perplexity
    "better": 93,  # more than LM_TIE below it (the rest: ties)
    "little_gain_runs": 72,  # scorings on whole sentences (LITTLE_GAIN_SPLITS)
    # per family, 3 significant digits: the largest W of a run that beat no fine-tuning; the smallest W above it of a
    # run that ended worse; the same on whole sentences (SST-2 dev and the tune split's whole sentences)
    "largest_better_walk": {"adam": 0.0498, "adam_bc": 0.0249},
    "worse_from_walk": {"adam": 0.124, "adam_bc": 0.0498},
    "little_gain_largest_better_walk": {"adam": 0.0126},
    "little_gain_worse_from_walk": {"adam": 0.0151, "adam_bc": 0.00249},
    "optimizers": ("dp_adamw", "dp_adamw_bc"),
    "learning_rates": (0.000481, 0.0005, 0.00063, 0.00066, 0.00078, 0.001, 0.0011, 0.00113, 0.00128, 0.00137,
                       0.00172, 0.002, 0.0022, 0.0025, 0.003, 0.004, 0.005, 0.01, 0.02, 0.05),
    "model": "a 4.7 M-parameter GPT-2 pretrained on public text, LoRA (rank 8 on c_attn), bias terms or the last "
             "block, 4,000 SST-2 sentences as row or user units; one pretrained on QNLI's questions only, 5,000 of its "
             "Wikipedia sentences",
}
#: a run within this fraction of no fine-tuning's perplexity is a tie (neither better nor worse; the thresholds are
#: not checked against it)
LM_TIE = 0.005
#: what the messages cite
SOURCE = "benchmarks/RESULTS.md §10"


#: set by :func:`not_calibrated_for`: why the calibration does not cover the model being trained (None: it does)
_NOT_CALIBRATED: contextvars.ContextVar[str | None] = contextvars.ContextVar("hf_dp_lm_not_calibrated", default=None)


@contextlib.contextmanager
def not_calibrated_for(reason: str):
    """Within this block the start-of-run block (:func:`hf_dp.plan.run_block`) gives no causal-LM verdict, only
    :func:`no_verdict_line` — for a model the calibration does not cover, e.g. one initialised at random (the runs
    behind the thresholds fine-tuned a *pretrained* model: "worse than no fine-tuning" means nothing for random weights).
    ``reason``: what the model is, in words (e.g. "the model starts from random weights (--model_type)")."""
    token = _NOT_CALIBRATED.set(reason)
    try:
        yield
    finally:
        _NOT_CALIBRATED.reset(token)


def not_calibrated_reason() -> str | None:
    """The reason given to the enclosing :func:`not_calibrated_for`, or None."""
    return _NOT_CALIBRATED.get()


#: why the calibration does not cover a model built from a config (the runs behind it fine-tuned a pretrained model)
FROM_SCRATCH = "the model is trained from scratch (built from its config: no pretrained weights were loaded)"


def trained_from_scratch(model) -> bool:
    """Whether ``model`` (or a PEFT model's base) was built from a config rather than loaded with ``from_pretrained``:
    its config names no checkpoint (``name_or_path``) and none of its parameters carries the mark transformers puts on
    the weights ``from_pretrained`` loaded (``_is_hf_initialized``). A model whose weights were loaded otherwise (a
    state dict into a model built from a config) counts as from scratch; a deep copy of a pretrained model (which
    loses the marks) keeps its config's name and does not."""
    get_base = getattr(model, "get_base_model", None)
    model = get_base() if callable(get_base) else model
    config = getattr(model, "config", None)
    if config is None or getattr(config, "name_or_path", None) or getattr(config, "_name_or_path", None):
        return False
    params = getattr(model, "parameters", None)
    return callable(params) and not any(getattr(p, "_is_hf_initialized", False) for p in params())


#: the LoRA adapters of every LoRA run behind the calibration (the recipes' ``--trainable lora`` defaults)
CALIBRATED_LORA = {"r": 8, "lora_alpha": 16}


def lora_not_calibrated(model) -> str | None:
    """Why the calibration does not cover ``model``'s LoRA adapters, or None (no adapters, or the calibrated ones:
    :data:`CALIBRATED_LORA` on PEFT's default modules for the model type). Other adapters move the model differently
    at the same σ, B, T and d: on the wiki corpus rank 2 kept 32 % of the gain where the fit expected 56 %, adapters on
    every linear layer 60 % where it expected 34 %, and on SST-2 those ended far worse than no fine-tuning at a noise
    walk the verdict calls safe (benchmarks/RESULTS.md §10e)."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or not configs:
        return None
    c = next(iter(configs.values()))
    if str(getattr(getattr(c, "peft_type", None), "value", getattr(c, "peft_type", ""))).upper() != "LORA":
        return None
    from peft.utils import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING as mapping

    get_base = getattr(model, "get_base_model", None)
    base = get_base() if callable(get_base) else model
    default = set(mapping.get(getattr(getattr(base, "config", None), "model_type", None)) or ())
    # the adapted modules' paths against those PEFT's default targets name (every layer's, e.g. each block's c_attn)
    adapted = sorted(getattr(model, "targeted_module_names", ()))  # PEFT's list of the adapted modules' paths
    candidates = sorted(n for n, _ in base.named_modules() if n.rsplit(".", 1)[-1] in default)
    same = (c.r, c.lora_alpha) == (CALIBRATED_LORA["r"], CALIBRATED_LORA["lora_alpha"]) and not any(
        getattr(c, k, None) for k in ("rank_pattern", "alpha_pattern", "use_dora", "use_rslora"))
    if same and adapted and adapted == candidates:
        return None
    names = sorted({n.rsplit(".", 1)[-1] for n in adapted})
    where = ", ".join(names) + ("" if set(names) != default or adapted == candidates
                                else f" of some layers only ({len(adapted)} of {len(candidates)} modules)")
    return (f"the LoRA adapters (rank {c.r}, alpha {c.lora_alpha}, on {where}) are not those the causal-LM runs were "
            f"measured with (rank {CALIBRATED_LORA['r']}, alpha {CALIBRATED_LORA['lora_alpha']}, on PEFT's default "
            "modules for the model type in every layer, e.g. GPT-2's c_attn), which move the model differently at the "
            "same sigma, B, T and d")


def calibration_scope(model):
    """Around a run's start-of-run block (:func:`hf_dp.plan.run_block`, :func:`hf_dp.plan.run_expectation`): for a
    model trained from scratch (:func:`trained_from_scratch`, :data:`FROM_SCRATCH`) or LoRA adapters other than the
    calibrated ones (:func:`lora_not_calibrated`), :func:`not_calibrated_for` — one line saying there is no calibrated
    expectation instead of the causal-LM verdict, as the recipes say for ``--model_type``; nothing when an enclosing
    block already gave its reason, or for any other model."""
    if not_calibrated_reason() is None:
        reason = FROM_SCRATCH if trained_from_scratch(model) else lora_not_calibrated(model)
        if reason:
            return not_calibrated_for(reason)
    return contextlib.nullcontext()


def no_verdict_line(reason: str) -> str:
    """The one line that replaces the verdict for a model the calibration does not cover."""
    return (f"hf_dp plan (causal LM): no verdict: {reason}, so no calibrated expectation for this model/task: "
            f"calibrated on fine-tuning a pretrained causal LM ({SOURCE})")


def family(optim: str | None) -> str | None:
    """The family of ``optim`` (an hf_dp DP optimizer name), or None for any other."""
    return FAMILIES.get(str(getattr(optim, "value", optim) or "").lower())


def r_step(sigma: float, batch_size: float, params: int) -> float:
    """√d·σ/B: one step's noise norm on the averaged gradient, in units of C (= the per-coordinate noise std σC/B
    relative to C/√d)."""
    return math.sqrt(params) * float(sigma) / float(batch_size)


def walk(sigma: float, batch_size: float, params: int, steps: int, learning_rate: float) -> float:
    """W = lr·√T·R_step/√(1 + R_step²): the noise's walk per trainable coordinate over the run (see the docstring)."""
    r = r_step(sigma, batch_size, params)
    return float(learning_rate) * math.sqrt(steps) * r / math.sqrt(1.0 + r * r)


def expected_worse(sigma: float, batch_size: float, params: int, steps: int, learning_rate: float | None,
                   optim: str | None) -> str | None:
    """``"worse"`` (every measured run this noisy ended worse), ``"worse_little_gain"`` (every one on text with as
    little to gain as SST-2 dev did), ``"not_worse"``, or None (no threshold for the family, or no learning rate)."""
    fam = family(optim) or ""
    if fam not in LM_WORSE_WALK or learning_rate is None:
        return None
    w = walk(sigma, batch_size, params, steps, learning_rate)
    if w >= LM_WORSE_WALK[fam]:
        return "worse"
    return "worse_little_gain" if w >= LM_WORSE_WALK_LITTLE_GAIN.get(fam, math.inf) else "not_worse"


def _basis() -> str:
    c = LM_CALIBRATION
    lrs = ", ".join(f"{x:g}" for x in c["learning_rates"])
    return (f"calibrated on {c['runs']} measured DP fine-tuning runs of a small pretrained causal LM ({c['model']}; "
            f"{', '.join(c['optimizers'])} at lr {lrs}; {SOURCE}), scored {c['scorings']} times on held-out text: "
            f"{c['worse']} worse than the model without fine-tuning, {c['better']} better, "
            f"{c['scorings'] - c['worse'] - c['better']} within {LM_TIE:.1%}; {c['little_gain_runs']} of the scorings on "
            "whole sentences as in SST-2 dev")


def lm_verdict(*, sigma: float, batch_size: float, params: int, steps: int, learning_rate: float | None,
               optim: str | None, who: str = "this plan", batch_fix: int | None = None) -> tuple[bool | None, str]:
    """(expected worse?, the verdict line) for a DP fine-tuning of a pretrained causal LM: True for either threshold
    (the line says which), False below both, None without a verdict. ``batch_fix``: a larger logical batch at the same
    epochs that would bring W below the threshold reached, when the caller knows one (the planner's table)."""
    name = str(getattr(optim, "value", optim) or "?")
    fam = family(optim) or ""
    r = r_step(sigma, batch_size, params)
    head = (f"hf_dp plan (causal LM): R_step = √d·σ/B = {r:.3g} (d = {params:,}, σ = {sigma:.4g}, B = {batch_size:g})")
    verdict = expected_worse(sigma, batch_size, params, steps, learning_rate, optim)
    if verdict is None:
        why = ("no learning rate given (--learning_rate)" if fam in LM_WORSE_WALK else
               f"the causal-LM calibration has no threshold for {name} (Adam-type rules only)")
        return None, f"{head}; no causal-LM verdict: {why}, so no calibrated expectation for this model/task: {_basis()}"
    w = walk(sigma, batch_size, params, steps, learning_rate)
    head += f", noise walk W = lr·√T·R_step/√(1 + R_step²) = {w:.3g} (lr = {learning_rate:g}, T = {steps:,})"
    c = LM_CALIBRATION
    if verdict == "not_worse":
        below = LM_WORSE_WALK_LITTLE_GAIN.get(fam, LM_WORSE_WALK[fam])
        best = c["largest_better_walk"].get(fam)
        seen = (f"measured runs of this family beat no fine-tuning up to W = {best:g}" if best is not None else
                "no measured run of this family beat no fine-tuning")
        quiet = c["little_gain_largest_better_walk"].get(fam)
        if fam in LM_WORSE_WALK_LITTLE_GAIN:
            seen += ("; on a task with as little to gain as SST-2 dev (whole sentences) measured runs this quiet went "
                     "both ways" + (f" (better up to W = {quiet:g})" if quiet is not None else "") + ": no verdict there")
        return False, (f"{head} < {below:g}: {who} is not expected to make the model worse than no fine-tuning where "
                       f"there is something to gain; {seen} ({_basis()})")
    limit = LM_WORSE_WALK[fam] if verdict == "worse" else LM_WORSE_WALK_LITTLE_GAIN[fam]
    if verdict == "worse":
        what = (f"{who} is expected to make the model worse than no fine-tuning: every measured run at W ≥ "
                f"{c['worse_from_walk'][fam]:g} ended with a higher perplexity than the pretrained model")
    else:
        quiet = c["little_gain_largest_better_walk"].get(fam)
        what = (f"{who} is expected to make the model worse than no fine-tuning on a task with as little to gain as "
                f"SST-2 dev (whole review sentences): every measured run there at W ≥ "
                f"{c['little_gain_worse_from_walk'][fam]:g} ended worse"
                + (f", runs up to W = {quiet:g} better" if quiet is not None else "")
                + f"; on text where the pretrained model was far off, runs at such W went both ways (better up to "
                f"W = {c['largest_better_walk'][fam]:g})")
    exact = learning_rate * limit / w  # W is linear in lr; said rounded down to 2 significant digits
    step = 10.0 ** (math.floor(math.log10(exact)) - 1)
    fixes = [f"a learning rate of at most {math.floor(exact / step) * step:.2g}",
             (f"a logical batch of at least {batch_fix:,} at these epochs (fewer, less noisy steps)" if batch_fix else
              "a larger logical batch at these epochs (fewer, less noisy steps; python -m hf_dp.plan --causal_lm "
              "--learning_rate LR shows W per batch size)"),
             "fewer trainable parameters (a smaller LoRA rank or fewer adapted modules)",
             "more data (units), which lets a larger batch keep the same number of steps"]
    # (a bias-corrected Adam is no remedy for W: measured, dp_adamw_bc ended worse at a W where dp_adamw did not)
    return True, (f"{head} ≥ {limit:g}: {what}. Under an Adam-type rule each coordinate moves by about the learning "
                  f"rate per step, the noise's share of it at least R_step/√(1 + R_step²), and W is how far the noise "
                  f"alone walks each coordinate over the run ({_basis()}). What would bring W below {limit:g}: "
                  + "; or ".join(fixes))
