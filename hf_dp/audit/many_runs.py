"""Empirical privacy audit of hf_dp's DP optimizers: a statistical *lower* bound on ε.

What it runs
------------
The real mechanism, on a tiny model: the same :class:`~hf_dp.privacy.sampler.PoissonBatchSampler`,
Opacus per-sample gradients attached with :func:`~hf_dp.clipping.attach_grad_sampler`, the
:class:`~hf_dp.privacy.privatizer.PrivateOptimizer` built by :func:`~hf_dp.optim.make_optimizer`
(clipping, one ``N(0, σ²C²)`` per step, ÷B) and the optimizer's update rule, for ``steps`` steps.
The model is a bias-free ``nn.Linear(K, 1)`` (θ ∈ R^K, θ_0 = 0) with the per-example loss
``ℓ(θ, x) = θ·x``, so an example's per-sample gradient is its feature vector x.

Neighbouring datasets (add/remove adjacency, the unit the accountant uses):

* D  = ``background`` examples with x = 0 (zero gradient: the strongest audit — nothing else
  moves θ; their rows still go through the grad sampler and the clipper);
* D' = D ∪ {canary}, the canary being a *gradient canary*: x = ``canary_scale``·C·u, a gradient
  far outside the clip ball along a fixed direction u (a coordinate axis), so after clipping it
  contributes exactly C·u — the worst case. MacAdam clips ``(g − m̂)/b`` to the unit ball; with
  b_0 = C and ``canary_scale`` ≫ 1 the canary's clip-space vector is again (after clipping)
  exactly the unit vector u, its worst case. With Poisson sampling the canary is in each step's
  batch only with probability q — that is part of the audited mechanism.

With ``micro_batches`` = m > 1 each logical batch is split into m physical micro-batches whose
loss is scaled by 1/m (HF gradient accumulation) and passed through ``accumulate(loss_scale=1/m)``
before one ``step()``, as the trainer does.

One trial = one training run of ``steps`` steps with a fresh noise seed and a fresh sampler seed;
the released output is the final model, and the test statistic is ⟨θ_0 − θ_T, u⟩ (the canary pushes
θ along −u). Trials on D and on D' are drawn in equal numbers.

Batched trials. For the coordinate-wise rules (``dp_sgd``, ``dp_adam``, ``dp_adamw``, ``dp_adambc``,
``dp_adamw_bc``) K trials share one run: trial k owns coordinate k of θ, and its canary (if it is
a D' trial) has x = canary_scale·C·e_k. This is exactly K independent trials of the real code path
because (i) every row's per-sample gradient is supported on its own trial's coordinate, so the
privatizer's joint clipping of a row over *all* parameters is the per-trial clipping; (ii) the
noise is i.i.d. per coordinate; (iii) these update rules act coordinate-wise with public scalars
(lr, betas, eps, γ', Φ=(σC/B)²); (iv) the sampler includes every row independently with
probability q. ``dp_macadam`` (global bound b_t, centring inside the clip) and ``dp_sgd_l2``
(λθ added inside the clip) couple coordinates, so they run one trial per run (K = 1).

The bound
---------
The first 20 % of the trials of each dataset (:data:`~hf_dp.audit.stats.SELECT_FRACTION`) *select* the test —
its thresholds and which events it counts —, the other 80 %, independent of that choice, *evaluate* it. Any (ε, δ)-DP
mechanism (add/remove DP holds in both directions) satisfies, for every event E of the output,
P_D'(E) ≤ e^ε·P_D(E) + δ and P_D(E) ≤ e^ε·P_D'(E) + δ. The selected test is one of

* ``upper``: E = {stat > τ} (the canary's side), heavy under D';
* ``lower``: E = {stat ≤ τ}, heavy under D;
* ``pooled``: both at once — D' trials above τ and D trials at or below τ_l ≤ τ are the *heavy* count H, D trials
  above τ and D' trials at or below τ_l the *light* count L, 2n Bernoulli trials each. Adding the two constraints,
  E[H] ≤ e^ε·E[L] + 2nδ; for a symmetric statistic (the q = 1, T = 1 audit: a Gaussian shift) this doubles the
  evaluation trials.

H and L are bounded by one-sided Clopper–Pearson limits at level 1 − α/2 each (Bonferroni: both hold with
probability ≥ 1 − α, α = 0.05: 95 %; for the pooled counts, sums of Bernoullis with two rates, the binomial limits
stay valid — Hoeffding 1956), hence with probability ≥ 95 %

    ε ≥ ε_lower = max(0, log((H_low − δ)/L_up)).

It is compared with the accountant's ε (:func:`~hf_dp.privacy.accounting.compute_epsilon` with the
*claimed* σ, q, steps, δ). ε_lower > claimed ε means the implementation is not private as claimed
(with 95% confidence); ε_lower ≤ claimed ε is the expected outcome. The audit is not tight: the
accountant bounds the whole transcript (every noisy gradient), the audit sees only θ_T; and with
``trials`` trials per dataset ε_lower cannot exceed about log(trials/2.3) (≈ 6.1 for 1 000 trials,
≈ 9.1 for 20 000) even for a mechanism with no privacy at all (:func:`certifiable_ceiling`, below). At q = 1,
T = 1, σ = 1 (claim 4.39 at δ = 1e-5) the statistic is exactly Gaussian and the best threshold test's bound is
limited by how precisely small rates can be estimated: ≈ 2.1 (0.48·ε) at 20 000 trials with one tail and half of the
trials selecting, ≈ 2.35 with the pooled test, ≈ 2.75 (0.63·ε) at 100 000 trials (``benchmarks/audit.md``).

One-run audit (``--one_run``, :mod:`hf_dp.audit.canaries`): instead of ``--trials`` runs per dataset, one DPTrainer run
with ``--canaries`` m canaries, each included with probability ½, and the bound of Steinke, Nasr & Jagielski (2023)
from the number of inclusions guessed right, with the Gaussian-DP estimate (Mahloujifar et al. 2024,
:mod:`hf_dp.audit.fdp`) beside it: black-box (random-token canaries with random labels in a tiny BERT classifier,
``--canary_kind black-box``), gradient (the same DPTrainer run with ``--audit_kind gradient``: each canary's gradient
a random direction over the parameters, clipped and noised with its batch) or white-box (gradient canaries, one
coordinate each of the trainer path's linear model). Variants ``real``, ``no_noise``, ``no_clip`` (and the trainer
path's ``two_rows``, ``accumulation_changed``) and the partial breaks ``noise_div10``, ``clip_x10``, ``replay_step``
(:func:`hf_dp.audit.one_run.partial_break`), which measure the audit's power; the claim is the run's own ε at
``--delta``. The black-box and gradient runs are DPTrainer's own ``--audit_canaries`` (N = rows + m canaries, q = B/N
whatever the draw).

Broken variants (``variant=``), to check the audit has power: ``no_noise`` (σ = 0 in the
privatizer), ``low_noise`` (σ/10 in the privatizer) and ``no_clip`` (the privatizer's clipping
skipped; noise still σC) — all *claiming* the ε of the nominal σ and C.

Correlated noise (``noise_bands`` = b > 1, ``--noise_bands B``; :mod:`hf_dp.audit.banded`): the privatizer's real
banded square root noise (``noise_mechanism="banded_sqrt"``) with the real cyclic Poisson sampler, every canary in
partition 0 (the worst position the accounting allows), against the accountant's ε for b bands (DP-SGD at rate
min(1, b·q) over ⌈T/b⌉ rounds); b·q must be ≤ 1. The batched trials stay exact (the banded noise is i.i.d. across
coordinates) and the statistic stays the final iterate (valid by post-processing; at b·q = 1 and T ≥ 8b its
signal-to-noise ratio is ≥ 0.92 (b = 2), ≥ 0.85 (b = 4) of the likelihood-ratio test's — why, and what it misses: that
module). Its broken variant
``banded_overstated`` over-states the cancellation: the full square root over the run, accounted as b bands. b = 1 is
the audit above, bit for bit.

The same audit through :class:`~hf_dp.trainer.DPTrainer` itself — HF's dataloader and collator, ghost
clipping, OS-entropy seeds, checkpoint + resume, several ``train()`` calls, and the broken variants
``no_noise``, ``replay_train`` and ``replay_resume`` (batches re-drawn) — is ``--path trainer``
(:mod:`hf_dp.audit.trainer_path`).

Hyper-parameters are the auditor's choice (DP must hold for all of them). By default
(:data:`AUDIT_HYPER`) lr = 1 and, for the Adam family, a large ``eps``/``gamma`` that makes the
step ≈ linear in g̃ (with the tiny default ε0 = 1e-8 every Adam step is ≈ sign(g̃), which throws
away most of the signal over several steps); override with ``hyper={...}`` or ``--hyper k=v``.

Power
-----
Whatever the implementation does, ``trials`` trials per side cannot certify more than
:func:`certifiable_ceiling` (the bound of a mechanism with no privacy at all, classified without a
single error: ≈ log(trials/2.3), 7.46 for 4 000 trials, 9.07 for 20 000). A claimed ε above it, or close
to it, cannot be refuted, so "ok" then says nothing: such rows are flagged (``power`` = ``LOW`` in the
table, :attr:`AuditResult.low_power`, a warning on stderr) when the claim is above ``ceiling −``
:data:`POWER_MARGIN`. Audit at a σ whose claim is well below the ceiling, and check that the broken
variants come out VIOLATION (σ = 1, q = 0.5, T = 5 claims 7.43: at 4 000 trials even ``no_noise`` is
"ok"; σ = 2 claims 2.82 and all three broken variants are caught, ``benchmarks/audit.md``). The one-run audit's
ceiling is the bound when every guess is right (≈ 3.75 for 200 canaries, ≈ 5.3 for 1 000 at δ = 1e-5).

Usage
-----
::

    # recommended: the claim (2.82) is far below the ceiling (7.46); ~20 s per variant on 2 CPU cores
    python -m hf_dp.audit --optim dp_adamw --variant real,no_noise,low_noise,no_clip \
        --noise_multiplier 2.0 --sample_rate 0.5 --steps 5 --trials 4000
    # longer audits, as recorded in benchmarks/audit.md (~30 s per line on 2 loaded CPU cores for
    # the batched rules; dp_sgd_l2 / dp_macadam run one trial per run: ~1000 trials, so claim ≤ ~3)
    python -m hf_dp.audit --optim dp_sgd,dp_adam,dp_adamw,dp_adambc,dp_adamw_bc \
        --variant real,no_noise,low_noise,no_clip --noise_multiplier 1.0 --sample_rate 1.0 --steps 1 \
        --trials 100000 --delta 1e-5
    python -m hf_dp.audit --optim dp_sgd_l2,dp_macadam --variant real,no_clip --noise_multiplier 2.0 \
        --trials 1000 --delta 1e-5
    # correlated noise: the 2-banded square root with cyclic Poisson sampling (claim 3.05, ceiling 9.07), and the
    # cancellation over-stated (VIOLATION); ~15 s per variant at one thread (hf_dp.audit.banded)
    python -m hf_dp.audit --variant real,banded_overstated --noise_bands 2 --sample_rate 0.5 --steps 128 \
        --noise_multiplier 11 --trials 20000
    # through DPTrainer itself (hf_dp.audit.trainer_path): second train() call, checkpoint + resume
    python -m hf_dp.audit --path trainer --variant real,no_noise,replay_train --train_calls 2 \
        --noise_multiplier 0.5 --sample_rate 0.25 --steps 1 --delta 0.05 --trials 100000
    python -m hf_dp.audit --path trainer --variant real,replay_resume --steps 2 --resume_at 1 \
        --noise_multiplier 0.5 --sample_rate 0.25 --delta 0.05 --trials 100000
    # one training run per variant, 200 black-box canaries through DPTrainer --audit_canaries (hf_dp.audit.one_run);
    # seconds per variant on 2 idle CPU cores (1-2 min at load average 7)
    python -m hf_dp.audit --one_run --variant real,no_noise,no_clip --canaries 200 --background 200 --steps 150 \
        --noise_multiplier 10 --sample_rate 0.25
    # the same with gradient canaries (--audit_kind gradient) and the partial breaks; ~1 min per variant
    python -m hf_dp.audit --one_run --canary_kind gradient --variant real,no_noise,noise_div10,clip_x10,replay_step \
        --canaries 200 --background 200 --steps 20 --sample_rate 0.5 --noise_multiplier 5

``--trials`` is the number of runs *per dataset* (D and D'); 20 % of them select the test.
The exit status is 1 if a ``real`` row shows ε_lower > claimed ε (a privacy violation), else 0.

Output columns: ε_lower, the claimed ε, the ceiling, and TPR/FPR of "canary iff the statistic is on the canary's
side of ``thresh``" on the evaluation part (for a ``lower`` test, thresh is its τ and the informative region is the
*low*-FNR end, TPR ≈ 1; a ``pooled`` test also counts the other tail, :class:`~hf_dp.audit.stats.BoundResult`).
"""

from __future__ import annotations

import argparse
import hashlib
import time
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from hf_dp.audit.stats import (  # noqa: F401  (the statistics are part of this module's interface)
    AUDIT_HYPER,
    POWER_MARGIN,
    AuditResult,
    BoundResult,
    certifiable_ceiling,
    clopper_pearson_upper,
    epsilon_from_rates,
    epsilon_lower_bound,
    format_table,
    low_power,
    parse_hyper,
    power_warning,
)

VARIANTS = ("real", "no_noise", "low_noise", "no_clip", "banded_overstated")
#: update rules that act coordinate-wise with public scalars: K trials can share one run
BATCHABLE = ("dp_sgd", "dp_adam", "dp_adamw", "dp_adambc", "dp_adamw_bc")


def _mix(*parts) -> int:
    h = hashlib.sha256(":".join(str(p) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


# ------------------------------------------------------------------------------------------------
# the trials
# ------------------------------------------------------------------------------------------------
@dataclass
class AuditConfig:
    optim: str = "dp_sgd"
    noise_multiplier: float = 1.0  # the claimed (nominal) σ
    max_grad_norm: float = 1.0  # the claimed C
    sample_rate: float = 1.0
    steps: int = 1
    trials: int = 1000  # runs per dataset (D and D')
    delta: float = 1e-5
    variant: str = "real"
    low_noise_factor: float = 10.0
    canary_scale: float = 1e3  # canary gradient norm / C
    background: int = 1  # zero-gradient examples in D
    micro_batches: int = 1  # physical micro-batches per logical step (gradient accumulation)
    expected_batch_size: float = 1.0  # B (a public scale; the same for D and D')
    hyper: dict = field(default_factory=dict)  # overrides AUDIT_HYPER[optim]
    batch_trials: int | None = None  # trials per run; None: 256 if batchable else 1
    accountant: str = "prv"
    alpha: float = 0.05
    seed: int = 0
    dtype: torch.dtype = torch.float64
    noise_bands: int = 1  # b: the banded square root with cyclic Poisson sampling when > 1 (hf_dp.audit.banded)
    noise_mechanism: str | None = None  # None: banded_sqrt when noise_bands > 1, else independent

    def check(self) -> None:
        """Every setting that would fail a trial, before the first: one sentence each (``ValueError``, ``error:``)."""
        from hf_dp.audit import banded

        if self.variant not in VARIANTS:
            raise ValueError(f"error: --variant must be one of {', '.join(VARIANTS)}, got {self.variant!r}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"error: --sample_rate must be in (0, 1], got {self.sample_rate}")
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"error: --steps must be a whole number >= 1, got {self.steps!r}")
        if not self.canary_scale > 1:
            raise ValueError("error: --canary_scale must be > 1 (the canary's gradient must leave the clip ball)")
        banded.check(self)


def _disable_clipping(opt) -> None:
    """Broken variant: the privatizer sums per-sample gradients unclipped (noise still σ·C)."""
    accumulate = opt.accumulate

    def unclipped(loss_scale: float = 1.0) -> int:
        saved = opt.max_grad_norm
        opt.max_grad_norm = float("inf")  # Opacus' clip factor min(1, C/‖g‖) becomes 1
        try:
            return accumulate(loss_scale)
        finally:
            opt.max_grad_norm = saved

    opt.accumulate = unclipped


def _actual_sigma(cfg: AuditConfig) -> float:
    if cfg.variant == "no_noise":
        return 0.0
    if cfg.variant == "low_noise":
        return cfg.noise_multiplier / cfg.low_noise_factor
    return cfg.noise_multiplier


def _one_run(cfg: AuditConfig, model, canaries: np.ndarray, run_seed: int) -> np.ndarray:
    """One training run of the real mechanism on a model with K = len(canaries) coordinates.

    Coordinate k belongs to trial k; it has a canary row iff ``canaries[k]``. Returns ⟨θ_0 − θ_T, e_k⟩.
    """
    from hf_dp.audit.banded import audit_partitions, privatizer_noise, sampler_bands
    from hf_dp.optim import make_optimizer
    from hf_dp.privacy.sampler import PoissonBatchSampler

    K = len(canaries)
    idx = np.flatnonzero(canaries)
    n_rows = cfg.background + len(idx)
    x = torch.zeros(n_rows, K, dtype=cfg.dtype)  # background rows first: x = 0
    x[cfg.background + np.arange(len(idx)), torch.as_tensor(idx)] = cfg.canary_scale * cfg.max_grad_norm
    with torch.no_grad():
        model.weight.zero_()
    theta0 = model.weight.detach().clone()
    hyper = {**AUDIT_HYPER.get(cfg.optim, {}), **cfg.hyper}
    opt = make_optimizer(
        cfg.optim,
        model.parameters(),
        noise_multiplier=_actual_sigma(cfg),
        max_grad_norm=cfg.max_grad_norm,
        expected_batch_size=cfg.expected_batch_size,
        noise_seed=_mix("noise", run_seed),
        noise_mechanism=privatizer_noise(cfg)[0],
        noise_bands=privatizer_noise(cfg)[1],
        **hyper,
    )
    if cfg.variant == "no_clip":
        _disable_clipping(opt)
    if n_rows == 0:
        raise ValueError("the dataset D must not be empty (background >= 1) when a run has no canary")
    m = cfg.micro_batches
    b = sampler_bands(cfg)  # cyclic Poisson sampling, every canary in partition 0 (hf_dp.audit.banded)
    sampler = PoissonBatchSampler(n_rows, cfg.sample_rate, cfg.steps, micro_batches=m, seed=_mix("sampler", run_seed),
                                  bands=b, partitions=audit_partitions(cfg.background, len(idx), b))
    if b > 1:
        opt.sampler = sampler  # the privatizer checks that each step's batch was drawn for its partition
    for i, batch in enumerate(sampler):  # `m` physical micro-batches per logical step, as in the trainer
        if batch:
            # summed per-example losses θ·x_i, scaled by 1/m as HF's gradient accumulation does;
            # the privatizer undoes the scale before clipping (loss_scale), as in the trainer
            (model(x[batch]).sum() / m).backward()
            opt.accumulate(loss_scale=1.0 / m)
        if (i + 1) % m == 0:
            opt.step()  # an empty logical batch still gets its noise
            opt.zero_grad()
    return (theta0 - model.weight.detach())[0].numpy().astype(float)


def run_trials(cfg: AuditConfig) -> tuple[np.ndarray, np.ndarray]:
    """``cfg.trials`` statistics on D and on D' from the real mechanism (see the module docstring)."""
    import warnings

    from hf_dp.clipping import attach_grad_sampler

    cfg.check()
    batchable = cfg.optim in BATCHABLE
    K = cfg.batch_trials or (256 if batchable else 1)
    if K > 1 and not batchable:
        raise ValueError(f"{cfg.optim} couples coordinates; its trials cannot share a run (batch_trials=1)")
    if K > 1 and K % 2:
        K += 1
    stats = {False: [], True: []}
    models: dict[int, nn.Module] = {}
    handles = []
    run = 0
    with warnings.catch_warnings():
        # Opacus' full backward hooks warn when the input (our features) does not require grad
        warnings.filterwarnings("ignore", message="Full backward hook is firing")
        while min(len(stats[False]), len(stats[True])) < cfg.trials:
            need0, need1 = cfg.trials - len(stats[False]), cfg.trials - len(stats[True])
            if K == 1:
                canaries = np.array([need1 > 0 and (need0 <= 0 or run % 2 == 1)])
            else:
                k = min(K, 2 * max(need0, need1))
                k += k % 2
                canaries = np.arange(k) < k // 2
            k = len(canaries)
            if k not in models:  # θ is zeroed at the start of every run
                models[k] = nn.Linear(k, 1, bias=False).to(cfg.dtype)
                handles.append(attach_grad_sampler(models[k]))
            out = _one_run(cfg, models[k], canaries, _mix(cfg.seed, cfg.optim, cfg.variant, run))
            for has, v in zip(canaries, out):
                stats[bool(has)].append(v)
            run += 1
    for h in handles:
        h.detach()
    return np.asarray(stats[False][: cfg.trials]), np.asarray(stats[True][: cfg.trials])


def claimed_epsilon(cfg: AuditConfig) -> float:
    """The accountant's ε for the *nominal* σ (``cfg.noise_multiplier``), q, steps, δ — and b bands with cyclic Poisson
    sampling when ``cfg.noise_bands`` > 1 (:mod:`hf_dp.audit.banded`; ``banded_overstated`` claims the same)."""
    import warnings

    from hf_dp.audit.banded import sampler_bands
    from hf_dp.privacy.accounting import compute_epsilon

    with warnings.catch_warnings():  # Opacus' PRV warns about log(0) when q = 1
        warnings.simplefilter("ignore", RuntimeWarning)
        return compute_epsilon(cfg.noise_multiplier, cfg.sample_rate, cfg.steps, cfg.delta, cfg.accountant,
                               bands=sampler_bands(cfg))


def audit(cfg: AuditConfig | None = None, **kwargs) -> AuditResult:
    """Run the trials and return ε_lower next to the accountant's claimed ε."""
    cfg = cfg or AuditConfig(**kwargs)
    t0 = time.perf_counter()
    s0, s1 = run_trials(cfg)
    bound = epsilon_lower_bound(s0, s1, cfg.delta, cfg.alpha)
    return AuditResult(cfg, bound.eps_lower, claimed_epsilon(cfg), bound, s0, s1, time.perf_counter() - t0)


RECOMMENDED = """recommended (the claim is well below the ceiling; the broken variants come out VIOLATION, see
benchmarks/audit.md):
  python -m hf_dp.audit --optim dp_adamw --variant real,no_noise,low_noise,no_clip \\
      --noise_multiplier 2.0 --sample_rate 0.5 --steps 5 --trials 4000
  python -m hf_dp.audit --variant real,banded_overstated --noise_bands 2 --sample_rate 0.5 --steps 128 \\
      --noise_multiplier 11 --trials 20000
  python -m hf_dp.audit --one_run --variant real,no_noise,no_clip --canaries 200 --background 200 --steps 150 \\
      --noise_multiplier 10 --sample_rate 0.25
  python -m hf_dp.audit --one_run --canary_kind gradient --variant real,no_noise,noise_div10,clip_x10,replay_step \\
      --canaries 200 --background 200 --steps 20 --sample_rate 0.5 --noise_multiplier 5
  python -m hf_dp.audit --path trainer --variant real,no_noise,replay_train --train_calls 2 \\
      --noise_multiplier 0.5 --sample_rate 0.25 --steps 1 --delta 0.05 --trials 100000
  python -m hf_dp.audit --path trainer --variant real,replay_resume --steps 2 --resume_at 1 \\
      --noise_multiplier 0.5 --sample_rate 0.25 --delta 0.05 --trials 100000
A row is flagged power=LOW (and a warning is printed) when the claimed epsilon is above, or within
%g of, the ceiling: the largest eps_lower the trials can certify (a mechanism with no privacy at all,
classified without error). Such an audit cannot report a violation; its 'ok' means little.
Exit status 1 if a 'real' row shows a violation.""" % POWER_MARGIN


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m hf_dp.audit``."""
    p = argparse.ArgumentParser(
        prog="python -m hf_dp.audit", description=__doc__.split("\n\n")[0], epilog=RECOMMENDED,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--one_run", action="store_true",
                   help="one training run through DPTrainer with --canaries canaries, each included with probability "
                        "1/2, and the one-run bound of Steinke, Nasr & Jagielski (2023) (hf_dp.audit.canaries) instead "
                        "of --trials runs per dataset")
    p.add_argument("--canaries", type=int, default=1000, help="--one_run: the number of canaries m")
    p.add_argument("--canary_kind", default="black-box", choices=("black-box", "white-box", "gradient"),
                   help="--one_run: black-box (random-token canaries with random labels, a tiny BERT classifier on a "
                        "synthetic task, scored by their label margin), gradient (the same DPTrainer run with "
                        "--audit_kind gradient: each canary's gradient a random direction, scored by the summed "
                        "privatized gradients) or white-box (one gradient canary per coordinate of the audit's linear "
                        "model, scored by its movement)")
    p.add_argument("--path", default="mechanism", choices=("mechanism", "trainer"),
                   help="mechanism: sampler + privatizer + rule driven directly (hf_dp.audit.many_runs); trainer: every trial "
                        "through DPTrainer (hf_dp.audit.trainer_path)")
    p.add_argument("--optim", default=None,
                   help="optimizer name, comma list, or 'all' (default dp_sgd; --one_run black-box: dp_adamw)")
    p.add_argument("--variant", default="real",
                   help=f"comma list; mechanism: {', '.join(VARIANTS)} (banded_overstated: see --noise_bands); trainer: real, no_noise, no_clip, replay_train, "
                        "replay_resume, two_rows, accumulation_changed; --one_run: real, no_noise, no_clip, two_rows, "
                        "accumulation_changed, noise_div10, clip_x10, replay_step")
    p.add_argument("--noise_multiplier", type=float, default=1.0, help="claimed sigma")
    p.add_argument("--max_grad_norm", type=float, default=None, help="C (default 1; --one_run black-box: 0.01)")
    p.add_argument("--sample_rate", type=float, default=1.0)
    p.add_argument("--steps", type=int, default=1, help="training steps (trainer: max_steps of each train() call)")
    p.add_argument("--trials", type=int, default=2000, help="runs per dataset (D and D')")
    p.add_argument("--delta", type=float, default=1e-5, help="the delta at which the accountant's claim is audited")
    p.add_argument("--alpha", type=float, default=0.05, help="1 - confidence of the bound")
    p.add_argument("--accountant", default="prv", choices=("prv", "rdp"))
    p.add_argument("--canary_scale", type=float, default=1e3, help="mechanism path only")
    p.add_argument("--background", type=int, default=None,
                   help="zero-gradient rows (default 1; trainer: at least 4); --one_run black-box: the synthetic task's "
                        "rows (default 1000), white-box: zero-gradient rows besides the canaries' (default 1000)")
    p.add_argument("--micro_batches", type=int, default=1, help="micro-batches per logical step (mechanism path)")
    p.add_argument("--noise_bands", type=int, default=1,
                   help="b > 1 audits the banded square root noise (--noise_mechanism banded_sqrt "
                        "--noise_bands b) with cyclic Poisson sampling, every canary in partition 0, against the "
                        "accountant's epsilon for it (hf_dp.audit.banded); b*q must be <= 1. The variant "
                        "banded_overstated overstates the noise's cancellation (full square root, accounted as b bands); "
                        "--one_run: DPTrainer's --audit_canaries with --noise_bands b (black-box and gradient canaries)")
    p.add_argument("--batch_trials", type=int, default=None,
                   help="trials per run (1 = no batching; default 256, trainer 8192)")
    p.add_argument("--hyper", action="append", default=[], help="update-rule hyper-parameter key=value")
    p.add_argument("--seed", type=int, default=0,
                   help="mechanism path: every seed; --one_run: the synthetic data, canary tokens and model init (the "
                        "inclusion draw, sampler and noise always come from OS entropy); the trainer path uses OS entropy")
    p.add_argument("--train_calls", type=int, default=1, help="trainer path: train() calls on one trainer")
    p.add_argument("--resume_at", type=int, default=None,
                   help="trainer path: checkpoint at this step, interrupt, resume in a new DPTrainer")
    return p


def main(argv=None) -> int:
    import sys

    from hf_dp.optim import optimizer_names

    a = build_parser().parse_args(argv)
    if a.one_run:
        from hf_dp.audit.one_run import main_one_run

        return main_one_run(a)
    optim = a.optim or "dp_sgd"
    a.max_grad_norm = 1.0 if a.max_grad_norm is None else a.max_grad_norm
    names = list(optimizer_names()) if optim == "all" else optim.split(",")
    variants = a.variant.split(",")
    hyper = parse_hyper(a.hyper)
    configs = []
    for name in names:
        for v in variants:
            if a.path == "trainer":
                from hf_dp.audit.trainer_path import TrainerAuditConfig

                configs.append(TrainerAuditConfig(
                    optim=name, noise_multiplier=a.noise_multiplier, max_grad_norm=a.max_grad_norm,
                    sample_rate=a.sample_rate, steps=a.steps, train_calls=a.train_calls, resume_at=a.resume_at,
                    trials=a.trials, delta=a.delta, variant=v, batch_trials=a.batch_trials or 8192,
                    background=a.background or 4, hyper=hyper, accountant=a.accountant, alpha=a.alpha,
                ))
            else:
                configs.append(AuditConfig(
                    optim=name, noise_multiplier=a.noise_multiplier, max_grad_norm=a.max_grad_norm,
                    sample_rate=a.sample_rate, steps=a.steps, trials=a.trials, delta=a.delta, variant=v,
                    canary_scale=a.canary_scale, background=a.background or 1, micro_batches=a.micro_batches,
                    hyper=hyper, batch_trials=a.batch_trials if (a.batch_trials is None or name in BATCHABLE) else 1,
                    accountant=a.accountant, alpha=a.alpha, seed=a.seed, noise_bands=a.noise_bands,
                ))
    try:  # every configuration checked before the first trial: bad input is one line, not a traceback
        if a.path == "trainer" and a.noise_bands != 1:
            raise ValueError(f"--noise_bands {a.noise_bands} runs on the mechanism path only (the trainer path audits "
                             "independent noise); drop --path trainer")
        for cfg in configs:
            cfg.check()
    except ValueError as e:
        msg = str(e)
        print(msg if msg.startswith("error:") else f"error: {msg}", file=sys.stderr)
        return 2
    results = []
    for cfg in configs:
        if a.path == "trainer":
            from hf_dp.audit.trainer_path import trainer_audit

            result = trainer_audit(cfg)
        else:
            result = audit(cfg)
        results.append(result)
        if result.low_power:
            print(power_warning(result.eps_claimed, cfg.trials, cfg.delta, cfg.alpha), file=sys.stderr, flush=True)
        print(format_table(results[-1:]).splitlines()[-1] if len(results) > 1 else format_table(results), flush=True)
    conf = 100 * (1 - a.alpha)
    what = "the trainer's sigma, q and ledger steps" if a.path == "trainer" else "the nominal sigma, q, steps"
    if a.noise_bands > 1:
        what += (f" of the {a.noise_bands}-banded square root with cyclic Poisson sampling (DP-SGD at rate "
                 f"min(1, {a.noise_bands}*q) over ceil(T/{a.noise_bands}) rounds)")
    print(
        f"\neps_lower: {conf:g}% Clopper-Pearson lower bound on epsilon at delta={a.delta:g} from the final model "
        f"(test chosen on 20% of the trials, counted on the rest); eps_claim: {a.accountant.upper()} "
        f"accountant for {what}; ceiling: the largest eps_lower {a.trials} trials can certify; power LOW: the claim is "
        f"above or within {POWER_MARGIN:g} of the ceiling."
    )
    return 1 if any(r.violation and r.config.variant == "real" for r in results) else 0


if __name__ == "__main__":
    raise SystemExit(main())
