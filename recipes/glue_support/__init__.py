"""GLUE support for the recipes (``recipes/glue.py``, ``recipes/qnli.py``) and the GLUE benchmarks; not part of hf_dp.

* :mod:`~recipes.glue_support.tasks`: the nine GLUE tasks (columns, label names, metrics, files, Hub splits);
* :mod:`~recipes.glue_support.data`: loading (Hub, a local folder in the GLUE layout, or your own files), checks,
  tokenization as run_glue.py;
* :mod:`~recipes.glue_support.metrics`: ``compute_metrics`` (``evaluate``, or the same formulas offline), the headline
  metric, and the constant-predictor baseline the summary and the model card report.
"""

from .data import LabelInfo, label_info, load_raw_datasets, preprocess, sentence_keys
from .metrics import build_compute_metrics, constant_baseline, load_metric_fn, main_metric_name, regression_baseline
from .tasks import GLUE_TASKS, HUB_GLUE_DATASET, MISMATCHED, DataLoadingError, GlueTask, get_task

__all__ = [
    "GLUE_TASKS", "HUB_GLUE_DATASET", "MISMATCHED", "DataLoadingError", "GlueTask", "get_task",
    "LabelInfo", "label_info", "load_raw_datasets", "preprocess", "sentence_keys",
    "build_compute_metrics", "constant_baseline", "load_metric_fn", "main_metric_name", "regression_baseline",
]
