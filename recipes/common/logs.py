"""Log lines of a recipe run that read like errors but are not: transformers' model-load report when the only missing
weights are the new classification head (one plain line instead of an ANSI table), and torch's ``pin_memory`` warning
on a machine without an accelerator (the recipes pin memory only where there is one: :func:`pin_memory_default`)."""

from __future__ import annotations

import logging
import re

_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
_ROW = re.compile(r"^(\S+)\s*\|\s*(\w+)\s*\|", re.M)
#: the modules of a task head from_pretrained creates new (sequence classifiers of BERT/RoBERTa/ELECTRA/GPT-2/Llama …)
HEAD_MODULES = ("classifier", "score")


def new_head_line(message: str) -> str | None:
    """One plain line for a ``LOAD REPORT`` whose only rows are MISSING weights of the task head; None otherwise (any
    other row — unexpected or mismatched weights, a missing body weight — keeps the full report)."""
    text = _ANSI.sub("", message)
    if "LOAD REPORT" not in text:
        return None
    rows = _ROW.findall(text.split("\n", 1)[1] if "\n" in text else "")
    rows = [(k, s) for k, s in rows if k != "Key"]
    if not rows or any(s != "MISSING" or k.split(".")[0] not in HEAD_MODULES for k, s in rows):
        return None
    model = text.split(" LOAD REPORT", 1)[0].strip()
    return (f"{model}: the task head ({', '.join(sorted(k for k, _ in rows))}) is new, initialised at random — as "
            "expected for a pre-trained model fine-tuned on a new task")


class NewHeadReport(logging.Filter):
    """Replaces transformers' load report by :func:`new_head_line` when that says everything."""

    def filter(self, record: logging.LogRecord) -> bool:
        line = new_head_line(record.getMessage())
        if line is not None:
            record.msg, record.args = line, None
        return True


def quiet_load_reports() -> None:
    """Install :class:`NewHeadReport` on transformers' loading logger (once)."""
    logger = logging.getLogger("transformers.modeling_utils")
    if not any(isinstance(f, NewHeadReport) for f in logger.filters):
        logger.addFilter(NewHeadReport())


def pin_memory_default() -> bool:
    """Pinned host memory helps only when batches go to an accelerator; on a CPU-only machine torch warns at every
    data loader (HF's default is True)."""
    import torch

    accel = getattr(torch, "accelerator", None)
    if accel is not None and hasattr(accel, "is_available"):
        return bool(accel.is_available())
    return torch.cuda.is_available()


def _minutes(seconds: float) -> str:
    return f"{seconds / 60:.1f} min" if seconds >= 90 else f"{seconds:.0f} s"


def time_left_callback():
    """One overall estimate of the training's time, in plain lines a log file keeps (the progress bar's own estimate is
    redrawn in place, or every 20 s when the output is not a terminal): at the start, the planned steps; at each
    logging step, the steps done and the training time left at the pace so far (the evaluation comes after). Rank 0
    only. Step times are not released beyond what the bar and the summary's wall time already show."""
    import time

    from transformers import TrainerCallback

    class TrainingTimeLeft(TrainerCallback):
        def __init__(self):
            self.start = None
            self.first_step = 0

        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.first_step = time.perf_counter(), state.global_step
            if state.is_world_process_zero and state.max_steps:
                done = f" ({state.global_step:,} done)" if state.global_step else ""
                print(f"training: {state.max_steps:,} steps planned{done}; the time left is printed at each logging "
                      f"step (every {args.logging_steps:g} steps)", flush=True)

        def on_log(self, args, state, control, **kwargs):
            steps = state.global_step - self.first_step
            if self.start is None or not state.is_world_process_zero or steps <= 0 or not state.max_steps:
                return
            if state.global_step >= state.max_steps:
                return
            elapsed = time.perf_counter() - self.start
            left = elapsed / steps * (state.max_steps - state.global_step)
            print(f"training: step {state.global_step:,}/{state.max_steps:,} after {_minutes(elapsed)}; about "
                  f"{_minutes(left)} of training left at this pace (evaluation after)", flush=True)

    return TrainingTimeLeft()
