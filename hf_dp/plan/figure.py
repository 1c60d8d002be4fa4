"""The planner's figure (``python -m hf_dp.plan ... --plot FILE``): the table it already computes, drawn.

With d: R_run = √d·σ/(B·√T) against the logical batch B, one line per epochs value, the recommended plan marked, and
the calibrated thresholds as horizontal lines (:data:`hf_dp.plan.calibration.CONSTANT_R_RUN`: the constant predictor
on a task as hard as QNLI; :data:`hf_dp.plan.calibration.CONSTANT_R_RUN_ALL`: on every measured task;
:data:`hf_dp.plan.calibration.WARN_R_RUN`: noise-dominated) — the classifiers' calibration, not drawn for a causal LM.
Without d: σ/B, the noise per coordinate of the averaged gradient in units of C. Candidates with fewer than the plan's
minimum steps are drawn hollow. Public quantities only, as the table.

matplotlib draws with its Agg backend through the object API, in its default style; the PNG carries no time stamp or
version, so the same plan gives the same file.
"""

from __future__ import annotations

import os

from hf_dp.plan.calibration import CONSTANT_R_RUN, CONSTANT_R_RUN_ALL, WARN_R_RUN


def matplotlib_missing() -> str | None:
    """None when matplotlib can be imported, else the sentence to print."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib)"
    return None


def write_plan_plot(plan, path: str | os.PathLike, causal_lm: bool = False) -> str:
    """Write ``plan``'s figure (a :class:`hf_dp.plan.plans.Plan`) to ``path`` as a PNG; returns the path. ``causal_lm``:
    leave out the sequence classifiers' thresholds."""
    import matplotlib
    import matplotlib.style
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import FuncFormatter, NullLocator

    with_d = bool(plan.params)
    best = plan.best_per_epochs() if with_d else {}
    with matplotlib.style.context("default"), matplotlib.rc_context(
            {"font.size": 8, "axes.titlesize": 9, "lines.linewidth": 1.4, "savefig.dpi": 90}):
        fig = Figure(figsize=(6.4, 4.8))
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        for i, epochs in enumerate(sorted({r.epochs for r in plan.rows})):
            rows = sorted((r for r in plan.rows if r.epochs == epochs), key=lambda r: r.batch_size)
            xs = [r.batch_size for r in rows]
            ys = [r.r_run if with_d else r.noise_per_step for r in rows]
            color = f"C{i % 10}"
            ax.plot(xs, ys, color=color, label=f"{epochs:g} epoch(s)")
            for r, y in zip(rows, ys):
                few = with_d and r.steps < plan.min_steps
                ax.plot([r.batch_size], [y], marker="o", markersize=4, color=color,
                        markerfacecolor="white" if few else color)
            if with_d and epochs in best and best[epochs] is not plan.choice:
                ax.plot([best[epochs].batch_size], [best[epochs].r_run], marker="s", markersize=6, color=color,
                        markerfacecolor="none")
        if with_d:  # what the markers mean
            ax.plot([], [], marker="o", markersize=4, color="grey", markerfacecolor="white", linestyle="none",
                    label=f"fewer than {plan.min_steps} steps (not recommended)")
            ax.plot([], [], marker="s", markersize=6, color="grey", markerfacecolor="none", linestyle="none",
                    label="best at its epochs")
        if plan.choice is not None:
            c = plan.choice
            ax.plot([c.batch_size], [c.r_run], marker="*", markersize=13, color="black", linestyle="none",
                    label=f"recommended: B = {c.batch_size}, {c.steps} steps")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        sizes = sorted({r.batch_size for r in plan.rows})
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.xaxis.set_minor_locator(NullLocator())
        plain = FuncFormatter(lambda v, _: f"{v:g}")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
        top = max((r.r_run if with_d else r.noise_per_step) for r in plan.rows)
        ax.set_xlabel("logical batch B")
        if with_d:
            lines = [(WARN_R_RUN, "noise-dominated above", "C3")]
            if not causal_lm:
                lines += [(CONSTANT_R_RUN, "constant predictor above, on a task as hard as QNLI", "C1"),
                          (CONSTANT_R_RUN_ALL, "constant predictor above, on every measured task", "C4")]
            for y, label, color in lines:
                if y > WARN_R_RUN and y > 1.5 * top:  # far above every candidate: said in the legend only
                    ax.plot([], [], color=color, linestyle="--", linewidth=0.9, label=f"R_run = {y:g}: {label} (above)")
                    continue
                ax.axhline(y, color=color, linestyle="--", linewidth=0.9, label=f"R_run = {y:g}: {label}")
            ax.set_ylabel("R_run = √d·σ/(B·√T)")
            title = f"N = {plan.n:,}, ε = {plan.epsilon:g}, δ = {plan.delta:g}, d = {plan.params:,} ({plan.accountant})"
        else:
            ax.set_ylabel("σ/B (noise per coordinate, units of C)")
            title = f"N = {plan.n:,}, ε = {plan.epsilon:g}, δ = {plan.delta:g} ({plan.accountant}); no d: σ/B"
        ax.set_title(title, loc="left")
        ax.grid(True, which="both", alpha=0.25)
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.14), frameon=False, fontsize=7, ncol=2)
        fig.tight_layout()
        fig.savefig(path, format="png", metadata={"Software": None}, bbox_inches="tight")
    return str(path)
