"""The update-rule half of a DP optimizer, built as a chain of small transforms (optax style).

A DP optimizer in hf_dp has two halves:

* the **privatizer** (:class:`hf_dp.privacy.PrivateOptimizer`, an Opacus ``DPOptimizer``): per-sample
  clipping to C, one sum over the logical batch, ``N(0, σ²C²)`` added once, division by the
  *expected* logical batch size B. It leaves the privatized gradient g̃_t in ``p.grad``;
* the **update rule** (:class:`DPUpdateRule`, a ``torch.optim.Optimizer``): turns g̃_t into a
  parameter update. It only ever reads g̃_t, public hyper-parameters and the public noise scale,
  so by post-processing it adds no privacy cost.

An update rule is a chain of :class:`Transform` pieces applied to the list of per-parameter
updates (vectorised with ``torch._foreach_*``), followed by ``θ ← θ − η·u``. The learning rate
η is read from ``param_groups`` every step, so HF/torch LR schedulers work. All state lives in
``self.state`` and round-trips through ``state_dict``.

Two optional hooks let a rule change what happens to per-sample gradients *before* clipping
(``to_clip_space``) and map the noisy average back (``from_clip_space``); the privatizer calls
them. Rules using them must state their sensitivity in their docstring.

A rule published in more than one form lists them as data (:class:`Variant`, ``variants``); the
``variant`` hyper-parameter picks one, per param group like every hyper-parameter.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
from torch import Tensor


def _check_lr(lr) -> None:
    if not isinstance(lr, (int, float)) and not torch.is_tensor(lr):
        raise ValueError(f"lr must be a number, got {lr!r}")
    if float(lr) < 0 or math.isnan(float(lr)):
        raise ValueError(f"lr must be >= 0, got {lr}")


def check_betas(betas) -> tuple[float, float]:
    try:
        b1, b2 = (float(b) for b in betas)
    except (TypeError, ValueError):
        raise ValueError(f"betas must be a pair of numbers in [0, 1), got {betas!r}") from None
    for name, b in (("betas[0]", b1), ("betas[1]", b2)):
        if not 0.0 <= b < 1.0:
            raise ValueError(f"{name} must be in [0, 1), got {b}")
    return b1, b2


def check_positive(name: str, value) -> float:
    if not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        raise ValueError(f"{name} must be > 0, got {value!r}")
    return float(value)


def check_nonnegative(name: str, value) -> float:
    if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
        raise ValueError(f"{name} must be >= 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Variant:
    """One published form of an Adam-type update rule, as data: what it reproduces and where its update differs.

    ``name`` is what ``--optim_args variant=NAME`` selects: ``paper`` for the algorithm as a paper writes it, else
    the name of the public code it reproduces. ``denominator`` is the kind of
    :class:`~hf_dp.optim.transforms.AdamDenominator` (``eps_outside`` √v̂ + ε, ``eps_inside`` √(v̂ + ε),
    ``bias_corrected`` √max(v̂ − Φ, γ)); ``eps_outside_clamp``: ``bias_corrected`` plus ε outside the root.
    ``decay``: ``coupled`` (λθ_{t−1} added to g̃ before the moments), ``decoupled`` (−η_tλθ_{t−1}), ``of_updated``
    (θ_t = (1 − η_tλ)(θ_{t−1} − η_tΔ_t)). ``gamma``: the γ a bias-corrected form uses unless one is given."""

    name: str
    reproduces: str
    denominator: str
    decay: str
    eps_outside_clamp: bool = False
    gamma: float | None = None

    def uses_eps(self) -> bool:
        return self.denominator != "bias_corrected" or self.eps_outside_clamp

    def fusable(self) -> bool:
        """True if the update is torch's Adam (coupled decay) or AdamW (decoupled) kernel, ε outside the root or, by
        moving it into v, inside (``hf_dp.optim.dp_adam._AdamFamily``)."""
        return self.denominator in ("eps_outside", "eps_inside") and self.decay in ("coupled", "decoupled")


class StepContext:
    """What one ``step()`` of one param group hands from transform to transform."""

    def __init__(self, rule: "DPUpdateRule", group: dict, params: list[Tensor], states: list[dict]):
        self.rule = rule
        self.group = group
        self.params = params
        self.states = states
        self.extras: dict = {}
        self._temporary: list | None = None

    def mark_temporary(self, updates: list[Tensor]) -> list[Tensor]:
        """Declare ``updates`` a fresh list of temporaries (not g̃, not state): later pieces may write it."""
        self._temporary = updates
        return updates

    def is_temporary(self, updates: list[Tensor]) -> bool:
        return updates is self._temporary


class Transform:
    """One piece of an update rule: maps the list of updates to a new list (never in place on p.grad)."""

    def init_state(self, p: Tensor, state: dict) -> None:  # pragma: no cover - default no state
        pass

    def __call__(self, updates: list[Tensor], ctx: StepContext) -> list[Tensor]:
        raise NotImplementedError


class DPUpdateRule(torch.optim.Optimizer):
    """Base class: ``step()`` applies ``self.chain(group)`` to g̃ = ``p.grad`` then θ ← θ − η·u.

    Subclasses define ``chain(group) -> Sequence[Transform]`` and validate their hyper-parameters
    in ``__init__``. The privatizer attaches itself with :meth:`attach_privatizer` so that rules
    needing the noise scale (the BC variants, MacAdam) read the very σ, C and B used for noise.
    """

    #: name in the registry (set by :func:`hf_dp.optim.registry.register`)
    registry_name: str = ""
    #: the published forms of this rule (:class:`Variant`), the default first; () for a rule with one form
    variants: tuple[Variant, ...] = ()

    def __init__(self, params, defaults: dict):
        _check_lr(defaults.get("lr", 0.0))
        if "weight_decay" in defaults:
            check_nonnegative("weight_decay", defaults["weight_decay"])
        self._hyperparameter_names = tuple(defaults)  # the rule's own (torch adds keys of its own on load)
        super().__init__(params, defaults)  # every group goes through add_param_group → check_group
        self._noise_source: Callable[[], float] | None = None

    def add_param_group(self, param_group: dict) -> None:
        super().add_param_group(param_group)
        # per-group overrides (e.g. {"params": ..., "betas": ...}) are validated like the defaults
        self.check_group(self.param_groups[-1])

    def check_group(self, group: dict) -> None:
        """Validate one param group's hyper-parameters (raises ``ValueError`` naming the bad one); a rule with
        ``variants`` also checks the group's ``variant`` and fills a ``gamma`` left ``None`` with the variant's."""
        _check_lr(group["lr"])
        check_nonnegative("weight_decay", group.get("weight_decay", 0.0))
        if self.variants:
            variant = self.variant_of(group)
            if "gamma" in group and group["gamma"] is None:
                group["gamma"] = variant.gamma

    def variant_of(self, group: dict) -> Variant:
        """The :class:`Variant` param group ``group`` runs (the one validation of the ``variant`` hyper-parameter)."""
        name = group.get("variant", self.variants[0].name)
        for v in self.variants:
            if v.name == name:
                return v
        raise ValueError(f"{self.registry_name or type(self).__name__} has no variant {name!r}; "
                         f"choose one of: {', '.join(v.name for v in self.variants)}")

    def unused_hyperparameters(self, group: dict) -> set[str]:
        """Hyper-parameters this group holds that its update does not read (e.g. ``eps`` of a bias-corrected rule)."""
        return set() if not self.variants or self.variant_of(group).uses_eps() else {"eps"}

    def describe(self) -> dict:
        """The update rule as ``privacy.json`` and the model card record it: the rule's own hyper-parameters (its
        constructor's, with ``variant`` for a rule published in several forms) that the update reads, as the first
        param group holds them (tuples as lists)."""
        group = self.param_groups[0]
        skip = self.unused_hyperparameters(group) | {"params"}
        return {k: (list(group[k]) if isinstance(group[k], tuple) else group[k])
                for k in self._hyperparameter_names if k in group and k not in skip}

    def load_state_dict(self, state_dict) -> None:
        """torch's load (the checkpoint's groups replace these, hyper-parameters included: a resume continues the
        checkpoint's lr, betas, variant, …), then every group is completed and validated as at construction: a key the
        checkpoint predates takes this optimizer's default; ``authors_code`` (before ``variant``) becomes the variant."""
        super().load_state_dict(state_dict)
        for group in self.param_groups:
            if "authors_code" in group and self.variants:
                group.setdefault("variant", "adam_corr" if group.pop("authors_code") else self.variants[0].name)
            for k in self._hyperparameter_names:
                group.setdefault(k, self.defaults[k])
            self.check_group(group)

    # ----- link to the privatizer -------------------------------------------------------------
    def attach_privatizer(self, privatizer) -> None:
        """Called by the privatizer: Φ and friends come from its σ, C (clip space) and B."""
        self._noise_source = lambda: privatizer.noise_std_of_mean

    def noise_std_of_mean(self) -> float:
        """σ·C/B: the standard deviation of the noise in each coordinate of g̃ (one source of truth); with the
        privatizer's correlated noise (``--noise_mechanism banded_sqrt``) the std of the step just noised,
        σ·C·s·√V_n/B (:attr:`hf_dp.privacy.privatizer.PrivateOptimizer.noise_std_of_mean`)."""
        if self._noise_source is None:
            raise RuntimeError(
                f"{type(self).__name__} needs the noise scale σC/B: build it with hf_dp.optim.make_optimizer "
                "or wrap it in hf_dp.privacy.PrivateOptimizer"
            )
        return float(self._noise_source())

    # ----- per-sample hooks (identity by default) ---------------------------------------------
    #: norm that per-sample vectors are clipped to in clip space, as a multiple of the user's C
    #: (None: the user's C itself). MacAdam clips unit-norm vectors and returns 1.0 via ``clip_norm``.
    def clip_norm(self, max_grad_norm: float) -> float:
        return max_grad_norm

    @classmethod
    def has_per_sample_transform(cls) -> bool:
        """True if this rule changes per-example gradients before clipping."""
        return cls.to_clip_space is not DPUpdateRule.to_clip_space or cls.clip_norm is not DPUpdateRule.clip_norm

    @classmethod
    def ghost_compatible(cls) -> bool:
        """True if ghost clipping can compute this rule's clipped sum: no per-sample transform, or a
        public per-coordinate affine one described by :meth:`per_sample_affine`."""
        return not cls.has_per_sample_transform() or cls.per_sample_affine is not DPUpdateRule.per_sample_affine

    def per_sample_affine(self, params: Sequence[Tensor]) -> dict | None:
        """For a rule whose ``to_clip_space`` is g_i ↦ (g_i + o) ⊙ s with o, s computed from public
        state only (the same for every example): ``{param: (o, s)}`` (``None`` for an identity part;
        parameters with neither omitted). ``None`` for rules without a per-sample transform."""
        return None

    def to_clip_space(self, params: Sequence[Tensor], grad_samples: list[Tensor]) -> list[Tensor]:
        return grad_samples

    def from_clip_space(self, params: Sequence[Tensor]) -> None:
        """Map the noisy mean in clip space (in ``p.grad``) back to a gradient, in place."""
        return None

    # ----- the update ----------------------------------------------------------------------------
    def chain(self, group: dict) -> Sequence[Transform]:
        raise NotImplementedError

    def _init_state(self, p: Tensor, state: dict, transforms: Sequence[Transform]) -> None:
        state["step"] = 0
        for t in transforms:
            t.init_state(p, state)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            transforms = self.chain(group)
            states = []
            for p in params:
                st = self.state[p]
                if len(st) == 0:
                    self._init_state(p, st, transforms)
                st["step"] += 1
                states.append(st)
            ctx = StepContext(self, group, params, states)
            if not self.fused_group_step(ctx):
                updates = [p.grad for p in params]
                for t in transforms:
                    updates = t(updates, ctx)
                torch._foreach_add_(params, updates, alpha=-float(group["lr"]))
            self.after_group_step(ctx)
        self.after_step()
        return loss

    def fused_group_step(self, ctx: StepContext) -> bool:
        """Optional fast path: apply the whole chain and θ ← θ − η·u to ``ctx.params`` with one fused
        kernel, returning True; it must compute the same update as the chain (up to float rounding,
        tested) and leave g̃_t in ``p.grad``. The default returns False: the chain runs."""
        return False

    def after_group_step(self, ctx: StepContext) -> None:
        """Hook for rules that keep extra statistics (e.g. the BC clamp rate)."""

    def after_step(self) -> None:
        """Hook run once after all groups (e.g. MacAdam's global clipping-bound refresh)."""
