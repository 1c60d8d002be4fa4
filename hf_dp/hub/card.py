"""Model card (README.md) and privacy.json for models trained with hf_dp.

The card is rendered from a Jinja2 template shipped in the top-level ``model_cards/`` folder of the source tree,
installed as the sub-package ``hf_dp.model_cards`` (setuptools ``package-dir``) and read with
:mod:`importlib.resources`, so a regular (non-editable) install finds it too.
"""

from __future__ import annotations

import importlib.resources
import json
import math
import os
from pathlib import Path
from typing import Any

import yaml

TEMPLATE_PACKAGE = "hf_dp.model_cards"
TEMPLATE_NAME = "model_card.md.j2"

# eval keys that are bookkeeping, not results
_NOT_RESULTS = {"epoch", "eval_runtime", "eval_samples_per_second", "eval_steps_per_second", "eval_samples"}
#: eval keys never published (neither in the card nor in privacy.json): TRL's ``num_tokens`` is the count of *training*
#: tokens seen so far (its ``_total_train_tokens``, logged with every evaluation too) — a count of the private data —,
#: and 0 under DP, whose loss is hf_dp's (TRL's counter never runs): a false number either way
_NOT_PUBLISHED = {"eval_num_tokens", "num_tokens"}
#: TRL's evaluation diagnostics: in the card's evaluation table with what they measure, not model-index results
_DIAGNOSTICS = {
    "entropy": "entropy (TRL's diagnostic: mean entropy of the predicted next-token distribution over the scored "
               "evaluation tokens)",
    "mean_token_accuracy": "mean_token_accuracy (TRL's diagnostic: share of the scored evaluation tokens predicted "
                           "exactly, greedy)",
}
_METRIC_TITLES = {
    "accuracy": "Accuracy", "f1": "F1", "matthews_correlation": "Matthews Correlation", "pearson": "Pearson",
    "spearmanr": "Spearman Correlation", "mse": "MSE", "combined_score": "Combined Score", "loss": "Loss",
    "perplexity": "Perplexity",
}
_GLUE_TASKS = {"cola", "sst2", "mrpc", "qqp", "stsb", "mnli", "qnli", "rte", "wnli"}


def template_source(name: str = TEMPLATE_NAME) -> tuple[str, str]:
    """``(template text, where it was found)``: the source checkout this ``hf_dp`` is imported from, else the
    installed package data.

    The checkout comes first so that the template always matches the imported code (an editable install of
    another checkout maps ``hf_dp.model_cards`` to *that* checkout's folder)."""
    checkout = Path(__file__).resolve().parents[2] / "model_cards" / name
    if checkout.is_file():
        return checkout.read_text(encoding="utf-8"), str(checkout)
    try:
        resource = importlib.resources.files(TEMPLATE_PACKAGE).joinpath(name)
        if resource.is_file():
            return resource.read_text(encoding="utf-8"), f"{TEMPLATE_PACKAGE}/{name}"
    except ModuleNotFoundError:
        pass
    # running from a source checkout where hf_dp.model_cards is not mapped: <repo>/model_cards/<name>
    path = Path(__file__).resolve().parents[2] / "model_cards" / name
    if path.is_file():
        return path.read_text(encoding="utf-8"), str(path)
    raise FileNotFoundError(
        f"hf_dp model card template {name!r} not found in package {TEMPLATE_PACKAGE!r} or at {path}; "
        "the installation is missing its package data"
    )


#: the eval loss is shown with what it measures: beside a fair accuracy, a high cross-entropy means over-confident
#: (poorly calibrated) probabilities, not a wrong number
_EVAL_LOSS_LABEL = ("loss (cross-entropy of the predicted probabilities: it measures calibration too — a high loss beside a "
                    "fair accuracy means over-confident probabilities; use the label, not the probability)")
#: a causal LM's eval loss is the mean cross-entropy of its next-token predictions (perplexity = exp(loss))
_LM_EVAL_LOSS_LABEL = "loss (mean cross-entropy per predicted token of the evaluation text; perplexity = exp(loss))"
#: the eval loss by the loss the head computes (:func:`infer_loss_kind`; hf_dp.models.loss.sequence_classification_loss)
_LOSS_LABELS = {
    "cross_entropy": _EVAL_LOSS_LABEL,
    "mse": "loss (mean squared error of the predicted score against the label: the regression head's loss)",
    "binary_cross_entropy": ("loss (binary cross-entropy of each label's predicted probability, summed over the labels: "
                             "the multi-label head's loss)"),
    "causal_lm": _LM_EVAL_LOSS_LABEL,
}
#: metrics only a regression is evaluated with (GLUE's STS-B, glue.py's regression without a task name)
_REGRESSION_METRICS = {"pearson", "spearmanr", "mse"}
_CLASSIFICATION_METRICS = {"accuracy", "f1", "matthews_correlation"}


def infer_loss_kind(report: dict, eval_results: dict | None = None, baseline: dict | None = None,
                    task_name: str | None = None) -> str:
    """Which loss the eval ``loss`` is (a key of :data:`_LOSS_LABELS`) when the caller did not say
    (:func:`hf_dp.hub.describe.card_fields` reads it from the model's config): a causal LM's token cross-entropy; a
    regression's MSE when the run was evaluated as one (GLUE's ``stsb``, a regression baseline, regression metrics
    only); else a classifier's cross-entropy."""
    if report.get("objective") == "causal_lm":
        return "causal_lm"
    names = {name.removesuffix("_mm") for name, _ in _metric_items(eval_results)}
    if ((task_name or "").lower().replace("-", "") == "stsb" or (baseline or {}).get("constant_mse") is not None
            or (names & _REGRESSION_METRICS and not names & _CLASSIFICATION_METRICS)):
        return "mse"
    return "cross_entropy"


def _num(x: Any) -> str:
    if x is None:
        return "not recorded"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, int):
        return f"{x:,}"  # 8,999 as the run's log writes it
    if isinstance(x, float):
        if math.isinf(x) or math.isnan(x):
            return str(x)
        if x.is_integer() and abs(x) < 1e6:
            return f"{int(x):,}"
        if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e6):
            return f"{x:.4g}"
        return f"{x:.6g}"
    return str(x)


def _pct(a: Any, b: Any) -> str:
    try:
        return f"{100.0 * float(a) / float(b):.2f}%"
    except (TypeError, ValueError, ZeroDivisionError):
        return "?"


def _is_dp(report: dict) -> bool:
    if report.get("disable_dp") or report.get("differential_privacy") is False:
        return False
    eps = report.get("epsilon")
    return isinstance(eps, (int, float)) and not isinstance(eps, bool) and math.isfinite(eps)


def _metric_items(eval_results: dict | None) -> list[tuple[str, Any]]:
    """``[(metric, value)]`` for numeric eval results, without the ``eval_`` prefix or bookkeeping keys."""
    items = []
    for key, value in (eval_results or {}).items():
        if key in _NOT_RESULTS or key in _NOT_PUBLISHED or not key.startswith("eval_") or not isinstance(value, (int, float)) or isinstance(value, bool):
            continue  # only eval_* keys are results: epsilon (added to every log) is the guarantee, not a metric
        items.append((key[len("eval_"):] if key.startswith("eval_") else key, value))
    return items


def _dataset_fields(task_name: str | None, dataset_name: str | None, local_data: bool = False) -> tuple[str | None, str | None, str]:
    """(hub dataset id for the card metadata, config, human description). ``local_data``: the data did not come from
    the Hub, so no Hub dataset is named (not even GLUE's for a GLUE task)."""
    task = task_name.lower().replace("-", "") if task_name else None
    if local_data and dataset_name is None:  # the user's own files in a GLUE task's format: not GLUE's data
        return None, None, (f"local files in the format of GLUE's `{task}`" if task in _GLUE_TASKS else "local files")
    if dataset_name is None and task in _GLUE_TASKS:
        dataset_name = "nyu-mll/glue"
    config = task if task in _GLUE_TASKS and dataset_name in ("nyu-mll/glue", "glue") else None
    if dataset_name and config:
        desc = f"GLUE {config.upper()} (`{dataset_name}`, config `{config}`), training split"
    elif dataset_name:
        desc = f"`{dataset_name}`"
    else:
        desc = "not recorded"
    return dataset_name, config, desc


def build_front_matter(
    report: dict,
    *,
    base_model: str | None,
    task_name: str | None,
    dataset_name: str | None,
    eval_results: dict | None,
    license: str,
    model_name: str,
    eval_split: str = "validation",
    local_data: bool = False,
) -> dict:
    """The YAML metadata block of the card (Hub model-card conventions + a ``differential_privacy`` section)."""
    ds_id, ds_config, local_name = _dataset_fields(task_name, dataset_name, local_data)
    meta: dict[str, Any] = {"license": license, "library_name": "transformers"}
    if base_model:
        meta["base_model"] = base_model
    opt_name = _optimizer_name(report)
    tags = (["differential-privacy"] if _is_dp(report) else []) + ["hf_dp"] + ([opt_name] if opt_name != "unknown" else [])
    lm = report.get("objective") == "causal_lm"
    pipeline = "text-generation" if lm else "text-classification"
    tags += [pipeline] + ([ds_config] if ds_config else []) + (["glue"] if ds_config else [])
    meta["tags"] = tags
    if ds_id:
        meta["datasets"] = [ds_id]
    meta["pipeline_tag"] = pipeline
    if _is_dp(report):
        meta["differential_privacy"] = {
            k: report[k]
            for k in ("epsilon", "delta", "target_epsilon", "accountant", "unit_of_privacy", "neighbouring_relation",
                      "dataset_size", "dataset_size_source", "privacy_unit", "sampling", "sample_rate",
                      "noise_multiplier", "noise_mechanism", "max_grad_norm", "expected_batch_size", "steps", "epochs")
            if k in report
        }
        if isinstance(report.get("correlated_noise"), dict):  # banded noise: b and the accounting it rests on
            meta["differential_privacy"]["noise_bands"] = report["correlated_noise"].get("bands")
        if report.get("non_private_training"):  # also trained without DP: the guarantee does not cover that data
            meta["differential_privacy"]["trained_without_dp_too"] = True
    # results: a classifier's metrics (its loss is a training objective, not a result); a language model's eval loss
    # (and its perplexity when computed) — never TRL's diagnostics or counters (num_tokens counts training tokens)
    metrics = [
        {"type": name, "value": value, "name": _METRIC_TITLES.get(name, name)}
        for name, value in _metric_items(eval_results)
        if (name in ("loss", "perplexity") if lm else name != "loss") and name not in _DIAGNOSTICS
    ]
    if metrics:
        task = task_name.lower().replace("-", "") if task_name else None
        # the dataset's own (lower-case) config name, as the Hub spells it: glue qnli, not GLUE QNLI
        name = (f"glue {ds_config}" if ds_config else ds_id if ds_id else
                (f"{task} (local files)" if task in _GLUE_TASKS else "local files") if local_data else "unknown")
        dataset: dict[str, Any] = {"name": name}
        if ds_id:
            dataset["type"] = ds_id
        if ds_config:
            dataset["config"] = ds_config
        dataset["split"] = eval_split
        meta["model-index"] = [{
            "name": model_name,
            "results": [{
                "task": {"type": pipeline, "name": "Text Generation" if lm else "Text Classification"},
                "dataset": dataset,
                "metrics": metrics,
            }],
        }]
    return meta


def _selection(report: dict) -> dict | None:
    """The ``model_selection`` entry of the report when the model was chosen on eval data, else ``None``."""
    sel = report.get("model_selection")
    if not isinstance(sel, dict) or not sel.get("selected_on_eval_data"):
        return None
    how = []
    if sel.get("load_best_model_at_end"):
        how.append("the best checkpoint was loaded at the end (`load_best_model_at_end`)")
    if sel.get("early_stopping"):
        how.append("training was stopped early (`EarlyStoppingCallback`)")
    names = sel.get("eval_datasets") or ["eval_dataset"]
    sizes = sel.get("eval_dataset_sizes") or {}
    data = ", ".join(f"`{n}`" + (f" ({sizes[n]} examples)" if n in sizes else "") for n in names)
    return {"how": " and ".join(how) or "the model was selected", "metric": sel.get("metric_for_best_model") or "loss", "data": data}


def _optimizer_name(report: dict) -> str:
    opt = report.get("optimizer") or {}
    return opt.get("name", "unknown") if isinstance(opt, dict) else str(opt)


def render_model_card(
    report: dict,
    *,
    base_model: str | None = None,
    task_name: str | None = None,
    dataset_name: str | None = None,
    eval_results: dict | None = None,
    license: str = "apache-2.0",
    model_name: str | None = None,
    eval_split: str = "validation",
    data_description: str | None = None,
    baseline: dict | None = None,
    task_description: str | None = None,
    model_description: str | None = None,
    random_init: bool = False,
    eval_overlap: bool = False,
    loss_kind: str | None = None,
    loss_description: str | None = None,
) -> str:
    """Render the README.md model card for a privacy report produced by ``DPTrainer.privacy_report()``.

    ``baseline``: the recipe's constant-predictor comparison (``recipes.glue_support.constant_baseline``: a dict with
    ``at_or_below`` and ``sentence``) of the evaluation results; the card says plainly when the
    model does no better than a constant predictor. ``task_description``: the Task line when no ``task_name`` is
    given (e.g. the labels, :func:`hf_dp.hub.describe.card_fields`). ``model_description``: what the model is when
    no Hub ``base_model`` names it (its class and config); ``random_init``: it was built from a config, so no parameter
    was pre-trained; ``eval_overlap``: some evaluation rows also occur in the training data (the metrics are not
    held-out ones). ``loss_kind``: the loss the eval ``loss`` is (``cross_entropy``, ``mse``, ``binary_cross_entropy``,
    ``causal_lm``: :func:`hf_dp.hub.describe.card_fields` reads it from the model's config; else
    :func:`infer_loss_kind`); ``loss_description``: the eval loss's label, when the trainer says what it is (DPSFTTrainer: the
    scored tokens)."""
    import jinja2

    dp = _is_dp(report)
    model_name = model_name or (
        "-".join(x for x in (base_model.rstrip('/').split('/')[-1], "dp" if dp else "", task_name) if x) if base_model
        else "-".join(x for x in (model_description.split()[0].strip("`") if model_description else "hf_dp-model",
                                  "dp" if dp else "") if x)
    )
    local_data = bool(data_description) and dataset_name is None
    front = build_front_matter(
        report, base_model=base_model, task_name=task_name, dataset_name=dataset_name, eval_results=eval_results,
        license=license, model_name=model_name, eval_split=eval_split, local_data=local_data,
    )
    _, _, dataset_desc = _dataset_fields(task_name, dataset_name, local_data)
    if data_description:
        dataset_desc = data_description
    opt = report.get("optimizer") or {}
    hps = (opt.get("hyperparameters") or {}) if isinstance(opt, dict) else {}
    optimizer_rows = [(k, ", ".join(_num(x) for x in v) if isinstance(v, (list, tuple)) else _num(v)) for k, v in hps.items()]
    kind = loss_kind if loss_kind in _LOSS_LABELS else infer_loss_kind(report, eval_results, baseline, task_name)
    loss_label = loss_description or _LOSS_LABELS[kind]
    eval_rows = [(loss_label if k == "loss" else _DIAGNOSTICS.get(k, k), _num(v)) for k, v in _metric_items(eval_results)]
    task_line = task_name or task_description or "not recorded"
    if task_name and task_description:
        task_line += f" ({task_description})"
    if base_model:
        base_line = base_model
    elif random_init:
        base_line = "none: " + (f"{model_description}, " if model_description else "") + "initialised at random from its config"
    else:
        base_line = model_description or "not recorded"

    text, _ = template_source()
    env = jinja2.Environment(
        undefined=jinja2.ChainableUndefined, trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True,
        autoescape=False,
    )
    template = env.from_string(text)
    return template.render(
        front_matter=yaml.safe_dump(front, sort_keys=False, allow_unicode=True),
        r=report, title=model_name, base_model=base_model, task_name=task_name, dataset_desc=dataset_desc,
        eval_rows=eval_rows, eval_split=eval_split, optimizer_name=_optimizer_name(report),
        optimizer_rows=optimizer_rows, trainable=report.get("trainable") or {}, dp=dp, num=_num, pct=_pct,
        selection=_selection(report), baseline=baseline, task_description=task_description, task_line=task_line,
        base_line=base_line, random_init=random_init, eval_overlap=eval_overlap,
        merged=merged_lora(report.get("trainable") or {}),
        lora_whole=any(".modules_to_save." in n for n in (report.get("trainable") or {}).get("names") or []),
    )


def merged_lora(trainable: dict) -> list[str] | None:
    """For a LoRA run (``trainable['mode'] == 'lora'``): the names of the release's weights the adapter was merged into
    (:func:`hf_dp.hub.report.merged_weight_names` of the trained adapter tensors), else ``None``."""
    if not isinstance(trainable, dict) or trainable.get("mode") != "lora":
        return None
    from hf_dp.hub.report import merged_weight_names

    return merged_weight_names(trainable.get("names") or [])


def parse_front_matter(card: str) -> dict:
    """The YAML metadata of a rendered card (between the leading ``---`` lines)."""
    if not card.startswith("---\n"):
        raise ValueError("model card does not start with YAML front matter")
    end = card.index("\n---\n", 4)
    return yaml.safe_load(card[4:end])


def write_privacy_artifacts(output_dir: str | os.PathLike, report: dict, *, log_history: list | None = None,
                            **card_kwargs) -> dict[str, str]:
    """Write ``privacy.json`` (the report, plus eval results under ``"eval"``) and ``README.md`` (the card).

    ``card_kwargs`` are passed to :func:`render_model_card` (base_model, task_name, dataset_name, eval_results,
    license, model_name, baseline; the baseline comparison is also stored under ``"eval_baseline"``). ``log_history``
    (``trainer.state.log_history``): also the training-curves PNG the card shows (:mod:`hf_dp.hub.plots`: ε and the
    eval metrics against steps, never the training loss). Returns the paths written.
    """
    os.makedirs(output_dir, exist_ok=True)
    payload = dict(report)
    eval_results = card_kwargs.get("eval_results")
    if eval_results is not None:
        eval_results = {k: v for k, v in eval_results.items() if k not in _NOT_PUBLISHED}
        card_kwargs = {**card_kwargs, "eval_results": eval_results}
        payload["eval"] = dict(eval_results)
    if card_kwargs.get("baseline"):
        payload["eval_baseline"] = dict(card_kwargs["baseline"])
    privacy_path = os.path.join(output_dir, "privacy.json")
    with open(privacy_path, "w", encoding="utf-8") as f:
        json.dump(payload, f, indent=2, sort_keys=False)
        f.write("\n")
    card_path = os.path.join(output_dir, "README.md")
    card, plot = render_model_card(report, **card_kwargs), None
    if log_history is not None:
        from hf_dp.hub import plots

        # never a count of the private data (TRL's num_tokens) in the picture either
        log_history = [{k: v for k, v in e.items() if k not in _NOT_PUBLISHED} if isinstance(e, dict) else e
                       for e in log_history]
        plot = plots.write_training_plot(log_history, output_dir)
        card = plots.add_to_card(card, plot, dp=_is_dp(report))
    with open(card_path, "w", encoding="utf-8") as f:
        f.write(card)
    return {"privacy.json": privacy_path, "README.md": card_path,
            **({plot.name: os.path.join(output_dir, plot.name)} if plot else {})}
