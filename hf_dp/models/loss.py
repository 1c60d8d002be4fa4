"""The per-example loss DPTrainer clips: one loss per example, as the model's own head would compute it.

One registry, the source of truth for which heads DP training supports (:data:`OBJECTIVES`, :func:`objective_for`):

* ``sequence_classification`` (``*ForSequenceClassification``): the problem type the model's own loss would use
  (regression, single-label, multi-label), one loss per row.
* ``causal_lm`` (``*ForCausalLM``, GPT-2's ``GPT2LMHeadModel``, …): labels ``[B, T]`` are shifted as the model's
  own loss (transformers' ``ForCausalLMLoss``) shifts them — padded with -100 on the right, ``labels[:, t + 1]``
  scored against ``logits[:, t]`` — and each sequence's loss is the mean cross-entropy over its own scored tokens
  (0 for a sequence with none). Never divided by the micro-batch's token count (``num_items_in_batch``), which
  would couple the examples: on an unpadded or right-padded one-sequence batch this *is* the model's own loss (a
  padding position predicts nothing, so a left-padded row scores the same tokens as unpadded).

A head no objective covers (masked LM, token classification, QA, seq2seq, …) is refused before training
(:func:`hf_dp.run.contract.check_head`): DPTrainer would train it on the wrong objective.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

#: the ignore index of cross-entropy: a label with this value contributes no loss
IGNORE_INDEX = -100


def _float(logits: torch.Tensor) -> torch.Tensor:
    """float32 (float64 for a float64 model), as the model's own loss computes it."""
    return logits if logits.dtype == torch.float64 else logits.float()


def sequence_classification_loss(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """Per-example loss with the problem type ``*ForSequenceClassification`` would use, in float32 (float64 for a
    float64 model)."""
    logits = _float(logits)
    num_labels = logits.shape[-1]
    problem = getattr(config, "problem_type", None)
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        return F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).view(-1), reduction="none")
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1), reduction="none")
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").sum(-1)


#: rows of logits per chunk of :func:`token_cross_entropy`'s log-sum-exp (its temporaries stay a few MB)
_CE_ROWS = 16


class _TokenCrossEntropy(torch.autograd.Function):
    """ℓ_t = logsumexp(z_t) − z_t[y_t] per row (0 where y_t = -100); backward (softmax(z_t) − onehot(y_t))·∂ℓ_t.

    The same values and gradient as ``F.cross_entropy(z, y, reduction="none")`` (to float rounding), with less
    traffic over the [rows, vocab] logits: the forward keeps one log-sum-exp per row instead of writing the
    log-softmax, the backward writes the gradient once (no zero-filled [rows, vocab] for the NLL's gradient, no
    log-softmax backward) — on CPU about a third less time for the loss at a 30,522-word vocabulary (a short
    measurement, issue 41), and one logits-sized tensor fewer alive while the loss back-propagates."""

    @staticmethod
    def forward(ctx, z, target):
        scored = target != IGNORE_INDEX
        t = target.clamp_min(0)
        lse = torch.empty(z.shape[0], dtype=z.dtype, device=z.device)
        for i in range(0, z.shape[0], _CE_ROWS):
            torch.logsumexp(z[i : i + _CE_ROWS], -1, out=lse[i : i + _CE_ROWS])
        ctx.save_for_backward(z, t, scored)
        return torch.where(scored, lse - z.gather(1, t[:, None]).squeeze(1), 0.0)

    @staticmethod
    def backward(ctx, grad):
        z, t, scored = ctx.saved_tensors
        w = torch.where(scored, grad, 0.0)
        g = torch.softmax(z, -1)
        g.mul_(w[:, None])
        g[torch.arange(z.shape[0], device=z.device), t] -= w
        return g, None


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """``[N]`` cross-entropy of each row of ``logits`` [N, V] against ``target`` [N] (0 where the target is -100):
    ``F.cross_entropy(..., ignore_index=-100, reduction="none")`` computed as :class:`_TokenCrossEntropy`; a
    ``[B, V, T]`` layout would also copy the logits and their gradient (before issue 41 it did: twice the LM head's
    time on CPU)."""
    if not logits.requires_grad:
        return F.cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="none")
    return _TokenCrossEntropy.apply(logits.contiguous(), target)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, config=None, attention_mask: torch.Tensor | None = None,
                   token_norm: int | None = None) -> torch.Tensor:
    """``[B]``: each sequence's mean next-token cross-entropy over its scored tokens (label ≠ -100 after the shift),
    0 for a sequence with none. The shift is the model's own (transformers' ``ForCausalLMLoss``). ``token_norm``
    (``--lm_loss_weighting token``): each sequence's token sum divided by this public constant instead (the run's
    ``--dp_max_length``), never by a count of the micro-batch — so every token weighs the same, as in the model's own
    loss over a batch, and the loss is still a function of the sequence alone.

    With ``attention_mask``, only real tokens predict and are predicted: under left padding the model's own loss
    also scores the last pad position against the row's first token, and a collator that copies ``input_ids`` into
    ``labels`` without masking the padding scores a right-padded row's last token against a pad token — terms that
    exist only when another, longer row pads this one, so one example's loss would depend on the others' lengths."""
    logits = _float(logits)
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    if attention_mask is not None:  # neither a padding position nor a padding target is scored
        real = attention_mask.to(torch.bool)
        target_real = F.pad(real, (0, 1), value=False)[:, 1:]
        shift = shift.masked_fill(real.logical_not() | target_real.logical_not(), IGNORE_INDEX)
    B, T = shift.shape
    tokens = token_cross_entropy(logits.reshape(B * T, logits.shape[-1]), shift.reshape(-1)).view(B, T)
    if token_norm is not None:
        return tokens.sum(1) / float(token_norm)
    scored = (shift != IGNORE_INDEX).sum(1)
    return tokens.sum(1) / scored.clamp_min(1).to(tokens.dtype)


def _check_classifier_logits(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 2 or labels.dim() == 0 or logits.shape[0] != labels.shape[0]:
        raise ValueError(
            f"the model returned logits of shape {tuple(logits.shape)} for labels of shape {tuple(labels.shape)}: "
            "DPTrainer's per-example loss needs one row of logits per example ([batch, num_labels]) and one label "
            "per example, as *ForSequenceClassification models return"
        )


def _check_lm_logits(logits: torch.Tensor, labels: torch.Tensor) -> None:
    if logits.dim() != 3 or labels.dim() != 2 or tuple(logits.shape[:2]) != tuple(labels.shape):
        raise ValueError(
            f"the model returned logits of shape {tuple(logits.shape)} for labels of shape {tuple(labels.shape)}: "
            "a causal LM's per-sequence loss needs logits [batch, tokens, vocab] and labels [batch, tokens] (the "
            "collator's labels: DataCollatorForLanguageModeling(tokenizer, mlm=False))"
        )
    if labels.is_floating_point():
        raise ValueError(f"a causal LM's labels must be token ids (integers), got {labels.dtype}")
    bad = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= logits.shape[-1]))
    if bool(bad.any()):
        raise ValueError(
            f"the labels contain token id {int(labels[bad][0])}, outside the model's vocabulary 0..{logits.shape[-1] - 1} "
            "(-100 marks a token that is not scored): the tokenizer and the model's vocab_size do not match"
        )


@dataclass(frozen=True)
class Objective:
    """How DPTrainer computes one head's per-example loss (see the module docstring)."""

    name: str
    #: transformers' auto-mapping whose classes this objective serves
    mapping: str
    #: (logits, labels, config) -> [B] per-example losses
    per_example: Callable
    #: (logits, labels) -> None, or ValueError in one sentence
    check_logits: Callable
    #: the training set carries a label column (else the collator makes the labels, as for language modelling)
    label_column: bool
    #: the collator's labels are per token ([B, T]) rather than per example
    token_labels: bool = False
    #: DPTrainer passes position_ids from the attention mask (a left-padded row's positions then do not depend on the
    #: micro-batch's padded length)
    positions_from_mask: bool = False


OBJECTIVES: dict[str, Objective] = {
    o.name: o
    for o in (
        Objective("sequence_classification", "MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES",
                  sequence_classification_loss, _check_classifier_logits, label_column=True),
        Objective("causal_lm", "MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", causal_lm_loss, _check_lm_logits,
                  label_column=False, token_labels=True, positions_from_mask=True),
    )
}


def _class_names(mapping_name: str) -> set:
    from transformers.models.auto import modeling_auto as auto

    out = set()
    for v in getattr(auto, mapping_name, {}).values():
        out.update(v if isinstance(v, (list, tuple)) else [v])
    return out


def base_model(model):
    """The model under a PEFT wrapper (``get_base_model``), else the model."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def objective_for(model) -> Objective | None:
    """The objective of ``model``'s head: the first class of its MRO (a subclass of a transformers model counts as
    that model) that a registered objective's auto mapping lists, or whose name ends in ``ForSequenceClassification``
    / ``ForCausalLM``; ``None`` if none does."""
    for cls in type(base_model(model)).__mro__:
        name = cls.__name__
        for obj in OBJECTIVES.values():
            if name in _class_names(obj.mapping):
                return obj
        if name.endswith("ForSequenceClassification"):
            return OBJECTIVES["sequence_classification"]
        if name.endswith("ForCausalLM"):
            return OBJECTIVES["causal_lm"]
    return None


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, config, objective: Objective | None = None,
                     attention_mask: torch.Tensor | None = None, token_norm: int | None = None) -> torch.Tensor:
    """``[B]`` per-example losses under ``objective`` (default: sequence classification); ``attention_mask`` and
    ``token_norm`` are read by objectives with per-token labels (see :func:`causal_lm_loss`)."""
    obj = objective or OBJECTIVES["sequence_classification"]
    if obj.token_labels:  # token_norm only when set: a per-token objective of its own (DPO's pairs) takes none
        extra = {} if token_norm is None else {"token_norm": token_norm}
        return obj.per_example(logits, labels, config, attention_mask=attention_mask, **extra)
    return obj.per_example(logits, labels, config)


def positions_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """``position_ids`` counting each row's own tokens (0 at its first unmasked token), whatever its padding side."""
    return (attention_mask.long().cumsum(-1) - 1).clamp_min(0)
