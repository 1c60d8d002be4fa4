"""What ``privacy.json`` and the model card say about a run.

:func:`privacy_report` (a DP run: every number of the guarantee, read from the run's
:class:`~hf_dp.privacy.mechanism.Mechanism` — ``describe()``, ``unit_report()``, ``unit_of_privacy`` — and its
ledger), :func:`non_private_report` (``--disable_dp``: says so, and records the optimizer and trainable set), and
their parts. They take the pieces they read: the mechanism, the ledger, and :class:`RunFacts` (the run's public
settings and facts), which ``DPTrainer.privacy_report()`` gathers; this module imports neither the trainer nor the
mechanism's module (duck-typed).
"""

from __future__ import annotations

import contextlib
import dataclasses
import re
from dataclasses import dataclass
from typing import Any

from hf_dp import __version__
from hf_dp.privacy.randomness import CSPRNG, SEEDED


@dataclass(frozen=True)
class RunFacts:
    """What the report reads of a run besides its mechanism and ledger: public settings and facts only (of the data,
    the eval sets' names and sizes, which a selection on them depends on). ``DPTrainer.privacy_report`` makes it; the
    DP parts come from the run's privacy state (:meth:`with_state`)."""

    args: Any  # the run's (DP)TrainingArguments
    objective: str | None = None  # the loss trained (hf_dp.models.loss: sequence_classification, causal_lm)
    trainable_info: Any = None  # hf_dp.models.freezing.TrainableInfo (None: --trainable not applied)
    cache_frozen_features: bool = False
    callbacks: tuple = ()  # the trainer's callbacks (early stopping selects the model on eval data)
    eval_dataset: Any = None  # the eval set(s) (a dict of named sets, one set, or None)
    # under DP, from the privacy state (hf_dp.run.state.PrivacyState)
    rule: Any = None  # the update rule (hf_dp.optim.base.DPUpdateRule) the privatizer drives, once built
    randomness: str | None = None  # hf_dp.privacy.randomness: entropy, csprng or seeded
    clipping: str | None = None  # the clipping engine's name
    bounds: Any = None  # hf_dp.clipping.common.TokenBounds: the run's public token bounds
    run_id: str | None = None
    noise_seed: int | None = None  # --dp_seed as the run was built with it (the privacy state's, not args')
    selection: dict | None = None  # a private hyper-parameter selection's record (hf_dp.tuning.search)
    audit: dict | None = None  # the one-run audit's record (hf_dp.audit.canaries.after_train), once audited

    def with_state(self, dp) -> "RunFacts":
        """These facts plus the parts of the run's privacy state ``dp`` (:class:`hf_dp.run.state.PrivacyState`) the
        report reads besides its mechanism and ledger."""
        return dataclasses.replace(
            self, rule=getattr(dp.optimizer, "rule", None), randomness=dp.randomness, clipping=dp.clipping,
            bounds=dp.bounds, run_id=dp.run_id, noise_seed=dp.noise_seed, selection=dp.selection.record,
            audit=dp.audit_record)


def _lm_loss_weighting(args, run: RunFacts) -> dict | None:
    """A causal LM's per-example loss (``--lm_loss_weighting``): the weighting, and under ``token`` the public length
    each sequence's token sum was divided by (the run's token bound); None for another head."""
    if run.objective != "causal_lm":
        return None
    weighting = getattr(args, "lm_loss_weighting", "sequence")
    token = weighting == "token" and run.bounds is not None
    return {"weighting": weighting, "token_norm": int(run.bounds.max_length) if token else None}


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


def privacy_report(mechanism, ledger, run: RunFacts, *, epsilon: float) -> dict:
    """All numbers of the guarantee of a DP run, as written to ``privacy.json`` and the model card: the planned
    ``mechanism``'s (:class:`hf_dp.privacy.mechanism.Mechanism`: its ``describe()``, ``unit_of_privacy`` and
    ``unit_report()``), the ``ledger``'s (steps, epochs, whose runs), ``epsilon`` spent (``DPTrainer.get_epsilon``) and
    the run's settings (``run``, with the privacy state's parts: :meth:`RunFacts.with_state`)."""
    args = run.args
    hyper = {}
    if run.rule is not None:  # the rule describes itself: its variant and the hyper-parameters its update reads
        hyper = _schedule(args, run.rule.describe())
    described = dict(mechanism.describe())  # δ, target ε, accountant, σ, C, q, B, N and its source, the adjacency, T
    planned_steps = described.pop("planned_steps")
    ledger_record = ledger_report(ledger)
    return {
        "hf_dp_version": __version__,
        "differential_privacy": True,
        "objective": run.objective,
        # a causal LM's per-example loss: each sequence's mean over its tokens, or its token sum over the public length
        "lm_loss_weighting": _lm_loss_weighting(args, run),
        "epsilon": epsilon,
        **described,
        "steps": ledger.steps,
        "planned_steps": planned_steps,
        "epochs": ledger_epochs(ledger),
        # banded noise (privacy.json's correlated_noise): each unit only at the steps of its partition, at rate b·q
        "sampling": "cyclic_poisson" if described.get("correlated_noise") else "poisson",
        "unit_of_privacy": mechanism.unit_of_privacy,
        "privacy_unit": mechanism.unit_report(),
        "secure_rng": run.randomness == CSPRNG,
        "randomness": run.randomness,
        "dp_seed": run.noise_seed if run.randomness == SEEDED else None,  # the seed the run drew with, not args' now
        "clipping": run.clipping,
        "clipping_rounding": rounding_report(run.bounds),
        "cache_frozen_features": bool(run.cache_frozen_features),
        "optimizer": {"name": str(args.optim), "hyperparameters": hyper},
        "trainable": trainable_report(run.trainable_info, args.trainable),
        "model_selection": model_selection_report(args, run.callbacks, run.eval_dataset),
        "hyperparameter_selection": run.selection,  # hf_dp.tuning.search
        "run_id": run.run_id,
        "ledger": ledger_record,
        # trained without DP too (hf_dp.run.lineage.mark_non_private): what the guarantee does not cover, said once
        **({"non_private_training": non_private_training()} if ledger_record.get("trained_without_dp_after") else {}),
        # --audit_canaries: the one-run audit's record (hf_dp.audit.canaries.after_train), once the run was audited
        **({"audit": dict(run.audit)} if run.audit else {}),
    }


def non_private_training() -> dict:
    """``privacy.json``'s statement for a DP run's model that was also trained without DP (a ``--disable_dp`` run after
    one of its DP runs; the ledger's ``trained_without_dp_after``): the DP guarantee does not cover that training."""
    return {
        "trained_without_dp": True,
        "note": (
            "after DP training, this model was also trained WITHOUT differential privacy (a non-private run, "
            "--disable_dp): no privacy guarantee covers the data of that training, and the (epsilon, delta) of this "
            "report holds for an example of the DP training data only if that example was not also used in the "
            "non-private training"
        ),
    }


def ledger_epochs(ledger) -> float:
    """Passes over the data the ledger counts: Σ q·steps over its history (earlier runs' included); with a banded run
    in it (whose history holds its DP-SGD equivalent rounds), Σ q·steps over its runs."""
    runs = ledger.runs() if hasattr(ledger, "runs") else []
    if any(r.get("noise_bands", 1) != 1 for r in runs):
        return float(sum(float(r["sample_rate"]) * int(r["steps"]) for r in runs if r.get("sample_rate") is not None))
    return float(sum(float(q) * int(n) for _, q, n in ledger.accountant.history))


def ledger_report(ledger) -> dict:
    """Whose steps ε counts: the runs of this model on this data (earlier ones first, this one last), the runs not
    counted (other or unknown data), the checkpoint this run resumed from (its run and step) and the steps counted
    past it (its run's, other resumes'). Public numbers and run ids only (the ledger's own public record)."""
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


def merged_weight_names(adapter_names) -> list[str]:
    """The plain model's weights a LoRA adapter is merged into, from the trained PEFT tensor names:
    ``base_model.model.X.lora_A.default.weight`` → ``X.weight`` (merged: W + (α/r)·B·A), and a trained copy of a
    module (``X.modules_to_save.default.weight``) → ``X.weight`` (it replaces the base's); order kept, no repeats."""
    out: dict[str, None] = {}
    for name in adapter_names:
        plain = name.removeprefix("base_model.model.")
        plain = re.sub(r"\.lora_(?:A|B|embedding_A|embedding_B|magnitude_vector)\.[^.]+(\.weight)?$", ".weight", plain)
        plain = re.sub(r"\.modules_to_save\.[^.]+\.", ".", plain)
        out[plain] = None
    return list(out)


#: what a LoRA release holds (privacy.json's ``trainable.release``; the card says it too)
LORA_RELEASE = ("merged: the released weights are the base model's with the trained LoRA adapter merged into them "
                "(W + (lora_alpha/r)·B·A, by peft's merge_and_unload) and no adapter tensors; 'names' are the adapter "
                "tensors that were trained, 'merged_into' the released weights they changed (a checkpoint-* folder "
                "keeps the adapter unmerged)")


def trainable_report(info, trainable: str | None) -> dict:
    """The parameters trained: ``info`` (:class:`hf_dp.models.freezing.TrainableInfo`), else ``trainable`` (the
    ``--trainable`` mode). A LoRA run also says that its release is merged and which released weights the adapter
    changed (:func:`merged_weight_names`)."""
    out = {
        "mode": info.mode if info else trainable,
        "trainable_params": info.num_trainable if info else None,
        "total_params": info.num_total if info else None,
        "names": list(info.trainable_names) if info else None,
    }
    if out["mode"] == "lora":
        out["release"] = LORA_RELEASE
        out["merged_into"] = merged_weight_names(out["names"] or [])
    return out


def non_private_report(run: RunFacts, optimizer, steps: int) -> dict:
    """The report of a ``--disable_dp`` run: says so, and records the optimizer (HF's, its first parameter group's
    hyper-parameters), the ``steps`` taken (``state.global_step``) and the trainable set."""
    args = run.args
    hyper: dict[str, Any] = {}
    groups = getattr(optimizer, "param_groups", None)
    if groups:
        hyper = {k: (list(v) if isinstance(v, tuple) else v) for k, v in groups[0].items()
                 if k not in ("params", "lr", "initial_lr") and isinstance(v, (int, float, tuple)) and not isinstance(v, bool)}
    hyper = _schedule(args, hyper)
    return {
        "hf_dp_version": __version__,
        "differential_privacy": False,
        "objective": run.objective,
        "steps": steps,
        "cache_frozen_features": bool(run.cache_frozen_features),
        "optimizer": {"name": str(getattr(args.optim, "value", args.optim)), "hyperparameters": hyper},
        "trainable": trainable_report(run.trainable_info, args.trainable),
        "model_selection": model_selection_report(args, run.callbacks, run.eval_dataset),
    }


def model_selection_report(args, callbacks, eval_ds) -> dict:
    """Which data chose the released model: the training run alone, or an eval set (best checkpoint /
    early stopping: an ``EarlyStoppingCallback`` among ``callbacks``). Such a selection depends on the eval data
    ``eval_ds``, outside the (ε, δ) guarantee."""
    from transformers import EarlyStoppingCallback

    early = any(isinstance(cb, EarlyStoppingCallback) for cb in callbacks)
    best = bool(args.load_best_model_at_end)
    metric = args.metric_for_best_model if (best or early) else None
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
