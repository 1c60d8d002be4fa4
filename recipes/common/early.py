"""Refusals a recipe can make before any expensive work (loading the data, tokenizing, building the frozen-prefix
cache): the model cannot be found, ``--resume_from_checkpoint True`` with no complete checkpoint, a resume whose
privacy settings differ from the checkpoint's. Each is one :class:`~recipes.common.args.RecipeError` sentence; the
library (``DPTrainer``) makes the same refusals again later, so nothing here weakens a check — it only moves the
user's answer to the first seconds of the run."""

from __future__ import annotations

import os
from typing import Optional

from .args import RecipeError


def check_model_loadable(model_args) -> None:
    """The model's config can be read (a local folder, a preset, or a Hub id reachable or cached), before any data is
    read: offline, a Hub id that is not cached is refused here instead of after loading the data."""
    from transformers import AutoConfig

    from .model import check_local_paths, model_load_error, resolve_model_path

    model_path = resolve_model_path(model_args.model_name_or_path)
    check_local_paths(("--model_name_or_path", model_path), ("--config_name", model_args.config_name),
                      ("--tokenizer_name", model_args.tokenizer_name))
    name = resolve_model_path(model_args.config_name) if model_args.config_name else model_path
    try:
        AutoConfig.from_pretrained(name, cache_dir=model_args.cache_dir, revision=model_args.model_revision,
                                   token=model_args.token, trust_remote_code=model_args.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise model_load_error(model_args, exc) from None


def resume_checkpoint(value, output_dir: str) -> Optional[str]:
    """The checkpoint folder ``--resume_from_checkpoint`` names (``True``: the newest complete one in ``output_dir``),
    or None for a fresh run; a resume with nothing complete to resume from is refused."""
    from hf_dp.run import checkpointing

    if value is None or value is False:
        return None
    if value is True:
        path = checkpointing.find_last_complete_checkpoint(output_dir, deep=False)
        if path is None:
            found = checkpointing.list_checkpoints(output_dir)
            detail = (f"its {len(found)} checkpoint folder(s) are incomplete" if found
                      else "it holds no checkpoint-N folder")
            raise RecipeError(
                f"--resume_from_checkpoint True: nothing to resume in --output_dir {output_dir} ({detail}); drop the "
                "flag to start a new run, or give the --output_dir of the run to continue"
            )
        return path
    path = os.fspath(value)
    problem = checkpointing.checkpoint_problem(path, deep=False)
    if problem is not None:
        raise RecipeError(f"--resume_from_checkpoint {path}: not a complete hf_dp checkpoint ({problem})")
    return path


def check_resume_settings(training_args, value, n_train: int) -> None:
    """A resume (``value`` as :func:`resume_checkpoint` takes it) whose planned mechanism — σ (calibrated as DPTrainer
    will calibrate it), C, q, B, N, δ, accountant — differs from the checkpoint's recorded one is refused now, with
    the same list of differences DPTrainer would give after tokenizing and caching."""
    from hf_dp.run import checkpointing
    from hf_dp.privacy.accounting import _same
    from hf_dp.privacy.planning import plan_mechanism

    from .run import public_size

    path = resume_checkpoint(value, training_args.output_dir)
    if path is None or not training_args.dp_enabled or not training_args.do_train:
        return
    if getattr(training_args, "audit_canaries", None):
        return  # N counts the canaries there, and DPTrainer refuses a resume of an audited run (hf_dp.audit.canaries)
    saved = (checkpointing.read_marker(path) or {}).get("privacy_spec")
    if not isinstance(saved, dict):
        return  # DPTrainer refuses a marker without its spec when it loads the checkpoint
    try:
        spec, _, _ = plan_mechanism(
            n=public_size(training_args, n_train), per_device_batch=training_args.per_device_train_batch_size,
            accumulation=training_args.gradient_accumulation_steps, world_size=training_args.world_size,
            delta=training_args.delta, epsilon=training_args.epsilon, noise_multiplier=training_args.noise_multiplier,
            max_grad_norm=training_args.per_sample_max_grad_norm, accountant=training_args.accountant,
            max_steps=training_args.max_steps, num_train_epochs=training_args.num_train_epochs,
            noise_mechanism=getattr(training_args, "noise_mechanism", "independent"),
            noise_bands=getattr(training_args, "noise_bands", 1),
        )
    except ValueError as exc:
        raise RecipeError(str(exc)) from None
    saved = {**checkpointing.SPEC_DEFAULTS, **saved}  # a marker written before correlated noise: independent noise
    changed = [k for k in checkpointing.MECHANISM_FIELDS if not _same(saved.get(k), getattr(spec, k))]
    if changed:
        detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {getattr(spec, k)!r}" for k in changed)
        raise RecipeError(
            f"refusing to resume from {path}: the privacy settings differ from the checkpoint's ({detail}); resume "
            "with the original flags (batch size, epochs or max_steps, ε or σ, C, δ, accountant, noise mechanism, "
            "training rows) or start a new run in another --output_dir"
        )
