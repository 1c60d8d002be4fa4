"""Log lines of a recipe run. Those that read like errors but are not: transformers' model-load report when the only
missing weights are the new classification head (one plain line instead of an ANSI table), and torch's ``pin_memory``
warning on a machine without an accelerator (the recipes pin memory only where there is one: :func:`pin_memory_default`).
Those a run adds: the planned steps and the training time left (:func:`time_left_callback`), and why a unit-level
training loss is far above ``eval_loss`` (:func:`unit_loss_line`)."""

from __future__ import annotations

import logging
import math
import re
from typing import Optional

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
    redrawn in place, or every 20 s when the output is not a terminal): at the start, the planned steps; then the steps
    done and the training time left at the pace so far (the evaluation comes after) — at each logging step, or, when no
    logging step falls before the end (a run shorter than one logging interval, or logging not by steps), once after
    the first step. The start line says which. Rank 0 only. Step times are not released beyond what the bar and the
    summary's wall time already show."""
    import time

    from transformers import TrainerCallback

    def logging_every(args, state) -> int:
        """The logging interval in steps (HF turns a fraction of the run into steps in ``state.logging_steps``); 0
        when the run does not log by steps."""
        if str(getattr(args.logging_strategy, "value", args.logging_strategy)) != "steps":
            return 0
        every = getattr(state, "logging_steps", None) or args.logging_steps
        if 0 < every < 1:
            every = math.ceil(state.max_steps * every)
        return int(every)

    class TrainingTimeLeft(TrainerCallback):
        def __init__(self):
            self.start = None
            self.first_step = 0
            self.once = False  # no logging step before the end: one estimate after the first step instead

        def _say(self, state) -> None:
            steps = state.global_step - self.first_step
            elapsed = time.perf_counter() - self.start
            left = elapsed / steps * (state.max_steps - state.global_step)
            print(f"training: step {state.global_step:,}/{state.max_steps:,} after {_minutes(elapsed)}; about "
                  f"{_minutes(left)} of training left at this pace (evaluation after)", flush=True)

        def on_train_begin(self, args, state, control, **kwargs):
            self.start, self.first_step = time.perf_counter(), state.global_step
            if state.is_world_process_zero and state.max_steps:
                done = f" ({state.global_step:,} done)" if state.global_step else ""
                left = state.max_steps - state.global_step
                every = logging_every(args, state)
                first_log = (state.global_step // every + 1) * every if every else None
                if left <= 1:
                    when = "one step to go: no time left to estimate"
                elif first_log is not None and first_log < state.max_steps:
                    when = f"the time left is printed at each logging step (every {every:,} steps)"
                else:
                    self.once = True
                    when = ("the time left is printed once, after the first step (" + (
                        f"no logging step before the end: every {every:,} steps" if every else "logging is not by steps")
                        + ")")
                print(f"training: {state.max_steps:,} steps planned{done}; {when}", flush=True)

        def on_step_end(self, args, state, control, **kwargs):
            if (self.once and self.start is not None and state.is_world_process_zero and state.max_steps
                    and state.global_step == self.first_step + 1 and state.global_step < state.max_steps):
                self._say(state)

        def on_log(self, args, state, control, **kwargs):
            steps = state.global_step - self.first_step
            if self.once or self.start is None or not state.is_world_process_zero or steps <= 0 or not state.max_steps:
                return
            if state.global_step >= state.max_steps:
                return
            self._say(state)

    return TrainingTimeLeft()


def _row_loss(training_args) -> str:
    if getattr(training_args, "lm_loss_weighting", "sequence") == "token":
        return f"token sum over the block size {training_args.dp_max_length}"
    return "mean over its scored tokens"


def unit_loss_line(training_args, row: str, rows: str) -> Optional[str]:
    """Under ``--privacy_unit_column`` the training loss DPTrainer logs is per *unit*: each drawn unit's loss is the sum
    of its rows' losses (what is clipped and trained on), and the logged ``loss`` is their sum over the step divided by
    the expected logical batch B (in units) — about (rows per unit) × the per-row loss, far above ``eval_loss`` (a mean
    per token of held-out rows). One line saying so, printed when training starts (None without a unit column or
    DP). ``row`` / ``rows``: what a row is, e.g. "conversation" / "conversations". The number of rows per unit is
    private: the line gives no figure for it."""
    column = getattr(training_args, "privacy_unit_column", None)
    if not training_args.dp_enabled or column is None:
        return None
    return (f"training loss: with --privacy_unit_column {column} the logged 'loss' is per unit, not per {row}: each "
            f"drawn unit's loss is the sum of its {rows}' losses (each {row}'s {_row_loss(training_args)}; that sum is "
            f"what is clipped to C and trained on), averaged over the step's expected B units — so it is about "
            f"({rows} per unit) × the per-{row} loss, while eval_loss is a mean per token of held-out {rows}")
