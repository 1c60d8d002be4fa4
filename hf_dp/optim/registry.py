"""The optimizer registry: the single source of truth for DP optimizer names.

``register`` is used as a class decorator by each optimizer file; the trainer, the argument
parser, the recipes and the docs all read names from here.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptimizerEntry:
    name: str
    rule_cls: type
    source: str
    summary: str


_REGISTRY: dict[str, OptimizerEntry] = {}


def register(name: str, *, source: str, summary: str):
    def deco(cls):
        if name in _REGISTRY:
            raise ValueError(f"optimizer {name!r} is already registered")
        cls.registry_name = name
        _REGISTRY[name] = OptimizerEntry(name, cls, source, summary)
        return cls

    return deco


def optimizer_names() -> tuple[str, ...]:
    _load_builtin()
    return tuple(_REGISTRY)


def get_entry(name: str) -> OptimizerEntry:
    _load_builtin()
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown DP optimizer {name!r}; choose one of {', '.join(_REGISTRY)}") from None


def is_dp_optimizer(name) -> bool:
    _load_builtin()
    return str(getattr(name, "value", name)) in _REGISTRY


def make_optimizer(
    name: str,
    params,
    *,
    noise_multiplier: float,
    max_grad_norm: float,
    expected_batch_size: float,
    noise_seed: int | None = None,
    secure_mode: bool = False,
    ledger=None,
    **hyperparameters,
):
    """Build DP optimizer ``name``: its update rule wrapped in the privatizer.

    ``hyperparameters`` go to the update rule (lr, betas, eps, weight_decay, momentum, gamma, h1, h2,
    …); σ, C and B go to the privatizer, which hands the rule the noise scale it needs.
    """
    from hf_dp.privacy.privatizer import PrivateOptimizer

    rule_cls = get_entry(name).rule_cls
    extra = {}
    if hasattr(rule_cls, "privatizer_kwargs"):
        extra = rule_cls.privatizer_kwargs(max_grad_norm=max_grad_norm, hyperparameters=hyperparameters)
    rule = rule_cls(params, **hyperparameters)
    return PrivateOptimizer(
        rule,
        noise_multiplier=noise_multiplier,
        max_grad_norm=max_grad_norm,
        expected_batch_size=expected_batch_size,
        noise_seed=noise_seed,
        secure_mode=secure_mode,
        ledger=ledger,
        **extra,
    )


_loaded = False


def _load_builtin() -> None:
    global _loaded
    if not _loaded:
        _loaded = True
        from . import dp_adam, dp_adambc, dp_adamw, dp_adamw_bc, dp_macadam, dp_sgd, dp_sgd_l2  # noqa: F401
