"""Privacy accounting: a thin, checked layer over Opacus' accountants.

hf_dp does not implement any privacy accountant itself. ε is computed by Opacus'
``PRVAccountant`` (default; Gopi et al. 2021, numerically tight with an upper bound on ε)
or ``RDPAccountant`` (Mironov et al., looser), for the Poisson-subsampled Gaussian mechanism
with sampling rate ``q``, noise multiplier ``σ`` and a number of steps.

The mechanism these accountants analyse is exactly what :mod:`hf_dp.privacy.sampler` and
:mod:`hf_dp.privacy.privatizer` do: every example is included in a step independently with
probability ``q``; the sum of its clipped gradient (norm ≤ C) over the batch receives
``N(0, σ²C²)`` once. The unit of privacy is one training example (add/remove adjacency).

Under ``--noise_mechanism banded_sqrt --noise_bands b`` (correlated noise with cyclic Poisson sampling,
:mod:`hf_dp.privacy.banded`) every ε and σ goes through one function,
:func:`hf_dp.privacy.banded.dp_sgd_equivalent`: T noisy steps are exactly as private as ⌈T/b⌉ rounds of the same
accountant's mechanism at rate min(1, b·q) and the same σ (b = 1: q and T unchanged). The ledger keeps counting noisy
steps; its accountant history holds each run's equivalent rounds.
"""

from __future__ import annotations

import contextlib
import functools
import math
import warnings
from dataclasses import dataclass

from .banded import BANDED_SQRT, INDEPENDENT, check_noise_mechanism, dp_sgd_equivalent, effective_bands  # noqa: F401

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
    noise_multiplier: float, sample_rate: float, steps: int, delta: float, accountant: str = "prv", bands: int = 1
) -> float:
    """ε after ``steps`` Poisson-subsampled Gaussian steps (σ, q) at δ, by the chosen Opacus accountant; with
    ``bands`` = b > 1, after ``steps`` steps of the b-banded mechanism with cyclic Poisson sampling, i.e. of its DP-SGD
    equivalent (:func:`hf_dp.privacy.banded.dp_sgd_equivalent`: rate min(1, b·q), ⌈steps/b⌉ rounds)."""
    if steps <= 0:
        return 0.0
    if noise_multiplier <= 0:
        return math.inf
    sample_rate, steps = dp_sgd_equivalent(sample_rate, steps, bands)
    acc = make_accountant(accountant)
    acc.history = [(float(noise_multiplier), float(sample_rate), int(steps))]
    with _quiet(accountant):
        return float(acc.get_epsilon(delta=delta))


@functools.lru_cache(maxsize=1024)
def composed_epsilon(history: tuple, delta: float, accountant: str = "prv") -> float:
    """ε of a heterogeneous history ``((σ, q, steps), ...)`` at δ: Opacus' accountants compose the entries (PRV by
    composing the privacy random variables, RDP by adding the Rényi divergences)."""
    history = canonical_history(history)
    if not history:
        return 0.0
    if any(s <= 0 for s, _, _ in history):
        return math.inf
    if len({(s, q) for s, q, _ in history}) == 1:
        s, q, _ = history[0]
        return compute_epsilon(s, q, sum(n for _, _, n in history), delta, accountant)
    acc = make_accountant(accountant)
    acc.history = list(history)
    with _quiet(accountant):
        return float(acc.get_epsilon(delta=delta))


def canonical_history(history) -> tuple:
    """``((σ, q, steps), ...)`` with the entries of equal (σ, q) merged and sorted (composition does not depend on
    the order): the same ε, bit for bit, however runs split and order the same steps."""
    merged: dict[tuple[float, float], int] = {}
    for s, q, n in history:
        if int(n) > 0:
            key = (float(s), float(q))
            merged[key] = merged.get(key, 0) + int(n)
    return tuple((s, q, n) for (s, q), n in sorted(merged.items()))


def _steps_of(history) -> int:
    return sum(int(n) for _, _, n in history)


@functools.lru_cache(maxsize=256)
def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    accountant: str = "prv",
    epsilon_tolerance: float = 0.01,
    bands: int = 1,
) -> float:
    """Smallest σ (to a bisection tolerance) such that ε(σ, q, steps, δ) ≤ target_epsilon; with ``bands`` = b > 1, for
    the b-banded mechanism, i.e. calibrated on its DP-SGD equivalent (:func:`hf_dp.privacy.banded.dp_sgd_equivalent`).

    Uses Opacus' ``get_noise_multiplier``; the result is re-checked with :func:`compute_epsilon`
    and nudged up if needed so that the planned run never exceeds the target.
    """
    from opacus.accountants.utils import get_noise_multiplier

    check_epsilon(target_epsilon)
    check_sample_rate(sample_rate)
    if steps <= 0:
        raise ValueError(f"the number of steps must be positive, got {steps}")
    if int(bands) != 1:  # the equivalent DP-SGD mechanism's σ (the same σ, re-checked there)
        rate, rounds = dp_sgd_equivalent(sample_rate, steps, bands)
        return calibrate_noise_multiplier(target_epsilon, delta, rate, rounds, accountant, epsilon_tolerance)
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
    #: ``--noise_mechanism`` (:data:`hf_dp.privacy.banded.NOISE_MECHANISMS`) and ``--noise_bands``
    noise_mechanism: str = INDEPENDENT
    noise_bands: int = 1

    @property
    def bands(self) -> int:
        """The b of the sampler and the accountant (1 for independent noise)."""
        return effective_bands(self.noise_mechanism, self.noise_bands)

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class PrivacyLedger:
    """The ε ledger of one training run: an Opacus accountant plus the spec it accounts for.

    ``record_step()`` is called by the privatizer exactly once per noisy step (rank 0 and all
    other ranks alike, so every rank reports the same ε). The history round-trips through
    ``state_dict``/``load_state_dict`` so that ε continues across resumes.

    **Earlier runs** (``prior``): the runs that trained the same model on the same data before this one (see
    :mod:`hf_dp.run.lineage`), each a dict with its own ``history`` ``[(σ, q, steps), ...]``. The accountant's history is
    their histories followed by this run's steps, so ``steps`` and ε count them; ``own_steps`` are this run's.
    ``meta`` holds public facts about the lineage (parent checkpoint, runs accounted separately), saved with the state.

    **A banded run** (``spec.bands`` = b > 1, :mod:`hf_dp.privacy.banded`): ``steps`` and ``own_steps`` still count
    noisy steps, while the accountant's history holds the run's DP-SGD equivalent (σ, min(1, b·q), ⌈own steps/b⌉)
    (:func:`hf_dp.privacy.banded.dp_sgd_equivalent`), and its public entry (:meth:`own_run`) names the mechanism and
    keeps its noisy steps beside that history (:func:`run_steps`).
    """

    def __init__(self, spec: PrivacySpec):
        self.spec = spec
        self.accountant = make_accountant(spec.accountant)
        self._cache: tuple[int, float] | None = None
        self.prior: list[dict] = []
        self.meta: dict = {}
        self._own = 0  # this run's noisy steps

    @property
    def steps(self) -> int:
        """Every noisy step this ledger counts (earlier runs' included)."""
        return self.prior_steps + self._own

    @property
    def prior_steps(self) -> int:
        return sum(run_steps(run) for run in self.prior)

    @property
    def own_steps(self) -> int:
        """The steps of this run (for a resumed run: the checkpoint's and those counted past it, too)."""
        return self._own

    def _own_history(self, own: int) -> list[tuple]:
        """This run's entry of the accountant's history for ``own`` noisy steps: (σ, q, own), or a banded run's
        DP-SGD equivalent (σ, min(1, b·q), ⌈own/b⌉)."""
        if own <= 0:
            return []
        q, n = dp_sgd_equivalent(float(self.spec.sample_rate), int(own), self.spec.bands)
        return [(float(self.spec.noise_multiplier), float(q), int(n))]

    def _set_own(self, own: int) -> None:
        self._own = int(own)
        self.accountant.history = self.prior_history() + self._own_history(self._own)
        self._cache = None

    def prior_history(self) -> list[tuple]:
        return [(float(s), float(q), int(n)) for run in self.prior for s, q, n in run["history"] if int(n) > 0]

    def set_prior(self, runs: list[dict]) -> None:
        """Start (or re-start) the ledger from earlier runs: the accountant's history becomes theirs followed by
        this run's own steps (at this run's σ and q)."""
        self.prior = [dict(run, history=[[float(s), float(q), int(n)] for s, q, n in run["history"]]) for run in runs]
        self._set_own(self._own)

    def record_step(self) -> None:
        self._own += 1
        if self.spec.bands == 1:  # Opacus' own step (merged into the last entry of equal σ and q)
            self.accountant.step(noise_multiplier=self.spec.noise_multiplier, sample_rate=self.spec.sample_rate)
            self._cache = None
        else:
            self._set_own(self._own)

    def add_steps(self, count: int) -> None:
        """Record ``count`` noisy steps at once (steps an interrupted run took past the checkpoint resumed from)."""
        if count <= 0:
            return
        self._own += int(count)
        if self.spec.bands != 1:
            self._set_own(self._own)
            return
        sigma, q = float(self.spec.noise_multiplier), float(self.spec.sample_rate)
        history = self.accountant.history
        if history and tuple(history[-1][:2]) == (sigma, q):  # merged as Opacus' own step() merges
            history[-1] = (sigma, q, int(history[-1][2]) + int(count))
        else:
            history.append((sigma, q, int(count)))
        self._cache = None

    def epsilon_after(self, steps: int) -> float:
        """ε once the ledger counts ``steps`` noisy steps in all (earlier runs' included), this run's at its σ and q
        (a banded run's: its DP-SGD equivalent)."""
        spec = self.spec
        if not self.prior:
            return compute_epsilon(spec.noise_multiplier, spec.sample_rate, steps, spec.delta, spec.accountant, spec.bands)
        own = max(0, int(steps) - self.prior_steps)
        history = tuple(self.prior_history()) + tuple(self._own_history(own))
        return composed_epsilon(history, spec.delta, spec.accountant)

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
                eps = composed_epsilon(canonical_history(self.accountant.history), self.spec.delta, self.spec.accountant)
            self._cache = (steps, eps)
        return self._cache[1]

    # ----- the public record of the ledger (privacy.json's "ledger", config.json's hf_dp_privacy) ----------
    def own_run(self) -> dict:
        """This run's entry: its own steps (for a resumed run, the checkpoint's and those counted past it too)."""
        spec, own = self.spec, self.own_steps
        banded = {"noise_mechanism": spec.noise_mechanism, "noise_bands": spec.noise_bands} if spec.bands > 1 else {}
        return {
            "run_id": self.meta.get("run_id"), "steps": own,
            # a banded run's history is its DP-SGD equivalent (σ, min(1, b·q), ⌈steps/b⌉): what composes with other runs
            "history": [list(h) for h in self._own_history(own)],
            "noise_multiplier": spec.noise_multiplier, "sample_rate": spec.sample_rate, "dataset_size": spec.dataset_size,
            "delta": spec.delta, "accountant": spec.accountant, "parent": self.meta.get("parent"),
            "privacy_unit": self.meta.get("privacy_unit"), **banded,
        }

    def runs(self) -> list[dict]:
        """The runs this ledger counts: the earlier ones, then this one."""
        return [dict(r) for r in self.prior] + [self.own_run()]

    def public_record(self) -> dict:
        """Numbers and run ids only — no fingerprint of the data, no path: the runs counted, the runs accounted
        separately, the parent checkpoint's run and step (and its ancestors'), the steps counted past the parent."""
        meta = self.meta
        selection = meta.get("hyperparameter_selection")
        return {
            "format": 1,
            # a model released by private selection: its epsilon is the selection's total (the trial's own ledger
            # alone, under "trial_epsilon", is not what the model cost)
            "epsilon": float(selection["total_epsilon"]) if selection else self.cached_epsilon(),
            **({"trial_epsilon": self.cached_epsilon()} if selection else {}),
            "delta": self.spec.delta,
            "accountant": self.spec.accountant,
            "steps": self.steps,
            "history": [list(h) for h in canonical_history(self.accountant.history)],
            "runs": [public_run(r) for r in self.runs()],
            "separate": [public_run(r) for r in meta.get("separate") or []],
            "parent": meta.get("parent"),
            "ancestry": [{"run_id": a.get("run_id"), "global_step": a.get("global_step")} for a in meta.get("ancestry") or []],
            "counted_past_parent": meta.get("counted_past_parent"),
            # the model was also trained without DP (--disable_dp after a DP run: hf_dp.run.lineage.mark_non_private)
            **({"trained_without_dp_after": True} if meta.get("trained_without_dp_after") else {}),
            # a model released by private selection (hf_dp.tuning.search): the total, which no (σ, q, steps) history holds
            **({"hyperparameter_selection": dict(meta["hyperparameter_selection"])}
               if meta.get("hyperparameter_selection") else {}),
        }

    def state_dict(self) -> dict:
        state = {"spec": self.spec.as_dict(), "history": [tuple(h) for h in self.accountant.history],
                 "own_steps": self._own}
        if self.prior or self.meta:
            state["prior"] = [dict(run) for run in self.prior]
            state["meta"] = dict(self.meta)
        return state

    def load_state_dict(self, state: dict) -> None:
        saved = dict(state["spec"])
        saved.setdefault("noise_mechanism", INDEPENDENT)  # a checkpoint of an hf_dp before correlated noise
        saved.setdefault("noise_bands", 1)
        changed = [
            k
            for k in ("noise_multiplier", "max_grad_norm", "sample_rate", "expected_batch_size", "dataset_size", "delta",
                      "accountant", "noise_mechanism", "noise_bands")
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
        self.prior = [dict(run) for run in state.get("prior") or []]
        self.meta = dict(state.get("meta") or {})
        own = state.get("own_steps")  # a checkpoint of an hf_dp before it: its history counts the steps themselves
        self._own = int(own) if own is not None else _steps_of(state["history"]) - self.prior_steps
        self._cache = None


def public_run(run: dict) -> dict:
    """A run's public entry: run id, (σ, q, steps) history, δ, accountant, N, parent checkpoint, the privacy unit
    column (``None``: a row); for a banded run also its mechanism and b, its history being the DP-SGD equivalent and
    its ``steps`` the noisy steps (:func:`run_steps`)."""
    keys = ("run_id", "noise_multiplier", "sample_rate", "dataset_size", "delta", "accountant", "parent", "privacy_unit",
            "noise_mechanism", "noise_bands")
    out = {k: run.get(k) for k in keys if k in run}
    out["history"] = [[float(s), float(q), int(n)] for s, q, n in run.get("history") or []]
    out["steps"] = run_steps(out if "steps" not in run else dict(out, steps=run["steps"]))
    return out


def run_steps(run: dict) -> int:
    """The noisy steps of a run's entry: a banded run's recorded ``steps`` (its history holds ⌈steps/b⌉ equivalent
    rounds), else the steps of its (σ, q, steps) history."""
    if run.get("noise_mechanism", INDEPENDENT) == BANDED_SQRT and int(run.get("noise_bands") or 1) > 1:
        if run.get("steps") is None:
            raise ValueError(f"the record of banded run {run.get('run_id')} has no noisy step count")
        return int(run["steps"])
    return _steps_of(run.get("history") or [])


def _same(a, b) -> bool:
    if isinstance(a, float) or isinstance(b, float):
        try:
            return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
        except (TypeError, ValueError):
            return False
    return a == b
