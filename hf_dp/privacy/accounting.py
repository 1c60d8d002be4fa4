"""Privacy accounting: a thin, checked layer over Opacus' accountants.

hf_dp does not implement any privacy accountant itself. ε is computed by Opacus'
``PRVAccountant`` (default; Gopi et al. 2021, numerically tight with an upper bound on ε)
or ``RDPAccountant`` (Mironov et al., looser), for the Poisson-subsampled Gaussian mechanism
with sampling rate ``q``, noise multiplier ``σ`` and a number of steps.

The mechanism these accountants analyse is exactly what :mod:`hf_dp.privacy.sampler` and
:mod:`hf_dp.privacy.privatizer` do: every example is included in a step independently with
probability ``q``; the sum of its clipped gradient (norm ≤ C) over the batch receives
``N(0, σ²C²)`` once. The unit of privacy is one training example (add/remove adjacency).
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass

ACCOUNTANTS = ("prv", "rdp")


def _check_accountant(name: str) -> str:
    if name not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {name!r}")
    return name


def check_delta(delta: float, dataset_size: int | None = None) -> float:
    """Validate δ: 0 < δ < 1/N (δ ≥ 1/N permits releasing one whole record)."""
    if delta is None or not isinstance(delta, (int, float)) or math.isnan(delta) or not 0 < delta < 1:
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
    if dataset_size is not None and delta >= 1.0 / dataset_size:
        raise ValueError(
            f"delta={delta:g} is not below 1/N = 1/{dataset_size} = {1.0 / dataset_size:.3g}: such a delta "
            "allows a mechanism that publishes a whole training example; choose delta < 1/N "
            "(1e-5 or smaller is customary)"
        )
    return float(delta)


def check_epsilon(epsilon: float) -> float:
    if epsilon is None or not isinstance(epsilon, (int, float)) or math.isnan(epsilon) or epsilon <= 0 or math.isinf(epsilon):
        raise ValueError(f"epsilon must be a finite number > 0, got {epsilon!r}")
    return float(epsilon)


def check_sample_rate(q: float) -> float:
    if not isinstance(q, (int, float)) or math.isnan(q) or not 0 < q <= 1:
        raise ValueError(
            f"sample rate q = expected logical batch / dataset size must be in (0, 1], got {q!r}; "
            "is the logical batch larger than the dataset?"
        )
    return float(q)


@contextlib.contextmanager
def _quiet(accountant: str):
    """Opacus' PRV accountant sizes its domain with an RDP bound and warns "Optimal order is the largest alpha" about
    that internal bound, which does not affect the PRV ε: silenced for ``prv`` only (for ``rdp`` it is about the ε
    reported, so it stays)."""
    with warnings.catch_warnings():
        if accountant == "prv":
            warnings.filterwarnings("ignore", message="Optimal order is the")
        yield


def make_accountant(name: str = "prv"):
    """A fresh Opacus accountant (``prv`` or ``rdp``)."""
    from opacus.accountants import create_accountant

    return create_accountant(mechanism=_check_accountant(name))


@functools.lru_cache(maxsize=4096)
def compute_epsilon(
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "prv"
) -> float:
    """ε after ``steps`` Poisson-subsampled Gaussian steps (σ, q) at δ, by the chosen Opacus accountant."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    acc = make_accountant(accountant)
    acc.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    with _quiet(accountant):
        return float(acc.get_epsilon(delta=delta))


@functools.lru_cache(maxsize=256)
def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
) -> float:
    """Smallest σ (to a bisection tolerance) such that ε(σ, q, steps, δ) ≤ target_epsilon.

    Uses Opacus' ``get_noise_multiplier``; the result is re-checked with :func:`compute_epsilon`
    and nudged up if needed so that the planned run never exceeds the target.
    """
    from opacus.accountants.utils import get_noise_multiplier

    check_epsilon(target_epsilon)
    check_sample_rate(sample_rate)
    if steps <= 0:
        raise ValueError(f"the number of steps must be positive, got {steps}")
    try:
        with _quiet(accountant):
            sigma = float(
                get_noise_multiplier(
                    target_epsilon=target_epsilon,
                    target_delta=delta,
                    sample_rate=sample_rate,
                    steps=int(steps),
                    accountant=_check_accountant(accountant),
                    epsilon_tolerance=epsilon_tolerance,
                )
            )
    except ValueError as e:  # Opacus says "The privacy budget is too low."
        raise ValueError(
            f"cannot reach epsilon={target_epsilon} at delta={delta:g} with q={sample_rate:.4g} "
            f"over {steps} steps: {e}"
        ) from e
    for _ in range(50):
        if compute_epsilon(sigma, sample_rate, steps, delta, accountant) <= target_epsilon:
            return sigma
        sigma *= 1.001
    raise RuntimeError("noise calibration did not converge")  # pragma: no cover


@dataclass(frozen=True)
class PrivacySpec:
    """The numbers that define the mechanism; checkpoints refuse to resume if any changes."""

    noise_multiplier: float
    max_grad_norm: float
    sample_rate: float
    expected_batch_size: float
    dataset_size: int
    delta: float
    accountant: str = "prv"
    target_epsilon: float | None = None
    planned_steps: int | None = None

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class PrivacyLedger:
    """The ε ledger of one training run: an Opacus accountant plus the spec it accounts for.

    ``record_step()`` is called by the privatizer exactly once per noisy step (rank 0 and all
    other ranks alike, so every rank reports the same ε). The history round-trips through
    ``state_dict``/``load_state_dict`` so that ε continues across resumes.
    """

    def __init__(self, spec: PrivacySpec):
        self.spec = spec
        self.accountant = make_accountant(spec.accountant)
        self._cache: tuple[int, float] | None = None

    @property
    def steps(self) -> int:
        return sum(int(n) for _, _, n in self.accountant.history)

    def record_step(self) -> None:
        self.accountant.step(noise_multiplier=self.spec.noise_multiplier, sample_rate=self.spec.sample_rate)
        self._cache = None

    def add_steps(self, count: int) -> None:
        """Record ``count`` noisy steps at once (steps an interrupted run took past the checkpoint resumed from)."""
        if count <= 0:
            return
        sigma, q = float(self.spec.noise_multiplier), float(self.spec.sample_rate)
        history = self.accountant.history
        if history and tuple(history[-1][:2]) == (sigma, q):  # merged as Opacus' own step() merges
            history[-1] = (sigma, q, int(history[-1][2]) + int(count))
        else:
            history.append((sigma, q, int(count)))
        self._cache = None

    def epsilon_after(self, steps: int) -> float:
        return compute_epsilon(self.spec.noise_multiplier, self.spec.sample_rate, steps, self.spec.delta, self.spec.accountant)

    def cached_epsilon(self) -> float | None:
        """ε for the current step count if already computed (no accountant call), else None."""
        steps = self.steps
        if steps == 0:
            return 0.0
        return self._cache[1] if self._cache is not None and self._cache[0] == steps else None

    def get_epsilon(self) -> float:
        """ε spent so far at the spec's δ (0 before the first step)."""
        steps = self.steps
        if self._cache is None or self._cache[0] != steps:
            if steps == 0:
                eps = 0.0
            else:
                acc = make_accountant(self.spec.accountant)
                acc.history = list(self.accountant.history)
                with _quiet(self.spec.accountant):
                    eps = float(acc.get_epsilon(delta=self.spec.delta))
            self._cache = (steps, eps)
        return self._cache[1]

    def state_dict(self) -> dict:
        return {"spec": self.spec.as_dict(), "history": [tuple(h) for h in self.accountant.history]}

    def load_state_dict(self, state: dict) -> None:
        saved = state["spec"]
        changed = [
            k
            for k in ("noise_multiplier", "max_grad_norm", "sample_rate", "expected_batch_size", "dataset_size", "delta", "accountant")
            if not _same(saved.get(k), getattr(self.spec, k))
        ]
        if changed:
            detail = ", ".join(f"{k}: checkpoint {saved.get(k)!r} vs now {getattr(self.spec, k)!r}" for k in changed)
            raise ValueError(
                "refusing to resume: the privacy settings differ from the checkpoint's "
                f"({detail}); the accountant's history would no longer describe the mechanism. "
                "Resume with the original settings or start a new run."
            )
        self.accountant.history = [tuple(h) for h in state["history"]]
        self._cache = None


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b
