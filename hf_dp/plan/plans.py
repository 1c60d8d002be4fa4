"""The planner's rows and plans: σ from the accountant for candidate (B, E), the noise figures, the recommendation at
a fixed compute budget, and the start-of-run block every DP run logs (:func:`run_block`). See :mod:`hf_dp.plan` for
the quantities and the objective; the calibrated expectation is :mod:`hf_dp.plan.calibration`."""

from __future__ import annotations

import json
import math
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field

from hf_dp.plan.calibration import (CONSTANT_R_RUN, CONSTANT_R_RUN_ALL, WARN_R_RUN, Expectation, classifier_expectation,
                                    constant_message, fmt_e, noisy_message)
from hf_dp.plan.lm_share import verdict_and_share
from hf_dp.plan.lm_verdict import expected_worse, no_verdict_line, not_calibrated_reason
from hf_dp.plan.noise_line import run_noise_line
from hf_dp.privacy.accounting import (ACCOUNTANTS, calibrate_noise_multiplier, check_delta, check_epsilon, compute_epsilon,
                                      dp_sgd_equivalent)
from hf_dp.privacy.sampler import PoissonBatchSampler

DEFAULT_BATCH_SIZES = (32, 64, 128, 256, 512, 1024, 2048)
DEFAULT_EPOCHS = (1, 3, 10)
MIN_STEPS = 50  # a practical floor on the recommended plan's steps (not derived from the bound; see the docstring)
CACHE_ENV = "HF_DP_PLAN_CACHE"  # a file path, or "0"/"off" to disable the on-disk cache of σ

# ----------------------------------------------------------------------------------------------- rows


def planned_steps(n: int, batch_size: int, epochs: float) -> int:
    """Steps of a run of ``epochs`` epochs at expected batch B: ceil(E · round(N/B)), as :class:`DPTrainer` plans."""
    q = batch_size / n
    return math.ceil(epochs * PoissonBatchSampler.steps_for_epoch(q))


@dataclass(frozen=True)
class PlanRow:
    """One (B, E) candidate: σ from the accountant and the noise figures (units of C; see the module docstring). With
    ``bands`` = b > 1 (banded_sqrt) σ is its DP-SGD equivalent's and the figures those of independent noise at σ."""

    batch_size: int
    epochs: float
    steps: int
    sample_rate: float
    sigma: float
    n: int
    params: int | None = None
    bands: int = 1

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
             params: int | None = None, disk_cache: bool = True, bands: int = 1) -> PlanRow:
    if not 0 < batch_size <= n:
        raise ValueError(f"the logical batch B = {batch_size} must be in [1, N = {n}]")
    steps = planned_steps(n, batch_size, epochs)
    q = batch_size / n
    rate, rounds = dp_sgd_equivalent(q, steps, bands)  # σ of b-banded noise: its DP-SGD equivalent's
    sigma = noise_multiplier(epsilon, delta, rate, rounds, accountant, disk_cache)
    return PlanRow(batch_size=int(batch_size), epochs=float(epochs), steps=steps, sample_rate=q, sigma=sigma, n=int(n),
                   params=int(params) if params else None, bands=int(bands))


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
    bands: int = 1  # --noise_bands of --noise_mechanism banded_sqrt (1: independent noise)

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

    def warnings(self, remedies: bool = True, calibrated: bool = True) -> list[str]:
        """The warnings of the recommended plan: the calibrated expectation (the constant predictor, with what would
        change it — ``remedies``: a few more σ calibrations, one per candidate N or ε; only when ``calibrated``: the
        expectation was measured on sequence classifiers, see :func:`calibrated_for`) and the worst-case noise bound."""
        out = []
        if calibrated and self.choice is not None and self.choice.constant_expected:  # only where it was measured
            out.append(constant_message(self.choice, "even the recommended plan", remedies=self._remedies() if remedies else None))
        if self.choice is not None and self.choice.noisy:
            out.append(noisy_message(self.choice, "even the recommended plan"))
        return out

    def expectation(self, calibrated: bool = True) -> Expectation | None:
        """The sequence classifiers' expectation of the recommended plan (:func:`classifier_expectation`: the
        constant predictor, what the measured runs below the threshold did, or that none is calibrated); None without
        a choice."""
        if self.choice is None:
            return None
        return classifier_expectation(self.choice, calibrated, "the recommended plan")

    def lm_verdict(self, optim: str | None, learning_rate: float | None,
                   schedule: str = "constant") -> tuple[bool | None, str] | None:
        """The causal-LM verdict of the recommended plan (:mod:`hf_dp.plan.lm_verdict`), with the smallest batch of the
        table at the budget epochs that the calibration expects to do better; None without a choice."""
        if self.choice is None:
            return None
        c = self.choice
        fix = lm_batch_fix(c, [r for r in self.rows if r.epochs == c.epochs], optim, learning_rate)
        return verdict_and_share(sigma=c.sigma, batch_size=c.batch_size, params=c.params, steps=c.steps,
                                 learning_rate=learning_rate, optim=optim, who="the recommended plan", batch_fix=fix,
                                 schedule=schedule)

    def _remedies(self) -> dict:
        """The smallest N (×2, ×4, ×8, ×16) at this ε and the smallest ε (×2, ×4, ×8) at this N, both at the chosen B
        and epochs, whose plan has R_run below :data:`CONSTANT_R_RUN`; ``None`` where none of the candidates does."""
        c = self.choice
        out: dict = {"n": None, "epsilon": None, "params": c.max_params}
        for k in (2, 4, 8, 16):
            # δ must stay below 1/N: a larger N at the same δ may need a smaller one
            row = plan_row(k * self.n, self.epsilon, min(self.delta, 0.5 / (k * self.n)), c.batch_size, c.epochs,
                           accountant=self.accountant, params=self.params, bands=self.bands)
            if not row.constant_expected:
                out["n"] = k * self.n
                break
        for k in (2, 4, 8):
            row = plan_row(self.n, k * self.epsilon, self.delta, c.batch_size, c.epochs, accountant=self.accountant,
                           params=self.params, bands=self.bands)
            if not row.constant_expected:
                out["epsilon"] = k * self.epsilon
                break
        return out

    def summary(self) -> str:
        if self.choice is None:
            return "no recommendation: give the number of trainable parameters d (--params) to weigh noise against steps"
        c = self.choice
        return (
            f"recommended at a budget of {fmt_e(self.budget_epochs)} epoch(s) (E·N = {self.budget_epochs * self.n:,.0f} "
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
            "constant_r_run_all": CONSTANT_R_RUN_ALL, "min_steps": self.min_steps, "noise_bands": self.bands,
        }


def _candidates(n: int, batch_sizes) -> list[int]:
    out = sorted({int(b) for b in batch_sizes if 0 < int(b) <= n})
    if not out:
        raise ValueError(f"no candidate logical batch size fits N = {n} (candidates {list(batch_sizes)}); pass smaller ones")
    return out


def make_plan(n: int, epsilon: float, delta: float, *, batch_sizes=DEFAULT_BATCH_SIZES, epochs=DEFAULT_EPOCHS,
              budget_epochs: float | None = None, params: int | None = None, accountant: str = "prv",
              disk_cache: bool = True, min_steps: int = MIN_STEPS, progress=None, bands: int = 1) -> Plan:
    """The (B, E) table, and with ``params`` the B minimising the bound at ``budget_epochs`` (default: max(epochs)).
    ``progress(done, total, row)``, if given, is called after each row is calibrated. ``bands``: σ for
    ``--noise_mechanism banded_sqrt --noise_bands b`` (candidates with b·B > N are left out)."""
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
    cands = _candidates(n, [b for b in batch_sizes if int(bands) * int(b) <= n])  # cyclic Poisson: b·B ≤ N
    rows = []
    for e in epochs:
        for b in cands:
            rows.append(plan_row(n, epsilon, delta, b, e, accountant=accountant, params=params, disk_cache=disk_cache,
                                 bands=bands))
            if progress is not None:
                progress(len(rows), len(epochs) * len(cands), rows[-1])
    plan = Plan(n=n, epsilon=float(epsilon), delta=float(delta), accountant=accountant,
                params=int(params) if params else None, budget_epochs=budget, rows=rows, min_steps=int(min_steps), bands=int(bands))
    if params:
        plan.choice = plan.best_per_epochs()[budget]
    plan.seconds = time.perf_counter() - t0
    return plan


def recommend(n: int, epsilon: float, delta: float, params: int, *, epochs: float = 3.0,
              batch_sizes=DEFAULT_BATCH_SIZES, accountant: str = "prv", disk_cache: bool = True,
              min_steps: int = MIN_STEPS, bands: int = 1) -> Plan:
    """The planner's choice of logical batch B for a compute budget of ``epochs`` epochs over N examples (``bands``:
    for ``--noise_mechanism banded_sqrt --noise_bands b``).

    Returns a :class:`Plan` with ``.batch_size`` (B), ``.epochs``, ``.choice`` (its :class:`PlanRow`),
    ``.summary()``, ``.table()`` and ``.warnings()``. Only the table's own epochs value is evaluated
    (``len(batch_sizes)`` calibrations; σ is memoised on disk, see :data:`CACHE_ENV`).
    """
    return make_plan(n, epsilon, delta, batch_sizes=batch_sizes, epochs=(epochs,), budget_epochs=epochs,
                     params=params, accountant=accountant, disk_cache=disk_cache, min_steps=min_steps, bands=bands)


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


def format_table(rows: list[PlanRow], choice: PlanRow | None = None, best: dict | None = None,
                 min_steps: int = 0) -> str:
    with_d = any(r.params for r in rows)
    head = ["E", "B", "q", "steps", "sigma", "sigma/B", "sigma/sqrt(BN)"]
    if with_d:
        head += ["R_step", "R_epoch", "R_run", "bound", ""]
    lines = [head]
    best_ids = {id(r) for r in (best or {}).values()}
    for r in rows:
        cells = [fmt_e(r.epochs), str(r.batch_size), f"{r.sample_rate:.4g}", str(r.steps), f"{r.sigma:.4f}",
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


_RANK = {"worse": 2, "worse_little_gain": 1, "not_worse": 0}


def lm_batch_fix(own: PlanRow, rows: list[PlanRow], optim: str | None, learning_rate: float | None) -> int | None:
    """The smallest batch among ``rows`` (``own``'s epochs) whose causal-LM verdict (:mod:`hf_dp.plan.lm_verdict`) is
    better than ``own``'s; None if none is, or there is no verdict."""
    if not own.params:
        return None
    mine = expected_worse(own.sigma, own.batch_size, own.params, own.steps, learning_rate, optim)
    if mine not in ("worse", "worse_little_gain"):
        return None
    ok = [r.batch_size for r in rows
          if _RANK.get(expected_worse(r.sigma, r.batch_size, own.params, r.steps, learning_rate, optim), 2) < _RANK[mine]]
    return min(ok) if ok else None


#: the causal-LM verdict's expected result, in a few words (for the summary)
_LM_SUMMARY = {
    "lm_not_worse": "not worse than no fine-tuning (a perplexity at or below the pretrained model's) where there is "
                    "something to gain",
    "lm_worse": "worse than no fine-tuning (a higher perplexity than the pretrained model's)",
    "lm_worse_little_gain": "worse than no fine-tuning on text with as little to gain as SST-2 dev",
}


def _own_row(n: int, batch_size: float, steps: int, sigma: float, params: int | None, bands: int = 1) -> PlanRow:
    spe = PoissonBatchSampler.steps_for_epoch(batch_size / n)
    return PlanRow(batch_size=int(round(batch_size)), epochs=steps / spe, steps=int(steps), sample_rate=batch_size / n,
                   sigma=float(sigma), n=int(n), params=int(params) if params else None, bands=int(bands))


def _expectation(own: PlanRow, *, calibrated: bool, causal_lm: bool, optim: str | None, learning_rate: float | None,
                 batch_fix: int | None = None, batch_size: float | None = None, schedule: str = "constant"
                 ) -> Expectation:  # batch_size: B as given (own holds it rounded); learning_rate: schedule's peak
    if not causal_lm:
        return classifier_expectation(own, calibrated, "this plan")
    uncovered = not_calibrated_reason()
    if uncovered or not own.params:
        line = no_verdict_line(uncovered or "d, the number of trainable parameters, is not known")
        return Expectation("none", line, "none (the causal-LM verdict is calibrated on fine-tuning a pretrained causal LM)",
                           r_run=own.r_run if own.params else None)
    b = own.batch_size if batch_size is None else batch_size
    worse, line = verdict_and_share(sigma=own.sigma, batch_size=b, params=own.params, steps=own.steps,
                                    learning_rate=learning_rate, optim=optim, who="this run", batch_fix=batch_fix,
                                    schedule=schedule)
    if worse is None:
        return Expectation("none", line, "none (no causal-LM verdict for this update rule or without a learning rate)",
                           r_run=own.r_run)
    kind = "lm_" + (expected_worse(own.sigma, b, own.params, own.steps, learning_rate, optim) if worse else "not_worse")
    return Expectation(kind, line, _LM_SUMMARY[kind], r_run=own.r_run, warning=bool(worse))


def run_expectation(*, n: int, batch_size: float, steps: int, sigma: float, params: int | None,
                    calibrated: bool = True, causal_lm: bool = False, optim: str | None = None,
                    learning_rate: float | None = None, schedule: str = "constant") -> Expectation:
    """What :func:`run_block` states the run is expected to end at (issue 53 item 3: always a calibrated expectation,
    or one line saying none is calibrated for this model or task and what the calibration is): the sequence
    classifiers' (:func:`hf_dp.plan.calibration.classifier_expectation`; ``calibrated``: the model is one it covers,
    :func:`hf_dp.plan.calibration.calibrated_for`), or with ``causal_lm`` the causal-LM verdict
    (:mod:`hf_dp.plan.lm_verdict`, inside :func:`hf_dp.plan.lm_verdict.not_calibrated_for` none). Public quantities
    only; no calibration."""
    own = _own_row(n, batch_size, steps, sigma, params)
    return _expectation(own, calibrated=calibrated, causal_lm=causal_lm, optim=optim, learning_rate=learning_rate,
                        batch_size=batch_size, schedule=schedule)


def run_block(*, n: int, batch_size: float, steps: int, sigma: float, delta: float, accountant: str,
              max_grad_norm: float, params: int, epsilon: float | None = None, calibrated: bool = True,
              detail: bool = False, sigma_note: str = "", causal_lm: bool = False,
              optim: str | None = None, learning_rate: float | None = None, bands: int = 1,
              schedule: str = "constant") -> tuple[str, str | None]:
    """The start-of-run block of a DP run and its warning (or None). Costs no calibration: σ is the run's own.

    Inputs are public only: N, the expected logical batch B, the planned steps T, σ, δ, the accountant, C, d (and
    the target ε). Always the expected result (:func:`run_expectation`): as the warning when it is the constant
    predictor (or, for a causal LM, worse than no fine-tuning), else as the block's last line — calibrated, or "no
    calibrated expectation for this model/task: calibrated on …". By default three lines before it: the plan in one
    (N, B, q, T, ε, δ, σ, C, d, R_run), where to see more, the noise mechanism (:mod:`hf_dp.plan.noise_line`);
    ``detail=True``: the noise figures and the table, with rows for other batch sizes already calibrated in this
    process (e.g. by a recipe's :func:`recommend`) for the same (N, ε, δ, accountant). ``sigma_note`` replaces the
    "(σ given)" after the ε of a run whose σ was given (e.g. "per trial (rdp; …)" under a private selection).
    ``causal_lm``: the causal-LM verdict for ``optim`` at the peak ``learning_rate`` of ``schedule`` (HF's
    lr_scheduler_type; :mod:`hf_dp.plan.lm_verdict`): with the warning when the run is expected to end worse than no
    fine-tuning, else as a line of the block; inside :func:`hf_dp.plan.lm_verdict.not_calibrated_for` one line instead.
    ``bands`` = b > 1: ``--noise_mechanism banded_sqrt`` (:class:`PlanRow`; no rows of other batch sizes).
    """
    spe = PoissonBatchSampler.steps_for_epoch(batch_size / n)
    own = _own_row(n, batch_size, steps, sigma, params, bands)
    rows = [own]
    if epsilon is not None and bands == 1:
        for (acc, eps, dl, q, t), s in sorted(_SIGMAS.memory.items(), key=lambda kv: (kv[0][4] * kv[0][3], kv[0][3])):
            b = q * n
            if (acc, eps, dl) == (accountant, float(epsilon), float(delta)) and abs(b - round(b)) < 1e-6 \
                    and (round(b), t) != (own.batch_size, own.steps):
                rows.append(PlanRow(batch_size=int(round(b)), epochs=t / PoissonBatchSampler.steps_for_epoch(q),
                                    steps=int(t), sample_rate=q, sigma=s, n=int(n), params=own.params))
        rows.sort(key=lambda r: (r.epochs, r.batch_size))
    spent = epsilon if epsilon is not None else compute_epsilon(sigma, batch_size / n, steps, delta, accountant, bands)
    target = f"target ε = {epsilon:g}" if epsilon is not None else f"ε = {spent:.3g} {sigma_note or '(σ given)'}"
    if bands > 1:
        target += (f", banded_sqrt noise with b = {bands} (σ of its DP-SGD equivalent: rate b·q, ⌈T/b⌉ rounds; R_run "
                   "and the expectation: independent noise's)")
    more = (f"python -m hf_dp.plan --n {n} " + (f"--epsilon {epsilon:g} " if epsilon is not None else "--epsilon <target> ")
            + f"--delta {delta:g} --params {params} --accountant {accountant}"
            + (f" --noise_bands {bands}" if bands > 1 else "")
            + (f" --causal_lm --optim {optim}" if causal_lm and optim else "")
            + (f" --learning_rate {learning_rate:g}" if causal_lm and learning_rate else "")
            + (f" --lr_scheduler_type {schedule}" if causal_lm and learning_rate and schedule != "constant" else ""))
    # the expected result, always (issue 53 item 3): calibrated, or one line saying none is and what the calibration
    # is — a warning when it is the constant predictor or worse than no fine-tuning, else a line of the block
    same = [r for r in rows if abs(r.epochs - own.epochs) < 1e-9]
    expectation = _expectation(own, calibrated=calibrated, causal_lm=causal_lm, optim=optim,
                               learning_rate=learning_rate, batch_fix=lm_batch_fix(own, same, optim, learning_rate)
                               if causal_lm and params and not not_calibrated_reason() else None, batch_size=batch_size,
                               schedule=schedule)
    warnings = ([expectation.line] if expectation.warning else []) + ([noisy_message(own)] if own.noisy else [])
    verdict = [] if expectation.warning else ["  " + expectation.line]
    if not detail:
        return "\n".join([
            f"hf_dp plan (public quantities only): N = {n:,}, B = {own.batch_size}, T = {own.steps} steps "
            f"({fmt_e(round(own.epochs, 3))} epochs), {target}, δ = {delta:g}, {accountant} → σ = {own.sigma:.4g}; "
            f"C = {max_grad_norm:g}, d = {params:,} trainable; R_run = {own.r_run:.3g}",
            f"  noise figures and table: --log_level debug; other batch sizes / epochs: {more}",
            run_noise_line(n, batch_size, steps, spent, delta, accountant, params, bands), *verdict,
        ]), ("\n".join(warnings) or None)
    lines = [
        f"hf_dp plan (public quantities only: N, B, steps, ε, δ, accountant, C, d): N = {n:,}, B = {own.batch_size}, "
        f"q = {own.sample_rate:.4g}, T = {own.steps} steps ({fmt_e(round(own.epochs, 3))} epochs × {spe}), {target}, "
        f"δ = {delta:g}, {accountant} → σ = {own.sigma:.4g}; C = {max_grad_norm:g}, d = {params:,} trainable",
        f"  noise of the averaged gradient: std σC/B = {own.noise_per_step:.3g}·C per coordinate, norm √d·σC/B = "
        f"{own.r_step:.3g}·C (R_step; the clipped signal's norm is ≤ C); accumulated over an epoch / the run relative to "
        f"the best-case accumulated signal: R_epoch = {own.r_epoch:.3g}, R_run = {own.r_run:.3g} (warning above {WARN_R_RUN:g})",
        format_table(rows, choice=None).replace("\n", "\n  ").join(["  ", ""]),
        f"  other batch sizes / epochs at this budget: {more}",
        run_noise_line(n, batch_size, steps, spent, delta, accountant, params, bands), *verdict,
    ]
    return "\n".join(lines), ("\n".join(warnings) or None)
