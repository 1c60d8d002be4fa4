"""Black-box canaries for a causal language model (``--audit_canaries m`` on a ``*ForCausalLM``, ``--audit_kind
input``): :mod:`hf_dp.audit.canaries` draws, appends and audits them as it does a sequence classifier's.

A canary is a sequence of tokens drawn uniformly from the vocabulary (special tokens excluded; wrapped in the special
tokens the tokenizer adds around one text, as the training rows are; as long as ``--audit_canary_length``, default 32,
capped by the model's positions), from the same public stream (``--seed``) — there is no label: a language model's
training target is the sequence itself (the collator, ``DataCollatorForLanguageModeling(mlm=False)``, makes the labels
from ``input_ids``). The same rules as the classifier's canaries: one unit each, N = real units + m whatever the draw,
the inclusion bits from the OS entropy source (rank 0's, broadcast in memory under DDP), never pickled, written or
logged, dropped after the audit.

The score of a canary is minus its mean per-token loss (the next-token cross-entropy over its tokens) under the trained
model: a canary the model was trained on tends to be more likely. It is computed through HF's ``evaluation_loop`` with
the trainer's collator, device and forward context (:func:`hf_dp.audit.canaries.canary_scores`), each batch's logits
reduced to one loss per canary on the way (:func:`per_sequence_loss` as ``preprocess_logits_for_metrics``, so that no
[m, tokens, vocabulary] array is gathered) and no ``compute_metrics``: no metric of the canaries is logged or seen
by a callback, and canaries never enter an evaluation set.

White-box canaries (``--audit_kind gradient``) need nothing of this module: a canary row's model loss is 0 whatever
the objective, and its gradient a random direction (:mod:`hf_dp.audit.canaries`); the rows they ride on are these
token sequences. This module imports nothing of hf_dp outside :mod:`hf_dp.audit.canary_kinds`.
"""

from __future__ import annotations

import numpy as np

from hf_dp.audit.canary_kinds import SequenceCanaries

#: the label id of a token that is not scored (transformers' convention)
IGNORE_INDEX = -100


class TokenCanaries(SequenceCanaries):
    """m black-box canaries for a causal LM: token sequences without labels (see the module docstring).

    ``draw(m, tokenizer=... or vocab_size=..., length=32)``; ``append_to(train_dataset)`` → the training set with the
    included canaries appended (one row, one unit each); ``dataset(score=True)`` → the canaries to score (with ``labels`` =
    their ``input_ids``: every token is scored); ``forget()`` drops the bits."""

    score_name = "minus the mean per-token loss (next-token cross-entropy) of the canary under the trained model"

    @classmethod
    def draw(cls, m: int, num_labels: int = 2, **kw) -> "TokenCanaries":
        """As :meth:`SequenceCanaries.draw`; the labels it draws are not used (a language model's target is the
        sequence itself)."""
        return super().draw(m, max(2, int(num_labels)), **kw)

    def rows(self, columns, which=None, blank=()) -> dict:
        """As :meth:`SequenceCanaries.rows`, but a ``labels`` column holds the canary's own tokens (a causal LM's
        target) instead of a class label."""
        tokens = [c for c in columns if c not in ("labels", "label")]
        out = super().rows(tokens, which, blank)
        idx = range(len(self)) if which is None else [int(i) for i in which]
        for c in columns:
            if c in ("labels", "label"):
                out[c] = [list(self.input_ids[i]) for i in idx]
        return {c: out[c] for c in columns}

    def dataset(self, like=None, which=None, blank=(), labels=True, drop=(), score=False):
        """The canaries ``which`` (default all) with the columns (and features) of ``like`` (default: input_ids,
        attention_mask); ``labels=False`` and ``drop`` leave columns out; ``score=True`` (scoring) adds a ``labels``
        column (the tokens themselves: every token is scored) if there is none."""
        import datasets

        from hf_dp.audit.canary_kinds import _quiet_datasets

        columns = list(getattr(like, "column_names", None) or ["input_ids", "attention_mask"])
        if "input_ids" not in columns:
            raise ValueError("error: canaries need an input_ids column in the training set")
        out = [c for c in columns if c not in drop and (labels or c not in ("labels", "label"))]
        if score and not ({"labels", "label"} & set(out)):
            out.append("labels")
        ds = datasets.Dataset.from_dict(self.rows(out, which, blank))
        features = getattr(like, "features", None)
        if features is None:
            return ds
        features = datasets.Features({c: features[c] if c in features else ds.features[c] for c in out})
        if ds.features == features:
            return ds
        with _quiet_datasets():
            return ds.cast(features)


def per_sequence_loss(logits, labels):
    """``[B]``: each row's mean next-token cross-entropy over its scored tokens (labels ≠ -100 after the shift), from
    the model's logits ``[B, T, V]`` (or a tuple whose first element they are) and the unshifted labels ``[B, T]``."""
    import torch
    import torch.nn.functional as F

    if isinstance(logits, (tuple, list)):
        logits = logits[0]
    if labels is None:
        raise ValueError("internal: the causal-LM canaries were scored without labels")
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:].to(shift_logits.device)
    tokens = F.cross_entropy(shift_logits.transpose(1, 2), shift_labels, ignore_index=IGNORE_INDEX, reduction="none")
    scored = (shift_labels != IGNORE_INDEX).sum(1).clamp_min(1)
    return tokens.sum(1) / scored.to(torch.float32)


def lm_canary_scores(predictions, m: int) -> np.ndarray:
    """Minus the mean per-token loss of each of the ``m`` canaries under the trained model, from ``predictions``: what
    HF's ``evaluation_loop`` gathered of :func:`per_sequence_loss` (its ``preprocess_logits_for_metrics``) over the
    canaries' test loader, run by :func:`hf_dp.audit.canaries.canary_scores` with the trainer's collator, device and
    forward context; no ``compute_metrics``, nothing logged (see the module docstring)."""
    preds = predictions  # a list of per-batch arrays under --eval_do_concat_batches false
    parts = preds if isinstance(preds, (list, tuple)) else [preds]
    losses = np.concatenate([np.asarray(p, dtype=np.float64).reshape(-1) for p in parts])[:m]
    if losses.shape[0] != m or not np.all(np.isfinite(losses)):
        raise ValueError(f"internal: {losses.shape[0]} finite canary losses for {m} canaries")
    return -losses
