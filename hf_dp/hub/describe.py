"""What a model card can say about a run from the Python API without being told: the base model
(``config._name_or_path`` when it reads as a Hub id), the task and labels (``config.finetuning_task``,
``config.id2label``), the fine-tuning data (a ``datasets.Dataset``'s own info: dataset name, config, split) and a
title. A recipe (or the user) sets ``trainer.base_model_id``, ``trainer.task_name``, ``trainer.dataset_name``,
``trainer.data_description`` or ``trainer.model_name`` to override any of them (docs/api.md, "Model cards"):
``DPTrainer`` hands those (:data:`CARD_SETTINGS`) to :func:`card_fields` with the model, the arguments and the
training set."""

from __future__ import annotations

import os
import re
from typing import Any

#: what may be set on a trainer to override what :func:`card_fields` finds (docs/api.md, "Model cards");
#: ``eval_overlap``: a recipe found evaluation rows that also occur in the training data (the card then does not call
#: the evaluation held-out)
CARD_SETTINGS = ("base_model_id", "task_name", "dataset_name", "data_description", "model_name", "eval_overlap")

#: builders of local files: their "dataset name" is a file format, not a dataset anyone can look up
_FILE_BUILDERS = {"csv", "json", "parquet", "text", "arrow", "pandas", "generator", "imagefolder", "audiofolder"}
#: those that read files from disk (``load_dataset("json", data_files=...)``): the card says "local json files"
_LOCAL_FILE_BUILDERS = _FILE_BUILDERS - {"pandas", "generator"}


def hub_id_or_none(name: str | None) -> str | None:
    """``name`` if it reads as a Hub id (``org/model`` or ``model``), ``None`` for a local path (never in a card)."""
    if not name or os.path.isabs(name) or name.startswith((".", "~")) or os.path.exists(name) or name.count("/") > 1:
        return None
    return name


def labels_of(config: Any) -> list[str] | None:
    """The label names of a classifier's config, or None when they are HF's placeholders (LABEL_0, …)."""
    id2label = getattr(config, "id2label", None) or {}
    names = [str(id2label[k]) for k in sorted(id2label, key=lambda k: int(k))] if id2label else []
    if not names or all(re.fullmatch(r"LABEL_\d+", n) for n in names):
        return None
    return names


def dataset_info(dataset: Any) -> tuple[str | None, str | None]:
    """(Hub dataset id or None, a description) from a ``datasets.Dataset``'s own info; (None, None) otherwise."""
    info = getattr(dataset, "info", None)
    if info is None:
        return None, None
    name = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None)
    if not name or name in _FILE_BUILDERS:
        return None, None
    config = getattr(info, "config_name", None)
    split = getattr(dataset, "split", None)
    desc = f"`{name}`" + (f" (config `{config}`)" if config and config != "default" else "") + (
        f", split `{split}`" if split else "")
    return None if name.count("/") > 1 else name, desc


def card_fields(model, args, train_dataset, objective: str | None = None, **settings) -> dict[str, Any]:
    """The keyword arguments :func:`hf_dp.hub.card.render_model_card` gets for a run of ``model`` with ``args`` on
    ``train_dataset`` (``objective``: the loss trained, :mod:`hf_dp.models.loss`'s name): what was set on the trainer
    (``settings``, the names of :data:`CARD_SETTINGS`: ``base_model_id``, ``task_name``, ``dataset_name``,
    ``data_description``, ``model_name``) first, else what the model's config and the training set say."""
    config = getattr(model, "config", None)
    base = settings.get("base_model_id") or hub_id_or_none(getattr(config, "_name_or_path", None))
    task = settings.get("task_name") or getattr(config, "finetuning_task", None)
    dataset_name = settings.get("dataset_name")
    description = settings.get("data_description")
    # under --privacy_unit_column the number of rows is private (one unit's removal changes it by its rows): the card
    # gives N, the number of units, only (the report's dataset_size)
    # (and so is the actual count under --public_dataset_size, whose N is the declared one)
    unit_level = getattr(args, "privacy_unit_column", None) is not None or getattr(args, "public_dataset_size", None) is not None
    if dataset_name is None and description is None:
        dataset_name, description = dataset_info(train_dataset)
        n = None if unit_level else _rows(train_dataset)
        if description and n:
            description += f", {n:,} training examples"
        if description is None and train_dataset is not None:  # no Hub info: the columns (public structure)
            columns = getattr(train_dataset, "column_names", None)
            builder = getattr(getattr(train_dataset, "info", None), "builder_name", None)
            description = (f"local {builder} files" if builder in _LOCAL_FILE_BUILDERS else "a dataset given in Python") + (
                f" (columns {', '.join(f'`{c}`' for c in columns)})" if columns else "")
    labels = labels_of(config) if config is not None else None
    task_description = None
    if labels:
        kind = "sequence classification" if getattr(config, "problem_type", None) != "regression" else "regression"
        task_description = f"{kind} — labels: {', '.join(labels)}"
    elif objective == "causal_lm":
        task_description = "causal language modeling"
    elif objective == "sequence_classification" and config is not None:
        regression = getattr(config, "problem_type", None) == "regression" or getattr(config, "num_labels", 2) == 1
        task_description = "regression" if regression else f"sequence classification ({config.num_labels} labels)"
    title = settings.get("model_name")
    name_or_path = getattr(config, "_name_or_path", None) if config is not None else None
    model_description = None
    if model is not None and not base:
        model_description = f"`{type(unwrap(model)).__name__}`" + (
            f" (model_type `{config.model_type}`)" if getattr(config, "model_type", None) else "")
        if name_or_path:  # from_pretrained of a local folder: never its path in a card
            model_description += ", loaded from a local checkpoint"
    return {"base_model": base, "task_name": task, "dataset_name": dataset_name, "data_description": description,
            "model_name": title, "task_description": task_description, "model_description": model_description,
            "random_init": config is not None and not name_or_path and not settings.get("base_model_id"),
            "loss_kind": loss_kind_of(config, objective), "eval_overlap": bool(settings.get("eval_overlap"))}


def loss_kind_of(config: Any, objective: str | None) -> str | None:
    """The loss the model's eval ``loss`` is, as :func:`hf_dp.hub.card.render_model_card` names it: ``causal_lm``; for
    a sequence classifier the problem type its loss uses (hf_dp.models.loss.sequence_classification_loss: ``mse``
    for a regression — problem_type ``regression``, or one output —, ``binary_cross_entropy`` for multi-label,
    else ``cross_entropy``); ``None`` when not known (the card infers it from the evaluation)."""
    if objective == "causal_lm":
        return "causal_lm"
    if objective != "sequence_classification" or config is None:
        return None
    problem = getattr(config, "problem_type", None)
    if problem == "regression" or (problem is None and getattr(config, "num_labels", 2) == 1):
        return "mse"
    if problem == "multi_label_classification":
        return "binary_cross_entropy"
    return "cross_entropy"


def unwrap(model: Any) -> Any:
    """The transformers model under a PEFT wrapper (its class names the architecture)."""
    get = getattr(model, "get_base_model", None)
    return get() if callable(get) else model


def _rows(dataset: Any) -> int | None:
    try:
        return len(dataset)
    except TypeError:
        return None
