"""The per-example contract, checked at run time.

The accountant's ε is true only if what the code does matches what it assumes. DPTrainer checks each of these
assumptions where it can, and refuses a violation in one sentence before a step it would falsify:

* **one row = one drawn example** (:func:`check_rows`): every tensor a data collator returns for a micro-batch has
  one row per example the Poisson sampler drew (a collator that emits two augmented views per example, or packs
  two examples into a row, would give one example up to 2·C–3·C of influence).
* **each example's loss depends on that example alone** (:func:`probe_independence`): at every ``train()``, on a
  probe micro-batch of training rows, replacing one example and removing one example must leave every other
  example's model output and loss gradient unchanged. Catches a ``compute_loss`` override with a batch-level term
  or a denominator counted over the batch (rows, tokens, ``num_items_in_batch``), a collator that mixes examples,
  and a model whose forward mixes the batch.
* **the mechanism planned at start is the mechanism run** (:func:`mechanism_snapshot`): B, accumulation, world
  size, N, σ or ε, C, δ, accountant, planned steps, clipping engine, update rule, trainable set — compared at every
  ``train()`` and every step with what the trainer planned (``trainer.args`` can be changed after it is built).
* **every rank holds the same data in the same order, and the same mechanism** (:func:`check_ranks_agree`).
* **labels the loss can use** (:func:`check_labels`): no NaN/inf labels, class labels inside ``[0, num_labels)``
  (or the ignore index -100), checked on the label column before training.
* **a loss DPTrainer computes as the model would** (:func:`check_head`, :func:`check_logits`): DPTrainer computes the
  per-example loss of the heads registered in :mod:`hf_dp.models.loss` (sequence classification; causal language
  modelling, per sequence); a masked LM, token-classification, QA or seq2seq head is refused (it would train on the
  wrong objective).

What stays the user's responsibility: README, "The per-example contract".
"""

from __future__ import annotations

import contextlib
import json
import math

import torch
from torch import nn

from hf_dp.models.loss import IGNORE_INDEX, OBJECTIVES, base_model, objective_for

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
                f"the training labels (column '{col}') contain NaN or infinite values (first at row {row}): such an "
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
                f"the training labels (column '{col}') contain {int(flat[row])} (first at row {row}), outside the "
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
                f"training row {row} has token id {bad}, outside the model's vocabulary 0..{vocab - 1}: the tokenizer "
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


def check_every_row(dataset, collate, config, objective=None) -> str:
    """Before any step, each training row through the collator alone: one row out (or several consecutive rows that
    are that row's own, also beside another row: see :class:`hf_dp.run.data.EmptySafeCollator`), labels finite
    and inside the model's classes (a causal LM's: inside its vocabulary). Otherwise a row that breaks the contract would stop training
    exactly at the step that draws it, and whether a model is released would reveal that row's presence. Skipped
    (returns why) for HF's per-row collators, whose rows are the dataset's and whose labels :func:`check_labels` has
    read (a language-modelling collator's labels are the row's own token ids)."""
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
        labels = batch.get("labels") if hasattr(batch, "get") else None
        if not torch.is_tensor(labels):
            continue
        if labels.is_floating_point() and not bool(torch.isfinite(labels).all()):
            raise ValueError(
                f"the data collator makes a NaN or infinite label for training row {i}: such an example's loss and "
                "gradient are not finite; fix the collator or the data before DP training"
            )
        if not labels.is_floating_point() and num_labels and (token_labels or _problem_type(config, True) == "single_label_classification"):
            flat = labels.reshape(-1)
            bad = ((flat < 0) | (flat >= num_labels)) & (flat != IGNORE_INDEX)
            if bool(bad.any()):
                raise ValueError(
                    f"the data collator makes label {int(flat[bad][0])} for training row {i}, outside the model's "
                    f"{classes} 0..{num_labels - 1}; fix the collator or the model's config before DP training"
                )
        _check_ids(batch, config, i)
    return "checked: several rows per example" if several else "checked"


def _check_ids(batch, config, i: int) -> None:
    """The collator's ``input_ids`` inside the model's vocabulary (a tokenizing collator's are never in the dataset)."""
    vocab = getattr(config, "vocab_size", None)
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    if not vocab or not torch.is_tensor(ids) or ids.is_floating_point() or ids.numel() == 0:
        return
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        bad = int(ids.max()) if int(ids.max()) >= vocab else int(ids.min())
        raise ValueError(
            f"the data collator makes token id {bad} for training row {i}, outside the model's vocabulary "
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
)


def _value(v):
    v = getattr(v, "value", v)  # enums
    if isinstance(v, float) and math.isnan(v):
        return "nan"
    return v if isinstance(v, (int, float, str, bool, type(None))) else str(v)


def mechanism_snapshot(trainer, with_parameters: bool = True) -> dict:
    """What the accountant's ε rests on, as ``trainer`` would run it now (arguments, world size, N, the trainable
    parameter set)."""
    args = trainer.args
    snap = {k: _value(getattr(args, k, None)) for k in MECHANISM_ARGS}
    snap["world_size"] = max(1, int(args.world_size))
    if with_parameters:
        snap["trainable_parameters"] = sorted(n for n, p in trainer.model.named_parameters() if p.requires_grad)
    return snap


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


def check_optimizer(trainer) -> None:
    """The optimizer HF steps is the trainer's privatizer, with the σ, C and B it was built with (an optimizer assigned
    to ``trainer.optimizer``, or a privatizer attribute changed, after ``create_optimizer`` would train without the
    planned noise while the report claims it)."""
    opt, dp = trainer.optimizer, getattr(trainer, "_dp_optimizer", None)
    if opt is None or dp is None:
        return
    inner = opt
    while inner is not dp and hasattr(inner, "optimizer") and inner.optimizer is not inner:
        inner = inner.optimizer  # Accelerate's AcceleratedOptimizer wraps ours
    if inner is not dp:
        raise ValueError(
            f"the optimizer is not DPTrainer's privatizer (trainer.optimizer was replaced by {type(inner).__name__} after "
            "create_optimizer): its steps would use unclipped, un-noised gradients while the report claims DP; let "
            "DPTrainer build the optimizer from --optim"
        )
    spec = trainer.privacy_spec
    planned = {"noise_multiplier": spec.noise_multiplier, "C": spec.max_grad_norm, "B": spec.expected_batch_size,
               "clip norm": dp.rule.clip_norm(spec.max_grad_norm)}
    now = {"noise_multiplier": dp.noise_multiplier, "C": dp.user_max_grad_norm, "B": dp.expected_batch_size,
           "clip norm": dp.max_grad_norm}
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


# ---------------------------------------------------------------------------------------------------
# each example's loss depends on that example alone
# ---------------------------------------------------------------------------------------------------
class _OutputTap:
    """Runs the model's forward without autograd and hands its logits to the loss as fresh leaves, so the probe
    differentiates the loss (and only the loss) with respect to each row's logits — no engine hook fires."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.leaves: list[torch.Tensor] = []
        self._grad_modes: list[bool] = []
        self._handles = []

    def __enter__(self):
        self._handles = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, with_kwargs=True),
        ]
        self._outer = torch.is_grad_enabled()
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        torch.set_grad_enabled(self._outer)
        return False

    def _pre(self, module, args, kwargs):
        self._grad_modes.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    def _post(self, module, args, kwargs, out):
        torch.set_grad_enabled(self._grad_modes.pop() if self._grad_modes else self._outer)
        logits = out.get("logits") if hasattr(out, "get") else None
        if torch.is_tensor(logits) and logits.is_floating_point():
            leaf = logits.detach().requires_grad_(True)
            out["logits"] = leaf
            self.leaves.append(leaf)
        return out


@contextlib.contextmanager
def _no_dropout(model: nn.Module):
    """Dropout off (p = 0 on dropout modules and on float ``attention_dropout`` attributes) while the model stays in
    training mode, so that two probe forwards compute the same function of each row."""
    saved = []
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            saved.append((m, "p", m.p))
            m.p = 0.0
        v = m.__dict__.get("attention_dropout")
        if isinstance(v, float):
            saved.append((m, "attention_dropout", v))
            m.attention_dropout = 0.0
    try:
        yield
    finally:
        for m, name, v in saved:
            setattr(m, name, v)


def _row_length(batch, i: int) -> int:
    for key in ("attention_mask", "labels"):
        v = batch.get(key) if hasattr(batch, "get") else None
        if torch.is_tensor(v) and v.dim() >= 2:
            if v.shape[0] <= i:  # a collator that makes no row for this example
                return 0
            return int((v[i] != (IGNORE_INDEX if key == "labels" else 0)).sum())
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    return int(ids.shape[1]) if torch.is_tensor(ids) and ids.dim() >= 2 else 0


def _lengthened(collate, base_rows: list, longest: int):
    """The probe batch with its last row replaced by its first row with every per-token field repeated twice (longer
    than every probe row), or ``None`` if the collator cannot take such a row."""
    first = base_rows[0]
    ids = first.get("input_ids") if hasattr(first, "get") else None
    if not isinstance(ids, (list, tuple)) or not ids:
        return None
    n = len(ids)
    row = {key: (list(v) + list(v) if isinstance(v, (list, tuple)) and len(v) == n else v) for key, v in first.items()}
    try:
        if _row_length(collate([row]), 0) <= longest:
            return None
        return collate(base_rows[:-1] + [row])
    except Exception:  # noqa: BLE001 - a collator that cannot take it (fixed-length fields): no lengthened variant
        return None


def _shapes(batch) -> dict:
    return {k: tuple(v.shape) for k, v in batch.items() if torch.is_tensor(v)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding; non-finite entries must be the same non-finite value in both (a NaN label made by
    a collator gives the same NaN gradient in every variant, which is not a coupling)."""
    a, b = a.double(), b.double()
    finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(finite_a, finite_b):
        return False
    same_special = torch.where(finite_a, True, (a == b) | (a.isnan() & b.isnan()))
    if not bool(same_special.all()):
        return False
    if not bool(finite_a.any()):
        return True
    a, b = a[finite_a], b[finite_a]
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    return bool(((a - b).abs() <= 1e-5 * scale).all())


def probe_independence(trainer, probe_rows: int = 4, candidates: int = 12) -> str:
    """Check on training rows that each example's output and loss gradient depend on that example alone.

    Builds a probe micro-batch of ``probe_rows`` rows through the training loader's dataset and collator, then the
    same batch with its last row replaced by another row (of another length where one exists) and with its last row
    removed; runs ``trainer.compute_loss`` on each (model in training mode, dropout off, the forward without
    autograd) and compares, for every other row, the model's logits and the gradient of the returned loss with
    respect to them. Raises ``ValueError`` when they differ; returns ``"passed"`` or why it could not run
    (``"skipped: ..."``)."""
    loader = trainer.get_train_dataloader()
    dataset, collate = loader.dataset, loader.collate_fn
    n = len(dataset)
    if n < 3:
        return "skipped: fewer than 3 training rows"
    take = min(n, probe_rows + candidates)
    rows = [dataset[i] for i in range(take)]
    k = min(probe_rows, take - 1)
    # the probe batch, longest rows first, so that the row replaced / removed (the last) never sets the padding
    lengths = [_row_length(collate([r]), 0) for r in rows]
    order = sorted(range(k), key=lambda i: -lengths[i])
    base_rows = [rows[i] for i in order]
    base = collate(base_rows)
    shapes = _shapes(base)
    j_len = lengths[order[-1]]
    replacement = None
    for c in sorted(range(k, take), key=lambda c: lengths[c] == j_len):  # another length first
        b = collate(base_rows[:-1] + [rows[c]])
        if _shapes(b) == shapes and lengths[c] <= lengths[order[0]]:
            replacement = b
            break
    removed = collate(base_rows[:-1])
    # a replacement longer than every probe row changes the padded length: a model whose rows see the padding (no
    # attention mask, left padding with absolute positions) then changes the other rows' outputs
    longer = [c for c in range(k, take) if lengths[c] > lengths[order[0]]]
    padded = collate(base_rows[:-1] + [rows[max(longer, key=lambda c: lengths[c])]]) if longer else None
    made = padded is None
    if made:  # no longer row among the candidates: make one (a probe row's tokens twice)
        padded = _lengthened(collate, base_rows, lengths[order[0]])
    model = trainer.model
    was_training = model.training
    model.train()
    trainer._contract_probe = True
    results = []
    try:
        with _no_dropout(model):
            for batch in [base, replacement, removed, padded]:
                if batch is None:
                    results.append(None)
                    continue
                inputs = trainer._prepare_inputs(dict(batch))
                labels = inputs.get("labels")
                items = None
                if torch.is_tensor(labels):
                    items = (labels != IGNORE_INDEX).sum() if labels.dim() > 1 else torch.tensor(labels.shape[0])
                with _OutputTap(model) as tap, torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    if made and batch is padded:
                        try:  # the made row may be longer than the model takes (its position table)
                            loss = trainer.compute_loss(model, inputs, num_items_in_batch=items)
                        except (IndexError, RuntimeError, ValueError):
                            results.append(None)
                            continue
                    else:
                        loss = trainer.compute_loss(model, inputs, num_items_in_batch=items)
                    if isinstance(loss, tuple):
                        loss = loss[0]
                    if not tap.leaves or not torch.is_tensor(loss) or not loss.requires_grad:
                        return "skipped: the loss is not a differentiable function of the model's logits"
                    grads = torch.autograd.grad(loss, tap.leaves, allow_unused=True)
                results.append([(leaf.detach(), torch.zeros_like(leaf) if g is None else g.detach())
                                for leaf, g in zip(tap.leaves, grads)])
    finally:
        trainer._contract_probe = False
        trainer._loss_scale = None
        trainer._empty_micro_batch = False
        engine = getattr(trainer, "clipping_engine", None)
        if engine is not None:
            engine.clear()  # the probe's forwards ran without autograd: nothing recorded, cleared all the same
        model.train(was_training)
    ref = results[0]
    keep = k - 1  # rows 0..k-2 are the same examples in every variant
    for name, other in (("replacing", results[1]), ("removing", results[2]), ("lengthening", results[3])):
        if other is None:
            continue
        if len(other) != len(ref):
            raise _coupled(name, "the number of model calls")
        for (la, ga), (lb, gb) in zip(ref, other):
            if la.shape[0] < keep or lb.shape[0] < keep:
                continue
            outputs_ok, grads_ok = False, False
            for a_la, a_lb, a_ga, a_gb in _aligned(la[:keep], lb[:keep], ga[:keep], gb[:keep]):
                o, g = _close(a_la, a_lb), _close(a_ga, a_gb)
                outputs_ok, grads_ok = outputs_ok or o, grads_ok or (o and g)
            if not outputs_ok:
                raise _coupled(name, "outputs")
            if not grads_ok:
                raise _coupled(name, "loss gradients")
    return "passed"


def _aligned(la, lb, ga, gb):
    """The ways to compare per-token outputs of the same rows padded to two lengths: the same positions when the
    lengths agree; else the first positions of both (right padding) or the last (left padding). Per-example outputs
    ([rows, classes]) have one way."""
    if la.shape == lb.shape or la.dim() < 3 or la.shape[2:] != lb.shape[2:]:
        return [(la, lb, ga, gb)]
    t = min(la.shape[1], lb.shape[1])
    return [(la[:, :t], lb[:, :t], ga[:, :t], gb[:, :t]), (la[:, -t:], lb[:, -t:], ga[:, -t:], gb[:, -t:])]


def _coupled(how: str, what: str) -> ValueError:
    if what == "outputs":
        cause = ("the model's forward or the data collator mixes the examples of a batch (e.g. mixup, BatchNorm, or a "
                 "row that sees the batch's padding: no attention mask, or left padding with absolute positions)")
    else:
        cause = ("the loss handed to backward is not a sum of per-example terms (e.g. a compute_loss override that "
                 "adds a batch-level term, or divides by the batch's row or token count or num_items_in_batch)")
    return ValueError(
        f"the per-example contract does not hold: {how} one example of a probe micro-batch changed the other "
        f"examples' {what}, so {cause}; one example could then move the update by more than the clip norm C and the "
        "reported epsilon would be false — make each example's loss a function of that example alone"
    )
