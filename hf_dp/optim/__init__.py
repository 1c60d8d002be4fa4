"""DP optimizers: update rules built from small transforms, registered by name.

Importable without transformers. ``make_optimizer(name, params, noise_multiplier=σ,
max_grad_norm=C, expected_batch_size=B, **hyper)`` returns the privatizer wrapping the rule.

Dependencies are one-way: each rule file imports ``registry`` (a leaf) to register itself; this package
imports the rule files (filling the registry) and ``build`` (which reads the registry).
"""

from .base import DPUpdateRule, Transform
from .registry import get_entry, is_dp_optimizer, optimizer_names, register

from . import dp_adam, dp_adambc, dp_adamw, dp_adamw_bc, dp_macadam, dp_sgd, dp_sgd_l2  # noqa: E402,F401  (register)
from .build import make_optimizer, rule_hyperparameters  # noqa: E402

DP_OPTIMIZERS = optimizer_names()

__all__ = [
    "DPUpdateRule", "Transform", "get_entry", "is_dp_optimizer", "make_optimizer", "optimizer_names", "register",
    "rule_hyperparameters", "DP_OPTIMIZERS",
]
