"""The one-run audit inside a training run (``--audit_canaries m``, ``--audit_kind input|gradient``): DPTrainer's
hooks (they take the run's privacy state ``trainer.dp``, or its audit part ``trainer.dp.audit``, and the pieces they
use; only :func:`canary_scores`, which runs HF's evaluation loop, takes the trainer; this module imports nothing of
hf_dp outside hf_dp.audit's pure modules).

The bound (Steinke, Nasr & Jagielski 2023) is :mod:`hf_dp.audit.one_run_bound`, the Gaussian-DP estimate beside it
(Mahloujifar et al. 2024) :mod:`hf_dp.audit.fdp`, the canaries :mod:`hf_dp.audit.canary_kinds`; the record holds both
(``epsilon_lower_bound`` — the verdict's, assumption-free — and ``gaussian_dp``), with their confidence.

Black-box canaries for a sequence classifier (:class:`SequenceCanaries`; ``--audit_canaries m``)
-----------------------------------------------------------------------------------------------
(A causal LM's are token sequences without a label, scored by minus their per-token loss:
:mod:`hf_dp.audit.lm_canaries`; everything else below applies to them unchanged.)
m out-of-distribution inputs — sequences of tokens drawn uniformly from the vocabulary (special tokens excluded,
wrapped in the tokenizer's special tokens when one is given; as long as a typical training row, at most
:data:`CANARY_TOKENS`) — each with a uniformly random label; canary i is included iff its secret bit says so. The
tokens and labels come from a public stream (``--seed``; the same on every rank); the bits from the OS entropy source
(rank 0's, broadcast in memory under DDP) and live only in memory: never in the model, its config, ``privacy.json``,
a checkpoint, a log or a pickle (pickling is refused). DPTrainer (:func:`attach`, :func:`extend_units`) appends the
included canaries to the training set given to it, which stays the source of the data fingerprint (a hash of the
training set with the canaries would be a function of the draw). After ``train()`` (:func:`after_train`) every canary
is scored through HF's ``evaluation_loop`` with the trainer's collator, device and frozen-prefix cache, *without its
label* (no loss, no metric; canaries never enter an evaluation set): the score is the label's logit margin
z_y − log Σ_{j≠y} e^{z_j} (included canaries were trained on and tend to score higher). Guesses, counts and the bound
go to ``trainer.dp.audit_record`` (``privacy.json``'s ``audit``, the card's line next to ε); the bits are then dropped.

Accounting. Every canary is a privacy unit whether or not the draw included it: an excluded canary is a unit with no
row, drawn by the Poisson sampler like any unit and contributing nothing (under ``--noise_bands`` b > 1 each canary unit
has a cyclic Poisson partition, a hash of its public content, included or not: :meth:`TrainerCanaries.identities`; it
is drawn at its partition's steps at rate b·q, as any unit). So **N = real units + m** and
**q = B/(N_real + m)** do not depend on the draw (the released N, q and ε reveal nothing about which or how many
canaries were included), and (ε, δ) is the guarantee of the mechanism for add/remove of any one unit — a canary, the
auditor's null hypothesis, or a real unit, each sampled at that q: canaries are extra units and the real examples'
guarantee is the reported ε. The reported N (``dataset_size``, the card's N) counts the m canaries; the record says so.
With ``--privacy_unit_column`` each canary is its own unit (its unit column is empty). A run cannot be resumed (the
draw is not stored, so a new process cannot rebuild the training set) and is audited after its one ``train()``.
The frozen-prefix cache of the training set is built without its progress bar and log line (their row count would
be real + included). The logged training loss is the real rows' only: the training loader tags the canary rows
(:func:`loader_parts`) and ``DPTrainer.training_step`` takes an input canary's loss out of what a micro-batch reports
(:func:`input_canary_loss`; the canary is trained on as any row), as a gradient canary's model loss is 0 already.

White-box (gradient) canaries (``--audit_kind gradient``). The same m canary units and rows (the draw, N, q and
the accounting above are unchanged), but a canary's contribution is a gradient the auditor chooses: a random unit
direction u_k over the trainable parameters (:class:`~hf_dp.audit.canary_kinds.GradientDirections`, from a 128-bit
key of the OS entropy source, broadcast under DDP), of raw norm s = :data:`GRADIENT_NORM`·C. How it goes through the
mechanism: the training loader tags each row with its canary id (:func:`loader_parts`: -1 for a real row; the
tag is taken out before the user's collator sees the row and comes back as the batch key :data:`CANARY_KEY`);
``compute_loss`` gives a canary row a model loss of exactly 0 (:func:`zero_canary_losses`: its gradient through the
model is 0, so the clipping engine sees an example with a zero gradient), and the engine's ``after_backward``
(:func:`wrap_engine`) then clips s·u_k for every canary row of the micro-batch as the privatizer clips an example
(c = min(1, C/(‖v‖ + 10⁻⁶)), C the privatizer's at that moment, as in ``PrivateOptimizer._clip_and_sum``) and adds it
into the logical batch's clipped sum, before its one noise: clipped to C (whatever a variant does to C there), summed
with the batch, noised, divided by B — the path of every example, not a side channel. Rules with a per-sample transform (DP-SGD-L2,
DP-MacAdam) and FSDP are refused (the zero-gradient row would add its own offset; the sums are sharded). The score
reads every step's privatized gradient g̃_t (the noisy mean, public by DP: the accountant's guarantee covers the
whole sequence, not only the last model), in the privatizer's ``step_hook``: x_kt = B·⟨g̃_t, u_k⟩/C is the canary's
projection in units of C — N(0, σ²) plus, in the steps that drew it, exactly 1 — and the score is the sum over the
steps of its log-likelihood ratio log(1 − q + q·exp((x_kt − ½)/σ²)) (q, σ the planned ones;
:func:`~hf_dp.audit.canary_kinds.step_log_likelihood_ratio`): the Neyman–Pearson test of each canary, where the
projection of the summed gradients ⟨Σ_t g̃_t, u_k⟩ dilutes the ≈ q·T steps that drew a canary in the noise of all T.
Linear in the canary's clipped contributions for every update rule (the model's total change is not, under Adam).
Under ``--noise_bands`` b > 1 the steps' noises are correlated (σ·C·s·w_t, w = M⁻¹z) and a canary joins only the steps
of its partition, at rate b·q: the score is then the same Neyman–Pearson statistic for that mechanism, on the whitened
projections (:class:`~hf_dp.audit.canary_kinds.BandedLikelihoodRatio`: r = M·x/s has independent noise, and the
canary's partition steps have disjoint columns), from the privatizer's coefficients and the sampler's partitions —
public, never a bit.
Only m running sums are kept (the scores and, for checks, the summed projections), in memory; they and the
directions are dropped with the bits.

The command line: ``python -m hf_dp.audit --one_run ...`` (:mod:`hf_dp.audit.one_run`: the black-box run is a
DPTrainer run with ``--audit_canaries``, variants as the trainer path of :mod:`hf_dp.audit.trainer_path`); see
``benchmarks/audit.md``.
"""

from __future__ import annotations

import contextlib
import warnings

import numpy as np

from hf_dp.audit.canary_kinds import (BandedLikelihoodRatio, GradientDirections, SequenceCanaries, _special_tokens,
                                      label_margins, step_log_likelihood_ratio)
from hf_dp.audit.fdp import gdp_audit_scores, gdp_record
from hf_dp.audit.lm_canaries import TokenCanaries, lm_canary_scores, per_sequence_loss
from hf_dp.audit.one_run_bound import OneRunBound, audit_scores, ceiling, describe, record, utility_cost
from hf_dp.audit.stats import power_note
# the canary rows' tags in the training loader and compute_loss (re-exported: DPTrainer calls them here)
from hf_dp.audit.canary_rows import (CANARY_KEY, _gradient_state, input_canary_loss, logged_loss,  # noqa: F401
                                     loader_parts, pop_rows, zero_canary_losses)

# ------------------------------------------------------------------------------------------------
# --audit_canaries m: the canaries of a DPTrainer run (the trainer's hooks call these with its privacy state)
# ------------------------------------------------------------------------------------------------
#: the fewest canaries --audit_canaries accepts: below it even a run with no privacy cannot be refuted at ε ≈ 1–3
MIN_CANARIES = 100
#: 1 − confidence of the trainer's audit (95 %); 2mδ must stay below it (:func:`check_canary_count`)
AUDIT_BETA = 0.05
#: tokens of one black-box canary (capped by the model's positions)
CANARY_TOKENS = 32
#: --audit_kind: input (black-box canaries, scored by the trained model) or gradient (white-box, the auditor's gradient)
AUDIT_KINDS = ("input", "gradient")
#: a gradient canary's raw norm, in units of C: the run clips it to C (a clip x 10 break lets 10 C through)
GRADIENT_NORM = 1e3
GRADIENT_SCORE = ("sum over the steps of the log-likelihood ratio of the privatized (noisy) gradient's projection on "
                  "the canary's direction")
ACCOUNTING = (
    "q = B/(N_real + m): every canary is counted as a privacy unit whether or not the secret draw included it, so N, "
    "q and epsilon do not depend on the draw; the reported N is the real units plus the m canaries, and the real "
    "examples' guarantee is the reported epsilon (each real unit is sampled at that q)"
)


def check_canary_count(m, delta: float, beta: float = AUDIT_BETA) -> None:
    """One-sentence ``ValueError`` unless ``m`` (--audit_canaries) is a whole number ≥ :data:`MIN_CANARIES` with
    2mδ < β (else the δ term of the bound alone reaches β and nothing can be certified)."""
    if isinstance(m, bool) or not isinstance(m, int) or m < MIN_CANARIES:
        raise ValueError(f"--audit_canaries must be a whole number >= {MIN_CANARIES} (fewer canaries cannot refute any "
                         f"useful epsilon), got {m!r}")
    if 2 * m * delta >= beta:
        raise ValueError(f"--audit_canaries {m} with --delta {delta:g}: 2*m*delta = {2 * m * delta:g} >= {beta:g}, so the "
                         "one-run bound can certify nothing; use fewer canaries or a smaller delta")


class TrainerCanaries:
    """A DPTrainer's canaries (``trainer.dp.audit``): the :class:`SequenceCanaries`, where they sit in the training set
    (rows ``real_rows`` … ``real_rows + #included − 1``) and the number of real units. Held in memory only."""

    def __init__(self, canaries: SequenceCanaries, real_rows: int, like, kind: str = "input"):
        self.canaries, self.real_rows, self.like = canaries, int(real_rows), like
        self.m = len(canaries)
        self.included_rows = int(canaries.included.sum())
        self.real_units: int | None = None
        self.trained = False
        self.bound: OneRunBound | None = None
        self.kind = kind
        # --audit_kind gradient (secret, memory only): the canary id of each appended row, the directions' key, the
        # canaries of the micro-batch in flight, the running scores (sum of the steps' log-likelihood ratios) and the
        # summed projections x_kt of the privatized gradients (m numbers each)
        self.row_canary: np.ndarray | None = None
        self.key: int | None = None
        self.directions: GradientDirections | None = None
        self.pending: list[int] = []
        self.score_sum: np.ndarray | None = None
        self.projection_sum: np.ndarray | None = None
        self.banded: BandedLikelihoodRatio | None = None  # --noise_bands b > 1: the whitened score's running state
        self._projector = None  # (indices, signs / √support) of all m directions on the parameters' device
        self.raw_norm: float | None = None
        self.gdp = None  # the Gaussian-DP estimate (hf_dp.audit.fdp.GdpEstimate) once audited
        self.beta = AUDIT_BETA  # 1 − the bound's confidence (the one-run command line's --alpha; else 95 %)

    def __reduce__(self):
        raise TypeError("the trainer's canaries cannot be pickled: the inclusion draw must never be stored")

    @property
    def public_rows(self) -> int:
        """What HF may report as the number of training examples: real rows + m (not + the included ones)."""
        return self.real_rows + self.m

    def identities(self) -> list:
        """Each canary unit's identity for cyclic Poisson sampling's partitions (``--noise_bands`` > 1,
        :func:`hf_dp.run.setup.cyclic_partitions` hashes it): its index and its public content (tokens, label), drawn
        from the public stream before the inclusion bits — never the bit, so an excluded canary has the partition it
        would have had included, and the partitions (and their digest in a checkpoint) reveal nothing of the draw."""
        c = self.canaries
        return [{"audit_canary": i, "input_ids": list(c.input_ids[i]), "label": int(c.labels[i])} for i in range(self.m)]


def _shared_key(key: int, args) -> int:
    """Under DDP every rank must build the same gradient directions: rank 0's 128-bit key, broadcast in memory."""
    bits = np.unpackbits(np.frombuffer(int(key).to_bytes(16, "little"), dtype=np.uint8)).astype(bool)
    return int.from_bytes(np.packbits(_shared_bits(bits, args)).tobytes(), "little")


def _shared_bits(bits: np.ndarray, args) -> np.ndarray:
    """Under DDP every rank must train on the same canaries: rank 0's bits, broadcast in memory."""
    import torch

    if getattr(args, "world_size", 1) <= 1:
        return bits
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("--audit_canaries with several processes needs torch.distributed initialized (torchrun)")
    device = torch.device("cpu") if dist.get_backend() == "gloo" else args.device
    t = torch.as_tensor(bits.astype(np.uint8), device=device)
    dist.broadcast(t, src=0)
    return t.cpu().numpy().astype(bool)


def attach(objective, model, args, train_dataset, tokenizer=None):
    """``--audit_canaries m`` (DPTrainer's ``__init__``, before HF's; ``objective``: the trainer's
    :mod:`hf_dp.models.loss` objective): draw the m black-box canaries and return (the training set with the included
    ones appended, the audit state that keeps them), which DPTrainer keeps as ``dp.audit``; (``train_dataset``,
    ``None``) without the flag."""
    m = getattr(args, "audit_canaries", None)
    if not m or not args.dp_enabled:
        return train_dataset, None
    check_canary_count(m, args.delta)
    kind = getattr(args, "audit_kind", None) or "input"
    if kind not in AUDIT_KINDS:
        raise ValueError(f"--audit_kind must be one of {', '.join(AUDIT_KINDS)}, got {kind!r}")
    if kind == "gradient" and getattr(args, "fsdp", None):
        raise ValueError("--audit_kind gradient is not supported with --fsdp: the canaries' gradients would be added "
                         "to sharded sums; use --audit_kind input")
    config = getattr(model, "config", None)
    num_labels = int(getattr(config, "num_labels", 0) or 0)
    causal = getattr(objective, "name", None) == "causal_lm"  # token canaries, no label (hf_dp.audit.lm_canaries)
    if not causal and (getattr(objective, "name", None) != "sequence_classification" or getattr(
            config, "problem_type", None) in ("regression", "multi_label_classification") or num_labels < 2):
        raise ValueError("--audit_canaries supports single-label sequence classifiers (>= 2 labels) and causal LMs only: "
                         "its black-box canaries are random token sequences, with random labels for a classifier")
    if train_dataset is None or not hasattr(train_dataset, "__len__") or not hasattr(train_dataset, "__getitem__"):
        raise ValueError("--audit_canaries needs a sized, map-style train_dataset to append its canaries to")
    if getattr(args, "keep_frozen_features_cache", False):
        raise ValueError("--audit_canaries with --keep_frozen_features_cache: the kept cache of the training set would "
                         "hold the included canaries' features, i.e. the secret draw; drop --keep_frozen_features_cache")
    if type(train_dataset).__name__ == "CachedFeatures":
        raise ValueError("--audit_canaries needs the tokenized training set, not a prebuilt frozen-prefix cache")
    vocab = int(getattr(config, "vocab_size", 0) or 0) or (len(tokenizer) if tokenizer is not None else 0)
    if vocab < 2:
        raise ValueError("--audit_canaries needs the model's vocab_size to draw canary tokens")
    reserved = sum(len(x) for x in _special_tokens(tokenizer)[:2]) if tokenizer is not None else 0
    _check_input_ids(train_dataset)
    # the length is a public constant (capped by the model's positions), never read from the training rows: canaries
    # that depended on the private data would differ between neighbouring datasets in every canary at once
    length = int(getattr(args, "audit_canary_length", CANARY_TOKENS) or CANARY_TOKENS)
    length = max(1, min(length, int(getattr(config, "max_position_embeddings", 512) or 512)) - reserved)
    # the tokens and labels come from a public stream (the same on every rank); the inclusion bits from OS entropy
    content_seed = [int(args.seed) & 0xFFFFFFFF, 0x0A0D17]
    canaries = (TokenCanaries if causal else SequenceCanaries).draw(int(m), max(2, num_labels), tokenizer=tokenizer, vocab_size=min(vocab, len(tokenizer))
                                     if tokenizer is not None else vocab, length=length, seed=content_seed)
    canaries._included = _shared_bits(canaries._included, args)
    unit_col = getattr(args, "privacy_unit_column", None)
    state = TrainerCanaries(canaries, len(train_dataset), train_dataset, kind)
    if kind == "gradient":
        import secrets

        state.row_canary = np.flatnonzero(canaries._included)  # row real_rows + j is canary row_canary[j]
        state.key = _shared_key(secrets.randbits(128), args)
        state.raw_norm = GRADIENT_NORM * float(args.per_sample_max_grad_norm)
    return canaries.append_to(train_dataset, blank=(unit_col,) if unit_col else ()), state


def _check_input_ids(train_dataset) -> None:
    """One-sentence refusal unless the training rows have an ``input_ids`` column (the canaries are token sequences)."""
    try:
        train_dataset[0]["input_ids"]
    except (KeyError, TypeError, IndexError):
        raise ValueError("--audit_canaries needs an input_ids column in the training set") from None


def extend_units(dp, rows: int) -> None:
    """The set-up's hook ``audit_units`` (:func:`hf_dp.run.setup.setup_privacy`, after the real units are read into
    ``dp.units``; ``dp`` the run's privacy state): the units of the canaries, one each, appended to the real units —
    an included canary's unit is its row, an excluded canary's unit has no row (it is drawn like any unit, and adds
    nothing) —, so that N = real units + m whatever the draw."""
    state = dp.audit
    if state is None:
        return
    if rows != state.real_rows + state.included_rows:
        raise ValueError("internal: the training set does not hold the real rows and the included canaries")
    real = dp.units.rows if dp.units.rows is not None else [[i] for i in range(state.real_rows)]
    state.real_units = len(real)
    units, k = list(real), state.real_rows
    for b in state.canaries.included:
        units.append([k] if b else [])
        k += int(b)
    if dp.units.of_row is not None:  # unit-level clipping: each included canary row is its own unit
        for j, rows_of in enumerate(units[len(real):], start=len(real)):
            for r in rows_of:
                dp.units.of_row[r] = j
    dp.units.rows = units
    dp.units.count = len(units)


# ------------------------------------------------------------------------------------------------
# --audit_kind gradient: the canary rows' gradient in the engine's clipped sum (their tags and zero model loss:
# hf_dp.audit.canary_rows)
# ------------------------------------------------------------------------------------------------
class _GradientCanaryEngine:
    """The trainer's clipping engine, with each drawn canary's gradient s·u_k handed to the privatizer's own
    per-example clipping after the engine's ``after_backward`` (see the module docstring)."""

    def __init__(self, inner, state: TrainerCanaries):
        self.inner, self.state = inner, state

    def __getattr__(self, name):  # name, clipper, grad_sampler, ... of the wrapped engine
        if name in ("inner", "state"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def before_backward(self, losses, optimizer, units=None):
        return self.inner.before_backward(losses, optimizer, units=units)

    def after_backward(self, optimizer, loss_scale: float, rows: int, units=None) -> None:
        self.inner.after_backward(optimizer, loss_scale, rows, units=units)
        _add_canary_gradients(self.state, optimizer)

    def discard(self, optimizer) -> None:
        self.inner.discard(optimizer)
        _prepare(self.state, optimizer)
        self.state.pending = []

    def clear(self) -> None:
        self.inner.clear()
        self.state.pending = []


def wrap_engine(dp, engine):
    """The set-up's hook ``audit_engine`` (:func:`hf_dp.run.setup.setup_privacy`; ``dp`` the run's privacy state): the
    clipping engine, wrapped under ``--audit_kind gradient``."""
    state = _gradient_state(dp.audit)
    return engine if state is None else _GradientCanaryEngine(engine, state)


def _prepare(state: TrainerCanaries, optimizer) -> None:
    """Once, before the first step: refuse a rule with a per-sample transform, build the directions over the
    privatizer's parameters and hook the per-step scoring of the privatized gradient onto its ``step_hook``."""
    import torch

    if state.directions is not None:
        return
    params = optimizer.params
    _check_rule(optimizer)
    state.directions = GradientDirections(state.m, [p.numel() for p in params], key=state.key)
    idx, signs = state.directions.matrix()
    device = params[0].device
    state._projector = (torch.as_tensor(idx, device=device),
                        torch.as_tensor(signs, dtype=torch.float64, device=device) / float(np.sqrt(idx.shape[1])))
    state.score_sum, state.projection_sum = np.zeros(state.m), np.zeros(state.m)
    spec = getattr(getattr(optimizer, "ledger", None), "spec", None)
    q = spec.sample_rate if spec is not None else getattr(getattr(optimizer, "sampler", None), "sample_rate", 0.0)
    sigma = spec.noise_multiplier if spec is not None else optimizer.noise_multiplier
    correlation, partitions = getattr(optimizer, "correlation", None), getattr(optimizer.sampler, "partitions", None)
    if correlation is not None and correlation.bands > 1:  # banded noise: the whitened likelihood ratio
        if partitions is None or state.real_units is None:
            raise ValueError("--audit_kind gradient with --noise_bands needs the canaries' cyclic Poisson partitions")
        state.banded = BandedLikelihoodRatio(partitions[state.real_units:].numpy(), correlation.coefficients, q, sigma)
    previous = optimizer.step_hook

    def score_privatized(opt):
        if state.score_sum is not None:
            x = step_projections(state, opt)
            if state.banded is not None:
                state.banded.update(x)
            else:
                state.score_sum += step_log_likelihood_ratio(x, q, sigma)
            state.projection_sum += x
        if previous:
            previous(opt)

    optimizer.step_hook = score_privatized


def check_optimizer(state, optimizer) -> None:
    """DPTrainer's ``create_optimizer`` (before the first step begins; ``state`` the audit state ``dp.audit``): refuse an
    update rule with a per-sample transform under ``--audit_kind gradient``."""
    if _gradient_state(state) is not None:
        _check_rule(optimizer)


def _check_rule(optimizer) -> None:
    rule = optimizer.rule
    if rule.per_sample_affine(optimizer.params) is not None or not rule.ghost_compatible():
        raise ValueError(f"--audit_kind gradient needs an update rule without a per-sample transform of the gradients "
                         f"({type(rule).__name__} has one: a canary row's zero gradient would still add its offset); "
                         "use --audit_kind input, or dp_sgd / dp_adam / dp_adamw / dp_adambc / dp_adamw_bc")


def step_projections(state: TrainerCanaries, optimizer) -> np.ndarray:
    """x_k = B·⟨g̃_t, u_k⟩/C for every canary k, g̃_t the privatized gradient of this step (``p.grad`` after
    ``privatize()``: the noisy mean, mapped back to gradient space), B the privatizer's divisor and C its clip norm:
    the canary's projection in units of C (1 when drawn at this step, plus N(0, σ²) and the real rows' projection)."""
    import torch

    idx, signs = state._projector
    flat = torch.cat([p.grad.detach().reshape(-1).to(device=idx.device, dtype=torch.float64)
                      for p in optimizer.params])
    z = (flat[idx] * signs).sum(dim=1)
    return z.cpu().numpy() * (float(optimizer.expected_batch_size) / float(optimizer.max_grad_norm))


def _add_canary_gradients(state: TrainerCanaries, optimizer) -> None:
    """s·u_k for every canary row of the micro-batch, clipped as the privatizer clips an example — c = min(1,
    C/(‖v‖ + 10⁻⁶)) with C = ``optimizer.max_grad_norm`` at this moment (what ``_clip_and_sum`` computes; v = s·u_k
    since the rule has no per-sample transform, so ‖v‖ = s) — and added into the logical batch's clipped sum
    (``p.summed_grad``), which the privatizer noises once. Sparse (u_k has :data:`~hf_dp.audit.canary_kinds.SUPPORT`
    coordinates): O(support) per canary, not O(d)."""
    import torch

    _prepare(state, optimizer)
    pending, state.pending = state.pending, []
    if not pending:
        return
    params = optimizer.params
    c = min(1.0, float(optimizer.max_grad_norm) / (state.raw_norm + 1e-6))
    for k in pending:
        for j, local, vals in state.directions.per_parameter(k):
            p = params[j]
            if getattr(p, "summed_grad", None) is None:
                p.summed_grad = torch.zeros_like(p)
            elif not p.summed_grad.is_contiguous():
                p.summed_grad = p.summed_grad.contiguous()
            flat = p.summed_grad.view(-1)
            flat.index_add_(0, torch.as_tensor(local, device=flat.device),
                            torch.as_tensor(c * state.raw_norm * vals, dtype=flat.dtype, device=flat.device))


def gradient_scores(state: TrainerCanaries) -> np.ndarray:
    """Σ_t log-likelihood ratio of x_kt for every canary (0 for all if no step was taken)."""
    if state.score_sum is None:
        return np.zeros(state.m)
    return state.banded.scores() if state.banded is not None else state.score_sum.copy()


def before_train(state, resume_from_checkpoint) -> None:
    """Refuse a resume (the draw is not stored: a new process cannot rebuild the training set) and a second train()
    (the bits were dropped after the first audit). ``state``: the audit state ``dp.audit`` (``None``: no audit)."""
    if state is None:
        return
    if resume_from_checkpoint is not None:
        raise ValueError("--audit_canaries cannot resume from a checkpoint: the canaries' inclusion draw is never "
                         "stored, so the resumed run would train on a different set; start the run again")
    if state.trained:
        raise ValueError("--audit_canaries audits one train() call: the inclusion draw was dropped after the first "
                         "audit; make a new DPTrainer")


def canary_scores(trainer, state: TrainerCanaries) -> np.ndarray:
    """The label margin of every canary under the trained model: the trainer's collator, device, frozen-prefix cache
    and suffix context, through HF's ``evaluation_loop`` on the canaries *without* their labels (no loss, no metric,
    no callback's on_evaluate/on_predict ever sees them). A causal LM's: minus their per-token loss (lm_canaries),
    each batch's logits reduced by :func:`~hf_dp.audit.lm_canaries.per_sequence_loss` on the way, without
    ``compute_metrics`` (``DPTrainer._canary_scoring``).
    Takes the trainer: it runs HF's test loader and evaluation loop (``trainer.evaluation_loop``) on the canaries."""
    c = state.canaries
    lm = isinstance(c, TokenCanaries)
    like = state.like if hasattr(state.like, "column_names") else None
    ds = c.dataset(like=like, drop=(getattr(trainer.args, "privacy_unit_column", None),),
                   **({"score": True} if lm else {"labels": False}))
    if trainer._prefix_cache:
        ds = trainer.prefix_cache.cache(ds, "canaries")
    loader = trainer.get_test_dataloader(ds)
    hooks = trainer._canary_scoring(per_sequence_loss) if lm else contextlib.nullcontext()  # lm: no [m, T, V] array
    with hooks, trainer._suffix_ctx(), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = trainer.evaluation_loop(loader, description="Canary scoring", prediction_loss_only=False,
                                      metric_key_prefix="canary")
    if lm:
        return lm_canary_scores(out.predictions, len(c))
    pred = out.predictions
    logits = np.asarray(pred[0] if isinstance(pred, (tuple, list)) else pred, dtype=np.float64)
    return label_margins(logits[: len(c)], c.labels)


def _drop(state: TrainerCanaries) -> None:
    """Forget the draw and everything derived from it (the bits, the rows' canary ids, the gradient scores)."""
    state.canaries.forget()
    if state.row_canary is not None:
        state.row_canary.fill(-1)  # a loader built before may still hold this array: its tags say nothing now
    state.row_canary = state.directions = state.key = state._projector = state.score_sum = state.projection_sum = None
    state.banded = None
    state.pending = []


def after_train(dp, args, score_canaries=None, get_epsilon=None, failed: bool = False) -> dict | None:
    """After DPTrainer's train() (``dp`` the run's privacy state, ``args`` its arguments): score, guess, count, bound;
    ``dp.audit_record`` (privacy.json's ``audit``, the card's line); the inclusion bits are then dropped.
    ``score_canaries(state)``: the black-box canaries' scores under the trained model (:func:`canary_scores` on the
    trainer); ``get_epsilon()``: the ε the trainer reports. ``failed`` (train() raised): no audit, the bits are dropped
    all the same, and a later train() is refused (it would reuse the draw)."""
    state = dp.audit
    if state is None or state.trained:
        return None
    state.trained = True
    if failed:
        return _drop(state)
    gradient = state.kind == "gradient"
    beta = float(state.beta)  # the command line's --alpha; else 95 %
    delta = float(args.delta)
    try:
        scores = gradient_scores(state) if gradient else score_canaries(state)
        bound = audit_scores(scores, state.canaries.included, delta, beta)
        gdp = gdp_audit_scores(scores, state.canaries.included, delta, beta)
    finally:
        _drop(state)
    state.bound, state.gdp = bound, gdp  # counts and the bounds only (no bit)
    rec = record(bound, "white-box" if gradient else "black-box", GRADIENT_SCORE if gradient else state.canaries.score_name)
    rec["gaussian_dp"] = gdp_record(gdp)
    eps = float(get_epsilon())
    # the real units as the mechanism counts them: the declared --public_dataset_size (the actual count is then private)
    real_units = getattr(args, "public_dataset_size", None) or state.real_units
    rec.update(
        epsilon=eps, violation=bool(bound.epsilon_lower > eps), ceiling=(top := ceiling(state.m, float(args.delta), beta)),
        low_power=bool(power_note(eps, top, state.m)),  # the claim above or within 1 of the ceiling (README's rule)
        real_units=real_units, dataset_size_includes_canaries=state.m, accounting=ACCOUNTING,
    )
    rec["summary"] = describe(rec)
    rec["utility_cost"] = utility_cost(state.m, int(real_units or 0), float(dp.spec.sample_rate),
                                       bool(getattr(args, "_hf_dp_canaries_on_top", False)))
    dp.audit_record = rec
    return rec


def report(dp) -> dict:
    """``{"audit": record}`` for ``privacy.json`` once the run (``dp``: its privacy state) was audited, else ``{}``."""
    rec = dp.audit_record
    return {"audit": dict(rec)} if rec else {}
