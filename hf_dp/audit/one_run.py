"""The one-run audit's command-line runs (``python -m hf_dp.audit --one_run``): one DPTrainer run of a tiny BERT
classifier on a synthetic task with black-box canaries (through ``--audit_canaries``, :mod:`hf_dp.audit.canaries`), or
of :mod:`hf_dp.audit.trainer_path`'s linear canary model with white-box (gradient) canaries, with a variant's break
(``real``, ``no_noise``, ``no_clip``, ...), and the one-run bound next to the run's own ε. See ``benchmarks/audit.md``."""

from __future__ import annotations

import secrets
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import numpy as np

from hf_dp.audit.canaries import KINDS, OneRunBound, SequenceCanaries, audit_scores, ceiling, record

#: the one-run command line's variants (hf_dp.audit.trainer_path's trainer-path variants that need no schedule)
ONE_RUN_VARIANTS = ("real", "no_noise", "no_clip", "two_rows", "accumulation_changed")

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

    def check(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"error: --canary_kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
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
        if self.kind == "black-box":  # DPTrainer's --audit_canaries limits, before any run
            from hf_dp.audit.canaries import check_canary_count

            if not self.delta > 0:
                raise ValueError("error: --one_run black-box runs DPTrainer, which needs --delta > 0")
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

    @property
    def eps_lower(self) -> float:
        return self.bound.epsilon_lower

    @property
    def violation(self) -> bool:
        return self.eps_lower > self.eps_claimed

    @property
    def low_power(self) -> bool:
        from hf_dp.audit.stats import POWER_MARGIN

        return self.eps_claimed > self.ceiling - POWER_MARGIN

    def record(self) -> dict:
        return record(self.bound, self.config.kind, SequenceCanaries.score_name if self.config.kind == "black-box"
                      else "coordinate movement theta_0 - theta_T")


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
        **kw,
    )


def _variant_trainer(cfg: OneRunConfig, model, args, dataset):
    """A DPTrainer with the variant's break (hf_dp.audit.trainer_path's variants)."""
    from hf_dp.audit.trainer_path import TrainerAuditConfig, _trainer

    tcfg = TrainerAuditConfig(optim=cfg.optim, variant=cfg.variant)
    return _trainer(tcfg, model, args, dataset, require_ghost=False)


def _claim(trainer, cfg: OneRunConfig) -> tuple[float, dict]:
    from hf_dp.privacy.accounting import compute_epsilon

    spec = trainer.privacy_spec
    info = dict(N=spec.dataset_size, B=spec.expected_batch_size, q=spec.sample_rate, steps=trainer.ledger.steps,
                sigma=spec.noise_multiplier, reported_epsilon=trainer.get_epsilon())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        claimed = max(0.0, compute_epsilon(info["sigma"], info["q"], info["steps"], cfg.delta, cfg.accountant))
    return claimed, info


def black_box_run(cfg: OneRunConfig) -> tuple[OneRunBound, float, dict]:
    """One DPTrainer run of a tiny BERT classifier on a synthetic task with ``--audit_canaries cfg.canaries`` (the
    trainer's own black-box canaries: random tokens of the whole vocabulary, random labels, each included with
    probability ½, N = real rows + m whatever the draw) and the variant's break; the trainer scores and bounds.
    Returns (bound, claimed ε, info)."""
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
        args.audit_canary_length = int(x.shape[1])  # the synthetic rows' fixed length (no padding collator)
        tr = _variant_trainer(cfg, _tiny_classifier(cfg), args, real)
        tr.audit_beta = cfg.alpha
        tr.train()
        claimed, info = _claim(tr, cfg)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    info["included"] = tr._audit.included_rows
    info["clipping"] = tr.clipping
    return tr._audit.bound, claimed, info


def white_box_run(cfg: OneRunConfig) -> tuple[np.ndarray, np.ndarray, float, dict]:
    """One DPTrainer run of :mod:`hf_dp.audit.trainer_path`'s ``CanaryModel`` (θ ∈ R^m, canary k's gradient clipped to
    C·e_k); canary k included with probability ½; background zero-gradient rows fill in for the excluded canaries so
    that N (hence q = B/N) does not depend on the draw (a zero-gradient row is indistinguishable from an absent one
    for every coordinate). Score: θ_0 − θ_T per coordinate."""
    import torch

    from hf_dp.audit.trainer_path import CanaryDataset, TrainerAuditConfig, _args, _model_classes, _sizes, _trainer

    m = cfg.canaries
    included = np.random.default_rng(secrets.randbits(128)).random(m) < 0.5
    tcfg = TrainerAuditConfig(optim=cfg.optim, variant=cfg.variant, noise_multiplier=cfg.noise_multiplier,
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
            tr.train()
        claimed, info = _claim(tr, cfg)
    finally:
        shutil.rmtree(out, ignore_errors=True)
    scores = (theta0 - model.score.weight.detach()[0]).double().numpy()
    info["included"] = int(included.sum())
    info["clipping"] = tr.clipping
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
            if cfg.kind == "black-box":
                bound, claimed, info = black_box_run(cfg)
            else:
                scores, included, claimed, info = white_box_run(cfg)
                bound = audit_scores(scores, included, cfg.delta, cfg.alpha)
    finally:
        hf_logging.set_verbosity(verbosity)
        own.setLevel(level)
    return OneRunResult(cfg, bound, claimed, ceiling(cfg.canaries, cfg.delta, cfg.alpha), time.perf_counter() - t0, info)


def format_table(results: list[OneRunResult]) -> str:
    """One line per run: the bound, its guesses, the claim and the ceiling, the verdict."""
    head = (f"{'optimizer':<10} {'kind':<9} {'variant':<13} {'sigma':>6} {'q':>6} {'T':>4} {'m':>5} {'guesses':>7} "
            f"{'correct':>7} {'eps_lower':>9} {'eps_claim':>9} {'ceiling':>7} {'verdict':<10} {'power':<5} {'sec':>6}")
    lines = [head, "-" * len(head)]
    for r in results:
        c, b, i = r.config, r.bound, r.info
        lines.append(
            f"{c.optim:<10} {c.kind:<9} {c.variant:<13} {i.get('sigma', c.noise_multiplier):>6.3g} {i.get('q', c.sample_rate):>6.3g} "
            f"{i.get('steps', c.steps):>4d} {b.canaries:>5d} {b.guesses:>7d} {b.correct:>7d} {b.epsilon_lower:>9.3f} "
            f"{r.eps_claimed:>9.3f} {r.ceiling:>7.3f} {'VIOLATION' if r.violation else 'ok':<10} "
            f"{'LOW' if r.low_power else 'ok':<5} {r.seconds:>6.1f}"
        )
    return "\n".join(lines)
