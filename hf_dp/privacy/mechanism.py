"""The mechanism of one DP run as one immutable value, fixed by public inputs before its first step.

:class:`Mechanism` holds what the accountant's ε rests on — q = B/N, σ, C, the planned steps T, B, δ, the target ε,
the accountant, the unit of privacy and the neighbouring relation — and is built once, by :meth:`Mechanism.plan`,
from public inputs only: N (declared with ``--public_dataset_size``, else the actual count treated as public, and the
value says which), the batch layout, δ, ε or σ, C, the accountant, the steps or epochs and the unit column. Two
datasets with the same public inputs give equal values; nothing of the data is in it. ``privacy.json``, the card,
the planner's start-of-run block, the contract's snapshot and the ledger all read it (as jax_privacy 2.x hands its
``DPExecutionPlan`` to the loop).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from . import banded
from .accounting import PrivacySpec
from .planning import plan_mechanism, size_source


@dataclass(frozen=True)
class Mechanism:
    """The planned mechanism: the accountant's :class:`~hf_dp.privacy.accounting.PrivacySpec` (σ, C, q, B, N, δ, the
    accountant, the target ε, the planned steps) plus the public facts around it. Immutable: a different plan is a
    different value (:meth:`with_target_epsilon`)."""

    spec: PrivacySpec
    #: round(1/q): the Poisson sampler's steps per epoch
    steps_per_epoch: int
    #: ε of the planned steps at δ (the accountant's, computed once when planned)
    planned_epsilon: float
    #: where N came from (:data:`hf_dp.privacy.planning.DECLARED` or :data:`~hf_dp.privacy.planning.COUNTED`)
    dataset_size_source: str
    #: ``--privacy_unit_column`` (``None``: one unit is one row)
    privacy_unit: str | None = None
    #: ``--max_rows_per_unit`` (``None``: every row of a drawn unit)
    max_rows_per_unit: int | None = None
    #: micro-batches per logical batch on each rank (``gradient_accumulation_steps``) and the number of ranks
    accumulation: int = 1
    world_size: int = 1

    @classmethod
    def plan(cls, *, n: int, declared: bool, per_device_batch: int, accumulation: int, world_size: int,
             delta: float, epsilon: float | None, noise_multiplier: float | None, max_grad_norm: float,
             accountant: str, max_steps: int, num_train_epochs: float, privacy_unit: str | None = None,
             max_rows_per_unit: int | None = None, noise_mechanism: str = banded.INDEPENDENT,
             noise_bands: int = 1) -> "Mechanism":
        """Plan the mechanism for the public N = ``n`` (``declared``: from ``--public_dataset_size``) and the expected
        logical batch B = per_device_batch × accumulation × world_size (:func:`hf_dp.privacy.planning.plan_mechanism`:
        q = B/N, the steps, σ calibrated for ``epsilon`` or given; with ``noise_mechanism`` ``banded_sqrt``, b =
        ``noise_bands``, on the DP-SGD equivalent of :mod:`hf_dp.privacy.banded`); refuses in one sentence what cannot
        be a private run."""
        world = max(1, int(world_size))
        spec, steps_per_epoch, planned_epsilon = plan_mechanism(
            n=n, per_device_batch=per_device_batch, accumulation=accumulation, world_size=world, delta=delta,
            epsilon=epsilon, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm, accountant=accountant,
            max_steps=max_steps, num_train_epochs=num_train_epochs, noise_mechanism=noise_mechanism,
            noise_bands=noise_bands)
        return cls(spec=spec, steps_per_epoch=int(steps_per_epoch), planned_epsilon=float(planned_epsilon),
                   dataset_size_source=size_source(n if declared else None), privacy_unit=privacy_unit,
                   max_rows_per_unit=max_rows_per_unit, accumulation=max(1, int(accumulation)), world_size=world)

    # the accountant's numbers, read through
    noise_multiplier = property(lambda self: self.spec.noise_multiplier)
    max_grad_norm = property(lambda self: self.spec.max_grad_norm)
    sample_rate = property(lambda self: self.spec.sample_rate)
    expected_batch_size = property(lambda self: self.spec.expected_batch_size)
    dataset_size = property(lambda self: self.spec.dataset_size)
    delta = property(lambda self: self.spec.delta)
    accountant = property(lambda self: self.spec.accountant)
    target_epsilon = property(lambda self: self.spec.target_epsilon)
    planned_steps = property(lambda self: self.spec.planned_steps)
    noise_mechanism = property(lambda self: self.spec.noise_mechanism)
    noise_bands = property(lambda self: self.spec.noise_bands)
    #: the b of the sampler and the accountant (1 for independent noise)
    bands = property(lambda self: self.spec.bands)

    @property
    def per_rank_divisor(self) -> float:
        """B / ranks: what each rank's loss is divided by (the logical batch's expected size over the ranks)."""
        return float(self.spec.expected_batch_size) / self.world_size

    @property
    def neighbouring_relation(self) -> str:
        """The adjacency ε is stated for (as jax_privacy records it): add/remove one example, or one unit."""
        col = self.privacy_unit
        return "add/remove one example" if col is None else f"add/remove one unit (all rows of one '{col}')"

    @property
    def unit_of_privacy(self) -> str:
        col = self.privacy_unit
        if col is None:
            return "one training example (add/remove adjacency)"
        return f"all training rows with the same '{col}' (add/remove adjacency of one unit)"

    def unit_report(self) -> dict:
        """What one unit of privacy is: a row, or the rows sharing a value of ``--privacy_unit_column``. The number of
        rows is not reported: under unit-level DP it is a statistic of the private data that ε does not cover; N, the
        number of units, is the accountant's (declared, or the actual count treated as public:
        ``dataset_size_source``)."""
        col, n = self.privacy_unit, self.spec.dataset_size
        if col is None:
            return {"level": "row", "column": None, "num_units": n, "max_rows_per_unit": None,
                    "description": f"example-level (row-level) DP: one unit = one row of the training set, N = {n:,}"}
        k = self.max_rows_per_unit
        cap = f"; at most {k} random rows of a drawn unit per step" if k else "; every row of a drawn unit enters its step"
        return {"level": "unit", "column": col, "num_units": n, "max_rows_per_unit": k,
                "description": f"unit-level DP (user-level when one value is one person): one unit = all rows with the "
                               f"same '{col}', N = {n:,} units; each unit's summed gradient is clipped to C{cap}"}

    def describe(self) -> dict:
        """The public description ``privacy.json`` and the card state (every number the guarantee rests on): with
        ``banded_sqrt`` also ``correlated_noise`` (b, the coefficients, s, the sampler, the accounting:
        :func:`hf_dp.privacy.banded.describe`)."""
        s = self.spec
        out = {
            "delta": s.delta, "target_epsilon": s.target_epsilon, "accountant": s.accountant,
            "noise_multiplier": s.noise_multiplier, "max_grad_norm": s.max_grad_norm, "sample_rate": s.sample_rate,
            "expected_batch_size": s.expected_batch_size, "dataset_size": s.dataset_size,
            "dataset_size_source": self.dataset_size_source, "neighbouring_relation": self.neighbouring_relation,
            "planned_steps": s.planned_steps, "noise_mechanism": s.noise_mechanism,
        }
        if s.noise_mechanism != banded.INDEPENDENT:
            out["correlated_noise"] = banded.describe(s.noise_bands)
        return out

    def with_target_epsilon(self, epsilon: float | None) -> "Mechanism":
        """The same mechanism stated against another target ε (a private selection's total: :mod:`hf_dp.tuning.search`)."""
        return dataclasses.replace(self, spec=dataclasses.replace(self.spec, target_epsilon=epsilon))
