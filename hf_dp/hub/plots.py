"""The release's picture: ε spent and the evaluation metrics against the training steps (issue 53 item 2).

:func:`write_training_plot` takes the trainer's log history (``trainer.state.log_history``: DPTrainer adds
``epsilon`` to every log) and the release folder, and writes :data:`PLOT_NAME` there; :func:`card_section` is the
card's paragraph that shows it. Only what a release may carry is drawn:

* ε spent, a function of the public mechanism (q, σ, the steps, δ, the accountant) and of nothing in the data;
* the evaluation metrics (``eval_*``) as the run logged them at each evaluation — the numbers the card's "Evaluation"
  section gives for the end of the run, and covered by what that section says about the evaluation data.

Never the logged training loss (nor ``bc_clamp_rate``, the learning rate or any other statistic of the training
batches): it is computed on the private training data without noise, and the card tells the reader not to publish
it. A run without evaluations gets the ε curve alone; one with neither gets no picture.

matplotlib (a core dependency) draws with its Agg backend through the object API (no pyplot state, no display); when
it cannot be imported the plot is skipped with one log line — a release never fails for its picture. The figure is
small (a few tens of KB) and its content deterministic: matplotlib's default style whatever the user's matplotlibrc,
fixed size and resolution, no time stamp or version in the PNG's metadata.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass

logger = logging.getLogger(__name__)

#: the file written in the release folder (and referenced from its card)
PLOT_NAME = "training_curves.png"
#: eval keys that are bookkeeping, not metrics (as the card's own list)
_BOOKKEEPING = ("runtime", "samples_per_second", "steps_per_second", "samples", "epoch")
#: the figure's size (inches) per panel and its resolution: ~25–45 KB
_WIDTH, _PANEL_HEIGHT, _DPI = 6.4, 2.1, 90


@dataclass(frozen=True)
class TrainingPlot:
    """What :func:`write_training_plot` drew: the file's name in the folder, whether it has the ε curve, and the
    evaluation metrics (without the ``eval_`` prefix) it has."""

    name: str
    epsilon: bool
    metrics: tuple[str, ...]


def curves(log_history: list[dict] | None) -> tuple[list[tuple[int, float]], dict[str, list[tuple[int, float]]]]:
    """``(ε points, {metric: points})`` from a log history, each a list of ``(step, value)`` sorted by step: ε from
    every entry that has it, and each ``eval_*`` metric from the evaluations (its first value at a step: an MNLI-style
    second evaluation logged at the same step under the same key is left out). Nothing else of the log is read."""
    eps: dict[int, float] = {}
    metrics: dict[str, dict[int, float]] = {}
    for entry in log_history or ():
        if not isinstance(entry, dict) or not _number(entry.get("step")):
            continue
        step = int(entry["step"])
        if _number(entry.get("epsilon")) and math.isfinite(entry["epsilon"]):
            eps[step] = float(entry["epsilon"])
        for key, value in entry.items():
            if (not key.startswith("eval_") or key.endswith(_BOOKKEEPING) or not _number(value)
                    or not math.isfinite(value)):
                continue
            metrics.setdefault(key[len("eval_"):], {}).setdefault(step, float(value))
    return sorted(eps.items()), {k: sorted(v.items()) for k, v in sorted(metrics.items())}


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def write_training_plot(log_history: list[dict] | None, output_dir: str | os.PathLike,
                        name: str = PLOT_NAME) -> TrainingPlot | None:
    """Write ``output_dir/name`` (PNG): ε spent against steps, and the evaluation metrics against steps (the loss in
    a panel of its own, the other metrics together). Returns what was drawn, or None — nothing to draw (no ε and no
    evaluation in the log; an earlier picture of that name is removed, so a card never shows another run's curves),
    or matplotlib missing (one log line)."""
    eps, metrics = curves(log_history)
    path = os.path.join(output_dir, name)
    if not eps and not metrics:
        if os.path.isfile(path):
            os.remove(path)
        return None
    try:
        import matplotlib
        import matplotlib.style
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        logger.info("hf_dp: matplotlib is not installed: the release has no %s (pip install matplotlib)", name)
        return None
    loss = {k: v for k, v in metrics.items() if k == "loss"}
    # a causal LM's perplexity is exp(eval loss): the loss panel already shows it
    others = {k: v for k, v in metrics.items() if k != "loss" and not (k == "perplexity" and loss)}
    panels = [p for p in (("ε spent", {"ε": eps}) if eps else None,
                          ("evaluation loss", loss) if loss else None,
                          ("evaluation metrics", others) if others else None) if p]
    # matplotlib's defaults whatever the user's matplotlibrc (the backend is not a style key: Agg through the canvas)
    with matplotlib.style.context("default"), matplotlib.rc_context(
            {"font.size": 8, "axes.titlesize": 9, "lines.linewidth": 1.4, "lines.markersize": 3.5, "savefig.dpi": _DPI}):
        fig = Figure(figsize=(_WIDTH, _PANEL_HEIGHT * len(panels)))
        FigureCanvasAgg(fig)
        axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
        for ax, (title, series) in zip(axes, panels):
            for label, points in series.items():
                steps, values = zip(*points)
                if label == "ε":  # spent after each logged step, from 0 at step 0
                    ax.plot((0, *steps), (0.0, *values), color="C3", label="ε spent")
                else:
                    ax.plot(steps, values, marker="o", label=label)
            ax.set_title(f"evaluation {next(iter(series))}" if title == "evaluation metrics" and len(series) == 1
                         else title, loc="left")
            ax.grid(True, alpha=0.3)
            if len(series) > 1:
                ax.legend(loc="best", frameon=False)
        axes[-1].set_xlabel("training step")
        fig.tight_layout()
        os.makedirs(output_dir, exist_ok=True)
        # no Software / date chunks: the same curves give the same bytes
        fig.savefig(path, format="png", metadata={"Software": None})
    return TrainingPlot(name=name, epsilon=bool(eps), metrics=(*loss, *others))


def card_section(plot: TrainingPlot | None, dp: bool = True) -> str:
    """The card's paragraph for ``plot`` (markdown; empty without one): the image and a caption saying what is drawn
    and that the training loss is not."""
    if plot is None:
        return ""
    shown = (["ε spent (from the accountant: public numbers only)"] if plot.epsilon else []) + (
        ["the evaluation metrics (" + ", ".join(f"`{m}`" for m in plot.metrics) + ") at each evaluation"]
        if plot.metrics else [])
    caption = ("Drawn against the training steps, from the run's log: " + " and ".join(shown) + ". "
               + ("The evaluation metrics are those of \"Evaluation\" above, over the run. " if plot.metrics else "")
               + ("The training loss is not plotted: it is computed on the private training data without noise and is "
                  "not protected (see \"What the guarantee does not cover\")." if dp else
                  "The training loss is not plotted."))
    return (f"## Training curves\n\n![{' and '.join(s.split(' (')[0] for s in shown)} against training steps]"
            f"({plot.name})\n\n{caption}\n\n")


def add_to_card(card: str, plot: TrainingPlot | None, dp: bool = True) -> str:
    """``card`` with :func:`card_section` placed before "## What the guarantee does not cover" (else before
    "## Reproducibility", else at the end)."""
    section = card_section(plot, dp)
    if not section:
        return card
    for heading in ("\n## What the guarantee does not cover", "\n## Reproducibility"):
        i = card.find(heading)
        if i >= 0:
            return card[:i + 1] + section + card[i + 1:]
    return card.rstrip("\n") + "\n\n" + section.rstrip("\n") + "\n"
