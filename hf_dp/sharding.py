"""FSDP2 under DP: two-pass ghost clipping on sharded parameters (``--fsdp full_shard``, docs/fsdp.md).

What a DP run under FSDP2 (``fully_shard`` through Accelerate, as plain ``Trainer`` wraps it) does:

* **pass 1** (the per-example norms, :meth:`hf_dp.clipping.ghost.GhostClipper.norms_pass`) is local to each rank:
  each rank runs the whole model on its own examples; FSDP's pre-backward hooks all-gather each layer for the input
  gradients, and no parameter gradient exists, so nothing is reduced. Every rank runs pass 1 on every micro-batch —
  also on an empty one (its placeholder row), whose loss then enters pass 2 multiplied by 0 — so that the ranks'
  all-gathers stay in step.
* **pass 2** is HF's own backward of Σ_i c_i ℓ_i; FSDP reduce-scatters each layer's gradient during it, **on every
  micro-batch** (:func:`prepare_micro_batch` turns the gradient sync back on inside HF's ``no_sync`` of
  gradient accumulation) and **summed, not averaged** (gradient divide factor 1), so each rank ends with its shard
  of Σ_ranks Σ_i c_i ∇ℓ_i — no raw gradient is ever reduced.
* **noise**: :meth:`hf_dp.privacy.privatizer.PrivateOptimizer.add_noise` adds N(0, σ²C²) on each rank's own shard
  only, from a stream keyed by (seed, ledger step, parameter, shard offset) — every coordinate gets exactly one
  draw per step — and nothing is all-reduced.
* **precision**: float32 only (``--bf16``/``--fp16`` refused): pass 2 would otherwise sum the clipped per-example
  gradients across examples in the reduced precision, and FSDP would reduce-scatter them in it.
* **saving**: the release is the full model gathered from the shards (``get_model_state_dict(full_state_dict=True)``)
  written by rank 0 with ``save_pretrained`` — a plain ``PreTrainedModel`` folder with its card and privacy.json; a
  LoRA model is rebuilt on rank 0 from the gathered weights and merged (:func:`plain_release`).

**CPU / gloo.** Accelerate drops an FSDP plugin when the processes run on CPU (``DistributedType.MULTI_CPU``), so plain
``Trainer`` with ``--fsdp`` on CPU silently trains with DDP (checked with transformers 5.24 / accelerate 1.15).
:func:`enable_on_cpu` (called by ``DPTrainer.create_accelerator_and_postprocess``, DP and ``--disable_dp`` runs alike)
hands Accelerate the same plugin HF built from ``--fsdp``/``--fsdp_config`` (or from an Accelerate FSDP config, via
its environment) and marks the state FSDP (in ``PartialState``'s shared state too, which every later
``AcceleratorState()`` copies back), so that ``accelerator.prepare`` calls ``fully_shard`` as it does on GPUs.

Refused under DP in one sentence at construction (:func:`check_args`, :func:`check_model`): FSDP1; engines other
than ``ghost_two_pass`` (``--clipping auto`` chooses it); ``--bf16``/``--fp16``; ``--cache_frozen_features``;
update rules with a per-sample affine map (DP-SGD-L2, DP-MacAdam); CPU offload and activation
checkpointing; trainable parameters shared between modules (tied embeddings). DeepSpeed stays refused
(:func:`hf_dp.training_data.refuse_sharding`).
"""

from __future__ import annotations

import os

import torch

__all__ = ["fsdp_requested", "check_args", "check_model", "check_processes", "enable_on_cpu", "is_fsdp_model", "prepare_micro_batch",
           "check_loss_scale_agrees", "full_state_dict", "plain_release"]


def _env_true(name: str) -> bool:
    return os.environ.get(name, "false").lower() in ("1", "true", "yes")


def fsdp_requested(args) -> bool:
    """``--fsdp``/``--fsdp_config``, or FSDP enabled in an Accelerate config (``accelerate launch`` sets the environment)."""
    return bool(getattr(args, "fsdp", False)) or bool(getattr(args, "fsdp_config", None)) or _env_true("ACCELERATE_USE_FSDP")


def _plugin_args(args) -> dict:
    plugin = getattr(args, "fsdp_plugin_args", None)
    if plugin is not None:
        return dict(plugin)
    cfg = getattr(args, "fsdp_config", None)
    out = {"fsdp_version": int(os.environ.get("FSDP_VERSION", (cfg or {}).get("version", 2) if isinstance(cfg, dict) else 2))}
    if _env_true("FSDP_OFFLOAD_PARAMS"):
        out["cpu_offload"] = True
    if _env_true("FSDP_ACTIVATION_CHECKPOINTING"):
        out["activation_checkpointing"] = True
    return out


def _has_affine_rule(optim: str) -> bool:
    from hf_dp.optim import get_entry
    from hf_dp.optim.base import DPUpdateRule

    return get_entry(optim).rule_cls.per_sample_affine is not DPUpdateRule.per_sample_affine


def check_args(args) -> None:
    """Under DP with FSDP: refuse (one ``ValueError`` sentence) what is not supported; see the module docstring."""
    plugin = _plugin_args(args)
    if getattr(args, "fsdp_config", None) and not getattr(args, "fsdp", False) and not _env_true("ACCELERATE_USE_FSDP"):
        raise ValueError("--fsdp_config without --fsdp is not allowed with DP: HF ignores it and trains with DDP; add "
                         "--fsdp full_shard (or drop --fsdp_config)")
    if int(plugin.get("fsdp_version", 2)) != 2:
        raise ValueError("DP under FSDP needs FSDP2 (fsdp_config version 2, the default); FSDP1 is not supported")
    if args.clipping not in ("auto", "ghost_two_pass"):
        raise ValueError(
            f"--clipping {args.clipping} is not supported under FSDP: only two-pass ghost clipping keeps the sharded "
            "gradients (its second backward is FSDP's reduce-scatter); use --clipping ghost_two_pass (or auto)"
        )
    if args.bf16 or args.fp16:
        raise ValueError(
            "--bf16/--fp16 are not supported with DP under FSDP: the second backward and FSDP's reduce-scatter would sum "
            "the clipped per-example gradients in reduced precision, loosening the bound C; train in float32"
        )
    if args.cache_frozen_features:
        raise ValueError("--cache_frozen_features is not supported under FSDP: the prefix cache is built with the full "
                         "model on one rank; drop one of the two flags")
    if _has_affine_rule(args.optim):
        raise ValueError(
            f"--optim {args.optim} is not supported under FSDP: its per-sample affine map needs every layer's full "
            "offset and scale in the per-example norms of pass 1; use dp_sgd, dp_adam, dp_adamw or a BC rule"
        )
    if str(getattr(getattr(args, "save_strategy", "no"), "value", getattr(args, "save_strategy", "no"))) != "no":
        raise ValueError("checkpoints are not supported with DP under FSDP yet (the sharded optimizer state and the "
                         "ledger are not saved together); use --save_strategy no: the final release is still saved")
    if plugin.get("cpu_offload"):
        raise ValueError("FSDP CPU offload is not supported with DP (untested with the sharded noise); drop cpu_offload")
    if plugin.get("activation_checkpointing") or getattr(args, "gradient_checkpointing", False):
        raise ValueError("activation/gradient checkpointing is not supported with DP under FSDP (pass 1 keeps the graph "
                         "for pass 2, which recomputation would not); drop it")


def check_model(model) -> None:
    """Refuse a trainable parameter shared between modules (tied embeddings) under FSDP: its two uses' shards and
    the two-pass hooks are untested (Opacus refuses them with FSDP too)."""
    seen: dict[int, str] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        if not p.requires_grad:
            continue
        if id(p) in seen:
            raise ValueError(
                f"the trainable parameter {seen[id(p)]} is shared with {name} (tied weights), which DP under FSDP does "
                "not support; untie them (config tie_word_embeddings=False), freeze them, or use DDP"
            )
        seen[id(p)] = name


def check_processes(args) -> None:
    """FSDP needs several processes (HF's own refusal would come later and say less)."""
    if max(1, int(args.world_size)) < 2:
        raise ValueError("--fsdp needs several processes (torchrun --nproc_per_node 2 ... or accelerate launch, on CPU "
                         "with --ddp_backend gloo --use_cpu); in one process train without --fsdp")


def enable_on_cpu(trainer) -> bool:
    """Hand Accelerate the FSDP plugin it dropped on CPU (see the module docstring); ``True`` if it did."""
    if not fsdp_requested(trainer.args):
        return False
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = trainer.accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin_args = getattr(trainer.args, "fsdp_plugin_args", None)
    plugin = FullyShardedDataParallelPlugin(**plugin_args) if plugin_args is not None else FullyShardedDataParallelPlugin()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    # every later AcceleratorState() copies PartialState's shared state over its own (accelerate 1.15): without this,
    # the next one (HF makes some during training) would turn the run back into MULTI_CPU, e.g. before prepare()
    from accelerate.state import PartialState

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    trainer.is_fsdp_enabled = True
    return True


def is_fsdp_model(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


@torch.no_grad()
def prepare_micro_batch(model) -> None:
    """Before a micro-batch's backward under FSDP: FSDP reduce-scatters this micro-batch's pass-2 gradients (also inside
    HF's ``no_sync`` of gradient accumulation, where they would otherwise accumulate unsharded and unclipped-sum-wise
    invisible to the privatizer) and sums the ranks' shards instead of averaging them."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            m.set_requires_gradient_sync(True, recurse=False)
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM), no division by 1


@torch.no_grad()
def check_loss_scale_agrees(scale: float) -> None:
    """Under FSDP, after each micro-batch's backward: every rank scaled its Σ_i c_i ℓ_i by the same factor. The
    reduce-scatter sums the ranks' scaled gradients before any rank divides by its own factor, so a rank with a
    larger factor (a subclass scaling the loss per rank) would let its examples contribute more than C; one
    all-reduce of two numbers per micro-batch refuses that before the step."""
    import torch.distributed as dist

    t = torch.tensor([scale, -scale], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    if float(t[0]) != -float(t[1]):
        raise RuntimeError(
            f"the ranks scaled their losses differently before backward (from {-float(t[1])!r} to {float(t[0])!r}): "
            "under FSDP the clipped gradients are summed across ranks before the scale is undone, so the per-example "
            "bound C would not hold; scale the loss the same way on every rank"
        )


def plain_release(model, state_dict: dict):
    """The model to ``save_pretrained`` from the gathered ``state_dict`` (rank 0): ``model`` itself, or, for a PEFT
    (LoRA) model, a fresh CPU copy of its base class with the adapter rebuilt from ``peft_config``, the gathered
    weights loaded (strict) and the adapters merged (``merge_and_unload``: a plain ``PreTrainedModel``, as without
    FSDP; the live sharded model is left untouched)."""
    try:
        from peft import PeftModel, get_peft_model
    except ImportError:  # pragma: no cover
        return model
    if not isinstance(model, PeftModel):
        return model
    import copy

    from transformers import PreTrainedModel

    base = model.get_base_model()
    cls = next(c for c in type(base).__mro__ if issubclass(c, PreTrainedModel) and not c.__name__.startswith("FSDP"))
    fresh = get_peft_model(cls(copy.deepcopy(base.config)), copy.deepcopy(model.peft_config[model.active_adapter]))
    fresh.load_state_dict(state_dict, strict=True)
    merged = fresh.merge_and_unload()
    merged.config = base.config  # the trained model's config (its ledger record: hf_dp.lineage)
    return merged


def full_state_dict(model) -> dict:
    """The full (unsharded) state dict of an FSDP2 model, on CPU, on rank 0 (empty elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
