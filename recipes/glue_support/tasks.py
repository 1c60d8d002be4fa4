"""The GLUE tasks the recipes know: columns, label names, metrics, file names, Hub splits (:data:`GLUE_TASKS`).

Labels use the integer ids of the Hub ``nyu-mll/glue`` dataset (QNLI: entailment=0, not_entailment=1), whichever
source the data comes from (:mod:`recipes.glue_support.data`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

HUB_GLUE_DATASET = "nyu-mll/glue"


class DataLoadingError(ValueError):
    """A dataset could not be loaded or failed validation; the message says what to do."""


#: the split name of MNLI's mismatched evaluation set (local dev_mismatched.tsv or the Hub's validation_mismatched)
MISMATCHED = "validation_mismatched"


@dataclass(frozen=True)
class GlueTask:
    """What hf_dp needs to know about one GLUE task."""

    name: str
    sentence1_key: str
    sentence2_key: str | None
    label_names: tuple[str, ...] | None  # None → regression (STS-B)
    metrics: tuple[str, ...]
    folder: str  # folder name in the original GLUE distribution
    dev_file: str = "dev.tsv"
    test_file: str = "test.tsv"
    validation_split: str = "validation"  # split name on the Hub
    # original GLUE TSV column → Hub column (applied only when the source column is present)
    rename: dict[str, str] = field(default_factory=dict)
    # None = the TSV has a header row; otherwise the column names to use (CoLA has no header)
    column_names: tuple[str, ...] | None = None
    # MNLI's second evaluation set (run_glue evaluates both): local file, Hub split; kept as split "validation_mismatched"
    dev_mismatched_file: str | None = None
    mismatched_split: str | None = None

    @property
    def is_regression(self) -> bool:
        return self.label_names is None

    @property
    def num_labels(self) -> int:
        return 1 if self.label_names is None else len(self.label_names)

    @property
    def text_columns(self) -> tuple[str, ...]:
        return tuple(k for k in (self.sentence1_key, self.sentence2_key) if k is not None)


GLUE_TASKS: dict[str, GlueTask] = {
    "cola": GlueTask(
        "cola", "sentence", None, ("unacceptable", "acceptable"), ("matthews_correlation",), "CoLA",
        column_names=("source", "label", "label_notes", "sentence"),
    ),
    "sst2": GlueTask("sst2", "sentence", None, ("negative", "positive"), ("accuracy",), "SST-2"),
    "mrpc": GlueTask(
        "mrpc", "sentence1", "sentence2", ("not_equivalent", "equivalent"), ("accuracy", "f1"), "MRPC",
        rename={"Quality": "label", "#1 String": "sentence1", "#2 String": "sentence2"},
    ),
    "qqp": GlueTask(
        "qqp", "question1", "question2", ("not_duplicate", "duplicate"), ("accuracy", "f1"), "QQP",
        rename={"is_duplicate": "label"},
    ),
    "stsb": GlueTask(
        "stsb", "sentence1", "sentence2", None, ("pearson", "spearmanr"), "STS-B", rename={"score": "label"}
    ),
    "mnli": GlueTask(
        "mnli", "premise", "hypothesis", ("entailment", "neutral", "contradiction"), ("accuracy",), "MNLI",
        dev_file="dev_matched.tsv", test_file="test_matched.tsv", validation_split="validation_matched",
        rename={"sentence1": "premise", "sentence2": "hypothesis", "gold_label": "label"},
        dev_mismatched_file="dev_mismatched.tsv", mismatched_split="validation_mismatched",
    ),
    "qnli": GlueTask("qnli", "question", "sentence", ("entailment", "not_entailment"), ("accuracy",), "QNLI"),
    "rte": GlueTask("rte", "sentence1", "sentence2", ("entailment", "not_entailment"), ("accuracy",), "RTE"),
    "wnli": GlueTask("wnli", "sentence1", "sentence2", ("not_entailment", "entailment"), ("accuracy",), "WNLI"),
}


def get_task(task_name: str | None) -> GlueTask | None:
    if task_name is None:
        return None
    key = task_name.lower().replace("-", "")
    if key not in GLUE_TASKS:
        raise DataLoadingError(f"unknown GLUE task {task_name!r}; choose one of {sorted(GLUE_TASKS)}")
    return GLUE_TASKS[key]
