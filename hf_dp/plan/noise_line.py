"""The start-of-run block's line on the noise mechanism (:func:`hf_dp.plan.plans.run_block`; no calibration): for
independent noise the ``python -m hf_dp.plan ... --noise_comparison`` command (:mod:`hf_dp.plan.noise`) that says whether
correlated noise would help the run's own plan, for ``--noise_mechanism banded_sqrt`` its b and its accounting."""

from __future__ import annotations

import math

from hf_dp.privacy.accounting import dp_sgd_equivalent
from hf_dp.privacy.sampler import PoissonBatchSampler


def _epochs_arg(n: int, batch: int, steps: int) -> str | None:
    """A ``--epochs`` value for which the planner plans exactly ``steps`` steps at ``batch`` (None if none is found)."""
    spe = PoissonBatchSampler.steps_for_epoch(batch / n)
    for epochs in (steps / spe, (steps - 0.5) / spe):
        text = f"{epochs:.6g}"
        if math.ceil(float(text) * spe) == steps:  # the steps hf_dp.plan.plans.planned_steps plans (it imports this module)
            return text
    return None


def comparison_command(*, n: int, batch_size: float, steps: int, epsilon: float, delta: float, accountant: str,
                       params: int, bands: int = 1) -> str:
    """``python -m hf_dp.plan ... --noise_comparison`` for a run's own B and T (``--batch`` and ``--epochs`` pinned to
    them; when B is not a whole number or no ``--epochs`` value gives T: ``--params``, the comparison then at the
    planner's own recommendation)."""
    b = int(round(batch_size))
    epochs = _epochs_arg(int(n), b, int(steps)) if abs(batch_size - b) < 1e-9 and 0 < b <= n else None
    return (f"python -m hf_dp.plan --n {n} --epsilon {epsilon:.4g} --delta {delta:g}"
            + (f" --batch {b} --epochs {epochs}" if epochs else f" --params {params}")
            + (f" --accountant {accountant}" if accountant != "prv" else "")
            + (f" --noise_bands {bands}" if bands > 1 else "") + " --noise_comparison")


def run_noise_line(n: int, batch_size: float, steps: int, epsilon: float, delta: float, accountant: str,
                   params: int, bands: int = 1) -> str:
    """The start-of-run block's line on the noise mechanism (no calibration): independent, with the command that says
    whether correlated noise would help this plan (:func:`comparison_command`), or banded_sqrt with b, its accounting
    (DP-SGD at rate b·q for ⌈T/b⌉ rounds; a banded run has b·q ≤ 1) and the same command."""
    command = comparison_command(n=n, batch_size=batch_size, steps=steps, epsilon=epsilon, delta=delta,
                                 accountant=accountant, params=params, bands=bands)
    if bands <= 1:
        return f"  noise: independent; would correlated noise help this plan? {command}"
    rate, rounds = dp_sgd_equivalent(batch_size / n, steps, bands)
    return (f"  noise: banded_sqrt, b = {bands} (ε as DP-SGD at rate {bands}·q = {rate:.4g} for ⌈T/{bands}⌉ = {rounds} "
            f"rounds); against independent noise: {command}")
