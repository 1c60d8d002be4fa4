"""The privatizer: Opacus ``DPOptimizer`` semantics around an hf_dp update rule.

For one logical batch (possibly several physical micro-batches, possibly several processes):

1. after each backward pass, :meth:`PrivateOptimizer.accumulate` takes the per-sample gradients
   Opacus' grad sampler left in ``p.grad_sample``, undoes any constant loss scale, lets the rule map
   them to its clip space (identity for most rules), clips each example's whole gradient (all
   parameters jointly; with ``units=``, each privacy unit's gradient — its rows summed first) to norm ≤ C as Opacus' ``clip_and_accumulate`` does, adds them to
   ``p.summed_grad`` and frees ``p.grad_sample``. Whatever an example's loss, its contribution is finite:
   an example whose norm is NaN, inf or ≥ √(largest float) (2^64 ≈ 1.8e19 in float32, where ghost
   clipping's squared norms overflow) contributes exactly 0 — never 0·inf = NaN — and the others keep
   Opacus' result bit for bit. Nothing is logged about it (not which examples, not how many);
2. :meth:`step` adds ``N(0, σ²C²)`` to the sum **once** — on rank 0 only when several processes
   train, after which the noisy sums are all-reduced, so the noise enters exactly once — divides by
   the *expected* logical batch size B, maps back from clip space, records the step in the
   :class:`~hf_dp.privacy.accounting.PrivacyLedger`, and runs the update rule. After ``step()``
   ``p.grad`` holds the privatized gradient g̃_t the rule used.

Randomness (:mod:`hf_dp.privacy.randomness`): the noise comes from a stream that starts at this
optimizer's first noisy step (and again after ``load_state_dict``) — a ``torch.Generator`` seeded
from OS entropy (default), or, with ``noise_seed``, keyed by (``noise_seed``, "noise", the ledger's
:attr:`~PrivateOptimizer.stream_tag` when set, the step) — :func:`~hf_dp.privacy.randomness.stream_generator`, which
sets the whole generator state from the key (``manual_seed`` would keep 32 bits of the seed on the CPU: seeds equal
modulo 2³² would draw the same noise) — the tag is ``None`` for a fresh run and for a clean continuation of a checkpoint, and a new id for
a resume from which other steps were already computed (:func:`hf_dp.run.spent.reconcile_resumed_ledger`) and for a
``train()`` that continues a ledger without resuming (:func:`hf_dp.run.lineage.before_train`), so a resumed or continued
run never redraws noise already used, by its own lineage or by another resume of the same run;
``secure_mode=True`` draws from the OS CSPRNG (Opacus' secure-mode construction). ``state_dict`` holds no seed and no generator state: nothing on disk lets anyone
recompute the noise.

Correlated noise (``noise_mechanism="banded_sqrt"``, ``noise_bands=b``; :mod:`hf_dp.privacy.banded`): the draw above,
at std σ·C·s, becomes step t's noise σ·C·s·w_t through :class:`~hf_dp.privacy.banded.BandedNoise` (the last b − 1 noise
tensors in memory only, a new segment after ``load_state_dict``), and :attr:`PrivateOptimizer.noise_std_of_mean` is the
std of the step just noised; with b = 1 the noise is the independent noise, bit for bit.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from opacus.optimizers import DPOptimizer

from hf_dp.optim.base import DPUpdateRule, check_nonnegative, check_positive

from .accounting import PrivacyLedger
from .banded import INDEPENDENT, BandedNoise, check_noise_mechanism, effective_bands
from .randomness import secure_gaussian_like, source_name, stream_generator
from .tensors import _is_sharded, _local, _shard_offset, _sq_norms64, all_reduce_grads  # noqa: F401 (_local, _shard_offset: tests)


class PrivacyBudgetExceeded(RuntimeError):
    """Raised instead of taking a step that would push ε past the target."""


def _world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class PrivateOptimizer(DPOptimizer):
    """A DP optimizer: Opacus privatization + an hf_dp :class:`~hf_dp.optim.base.DPUpdateRule`.

    Args:
        rule: the update rule (holds the param groups and state).
        noise_multiplier: σ ≥ 0.
        max_grad_norm: the user's clip norm C > 0.
        expected_batch_size: B = expected *logical* batch size (q·N) over all processes.
        noise_seed: seed of the noise stream (``None``: OS entropy); known to whoever knows it.
        secure_mode: noise from the OS CSPRNG, as Opacus' secure mode (sums of Gaussians against
            floating-point attacks); cannot be combined with ``noise_seed``.
        ledger: a :class:`PrivacyLedger` that records one step per noisy step (optional).
        max_epsilon: refuse (raise :class:`PrivacyBudgetExceeded`) to take a step after which the
            ledger's ε would exceed this.
        noise_mechanism, noise_bands: ``independent`` (DP-SGD's noise, the default) or ``banded_sqrt`` with b bands
            (:mod:`hf_dp.privacy.banded`).
    """

    def __init__(
        self,
        rule: DPUpdateRule,
        *,
        noise_multiplier: float,
        max_grad_norm: float,
        expected_batch_size: float,
        noise_seed: int | None = None,
        secure_mode: bool = False,
        ledger: PrivacyLedger | None = None,
        max_epsilon: float | None = None,
        noise_mechanism: str = INDEPENDENT,
        noise_bands: int = 1,
    ):
        if not isinstance(rule, DPUpdateRule):
            raise TypeError(f"rule must be an hf_dp DPUpdateRule, got {type(rule).__name__}")
        check_nonnegative("noise_multiplier (sigma)", noise_multiplier)
        check_positive("max_grad_norm (C)", max_grad_norm)
        check_positive("expected_batch_size (B)", expected_batch_size)
        self.noise_mechanism, self.noise_bands = check_noise_mechanism(noise_mechanism, noise_bands)
        #: the correlated noise's running state (memory only; ``None`` for independent noise)
        self.correlation = None if noise_mechanism == INDEPENDENT else BandedNoise(effective_bands(noise_mechanism, noise_bands))
        self.user_max_grad_norm = float(max_grad_norm)
        self.randomness = source_name(noise_seed, secure_mode)
        super().__init__(
            rule,
            noise_multiplier=float(noise_multiplier),
            # per-sample vectors are clipped in the rule's clip space to rule.clip_norm(C) (C; MacAdam: unit vectors),
            # and the noise std on the sum is σ times that
            max_grad_norm=float(rule.clip_norm(max_grad_norm)),
            expected_batch_size=expected_batch_size,
            loss_reduction="sum",
            generator=None,
            secure_mode=secure_mode,
        )
        self.rule = rule
        self.ledger = ledger
        self.max_epsilon = max_epsilon
        self.noise_seed = None if noise_seed is None else int(noise_seed)
        self.sampler = None  # a PoissonBatchSampler whose state travels with the optimizer's
        #: relative rounding allowance of the per-sample gradients' float32 sum (γ of its public term count; set by
        #: DPTrainer from the run's token bounds): each example is clipped to C/(1 + it)
        self.sum_allowance = 0.0
        self._parts: dict | None = None  # parts(): the float64 sum of a split micro-batch's parts
        self.steps_taken = 0
        #: steps known to fit in ``max_epsilon`` (see ``_would_exceed_budget``)
        self.budget_steps: int | None = None
        rule.attach_privatizer(self)

    # ----- the noise scale, one source of truth ---------------------------------------------------
    @property
    def noise_std_of_mean(self) -> float:
        """σ·C/B (C in clip space): the noise std of each coordinate of the privatized mean; with correlated noise
        σ·C·s·√V_n/B, the std of the step noised last (n: its position in the segment; the update rule runs after
        that step's noise is added: :meth:`hf_dp.privacy.banded.BandedNoise.std_factor`)."""
        std = self.noise_multiplier * self.max_grad_norm / float(self.expected_batch_size)
        return std if self.correlation is None else std * self.correlation.std_factor()

    def _noise_std(self) -> float:
        """The std of each coordinate of the fresh draw z_t: σ·C, times s under correlated noise."""
        std = self.noise_multiplier * self.max_grad_norm
        return std if self.correlation is None else std * self.correlation.scale

    def _correlate(self, key, noise):
        return noise if self.correlation is None else self.correlation.correlate(key, noise)

    @property
    def step_index(self) -> int:
        """Noisy steps taken so far (the ledger's count when there is one): keys a seeded noise stream."""
        return self.ledger.steps if self.ledger is not None else self.steps_taken

    @property
    def stream_tag(self) -> str | None:
        """Keys the seeded streams together with the step (``ledger.meta["stream_tag"]``): ``None`` for a fresh run and
        a clean continuation of a checkpoint (nothing computed past it, no other resume of it), else the id the resume
        drew (:func:`hf_dp.run.spent.reconcile_resumed_ledger`), or that a ``train()`` continuing the ledger without
        a resume drew (:func:`hf_dp.run.lineage.before_train`): two resumes of one run never share a stream."""
        return self.ledger.meta.get("stream_tag") if self.ledger is not None else None

    def _stream_key(self, purpose: str, step: int, *rest) -> tuple:
        tag = self.stream_tag
        return (purpose, step, *rest) if tag is None else (purpose, tag, step, *rest)

    def _noise_generator(self, device) -> torch.Generator:
        """The noise stream on ``device``: started at the first noisy step of this object (or after a load)."""
        gen = self.generator
        if gen is None or gen.device != torch.device(device):
            # a fresh run too (start 0, no tag): manual_seed(noise_seed) would keep 32 bits of the seed on the CPU
            # (seeds equal modulo 2^32 drawing the same noise); stream_generator sets the whole state from the key
            gen = stream_generator(self.noise_seed, *self._stream_key("noise", self.step_index), device=device)
            self.generator = gen
        return gen

    def add_noise(self):
        """``p.grad = p.summed_grad + N(0, σ²C²)``, the noise from this optimizer's stream (see the module docstring);
        under FSDP (sharded ``summed_grad``) on this rank's shard of each tensor only (:meth:`_add_shard_noise`)."""
        std = self._noise_std()
        if _is_sharded(self.params):
            return self._add_shard_noise(std)
        if self.secure_mode:
            for index, p in enumerate(self.params):
                p.grad = (p.summed_grad + self._correlate(index, secure_gaussian_like(p.summed_grad, std))).view_as(p)
            return
        gen = self._noise_generator(self.params[0].device)
        for index, p in enumerate(self.params):
            ref = p.summed_grad
            if std == 0:
                noise = torch.zeros_like(ref)
            else:
                noise = torch.normal(0.0, std, size=ref.shape, device=ref.device, dtype=ref.dtype, generator=gen)
                noise = self._correlate(index, noise)
            p.grad = (ref + noise).view_as(p)

    def _add_shard_noise(self, std: float) -> None:
        """FSDP: ``p.grad = p.summed_grad + N(0, σ²C²)`` on this rank's local shard of every parameter, no other rank
        touching those coordinates, so every coordinate of the model gets exactly one draw per step. The stream of
        each (parameter, shard) is its own: ``--secure_rng`` draws from the OS CSPRNG; otherwise a generator seeded
        from (``noise_seed`` — OS entropy when ``None`` —, "fsdp_noise", the :attr:`stream_tag` when set, the ledger's
        step, the parameter's index, the shard's offset in the flattened parameter), so no two shards, no two steps and
        no two resumes of one run share a stream."""
        step = self.step_index
        if not all(_is_sharded([p]) for p in self.params):  # a replicated one would get world-size draws, unreduced
            raise RuntimeError("under FSDP every trainable parameter must be sharded by fully_shard (its gradient a "
                               "sharded DTensor); one is not, so its noise would be drawn on every rank")
        for index, p in enumerate(self.params):
            ref = p.summed_grad
            local = _local(ref)
            if std == 0 or local.numel() == 0:
                noise = torch.zeros_like(local)
            elif self.secure_mode:
                noise = secure_gaussian_like(local, std)
            else:
                gen = stream_generator(self.noise_seed, *self._stream_key("fsdp_noise", step, index, _shard_offset(ref)),
                                       device=local.device)
                noise = torch.normal(0.0, std, size=local.shape, device=local.device, dtype=local.dtype, generator=gen)
            if std != 0 and local.numel():
                noise = self._correlate(index, noise)  # this rank's shard's own segment
            local.add_(noise)
            p.grad = ref
        return None

    # ----- per micro-batch ----------------------------------------------------------------------------
    @torch.no_grad()
    def accumulate(self, loss_scale: float = 1.0, units: torch.Tensor | None = None) -> int:
        """Clip and sum the per-sample gradients of the last backward pass(es); free them.

        ``loss_scale``: the constant the per-example losses were multiplied by before backward
        (e.g. 1/accumulation steps); per-sample gradients are divided by it first so that clipping
        sees each example's true gradient. Each example adds a finite vector of norm ≤ C, 0 if its norm is
        not finite (see :meth:`_clip_and_sum`). Returns the number of rows processed.

        ``units``: ``None`` (every row its own privacy unit) or an integer tensor [rows], values 0..U−1 with every
        value present: the rows' per-sample gradients are summed per unit (``index_add``, in float32 or wider)
        before the rule's map to clip space and the clipping, so each unit adds one finite vector of norm ≤ C —
        exactly 0 if its summed vector's norm is not finite (a NaN or inf row zeroes its whole unit).
        """
        params = self.params
        if not params or all(getattr(p, "grad_sample", None) is None for p in params):
            return 0
        missing = [i for i, p in enumerate(params) if getattr(p, "grad_sample", None) is None]
        if missing:
            raise ValueError(
                f"{len(missing)} trainable parameter(s) received no per-sample gradient in backward; "
                "every trainable parameter must be used in the forward pass through a layer Opacus supports"
            )
        # norms and sums in float32 at least: under bf16 autocast Opacus leaves bf16 per-sample gradients, whose
        # norm and clip factor rounded to bf16 would let c_i·‖g_i‖ exceed C (by up to ~0.8%)
        flat = [self._get_flat_grad_sample(p) for p in params]
        flat = [g.to(torch.promote_types(g.dtype, torch.float32)) for g in flat]
        if loss_scale != 1.0:
            if not loss_scale > 0:
                raise ValueError(f"loss_scale must be > 0, got {loss_scale}")
            flat = [g / loss_scale for g in flat]
        rows = flat[0].shape[0]
        if units is not None:
            flat = self._sum_per_unit(flat, units, rows)
        flat = self.rule.to_clip_space(params, flat)
        self._clip_and_sum(params, flat)
        for p in params:
            p.grad_sample = None
        return rows

    @staticmethod
    def _sum_per_unit(flat: list, units: torch.Tensor, rows: int) -> list:
        """[rows, …] per-sample gradients -> [U, …] per-unit sums (``units`` as in :meth:`accumulate`)."""
        if not torch.is_tensor(units) or units.dim() != 1 or units.dtype.is_floating_point or units.dtype == torch.bool:
            raise ValueError(f"units must be a 1-D integer tensor (one unit index per row), got {units!r}")
        if units.numel() != rows:
            raise ValueError(f"units has {units.numel()} entries for {rows} rows of per-sample gradients")
        if rows == 0:
            return flat
        units = units.long()
        if int(units.min()) < 0 or not bool((torch.bincount(units) > 0).all()):
            raise ValueError("units must number the units 0..U-1 with every value present")
        num = int(units.max()) + 1
        out = []
        for g in flat:
            idx = units.to(g.device)
            out.append(g.new_zeros((num, *g.shape[1:])).index_add_(0, idx, g))
        return out

    def _clip_and_sum(self, params, flat: list) -> None:
        """``p.summed_grad += Σ_i c_i v_i`` with Opacus' c_i = min(1, C/(‖v_i‖ + 1e-6)) (the same operations as
        ``DPOptimizer.clip_and_accumulate``), except that an example whose ‖v_i‖ is not finite or not below
        √(largest float of its dtype) — its squared norm would not be representable — gets c_i = 0 and its
        rows are zeroed first, so it adds exactly 0 (not 0·inf = NaN) and every other example's term is
        unchanged. The threshold is a property of each example alone (any bounded per-example map is private)."""
        if flat[0].shape[0] == 0:
            c, keep = torch.zeros((0,), device=flat[0].device), None
        else:
            # squares summed in float64, a slice at a time: a float32 norm can fall short of the exact one (by 1 % for
            # one large entry among 2^24 small ones), letting c_i·‖v_i‖ exceed C
            norms = torch.stack([_sq_norms64(g) for g in flat], dim=1).sum(1).sqrt()
            # (1 + sum_allowance): each example's share of the float32 sum's rounding (hf_dp.run.setup.token_bounds)
            c = (self.max_grad_norm / (norms * (1 + self.sum_allowance) + 1e-6)).clamp(max=1.0)
            keep = norms <= torch.finfo(flat[0].dtype).max ** 0.5  # False for NaN and inf (and ‖v_i‖² not representable)
            if bool(keep.all()):
                keep = None
            else:
                c = torch.where(keep, c, c.new_zeros(()))
        for p, g in zip(params, flat):
            g = g.to(p.dtype)  # as Opacus: the sum in the parameters' dtype
            if keep is not None:
                g = torch.where(keep.to(g.device).view(-1, *([1] * (g.dim() - 1))), g, g.new_zeros(()))
            grad = torch.einsum("i,i...", c.to(g.device).to(p.dtype), g)
            self._add_to_sum(p, grad)

    @torch.no_grad()
    def add_clipped_sum(self, clipped: dict) -> None:
        """Add an already clipped per-example sum {param: Σ_i c_i v_i} (from ghost clipping) to the
        logical batch, v_i = ∇ℓ_i or the rule's per-sample affine map of it (:meth:`per_sample_affine`, which
        the caller must have passed to ghost clipping): the sum is in clip space, as :meth:`accumulate`'s."""
        if not self.rule.ghost_compatible():
            raise ValueError(
                f"{type(self.rule).__name__} transforms per-example gradients before clipping; "
                "ghost clipping cannot apply to it (use the Opacus hooks)"
            )
        for p in self.params:
            g = clipped.get(p)
            if g is None:
                raise ValueError("ghost clipping returned no clipped sum for a trainable parameter")
            self._add_to_sum(p, g.view_as(p))

    def _add_to_sum(self, p, g) -> None:
        """``p.summed_grad += g`` — or, inside :meth:`parts` (a micro-batch run as several), into a float64 sum of the
        parts that :meth:`parts` adds once: the parts' float32 additions would otherwise round with the whole sum's
        magnitude, once per part, beyond the allowance of the run's public micro-batch count."""
        if self._parts is not None:
            prev = self._parts.get(p)
            self._parts[p] = g.double() if prev is None else prev + g.double()
            return
        prev = getattr(p, "summed_grad", None)  # FSDP: Accelerate swapped in sharded parameters without it
        p.summed_grad = g if prev is None else prev + g

    @contextlib.contextmanager
    def parts(self):
        """The clipped sums added inside are summed in float64 and added to ``summed_grad`` once, on a clean exit."""
        self._parts = {}
        try:
            yield
            parts = self._parts
        finally:
            self._parts = None
        for p, g in parts.items():
            self._add_to_sum(p, g.to(p.dtype))

    # Opacus' pre_step calls clip_and_accumulate on pending grad samples; we route it through accumulate
    def clip_and_accumulate(self):
        self.accumulate()

    def scale_grad(self):
        for p in self.params:
            p.grad /= float(self.expected_batch_size)

    # ----- per logical batch --------------------------------------------------------------------------
    def _within_budget(self, steps: int) -> bool:
        return self.ledger.epsilon_after(steps) <= self.max_epsilon * (1 + 1e-9)

    def _would_exceed_budget(self) -> bool:
        """True if the next step would push ε past ``max_epsilon``.

        ε is monotone in the step count, so the largest affordable count is found once (by
        bisection, a few accountant calls) and cached in ``budget_steps``; the trainer pre-sets it to
        the planned steps it calibrated σ for (already verified to be within budget).
        """
        if self.ledger is None or self.max_epsilon is None:
            return False
        nxt = self.ledger.steps + 1
        if self.budget_steps is not None and nxt <= self.budget_steps:
            return False
        if not self._within_budget(nxt):
            return True
        lo, hi = nxt, 2 * nxt
        while self._within_budget(hi):
            lo, hi = hi, 2 * hi
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if self._within_budget(mid) else (lo, mid)
        self.budget_steps = lo
        return False

    @torch.no_grad()
    def privatize(self) -> None:
        """Noise (once), reduce across ranks, scale by 1/B, map back to gradient space, record the step."""
        if self._would_exceed_budget():
            raise PrivacyBudgetExceeded(
                f"step {self.ledger.steps + 1} would spend more than the target epsilon={self.max_epsilon}; "
                "training must stop here"
            )
        self.accumulate()  # anything left over from a backward pass that was not accumulated yet
        params = self.params
        rank, world = _world()
        for p in params:
            if getattr(p, "summed_grad", None) is None:  # an empty logical batch still gets its noise
                p.summed_grad = torch.zeros_like(p)
        sharded = _is_sharded(params)
        step = self.ledger.own_steps if self.ledger is not None else self.steps_taken
        if self.correlation is not None:
            self._check_draw(step)
            self.correlation.begin_step(step)  # a new segment unless this step follows the segment's last one
        if sharded:  # FSDP: each rank holds the summed shards of its own coordinates; their noise is drawn there
            self.add_noise()
            world = 1  # FSDP's reduce-scatter already summed the ranks' clipped sums: nothing to all-reduce
        elif rank == 0:
            self.add_noise()  # p.grad = summed_grad + N(0, σ²C²)
        else:
            for p in params:
                p.grad = p.summed_grad.view_as(p)
        for p in params:
            p.summed_grad = None
        if self.correlation is not None:
            self.correlation.end_step(step)
        if world > 1:
            self._all_reduce_grads(params)
        self.scale_grad()
        self.rule.from_clip_space(params)
        if self.ledger is not None:
            self.ledger.record_step()
        self.steps_taken += 1

    def _check_draw(self, step: int) -> None:
        """Under cyclic Poisson sampling the sampler's last draw must be this step's (``PoissonBatchSampler.drawn_for``).
        A second check only: a loader that draws one batch ahead while the step is still running draws it for this
        step's number too, so the check that counts is each micro-batch's own tag (:func:`hf_dp.run.step.check_drawn_for`)."""
        sampler = self.sampler
        drawn = getattr(sampler, "drawn_for", None) if getattr(sampler, "bands", 1) > 1 else None
        if drawn is not None and drawn != step:
            raise RuntimeError(f"the batch of step {step} was drawn for step {drawn}'s partition (a loader that draws "
                               "ahead, e.g. with worker processes): cyclic Poisson sampling needs each batch drawn at "
                               "its own step; use dataloader_num_workers=0")

    #: largest all-reduce of :meth:`_all_reduce_grads` (bytes): small tensors are packed up to this size, so the
    #: extra memory of the reduction is one bucket, not a flat copy of every gradient
    all_reduce_bucket_bytes = 32 * 2**20

    @staticmethod
    def _all_reduce_grads(params) -> None:
        """Sum ``p.grad`` over all ranks, in place, in buckets of at most :attr:`all_reduce_bucket_bytes`
        (:func:`hf_dp.privacy.tensors.all_reduce_grads`)."""
        all_reduce_grads(params, PrivateOptimizer.all_reduce_bucket_bytes)

    def step(self, closure=None):
        if closure is not None:
            with torch.enable_grad():
                closure()
        if not self.params:
            return self.rule.step()
        self.privatize()
        if self.step_hook:
            self.step_hook(self)
        return self.rule.step()

    def discard_pending(self) -> None:
        """Drop clipped sums and per-sample gradients of a logical batch that was never stepped (an interrupted
        step): they must not be added into a later step's sum (two draws in one step: up to 2C per example)."""
        for p in self.params:
            p.grad_sample = None
            p.summed_grad = None

    def zero_grad(self, set_to_none: bool = True):
        # as Opacus' DPOptimizer.zero_grad (transformers 5 clears gradients with model.zero_grad() instead: privatize and
        # accumulate clear their own state, and each DP training_step starts by dropping leftovers, ClippingEngine.active)
        self.discard_pending()
        self.rule.zero_grad(set_to_none)

    # ----- state ----------------------------------------------------------------------------------------
    def state_dict(self):
        """The rule's state, the ledger (with its public stream tag) and the sampler's N and q. No seed, no generator
        state: a resumed run draws fresh noise and fresh batches (the accountant's steps are independent)."""
        return {
            "rule": self.rule.state_dict(),
            "hf_dp": {
                "steps_taken": self.steps_taken,
                "ledger": self.ledger.state_dict() if self.ledger is not None else None,
                "sampler": self.sampler.state_dict() if self.sampler is not None else None,
            },
        }

    def load_state_dict(self, state_dict) -> None:
        if "rule" not in state_dict or "hf_dp" not in state_dict:
            raise ValueError("not an hf_dp optimizer state (expected keys 'rule' and 'hf_dp')")
        extra = state_dict["hf_dp"]
        if self.ledger is not None:
            if extra.get("ledger") is None:
                raise ValueError("the checkpoint has no privacy ledger; refusing to resume with epsilon reset to 0")
            self.ledger.load_state_dict(extra["ledger"])
        self.rule.load_state_dict(state_dict["rule"])
        self.discard_pending()
        self.generator = None  # a new noise stream from the next step (never the stream of a saved state)
        if self.correlation is not None:
            self.correlation.reset()  # a new correlation segment: nothing of the noise was saved
        self.steps_taken = int(extra.get("steps_taken", 0))
        if self.sampler is not None and extra.get("sampler") is not None:
            self.sampler.load_state_dict(extra["sampler"])

    def __repr__(self):
        return (
            f"PrivateOptimizer({type(self.rule).__name__}, sigma={self.noise_multiplier}, "
            f"C={self.user_max_grad_norm}, B={self.expected_batch_size})"
        )
