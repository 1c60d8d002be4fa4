"""What ``privacy.json`` and the model card say about a run, read from a ``DPTrainer``.

:func:`privacy_report` (a DP run: every number of the guarantee), :func:`non_private_report`
(``--disable_dp``: says so, and records the optimizer and trainable set), and their parts. The trainer
is passed in (duck-typed; this module does not import it); ``DPTrainer.privacy_report()`` calls these.
"""

from __future__ import annotations

import contextlib
from typing import Any

from hf_dp import __version__
from hf_dp.privacy.randomness import CSPRNG, SEEDED


def _schedule(args, hyper: dict) -> dict:
    hyper["weight_decay"] = args.weight_decay
    hyper["lr"] = args.learning_rate
    hyper["lr_scheduler_type"] = str(getattr(args.lr_scheduler_type, "value", args.lr_scheduler_type))
    return hyper


def rounding_report(bounds) -> dict | None:
    """The public constants the float32 rounding allowance of the clipped sum comes from (issue 49): every example
    (unit) is clipped so that its contribution plus its share of that rounding — γ of the terms — is ≤ C, the
    sensitivity the accountant uses; no count of the data enters it."""
    if bounds is None:
        return None
    n, u = bounds.sum_terms + 2, 2.0**-24  # γ_n = n·u/(1 − n·u), float32's worst-case relative rounding of n terms
    return {"max_length": bounds.max_length, "max_tokens_per_micro_batch": bounds.max_tokens,
            "sum_terms": bounds.sum_terms, "allowance_gamma": n * u / (1 - n * u),
            "sensitivity": "C: each example's clipped contribution plus gamma times its rounding terms is <= C"}


def privacy_report(trainer) -> dict:
    """All numbers of the guarantee of a DP run, as written to ``privacy.json`` and the model card."""
    args, spec = trainer.args, trainer.dp.spec
    steps = trainer.dp.ledger.steps
    rule = trainer.dp.optimizer.rule if trainer.dp.optimizer is not None else None
    hyper = {}
    if rule is not None:  # the rule describes itself: its variant and the hyper-parameters its update reads
        hyper = _schedule(args, rule.describe())
    return {
        "hf_dp_version": __version__,
        "differential_privacy": True,
        "objective": _objective(trainer),
        "epsilon": trainer.get_epsilon(),
        "delta": spec.delta,
        "target_epsilon": spec.target_epsilon,
        "accountant": spec.accountant,
        "noise_multiplier": spec.noise_multiplier,
        "max_grad_norm": spec.max_grad_norm,
        "sample_rate": spec.sample_rate,
        "expected_batch_size": spec.expected_batch_size,
        "dataset_size": spec.dataset_size,
        "dataset_size_source": trainer.dp.mechanism.dataset_size_source,  # declared, or counted (hf_dp.run.setup)
        "neighbouring_relation": neighbouring_relation(trainer),
        "steps": steps,
        "planned_steps": spec.planned_steps,
        "epochs": ledger_epochs(trainer.dp.ledger),
        "sampling": "poisson",
        "unit_of_privacy": unit_of_privacy(trainer),
        "privacy_unit": privacy_unit_report(trainer),
        "secure_rng": trainer.dp.randomness == CSPRNG,
        "randomness": trainer.dp.randomness,
        "dp_seed": args.dp_seed if trainer.dp.randomness == SEEDED else None,
        "clipping": trainer.dp.clipping,
        "clipping_rounding": rounding_report(trainer.dp.bounds),
        "cache_frozen_features": bool(trainer._prefix_cache),
        "optimizer": {"name": str(args.optim), "hyperparameters": hyper},
        "trainable": trainable_report(trainer),
        "model_selection": model_selection_report(trainer),
        "hyperparameter_selection": trainer.dp.selection.record,  # hf_dp.tuning.search
        "run_id": trainer.dp.run_id,
        "ledger": ledger_report(trainer),
        # --audit_canaries: the one-run audit's record (hf_dp.audit.canaries.after_train), once the run was audited
        **({"audit": dict(trainer.dp.audit_record)} if trainer.dp.audit_record else {}),
    }


def _objective(trainer) -> str | None:
    """The loss the run trained (``hf_dp.models.loss``: sequence_classification, causal_lm)."""
    obj = getattr(trainer, "objective", None)
    return getattr(obj, "name", None)


def privacy_unit_report(trainer) -> dict:
    """What one unit of privacy is: a row, or the rows sharing a value of ``--privacy_unit_column``. The number of
    rows is not reported: under unit-level DP it is a statistic of the private data (e.g. how many blocks the units'
    texts make) that ε does not cover; N, the number of units, is the accountant's: the declared
    ``--public_dataset_size``, else the actual count (then not protected either: ``dataset_size_source``)."""
    args = trainer.args
    col = getattr(args, "privacy_unit_column", None)
    n = trainer.dp.spec.dataset_size
    if col is None:
        return {"level": "row", "column": None, "num_units": n, "max_rows_per_unit": None,
                "description": f"example-level (row-level) DP: one unit = one row of the training set, N = {n:,}"}
    k = getattr(args, "max_rows_per_unit", None)
    cap = f"; at most {k} random rows of a drawn unit per step" if k else "; every row of a drawn unit enters its step"
    return {"level": "unit", "column": col, "num_units": n, "max_rows_per_unit": k,
            "description": f"unit-level DP (user-level when one value is one person): one unit = all rows with the same "
                           f"'{col}', N = {n:,} units; each unit's summed gradient is clipped to C{cap}"}


def neighbouring_relation(trainer) -> str:
    """The adjacency ε is stated for, as a field (as jax_privacy records it): add/remove one example, or one unit."""
    col = getattr(trainer.args, "privacy_unit_column", None)
    return "add/remove one example" if col is None else f"add/remove one unit (all rows of one '{col}')"


def unit_of_privacy(trainer) -> str:
    col = getattr(trainer.args, "privacy_unit_column", None)
    if col is None:
        return "one training example (add/remove adjacency)"
    return f"all training rows with the same '{col}' (add/remove adjacency of one unit)"


def ledger_epochs(ledger) -> float:
    """Passes over the data the ledger counts: Σ q·steps over its history (earlier runs' included)."""
    return float(sum(float(q) * int(n) for _, q, n in ledger.accountant.history))


def ledger_report(trainer) -> dict:
    """Whose steps ε counts: the runs of this model on this data (earlier ones first, this one last), the runs not
    counted (other or unknown data), the checkpoint this run resumed from (its run and step) and the steps counted
    past it (its run's, other resumes'). Public numbers and run ids only (the ledger's own public record)."""
    ledger = trainer.dp.ledger
    build = getattr(ledger, "public_record", None)
    record = dict(build()) if callable(build) else {}
    record.pop("format", None)
    record.pop("epsilon", None)  # the report's own "epsilon"
    record["note"] = (
        "epsilon counts every noisy step of the runs listed under 'runs' (every earlier DP run of this model unless "
        "declared disjoint, and the steps computed from the same checkpoints by other runs: 'counted_past_parent'); "
        "runs under 'separate' trained this model on data declared disjoint from this training data (--prior_privacy "
        "separate) and are not counted"
    )
    return record


def trainable_report(trainer) -> dict:
    info = trainer.trainable_info
    return {
        "mode": info.mode if info else trainer.args.trainable,
        "trainable_params": info.num_trainable if info else None,
        "total_params": info.num_total if info else None,
        "names": list(info.trainable_names) if info else None,
    }


def non_private_report(trainer) -> dict:
    """The report of a ``--disable_dp`` run: says so, and records the optimizer and trainable set."""
    args = trainer.args
    hyper: dict[str, Any] = {}
    optimizer = getattr(trainer, "optimizer", None)
    groups = getattr(optimizer, "param_groups", None)
    if groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in groups[0].items()
                 if k not in ("params", "lr", "initial_lr") and isinstance(v, (int, float, tuple)) and not isinstance(v, bool)}
    hyper = _schedule(args, hyper)
    return {
        "hf_dp_version": __version__,
        "differential_privacy": False,
        "objective": _objective(trainer),
        "steps": trainer.state.global_step,
        "cache_frozen_features": bool(getattr(trainer, "_prefix_cache", False)),
        "optimizer": {"name": str(getattr(args.optim, "value", args.optim)), "hyperparameters": hyper},
        "trainable": trainable_report(trainer),
        "model_selection": model_selection_report(trainer),
    }


def model_selection_report(trainer) -> dict:
    """Which data chose the released model: the training run alone, or an eval set (best checkpoint /
    early stopping). Such a selection depends on the eval data, outside the (ε, δ) guarantee."""
    from transformers import EarlyStoppingCallback

    args = trainer.args
    early = any(isinstance(cb, EarlyStoppingCallback) for cb in trainer.callback_handler.callbacks)
    best = bool(args.load_best_model_at_end)
    metric = args.metric_for_best_model if (best or early) else None
    eval_ds = trainer.eval_dataset
    if eval_ds is None:
        names = []
    elif isinstance(eval_ds, dict):
        names = list(eval_ds)
    else:
        names = ["eval_dataset"]
    sizes = {}
    for name, ds in (eval_ds.items() if isinstance(eval_ds, dict) else [("eval_dataset", eval_ds)] if eval_ds is not None else []):
        with contextlib.suppress(TypeError):
            sizes[name] = len(ds)
    selected = best or early
    report = {
        "selected_on_eval_data": selected,
        "load_best_model_at_end": best,
        "early_stopping": early,
        "metric_for_best_model": metric,
        "eval_datasets": names if selected else [],
        "eval_dataset_sizes": sizes if selected else {},
    }
    if selected:
        report["note"] = (
            "the released model was chosen (best checkpoint and/or early stopping) by its metric on the eval data; "
            "this choice depends on the eval data and is outside the privacy guarantee, which covers only the "
            "training data: if the eval data is private, it is not protected"
        )
    return report


def latest_eval_metrics(log_history: list[dict]) -> dict:
    """The ``eval_*`` numbers of the last log entry that has any (``{}`` if none)."""
    for entry in reversed(log_history):
        metrics = {k: v for k, v in entry.items() if k.startswith("eval_") and isinstance(v, (int, float))}
        if metrics:
            return metrics
    return {}
