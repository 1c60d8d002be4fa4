"""The per-example contract, checked at run time.

The accountant's ε is true only if what the code does matches what it assumes. DPTrainer checks each of these
assumptions where it can, and refuses a violation in one sentence before a step it would falsify:

* **one row = one drawn example** (:func:`check_rows`): every tensor a data collator returns for a micro-batch has
  one row per example the Poisson sampler drew (a collator that emits two augmented views per example, or packs
  two examples into a row, would give one example up to 2·C–3·C of influence).
* **each example's loss depends on that example alone** (:func:`hf_dp.run.independence.probe_independence`): at every ``train()``, on a
  probe micro-batch of training rows, replacing one example and removing one example must leave every other
  example's model output and loss gradient unchanged. Catches a ``compute_loss`` override with a batch-level term
  or a denominator counted over the batch (rows, tokens, ``num_items_in_batch``), a collator that mixes examples,
  and a model whose forward mixes the batch.
* **the mechanism planned at start is the mechanism run** (:func:`mechanism_snapshot`): B, accumulation, world
  size, N, σ or ε, C, δ, accountant, planned steps, clipping engine, update rule, trainable set, and the planned
  :class:`~hf_dp.privacy.mechanism.Mechanism`'s fields — compared at every ``train()`` and every step with what was
  planned at set-up (``trainer.args`` can be changed after the trainer is built).
* **a private run stays private** (:func:`check_private_fixed`): ``--disable_dp`` is fixed when the trainer is built,
  checked at every ``train()`` and every step.
* **every rank holds the same data in the same order, and the same mechanism** (:func:`check_ranks_agree`).
* **labels the loss can use** (:func:`check_labels`): no NaN/inf labels, class labels inside ``[0, num_labels)``
  (or the ignore index -100), checked on the label column before training.
* **a loss DPTrainer computes as the model would** (:func:`check_head`, :func:`check_logits`): DPTrainer computes the
  per-example loss of the heads registered in :mod:`hf_dp.models.loss` (sequence classification; causal language
  modelling, per sequence); a masked LM, token-classification, QA or seq2seq head is refused (it would train on the
  wrong objective).

At every ``train()``, before any step, :func:`check_at_train` runs the checks of the whole run (``DPTrainer._check_contract``);
every micro-batch, :func:`check_rows` (in the loader's collator), :func:`check_mechanism` and :func:`check_optimizer`.
The checks take the pieces they read (the arguments, the model, the run's privacy state ``trainer.dp``, the trainer's
loader and loss as callables), never the trainer.

What stays the user's responsibility: docs/guarantee.md, "The per-example contract: what hf_dp enforces, and what stays yours".
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math

import torch

from hf_dp.models.loss import IGNORE_INDEX, OBJECTIVES, base_model, objective_for
from hf_dp.models.precision import check_full_precision, check_no_mixed_precision
from hf_dp.run import independence

logger = logging.getLogger("hf_dp.trainer")  # what DPTrainer's checks say keeps the trainer's logger name

#: class-name endings of heads whose loss is not a sequence classifier's
_OTHER_HEAD_SUFFIXES = (
    "ForCausalLM", "LMHeadModel", "ForMaskedLM", "ForTokenClassification", "ForQuestionAnswering",
    "ForConditionalGeneration", "ForSeq2SeqLM", "ForMultipleChoice", "ForPreTraining", "ForNextSentencePrediction",
    "ForSpeechSeq2Seq", "ForCTC", "ForMaskedImageModeling", "ForSemanticSegmentation", "ForObjectDetection",
)


# ---------------------------------------------------------------------------------------------------
# one row = one drawn example
# ---------------------------------------------------------------------------------------------------
def check_rows(batch, drawn: int, skip=()) -> None:
    """Every tensor (or array) of the collated ``batch`` with a batch dimension has ``drawn`` rows."""
    if not hasattr(batch, "items"):
        return
    for key, value in batch.items():
        if key in skip:
            continue
        shape = getattr(value, "shape", None)
        if shape is None or len(shape) == 0:
            continue
        if int(shape[0]) != drawn:
            raise ValueError(
                f"the data collator returned '{key}' with {int(shape[0])} rows for {drawn} drawn example(s): DP "
                "training needs exactly one row per example (a collator that adds augmented views or packs several "
                "examples into a row multiplies one example's influence beyond the clip norm C, and the reported "
                "epsilon would be false); give each example one row"
            )


# ---------------------------------------------------------------------------------------------------
# the head: a loss DPTrainer computes as the model would
# ---------------------------------------------------------------------------------------------------
_base_model = base_model  # a PEFT wrapper's base model


def _mapping_names() -> tuple[set, dict]:
    """(sequence-classification class names, {class name: head kind}) from transformers' auto mappings."""
    from transformers.models.auto import modeling_auto as auto

    def names(mapping_name):
        mapping = getattr(auto, mapping_name, {})
        out = set()
        for v in mapping.values():
            out.update(v if isinstance(v, (list, tuple)) else [v])
        return out

    seq = names("MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING_NAMES")
    other = {}
    for mapping_name, kind in (
        ("MODEL_FOR_CAUSAL_LM_MAPPING_NAMES", "causal language"),
        ("MODEL_FOR_MASKED_LM_MAPPING_NAMES", "masked language"),
        ("MODEL_FOR_TOKEN_CLASSIFICATION_MAPPING_NAMES", "token-classification"),
        ("MODEL_FOR_QUESTION_ANSWERING_MAPPING_NAMES", "question-answering"),
        ("MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES", "sequence-to-sequence"),
        ("MODEL_FOR_MULTIPLE_CHOICE_MAPPING_NAMES", "multiple-choice"),
        ("MODEL_FOR_PRETRAINING_MAPPING_NAMES", "pre-training"),
    ):
        for name in names(mapping_name):
            other.setdefault(name, kind)
    return seq, other


def check_head(model) -> None:
    """Refuse a model whose head's loss DPTrainer does not compute as the model would (it would train it on the wrong
    objective, silently: e.g. a masked LM scored as a sequence classifier). Supported heads: the registry of
    :mod:`hf_dp.models.loss` (sequence classification, causal language modelling)."""
    base = _base_model(model)
    name = type(base).__name__
    if objective_for(model) is not None:
        return
    seq, other = _mapping_names()
    kind = other.get(name)
    if kind is None and name.endswith(_OTHER_HEAD_SUFFIXES):
        kind = "non-sequence-classification"
    if kind is not None:
        raise ValueError(
            f"{name} is a {kind} model, but DPTrainer computes each example's loss only for the heads it supports "
            f"({', '.join(OBJECTIVES)}: *ForSequenceClassification, *ForCausalLM), so it would train this model on the "
            "wrong objective; use a supported head (other heads are not supported yet)"
        )


def check_logits(logits: torch.Tensor, labels: torch.Tensor, objective=None) -> None:
    """The shapes the objective's per-example loss needs (default: a sequence classifier's ``[batch, num_labels]``)."""
    (objective or OBJECTIVES["sequence_classification"]).check_logits(logits, labels)


# ---------------------------------------------------------------------------------------------------
# labels
# ---------------------------------------------------------------------------------------------------
LABEL_COLUMNS = ("labels", "label", "label_ids")


def _label_values(dataset):
    """(column, list of label values) of a training set; (None, None) when its columns cannot be read. A training set
    whose columns are known but hold no label column is refused: DP training computes each example's loss from it."""
    columns = getattr(dataset, "column_names", None)
    first = None
    if columns is None:
        try:
            first = dataset[0]
        except Exception:  # noqa: BLE001 - a dataset we cannot index: nothing to check
            return None, None
        if not hasattr(first, "keys"):
            return None, None
        columns = list(first.keys())
    col = next((c for c in LABEL_COLUMNS if c in columns), None)
    if col is None:
        raise ValueError(
            f"the train dataset has no label column ('labels' or 'label'; it has {sorted(columns)}): "
            "DP training computes each example's loss from its label"
        )
    if first is None:
        values = dataset[col]
        return col, list(values) if not torch.is_tensor(values) else values
    return col, [dataset[i][col] for i in range(len(dataset))]


def _problem_type(config, integer_labels: bool) -> str:
    num_labels = getattr(config, "num_labels", None)
    problem = getattr(config, "problem_type", None)
    if problem is not None:
        return problem
    if num_labels == 1:
        return "regression"
    return "single_label_classification" if integer_labels else "multi_label_classification"


def check_labels(dataset, config, objective=None) -> None:
    """Refuse a training set without a label column, non-finite labels and class labels outside ``[0, num_labels)`` (``-100`` is the ignore index) before
    training: one such row would otherwise fail, or poison the model, exactly at the step that draws it. A causal LM's
    training set needs no label column (its collator makes the labels from the tokens; their range is checked at
    every step against the vocabulary)."""
    if objective is not None and not objective.label_column:
        return
    col, values = _label_values(dataset)
    if col is None or values is None or len(values) == 0:
        return
    try:
        t = torch.as_tensor(values)
    except (TypeError, ValueError, RuntimeError):
        try:
            t = torch.as_tensor([torch.as_tensor(v, dtype=torch.float64).reshape(-1) for v in values])
        except (TypeError, ValueError, RuntimeError):
            return  # ragged or non-numeric labels: the loss decides
    if t.dtype == torch.bool:
        t = t.long()
    if not (t.is_floating_point() or t.dtype in (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)):
        return
    if t.is_floating_point():
        bad = ~torch.isfinite(t.double())
        if bad.any():
            row = int(bad.reshape(t.shape[0], -1).any(-1).nonzero()[0, 0]) if t.dim() else 0
            raise ValueError(
                f"the training labels (column '{col}') contain NaN or infinite values (first at row {row}, counting from 0): such an "
                "example's loss and gradient are not finite; remove or fix those rows before DP training"
            )
    integer = not t.is_floating_point()
    problem = _problem_type(config, integer)
    num_labels = getattr(config, "num_labels", None)
    if problem == "single_label_classification" and num_labels:
        if t.is_floating_point():
            if not torch.equal(t, t.round()):
                return  # float labels for a classifier: the loss treats them as multi-label
        flat = t.reshape(-1).long()
        bad = ((flat < 0) | (flat >= num_labels)) & (flat != IGNORE_INDEX)
        if bad.any():
            row = int(bad.nonzero()[0, 0])
            raise ValueError(
                f"the training labels (column '{col}') contain {int(flat[row])} (first at row {row}, counting from 0), outside the "
                f"model's classes 0..{num_labels - 1}: the step that draws that example would fail; fix the labels or "
                "the model's num_labels before DP training"
            )


def check_token_ids(dataset, config) -> None:
    """Refuse token ids outside the model's vocabulary (``config.vocab_size``) before training: the step that draws
    such a row would fail in the embedding (or, for a causal LM, in its labels), revealing that row's presence."""
    vocab = getattr(config, "vocab_size", None)
    columns = getattr(dataset, "column_names", None)
    if not vocab or columns is None or "input_ids" not in columns:
        return
    for row, ids in enumerate(dataset["input_ids"]):
        t = torch.as_tensor(ids) if not torch.is_tensor(ids) else ids
        if t.numel() and (int(t.min()) < 0 or int(t.max()) >= vocab):
            bad = int(t.max()) if int(t.max()) >= vocab else int(t.min())
            raise ValueError(
                f"training row {row} (counting from 0) has token id {bad}, outside the model's vocabulary 0..{vocab - 1}: the tokenizer "
                "and the model do not match (set the model's vocab_size to the tokenizer's length)"
            )


def _standard_collator(collate) -> bool:
    """HF's per-row collators (and hf_dp's cache collator): one row per example, labels from the label column."""
    from transformers import DataCollatorForLanguageModeling, DataCollatorWithPadding, DefaultDataCollator, default_data_collator

    from hf_dp.models.prefix_cache import CachedFeaturesCollator

    inner = getattr(collate, "collate_fn", collate)  # hf_dp's empty-batch wrapper
    inner = getattr(inner, "data_collator", inner)  # HF's RemoveColumnsCollator
    # the classes themselves, not subclasses: a subclass may override __call__ (augmented views, a long row split)
    if type(inner) is DataCollatorForLanguageModeling:  # its labels are the row's own tokens (mlm=False only)
        return not inner.mlm
    return inner is default_data_collator or type(inner) in (DataCollatorWithPadding, DefaultDataCollator, CachedFeaturesCollator)


def _first_dim(batch) -> int | None:
    for v in (batch.values() if hasattr(batch, "values") else []):
        if torch.is_tensor(v) and v.dim() >= 1:
            return int(v.shape[0])
    return None


def check_every_row(dataset, collate, config, objective=None, max_length: int | None = None) -> str:
    """Before any step, each training row through the collator alone: one row out (or several consecutive rows that
    are that row's own, also beside another row: see :class:`hf_dp.run.data.EmptySafeCollator`), labels finite
    and inside the model's classes (a causal LM's: inside its vocabulary). Otherwise a row that breaks the contract would stop training
    exactly at the step that draws it, and whether a model is released would reveal that row's presence. Skipped
    (returns why) for HF's per-row collators, whose rows are the dataset's and whose labels :func:`check_labels` has
    read (a language-modelling collator's labels are the row's own token ids). ``max_length``: the run's public token
    bound of one row (``--dp_max_length``): a row the collator makes longer (a collator that tokenizes raw text) is
    refused here, not at the step that draws it."""
    if _standard_collator(collate):
        return "skipped: a per-row collator"
    token_labels = bool(getattr(objective, "token_labels", False))
    num_labels = getattr(config, "vocab_size" if token_labels else "num_labels", None)
    classes = "vocabulary" if token_labels else "classes"
    several = False
    for i in range(len(dataset)):
        batch = collate([dataset[i]])  # hf_dp's wrapper checks one row per example (check_rows)
        several = several or _first_dim(batch) not in (None, 1)
        if _first_dim(batch) not in (None, 1) and len(dataset) > 1:
            # several rows for this example: they must be consecutive and its own also beside another example
            # (hf_dp.run.data.EmptySafeCollator attributes them or refuses), here rather than at a step
            partner = dataset[1 if i == 0 else 0]
            collate([dataset[i], partner])
            collate([partner, dataset[i]])
        _check_length(batch, max_length, i)
        labels = batch.get("labels") if hasattr(batch, "get") else None
        if not torch.is_tensor(labels):
            continue
        if labels.is_floating_point() and not bool(torch.isfinite(labels).all()):
            raise ValueError(
                f"the data collator makes a NaN or infinite label for training row {i} (counting from 0): such an example's loss and "
                "gradient are not finite; fix the collator or the data before DP training"
            )
        ids = batch.get("input_ids")
        if token_labels and torch.is_tensor(ids) and labels.shape != ids.shape:  # else a shape error at its step
            raise ValueError(f"the data collator makes labels of shape {tuple(labels.shape)} for training row {i} (counting "
                             f"from 0), whose input_ids have shape {tuple(ids.shape)}: each token's label must align with "
                             "it; fix the collator or the data's 'labels' column before DP training")
        if not labels.is_floating_point() and num_labels and (token_labels or _problem_type(config, True) == "single_label_classification"):
            flat = labels.reshape(-1)
            bad = ((flat < 0) | (flat >= num_labels)) & (flat != IGNORE_INDEX)
            if bool(bad.any()):
                raise ValueError(
                    f"the data collator makes label {int(flat[bad][0])} for training row {i} (counting from 0), outside the model's "
                    f"{classes} 0..{num_labels - 1}; fix the collator or the model's config before DP training"
                )
        _check_ids(batch, config, i)
    return "checked: several rows per example" if several else "checked"


def _check_length(batch, max_length: int | None, i: int) -> None:
    """A collated training row (or each of its rows) within the run's public token bound: its own tokens (the attention
    mask's count, else the padded width) — padding adds exact zeros (:func:`hf_dp.run.data.split_to_bounds`)."""
    if not max_length or not hasattr(batch, "get"):
        return
    mask, ids = batch.get("attention_mask"), batch.get("input_ids")
    masked = torch.is_tensor(mask) and mask.dim() == 2 and mask.numel() > 0
    if masked:
        longest = int((mask != 0).sum(-1).max())  # any non-zero mask value is a real token to the model and the loss
    elif torch.is_tensor(ids) and ids.dim() == 2:
        longest = int(ids.shape[1])  # without a mask the model attends to every position, padding included
    else:
        return
    if longest > max_length and not masked:
        raise ValueError(f"the data collator makes training row {i} (counting from 0) {longest} positions wide with no "
                         f"attention_mask, more than the run's public --dp_max_length {max_length}: without a mask "
                         "every position is the row's own; return an attention_mask, pad to the batch's longest row, "
                         "or raise --dp_max_length")
    if longest > max_length:
        raise ValueError(f"the data collator makes training row {i} (counting from 0) {longest} tokens long, more than "
                         f"the run's public --dp_max_length {max_length} (the bound of ghost clipping's rounding "
                         "allowance): truncate in the collator (its max_length), or raise --dp_max_length")


def _check_ids(batch, config, i: int) -> None:
    """The collator's ``input_ids`` inside the model's vocabulary (a tokenizing collator's are never in the dataset)."""
    vocab = getattr(config, "vocab_size", None)
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    if not vocab or not torch.is_tensor(ids) or ids.is_floating_point() or ids.numel() == 0:
        return
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
        raise ValueError(
            f"the data collator makes token id {bad} for training row {i} (counting from 0), outside the model's vocabulary "
            f"0..{vocab - 1}: the tokenizer and the model do not match"
        )


# ---------------------------------------------------------------------------------------------------
# the mechanism planned at start
# ---------------------------------------------------------------------------------------------------
#: arguments that define the mechanism (or what the accountant is told about it)
MECHANISM_ARGS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "epsilon", "noise_multiplier", "delta",
    "per_sample_max_grad_norm", "accountant", "max_steps", "num_train_epochs", "clipping", "trainable", "optim",
    "secure_rng", "dp_seed", "cache_frozen_features", "disable_dp", "privacy_unit_column", "max_rows_per_unit",
    "public_dataset_size", "noise_mechanism", "noise_bands", "lm_loss_weighting",
)


def _value(v):
    v = getattr(v, "value", v)  # enums
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


def mechanism_snapshot(args, mechanism=None, model=None) -> dict:
    """What the accountant's ε rests on, as a run would run it now: its arguments ``args`` and world size, the planned
    ``mechanism``'s public fields (:class:`hf_dp.privacy.mechanism.Mechanism`: σ, C, q, B, N and its source, δ, the
    accountant, the steps, the unit; as ``mechanism.<field>``) and, given the ``model``, its trainable parameter set."""
    snap = {k: _value(getattr(args, k, None)) for k in MECHANISM_ARGS}
    snap["world_size"] = max(1, int(args.world_size))
    if mechanism is not None:
        fields = dict(mechanism.describe())
        fields.update((f.name, getattr(mechanism, f.name)) for f in dataclasses.fields(mechanism) if f.name != "spec")
        snap.update((f"mechanism.{k}", _value(v)) for k, v in fields.items())
    if model is not None:
        snap["trainable_parameters"] = sorted(n for n, p in model.named_parameters() if p.requires_grad)
    return snap


def check_private_fixed(dp, args) -> None:
    """Whether the run is private is fixed when the trainer is built (``dp.enabled``: the run's
    :class:`hf_dp.run.state.PrivacyState`): refuse a ``train()`` or a step whose ``args.disable_dp`` says otherwise (a
    DP trainer trained without noise would report the ledger of its DP set-up for weights it did not account)."""
    if bool(args.dp_enabled) != bool(dp.enabled):
        built, now = ("with DP", "without DP") if dp.enabled else ("without DP (--disable_dp)", "with DP")
        raise ValueError(
            f"this DPTrainer was built {built} and trainer.args now asks to train {now}: whether a run is private is "
            "fixed when the trainer is built (its mechanism, ledger and report are planned then); set disable_dp "
            "before making the DPTrainer (make a new one for the other kind of run)"
        )


def check_mechanism(planned: dict, now: dict) -> None:
    """Refuse a run whose mechanism differs from the one planned when the trainer was built."""
    changed = [k for k in planned if k in now and planned[k] != now[k]]
    if not changed:
        return
    detail = ", ".join(
        f"{k}: planned {_short(planned[k])}, now {_short(now[k])}" for k in changed
    )
    raise ValueError(
        f"the privacy mechanism changed after the DPTrainer was built ({detail}): sigma, q and the steps were "
        "planned and accounted for the settings at construction, so the reported epsilon would be false; set the "
        "arguments before making the DPTrainer (make a new one for other settings)"
    )


def _short(v):
    if isinstance(v, list):
        return f"{len(v)} trainable tensors"
    return repr(v)


def check_optimizer(optimizer, privatizer, mechanism) -> None:
    """The ``optimizer`` HF steps is the run's ``privatizer`` (``dp.optimizer``), with the σ, C and B of the planned
    ``mechanism`` (an optimizer assigned to ``trainer.optimizer``, or a privatizer attribute changed, after
    ``create_optimizer`` would train without the planned noise while the report claims it)."""
    if optimizer is None or privatizer is None:
        return
    inner = optimizer
    while inner is not privatizer and hasattr(inner, "optimizer") and inner.optimizer is not inner:
        inner = inner.optimizer  # Accelerate's AcceleratedOptimizer wraps ours
    if inner is not privatizer:
        raise ValueError(
            f"the optimizer is not DPTrainer's privatizer (trainer.optimizer was replaced by {type(inner).__name__} after "
            "create_optimizer): its steps would use unclipped, un-noised gradients while the report claims DP; let "
            "DPTrainer build the optimizer from --optim"
        )
    m, p = mechanism, privatizer
    planned = {"noise_multiplier": m.noise_multiplier, "C": m.max_grad_norm, "B": m.expected_batch_size,
               "clip norm": p.rule.clip_norm(m.max_grad_norm), "noise bands": m.bands}
    now = {"noise_multiplier": p.noise_multiplier, "C": p.user_max_grad_norm, "B": p.expected_batch_size,
           "clip norm": p.max_grad_norm, "noise bands": 1 if p.correlation is None else p.correlation.bands}
    changed = [k for k in planned if not math.isclose(float(planned[k]), float(now[k]), rel_tol=1e-12, abs_tol=0.0)]
    if changed:
        detail = ", ".join(f"{k}: planned {planned[k]!r}, now {now[k]!r}" for k in changed)
        raise ValueError(
            f"the privatizer's settings were changed after it was built ({detail}): the noise added would no longer be "
            "the noise the accountant counts; do not modify the DP optimizer"
        )


def check_flags(args) -> None:
    """The HF flags refused under DP (``hf_dp.flags``) are refused also when set on ``trainer.args`` after
    construction (the adjustments are re-applied)."""
    from hf_dp import flags

    flags.enforce(args)
    check_no_mixed_precision(args)


def check_ranks_agree(fingerprint: str, mechanism: dict) -> None:
    """Under several processes: every rank holds the same training data in the same order (an order-sensitive
    fingerprint) and plans the same mechanism; otherwise one example could be drawn by two ranks in one step."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    mine = (fingerprint, json.dumps(mechanism, sort_keys=True, default=str))
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if any(g[0] != gathered[0][0] for g in gathered):
        raise ValueError(
            "the processes hold different training data or the same data in different orders (their fingerprints "
            "differ): each rank would draw its Poisson batches from other rows, so one example could enter a step "
            "twice; give every rank the same dataset in the same order (seed any shuffle identically)"
        )
    if any(g[1] != gathered[0][1] for g in gathered):
        raise ValueError(
            "the processes plan different privacy mechanisms (batch size, sigma, C, steps or trainable set differ "
            "between ranks); launch every rank with the same arguments and model"
        )


def check_ranks_share_draw(sampler, ledger, key) -> None:
    """Under several processes, at every ``train()`` once the sampler's key is shared: every rank's Poisson
    ``sampler`` would draw the same sample (the same N, rows, units, q, steps, position: the ``ledger``'s step, its
    stream tag and a SHA-256 of the ``key``, ``dp.sampling_key``) —
    each rank deals itself a share of that one draw (:mod:`hf_dp.privacy.sampler`), so ranks that drew differently
    could put one example into a step on two of them."""
    import hashlib

    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() <= 1:
        return
    mine = sampler.draw_digest(int(ledger.steps), int(ledger.own_steps), ledger.meta.get("stream_tag"),
                               None if key is None else hashlib.sha256(str(key).encode()).hexdigest())
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if any(g != gathered[0] for g in gathered):
        raise ValueError(
            "the processes would draw different Poisson samples (their N, privacy units, q, steps, ledger step or "
            "random key differ): each rank takes its share of one draw, so one example could enter a step on two "
            "ranks; launch every rank with the same data, arguments and model ledger (--prior_privacy)"
        )


def check_at_train(dp, args, model, train_dataset, collator, objective, *, loader, data_info, compute_loss,
                   prepare_inputs) -> None:
    """``DPTrainer._check_contract``, at every ``train()`` before any step: the ``train_dataset`` is the one planned,
    the flags refused under DP are not set in ``args``, the mechanism is still the one planned (``dp``: the run's
    :class:`~hf_dp.run.state.PrivacyState`), every rank holds the same data in the same order (``data_info()``: its
    SHA-256, read only under several ranks), a non-HF ``collator`` gives one usable row per example for every training
    row, and each example's loss depends on that example alone (:func:`hf_dp.run.independence.probe_independence`,
    on the ``model`` through ``prepare_inputs`` and ``compute_loss``). ``loader()``: the training loader (its dataset
    and collate function); ``objective``: the head's loss (:mod:`hf_dp.models.loss`)."""
    if train_dataset is not dp.contract.planned_dataset:
        raise ValueError(
            "train_dataset was replaced after the DPTrainer was built: N, the fingerprint that resumes, ranks and "
            "the model's ledger compare, and the label checks describe the dataset given at construction; make a "
            "new DPTrainer for other data"
        )
    if dp.contract.partitions is not None and dp.contract.partitions() != dp.sampler.partitions_digest():
        raise ValueError(
            "the training set's rows changed since the DPTrainer was built (their content or order, read again for "
            "the cyclic Poisson partitions of --noise_bands): a unit could now sit in another partition and enter two "
            "steps less than b apart; make a new DPTrainer for other data"
        )
    check_flags(args)  # HF flags refused under DP, also when set on trainer.args after construction
    check_full_precision(model, "the model")  # also after a .half() / .to(torch.bfloat16) since construction
    check_mechanism(dp.contract.planned, mechanism_snapshot(args, dp.mechanism, model))
    if args.world_size > 1:
        check_ranks_agree(data_info()["sha256"], dp.contract.planned)
    if dp.contract.rows_checked is not collator:  # the dataset is fixed (above); again if the collator changed
        train_loader = loader()
        outcome = check_every_row(train_loader.dataset, train_loader.collate_fn, getattr(model, "config", None),
                                  objective, max_length=getattr(dp.bounds, "max_length", None))
        # a collator seen to emit several rows (or none) for one example: every micro-batch's rows are attributed
        # to their examples, also when the row count happens to equal the number of examples drawn
        dp.contract.several_rows = outcome.endswith("several rows per example")
        dp.contract.rows_checked = collator
    train_loader = loader()
    outcome = independence.probe_independence(train_loader.dataset, train_loader.collate_fn, model, dp,
                                              compute_loss=compute_loss, prepare_inputs=prepare_inputs)
    if outcome != "passed":
        logger.warning("hf_dp: the per-example contract could not be verified on a probe micro-batch (%s)", outcome)
