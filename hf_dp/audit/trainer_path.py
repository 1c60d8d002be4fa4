"""The privacy audit through the real trainer path (``python -m hf_dp.audit --path trainer``).

:mod:`hf_dp.audit.many_runs` drives the sampler, the privatizer and the update rule directly. This module runs
each trial through what a user runs: :class:`~hf_dp.trainer.DPTrainer` with
:class:`~hf_dp.arguments.DPTrainingArguments` (``--noise_multiplier``, no ``--dp_seed``: sampler and
noise seeds come from OS entropy in every run), HF's dataloader with ``default_data_collator`` and
hf_dp's empty-batch collator, the default clipping engine (``--clipping auto``, which picks one-backward
ghost clipping here — checked), the Poisson batch sampler and the ``PrivateOptimizer`` built by
``create_optimizer``, ``max_steps`` steps per ``train()`` call, optionally a checkpoint + resume and
several ``train()`` calls on one trainer.

Model and data. ``CanaryModel`` (from ``_model_classes()``) is a ``PreTrainedModel`` regression "sequence classifier"
(``num_labels = 1``, so hf_dp's per-example loss is the squared error) whose only parameter is a
bias-free ``nn.Linear(K, 1)`` θ ∈ R^K, zero at the start (``--trainable all``; the trainer chooses ghost
clipping for it). A row holds ``canary_index`` and ``labels``: row index −1 is a *background* row, input
0, so its gradient is 0; a canary row for trial k has input e_k and label −``CANARY_LABEL`` (−10⁶), so
its gradient 2(θ_k + 10⁶)·e_k is ≈ 2·10⁶ ≫ C along +e_k and is clipped to exactly C·e_k (the worst
case) as long as θ_k > −10⁶. Released output: the final weights; statistic ⟨θ_0 − θ_T, e_k⟩.

K trials per run (exact, as in :mod:`hf_dp.audit.many_runs`): trial k owns coordinate k; half of the
coordinates have a canary row (D' trials), half have none (D trials); the dataset is ``background``
zero rows plus the canary rows. Each trial sees exactly the real mechanism on its pair of neighbouring
datasets because (i) every row's gradient lies on its own coordinate, so the engine's joint per-example
clipping over all of θ is the per-trial clipping; (ii) the privatizer's noise is i.i.d. per coordinate;
(iii) DP-SGD with a constant learning rate and no weight decay (or a DP-Adam-family rule with public
scalars) updates each coordinate from that coordinate alone; (iv) the sampler includes every row
independently with probability q = B/N (the run's N and B; the claimed ε uses that q), and the sum is
divided by the expected batch size B, a public constant — so rows with zero gradient on coordinate k
(background rows, other trials' canaries, the placeholder row of an empty batch, which the trainer
discards) are indistinguishable from absent rows for trial k: its D' is D plus one canary (add/remove
adjacency) at the same q. Replays and resumes act on whole batches, so every trial sees the same
replay structure.

Schedules: ``train_calls`` R ≥ 1 calls of ``train()`` on one trainer, ``steps`` steps each (the ledger
counts R·steps, and that is what the trainer reports); ``resume_at`` k: the first call saves a
checkpoint at step k (``save_steps = k``) and is stopped there (an interruption; its model is not
released), a new DPTrainer resumes with ``train(resume_from_checkpoint=<checkpoint-k>)`` to ``steps``,
and the further calls run on that trainer.

Variants (each claims the ε the trainer itself reports, i.e. the accountant's ε for the nominal σ, q
and the steps in the ledger — evaluated at the audit's δ):

* ``real``: the trainer as is.
* ``no_noise``: σ = 0 in the privatizer (set on the ``PrivateOptimizer`` after ``create_optimizer``).
* ``no_clip``: the clipping engine clips to C = ∞ (the privatizer's ``max_grad_norm`` is set to ∞ while the engine
  computes the clipped sum, and restored before the noise, which stays σ·C): per-example gradients are summed unclipped.
* ``replay_train``: every ``train()`` call after the first is fed the index lists the batch sampler
  yielded in the first call (recorded and substituted by :class:`ReplayBatchSampler`, a wrapper
  around ``trainer.dp.sampler`` that relies only on its public surface). Noise stays fresh.
* ``replay_resume``: after the resume, the first k steps are fed the lists of steps 1…k of the
  interrupted run (the lists HF's resume skips in the current epoch are passed through first).
* ``two_rows``: a collator that emits every drawn row twice (augmented views), with DPTrainer's
  one-row-per-example check (:func:`hf_dp.run.contract.check_rows`) bypassed: a canary moves its coordinate by 2C, the
  true ε is ε(σ/2, q, T).
* ``accumulation_changed``: ``trainer.args.gradient_accumulation_steps = 3`` after the trainer is built, with its
  mechanism check (:func:`hf_dp.run.contract.check_mechanism`) bypassed: every noisy step sums three independent
  Poisson draws at q (a canary can enter a step up to three times), while the accountant is told one draw at q.

Unmodified, DPTrainer refuses the last two before any step (``tests/test_contract.py``); the variants show that the
audit would catch them if the checks were missing.

True ε of a replay (fresh noise, same batches): a batch used r times gives r independent noisy sums
of the same clipped sum, whose mean is sufficient — one Poisson-subsampled Gaussian step with noise
multiplier σ/√r. R calls of T steps with full replay are therefore T steps at σ/√R:
``compute_epsilon(σ/√R, q, T, δ)``, against the claimed ``compute_epsilon(σ, q, R·T, δ)``; see
:func:`replay_epsilon`.

Why δ = 0.05 in the recommended commands: the accountant's claim is a whole curve ε(δ), and a
correct implementation must respect every point of it. At δ = 1e-5 the claims of these settings are
far above what the trials can show even for a replayed sampler (σ = 0.5, q = 0.25, two steps claim
10.8; the ideal test on a replay gives ε_lower ≈ 4.1–4.5 with 2·10⁴ trials, in simulation): the
informative tests would need FPR ≪ 1e-4. At δ = 0.05 the bulk of the distributions is informative, the
honest trainer comes within ≈ 1 of its claim, and a replay exceeds it (``benchmarks/audit.md``). The trainer's own δ
(``--delta`` of the run, which must be < 1/N) is independent of the audit's δ.

Only DP-SGD and the coordinate-wise Adam family can share runs (as in :mod:`hf_dp.audit.many_runs`).
"""

from __future__ import annotations

import functools
import math
import os
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

#: |label| of a canary row: its gradient norm is ≈ 2·CANARY_LABEL ≫ C while |θ_k| ≪ CANARY_LABEL
CANARY_LABEL = 1e6
TRAINER_VARIANTS = ("real", "no_noise", "no_clip", "replay_train", "replay_resume", "two_rows", "accumulation_changed")
#: rules whose trials can share a run (coordinate-wise with public scalars)
TRAINER_BATCHABLE = ("dp_sgd", "dp_adam", "dp_adamw", "dp_adambc", "dp_adamw_bc")


# ------------------------------------------------------------------------------------------------
# the model and the data
# ------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _model_classes():
    """(CanaryConfig, CanaryModel), built on first use so that importing this module does not import transformers."""
    from transformers import PretrainedConfig, PreTrainedModel
    from transformers.modeling_outputs import SequenceClassifierOutput

    class CanaryConfig(PretrainedConfig):
        model_type = "hf_dp_audit_canary"

        def __init__(self, dim: int = 2, **kwargs):
            self.dim = int(dim)
            kwargs.setdefault("num_labels", 1)
            kwargs.setdefault("problem_type", "regression")
            super().__init__(**kwargs)

    class CanaryModel(PreTrainedModel):
        """logits = θ·x with x = e_{canary_index} (0 for index −1); θ = ``score.weight``, bias-free."""

        config_class = CanaryConfig
        base_model_prefix = "audit"

        def __init__(self, config):
            super().__init__(config)
            self.score = nn.Linear(config.dim, 1, bias=False)
            self.post_init()

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                nn.init.zeros_(module.weight)

        def forward(self, canary_index=None, labels=None, **kwargs):
            idx = canary_index.long().view(-1)
            x = torch.zeros(idx.shape[0], self.config.dim, dtype=self.score.weight.dtype, device=idx.device)
            rows = torch.nonzero(idx >= 0).view(-1)
            x[rows, idx[rows]] = 1.0
            return SequenceClassifierOutput(logits=self.score(x))

    return CanaryConfig, CanaryModel


class CanaryDataset(torch.utils.data.Dataset):
    """``background`` rows with index −1 (zero gradient; row 0 is one, the empty-batch placeholder),
    then one canary row per index in ``canaries``."""

    def __init__(self, background: int, canaries):
        self.index = [-1] * int(background) + [int(k) for k in canaries]
        self.background = int(background)

    def __len__(self) -> int:
        return len(self.index)

    def __getitem__(self, i):
        k = self.index[i]
        return {"canary_index": k, "labels": 0.0 if k < 0 else -CANARY_LABEL}


# ------------------------------------------------------------------------------------------------
# replaying batches from the outside
# ------------------------------------------------------------------------------------------------
class ReplayBatchSampler:
    """Wraps the trainer's batch sampler (``trainer.dp.sampler``): records every index list it yields
    and, after :meth:`replay`, substitutes given lists for the ones the wrapped sampler yields.

    Relies only on the wrapped sampler being an iterable of index lists with ``__len__`` and
    ``set_epoch``; everything else (``state_dict``, ``load_state_dict``, ...) is delegated, so the
    checkpoint carries the wrapped sampler's state. The wrapped sampler is still iterated in step
    (same lengths, epochs and RNG use); only the contents change.
    """

    def __init__(self, inner):
        self.inner = inner
        self.recorded: list[list[int]] = []
        self._replay: list[list[int]] | None = None
        self._skip = 0
        self._served = 0

    def replay(self, lists, skip: int = 0) -> None:
        """From now on yield the wrapped sampler's next ``skip`` lists unchanged, then ``lists`` in order
        (in place of as many wrapped lists), then the wrapped sampler's lists again."""
        self._replay = [list(b) for b in lists]
        self._skip = int(skip)
        self._served = 0

    def __len__(self) -> int:
        return len(self.inner)

    def set_epoch(self, epoch: int) -> None:
        self.inner.set_epoch(epoch)

    def __iter__(self):
        for batch in self.inner:
            j = self._served
            self._served += 1
            drawn = batch
            if self._replay is not None and self._skip <= j < self._skip + len(self._replay):
                batch = list(self._replay[j - self._skip])
            batch = list(batch)
            self.recorded.append(batch)
            yield _as_drawn(batch, drawn)

    def __getattr__(self, name):
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)


def _as_drawn(indices, drawn):
    """``indices`` under the numbers of the micro-batch ``drawn`` the wrapped sampler yielded in its place (a forged
    :class:`~hf_dp.privacy.sampler.DrawnIndices`): the replay reaches the step as that draw, so the audit sees it."""
    from hf_dp.privacy.sampler import DrawnIndices

    if not isinstance(drawn, DrawnIndices):
        return list(indices)
    return DrawnIndices(indices, drawn.draw, drawn.logical, drawn.micro)


def replay_epsilon(noise_multiplier: float, sample_rate: float, steps: int, replays: int, delta: float, accountant: str = "prv") -> float:
    """True ε when every one of ``steps`` Poisson batches is used ``replays`` times with fresh noise:
    the mean of the r noisy sums is sufficient, so it is ``steps`` subsampled Gaussian steps at σ/√r."""
    from hf_dp.privacy.accounting import compute_epsilon

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        return compute_epsilon(noise_multiplier / math.sqrt(replays), sample_rate, steps, delta, accountant)


# ------------------------------------------------------------------------------------------------
# one run = K trials
# ------------------------------------------------------------------------------------------------
@dataclass
class TrainerAuditConfig:
    optim: str = "dp_sgd"
    noise_multiplier: float = 0.5  # the claimed (nominal) σ, given to the trainer
    max_grad_norm: float = 1.0  # C (--per_sample_max_grad_norm)
    sample_rate: float = 0.25  # q = B/N; the run picks N and B with B/N exactly this
    steps: int = 1  # max_steps of each train() call
    train_calls: int = 1
    resume_at: int | None = None  # checkpoint + interruption + resume at this step of the first call
    trials: int = 20000  # per dataset (D and D')
    delta: float = 0.05  # the audit's δ (the claim is the accountant's ε at this δ)
    variant: str = "real"
    batch_trials: int = 8192  # K trials (coordinates) per run
    background: int = 4  # minimum number of zero-gradient rows
    hyper: dict = field(default_factory=dict)  # overrides hf_dp.audit.stats.AUDIT_HYPER (lr default: B); eps, gamma, others via optim_args
    accountant: str = "prv"
    alpha: float = 0.05
    trainer_delta: float = 1e-5  # the run's own --delta (must be < 1/N)

    def check(self) -> None:
        if self.variant not in TRAINER_VARIANTS:
            raise ValueError(f"--path trainer: variant must be one of {TRAINER_VARIANTS}, got {self.variant!r}")
        if self.optim not in TRAINER_BATCHABLE:
            raise ValueError(f"--path trainer supports {', '.join(TRAINER_BATCHABLE)} (coordinate-wise rules), not {self.optim}")
        if self.variant == "replay_train" and self.train_calls < 2:
            raise ValueError("variant replay_train needs --train_calls >= 2")
        if self.variant == "replay_resume" and self.resume_at is None:
            raise ValueError("variant replay_resume needs --resume_at k")
        if self.resume_at is not None:
            if not 1 <= self.resume_at < self.steps:
                raise ValueError("--resume_at must be in [1, steps)")
            if self.variant == "replay_resume" and 2 * self.resume_at > self.steps:
                raise ValueError("replay_resume replays the first resume_at steps after the resume: needs 2*resume_at <= steps")


def _sizes(cfg: TrainerAuditConfig, canaries: int) -> tuple[int, int]:
    """(N, B) with N ≥ background + canaries and B/N = q exactly (B an integer)."""
    q = cfg.sample_rate
    for n in range(cfg.background + canaries, cfg.background + canaries + 100000):
        b = q * n
        if abs(b - round(b)) < 1e-9 and round(b) >= 1:
            return n, int(round(b))
    raise ValueError(f"no dataset size gives an integer batch for q={q}")


def _stop_at(k: int):
    """A TrainerCallback that ends ``train()`` after global step ``k`` (an interruption)."""
    from transformers import TrainerCallback

    class StopAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step >= k:
                control.should_training_stop = True

    return StopAt()


def privatizer_break(dp, brk):
    """A ``TrainerCallback`` that breaks the privatizer of a DPTrainer whose privacy state is ``dp``: ``brk(dp.optimizer)``
    at ``on_train_begin`` (after ``create_optimizer`` made it, before the first step). Add it with ``add_callback``."""
    from transformers import TrainerCallback

    class PrivatizerBreak(TrainerCallback):
        def on_train_begin(self, args, state, control, **kwargs):
            brk(dp.optimizer)  # the privatizer (HF may hold Accelerate's wrapper of it)

    return PrivatizerBreak()


def noise_off(dp):
    """The no_noise break for a DPTrainer whose privacy state is ``dp`` (tests and the one-run audit's trainer runs):
    the callback (:func:`privatizer_break`) that applies :func:`zero_noise` to the privatizer ``create_optimizer``
    makes, before the first step; ``trainer.add_callback(noise_off(trainer.dp))``."""
    return privatizer_break(dp, zero_noise)


def zero_noise(opt) -> None:
    """The audit's no_noise break: the privatizer ``opt`` adds N(0, (0·C)²); the ledger keeps the nominal σ, and so
    does the optimizer between steps (DPTrainer checks it). Idempotent; ``None`` is left alone."""
    if opt is None or getattr(opt, "_audit_zero_noise", False):
        return
    opt._audit_zero_noise = True
    add_noise = opt.add_noise

    def add_zero_noise():
        sigma, opt.noise_multiplier = opt.noise_multiplier, 0.0
        try:
            add_noise()
        finally:
            opt.noise_multiplier = sigma

    opt.add_noise = add_zero_noise


def optimizer_flags(hyper: dict) -> dict:
    """An audit's optimizer hyper-parameters (without lr) as DPTrainingArguments flags: eps → adam_epsilon, gamma →
    bc_gamma, the rest through --optim_args. ``hyper`` is consumed."""
    kw = {}
    if "eps" in hyper:
        kw["adam_epsilon"] = float(hyper.pop("eps"))
    if "gamma" in hyper:
        kw["bc_gamma"] = float(hyper.pop("gamma"))
    if hyper:
        kw["optim_args"] = ",".join(f"{k}={v}" for k, v in hyper.items())
    return kw


def _args(cfg: TrainerAuditConfig, out: str, batch: int, save_steps: int | None):
    from hf_dp import DPTrainingArguments

    from hf_dp.audit.stats import AUDIT_HYPER

    # the mechanism path's audit hyper-parameters (e.g. a large Adam eps: the step is ≈ linear in g̃), but
    # lr = B by default: one clipped canary then moves a DP-SGD coordinate by exactly C
    hyper = {**{k: v for k, v in AUDIT_HYPER.get(cfg.optim, {}).items() if k != "lr"}, **cfg.hyper}
    lr = float(hyper.pop("lr", batch))
    kw = optimizer_flags(hyper)
    return DPTrainingArguments(
        output_dir=out, optim=cfg.optim, noise_multiplier=cfg.noise_multiplier, delta=cfg.trainer_delta,
        per_sample_max_grad_norm=cfg.max_grad_norm, accountant=cfg.accountant, learning_rate=lr,
        lr_scheduler_type="constant", weight_decay=0.0, per_device_train_batch_size=batch,
        gradient_accumulation_steps=1, max_steps=cfg.steps, trainable="all", clipping="auto",
        dp_max_length=1,  # one one-hot input per row: the public token bound of the clipped sum's rounding allowance
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500, report_to=[],
        use_cpu=True, disable_tqdm=True, dataloader_num_workers=0, logging_strategy="no", **kw,
    )


def _without_clipping(engine) -> None:
    """Variant ``no_clip``: the trainer's clipping engine (``dp.engine``) clips to C = ∞ (factor 1 for every example);
    the noise keeps σ·C."""
    before, after = engine.before_backward, engine.after_backward

    def unbounded(optimizer, run):
        saved, optimizer.max_grad_norm = optimizer.max_grad_norm, float("inf")
        try:
            return run()
        finally:
            optimizer.max_grad_norm = saved

    engine.before_backward = lambda losses, optimizer, units=None: unbounded(optimizer, lambda: before(losses, optimizer, units))
    engine.after_backward = lambda optimizer, loss_scale, rows, units=None: unbounded(
        optimizer, lambda: after(optimizer, loss_scale, rows, units))


@functools.lru_cache(maxsize=None)
def _two_rows_trainer():
    """Variant ``two_rows``: a DPTrainer whose training loader's collator emits every drawn row twice, with the
    one-row-per-example check bypassed (a class, built on first use)."""
    from hf_dp import DPTrainer

    from hf_dp.run.data import DRAWN_KEY, ROW_DRAW_KEY

    class TwoRowsTrainer(DPTrainer):
        def get_train_dataloader(self):
            loader = super().get_train_dataloader()
            checked = loader.collate_fn  # hf_dp's collator: checks the rows, then calls HF's (.collate_fn)

            def twice(features):
                if not features:
                    return checked(features)
                tag = checked(features).get(DRAWN_KEY)  # the draw's own tag, forged: the step takes the batch as drawn
                plain = [{k: v for k, v in f.items() if k != ROW_DRAW_KEY} for f in features]
                out = checked.collate_fn(plain * 2)
                out[DRAWN_KEY] = tag[:-1] + (2 * len(plain),)  # (token, draw, logical, micro, rows): twice the rows
                return out

            loader.collate_fn = twice
            return loader

    return TwoRowsTrainer


def _trainer(cfg, model, args, dataset, require_ghost: bool = True):
    """A DPTrainer on ``dataset`` with ``cfg.variant``'s break (the module docstring); ``require_ghost``: refuse an
    engine other than one-backward ghost clipping (the canary model's K trials per run rely on it)."""
    from transformers.trainer_callback import PrinterCallback

    from hf_dp import DPTrainer

    # two_rows: the collator emits every drawn row twice; the one-row-per-example check bypassed
    cls = _two_rows_trainer() if cfg.variant == "two_rows" else DPTrainer
    tr = cls(model=model, args=args, train_dataset=dataset)
    tr.remove_callback(PrinterCallback)
    if require_ghost and tr.dp.clipping != "ghost":
        raise RuntimeError(f"internal: expected --clipping auto to choose ghost clipping, got {tr.dp.clipping}")
    if cfg.variant == "no_clip":
        _without_clipping(tr.dp.engine)
    if cfg.variant == "no_noise":
        tr.add_callback(noise_off(tr.dp))
    if cfg.variant in ("replay_train", "replay_resume"):
        tr.dp.sampler = ReplayBatchSampler(tr.dp.sampler)
    if cfg.variant == "accumulation_changed":  # the trainer.args change after construction, check bypassed
        from hf_dp.run import contract

        tr.args.gradient_accumulation_steps = 3
        tr.dp.contract.planned = contract.mechanism_snapshot(tr.args, tr.dp.mechanism, tr.model)
    return tr


def one_trainer_run(cfg: TrainerAuditConfig, canaries: int, no_canaries: int, workdir: str) -> tuple[np.ndarray, np.ndarray, dict]:
    """One scheduled training of a fresh model with ``canaries`` D' coordinates and ``no_canaries`` D
    coordinates. Returns (stats on D, stats on D', info) with stat = θ_0 − θ_T per coordinate."""
    _, CanaryModel = _model_classes()
    CanaryConfig = CanaryModel.config_class
    k = canaries + no_canaries
    n, b = _sizes(cfg, canaries)
    dataset = CanaryDataset(n - canaries, range(canaries))
    model = CanaryModel(CanaryConfig(dim=k))
    with torch.no_grad():
        model.score.weight.zero_()
    theta0 = model.score.weight.detach().clone()[0]
    out = tempfile.mkdtemp(dir=workdir)
    m = 1  # gradient_accumulation_steps
    try:
        first_lists = None
        if cfg.resume_at is not None:
            tr = _trainer(cfg, model, _args(cfg, out, b, cfg.resume_at), dataset)
            tr.add_callback(_stop_at(cfg.resume_at))
            tr.train()
            interrupted = tr
            ckpt = os.path.join(out, f"checkpoint-{cfg.resume_at}")
            model = CanaryModel(CanaryConfig(dim=k))  # the interrupted run's model is discarded
            tr = _trainer(cfg, model, _args(cfg, out, b, None), dataset)
            if cfg.variant == "replay_resume":
                spe = len(tr.dp.sampler) // m  # steps per epoch
                skip = (cfg.resume_at % spe) * m  # the lists HF's resume draws and skips in the current epoch
                tr.dp.sampler.replay(interrupted.dp.sampler.recorded[: cfg.resume_at * m], skip=skip)
            tr.train(resume_from_checkpoint=ckpt)
        else:
            tr = _trainer(cfg, model, _args(cfg, out, b, None), dataset)
            tr.train()
        if cfg.variant == "replay_train":
            first_lists = list(tr.dp.sampler.recorded)
        for _ in range(cfg.train_calls - 1):
            if cfg.variant == "replay_train":
                tr.dp.sampler.replay(first_lists)
            tr.train()
        info = dict(
            steps=tr.dp.ledger.steps, sigma=tr.dp.spec.noise_multiplier, q=tr.dp.spec.sample_rate,
            reported_epsilon=tr.get_epsilon(), N=n, B=b,
        )
        stat = (theta0 - model.score.weight.detach()[0]).double().numpy()
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return stat[canaries:], stat[:canaries], info


def run_trainer_trials(cfg: TrainerAuditConfig) -> tuple[np.ndarray, np.ndarray, dict]:
    """``cfg.trials`` statistics on D and on D' through the trainer (see the module docstring)."""
    cfg.check()
    s0, s1 = [], []
    info = {}
    K = max(2, cfg.batch_trials + cfg.batch_trials % 2)
    workdir = tempfile.mkdtemp(prefix="hf_dp_audit_")
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # resume warnings about save_steps etc.
    hf_logging.disable_progress_bar()  # checkpoint "Writing model shards" bars
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            while min(len(s0), len(s1)) < cfg.trials:
                need = cfg.trials - min(len(s0), len(s1))
                half = min(K // 2, need)
                d, dp, info_run = one_trainer_run(cfg, half, half, workdir)
                if info and (info_run["steps"], info_run["sigma"], info_run["q"]) != (info["steps"], info["sigma"], info["q"]):
                    raise RuntimeError("internal: runs of one audit differ in steps, sigma or q")
                info = info or info_run
                s0.extend(d)
                s1.extend(dp)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    return np.asarray(s0[: cfg.trials]), np.asarray(s1[: cfg.trials]), info


def trainer_audit(cfg: TrainerAuditConfig | None = None, **kwargs):
    """Run the trials through DPTrainer; returns an :class:`hf_dp.audit.stats.AuditResult` whose claimed ε is
    the accountant's ε for the trainer's own σ, q and ledger steps at ``cfg.delta``."""
    from hf_dp.audit.stats import AuditResult, epsilon_lower_bound
    from hf_dp.privacy.accounting import compute_epsilon

    cfg = cfg or TrainerAuditConfig(**kwargs)
    t0 = time.perf_counter()
    s0, s1, info = run_trainer_trials(cfg)
    bound = epsilon_lower_bound(s0, s1, cfg.delta, cfg.alpha)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        claimed = max(0.0, compute_epsilon(info["sigma"], info["q"], info["steps"], cfg.delta, cfg.accountant))
    return AuditResult(cfg, bound.eps_lower, claimed, bound, s0, s1, time.perf_counter() - t0, info)
