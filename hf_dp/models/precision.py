"""The model's numeric precision under DP: every floating-point weight the forward reads in float32 or float64.

In bfloat16 or float16 each example's activations — and so its gradient and its clip factor — depend on the padded
shape of its micro-batch (kernels block and round by shape), and trainable weights' clipped sums round at 2^-8: one
example could then move the clipped sum by more than C (issue 49's review: 1.47 C from bf16 autocast; a later review:
1.90 C with only a frozen base in bfloat16 under float32 LoRA adapters, 1.46 C for a DPO pair). ``DPTrainer`` refuses
such a model when it is built and at every ``train()``; a trainer that loads a model by name loads it in float32
(:func:`model_init_kwargs`), since transformers keeps a checkpoint's saved dtype, often bfloat16.
"""

from __future__ import annotations

import torch


def reduced_precision_weights(module) -> dict[str, torch.dtype]:
    """``module``'s floating-point parameters and buffers held in less than float32 (bfloat16, float16, float8),
    trainable or frozen: name → dtype."""
    tensors = [*module.named_parameters(), *module.named_buffers()]
    return {n: t.dtype for n, t in tensors if t.is_floating_point() and t.dtype not in (torch.float32, torch.float64)}


def check_full_precision(module, what: str) -> None:
    """Refuse a DP run whose forward reads weights in reduced precision — a frozen base under LoRA, a reference model:
    each example's activations, and so its gradient, would depend on the micro-batch's padded shape at bfloat16's
    rounding (one pair beside 256 short copies moved the clipped sum by 1.46 C under a bfloat16 base with float32
    adapters, a causal LM's row by 1.90 C), so the clip factor of one example would depend on the others."""
    low = reduced_precision_weights(module)
    if low:
        dtypes = ", ".join(sorted({str(d).replace("torch.", "") for d in low.values()}))
        raise ValueError(f"DP training needs {what} in float32 (or float64), got {dtypes} weights (such as {next(iter(low))}"
                         ", frozen or not): in reduced precision each example's forward depends on its micro-batch's "
                         "padded shape and trainable weights' clipped sums round at 2^-8, so one example can move the "
                         "clipped sum by more than C; load it with dtype=torch.float32")


def model_init_kwargs(args) -> dict:
    """``from_pretrained``'s keyword arguments for a model a trainer is given by name (TRL's ``model_init_kwargs``):
    under DP the weights load in float32 unless the config says otherwise (transformers keeps a checkpoint's saved
    dtype, often bfloat16, which :func:`check_full_precision` refuses)."""
    kwargs = dict(getattr(args, "model_init_kwargs", None) or {})
    if not getattr(args, "disable_dp", False):
        kwargs.setdefault("dtype", torch.float32)
    return kwargs


def check_no_mixed_precision(args) -> None:
    """Refuse mixed precision that does not show in ``--bf16`` / ``--fp16``: transformers reads
    ``ACCELERATE_MIXED_PRECISION`` (set by ``accelerate launch --mixed_precision bf16`` or an ``accelerate config``
    default) into ``args.mixed_precision``, and Accelerate then runs every forward under autocast (one example moved
    the clipped sum by 2.83 C)."""
    mixed = getattr(args, "mixed_precision", None)
    if mixed not in (None, "no", ""):
        raise ValueError(f"mixed precision {mixed} (ACCELERATE_MIXED_PRECISION, from accelerate launch --mixed_precision "
                         "or an accelerate config) is not supported with DP training: under autocast each example's "
                         "gradient depends on its micro-batch's padded shape, so one example can move the clipped sum "
                         "by more than C; set ACCELERATE_MIXED_PRECISION=no (accelerate launch --mixed_precision no)")


def check_output_precision(logits, what: str = "the model") -> None:
    """Every micro-batch under DP: the forward's output in float32 or float64. Reduced-precision logits from float32
    weights mean an autocast that no flag shows (a forward that enters ``torch.autocast``, a wrapper)."""
    if logits.is_floating_point() and logits.dtype not in (torch.float32, torch.float64):
        raise ValueError(f"{what}'s forward returned {str(logits.dtype).replace('torch.', '')} logits in a DP step: it "
                         "ran in reduced precision (autocast), where each example's gradient depends on its "
                         "micro-batch's padded shape, so one example can move the clipped sum by more than C; train "
                         "without autocast or mixed precision")

