"""DP optimizers: update rules built from small transforms, registered by name.

Importable without transformers. ``make_optimizer(name, params, noise_multiplier=σ,
max_grad_norm=C, expected_batch_size=B, **hyper)`` returns the privatizer wrapping the rule.
"""

from .base import DPUpdateRule, Transform
from .registry import get_entry, is_dp_optimizer, make_optimizer, optimizer_names, register

DP_OPTIMIZERS = optimizer_names()

__all__ = ["DPUpdateRule", "Transform", "get_entry", "is_dp_optimizer", "make_optimizer", "optimizer_names", "register", "DP_OPTIMIZERS"]
