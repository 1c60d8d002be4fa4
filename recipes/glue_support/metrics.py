"""GLUE metrics for ``Trainer(compute_metrics=...)`` (the recipes), and the constant-predictor baseline.

hf_dp prefers Hugging Face ``evaluate`` (``evaluate.load("glue", task)``; ``"accuracy"`` / ``"mse"`` for custom
data, as run_glue.py). ``evaluate.load`` fetches the metric script from the Hub, so without network (and without a
cached copy) it fails; hf_dp then computes the same formulas that evaluate's ``glue`` metric wraps
(scikit-learn's ``f1_score`` / ``matthews_corrcoef``, scipy's ``pearsonr`` / ``spearmanr``, plain accuracy) and
logs one line saying which implementation is used. ``metric_path`` may point to a local copy of an evaluate
metric script (e.g. a checkout of huggingface/evaluate's ``metrics/glue``), which loads offline.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

from .tasks import get_task

logger = logging.getLogger(__name__)

BACKENDS = ("auto", "evaluate", "sklearn")
#: the planner's calibration rule (hf_dp.plan, benchmarks/planner_calibration.py): an accuracy less than this many
#: points above the evaluation set's majority rate counts as the constant predictor
BARELY_POINTS = 3.0


def _fallback_metrics(name: str) -> Callable[[np.ndarray, np.ndarray], dict[str, float]]:
    """scikit-learn/scipy versions of evaluate's glue/accuracy/mse metrics (same formulas)."""

    def accuracy(p, r):
        return {"accuracy": float((p == r).mean())}

    def acc_f1(p, r):
        from sklearn.metrics import f1_score

        return {"accuracy": float((p == r).mean()), "f1": float(f1_score(y_true=r, y_pred=p))}

    def matthews(p, r):
        from sklearn.metrics import matthews_corrcoef

        return {"matthews_correlation": float(matthews_corrcoef(r, p))}

    def corr(p, r):
        from scipy.stats import pearsonr, spearmanr

        return {"pearson": float(pearsonr(p, r)[0]), "spearmanr": float(spearmanr(p, r)[0])}

    def mse(p, r):
        return {"mse": float(((np.asarray(p, dtype=np.float64) - np.asarray(r, dtype=np.float64)) ** 2).mean())}

    table = {
        "cola": matthews, "stsb": corr, "mrpc": acc_f1, "qqp": acc_f1,
        "accuracy": accuracy, "mse": mse,
    }
    return table.get(name, accuracy)


def _metric_spec(task_name: str | None, is_regression: bool | None) -> tuple[str, str | None, str, bool]:
    """(evaluate path, evaluate config, fallback key, is_regression)."""
    task = get_task(task_name)
    if task is not None:
        return "glue", task.name, task.name, task.is_regression
    if is_regression:
        return "mse", None, "mse", True
    return "accuracy", None, "accuracy", False


def _offline() -> bool:
    """HF_HUB_OFFLINE / HF_EVALUATE_OFFLINE set (as huggingface_hub reads them)."""
    import os

    return any(os.environ.get(k, "").strip().upper() in ("1", "ON", "YES", "TRUE")
               for k in ("HF_HUB_OFFLINE", "HF_EVALUATE_OFFLINE"))


def load_metric_fn(
    task_name: str | None = None,
    *,
    is_regression: bool | None = None,
    backend: str = "auto",
    metric_path: str | None = None,
) -> tuple[Callable[[np.ndarray, np.ndarray], dict[str, float]], str]:
    """Return ``(fn(predictions, references) -> dict, description of the implementation used)``."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    path, config, fallback_key, _ = _metric_spec(task_name, is_regression)
    if metric_path is not None:
        path = metric_path
    if backend == "auto" and metric_path is None and _offline():
        # offline, evaluate.load would only fail ("Couldn't find a module script at …/glue/glue.py"), which reads
        # like an error on every offline run: the same metrics from scikit-learn/scipy, said plainly
        desc = "scikit-learn/scipy (offline mode: evaluate's metric scripts are not downloaded)"
        logger.info("hf_dp metrics: using %s", desc)
        return _fallback_metrics(fallback_key), desc
    if backend in ("auto", "evaluate"):
        try:
            import evaluate

            metric = evaluate.load(path, config) if config else evaluate.load(path)
        except Exception as exc:  # Hub unreachable, script missing, ...
            if backend == "evaluate":
                raise RuntimeError(f"evaluate.load({path!r}, {config!r}) failed: {exc}") from exc
            # the first line of the reason, whole (never cut mid-word)
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            desc = f"scikit-learn/scipy (evaluate.load({path!r}) unavailable: {reason})"
        else:
            def via_evaluate(p, r, _m=metric):
                return {k: float(v) for k, v in _m.compute(predictions=p, references=r).items()}

            desc = f"evaluate ({path}{'/' + config if config else ''})"
            logger.info("hf_dp metrics: using %s", desc)
            return via_evaluate, desc
    else:
        desc = "scikit-learn/scipy (requested)"
    logger.info("hf_dp metrics: using %s", desc)
    return _fallback_metrics(fallback_key), desc


def build_compute_metrics(
    task_name: str | None = None,
    *,
    is_regression: bool | None = None,
    backend: str = "auto",
    metric_path: str | None = None,
):
    """A ``compute_metrics(EvalPrediction) -> dict`` for the Trainer, as in run_glue.py.

    Accuracy for most GLUE tasks; accuracy + F1 for MRPC/QQP; Matthews correlation for CoLA; Pearson and
    Spearman for STS-B; accuracy (classification) or MSE (regression) without a task name.
    The function carries ``.implementation`` (which backend is used) and ``.last_predictions`` (the predicted classes,
    or scores, of its latest call: what :func:`constant_baseline` reads for the predicted-class spread).
    """
    fn, desc = load_metric_fn(task_name, is_regression=is_regression, backend=backend, metric_path=metric_path)
    regression = _metric_spec(task_name, is_regression)[3]

    def compute_metrics(p) -> dict[str, float]:
        preds = p.predictions[0] if isinstance(p.predictions, tuple) else p.predictions
        preds = np.squeeze(preds) if regression else np.argmax(preds, axis=1)
        labels = p.label_ids
        result = fn(np.asarray(preds), np.asarray(labels))
        if len(result) > 1:
            result["combined_score"] = float(np.mean(list(result.values())))
        compute_metrics.last_predictions = np.asarray(preds)  # for the baseline's spread (not a metric, not logged)
        return result

    compute_metrics.implementation = desc
    compute_metrics.last_predictions = None
    return compute_metrics


def main_metric_name(task_name: str | None, is_regression: bool | None = None) -> str:
    """The headline metric for summaries: accuracy, f1, matthews_correlation, pearson or mse."""
    task = get_task(task_name)
    if task is not None:
        return {"mrpc": "f1", "qqp": "f1", "cola": "matthews_correlation", "stsb": "pearson"}.get(task.name, "accuracy")
    return "mse" if is_regression else "accuracy"


def constant_baseline(labels, metrics: dict[str, Any], *, label_names: list[str] | None = None,
                      prefix: str = "eval_", predictions=None) -> dict[str, Any] | None:
    """How the evaluated model compares with the best *constant* predictor on the same evaluation labels.

    ``labels``: the evaluation set's class labels (ints; -1 = unlabelled, ignored). ``metrics``: the evaluation
    results (``eval_accuracy``, ``eval_matthews_correlation`` ...). ``predictions``: the model's predicted classes on
    the same rows (optional: the predicted-class spread). Returns None for regression (:func:`regression_baseline`),
    for an evaluation set without labels, or when no comparable metric was computed. Otherwise a dict with
    ``majority_rate`` (the share of the most frequent class: the accuracy of always predicting it), ``majority_label``,
    per compared metric the model's value and the constant predictor's (accuracy: the majority rate; F1 of the
    positive class: 2p/(1 + p) at a share p of positives, always predicting it; Matthews correlation: 0),
    ``predicted_shares`` (each class's share of the predictions, when given); ``at_or_below`` is True
    when the model counts as the constant predictor on any compared metric — by the planner's calibration rule, an
    accuracy less than :data:`BARELY_POINTS` points above the majority rate, an F1 or a Matthews correlation at or
    below the constant predictor's;
    ``sentence`` says so in plain words (for the summary and the card).

    Only the evaluation labels are used — never the training data's label counts, which are private.
    """
    arr = np.asarray(list(labels) if not isinstance(labels, np.ndarray) else labels)
    if arr.size == 0 or not np.issubdtype(arr.dtype, np.integer):
        return None
    keep = arr >= 0
    arr = arr[keep]
    if arr.size == 0:
        return None
    values, counts = np.unique(arr, return_counts=True)
    top = int(values[int(np.argmax(counts))])
    rate = float(counts.max() / arr.size)
    compared: dict[str, dict[str, float]] = {}
    # F1 of the positive class (MRPC, QQP: label 1): the best constant predicts it always, F1 = 2p/(1 + p) at a share p
    # of positives (MRPC dev: 0.812), never 0 — a model's F1 means little without it
    positive = float((arr == 1).mean())
    best_f1 = 2 * positive / (1 + positive) if positive > 0 else 0.0
    for name, constant in (("accuracy", rate), ("f1", best_f1), ("matthews_correlation", 0.0)):
        value = metrics.get(prefix + name)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            compared[name] = {"model": float(value), "constant": constant}
    if not compared:
        return None

    def label(i: int) -> str:
        return label_names[i] if label_names and 0 <= i < len(label_names) else str(i)

    baseline = {
        "majority_label": label(top), "majority_rate": rate, "eval_examples": int(arr.size), "compared": compared,
        "rule": f"accuracy less than {BARELY_POINTS:g} points above the majority rate (the planner's calibration), "
                "F1 at or below always predicting the positive class, or Matthews correlation <= 0, counts as the "
                "constant predictor",
        "at_or_below": any(_constant_like(n, c) for n, c in compared.items()),
    }
    if predictions is not None:
        pred = np.asarray(predictions).reshape(-1)
        if pred.size == keep.size:
            pred = pred[keep]
        if pred.size:
            classes, n = np.unique(pred.astype(int), return_counts=True)
            order = np.argsort(-n, kind="stable")
            baseline["predicted_shares"] = {label(int(classes[i])): float(n[i] / pred.size) for i in order}
    baseline["sentence"] = _baseline_sentence(baseline)
    return baseline


def _constant_like(name: str, c: dict[str, float]) -> bool:
    if name == "accuracy":
        return 100.0 * (c["model"] - c["constant"]) < BARELY_POINTS - 1e-9
    return c["model"] <= c["constant"] + 1e-12


def _baseline_sentence(baseline: dict[str, Any]) -> str:
    """One plain sentence for summaries and cards (``constant_baseline(...)["sentence"]``)."""
    parts = []
    for name, c in baseline["compared"].items():
        if name == "accuracy":
            what = (f"always predicting the most frequent class ('{baseline['majority_label']}', {c['constant']:.4f} of "
                    "the evaluation set)")
        elif name == "f1":
            what = f"always predicting the positive class (F1 {c['constant']:.4f})"
        else:
            what = "a constant prediction (0)"
        if c["model"] <= c["constant"] + 1e-12:
            rel = "at or below"
        elif _constant_like(name, c):
            rel = f"less than {BARELY_POINTS:g} points above"
        else:
            rel = "above"
        parts.append(f"{name} {c['model']:.4f} is {rel} {what}")
    verdict = ("NO BETTER THAN A CONSTANT PREDICTOR: the model has not learned the task. " if baseline["at_or_below"]
               else "")
    shares = baseline.get("predicted_shares")
    spread = ("; predicted classes: " + ", ".join(f"'{k}' {100 * v:.1f} %" for k, v in shares.items())) if shares else ""
    return verdict + "; ".join(parts) + spread + "."


def regression_baseline(labels, metrics: dict[str, Any], *, predictions=None, prefix: str = "eval_") -> dict[str, Any] | None:
    """A regression task's constant baseline: predicting the *evaluation* set's own mean label. (The training mean
    would be the usual choice, but it is a statistic of the private training data; the evaluation labels are not
    private, so this baseline costs no privacy.) It has MSE = the evaluation labels' variance and no correlation
    (Pearson / Spearman 0). ``predictions``: the model's scores on the same rows, for its MSE. ``at_or_below``: the
    model's Pearson correlation is ≤ 0, or its MSE is not below the baseline's."""
    arr = np.asarray(list(labels) if not isinstance(labels, np.ndarray) else labels, dtype=np.float64).reshape(-1)
    if arr.size == 0:
        return None
    mean, var = float(arr.mean()), float(arr.var())
    out: dict[str, Any] = {"constant": "the evaluation set's own mean label (the training mean is private)",
                           "eval_mean": mean, "eval_examples": int(arr.size), "constant_mse": var}
    pearson = metrics.get(prefix + "pearson")
    model_mse = metrics.get(prefix + "mse")
    if model_mse is None and predictions is not None and np.asarray(predictions).size == arr.size:
        model_mse = float(((np.asarray(predictions, dtype=np.float64).reshape(-1) - arr) ** 2).mean())
    out["model_mse"] = model_mse
    out["at_or_below"] = bool((isinstance(pearson, (int, float)) and pearson <= 0)
                              or (model_mse is not None and model_mse >= var))
    parts = [f"predicting the evaluation set's own mean label {mean:.3g} (not the training mean, a statistic of the "
             f"private data) gives MSE {var:.4g} and no correlation"]
    if model_mse is not None:
        parts.append(f"the model's MSE is {model_mse:.4g}")
    if isinstance(pearson, (int, float)):
        parts.append(f"its Pearson correlation {pearson:.4f}")
    out["sentence"] = ("NO BETTER THAN A CONSTANT PREDICTOR: the model has not learned the task. " if out["at_or_below"]
                       else "") + "; ".join(parts) + "."
    return out
