"""The one-run audit's command-line runs (``python -m hf_dp.audit --one_run``): one DPTrainer run of a tiny BERT
classifier on a synthetic task with ``--audit_canaries`` (:mod:`hf_dp.audit.canaries`) — black-box canaries
(``--canary_kind black-box``) or gradient canaries (``gradient``: ``--audit_kind gradient``) — or of
:mod:`hf_dp.audit.trainer_path`'s linear canary model with one Dirac gradient canary per coordinate (``white-box``),
with a variant's break (``real``, ``no_noise``, ``no_clip``, ... and the partial breaks ``noise_div10``, ``clip_x10``,
``replay_step`` of :func:`partial_break`, which measure the audit's power), and the one-run bound (Steinke et al.)
and the Gaussian-DP estimate (:mod:`hf_dp.audit.fdp`) next to the run's own ε; with ``--noise_bands`` b > 1 the
DPTrainer runs use the b-banded noise (the claim is its accountant's ε; :mod:`hf_dp.audit.banded`). See
``benchmarks/audit.md``."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
from transformers import TrainerCallback

from hf_dp.audit.canary_kinds import SequenceCanaries
from hf_dp.audit.canaries import GRADIENT_SCORE
from hf_dp.audit.fdp import GdpEstimate, gdp_audit_scores, gdp_record
from hf_dp.audit.one_run_bound import OneRunBound, audit_scores, ceiling, record

#: the one-run command line's variants: hf_dp.audit.trainer_path's trainer-path variants that need no schedule, and
#: partial breaks (:func:`partial_break`) that measure the audit's power: σ ÷ 10 in the privatizer, C × 10 in the
#: clipping (the noise stays σ·C), and the first step's batch replayed at the second step (fresh noise)
ONE_RUN_VARIANTS = ("real", "no_noise", "no_clip", "two_rows", "accumulation_changed", "noise_div10", "clip_x10",
                    "replay_step")
PARTIAL_BREAKS = ("noise_div10", "clip_x10", "replay_step")
#: --canary_kind: black-box and gradient run DPTrainer's --audit_canaries (--audit_kind input / gradient) on a tiny BERT
#: classifier; white-box is the trainer path's linear canary model, one coordinate per canary
ONE_RUN_KINDS = ("black-box", "white-box", "gradient")

# ------------------------------------------------------------------------------------------------
# the command line's runs (python -m hf_dp.audit --one_run)
# ------------------------------------------------------------------------------------------------
@dataclass
class OneRunConfig:
    kind: str = "black-box"
    canaries: int = 1000
    variant: str = "real"
    optim: str = "dp_adamw"
    noise_multiplier: float = 10.0  # the claimed σ
    max_grad_norm: float = 0.01
    sample_rate: float = 0.25  # B = round(q·N)
    steps: int = 300
    delta: float = 1e-5  # the run's δ (the claim and the bound)
    alpha: float = 0.05
    accountant: str = "prv"
    hyper: dict = field(default_factory=dict)  # lr (default 1e-2; white-box: B) and rule hyper-parameters
    real_rows: int = 1000  # black-box: the synthetic task's rows (white-box: zero-gradient background rows)
    length: int = 16  # black-box: tokens per real row (the canaries get as many: DPTrainer matches the rows' length)
    vocab_size: int = 32768  # black-box: real rows use tokens [5, 512), canaries the whole vocabulary
    seed: int | None = None  # the synthetic data / model init; the inclusion draw always comes from OS entropy
    progress: bool = False  # black-box / gradient: a line on stderr every tenth of the steps (the command line's runs)
    noise_bands: int = 1  # black-box / gradient: > 1 runs DPTrainer with --noise_mechanism banded_sqrt --noise_bands b

    def check(self) -> None:
        if self.kind not in ONE_RUN_KINDS:
            raise ValueError(f"error: --canary_kind must be one of {', '.join(ONE_RUN_KINDS)}, got {self.kind!r}")
        if self.variant not in ONE_RUN_VARIANTS:
            raise ValueError(f"error: --one_run variant must be one of {', '.join(ONE_RUN_VARIANTS)}, got {self.variant!r}")
        if not (isinstance(self.canaries, int) and self.canaries >= 2):
            raise ValueError(f"error: --canaries must be an integer >= 2, got {self.canaries!r}")
        if not 0 < self.sample_rate <= 1:
            raise ValueError(f"error: --sample_rate must be in (0, 1], got {self.sample_rate}")
        if self.steps < 1:
            raise ValueError(f"error: --steps must be >= 1, got {self.steps}")
        if not 0 <= self.delta < 1:
            raise ValueError(f"error: --delta must be in [0, 1), got {self.delta}")
        if isinstance(self.noise_bands, bool) or not isinstance(self.noise_bands, int) or self.noise_bands < 1:
            raise ValueError(f"error: --noise_bands must be a whole number >= 1, got {self.noise_bands!r}")
        if self.noise_bands > 1:
            if self.kind == "white-box":
                raise ValueError("error: --one_run --canary_kind white-box runs independent noise only; banded noise is "
                                 "audited by --canary_kind black-box or gradient (DPTrainer's --audit_canaries)")
            if self.noise_bands * self.sample_rate > 1:
                raise ValueError(f"error: --noise_bands {self.noise_bands} with --sample_rate {self.sample_rate:g}: "
                                 f"cyclic Poisson sampling draws each unit of the step's partition with probability "
                                 f"b*q = {self.noise_bands * self.sample_rate:g} > 1")
        if self.kind in ("black-box", "gradient"):  # DPTrainer's --audit_canaries limits, before any run
            from hf_dp.audit.canaries import check_canary_count

            if not self.delta > 0:
                raise ValueError(f"error: --one_run {self.kind} runs DPTrainer, which needs --delta > 0")
            try:
                check_canary_count(self.canaries, self.delta, self.alpha)
            except ValueError as e:
                raise ValueError(f"error: {e}".replace("--audit_canaries", "--canaries")) from None


@dataclass
class OneRunResult:
    config: OneRunConfig
    bound: OneRunBound
    eps_claimed: float
    ceiling: float
    seconds: float
    info: dict = field(default_factory=dict)  # N, B, q, steps, sigma of the run; included count
    gdp: GdpEstimate | None = None  # the Gaussian-DP estimate from the same scores (hf_dp.audit.fdp)

    @property
    def eps_lower(self) -> float:
        return self.bound.epsilon_lower

    @property
    def eps_gdp(self) -> float:
        """ε of the Gaussian-DP estimate μ̂ at the run's δ (an estimate under the Gaussian hypothesis)."""
        return self.gdp.epsilon if self.gdp is not None else 0.0

    @property
    def violation(self) -> bool:
        return self.eps_lower > self.eps_claimed

    @property
    def low_power(self) -> bool:
        from hf_dp.audit.stats import POWER_MARGIN

        return self.eps_claimed > self.ceiling - POWER_MARGIN

    def record(self) -> dict:
        kind = self.config.kind
        score = {"black-box": SequenceCanaries.score_name, "gradient": GRADIENT_SCORE}.get(
            kind, "coordinate movement theta_0 - theta_T")
        rec = record(self.bound, "black-box" if kind == "black-box" else "white-box", score)
        if self.gdp is not None:
            rec["gaussian_dp"] = gdp_record(self.gdp)
        return rec


def _synthetic_task(cfg: OneRunConfig, rng):
    """The black-box run's real rows: ``length`` tokens from [5, 512), label 1 iff most of them are below 258."""
    x = rng.integers(5, 512, size=(cfg.real_rows, cfg.length))
    y = (np.mean(x < 258, axis=1) > 0.5).astype(np.int64)
    return x, y


def _tiny_classifier(cfg: OneRunConfig):
    import torch
    from transformers import BertConfig, BertForSequenceClassification

    if cfg.seed is not None:
        torch.manual_seed(cfg.seed)
    conf = BertConfig(vocab_size=cfg.vocab_size, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                      intermediate_size=64, max_position_embeddings=max(64, cfg.length + 2), num_labels=2)
    return BertForSequenceClassification(conf)


def _one_run_args(cfg: OneRunConfig, out: str, batch: int, lr: float):
    from hf_dp import DPTrainingArguments

    from hf_dp.audit.trainer_path import optimizer_flags

    hyper = dict(cfg.hyper)
    hyper.pop("lr", None)
    kw = optimizer_flags(hyper)
    return DPTrainingArguments(
        output_dir=out, optim=cfg.optim, noise_multiplier=cfg.noise_multiplier, delta=cfg.delta,
        per_sample_max_grad_norm=cfg.max_grad_norm, accountant=cfg.accountant, learning_rate=lr,
        lr_scheduler_type="constant", weight_decay=0.0, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, max_steps=cfg.steps, trainable="all", clipping="auto", save_strategy="no",
        report_to=[], use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, logging_strategy="no",
        noise_mechanism="banded_sqrt" if cfg.noise_bands > 1 else "independent", noise_bands=cfg.noise_bands,
        **kw,
    )


def _variant_trainer(cfg: OneRunConfig, model, args, dataset):
    """A DPTrainer with the variant's break (hf_dp.audit.trainer_path's variants, or :func:`partial_break`)."""
    from hf_dp.audit.trainer_path import TrainerAuditConfig, _trainer

    tcfg = TrainerAuditConfig(optim=cfg.optim, variant="real" if cfg.variant in PARTIAL_BREAKS else cfg.variant)
    tr = _trainer(tcfg, model, args, dataset, require_ghost=False)
    brk = partial_break(tr.dp, cfg.variant)
    if brk is not None:
        tr.add_callback(brk)
    return tr


class _ReplayFirst:
    """The trainer's batch sampler with the first step's index list yielded again in place of the second's (the wrapped
    sampler still draws the second, so lengths and RNG use are unchanged)."""

    def __init__(self, inner):
        self.inner = inner

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self):
        from hf_dp.audit.trainer_path import _as_drawn

        first = None
        for i, batch in enumerate(self.inner):
            if i == 0:
                first = list(batch)
            yield _as_drawn(first, batch) if i == 1 else batch  # the replay forged as the second draw

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def divide_noise(opt, factor: float) -> None:
    """The break ``noise_div10``: the privatizer ``opt`` adds N(0, (σ/factor · C)²); σ stays nominal between steps
    (what DPTrainer's checks and the ledger see). Idempotent."""
    if opt is None or getattr(opt, "_audit_noise_divided", False):
        return
    opt._audit_noise_divided = True
    add_noise = opt.add_noise

    def add_less_noise():
        sigma, opt.noise_multiplier = opt.noise_multiplier, opt.noise_multiplier / factor
        try:
            add_noise()
        finally:
            opt.noise_multiplier = sigma

    opt.add_noise = add_less_noise


def partial_break(dp, variant: str):
    """The partial breaks of :data:`PARTIAL_BREAKS` on a built DPTrainer's privacy state ``dp`` (its checks see the
    nominal σ, C and B between steps, as the trainer path's ``no_noise``): ``noise_div10`` — the privatizer adds
    N(0, (σ/10 · C)²) (returns the callback that breaks it when ``train()`` begins, for ``trainer.add_callback``);
    ``clip_x10`` — the engine clips to 10 C (also the gradient canaries it hands on), the noise stays σ·C;
    ``replay_step`` — the first step's batch is used again at the second step, with fresh noise (one step at σ/√2,
    the accountant told two at σ: a break only a very strong audit sees). Other variants: ``dp`` unchanged. Returns
    the callback to add, or ``None``."""
    if variant == "noise_div10":
        from hf_dp.audit.trainer_path import privatizer_break

        return privatizer_break(dp, lambda opt: divide_noise(opt, 10.0))
    elif variant == "clip_x10":
        engine = dp.engine
        before, after = engine.before_backward, engine.after_backward

        def wider(optimizer, run):
            saved, optimizer.max_grad_norm = optimizer.max_grad_norm, 10.0 * optimizer.max_grad_norm
            try:
                return run()
            finally:
                optimizer.max_grad_norm = saved

        engine.before_backward = lambda losses, optimizer, units=None: wider(optimizer, lambda: before(losses, optimizer, units))
        engine.after_backward = lambda optimizer, loss_scale, rows, units=None: wider(
            optimizer, lambda: after(optimizer, loss_scale, rows, units))
    elif variant == "replay_step":
        dp.sampler = _ReplayFirst(dp.sampler)
    return None


def _claim(dp, reported_epsilon: float, cfg: OneRunConfig) -> tuple[float, dict]:
    """The claimed ε (the accountant's, for the run's σ, q and ledger steps at ``cfg.delta``) and the run's numbers, from
    its privacy state ``dp`` and the ε the trainer reports."""
    from hf_dp.privacy.accounting import compute_epsilon

    spec = dp.spec
    info = dict(N=spec.dataset_size, B=spec.expected_batch_size, q=spec.sample_rate, steps=dp.ledger.steps,
                sigma=spec.noise_multiplier, reported_epsilon=reported_epsilon, bands=spec.bands)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        claimed = max(0.0, compute_epsilon(info["sigma"], info["q"], info["steps"], cfg.delta, cfg.accountant,
                                           bands=spec.bands))
    return claimed, info


class _StepProgress(TrainerCallback):
    """Says on stderr how far a run is, every tenth of its steps, with the time it has taken: a --one_run audit under
    load takes minutes per variant."""

    def __init__(self, name: str):
        self.name, self.t0 = name, time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        import sys

        every = max(1, state.max_steps // 10)
        if state.global_step % every == 0 or state.global_step == state.max_steps:
            print(f"  {self.name}: step {state.global_step}/{state.max_steps} "
                  f"({time.perf_counter() - self.t0:.0f} s)", file=sys.stderr, flush=True)


def black_box_run(cfg: OneRunConfig) -> tuple[OneRunBound, float, dict]:
    """One DPTrainer run of a tiny BERT classifier on a synthetic task with ``--audit_canaries cfg.canaries`` (the
    trainer's own canaries: random tokens of the whole vocabulary, random labels, each included with probability ½,
    N = real rows + m whatever the draw; ``cfg.kind`` gradient: ``--audit_kind gradient``, each canary's gradient a
    random direction over the parameters, clipped and noised with its batch) and the variant's break; the trainer
    scores and bounds. Returns (bound, claimed ε, info); ``info["gdp"]``: the Gaussian-DP estimate."""
    import datasets

    rng = np.random.default_rng(cfg.seed)
    x, y = _synthetic_task(cfg, rng)
    real = datasets.Dataset.from_dict({"input_ids": x.tolist(), "attention_mask": np.ones_like(x).tolist(),
                                       "labels": y.tolist()})
    batch = max(1, int(round(cfg.sample_rate * (len(real) + cfg.canaries))))
    lr = float(cfg.hyper.get("lr", 1e-2))
    out = tempfile.mkdtemp(prefix="hf_dp_one_run_")
    try:
        args = _one_run_args(cfg, out, batch, lr)
        args.audit_canaries = cfg.canaries
        args.audit_kind = "gradient" if cfg.kind == "gradient" else "input"
        args.audit_canary_length = int(x.shape[1])  # the synthetic rows' fixed length (no padding collator)
        tr = _variant_trainer(cfg, _tiny_classifier(cfg), args, real)
        tr.dp.audit.beta = cfg.alpha  # the bound's 1 − confidence (hf_dp.audit.canaries.after_train)
        if cfg.progress:
            tr.add_callback(_StepProgress(f"{cfg.optim} {cfg.variant}"))
        tr.train()
        claimed, info = _claim(tr.dp, tr.get_epsilon(), cfg)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    info["included"] = tr.dp.audit.included_rows
    info["clipping"] = tr.dp.clipping
    info["gdp"] = tr.dp.audit.gdp
    return tr.dp.audit.bound, claimed, info


def white_box_run(cfg: OneRunConfig) -> tuple[np.ndarray, np.ndarray, float, dict]:
    """One DPTrainer run of :mod:`hf_dp.audit.trainer_path`'s ``CanaryModel`` (θ ∈ R^m, canary k's gradient clipped to
    C·e_k); canary k included with probability ½; background zero-gradient rows fill in for the excluded canaries so
    that N (hence q = B/N) does not depend on the draw (a zero-gradient row is indistinguishable from an absent one
    for every coordinate). Score: θ_0 − θ_T per coordinate."""
    import torch

    from hf_dp.audit.trainer_path import CanaryDataset, TrainerAuditConfig, _args, _model_classes, _sizes, _trainer

    m = cfg.canaries
    included = np.random.default_rng(secrets.randbits(128)).random(m) < 0.5
    tcfg = TrainerAuditConfig(optim=cfg.optim, variant="real" if cfg.variant in PARTIAL_BREAKS else cfg.variant,
                              noise_multiplier=cfg.noise_multiplier,
                              max_grad_norm=cfg.max_grad_norm, sample_rate=cfg.sample_rate, steps=cfg.steps,
                              delta=cfg.delta, background=max(4, cfg.real_rows), hyper=dict(cfg.hyper),
                              accountant=cfg.accountant, trainer_delta=cfg.delta)
    n, b = _sizes(tcfg, m)  # N >= background + m, B/N = q exactly, whatever the draw
    idx = np.flatnonzero(included)
    dataset = CanaryDataset(n - len(idx), idx)
    _, CanaryModel = _model_classes()
    model = CanaryModel(CanaryModel.config_class(dim=m))
    with torch.no_grad():
        model.score.weight.zero_()
    theta0 = model.score.weight.detach().clone()[0]
    out = tempfile.mkdtemp(prefix="hf_dp_one_run_")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            tr = _trainer(tcfg, model, _args(tcfg, out, b, None), dataset)
            brk = partial_break(tr.dp, cfg.variant)
            if brk is not None:
                tr.add_callback(brk)
            tr.train()
        claimed, info = _claim(tr.dp, tr.get_epsilon(), cfg)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    scores = (theta0 - model.score.weight.detach()[0]).double().numpy()
    info["included"] = int(included.sum())
    info["clipping"] = tr.dp.clipping
    return scores, included, claimed, info


def one_run_audit(cfg: OneRunConfig | None = None, **kwargs) -> OneRunResult:
    """One training run with ``cfg.canaries`` canaries; the bound next to the claimed ε (the accountant's ε for the
    run's own σ, q and steps at ``cfg.delta``) and the :func:`ceiling`."""
    from transformers.utils import logging as hf_logging

    cfg = cfg or OneRunConfig(**kwargs)
    cfg.check()
    t0 = time.perf_counter()
    import logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    own = logging.getLogger("hf_dp")
    level = own.level
    own.setLevel(logging.ERROR)  # the planner's start-of-run block and its noise-dominated warning, once per run
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            if cfg.kind in ("black-box", "gradient"):
                bound, claimed, info = black_box_run(cfg)
                gdp = info.pop("gdp")
            else:
                scores, included, claimed, info = white_box_run(cfg)
                bound = audit_scores(scores, included, cfg.delta, cfg.alpha)
                gdp = gdp_audit_scores(scores, included, cfg.delta, cfg.alpha) if cfg.delta > 0 else None
    finally:
        hf_logging.set_verbosity(verbosity)
        own.setLevel(level)
    return OneRunResult(cfg, bound, claimed, ceiling(cfg.canaries, cfg.delta, cfg.alpha), time.perf_counter() - t0, info,
                        gdp)


def format_table(results: list[OneRunResult]) -> str:
    """One line per run: the bound, its guesses, the claim and the ceiling, the verdict (``T``: ``T/bB`` for a run with
    B-banded noise)."""
    head = (f"{'optimizer':<10} {'kind':<9} {'variant':<13} {'sigma':>6} {'q':>6} {'T':>4} {'m':>5} {'guesses':>7} "
            f"{'correct':>7} {'eps_lower':>9} {'eps_claim':>9} {'ceiling':>7} {'verdict':<10} {'power':<5} {'sec':>6} "
            f"{'eps_gdp':>7} {'gdp':<9}")
    lines = [head, "-" * len(head)]
    for r in results:
        c, b, i = r.config, r.bound, r.info
        bands = i.get("bands", 1)
        steps = f"{i.get('steps', c.steps)}" + (f"/b{bands}" if bands > 1 else "")  # one field (columns split on spaces)
        lines.append(
            f"{c.optim:<10} {c.kind:<9} {c.variant:<13} {i.get('sigma', c.noise_multiplier):>6.3g} {i.get('q', c.sample_rate):>6.3g} "
            f"{steps:>4} {b.canaries:>5d} {b.guesses:>7d} {b.correct:>7d} {b.epsilon_lower:>9.3f} "
            f"{r.eps_claimed:>9.3f} {r.ceiling:>7.3f} {'VIOLATION' if r.violation else 'ok':<10} "
            f"{'LOW' if r.low_power else 'ok':<5} {r.seconds:>6.1f} {r.eps_gdp:>7.3f} "
            f"{'-' if r.gdp is None else 'VIOLATION' if r.eps_gdp > r.eps_claimed else 'ok':<9}"
        )
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# the command line (python -m hf_dp.audit --one_run)
# ------------------------------------------------------------------------------------------------
def one_run_config(a) -> list:
    """The :class:`hf_dp.audit.one_run.OneRunConfig` of each (optimizer, variant) of a parsed ``--one_run`` command."""
    from hf_dp.audit.stats import parse_hyper

    black = a.canary_kind == "black-box"
    optim = a.optim or ("dp_adamw" if black else "dp_sgd")  # gradient canaries: any rule without a per-sample map
    out = []
    for name in optim.split(","):
        for v in a.variant.split(","):
            out.append(OneRunConfig(
                kind=a.canary_kind, canaries=a.canaries, variant=v, optim=name, noise_multiplier=a.noise_multiplier,
                max_grad_norm=(0.01 if black else 1.0) if a.max_grad_norm is None else a.max_grad_norm,
                sample_rate=a.sample_rate, steps=a.steps, delta=a.delta, alpha=a.alpha, accountant=a.accountant,
                hyper=parse_hyper(a.hyper), real_rows=1000 if a.background is None else a.background, seed=a.seed,
                noise_bands=a.noise_bands,
            ))
    return out


def main_one_run(a) -> int:
    """``python -m hf_dp.audit --one_run`` (:func:`hf_dp.audit.many_runs.main` hands it the parsed arguments): every
    configuration checked first (one ``error:`` line, exit status 2), then one run each, a table line per run."""
    import sys

    from hf_dp.audit.stats import POWER_MARGIN

    results = []
    configs = one_run_config(a)
    try:
        for cfg in configs:  # every configuration checked before the first run
            cfg.check()
    except ValueError as e:
        print(e, file=sys.stderr)
        return 2
    for i, cfg in enumerate(configs, 1):  # each run takes seconds to minutes: say which one is running
        print(f"one-run audit {i}/{len(configs)}: {cfg.optim} {cfg.variant}, {cfg.canaries} {cfg.kind} canaries"
              + (f", {cfg.steps} steps ..." if cfg.kind != "white-box" else " ..."), file=sys.stderr, flush=True)
        cfg.progress = cfg.kind != "white-box"
        r = one_run_audit(cfg)
        results.append(r)
        if r.low_power:
            print(f"warning: the claimed epsilon {r.eps_claimed:.3f} is above or within {POWER_MARGIN:g} of the ceiling "
                  f"{r.ceiling:.3f} that {cfg.canaries} canaries can certify at delta={cfg.delta:g}; this audit (almost) "
                  "cannot report a violation. Lower the claim (raise --noise_multiplier) or use more --canaries.",
                  file=sys.stderr, flush=True)
        table = format_table(results)
        print(table.splitlines()[-1] if len(results) > 1 else table, flush=True)
    conf = 100 * (1 - a.alpha)
    print(
        f"\neps_lower: {conf:g}% one-run lower bound on epsilon at delta={a.delta:g} (Steinke, Nasr, Jagielski 2023) from "
        f"{a.canaries} {a.canary_kind} canaries, each included with probability 1/2, guessed from the final model "
        f"(five guess sets, Bonferroni); eps_claim: {a.accountant.upper()} accountant for the run's sigma, q and steps"
        f"{f' (and its {a.noise_bands} bands)' if a.noise_bands > 1 else ''}; "
        "ceiling: the bound if every guess is right. A lower bound that can expose a bug, never a proof of privacy."
    )
    return 1 if any(r.violation and r.config.variant == "real" for r in results) else 0
