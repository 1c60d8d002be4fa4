"""The summary block every recipe prints at the end of a run: the result, the constant predictor's, the planner's
expectation beside it, ε and the run's settings (:func:`summarize`, :func:`summary_block`)."""

from __future__ import annotations

import time
from typing import Any, Iterable, Optional

from .args import optim_name


def summarize(task: str, training_args, report: dict, metric_name: str, eval_metrics: dict, baseline, start: float,
              output_dir: Optional[str], pushed, extra_rows: Iterable[tuple[str, Any]] = (),
              expectation: Any = None) -> dict[str, Any]:
    """The run's summary dict (what :func:`summary_block` prints and ``main`` returns to the caller).
    ``extra_rows``: a recipe's own ``(name, value)`` rows, printed after the metric (one line each). ``expectation``:
    what the planner's start-of-run block said to expect (``trainer.dp.plan_expectation``, an
    :class:`hf_dp.plan.Expectation`; see :func:`planner_expectation`), compared with the result."""
    return {
        "extra_rows": [(str(k), v) for k, v in extra_rows],
        "expectation": expectation,
        "task": task,
        "optimizer": optim_name(training_args.optim),
        "epsilon": report.get("epsilon"),
        "target_epsilon": report.get("target_epsilon"),
        "delta": report.get("delta"),
        "noise_multiplier": report.get("noise_multiplier"),
        "max_grad_norm": report.get("max_grad_norm"),
        "sample_rate": report.get("sample_rate"),
        "steps": report.get("steps"),
        "metric_name": metric_name,
        "metric": eval_metrics.get(f"eval_{metric_name}"),
        "eval": eval_metrics,
        "baseline": baseline,
        "wall_time": time.perf_counter() - start,
        "output_dir": output_dir,
        "report": report,
        "push": pushed,
    }


def _fmt(x, spec=".4g") -> str:
    if x is None:
        return "n/a"
    if isinstance(x, float):
        return format(x, spec)
    return str(x)


#: how the best constant predictor reaches its value of each compared metric (recipes.glue_support.constant_baseline)
_CONSTANT_HOW = {"accuracy": "always the most frequent class", "f1": "always the positive class",
                 "matthews_correlation": "any constant prediction"}


def _constant_row(s: dict[str, Any]) -> list[tuple[str, str]]:
    """Right under the headline metric: the best constant predictor's value of the same metric on the same evaluation
    labels (e.g. F1 0.818 over always predicting the positive class's 0.812), when the baseline computed it."""
    name = s.get("metric_name")
    compared = ((s.get("baseline") or {}).get("compared") or {}).get(name)
    if not compared or s.get("metric") is None:
        return []
    return [(f"{name} of a constant predictor", f"{_fmt(compared['constant'])} ({_CONSTANT_HOW.get(name, 'a constant')}, "
                                                "on the same evaluation labels)")]


def planner_expectation(trainer) -> Any:
    """The expected result the trainer's start-of-run block stated (:func:`hf_dp.plan.run_expectation`), or None (a
    non-private run, or a selection's holder, prints no block)."""
    return getattr(getattr(trainer, "dp", None), "plan_expectation", None)


def _expectation_row(s: dict[str, Any]) -> list[tuple[str, str]]:
    """The planner's expectation beside the result (issue 53 item 3): "expected ≥ 3 points above the constant
    predictor … (planner, R_run 0.27), got accuracy 0.5121, at the constant predictor (0.5054): below the
    expectation". A classifier's result is judged by the constant-predictor comparison (the planner's own rule:
    ``baseline["at_or_below"]``); a causal LM's perplexity is shown beside the verdict (the run does not score the
    pretrained model)."""
    exp = s.get("expectation")
    if exp is None:
        return []
    name, value = s.get("metric_name", "metric"), s.get("metric")
    got = f"{name} {_fmt(value)}" if value is not None else "no evaluation"
    r_run = f", R_run {exp.r_run:.3g}" if isinstance(getattr(exp, "r_run", None), float) else ""
    if not exp.calibrated:
        return [("planner's expectation", f"no calibrated expectation: {exp.summary}; got {got}")]
    base = s.get("baseline") or {}
    expects_constant = exp.expects_constant
    if expects_constant is not None and value is not None and "at_or_below" in base:
        compared = (base.get("compared") or {}).get(name)
        at = bool(base["at_or_below"])
        got += (", at the constant predictor" if at else ", above the constant predictor") + (
            f" ({_fmt(compared['constant'])})" if compared else "")
        got += (": as expected" if at == expects_constant else
                ": below the expectation" if at else ": better than expected")
    elif expects_constant is None and value is not None:  # a causal LM: the verdict is against no fine-tuning
        got += " (this run does not score the pretrained model: compare with the pretrained model's on the same text)"
    return [("planner's expectation", f"expected {exp.summary} (planner{r_run}), got {got}")]


def summary_block(s: dict[str, Any]) -> str:
    rows = [
        ("task", s.get("task")),
        ("optimizer", s.get("optimizer")),
        ("epsilon spent", _fmt(s.get("epsilon")) + (f" (target {_fmt(s.get('target_epsilon'))})" if s.get("target_epsilon") else "")),
        *([("one-run audit", s["report"]["audit"]["summary"])] if (s.get("report") or {}).get("audit") else []),  # --audit_canaries
        ("delta", _fmt(s.get("delta"))),
        ("noise multiplier sigma", _fmt(s.get("noise_multiplier"))),
        ("clipping norm C", _fmt(s.get("max_grad_norm"))),
        ("sampling rate q", _fmt(s.get("sample_rate"))),
        ("steps", _fmt(s.get("steps"))),
        (s.get("metric_name", "metric"), _fmt(s.get("metric"))),
        *_constant_row(s),
        *[(k, _fmt(v)) for k, v in s.get("extra_rows", ())],
        *([("constant baseline", s["baseline"]["sentence"])] if s.get("baseline") else []),
        *_expectation_row(s),
        ("wall time", f"{s.get('wall_time', 0.0):.1f} s"),
        ("saved to", s.get("output_dir") or "not saved"),
    ]
    width = max(len(k) for k, _ in rows)
    lines = ["=" * 20 + " hf_dp summary " + "=" * 20]
    lines += [f"{k.ljust(width)} : {v}" for k, v in rows]
    lines.append("=" * 55)
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- entry point
