"""The mechanism a DP run plans before its first step: q = B/N, the planned steps, σ (calibrated for ``--epsilon``,
or given), as one :class:`~hf_dp.privacy.accounting.PrivacySpec`.

Everything here is a function of public quantities (N, B, δ, ε or σ, C, the steps); ``DPTrainer`` calls
:func:`plan_mechanism` once, when it is built, and every later check compares against that plan. N is
:func:`public_size`: ``--public_dataset_size`` when declared (the actual count then only changes how many rows each
Poisson draw finds), else the actual count, treated as public — under add/remove adjacency it differs between
neighbouring datasets, so q, σ and T computed from it are not functions of public inputs alone (the record says which:
:data:`DECLARED`, :data:`COUNTED`).
"""

from __future__ import annotations

import math

from .accounting import PrivacySpec, calibrate_noise_multiplier, check_delta, compute_epsilon
from .banded import INDEPENDENT, check_noise_mechanism, cyclic_rate, effective_bands
from .sampler import PoissonBatchSampler

#: where N came from, as ``privacy.json``'s ``dataset_size_source`` says
DECLARED = "declared public (--public_dataset_size)"
COUNTED = "actual count (treated as public)"
#: an actual count this many times the declared size is said to the operator (each draw finds that many more rows)
LARGER_THAN_DECLARED = 2.0


def public_size(declared: int | None, actual: int, extra: int = 0) -> int:
    """The N the mechanism is planned from: the declared public size plus ``extra`` units that are public by
    construction (``--audit_canaries``' m canaries), else the ``actual`` count (which includes them)."""
    return int(declared) + int(extra) if declared is not None else int(actual)


def size_source(declared: int | None) -> str:
    """:data:`DECLARED` or :data:`COUNTED`."""
    return DECLARED if declared is not None else COUNTED


def plan_mechanism(*, n: int, per_device_batch: int, accumulation: int, world_size: int, delta: float,
                   epsilon: float | None, noise_multiplier: float | None, max_grad_norm: float, accountant: str,
                   max_steps: int, num_train_epochs: float, noise_mechanism: str = INDEPENDENT,
                   noise_bands: int = 1) -> tuple[PrivacySpec, int, float]:
    """(spec, steps per epoch, ε of the planned steps) for N = ``n`` examples and the expected logical batch
    B = per_device_batch × accumulation × world_size; refuses in one sentence what cannot be a private run. With
    ``noise_mechanism`` ``banded_sqrt`` and b = ``noise_bands`` (:mod:`hf_dp.privacy.banded`) σ and ε are those of its
    DP-SGD equivalent (rate b·q, which must be ≤ 1, for ⌈T/b⌉ rounds)."""
    b = per_device_batch * accumulation * max(1, world_size)
    if b > n:
        raise ValueError(
            f"the expected logical batch B = per_device_train_batch_size × gradient_accumulation_steps × world_size "
            f"= {b} is larger than the dataset (N = {n}); Poisson sampling needs q = B/N ≤ 1"
        )
    check_delta(delta, n)
    q = b / n
    noise_mechanism, noise_bands = check_noise_mechanism(noise_mechanism, noise_bands)
    bands = effective_bands(noise_mechanism, noise_bands)
    cyclic_rate(q, bands)  # b·q ≤ 1
    steps_per_epoch = PoissonBatchSampler.steps_for_epoch(q)
    planned = max_steps if max_steps > 0 else math.ceil(num_train_epochs * steps_per_epoch)
    if planned <= 0:
        raise ValueError("the run plans no training step (check --num_train_epochs / --max_steps)")
    if epsilon is not None:
        sigma = calibrate_noise_multiplier(epsilon, delta, q, planned, accountant, bands=bands)
    else:
        sigma = float(noise_multiplier)
    spec = PrivacySpec(
        noise_multiplier=sigma, max_grad_norm=float(max_grad_norm), sample_rate=q, expected_batch_size=float(b),
        dataset_size=n, delta=float(delta), accountant=accountant, target_epsilon=epsilon, planned_steps=planned,
        noise_mechanism=noise_mechanism, noise_bands=noise_bands,
    )
    try:
        planned_epsilon = compute_epsilon(sigma, q, planned, delta, accountant, bands)
    except (MemoryError, OverflowError, ValueError, RuntimeError) as e:
        raise ValueError(
            f"the {accountant} accountant cannot evaluate sigma={sigma:g} with q={q:.4g} over {planned} steps "
            f"({type(e).__name__}); such a small noise multiplier gives no meaningful guarantee — raise "
            "--noise_multiplier (or use --accountant rdp)"
        ) from e
    return spec, steps_per_epoch, planned_epsilon
