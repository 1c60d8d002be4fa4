"""Privacy mechanism pieces: accounting (Opacus accountants), Poisson sampling, the privatizer."""

from .accounting import (
    ACCOUNTANTS,
    PrivacyLedger,
    PrivacySpec,
    calibrate_noise_multiplier,
    check_delta,
    check_epsilon,
    compute_epsilon,
)
from .privatizer import PrivacyBudgetExceeded, PrivateOptimizer
from .sampler import PoissonBatchSampler

__all__ = [
    "ACCOUNTANTS",
    "PrivacyLedger",
    "PrivacySpec",
    "calibrate_noise_multiplier",
    "check_delta",
    "check_epsilon",
    "compute_epsilon",
    "PrivacyBudgetExceeded",
    "PrivateOptimizer",
    "PoissonBatchSampler",
]
