"""FSDP2 under DP: ghost clipping on sharded parameters (``--fsdp full_shard``, docs/fsdp.md).

What a DP run under FSDP2 (``fully_shard`` through Accelerate, as plain ``Trainer`` wraps it) does:

* **one pass** (``--clipping auto``/``ghost``, the default: :mod:`hf_dp.clipping.fsdp_ghost`): HF's one backward;
  each rank computes its examples' norms over every layer of the model from its full-size records, then the clipped
  sums, which it reduce-scatters (summed) into the shards itself — no second backward, no second all-gather.
* **two passes** (``--clipping ghost_two_pass``, no records kept): pass 1 (the per-example norms,
  :meth:`hf_dp.clipping.ghost.GhostClipper.norms_pass`) is local to each rank: each rank runs the whole model on
  its own examples; FSDP's pre-backward hooks all-gather each layer for the input gradients, and no parameter
  gradient exists, so nothing is reduced. Every rank runs pass 1 on every micro-batch — also on an empty one (its
  placeholder row), whose loss then enters pass 2 multiplied by 0 — so that the ranks' all-gathers stay in step.
  Pass 2 is HF's own backward of Σ_i c_i ℓ_i; FSDP reduce-scatters each layer's gradient during it.
* in both, the reduction runs **on every micro-batch** (:func:`prepare_micro_batch` turns the gradient sync back on
  inside HF's ``no_sync`` of gradient accumulation) and is **summed, not averaged** (gradient divide factor 1), so
  each rank ends with its shard of Σ_ranks Σ_i c_i ∇ℓ_i — no raw gradient is ever used.
* **noise**: :meth:`hf_dp.privacy.privatizer.PrivateOptimizer.add_noise` adds N(0, σ²C²) on each rank's own shard
  only, from a stream keyed by (seed, the resume's stream tag if any, ledger step, parameter, shard offset) — every
  coordinate gets exactly one draw per step — and nothing is all-reduced.
* **wrapping**: each of the model's blocks is its own FSDP unit — the layer classes given, else its
  ``_no_split_modules`` less a class around the embeddings (:func:`wrap_classes`, set before ``prepare`` by
  :func:`set_wrap_classes`).
* **precision**: float32 only (``--bf16``/``--fp16`` refused): pass 2 would otherwise sum the clipped per-example
  gradients across examples in the reduced precision, and FSDP would reduce-scatter them in it.
* **saving**: the release is the full model gathered from the shards (``get_model_state_dict(full_state_dict=True)``)
  written by rank 0 with ``save_pretrained`` — a plain ``PreTrainedModel`` folder with its card and privacy.json; a
  LoRA model is rebuilt on rank 0 from the gathered weights and merged (:func:`plain_release`).
* **checkpoints** (``--save_strategy steps/epoch``): the model through Accelerate's own ``save_fsdp_model``, as HF's
  ``Trainer`` writes it under FSDP (each rank's shards with ``fsdp_config`` ``state_dict_type: SHARDED_STATE_DICT``;
  gathered by rank 0 with HF's default ``FULL_STATE_DICT``; HF's ``_load_from_checkpoint`` loads it on resume), the DP
  optimizer's state — the update rule's sharded state and the privacy ledger — always sharded, with
  ``torch.distributed.checkpoint`` into :data:`OPTIMIZER_DIR` (:func:`save_checkpoint_state` /
  :func:`load_checkpoint_state`; Accelerate's ``save_fsdp_optimizer``/``load_fsdp_optimizer`` cannot be used: they
  read torch's optimizer state format, which the privatizer's is not, and before loading they initialise an empty
  optimizer by *stepping* it on zero gradients, which on the privatizer would be a noisy step). The completion marker
  is written by rank 0 after every rank has written its shards (``DPTrainer._save_checkpoint``) and records the
  number of processes; such a checkpoint resumes under FSDP with that many processes only (:func:`check_resume`).
  ``torch.distributed.checkpoint`` reads ``.metadata`` with plain ``pickle.load`` and non-tensor entries with
  ``torch.load(weights_only=False)``; before any load every ``.metadata`` of the checkpoint (and every rank-local
  ``__<rank>.metadata``, DCP's fallback) is read with an unpickler restricted to DCP's metadata classes (symlinked folders
  refused), a model's sharded state must hold tensors only, and the DP optimizer's
  non-tensor entries are read with ``weights_only=True`` — a crafted checkpoint is refused, no code runs.

**CPU / gloo.** Accelerate drops an FSDP plugin when the processes run on CPU (``DistributedType.MULTI_CPU``), so plain
``Trainer`` with ``--fsdp`` on CPU silently trains with DDP (checked with transformers 5.24 / accelerate 1.15).
:func:`enable_on_cpu` (called by ``DPTrainer.create_accelerator_and_postprocess``, DP and ``--disable_dp`` runs alike)
hands Accelerate the same plugin HF built from ``--fsdp``/``--fsdp_config`` (or from an Accelerate FSDP config, via
its environment) and marks the state FSDP (in ``PartialState``'s shared state too, which every later
``AcceleratorState()`` copies back), so that ``accelerator.prepare`` calls ``fully_shard`` as it does on GPUs.

Refused under DP in one sentence at construction (:func:`check_args`, :func:`check_model`): FSDP1; ``--clipping
hooks``; ``--bf16``/``--fp16``; ``--cache_frozen_features``;
update rules with a per-sample affine map (DP-SGD-L2, DP-MacAdam); CPU offload and activation
checkpointing; trainable parameters shared between modules (tied embeddings). At ``train(resume_from_checkpoint=...)``:
a checkpoint written under FSDP resumed without it or with another number of processes, and one written without
FSDP resumed under it (:func:`check_resume`). DeepSpeed stays refused (:func:`hf_dp.run.data.refuse_sharding`).
"""

from __future__ import annotations

import json
import os
import re

import torch

__all__ = ["fsdp_requested", "check_args", "check_model", "check_processes", "enable_on_cpu", "wrap_classes",
           "set_wrap_classes", "is_fsdp_model", "prepare_micro_batch",
           "check_loss_scale_agrees", "full_state_dict", "plain_release", "OPTIMIZER_DIR", "save_checkpoint_state",
           "load_checkpoint_state", "check_resume"]


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
    if args.clipping not in ("auto", "ghost", "ghost_two_pass"):
        raise ValueError(
            f"--clipping {args.clipping} is not supported under FSDP: only ghost clipping keeps the gradients sharded "
            "(its clipped sums are reduce-scattered into the shards); use --clipping ghost (or auto) or ghost_two_pass"
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


def enable_on_cpu(accelerator, args) -> bool:
    """Hand ``accelerator`` the FSDP plugin it dropped on CPU (see the module docstring); ``True`` if it did (the
    caller, ``DPTrainer.create_accelerator_and_postprocess``, then marks the trainer FSDP-enabled)."""
    if not fsdp_requested(args):
        return False
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin

    state = accelerator.state
    if state.distributed_type != DistributedType.MULTI_CPU:
        return False
    plugin_args = getattr(args, "fsdp_plugin_args", None)
    plugin = FullyShardedDataParallelPlugin(**plugin_args) if plugin_args is not None else FullyShardedDataParallelPlugin()
    if state.mixed_precision != "no":
        plugin.set_mixed_precision(state.mixed_precision)
    state.fsdp_plugin = plugin
    state.distributed_type = DistributedType.FSDP
    # every later AcceleratorState() copies PartialState's shared state over its own (accelerate 1.15): without this,
    # the next one (HF makes some during training) would turn the run back into MULTI_CPU, e.g. before prepare()
    from accelerate.state import PartialState

    PartialState._shared_state["distributed_type"] = DistributedType.FSDP
    return True


def _carved_modules(model) -> list:
    """The modules Accelerate's ``fsdp2_prepare_model`` shards on their own after the auto-wrapped layers: the input
    and output embeddings and the final norm."""
    out = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        try:
            out.append(getattr(model, getter)())
        except (AttributeError, NotImplementedError):
            pass
    try:
        from accelerate.utils.fsdp_utils import _find_final_norm

        out.append(_find_final_norm(model))
    except (ImportError, AttributeError):  # pragma: no cover - other Accelerate versions
        pass
    return [m for m in out if isinstance(m, torch.nn.Module)]


def wrap_classes(model, given=None) -> list[str]:
    """The layer classes FSDP2 shards as their own units (``TRANSFORMER_BASED_WRAP``, HF's default for ``--fsdp``).

    ``given`` (``--fsdp_config '{"transformer_layer_cls_to_wrap": [...]}'``, or an Accelerate config's) is checked;
    without it, the model's own ``_no_split_modules``, as HF and Accelerate default to — less any class that holds the
    input/output embeddings or the final norm: Accelerate shards those on their own after the layers, and a wrapped
    class around them makes it shard already-sharded weights, which dies inside torch ("Invariant encountered: value
    was None"; BERT's no-split classes include ``BertEmbeddings``). A given class that is not in the model, or that
    holds those modules, is refused in one sentence naming the model's block classes."""
    carved = _carved_modules(model)
    classes: dict[str, list] = {}
    for m in model.modules():
        classes.setdefault(type(m).__name__, []).append(m)

    def holds_carved(name: str) -> bool:
        return any(c is not m and any(c is x for x in m.modules()) for m in classes.get(name, ()) for c in carved)

    default = [n for n in dict.fromkeys(getattr(model, "_no_split_modules", None) or ()) if n in classes and not holds_carved(n)]
    if given is None:
        return default
    names = [given] if isinstance(given, str) else list(given)
    hint = f"""--fsdp_config '{{"transformer_layer_cls_to_wrap": {json.dumps(default)}}}' (or no --fsdp_config)"""
    for name in names:
        if name not in classes:
            raise ValueError(f"--fsdp_config transformer_layer_cls_to_wrap names {name}, which is no module class of "
                             f"this model ({type(model).__name__}); its blocks: {hint}")
        if holds_carved(name):
            raise ValueError(f"--fsdp_config transformer_layer_cls_to_wrap names {name}, which holds the model's "
                             "embeddings (or final norm) that Accelerate shards on their own: torch would fail on "
                             f"the already-sharded weights; wrap the blocks instead: {hint}")
    return names


def set_wrap_classes(accelerator, model) -> None:
    """Under FSDP2 with the transformer-based wrap (DP and ``--disable_dp`` runs alike, before ``prepare``): the
    plugin's layer classes (in ``accelerator``'s state) from :func:`wrap_classes` — ``model``'s own blocks when none
    were given."""
    plugin = getattr(accelerator.state, "fsdp_plugin", None)
    if plugin is None or model is None or int(getattr(plugin, "fsdp_version", 1) or 1) != 2:
        return
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    if getattr(plugin.auto_wrap_policy, "func", plugin.auto_wrap_policy) is transformer_auto_wrap_policy:
        plugin.transformer_cls_names_to_wrap = wrap_classes(model, plugin.transformer_cls_names_to_wrap)


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


def collective_device() -> torch.device:
    """Where a tensor for a collective on the default process group must live: the current CUDA device under NCCL
    (which reduces CUDA tensors only), else the CPU (gloo)."""
    import torch.distributed as dist

    if "nccl" in str(dist.get_backend()).lower():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@torch.no_grad()
def check_loss_scale_agrees(scale: float) -> None:
    """Under FSDP, after each micro-batch's backward: every rank scaled its Σ_i c_i ℓ_i by the same factor. The
    reduce-scatter sums the ranks' scaled gradients before any rank divides by its own factor, so a rank with a
    larger factor (a subclass scaling the loss per rank) would let its examples contribute more than C; one
    all-reduce of two numbers per micro-batch refuses that before the step."""
    import torch.distributed as dist

    t = torch.tensor([scale, -scale], dtype=torch.float64, device=collective_device())
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
    merged.config = base.config  # the trained model's config (its ledger record: hf_dp.run.lineage)
    return merged


def full_state_dict(model) -> dict:
    """The full (unsharded) state dict of an FSDP2 model, on CPU, on rank 0 (empty elsewhere); every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


# ------------------------------------------------------------------------------------------------------------------
# sharded checkpoints (--save_strategy steps/epoch under FSDP)
# ------------------------------------------------------------------------------------------------------------------
#: the folder of a checkpoint that holds the DP optimizer's state under FSDP (``torch.distributed.checkpoint``): the
#: update rule's state, sharded as its parameters, and the privatizer's own part (the privacy ledger, the sampler's N
#: and q, the steps taken: ``PrivateOptimizer.state_dict()["hf_dp"]``, no seed and no generator state)
OPTIMIZER_DIR = "hf_dp_optimizer_fsdp"


def save_checkpoint_state(accelerator, model, optimizer, scheduler, should_save: bool, output_dir: str) -> None:
    """In place of HF's ``_save_optimizer_and_scheduler`` under DP with FSDP (every rank calls it): the ``model`` with
    Accelerate's ``save_fsdp_model`` through ``accelerator`` (as HF writes it: sharded or gathered by
    ``state_dict_type``), the DP optimizer's state (``optimizer``, the privatizer) into :data:`OPTIMIZER_DIR` with
    ``torch.distributed.checkpoint`` (each rank its own shards), the ``scheduler`` by the saving process
    (``should_save``)."""
    import io

    import torch.distributed.checkpoint as dcp
    from accelerate.utils import save_fsdp_model
    from transformers.distributed.fsdp import get_fsdp_ckpt_kwargs
    from transformers.trainer import SCHEDULER_NAME

    save_fsdp_model(accelerator.state.fsdp_plugin, accelerator, model, output_dir, **get_fsdp_ckpt_kwargs())
    state = optimizer.state_dict()
    extras = io.BytesIO()
    torch.save(state["hf_dp"], extras)  # one opaque leaf: loaded with weights_only=True, as optimizer.pt is
    dcp.save({"optimizer": state["rule"], "hf_dp": extras.getvalue()},
             storage_writer=dcp.FileSystemWriter(os.path.join(output_dir, OPTIMIZER_DIR)))
    if should_save:
        torch.save(scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))


def load_checkpoint_state(optimizer, scheduler, checkpoint: str) -> None:
    """In place of HF's optimizer and scheduler load under DP with FSDP (every rank calls it, after HF loaded the
    model's shards): the DP optimizer's state from :data:`OPTIMIZER_DIR` into ``optimizer`` (the privatizer's
    ``PrivateOptimizer.load_state_dict``) — the path of ``optimizer.pt`` without FSDP (the ledger and the sampler's N
    and q checked, the rule's state restored) — and the ``scheduler``'s. The state to load into is built from the
    checkpoint's own metadata (as torch's ``_EmptyStateDictLoadPlanner`` does), each tensor shaped like its parameter
    sharded as that parameter: the optimizer is never stepped to create it."""
    import io
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._traverse import set_element  # as torch's _EmptyStateDictLoadPlanner rebuilds
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    from transformers.trainer import SCHEDULER_NAME

    path = os.path.join(checkpoint, OPTIMIZER_DIR)
    _check_dcp_metadata(os.path.join(path, ".metadata"), checkpoint, tensors_only=False)  # before torch unpickles it
    metadata = dcp.FileSystemReader(path).read_metadata()
    private = optimizer
    params = [p for group in private.rule.param_groups for p in group["params"]]
    template: dict = {}
    for key, md in metadata.state_dict_metadata.items():
        # the saved object's path: dict keys as str, list positions as int, e.g. ("optimizer", "state", "3", "exp_avg")
        where = tuple(metadata.planner_data[key])
        value = None  # a non-tensor leaf: replaced by the saved object
        if isinstance(md, TensorStorageMetadata):
            p = None
            if len(where) == 4 and where[:2] == ("optimizer", "state") and str(where[2]).isdigit() and int(where[2]) < len(params):
                p = params[int(where[2])]
            if p is not None and tuple(md.size) == tuple(p.shape):
                value = torch.zeros_like(p, dtype=md.properties.dtype)  # sharded as its parameter: each rank its shard
            else:
                value = torch.empty(md.size, dtype=md.properties.dtype)
        set_element(template, where, value)
    if "hf_dp" not in template or not isinstance(template.get("optimizer"), dict):
        raise ValueError(f"refusing to resume from {checkpoint}: {OPTIMIZER_DIR} is not an hf_dp optimizer state")
    from torch.distributed.checkpoint.api import CheckpointException  # (a BaseException: every rank's failures)

    try:
        dcp.load(template, storage_reader=dcp.FileSystemReader(path), planner=_weights_only_load_planner())
    except (CheckpointException, pickle.UnpicklingError) as e:
        if "Weights only load failed" in str(e):
            raise ValueError(f"refusing to resume from {checkpoint}: {OPTIMIZER_DIR} holds an object other than tensors "
                             "and plain values (it is read with weights_only=True)") from None
        raise
    rule_state = template["optimizer"]
    rule_state["state"] = {int(k): v for k, v in (rule_state.get("state") or {}).items()}  # torch's ids (DCP's keys are str)
    extras = torch.load(io.BytesIO(template["hf_dp"]), weights_only=True)
    private.load_state_dict({"rule": rule_state, "hf_dp": extras})
    scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME), weights_only=True))


#: what a ``torch.distributed.checkpoint`` ``.metadata`` file is built of (torch 2.x; plus torch's dtypes): it is a
#: pickle, which torch reads with plain ``pickle.load`` — any other global in it could run code at resume
_DCP_METADATA_GLOBALS = frozenset(
    {("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata",
        "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")}
    | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"), ("torch.serialization", "_get_layout"),
       ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PureWindowsPath"),
       ("collections", "OrderedDict")}
)


def _check_dcp_metadata(path: str, checkpoint: str, tensors_only: bool) -> None:
    """Read a DCP ``.metadata`` pickle allowing only :data:`_DCP_METADATA_GLOBALS` (Python's documented way of
    restricting an unpickler) before torch reads it with plain ``pickle.load``; ``tensors_only``: refuse non-tensor
    entries (DCP loads those with ``torch.load(weights_only=False)``)."""
    import pickle

    class Restricted(pickle.Unpickler):
        def find_class(self, module, name):
            if (module, name) in _DCP_METADATA_GLOBALS or (
                    module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)):
                return super().find_class(module, name)
            raise pickle.UnpicklingError(f"{module}.{name}")

    rel = os.path.relpath(path, checkpoint)
    try:
        with open(path, "rb") as f:
            metadata = Restricted(f).load()
    except Exception as e:  # noqa: BLE001 - any failure: not a plain DCP metadata file
        raise ValueError(f"refusing to resume from {checkpoint}: {rel} is not a plain torch.distributed.checkpoint "
                         f"metadata file ({type(e).__name__}: {str(e)[:80]}), and it is read with pickle") from None
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    entries = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(entries, dict) or (tensors_only and any(isinstance(m, BytesStorageMetadata) for m in entries.values())):
        raise ValueError(f"refusing to resume from {checkpoint}: {rel} is not a model's sharded state (tensors only); "
                         "torch would unpickle its other entries with weights_only=False")


#: the files ``torch.distributed.checkpoint`` unpickles as a folder's metadata: ``.metadata``, and, when that is missing
#: or unreadable, the rank-local ``__<rank>.metadata`` (``dcp.load`` falls back to it, also with plain ``pickle.load``)
_DCP_METADATA_NAME = re.compile(r"^(__\d+)?\.metadata$")


def _check_dcp_files(checkpoint: str) -> None:
    """Every DCP metadata file of ``checkpoint`` checked (:func:`_check_dcp_metadata`): the privatizer's state may hold
    non-tensor entries (read with :class:`_WeightsOnlyLoadPlanner`), a model's sharded state (HF's load) tensors only.
    The rank-local ``__<rank>.metadata`` files too (DCP's fallback when ``.metadata`` is missing or unreadable); a
    metadata name that is not a regular file, and a symlinked folder (which the walk would not enter, while
    Accelerate's load follows it), are refused."""
    for root, dirs, files in os.walk(checkpoint):
        own = os.path.abspath(root) == os.path.abspath(os.path.join(checkpoint, OPTIMIZER_DIR))
        for name in dirs:
            path = os.path.join(root, name)
            rel = os.path.relpath(path, checkpoint)
            if os.path.islink(path):
                raise ValueError(f"refusing to resume from {checkpoint}: {rel} is a symbolic link to a folder (a "
                                 "checkpoint hf_dp writes has none; its files would be loaded unchecked)")
            if _DCP_METADATA_NAME.match(name):
                raise ValueError(f"refusing to resume from {checkpoint}: {rel} is a folder, not a "
                                 "torch.distributed.checkpoint metadata file")
        for name in files:
            if _DCP_METADATA_NAME.match(name):
                _check_dcp_metadata(os.path.join(root, name), checkpoint, tensors_only=not own)


def _weights_only_load_planner():
    """DCP's default load planner, except that its non-tensor entries are read with ``torch.load(weights_only=True)``
    (torch's own reads them with ``weights_only=False``)."""
    import io

    from torch.distributed.checkpoint import DefaultLoadPlanner
    from torch.distributed.checkpoint._traverse import set_element

    class _WeightsOnlyLoadPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value: io.BytesIO) -> None:  # DefaultLoadPlanner's, with weights_only=True
            obj = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], obj)
            else:
                self.state_dict[read_item.dest_index.fqn] = obj

    return _WeightsOnlyLoadPlanner()


def check_resume(checkpoint: str, marker: dict | None, fsdp: bool, world_size: int) -> None:
    """Before resuming under DP (one ``ValueError`` sentence): a checkpoint written under FSDP resumes only under FSDP
    with the number of processes that wrote it (its shards, and the ranks' noise streams, are laid out for that
    number; resharding is untested), and only if it holds the DP optimizer's state; one written without FSDP does not
    resume under FSDP (HF's FSDP load reads sharded checkpoints only)."""
    written = (marker or {}).get("fsdp")
    world_size = max(1, int(world_size))
    if written:
        w = int(written.get("world_size") or 0)
        if not fsdp or w != world_size:
            now = f"{world_size} process{'es' if world_size > 1 else ''}" + (" under --fsdp" if fsdp else " without --fsdp")
            raise ValueError(
                f"refusing to resume from {checkpoint}: it was written under FSDP by {w} processes (a sharded model and "
                f"optimizer state), not with {now}; resume it with --fsdp and {w} processes"
            )
        if not os.path.isfile(os.path.join(checkpoint, OPTIMIZER_DIR, ".metadata")):
            raise ValueError(
                f"refusing to resume from {checkpoint}: it holds no sharded DP optimizer state ({OPTIMIZER_DIR}), so no "
                "privacy ledger (it was written with --save_only_model or without DP); resume from a checkpoint that has it"
            )
        _check_dcp_files(checkpoint)  # before HF's and hf_dp's loads unpickle them
    elif fsdp:
        raise ValueError(
            f"refusing to resume from {checkpoint} under --fsdp: it was written without FSDP (a full model and "
            "optimizer.pt); resume it without --fsdp, with the processes that wrote it"
        )
