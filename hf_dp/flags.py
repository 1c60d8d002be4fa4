"""What every ``transformers.TrainingArguments`` field means for a DP run: one registry, the source of truth.

Each field is ``safe`` (keeps its meaning; the reason says why that is compatible with the guarantee),
``adjusted`` (hf_dp changes or narrows what it does, and says how), ``refused`` (a DP run with it set
fails with one sentence), or ``refused when …`` (refused only at the values a predicate names). Refusals
and adjustments apply to DP runs only (not with ``--disable_dp``); :class:`~hf_dp.arguments.DPTrainingArguments`
enforces them from this registry (:func:`enforce`). ``docs/privacy_flags.md`` is generated from it::

    python -m hf_dp.flags > docs/privacy_flags.md

and ``tests/test_flags.py`` fails when the installed transformers has a field the registry does not classify
(or the doc is stale), so that "every HF flag keeps its meaning or is refused with a reason" stays true.
"""

from __future__ import annotations

import dataclasses
import sys
from dataclasses import dataclass
from typing import Any, Callable

SAFE, ADJUSTED, REFUSED, REFUSED_WHEN = "safe", "adjusted", "refused", "refused when"


@dataclass(frozen=True)
class Policy:
    status: str
    reason: str
    #: for ``refused``/``refused when``: args -> True if the run must be refused
    refuse_if: Callable[[Any], bool] | None = None
    #: the ValueError message (one sentence)
    message: str | None = None
    #: for ``refused when``: the values, in words, for the table
    when: str | None = None


def _safe(reason: str) -> Policy:
    return Policy(SAFE, reason)


def _adjusted(reason: str) -> Policy:
    return Policy(ADJUSTED, reason)


def _refused_when(when: str, reason: str, refuse_if: Callable[[Any], bool], message: str) -> Policy:
    return Policy(REFUSED_WHEN, reason, refuse_if, message, when)


def _set(value) -> bool:
    """True if a flag is on (not None/False/empty/0/'no')."""
    v = getattr(value, "value", value)
    return v not in (None, False, "", 0, 0.0, "no", "False", "None", [], {})


_EVAL = "evaluation only (the eval set is not protected by ε and is never the training set: refused)"
_SPEED = "speed or memory of the same computation"
_META = "metadata or I/O of the run; nothing computed from the private data"
_NOT_PRIVATE_LOG = "the logged training loss is computed from private batches without noise: not private, never part of the card's guarantee"

POLICIES: dict[str, Policy] = {
    # ---- output, batch, schedule ------------------------------------------------------------------
    "output_dir": _safe(_META + "; checkpoints there are not a release (README: what is stored on disk)"),
    "per_device_train_batch_size": _adjusted("the *expected* per-device batch of Poisson sampling: B = per_device × gradient_accumulation_steps × world_size, q = B/N; physical batches fluctuate around it"),
    "num_train_epochs": _adjusted("an epoch is round(1/q) Poisson steps (one expected pass over the data); σ is calibrated for the planned steps"),
    "max_steps": _safe("the planned number of noisy steps: σ is calibrated for it with --epsilon"),
    "learning_rate": _safe("a public hyper-parameter of the update rule (post-processing)"),
    "lr_scheduler_type": _safe("the schedule of η: post-processing of the noisy gradients"),
    "lr_scheduler_kwargs": _safe("the schedule of η: post-processing of the noisy gradients"),
    "warmup_steps": _safe("the schedule of η: post-processing of the noisy gradients"),
    "optim": _adjusted("redefined by DPTrainingArguments: a DP optimizer name (dp_adamw, …); HF names only with --disable_dp"),
    "optim_args": _safe("extra hyper-parameters of the DP update rule (numbers or true/false)"),
    "weight_decay": _safe("HF's decay / no-decay groups, applied by the DP update rule to θ (post-processing)"),
    "adam_beta1": _safe("update-rule hyper-parameter (post-processing)"),
    "adam_beta2": _safe("update-rule hyper-parameter (post-processing)"),
    "adam_epsilon": _safe("update-rule hyper-parameter (post-processing)"),
    "optim_target_modules": _refused_when(
        "set", "only HF's GaLore/APOLLO-style optimizers read it; a DP optimizer would silently ignore it",
        lambda a: _set(a.optim_target_modules),
        "--optim_target_modules selects modules for HF's GaLore/APOLLO optimizers, which are not DP optimizers; choose the trained parameters with --trainable",
    ),
    "gradient_accumulation_steps": _adjusted("splits one Poisson-sampled logical batch into micro-batches; clipping per example, noise once per logical batch"),
    "average_tokens_across_devices": _adjusted("no effect on the DP loss: hf_dp divides Σ ℓ_i by the expected batch, never by token counts (num_items_in_batch is ignored)"),
    "max_grad_norm": _adjusted("set to 0: HF would clip (and log the norm of) the non-private summed gradient; DP clips each example to C (--per_sample_max_grad_norm)"),
    "label_smoothing_factor": _refused_when(
        "> 0", "hf_dp computes each example's loss itself (cross-entropy without label smoothing)",
        lambda a: bool(a.label_smoothing_factor),
        "--label_smoothing_factor is not applied by DPTrainer's per-example loss (plain cross-entropy); drop it under DP",
    ),
    # ---- precision, compilation, kernels -------------------------------------------------------------
    "bf16": _safe("bf16 autocast; per-example norms and clipped sums are computed in float32"),
    "fp16": _refused_when(
        "set", "dynamic loss scaling skips steps depending on private gradients (a data-dependent decision outside the mechanism)",
        lambda a: bool(a.fp16),
        "--fp16 is not supported with DP: dynamic loss scaling skips steps depending on private gradients; use --bf16 or fp32",
    ),
    "bf16_full_eval": _safe(_EVAL),
    "fp16_full_eval": _safe(_EVAL),
    "tf32": _safe(_SPEED + " (TF32 matmuls on Ampere GPUs)"),
    "activation_checkpointing": _refused_when(
        "set", "recomputed forward passes re-run the per-example clipping engines' capture hooks; not supported or tested with DP",
        lambda a: _set(a.activation_checkpointing),
        "--activation_checkpointing is not supported with DP: recomputed forward passes re-run the per-example clipping hooks",
    ),
    "activation_checkpointing_kwargs": _safe("read only with activation_checkpointing, which is refused"),
    "gradient_checkpointing": _refused_when(
        "set", "recomputed forward passes re-run the per-example clipping engines' capture hooks; not supported or tested with DP",
        lambda a: bool(a.gradient_checkpointing),
        "--gradient_checkpointing is not supported with DP: recomputed forward passes re-run the per-example clipping hooks",
    ),
    "gradient_checkpointing_kwargs": _safe("read only with gradient_checkpointing, which is refused"),
    "torch_compile": _refused_when(
        "set", "compiled graphs and the per-example clipping hooks are not tested together: clipping could be skipped silently",
        lambda a: bool(a.torch_compile),
        "--torch_compile is not supported with DP: the per-example clipping engines rely on module hooks that compilation is not tested with",
    ),
    "torch_compile_backend": _safe("read only with torch_compile, which is refused"),
    "torch_compile_mode": _safe("read only with torch_compile, which is refused"),
    "use_liger_kernel": _refused_when(
        "set", "Liger kernels replace layers and the loss (fused linear cross-entropy) that per-example clipping hooks into",
        lambda a: bool(a.use_liger_kernel),
        "--use_liger_kernel is not supported with DP: its fused kernels replace the layers and loss that per-example clipping needs",
    ),
    "liger_kernel_config": _safe("read only with use_liger_kernel, which is refused"),
    "use_cache": _safe("the model's key/value cache at generation; no effect on classification training"),
    "neftune_noise_alpha": _refused_when(
        "set", "NEFTune's embedding noise is not part of the DP mechanism (it counts for nothing in ε) and is skipped with the frozen-prefix cache",
        lambda a: _set(a.neftune_noise_alpha),
        "--neftune_noise_alpha is not supported with DP: its embedding noise is not the DP noise and counts for nothing in epsilon",
    ),
    "torch_empty_cache_steps": _safe(_SPEED),
    "auto_find_batch_size": _refused_when(
        "set", "it shrinks the batch after an out-of-memory error, changing B and q mid-run while the accountant assumes one q",
        lambda a: bool(a.auto_find_batch_size),
        "--auto_find_batch_size changes the batch size mid-run, so the sampling rate q the accountant uses would be wrong; set the batch size yourself",
    ),
    # ---- logging -------------------------------------------------------------------------------------------
    "logging_strategy": _safe("when to log; ε is added to every log, HF's grad_norm dropped; " + _NOT_PRIVATE_LOG),
    "logging_steps": _safe("when to log; ε is added to every log, HF's grad_norm dropped; " + _NOT_PRIVATE_LOG),
    "logging_first_step": _safe("when to log; " + _NOT_PRIVATE_LOG),
    "log_on_each_node": _safe(_META),
    "logging_nan_inf_filter": _safe("only what the logged loss shows; " + _NOT_PRIVATE_LOG),
    "include_num_input_tokens_seen": _refused_when(
        "not 'no'", "it logs how many tokens the Poisson batches held: batch sizes computed from private data outside the mechanism",
        lambda a: str(getattr(a.include_num_input_tokens_seen, "value", a.include_num_input_tokens_seen)) not in ("no", "False", "None"),
        "--include_num_input_tokens_seen logs how many tokens the Poisson-sampled batches held, which reveals batch sizes computed from private data outside the DP mechanism; it is not allowed with DP",
    ),
    "log_level": _safe(_META),
    "log_level_replica": _safe(_META),
    "disable_tqdm": _safe(_META),
    "report_to": _safe("trackers receive the logs: ε and eval metrics, and the training loss, which " + _NOT_PRIVATE_LOG.split(": ", 1)[1]),
    "run_name": _safe(_META),
    "project": _safe(_META),
    "trackio_space_id": _safe(_META),
    "trackio_bucket_id": _safe(_META),
    "trackio_static_space_id": _safe(_META),
    # ---- evaluation -------------------------------------------------------------------------------------------
    "eval_strategy": _safe(_EVAL),
    "eval_steps": _safe(_EVAL),
    "eval_delay": _safe(_EVAL),
    "per_device_eval_batch_size": _safe(_EVAL),
    "prediction_loss_only": _safe(_EVAL),
    "eval_on_start": _safe(_EVAL),
    "eval_do_concat_batches": _safe(_EVAL),
    "eval_use_gather_object": _safe(_EVAL),
    "eval_accumulation_steps": _safe(_EVAL),
    "include_for_metrics": _safe(_EVAL),
    "batch_eval_metrics": _safe(_EVAL),
    # ---- saving, Hub ----------------------------------------------------------------------------------------------
    "save_only_model": _safe("the model alone is DP; a checkpoint without optimizer.pt holds no ledger, so resuming from it is refused"),
    "save_strategy": _safe("checkpoints get hf_dp's completion marker and ledger; they are not a release"),
    "save_steps": _safe("checkpoints get hf_dp's completion marker and ledger; they are not a release"),
    "save_on_each_node": _safe(_META),
    "save_total_limit": _safe("old checkpoints are rotated only after the newest one's completion marker is written"),
    "enable_jit_checkpoint": _safe("the checkpoint on termination goes through DPTrainer's checkpoint path (ledger + marker)"),
    "push_to_hub": _safe("pushes output_dir's final model, card and privacy.json; HF's push skips checkpoint-* and _* (the kept prefix cache)"),
    "hub_token": _safe(_META),
    "hub_private_repo": _safe(_META),
    "hub_model_id": _safe(_META),
    "hub_strategy": _refused_when(
        "checkpoint or all_checkpoints",
        "those upload checkpoint folders, whose trainer_state.json holds the non-private training loss and whose marker a fingerprint of the training data; every_save and end push the final folder only",
        lambda a: str(getattr(a.hub_strategy, "value", a.hub_strategy)) in ("checkpoint", "all_checkpoints"),
        "--hub_strategy checkpoint/all_checkpoints would upload checkpoint folders, which hold the non-private training loss (trainer_state.json) and a fingerprint of the training data; use every_save or end, which push the final model only",
    ),
    "hub_always_push": _safe(_META),
    "hub_revision": _safe(_META),
    "load_best_model_at_end": _safe("model selection on the eval set: outside the guarantee, and the card says which data selected the model; the eval set may not be the training set"),
    "metric_for_best_model": _safe("model selection on the eval set: outside the guarantee (stated in the card)"),
    "greater_is_better": _safe("model selection on the eval set: outside the guarantee (stated in the card)"),
    "ignore_data_skip": _safe("every step's Poisson draw is fresh, so skipping or not after a resume replays nothing"),
    "restore_callback_states_from_checkpoint": _safe("callback state (e.g. early stopping counters)"),
    # ---- seeds, devices -----------------------------------------------------------------------------------------------
    "full_determinism": _safe("HF's global RNGs and kernels; DP sampling and noise do not use them (OS entropy, or --dp_seed)"),
    "seed": _safe("HF's global RNGs (initialisation, dropout); DP sampling and noise do not use them (OS entropy, or --dp_seed)"),
    "data_seed": _refused_when(
        "set", "it seeds HF's train sampler, which Poisson sampling replaces; a reproducible DP run needs --dp_seed (recorded in the card)",
        lambda a: a.data_seed is not None,
        "--data_seed seeds HF's train sampler, which DP's Poisson sampling replaces; use --dp_seed for a reproducible run",
    ),
    "use_cpu": _safe(_SPEED),
    "accelerator_config": _safe("hf_dp's training loader is not prepared by Accelerate (each rank draws its own Poisson shard), so batch splitting/dispatching applies to evaluation only"),
    "parallelism_config": _refused_when(
        "set", "tensor/context/sequence parallelism splits examples across devices; per-example clipping is not supported there",
        lambda a: _set(a.parallelism_config),
        "--parallelism_config (tensor/context parallelism) is not supported with DP: per-example clipping needs each example on one device",
    ),
    # ---- data loading --------------------------------------------------------------------------------------------------
    "dataloader_drop_last": _adjusted("applies to evaluation only: a Poisson batch is never dropped (every noisy step is what was drawn, possibly empty)"),
    "dataloader_num_workers": _safe(_SPEED + "; the Poisson batch sampler runs in the main process"),
    "dataloader_pin_memory": _safe(_SPEED),
    "dataloader_persistent_workers": _safe(_SPEED),
    "dataloader_prefetch_factor": _safe(_SPEED + "; prefetched draws are fresh randomness whether trained on or not"),
    "dataloader_multiprocessing_context": _safe(_SPEED),
    "dataloader_in_order": _safe(_SPEED),
    "remove_unused_columns": _safe("which dataset columns reach the model"),
    "label_names": _safe("which input keys are labels"),
    "train_sampling_strategy": _refused_when(
        "not 'random'", "Poisson sampling (what the accountant assumes) replaces HF's train sampler: 'random' is adjusted to it, other strategies cannot apply",
        lambda a: str(getattr(a.train_sampling_strategy, "value", a.train_sampling_strategy)) != "random",
        "--train_sampling_strategy must stay 'random' with DP: Poisson sampling, which the accountant assumes, replaces HF's train sampler",
    ),
    "length_column_name": _safe("read only by the sampling strategies that are refused"),
    # ---- distributed ----------------------------------------------------------------------------------------------------
    "ddp_find_unused_parameters": _safe("DDP wrapping; clipped sums are all-reduced once per logical batch after the noise"),
    "ddp_bucket_cap_mb": _safe(_SPEED),
    "ddp_broadcast_buffers": _safe(_SPEED),
    "ddp_static_graph": _safe(_SPEED),
    "ddp_backend": _safe(_SPEED),
    "ddp_timeout": _safe(_META),
    "fsdp": _refused_when(
        "set", "per-example clipping is not implemented for sharded parameters (docs/fsdp.md)",
        lambda a: _set(a.fsdp),
        "--fsdp is not supported with DP: per-example clipping is not implemented for sharded parameters",
    ),
    "fsdp_config": _refused_when(
        "set together with fsdp", "read only with fsdp (per-example clipping is not implemented for sharded parameters: docs/fsdp.md)",
        lambda a: _set(a.fsdp_config) and _set(a.fsdp),
        "--fsdp_config is not supported with DP: per-example clipping is not implemented for sharded parameters",
    ),
    "deepspeed": _refused_when(
        "set", "DeepSpeed takes over the optimizer step and gradient reduction; DP with it is neither implemented nor tested",
        lambda a: _set(a.deepspeed),
        "--deepspeed is not supported with DP: it takes over the optimizer step and gradient reduction that the DP mechanism needs",
    ),
    "debug": _refused_when(
        "set", "underflow/overflow debugging prints statistics of activations computed from private examples",
        lambda a: _set(a.debug),
        "--debug prints statistics of activations computed from private examples outside the DP mechanism; it is not allowed with DP",
    ),
    "skip_memory_metrics": _safe(_META),
    "do_train": _safe("read by scripts only"),
    "do_eval": _safe("read by scripts only"),
    "do_predict": _safe("read by scripts only"),
    "resume_from_checkpoint": _safe("read by scripts; DPTrainer.train(resume_from_checkpoint=…) resumes only complete checkpoints and continues ε"),
    "local_rank": _safe(_META),
}


def refusals(args) -> list[str]:
    """The messages of every refused flag set in ``args`` (a DP run), in field order."""
    out = []
    for name, policy in POLICIES.items():
        if policy.refuse_if is not None and hasattr(args, name) and policy.refuse_if(args):
            out.append(policy.message)
    return out


def enforce(args) -> None:
    """Raise the first refusal (ValueError, one sentence) for a DP run; adjust what the registry adjusts."""
    found = refusals(args)
    if found:
        raise ValueError(found[0])
    args.max_grad_norm = 0.0


def unclassified(fields=None) -> list[str]:
    """``TrainingArguments`` fields of the installed transformers that the registry does not classify."""
    from transformers import TrainingArguments

    names = [f.name for f in dataclasses.fields(TrainingArguments)] if fields is None else fields
    return [n for n in names if n not in POLICIES]


def markdown() -> str:
    """``docs/privacy_flags.md``: the registry as a table."""
    import transformers
    from transformers import TrainingArguments

    names = [f.name for f in dataclasses.fields(TrainingArguments)]
    counts = {s: sum(1 for n in names if POLICIES[n].status == s) for s in (SAFE, ADJUSTED, REFUSED_WHEN, REFUSED)}
    lines = [
        "# Every `TrainingArguments` flag under DP",
        "",
        "<!-- generated by `python -m hf_dp.flags > docs/privacy_flags.md` from `hf_dp/flags.py`; do not edit -->",
        "",
        f"Generated from the registry in `hf_dp/flags.py` for transformers {transformers.__version__}: all {len(names)} fields of",
        f"`TrainingArguments` — {counts[SAFE]} safe, {counts[ADJUSTED]} adjusted, {counts[REFUSED_WHEN] + counts[REFUSED]} refused (at the values given).",
        "Refusals are one `ValueError` sentence from `DPTrainingArguments` (DP runs only; `--disable_dp` runs keep HF's behaviour).",
        "`tests/test_flags.py` fails when a transformers release adds a field nobody classified, or when this file is stale.",
        "",
        "| flag | under DP | why |",
        "| --- | --- | --- |",
    ]
    for n in names:
        p = POLICIES[n]
        status = f"refused when {p.when}" if p.status == REFUSED_WHEN else p.status
        lines.append(f"| `--{n}` | {status} | {p.reason} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # pragma: no cover - exercised by tests/test_flags.py through markdown()
    sys.stdout.write(markdown())
