"""What every ``transformers.TrainingArguments`` field does to the DP guarantee: one registry.

:data:`FLAGS` maps each dataclass field of ``TrainingArguments`` to one or more :class:`Rule` s. A rule
has a status, a one-line reason, and optionally a condition (``when``: a predicate on the arguments,
with its human-readable text). For a DP run :meth:`DPTrainingArguments.__post_init__
<hf_dp.arguments.DPTrainingArguments.__post_init__>` calls :func:`enforce`, which takes each field's
first rule whose condition holds (the last rule of a field is unconditional) and

* ``refused``: raises ``ValueError(reason)`` — the reason *is* the error message (one sentence);
* ``adjusted``: applies the rule's ``adjust`` (e.g. ``max_grad_norm`` → 0), or, when it has none,
  DPTrainer changes what the flag does (the reason says how);
* ``safe`` / ``outside``: nothing.

Statuses (all for DP runs; ``--disable_dp`` runs are plain HF runs):

* **refused** — the flag would break the guarantee or its accounting (non-private quantities of the
  training data logged or uploaded, a sampling or loss the accountant does not describe, steps
  skipped or replayed), or would be silently ignored by DPTrainer, or is not supported with
  per-example clipping;
* **adjusted** — DP changes the value or what the flag does;
* **safe** — the released model and ``privacy.json`` keep the guarantee whatever the value;
* **outside** — allowed, the model keeps the guarantee, but what the flag produces (logs of the
  training loss, checkpoints, choices made on the eval set) is *not* covered by it.

Fields that ``TrainingArguments`` gains in a newer transformers release are not in the registry:
:func:`enforce` refuses them under DP when they differ from their default (nobody has checked what
they do), and ``tests/test_flags.py`` fails until they are classified here.

The table ``docs/privacy_flags.md`` is generated from :data:`FLAGS` by :mod:`hf_dp.flags_table`
(``python -m hf_dp.flags_table --markdown > docs/privacy_flags.md``; a test checks that the committed file is its
output). The TRL trainers (:mod:`hf_dp.sft`, :mod:`hf_dp.dpo`) share :func:`enforce_config` for their configs' flags
and :func:`quiet_length_warning` around TRL's data preparation.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from typing import Any, Callable, NamedTuple

REFUSED, ADJUSTED, SAFE, OUTSIDE = "refused", "adjusted", "safe", "outside"
STATUSES = (REFUSED, ADJUSTED, SAFE, OUTSIDE)
STATUS_TEXT = {REFUSED: "**refused**", ADJUSTED: "adjusted", SAFE: "safe", OUTSIDE: "outside the guarantee"}
#: transformers releases whose TrainingArguments fields were read and classified here (a later release that adds a
#: field fails tests/test_flags.py; one that adds none needs only its version added here and the table regenerated)
CHECKED_WITH = ("5.23.0", "5.24.0")


class Rule(NamedTuple):
    status: str
    reason: str  # one line; for ``refused`` the full error message (one sentence)
    when: str | None = None  # human-readable condition; None: unconditional (a field's last rule)
    applies: Callable[[Any], bool] | None = None  # the condition, on the raw arguments (before HF's __post_init__)
    adjust: Callable[[Any], None] | None = None  # for ``adjusted``: the change made to the arguments


# ---------------------------------------------------------------------------------------------------
# predicates: they see the raw values (strings, enums, bools, lists), before HF normalises them
# ---------------------------------------------------------------------------------------------------
def _v(x):
    return getattr(x, "value", x)


def _true(name: str) -> Callable[[Any], bool]:
    return lambda a: bool(getattr(a, name, False))


def _set(name: str) -> Callable[[Any], bool]:
    return lambda a: getattr(a, name, None) is not None


def _reporters(a) -> list[str]:
    r = getattr(a, "report_to", None)
    if r is None:
        return []
    r = [r] if isinstance(r, str) else list(r)
    r = [str(_v(x)) for x in r]
    if "all" in r:
        from transformers.integrations import get_available_reporting_integrations

        r = list(get_available_reporting_integrations())
    return [x for x in r if x != "none"]


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(os.path.expanduser(path)), os.path.abspath(os.path.expanduser(folder))
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _tensorboard_pushed(a) -> bool:
    if not a.push_to_hub or "tensorboard" not in _reporters(a):
        return False
    logdir = os.environ.get("TENSORBOARD_LOGGING_DIR")  # HF's TensorBoardCallback; default output_dir/runs/<run>
    return logdir is None or _inside(logdir, a.output_dir or "trainer_output")


def _trackio_synced(a) -> bool:
    return bool(a.push_to_hub) and "trackio" in _reporters(a) and getattr(a, "trackio_static_space_id", None) is not False


def _tokens_seen(a) -> bool:
    return str(_v(a.include_num_input_tokens_seen)) not in ("no", "False", "None")


def _debug_options(a) -> list[str]:
    d = getattr(a, "debug", None) or []
    return d.split() if isinstance(d, str) else [str(_v(x)) for x in d]


def _set_max_grad_norm_zero(a) -> None:
    a.max_grad_norm = 0.0


_EVAL = "only affects evaluation on eval_dataset (keep it disjoint from the training set: the guarantee covers the training set)"
_EVAL_LOADER = ("speed of loading the same batches; the DP training loader (DPTrainer.get_train_dataloader) passes only "
                "num_workers and pin_memory, so this applies to the evaluation loaders")
_TRAIN_LOSS = "the logged training loss is an average over the private Poisson batch without noise (not private)"
_SELECTION = ("the kept model is chosen on eval-set metrics: the eval set is not protected, and for the training set this is "
              "post-processing of DP checkpoints (epsilon unchanged) only if the eval set holds no training example")
_HOOKS = "hf_dp's per-example clipping records activations and gradients through module hooks"

# --------------------------------------------------------------------------------------------------
# the registry: one entry per dataclass field of transformers.TrainingArguments (checked by tests/test_flags.py)
# --------------------------------------------------------------------------------------------------
FLAGS: dict[str, tuple[Rule, ...]] = {
    # ---- output, batch, schedule -----------------------------------------------------------------
    "output_dir": (Rule(SAFE, "where the release (model, privacy.json, card) and the non-private artefacts (checkpoints, logs) are "
                              "written; push_to_hub uploads it without checkpoint-* and _*"),),
    "per_device_train_batch_size": (Rule(ADJUSTED, "becomes the expected per-device micro-batch: B = per_device_train_batch_size × "
                                                   "gradient_accumulation_steps × world_size sets q = B/N, and each Poisson batch's "
                                                   "size fluctuates around it"),),
    "num_train_epochs": (Rule(ADJUSTED, "an epoch is round(1/q) Poisson steps (one pass in expectation; an example may be drawn "
                                        "0, 1 or more times); with --epsilon it plans the steps sigma is calibrated for"),),
    "max_steps": (Rule(REFUSED, "--max_steps 0 trains nothing", "== 0", lambda a: a.max_steps is not None and a.max_steps == 0),
                  Rule(SAFE, "the number of noisy steps; with --epsilon, sigma is calibrated for it and no step beyond the budget is taken")),
    "learning_rate": (Rule(SAFE, "step size of the DP update rule: post-processing of the noisy gradient"),),
    "lr_scheduler_type": (Rule(OUTSIDE, "the learning rate follows eval-set metrics (metric_for_best_model): not private for the "
                                        "eval set; post-processing for the training set if the eval set holds no training example",
                               "reduce_lr_on_plateau or greedy",
                               lambda a: str(_v(a.lr_scheduler_type)) in ("reduce_lr_on_plateau", "greedy")),
                          Rule(SAFE, "the learning rate depends on the step count only: post-processing")),
    "lr_scheduler_kwargs": (Rule(SAFE, "parameters of the learning-rate schedule: post-processing"),),
    "warmup_steps": (Rule(SAFE, "part of the learning-rate schedule (a function of the step count): post-processing"),),
    # ---- optimizer ---------------------------------------------------------------------------------------------------
    "optim": (Rule(ADJUSTED, "redefined by DPTrainingArguments: takes the DP update rules of hf_dp.optim (default dp_adamw); "
                             "HF's names are refused unless --disable_dp (checked before the rules of this table)"),),
    "optim_args": (Rule(SAFE, "extra hyper-parameters of the DP update rule (e.g. momentum=0.9, fused=false): post-processing"),),
    "weight_decay": (Rule(SAFE, "applied by the DP update rule to HF's decay parameter group: a function of the parameters only"),),
    "adam_beta1": (Rule(SAFE, "hyper-parameter of the DP update rule (moments of the noisy gradient): post-processing"),),
    "adam_beta2": (Rule(SAFE, "hyper-parameter of the DP update rule (moments of the noisy gradient): post-processing"),),
    "adam_epsilon": (Rule(SAFE, "hyper-parameter of the DP update rule: post-processing"),),
    "optim_target_modules": (Rule(REFUSED, "--optim_target_modules selects the modules of GaLore/APOLLO optimizers, which are not DP "
                                           "update rules, so it would be silently ignored; with DP choose the trained parameters "
                                           "with --trainable", "set", _set("optim_target_modules")),
                             Rule(SAFE, "unset (default)")),
    "gradient_accumulation_steps": (Rule(SAFE, "each Poisson logical batch is split into this many micro-batches; clipping is per "
                                               "example and the noise is added once per logical batch"),),
    "average_tokens_across_devices": (Rule(SAFE, "only changes num_items_in_batch, which DPTrainer's per-example loss ignores; the "
                                                 "gathered count stays inside the process group and is not logged"),),
    "max_grad_norm": (Rule(ADJUSTED, "set to 0 with DP: HF would clip — and log the norm of — the non-private summed gradient; DP "
                                     "clips each example's gradient to --per_sample_max_grad_norm",
                           adjust=_set_max_grad_norm_zero),),
    "label_smoothing_factor": (Rule(REFUSED, "--label_smoothing_factor is not supported with DP: DPTrainer computes each example's "
                                             "loss itself, without label smoothing, so it would be silently ignored in training",
                                    "≠ 0", lambda a: bool(a.label_smoothing_factor)),
                               Rule(SAFE, "0 (default): no smoothing")),
    # ---- precision, memory, kernels ------------------------------------------------------------------------------------
    "bf16": (Rule(REFUSED, "--bf16 is not supported with DP training: under bf16 autocast each example's gradient depends on the "
                           "padded length and shape of its micro-batch (rounding at 2^-8), so one example can move the clipped sum "
                           "by more than C (1.47 C measured); train in float32 (--bf16_full_eval still speeds up evaluation)",
                  "True", _true("bf16")),
             Rule(SAFE, "False (default)")),
    "fp16": (Rule(REFUSED, "--fp16 is not supported with DP: dynamic loss scaling skips steps depending on private gradients; "
                           "train in float32", "True", _true("fp16")),
             Rule(SAFE, "False (default)")),
    "bf16_full_eval": (Rule(SAFE, "precision of evaluation outside train() only (refused with --cache_frozen_features, "
                              "docs/misuse.md: the cast would leave the cache another model's)"),),
    "fp16_full_eval": (Rule(SAFE, "precision of evaluation outside train() only (no loss scaling in evaluation; refused "
                              "with --cache_frozen_features, docs/misuse.md)"),),
    "tf32": (Rule(SAFE, "TF32 matmuls on Ampere+ GPUs: precision of the same computation"),),
    "activation_checkpointing": (Rule(REFUSED, "--activation_checkpointing (--gradient_checkpointing) is not supported with DP: "
                                               f"{_HOOKS}, and the forward recomputed during backward would run them again, which "
                                               "has not been verified to keep each example's clipping exact",
                                      "True", _true("activation_checkpointing")),
                                 Rule(SAFE, "off (default)")),
    "activation_checkpointing_kwargs": (Rule(SAFE, "only read with activation_checkpointing, which is refused with DP"),),
    "gradient_checkpointing": (Rule(REFUSED, "--gradient_checkpointing (--activation_checkpointing) is not supported with DP: "
                                             f"{_HOOKS}, and the forward recomputed during backward would run them again, which has "
                                             "not been verified to keep each example's clipping exact",
                                    "True", _true("gradient_checkpointing")),
                               Rule(SAFE, "off (default; deprecated alias of activation_checkpointing)")),
    "gradient_checkpointing_kwargs": (Rule(SAFE, "only read with activation_checkpointing, which is refused with DP"),),
    "torch_compile": (Rule(REFUSED, f"--torch_compile is not supported with DP: {_HOOKS}, which torch.compile has not been "
                                    "verified to preserve (a skipped hook would leave an example unclipped)",
                           "True", _true("torch_compile")),
                      Rule(SAFE, "False (default)")),
    "torch_compile_backend": (Rule(REFUSED, f"--torch_compile_backend turns on torch.compile, which is not supported with DP: {_HOOKS}, "
                                            "which torch.compile has not been verified to preserve (a skipped hook would leave an "
                                            "example unclipped)", "set", _set("torch_compile_backend")),
                              Rule(SAFE, "unset (default)")),
    "torch_compile_mode": (Rule(REFUSED, f"--torch_compile_mode turns on torch.compile, which is not supported with DP: {_HOOKS}, "
                                         "which torch.compile has not been verified to preserve (a skipped hook would leave an "
                                         "example unclipped)", "set", _set("torch_compile_mode")),
                           Rule(SAFE, "unset (default)")),
    "use_liger_kernel": (Rule(REFUSED, "--use_liger_kernel is not supported with DP: Liger replaces model layers and the loss by "
                                       "fused kernels that hf_dp's per-example clipping does not know",
                              "True", _true("use_liger_kernel")),
                         Rule(SAFE, "False (default)")),
    "liger_kernel_config": (Rule(SAFE, "only read with use_liger_kernel, which is refused with DP"),),
    "use_cache": (Rule(SAFE, "the model's KV-cache flag: the training forward pass computes the same outputs"),),
    "neftune_noise_alpha": (Rule(REFUSED, "--neftune_noise_alpha is not supported with DP: NEFTune scales its embedding noise by the "
                                          "padded length of the whole batch, so one example changes the other examples' gradients "
                                          "and the per-example bound C no longer holds (its noise adds nothing to the guarantee)",
                                 "set", _set("neftune_noise_alpha")),
                            Rule(SAFE, "unset (default)")),
    "torch_empty_cache_steps": (Rule(SAFE, "empties the device cache every k steps: memory only"),),
    "auto_find_batch_size": (Rule(REFUSED, "--auto_find_batch_size is not supported with DP: after an out-of-memory error it restarts "
                                           "training with a smaller batch, so the steps already taken and q = B/N would no longer be "
                                           "what the accountant describes; choose --per_device_train_batch_size and "
                                           "--gradient_accumulation_steps that fit",
                                  "True", _true("auto_find_batch_size")),
                             Rule(SAFE, "False (default)")),
    # ---- logging ---------------------------------------------------------------------------------------------------------
    "logging_strategy": (Rule(OUTSIDE, f"when the training loss is logged: {_TRAIN_LOSS}; DPTrainer drops grad_norm and adds epsilon"),),
    "logging_steps": (Rule(OUTSIDE, f"how often the training loss is logged: {_TRAIN_LOSS}"),),
    "logging_first_step": (Rule(OUTSIDE, f"logs the first step's training loss: {_TRAIN_LOSS}"),),
    "log_on_each_node": (Rule(SAFE, "which processes print the logs (their content is set by logging_strategy)"),),
    "logging_nan_inf_filter": (Rule(OUTSIDE, f"replaces a NaN/Inf training loss in the logs by the running mean: {_TRAIN_LOSS}; "
                                             "training itself is unchanged"),),
    "include_num_input_tokens_seen": (Rule(REFUSED, "--include_num_input_tokens_seen logs how many tokens the Poisson-sampled batches "
                                                    "held, which reveals batch sizes computed from private data outside the DP "
                                                    "mechanism; it is not allowed with DP",
                                           "all, non_padding or True", _tokens_seen),
                                      Rule(SAFE, "no (default)")),
    "log_level": (Rule(SAFE, "verbosity of HF's log messages (settings and counts such as N, not the data)"),),
    "log_level_replica": (Rule(SAFE, "verbosity of HF's log messages on replica processes"),),
    "disable_tqdm": (Rule(SAFE, "progress bar or printed logs (the same logs as logging_strategy)"),),
    "report_to": (Rule(REFUSED, "--report_to tensorboard with --push_to_hub is not allowed with DP: TensorBoard writes the "
                                "non-private training loss under output_dir/runs, which push_to_hub uploads with the model; set "
                                "TENSORBOARD_LOGGING_DIR outside output_dir, or drop one of the two",
                       "tensorboard, with push_to_hub and the TensorBoard folder inside output_dir", _tensorboard_pushed),
                  Rule(REFUSED, "--report_to trackio with --push_to_hub is not allowed with DP: every push syncs the Trackio "
                                "logs, with the non-private training loss, to a Hub Space (public unless --hub_private_repo) that "
                                "the model card links to; pass --trackio_static_space_id False, or drop one of the two",
                       "trackio, with push_to_hub and trackio_static_space_id not False", _trackio_synced),
                  Rule(OUTSIDE, f"sends the logs to the chosen trackers: {_TRAIN_LOSS}; treat tracker runs as private data")),
    "run_name": (Rule(SAFE, "name of the run in the trackers"),),
    "project": (Rule(SAFE, "Trackio project name"),),
    "trackio_space_id": (Rule(OUTSIDE, f"with --report_to trackio, the logs go live to this Hub Space (public unless "
                                       f"--hub_private_repo): {_TRAIN_LOSS}"),),
    "trackio_bucket_id": (Rule(OUTSIDE, f"the Hub bucket holding the Trackio logs: {_TRAIN_LOSS}"),),
    "trackio_static_space_id": (Rule(OUTSIDE, f"the static Hub Space of the Trackio logs (False: none; see report_to): {_TRAIN_LOSS}"),),
    # ---- evaluation --------------------------------------------------------------------------------------------------------
    "eval_strategy": (Rule(SAFE, f"when evaluation runs; {_EVAL}"),),
    "eval_steps": (Rule(SAFE, _EVAL),),
    "eval_delay": (Rule(SAFE, _EVAL),),
    "per_device_eval_batch_size": (Rule(SAFE, "batch size of evaluation (and of building the frozen-feature cache): computes the same "
                                              "outputs"),),
    "prediction_loss_only": (Rule(SAFE, _EVAL),),
    "eval_on_start": (Rule(SAFE, _EVAL),),
    "eval_do_concat_batches": (Rule(SAFE, _EVAL),),
    "eval_use_gather_object": (Rule(SAFE, _EVAL),),
    "eval_accumulation_steps": (Rule(SAFE, _EVAL),),
    "include_for_metrics": (Rule(SAFE, _EVAL),),
    "batch_eval_metrics": (Rule(SAFE, _EVAL),),
    # ---- saving, Hub ------------------------------------------------------------------------------------------------------
    "save_only_model": (Rule(SAFE, "checkpoints without optimizer.pt carry no privacy ledger; DPTrainer refuses to resume from them "
                                   "(docs/misuse.md), so epsilon is never reset"),),
    "save_strategy": (Rule(OUTSIDE, "checkpoints are not part of the DP release: their trainer_state.json logs the non-private "
                                    "training loss (and with 'best' the kept checkpoint is chosen on eval-set metrics); keep them "
                                    "private (Hub pushes skip checkpoint-*)"),),
    "save_steps": (Rule(SAFE, "when checkpoints are written (see save_strategy); the ledger in each one counts every noisy step"),),
    "save_on_each_node": (Rule(SAFE, "which nodes write checkpoints (see save_strategy)"),),
    "save_total_limit": (Rule(SAFE, "how many checkpoints are kept; DPTrainer rotates only after a checkpoint's completion marker "
                                    "is written"),),
    "enable_jit_checkpoint": (Rule(REFUSED, "--enable_jit_checkpoint is not supported with DP: HF writes its SIGTERM checkpoint "
                                            "next to an in-progress sentinel file that hf_dp's completion marker records and HF then "
                                            "deletes, so the checkpoint could never be resumed; use --save_strategy steps",
                                   "True", _true("enable_jit_checkpoint")),
                              Rule(SAFE, "False (default)")),
    "push_to_hub": (Rule(SAFE, "uploads output_dir except checkpoint-* and _* (HF's ignore_patterns): the DP model, tokenizer, "
                               "training_args.bin, privacy.json and card — and whatever else you write there (trainer_state.json "
                               "or *_results.json carry the non-private training loss)"),),
    "hub_token": (Rule(SAFE, "credential for the Hub"),),
    "hub_private_repo": (Rule(SAFE, "visibility of the model repo (and of Trackio Spaces)"),),
    "hub_model_id": (Rule(SAFE, "name of the model repo"),),
    "hub_strategy": (Rule(REFUSED, "--hub_strategy checkpoint/all_checkpoints is not allowed with DP: it uploads checkpoint folders, "
                                   "whose trainer_state.json logs the non-private training loss and whose optimizer and RNG state "
                                   "are not part of the DP release; use --hub_strategy every_save or end",
                          "checkpoint or all_checkpoints",
                          lambda a: str(_v(a.hub_strategy)) in ("checkpoint", "all_checkpoints")),
                     Rule(SAFE, "every_save (default) or end: pushes output_dir, whose checkpoint-* and _* HF's uploads ignore")),
    "hub_always_push": (Rule(SAFE, "whether a push waits for the previous one (what is pushed: see hub_strategy)"),),
    "hub_revision": (Rule(SAFE, "branch or revision pushed to"),),
    "load_best_model_at_end": (Rule(OUTSIDE, _SELECTION),),
    "metric_for_best_model": (Rule(OUTSIDE, _SELECTION),),
    "greater_is_better": (Rule(OUTSIDE, _SELECTION),),
    # ---- resuming, randomness ----------------------------------------------------------------------------------------------
    "ignore_data_skip": (Rule(SAFE, "whether HF fast-forwards the data loader on resume; hf_dp's Poisson draws are fresh for every "
                                    "step after a resume, so no batch is replayed either way"),),
    "restore_callback_states_from_checkpoint": (Rule(SAFE, "restores callbacks' state on resume; the privacy ledger is restored from "
                                                           "the checkpoint either way"),),
    "full_determinism": (Rule(SAFE, "seeds HF's global RNGs and picks deterministic kernels; hf_dp's Poisson sampling and noise use "
                                    "their own generators (--dp_seed or OS entropy)"),),
    "seed": (Rule(SAFE, "seeds HF's global RNGs (new heads' initialisation, dropout); hf_dp's Poisson sampling and noise use their "
                        "own generators (--dp_seed or OS entropy)"),),
    "data_seed": (Rule(REFUSED, "--data_seed seeds HF's train sampler, which DP's Poisson sampling replaces, so it would be silently "
                                "ignored; use --dp_seed for a reproducible run (recorded in the card)",
                       "set", _set("data_seed")),
                  Rule(SAFE, "None (default)")),
    # ---- devices, data loading -------------------------------------------------------------------------------------------------
    "use_cpu": (Rule(SAFE, "the device: same computation"),),
    "accelerator_config": (Rule(SAFE, "Accelerate settings of the loaders Accelerate prepares (evaluation: the DP training loader is "
                                      "DPTrainer's own) and of gradient syncing; DPTrainer measures and undoes any loss scaling"),),
    "parallelism_config": (Rule(REFUSED, "--parallelism_config is not supported with DP: tensor, context, sequence or sharded "
                                         "parallelism splits each example's computation across processes, so no process holds a "
                                         "whole example's gradient to clip", "set", _set("parallelism_config")),
                           Rule(SAFE, "unset (default)")),
    "dataloader_drop_last": (Rule(SAFE, "DP training batches are Poisson draws of random size (no last incomplete batch to drop), so "
                                        "it applies to the evaluation loaders only"),),
    "dataloader_num_workers": (Rule(SAFE, "speed of loading the same batches (the Poisson draw happens in the main process)"),),
    "dataloader_pin_memory": (Rule(SAFE, "speed of moving the same batches to the device"),),
    "dataloader_persistent_workers": (Rule(SAFE, _EVAL_LOADER),),
    "dataloader_prefetch_factor": (Rule(SAFE, _EVAL_LOADER),),
    "dataloader_multiprocessing_context": (Rule(SAFE, _EVAL_LOADER),),
    "dataloader_in_order": (Rule(SAFE, _EVAL_LOADER),),
    "remove_unused_columns": (Rule(SAFE, "which dataset columns reach the model (training and evaluation alike)"),),
    "label_names": (Rule(REFUSED, "--label_names other than labels is not supported with DP: DPTrainer computes each example's loss "
                                  "from the 'labels' column", "set to anything but ['labels']",
                         lambda a: a.label_names is not None and list(a.label_names) != ["labels"]),
                    Rule(SAFE, "unset (default) or ['labels']")),
    "train_sampling_strategy": (Rule(REFUSED, "--train_sampling_strategy sequential or batch_rebalance is not allowed with DP: DPTrainer "
                                              "draws every batch by Poisson sampling at rate q = B/N, as the accountant assumes, so "
                                              "HF's sampler choice would be silently ignored",
                                     "sequential or batch_rebalance",
                                     lambda a: str(_v(a.train_sampling_strategy)) not in ("random", "group_by_length")),
                                Rule(ADJUSTED, "Poisson sampling at rate q = B/N, as with random; each step's draw is then ordered by "
                                               "length before it is cut into the gradient-accumulation micro-batches, so each pads "
                                               "to about its own rows' length. The rows drawn, the clipped sum and the noise are "
                                               "unchanged (the order only decides which micro-batch computes which example). Evaluation and "
                                               "predict keep the dataset's order (HF's would group them too)",
                                     "group_by_length", lambda a: str(_v(a.train_sampling_strategy)) == "group_by_length"),
                                Rule(ADJUSTED, "random (default): replaced by Poisson sampling at rate q = B/N (each example joins "
                                               "each step's batch independently with probability q)")),
    "length_column_name": (Rule(SAFE, "the lengths group_by_length orders each Poisson draw by (kept in memory only; a prefix cache "
                                  "uses its own)"),),
    # ---- distributed -------------------------------------------------------------------------------------------------------------
    "ddp_find_unused_parameters": (Rule(SAFE, "DDP wrapper option: communication only; the noise is added once per logical batch"),),
    "ddp_bucket_cap_mb": (Rule(SAFE, "DDP wrapper option: communication only"),),
    "ddp_broadcast_buffers": (Rule(SAFE, "DDP wrapper option: communication only (trainable BatchNorm is refused by DPTrainer)"),),
    "ddp_static_graph": (Rule(SAFE, "DDP wrapper option: communication only"),),
    "ddp_backend": (Rule(SAFE, "process-group backend: communication only"),),
    "ddp_timeout": (Rule(SAFE, "process-group timeout"),),
    "fsdp": (Rule(ADJUSTED, "FSDP2 (fully_shard, through Accelerate; also on CPU/gloo) with ghost clipping (one backward by default, "
                            "--clipping ghost_two_pass on request): per-example norms over the whole model on each rank, the clipped "
                            "sums reduce-scattered into the shards and summed (not averaged), the noise added once "
                            "per coordinate on each rank's own shard, checkpoints sharded with the ledger; --clipping hooks, --bf16/--fp16, DP-SGD-L2/DP-MacAdam, "
                            "--cache_frozen_features, FSDP1, CPU offload and tied trainable weights are refused (docs/fsdp.md)",
                  "set", _true("fsdp")),
             Rule(SAFE, "unset (default)")),
    "fsdp_config": (Rule(REFUSED, "--fsdp_config without --fsdp is not allowed with DP: HF ignores it and trains with DDP; add --fsdp "
                                  "full_shard (or drop --fsdp_config)", "set without --fsdp",
                         lambda a: bool(getattr(a, "fsdp_config", None)) and not getattr(a, "fsdp", False)),
                    Rule(ADJUSTED, "the FSDP2 options of --fsdp (version 2 only; cpu_offload and activation_checkpointing refused "
                                   "under DP)", "set with --fsdp", _true("fsdp_config")),
                    Rule(SAFE, "unset (default)")),
    "deepspeed": (Rule(REFUSED, "--deepspeed is not supported with DP: DeepSpeed's engine runs the backward, the gradient reduction, "
                                "the loss scaling and the optimizer step itself, bypassing hf_dp's per-example clipping and noise; "
                                "use several processes with DDP (ghost clipping, --clipping auto) or FSDP2 (--fsdp full_shard) (docs/fsdp.md)",
                       "set", _true("deepspeed")),
                  Rule(SAFE, "unset (default)")),
    "local_rank": (Rule(SAFE, "launcher bookkeeping; the world size enters B"),),
    # ---- misc ------------------------------------------------------------------------------------------------------------------------
    "debug": (Rule(REFUSED, "--debug underflow_overflow is not allowed with DP: it prints activation statistics of the private batch "
                            "and stops training when one overflows, a decision on private data outside the DP mechanism",
                   "includes underflow_overflow", lambda a: "underflow_overflow" in _debug_options(a)),
              Rule(SAFE, "empty (default) or tpu_metrics_debug: performance metrics")),
    "skip_memory_metrics": (Rule(REFUSED, "--skip_memory_metrics False is not allowed with DP: the logged peak memory of training grows "
                                          "with the largest Poisson batch and its padded length, statistics of private data outside "
                                          "the DP mechanism",
                                 "False", lambda a: not a.skip_memory_metrics),
                            Rule(SAFE, "True (default): no memory metrics")),
    "do_train": (Rule(SAFE, "not used by Trainer (scripts only)"),),
    "do_eval": (Rule(SAFE, "not used by Trainer (scripts only)"),),
    "do_predict": (Rule(SAFE, "not used by Trainer (scripts only)"),),
    "resume_from_checkpoint": (Rule(SAFE, "not used by Trainer (scripts pass it to train()); DPTrainer resumes only from complete hf_dp "
                                          "checkpoints with the same privacy settings (docs/misuse.md)"),),
}


#: TRL's ``--chat_template_path`` (SFTConfig, DPOConfig, RewardConfig): the rules of hf_dp.sft.config.SFT_FLAGS and
#: hf_dp.dpo.config's registries
CHAT_TEMPLATE_PATH_RULES: tuple[Rule, ...] = (
    Rule(REFUSED, "--chat_template_path naming a model or tokenizer is not supported with DP: TRL would then add "
                  "tokens and resize the embeddings after hf_dp has frozen the model (--trainable); give a .jinja "
                  "file or set the tokenizer's chat_template", "not a .jinja/.j2 file",
         lambda a: a.chat_template_path is not None and not str(a.chat_template_path).endswith((".jinja", ".j2"))),
    Rule(SAFE, "a .jinja/.j2 file (public): how each conversation is rendered"))


# --------------------------------------------------------------------------------------------------
# enforcement
# --------------------------------------------------------------------------------------------------
def hf_fields() -> list[dataclasses.Field]:
    from transformers import TrainingArguments

    return list(dataclasses.fields(TrainingArguments))


def field_default(f: dataclasses.Field):
    """A dataclass field's default value (its factory called), or ``dataclasses.MISSING``."""
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def rule_for(args, name: str) -> Rule:
    """The rule of field ``name`` that applies to ``args`` (the first whose condition holds)."""
    for rule in FLAGS[name]:
        if rule.applies is None or rule.applies(args):
            return rule
    raise AssertionError(f"hf_dp.flags: the last rule of {name} must be unconditional")


_PLAIN_STATUS = {REFUSED: "refused", ADJUSTED: "adjusted", SAFE: "safe", OUTSIDE: "outside the guarantee"}


def help_note(name: str, registry: dict[str, tuple[Rule, ...]] | None = None) -> str | None:
    """A ``--help`` note for a DP run, from the registry (:data:`FLAGS`, or another of the same format such as
    ``hf_dp.sft.config.SFT_FLAGS``): None when the field is plainly safe; otherwise its statuses, conditions and
    reasons, e.g. ``[DP: adjusted — set to 0 with DP: …]`` or ``[DP: refused if True — …; otherwise safe]``. A field
    nobody classified says so."""
    rules = (FLAGS if registry is None else registry).get(name)
    if rules is None:
        return "[DP: not classified by hf_dp: refused under DP unless left at its default]"
    if all(r.status == SAFE for r in rules):
        return None
    parts = []
    for i, r in enumerate(rules):
        if r.when is not None:
            parts.append(f"{_PLAIN_STATUS[r.status]} if {r.when} — {r.reason}")
        elif i == 0:
            parts.append(f"{_PLAIN_STATUS[r.status]} — {r.reason}")
        else:  # the unconditional last rule after conditions: its reason is just the default value
            parts.append(f"otherwise {_PLAIN_STATUS[r.status]}")
    return "[DP: " + "; ".join(parts) + "]"


def enforce(args) -> None:
    """Apply the registry to DP arguments (raw values, before ``TrainingArguments.__post_init__``):
    raise the first refusal, apply the adjustments, refuse unclassified fields set to a non-default value."""
    for f in hf_fields():
        if f.name not in FLAGS:
            default = field_default(f)
            if default is not dataclasses.MISSING and getattr(args, f.name, default) != default:
                import transformers

                raise ValueError(
                    f"--{f.name} is a TrainingArguments field of transformers {transformers.__version__} that hf_dp has not "
                    "classified for privacy (hf_dp/flags.py), so it is not allowed with DP until it is"
                )
            continue
        rule = rule_for(args, f.name)
        if rule.status == REFUSED:
            raise ValueError(rule.reason)
        if rule.status == ADJUSTED and rule.adjust is not None:
            rule.adjust(args)


def config_fields(config_cls) -> list[str]:
    """The fields a TRL config class (``SFTConfig``, ``DPOConfig``, ...) adds to ``TrainingArguments``."""
    hf = {f.name for f in hf_fields()}
    return [f.name for f in dataclasses.fields(config_cls) if f.name not in hf]


def enforce_config(args, registry: dict[str, tuple[Rule, ...]], config_cls, label: str, source: str) -> None:
    """Raise the first refusal of a TRL config's ``registry`` (raw values); a field of a newer TRL that is not
    classified is refused when it differs from its default: ``--NAME is <label> field of trl X that hf_dp has not
    classified for privacy (<source>) ...`` (``label``: ``"an SFTConfig"``, ``"a DPOConfig"``)."""
    defaults = {f.name: f for f in dataclasses.fields(config_cls)}
    for name in config_fields(config_cls):
        rules = registry.get(name)
        if rules is None:
            f = defaults[name]
            default = f.default if f.default is not dataclasses.MISSING else dataclasses.MISSING
            if default is not dataclasses.MISSING and getattr(args, name, default) != default:
                import trl

                raise ValueError(f"--{name} is {label} field of trl {trl.__version__} that hf_dp has not classified "
                                 f"for privacy ({source}), so it is not allowed with DP until it is")
            continue
        rule = next(r for r in rules if r.applies is None or r.applies(args))
        if rule.status == REFUSED:
            raise ValueError(rule.reason)


# --------------------------------------------------------------------------------------------------
# TRL's data preparation under DP (hf_dp.sft, hf_dp.dpo)
# --------------------------------------------------------------------------------------------------
#: transformers' warning (tokenization_utils_base) when a text tokenizes to more tokens than the tokenizer's
#: ``model_max_length``: TRL tokenizes each text whole and cuts it to ``max_length`` afterwards
LENGTH_WARNING = "Token indices sequence length is longer than the specified maximum sequence length for this model"


class _DropLengthWarning:
    """A ``logging`` filter that drops :data:`LENGTH_WARNING` and lets every other record through."""

    @staticmethod
    def filter(record) -> bool:
        return LENGTH_WARNING not in str(record.msg)


def length_warning_handled(args, dataset_name: str) -> bool:
    """Whether hf_dp (or TRL under it) already handles the length of every sequence of the set TRL prepares: a DP run
    whose sequences TRL cuts to ``max_length`` (or drops), or its training set, whose rows over the run's public token
    bound are refused before any step."""
    return bool(getattr(args, "dp_enabled", False)) and (args.max_length is not None or dataset_name == "train")


@contextlib.contextmanager
def quiet_length_warning(active: bool = True):
    """Within this block, transformers' :data:`LENGTH_WARNING` ("... (N > M). Running this sequence through the model
    will result in indexing errors") is not logged: around TRL's ``_prepare_dataset`` where
    :func:`length_warning_handled` — the sequence it measured is cut or refused before the model sees it, so the
    warning is false there. Every other message of that logger still goes through."""
    if not active:
        yield
        return
    import logging

    log, drop = logging.getLogger("transformers.tokenization_utils_base"), _DropLengthWarning()
    log.addFilter(drop)
    try:
        yield
    finally:
        log.removeFilter(drop)
