"""Per-sample gradients for a plain (unwrapped) model via Opacus hooks (``--clipping hooks``).

Layer types are Opacus' own registry (``opacus.grad_sample.register_grad_sampler``); the privatizer clips the
per-sample gradients (:meth:`hf_dp.privacy.privatizer.PrivateOptimizer.accumulate`). The batch hooks below
(:func:`install_batch_hooks`) serve ghost clipping too.

Design: the model is *not* replaced by Opacus' ``GradSampleModule`` wrapper.
:func:`attach_grad_sampler` constructs ``opacus.GradSampleModule(model,
batch_first=True, loss_reduction="sum")`` only for its side effect of
registering forward/backward hooks on the model's trainable submodules, and
keeps that object inside the returned :class:`GradSamplerHandle`.  The caller
keeps using the plain model for forward passes and saving (no ``_module.``
prefixes); after ``loss.backward()`` on the plain model (in train mode, with
grad enabled) every trainable parameter ``p`` carries ``p.grad_sample`` of
shape ``[batch_size, *p.shape]``.  ``loss_reduction="sum"`` means the
per-sample gradients are the gradients of each example's term of the loss that
was back-propagated: with a summed loss they are the true per-example
gradients; with a mean loss they are scaled by ``1 / batch_size``.

Extra hooks added by this module:

* **Broadcast inputs.**  Transformers models feed buffers such as
  ``position_ids`` of shape ``[1, L]`` into ``nn.Embedding`` and rely on
  broadcasting over the batch.  Opacus needs the batch dimension, so a forward
  pre-hook on the model (and on every ``PreTrainedModel`` inside it) records
  the batch size ``B`` from ``input_ids`` / ``inputs_embeds`` (keyword or first
  positional argument), and a forward pre-hook on every *trainable*
  ``nn.Embedding`` expands a batch-1 index tensor to ``[B, ...]``
  (``.expand(...).contiguous()``).  The embedding output then has a real batch
  dimension; after the broadcasting add it is numerically identical.
* **BatchNorm.**  BatchNorm (any ``torch.nn.modules.batchnorm._BatchNorm``,
  incl. ``SyncBatchNorm``) mixes examples of a batch.  A BatchNorm with
  trainable parameters is rejected with ``ValueError`` when attaching.  A
  frozen BatchNorm is allowed only in eval mode: a forward pre-hook raises
  ``RuntimeError`` if it runs in training mode (note that
  ``Trainer``/``model.train()`` put it in training mode).  Other layers that
  Opacus' ``ModuleValidator`` rejects (e.g. ``nn.LSTM``, ``nn.MultiheadAttention``,
  ``InstanceNorm`` with running stats) are rejected when they hold trainable
  parameters, as are trainable modules with buffers that Opacus cannot handle.

* **Embeddings with ``padding_idx``.**  Opacus' grad sampler for ``nn.Embedding`` adds the output gradient
  of every position to the row of its token id, also where the id is ``padding_idx``, whose row autograd never
  updates. The output gradient at padding positions is not always 0 (a left-padded causal LM scores its first
  real token from the last padding position), so Opacus' per-sample gradient of that row would differ from the
  true one. :func:`attach_grad_sampler` registers a grad sampler for ``nn.Embedding`` (in Opacus' registry, for
  the process) that zeroes the output gradient at ``padding_idx`` positions first (exact zeros, also for a NaN
  gradient) and is otherwise Opacus' own.
* **Tied weights.**  A parameter used by two modules (GPT-2's ``lm_head.weight is transformer.wte.weight``) gets
  the sum of both modules' per-sample gradients (Opacus accumulates ``grad_sample`` over the modules of one
  backward): exactly the per-example gradient (``tests/test_clm_layers.py``).
* **RMSNorm.**  transformers' per-family ``*RMSNorm`` classes have no Opacus grad sampler; Opacus computes their
  per-sample gradients with its generic functorch fallback (a per-example ``vmap`` of the module's own forward),
  which is exact for any of them; ``torch.nn.RMSNorm`` has Opacus' own sampler.

What cannot be fixed generically: parameters that are used directly rather
than through their module's forward (DeBERTa's ``rel_embeddings.weight``) get
no per-sample gradient, and modules called with a non-batch input (MPNet's
``relative_attention_bias`` receives ``[L, L]`` bucket ids) get per-sample
gradients of the wrong batch size.  :func:`assert_grad_samples_complete`
detects both after the first backward pass and raises a clear error.  (If by
coincidence ``L == B`` the MPNet case is not detectable by shapes; with
``last_block``/``lora`` these layers are frozen so the issue never arises.)
"""

from __future__ import annotations

import copy
import functools
from typing import Any

import torch
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm

from .copies import note_hooks

__all__ = [
    "GradSamplerHandle",
    "attach_grad_sampler",
    "assert_grad_samples_complete",
    "install_batch_hooks",
    "unwrap_for_save",
]

_OPACUS_PARAM_ATTRS = ("grad_sample", "_forward_counter", "_current_grad_sample", "_norm_sample")
_OPACUS_MODULE_ATTRS = ("activations", "max_batch_len", "ft_compute_sample_grad", "autograd_grad_sample_hooks")
_SUGGESTION = "use --trainable last_block or --trainable lora (which keep such layers frozen)"


def _has_trainable_params(module: nn.Module, recurse: bool = False) -> bool:
    return any(p.requires_grad for p in module.parameters(recurse=recurse))


def _validate(model: nn.Module) -> None:
    """Raise ``ValueError`` for trainable layers whose per-sample gradients are undefined."""
    from opacus.validators import ModuleValidator

    problems: list[str] = []
    for name, module in model.named_modules():
        if isinstance(module, _BatchNorm) and _has_trainable_params(module, recurse=True):
            problems.append(
                f"{name or '<model>'} ({type(module).__name__}) is trainable, but BatchNorm mixes the "
                "examples of a batch, so per-example gradients (and DP) are undefined; freeze it or "
                "replace it by GroupNorm/LayerNorm"
            )
            continue
        if not _has_trainable_params(module):
            continue
        validator = ModuleValidator.VALIDATORS.get(type(module))
        if validator is not None:
            for err in validator(module):
                problems.append(f"{name or '<model>'} ({type(module).__name__}): {err}")
    if problems:
        raise ValueError(
            "Cannot compute per-sample gradients for this model: " + "; ".join(problems) + "."
        )


def _batch_size_from_call(args: tuple, kwargs: dict) -> int | None:
    for key in ("input_ids", "inputs_embeds"):
        t = kwargs.get(key)
        if torch.is_tensor(t) and t.dim() >= 1:
            return int(t.shape[0])
    if args and torch.is_tensor(args[0]) and args[0].dim() >= 1:
        return int(args[0].shape[0])
    return None


class GradSamplerHandle:
    """Handle returned by :func:`attach_grad_sampler`.

    Attributes:
        model: the (plain) model the hooks are attached to.
        gsm: the ``opacus.GradSampleModule`` that owns the Opacus hooks.  Do
            not call it or save it; use ``model``.
        batch_size: batch size recorded at the last forward of ``model``
            (``None`` before the first forward).

    Use :meth:`detach` (or ``with attach_grad_sampler(model) as handle:``) to
    remove every hook and ``grad_sample`` attribute.

    Opacus stores the inputs of every trainable layer at each forward pass run
    in training mode with gradients enabled and consumes them in the matching
    backward pass, so every such forward must be followed by ``backward()``
    (evaluate in eval mode or under ``torch.no_grad()``), and per-sample
    gradients of consecutive backward passes are stacked into a list unless
    :meth:`clear_grad_samples` is called in between.
    """

    def __init__(self, model: nn.Module, gsm: Any, hook_handles: list):
        self.model = model
        self.gsm = gsm
        self._hook_handles = hook_handles
        self.batch_size: int | None = None
        self.attached = True
        self.paused = False  # ClippingEngine.pause: the batch hooks leave the model as it is

    def trainable_parameters(self) -> list[tuple[str, nn.Parameter]]:
        return [(n, p) for n, p in self.model.named_parameters() if p.requires_grad]

    def clear_grad_samples(self) -> None:
        """Set ``p.grad_sample = None`` on every parameter (call after each optimizer step)."""
        for p in self.model.parameters():
            if hasattr(p, "grad_sample"):
                p.grad_sample = None

    def detach(self) -> None:
        """Remove all hooks (Opacus' and ours) and the Opacus attributes. Idempotent."""
        if not self.attached:
            return
        self.attached = False
        for h in self._hook_handles:
            h.remove()
        self._hook_handles = []
        cleanup = getattr(self.gsm, "cleanup", None)
        if cleanup is not None:
            cleanup()
        else:  # older Opacus
            self.gsm.remove_hooks()
        _strip_opacus_state(self.model)

    def __enter__(self) -> "GradSamplerHandle":
        return self

    def __exit__(self, *exc) -> None:
        self.detach()

    def __repr__(self) -> str:
        state = "attached" if self.attached else "detached"
        return f"GradSamplerHandle({type(self.model).__name__}, {state})"


def _strip_opacus_state(model: nn.Module) -> None:
    for p in model.parameters():
        for attr in _OPACUS_PARAM_ATTRS:
            if hasattr(p, attr):
                delattr(p, attr)
    for m in model.modules():
        for attr in _OPACUS_MODULE_ATTRS:
            if attr in m.__dict__:
                del m.__dict__[attr]


def install_batch_hooks(model: nn.Module, holder) -> list:
    """Hooks shared by every per-sample-gradient engine (Opacus hooks, ghost clipping).

    1. record the batch size of each forward call in ``holder.batch_size`` (from ``input_ids`` /
       ``inputs_embeds``);
    2. expand batch-1 (broadcast) inputs of trainable ``nn.Embedding`` layers — HF passes buffers such
       as ``position_ids`` of shape ``[1, L]`` — to ``[B, L]`` (contiguous), which leaves the output
       unchanged after broadcasting but gives every example its own rows;
    3. make frozen BatchNorm layers refuse to run in training mode (batch statistics mix examples).

    Returns the hook handles.
    """
    from transformers import PreTrainedModel

    handles: list = []
    handle = holder

    # 1. batch size recorder on the model and any PreTrainedModel inside it.
    def record_batch_size(_module, args, kwargs):
        bs = _batch_size_from_call(args, kwargs)
        if bs is not None:
            handle.batch_size = bs

    depth = [0]  # > 0 while the model's own forward runs (not Opacus' per-example functorch replays)

    def enter(_module, _args):
        depth[0] += 1

    def leave(_module, _args, _out):
        depth[0] -= 1

    tops = [model] + [m for m in model.modules() if m is not model and isinstance(m, PreTrainedModel)]
    for m in tops:
        handles.append(m.register_forward_pre_hook(record_batch_size, with_kwargs=True))
    handles.append(model.register_forward_pre_hook(enter))
    handles.append(model.register_forward_hook(leave, always_call=True))

    # 2. expand batch-1 (broadcast) inputs of trainable embeddings.
    def expand_broadcast_input(_module, args):
        bs = handle.batch_size
        if not args or bs is None or bs <= 1 or getattr(handle, "paused", False):  # (paused: the model as it is)
            return None
        x = args[0]
        if torch.is_tensor(x) and x.dim() >= 1 and x.shape[0] == 1:
            return (x.expand(bs, *x.shape[1:]).contiguous(),) + tuple(args[1:])
        return None

    # 3. frozen BatchNorm must run in eval mode.
    def forbid_train_mode(module, _args):
        if module.training and not getattr(handle, "paused", False):
            raise RuntimeError(
                f"{type(module).__name__} runs in training mode under DP training: it normalizes with "
                "batch statistics, which mixes examples. Put it in eval mode (module.eval()) or replace it."
            )

    # 4. a trainable layer applied to an input shared by the whole batch (e.g. DeBERTa's relative-position
    #    embeddings projected by the attention's query/key layers, then repeated over the batch): its
    #    gradient mixes all examples and cannot be split per example — neither Opacus' hooks nor ghost
    #    clipping can bound each example's contribution, so refuse rather than mis-attribute it.
    def forbid_shared_input(module, args, _name=None):
        bs = handle.batch_size
        if (depth[0] <= 0 or not module.training or not torch.is_grad_enabled() or bs is None or not args
                or getattr(handle, "paused", False)):
            return None
        x = args[0]
        if torch.is_tensor(x) and x.dim() >= 2 and x.shape[0] != bs:
            raise ValueError(
                f"trainable layer {_name} ({type(module).__name__}) is applied to an input with batch dimension "
                f"{x.shape[0]} while the batch has {bs} examples (an input shared by the whole batch): its "
                "per-example gradients cannot be separated, so each example's contribution could not be bounded. "
                "Freeze it (e.g. --trainable head or a LoRA/target choice that avoids it)."
            )
        return None

    import functools

    for name, m in model.named_modules():
        if isinstance(m, nn.Embedding) and m.weight.requires_grad:
            handles.append(m.register_forward_pre_hook(expand_broadcast_input))
        elif isinstance(m, _BatchNorm):
            handles.append(m.register_forward_pre_hook(forbid_train_mode))
        if any(p.requires_grad for p in m.parameters(recurse=False)):
            handles.append(m.register_forward_pre_hook(functools.partial(forbid_shared_input, _name=name)))

    return handles


def _embedding_grad_sample(layer: nn.Embedding, activations, backprops):
    """Opacus' ``nn.Embedding`` grad sampler with the output gradient at ``padding_idx`` positions zeroed first:
    autograd gives the padding row no gradient from the embedding (see the module docstring)."""
    from opacus.grad_sample.embedding import compute_embedding_grad_sample

    if layer.padding_idx is not None:
        backprops = backprops.masked_fill((activations[0] == layer.padding_idx).unsqueeze(-1), 0)  # ids [B, …], g [B, …, d]
    return compute_embedding_grad_sample(layer, activations, backprops)


def _register_grad_samplers() -> None:
    from opacus.grad_sample.grad_sample_module import GradSampleModule

    GradSampleModule.GRAD_SAMPLERS[nn.Embedding] = _embedding_grad_sample


def attach_grad_sampler(model: nn.Module) -> GradSamplerHandle:
    """Register Opacus per-sample-gradient hooks on ``model`` (in place) and return a handle.

    Validates the trainable modules first (see the module docstring) and raises
    ``ValueError`` for BatchNorm or other unsupported trainable layers, or if
    nothing is trainable.  Only hooks are added; ``model`` keeps its class,
    its ``forward`` and its ``state_dict`` keys.  Per-sample gradients appear in
    ``p.grad_sample`` after ``loss.backward()`` when the forward pass ran in
    training mode with gradients enabled.
    """
    from opacus import GradSampleModule

    if hasattr(model, "autograd_grad_sample_hooks"):
        raise ValueError("A grad sampler is already attached to this model; detach it first.")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError("The model has no trainable parameter; call apply_trainable first.")
    _validate(model)

    _register_grad_samplers()
    handles: list = []
    handle = GradSamplerHandle(model, None, handles)

    handles.extend(install_batch_hooks(model, handle))

    try:
        gsm = GradSampleModule(model, batch_first=True, loss_reduction="sum", strict=True)
    except NotImplementedError as e:
        for h in handles:
            h.remove()
        _strip_opacus_state(model)
        raise ValueError(
            f"Opacus cannot compute per-sample gradients for a trainable layer of this model ({e}); "
            + _SUGGESTION
            + "."
        ) from e
    except Exception:
        for h in handles:
            h.remove()
        _strip_opacus_state(model)
        raise
    handle.gsm = gsm
    # a copy of the model (deepcopy, pickle) has none of these hooks nor Opacus' attributes (hf_dp.clipping.copies)
    note_hooks(model, handles + list(getattr(model, "autograd_grad_sample_hooks", None) or []), _OPACUS_MODULE_ATTRS)
    return handle


def assert_grad_samples_complete(
    model: nn.Module,
    batch_size: int,
    *,
    allow_unused: bool = False,
    check_sum: bool = False,
    rtol: float = 1e-3,
) -> None:
    """Check that every trainable parameter got a correct-looking per-sample gradient.

    Call after the first ``loss.backward()`` (before ``grad_sample`` is cleared).
    Every parameter with ``requires_grad`` must have a tensor ``grad_sample`` of
    shape ``[batch_size, *p.shape]`` (if Opacus stacked a list over several
    backward passes, its last entry is checked).

    Args:
        model: the model passed to :func:`attach_grad_sampler`.
        batch_size: the number of examples in that forward/backward pass.
        allow_unused: if True, trainable parameters that received neither a
            gradient nor a per-sample gradient (not used in the forward pass)
            are accepted (their per-sample gradients are zero).
        check_sum: if True, additionally require ``grad_sample.sum(0)`` to
            match ``p.grad`` (relative tolerance ``rtol`` of the gradient's
            norm).  Only valid when ``p.grad`` comes from exactly that one
            backward pass without cross-process averaging (not under DDP or
            gradient accumulation).

    Raises:
        ValueError: naming the offending parameters and suggesting
            ``--trainable last_block`` / ``lora``.
    """
    missing, wrong_shape, unused, mismatch = [], [], [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        gs = getattr(p, "grad_sample", None)
        if isinstance(gs, (list, tuple)):
            gs = gs[-1] if len(gs) else None
        if gs is None:
            if p.grad is None:
                if not allow_unused:
                    unused.append(name)
            else:
                missing.append(name)
            continue
        if tuple(gs.shape) != (batch_size, *p.shape):
            wrong_shape.append(f"{name} {tuple(gs.shape)} != {(batch_size, *tuple(p.shape))}")
            continue
        if check_sum and p.grad is not None:
            diff = (gs.sum(0) - p.grad).norm()
            if diff > rtol * p.grad.norm() + 1e-8:
                mismatch.append(name)
    parts = []
    if missing:
        parts.append(
            "no per-sample gradient although a gradient was computed (the parameter is used directly, "
            "not through its module's forward): " + ", ".join(missing)
        )
    if wrong_shape:
        parts.append(
            "per-sample gradient without the batch dimension (the layer is called on a non-batch "
            "input): " + ", ".join(wrong_shape)
        )
    if unused:
        parts.append("no gradient at all (unused in the forward pass): " + ", ".join(unused))
    if mismatch:
        parts.append("per-sample gradients do not sum to the gradient: " + ", ".join(mismatch))
    if parts:
        raise ValueError(
            "Per-sample gradients are incomplete or incorrect, so DP clipping would be wrong. "
            + "; ".join(parts)
            + f". Freeze these parameters: {_SUGGESTION}."
        )


def _is_dp_hook(fn) -> bool:
    """True for hooks registered by Opacus (bound to a grad-sample hooks object) or by this module."""
    from opacus.grad_sample.gsm_base import AbstractGradSampleHooks

    while isinstance(fn, functools.partial):
        fn = fn.func
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, AbstractGradSampleHooks):
        return True
    return getattr(fn, "__module__", None) == __name__


def _strip_dp_hooks(model: nn.Module) -> None:
    for m in model.modules():
        for attr in ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"):
            hooks = getattr(m, attr, None)
            if not hooks:
                continue
            for key in [k for k, fn in hooks.items() if _is_dp_hook(fn)]:
                del hooks[key]
                for extra in ("_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs",
                              "_forward_hooks_always_called"):
                    d = getattr(m, extra, None)
                    if d is not None:
                        d.pop(key, None)
        if not m._backward_hooks:
            m._is_full_backward_hook = None
    _strip_opacus_state(model)


def unwrap_for_save(model: nn.Module) -> nn.Module:
    """Return the plain transformers model to save.

    * Opacus ``GradSampleModule`` / DDP wrappers are unwrapped (so state-dict
      keys never carry ``_module.`` / ``module.`` prefixes).
    * A PEFT model is deep-copied and ``merge_and_unload()``-ed: the result is
      a plain ``PreTrainedModel`` with the LoRA deltas merged into the base
      weights and the trained ``modules_to_save`` copies (the head) in place;
      the Opacus/hf_dp hooks and ``grad_sample`` attributes are removed from
      the copy.  The training model is left untouched.
    * Any other model is returned as is (same object).
    """
    from opacus.grad_sample.gsm_base import AbstractGradSampleModule

    while True:
        if isinstance(model, AbstractGradSampleModule):
            model = model._module
        elif isinstance(model, nn.parallel.DistributedDataParallel | nn.DataParallel):
            model = model.module
        else:
            break
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return model
    if isinstance(model, PeftModel):
        merged = copy.deepcopy(model).merge_and_unload()
        _strip_dp_hooks(merged)
        return merged
    return model
