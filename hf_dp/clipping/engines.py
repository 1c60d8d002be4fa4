"""The clipping engines DPTrainer drives: one object per ``--clipping`` value, all with the same few methods.

Per micro-batch, :class:`~hf_dp.trainer.DPTrainer` calls

* :meth:`ClippingEngine.before_backward` in ``compute_loss``, on the per-example losses ℓ_i [B] of a non-empty
  micro-batch (not under the contract probe): it returns the losses whose sum HF back-propagates (identity,
  except two-pass ghost clipping, whose pass 1 — the norms — runs here and which returns Σ_i c_i ℓ_i in gradient
  with the value of Σ_i ℓ_i);
* :meth:`ClippingEngine.after_backward` in ``training_step``, after HF's backward: hands the privatizer this
  micro-batch's clipped contributions, undoing ``loss_scale`` (the factor ``compute_loss`` measured on Σ_i ℓ_i) —
  Σ_i c_i v_i with ‖c_i v_i‖ ≤ C through ``optimizer.add_clipped_sum`` (ghost), or the per-sample gradients
  through ``optimizer.accumulate`` (hooks), which clips them;
* :meth:`ClippingEngine.discard` instead, for an empty micro-batch: its placeholder row contributes nothing;
* :meth:`ClippingEngine.clear` after an interrupted step.

``units`` (both calls, the same tensor): ``None`` — every row is its own privacy unit — or an integer tensor [B]
with values 0..U−1, every value present, naming each row's unit. A unit is then the "example": it contributes
c_u·v_u with v_u = (Σ_{r∈u} ∇ℓ_r + o) ⊙ s (the rule's per-sample affine map applied once per unit),
c_u = min(1, C/‖v_u‖…) and exactly 0 when ‖v_u‖² is not finite — ghost clipping regroups each layer's records by unit
(:meth:`hf_dp.clipping.ghost.GhostClipper.clipped_sum`), two passes weight row r by c_{units[r]}, the hooks sum the
rows' per-sample gradients per unit before clipping (:meth:`hf_dp.privacy.privatizer.PrivateOptimizer.accumulate`).
``units=None`` computes exactly what it computed before units existed.

``optimizer`` is the trainer's :class:`~hf_dp.privacy.privatizer.PrivateOptimizer` (passed in; this package does
not import the trainer). :func:`choose_engine` is ``--clipping auto|ghost|ghost_two_pass|hooks``;
:func:`make_engine` builds the engine on the plain model. A new engine subclasses :class:`ClippingEngine`, is
added to :data:`ENGINES` and to ``--clipping`` (``hf_dp/arguments.py``), and joins the engine-equivalence tests
(``tests/test_trainer_engines.py``).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from .common import unit_index
from .ghost import GhostClipper, clip_factors
from .hooks import GradSamplerHandle, assert_grad_samples_complete, attach_grad_sampler

__all__ = ["ClippingEngine", "HooksEngine", "GhostEngine", "TwoPassGhostEngine", "ENGINES", "choose_engine", "make_engine"]

_logger = logging.getLogger(__name__)


class ClippingEngine:
    """The protocol (see the module docstring). ``clipper`` / ``grad_sampler``: the ghost clipper or the Opacus
    handle the engine attached to the model (``None`` for the other engine)."""

    name = ""
    clipper: GhostClipper | None = None
    grad_sampler: GradSamplerHandle | None = None
    _paused = False  # pause(): DPTrainer pauses the engine at set-up and resumes it in active()

    def before_backward(self, losses: torch.Tensor, optimizer, units: torch.Tensor | None = None) -> torch.Tensor:
        return losses

    def after_backward(self, optimizer, loss_scale: float, rows: int, units: torch.Tensor | None = None) -> None:
        raise NotImplementedError

    def discard(self, optimizer) -> None:
        """Drop what the backward of an empty micro-batch's placeholder row left (records, per-sample gradients):
        it contributes nothing — not even a rule's per-sample offset (DP-SGD-L2's λθ, DP-MacAdam's −m̂/b), which
        would otherwise make a neighbouring dataset's sum differ by up to 2C when its one extra example is the only
        one in the micro-batch."""
        if self.clipper is not None:
            self.clipper.clear()
        for p in optimizer.params:
            p.grad_sample = None

    def clear(self) -> None:
        """Forget an interrupted step's records (the optimizer's ``discard_pending`` drops its sums)."""
        if self.clipper is not None:
            self.clipper.clear()

    def pause(self, paused: bool = True) -> None:
        """Pause (or resume) what the engine attached to the model: the ghost clipper's instrumentation
        (:meth:`~hf_dp.clipping.ghost.GhostClipper.pause`) or Opacus' per-sample-gradient hooks."""
        self._paused = bool(paused)
        if self.clipper is not None:
            self.clipper.pause(paused)
        if self.grad_sampler is not None and self.grad_sampler.attached:
            self.grad_sampler.paused = bool(paused)
            if paused:
                self.grad_sampler.gsm.disable_hooks()
            else:
                self.grad_sampler.gsm.enable_hooks()

    @contextlib.contextmanager
    def active(self, optimizer=None):
        """One micro-batch of DP training (DPTrainer runs each ``training_step`` in it): first whatever a forward or
        backward outside it left is dropped (records, per-sample gradients, the privatizer's parameters' ``.grad`` —
        e.g. a callback's own backward, which two passes would otherwise sum unclipped and the hooks would clip into
        this step), then the engine's instrumentation is resumed, and afterwards it is put back as it was (paused, as
        DPTrainer keeps it: the model it instruments trains and differentiates as usual anywhere else, and a second
        DPTrainer's steps on the same model are not recorded by this one's hooks)."""
        if optimizer is not None:
            self.discard(optimizer)
            for p in optimizer.params:
                p.grad = None
        before = self._paused
        self.pause(False)
        try:
            yield
        finally:
            self.pause(before)


class HooksEngine(ClippingEngine):
    """Opacus per-sample gradients (:mod:`hf_dp.clipping.hooks`), clipped and summed by the privatizer."""

    name = "hooks"

    def __init__(self, model: nn.Module, bounds=None):
        self.grad_sampler = attach_grad_sampler(model)
        self.bounds = bounds  # the privatizer's rounding allowance of the clipped sum (hf_dp.run.setup) is set from it
        self._checked = False  # every trainable parameter got a per-sample gradient (checked on the first backward)

    def after_backward(self, optimizer, loss_scale: float, rows: int, units: torch.Tensor | None = None) -> None:
        if not self._checked:
            assert_grad_samples_complete(self.grad_sampler.model, rows)
            self._checked = True
        optimizer.accumulate(loss_scale=loss_scale, units=units)


class GhostEngine(ClippingEngine):
    """One-backward ghost clipping (:mod:`hf_dp.clipping.ghost`): the clipped sum straight from the records."""

    name = "ghost"

    def __init__(self, model: nn.Module, bounds=None):
        self.clipper = GhostClipper(model, bounds=bounds)

    def after_backward(self, optimizer, loss_scale: float, rows: int, units: torch.Tensor | None = None) -> None:
        opt = optimizer
        clipped = self.clipper.clipped_sum(opt.max_grad_norm, loss_scale=loss_scale, affine=opt.rule.per_sample_affine(opt.params),
                                           units=units)
        opt.add_clipped_sum(clipped)


class TwoPassGhostEngine(ClippingEngine):
    """Ghost clipping in two backward passes: pass 1 (the norms) in :meth:`before_backward`, pass 2 is HF's own
    backward of Σ_i c_i ℓ_i (with units: Σ_r c_{units[r]} ℓ_r), whose parameter gradients :meth:`after_backward`
    hands on."""

    name = "ghost_two_pass"

    def __init__(self, model: nn.Module, bounds=None):
        self.clipper = GhostClipper(model, two_pass=True, bounds=bounds)
        self._clip_factors: torch.Tensor | None = None  # c of the micro-batch in flight
        self._affine: dict | None = None  # the rule's per-sample maps used in pass 1, reused after pass 2

    def before_backward(self, losses: torch.Tensor, optimizer, units: torch.Tensor | None = None) -> torch.Tensor:
        # pass 1: the per-example (per-unit) norms (a backward that computes no parameter gradient and keeps the
        # graph); the backward of the returned loss is pass 2: its gradients are Σ_i c_i ∇ℓ_i
        opt = optimizer
        self._affine = opt.rule.per_sample_affine(opt.params)
        sq = self.clipper.norms_pass(losses, affine=self._affine, units=units)
        self._clip_factors = clip_factors(sq, opt.max_grad_norm)  # [U]
        idx = unit_index(units, losses.shape[0])
        weighted = losses * (self._clip_factors if idx is None else idx.rows_of(self._clip_factors))
        return weighted + (losses - weighted).detach()  # the value (and logged loss) stays Σ ℓ_i

    def after_backward(self, optimizer, loss_scale: float, rows: int, units: torch.Tensor | None = None) -> None:
        c, affine, self._clip_factors, self._affine = self._clip_factors, self._affine, None, None
        optimizer.add_clipped_sum(self.clipper.grads_after_backward(c, loss_scale, affine=affine))

    def discard(self, optimizer) -> None:
        self.clipper.clear()
        for p in optimizer.params:
            p.grad_sample = None
            p.grad = None  # pass 2 of the placeholder left ordinary gradients

    def clear(self) -> None:
        super().clear()
        self._clip_factors = self._affine = None


#: ``--clipping`` value -> engine class
ENGINES: dict[str, type[ClippingEngine]] = {e.name: e for e in (HooksEngine, GhostEngine, TwoPassGhostEngine)}


def make_engine(name: str, model: nn.Module, bounds=None) -> ClippingEngine:
    """The engine ``name`` (``hooks``, ``ghost``, ``ghost_two_pass``) attached to the plain ``model``; ``bounds``: the
    run's public :class:`~hf_dp.clipping.common.TokenBounds` (default: the model's, see there)."""
    return ENGINES[name](model, bounds=bounds)


def _refuse_redefined_embeddings(model: nn.Module) -> None:
    """A trainable ``nn.Embedding`` subclass with a forward of its own (OPT's and BioGPT's learned positional
    embeddings take an attention mask, not ids) is neither a lookup ghost clipping's embedding type can record nor one
    Opacus' embedding grad sampler can differentiate: refused in one sentence, before any step."""
    for name, m in model.named_modules():
        if (isinstance(m, nn.Embedding) and type(m).forward is not nn.Embedding.forward
                and any(p.requires_grad for p in m.parameters(recurse=False))):
            raise ValueError(
                f"the trainable embedding {name} ({type(m).__name__}) computes its own lookup (its forward is not "
                "nn.Embedding's), which no per-example clipping engine here can differentiate per example; freeze it "
                "(--trainable lora or last_block) or train without it"
            )


def choose_engine(mode: str, model: nn.Module, *, optim: str, rule_cls, reduced_precision: bool,
                  logger: logging.Logger | None = None) -> str:
    """``--clipping mode`` -> the engine name: ``ghost`` (one backward pass) where it applies, else Opacus hooks;
    ``ghost_two_pass`` only when asked for. ``ValueError`` when an explicit ghost choice cannot apply (or two passes
    under ``--bf16``/``--fp16``); ``auto`` says on ``logger`` (INFO, one line) which engine it chose and why.

    ``optim`` / ``rule_cls``: the update rule's name and class (a rule that transforms per-example gradients other
    than by a declared affine map is not ``ghost_compatible``)."""
    log = logger or _logger
    _refuse_redefined_embeddings(model)
    if mode == "hooks":
        return "hooks"
    if mode == "ghost_two_pass" and reduced_precision:
        raise ValueError(
            "--clipping ghost_two_pass needs float32 training: its second backward sums the clipped per-example "
            "gradients in the autocast precision, across examples, which loosens the per-example bound C; "
            "train in float32 (DPTrainer refuses --bf16/--fp16 before it gets here)"
        )
    reasons = []
    if not rule_cls.ghost_compatible():
        reasons.append(f"{optim} transforms per-example gradients before clipping")
    if not reasons:
        try:
            GhostClipper.check_supported(model)
        except ValueError as e:
            reasons.append(str(e))
    if reasons and mode in ("ghost", "ghost_two_pass"):
        raise ValueError(f"--clipping {mode} cannot apply: " + "; ".join(reasons) + " (use --clipping hooks)")
    if mode == "auto":  # one line, never a silent fallback
        if reasons:
            log.info("hf_dp: --clipping auto chose hooks (Opacus per-sample gradients): ghost clipping cannot apply: %s", "; ".join(reasons))
        else:
            log.info("hf_dp: --clipping auto chose ghost (one-backward ghost clipping): every trainable layer is supported")
    return "hooks" if reasons else ("ghost_two_pass" if mode == "ghost_two_pass" else "ghost")
