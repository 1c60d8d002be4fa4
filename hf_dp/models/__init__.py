"""Model-side pieces of hf_dp: which parameters train, and how the frozen part runs.

* :func:`apply_trainable` / :class:`TrainableInfo` / :data:`TRAINABLE_MODES`
  / :func:`check_trainable` / :func:`suffix_blocks` / :func:`lora_config_of` (``hf_dp.models.freezing``):
  freezing policy (``last_block``, ``last_k:K``, ``head``, ``all``, ``bias``, ``lora``).
* :func:`check_full_precision` / :func:`model_init_kwargs` (``hf_dp.models.precision``): every weight the forward
  reads in float32 or float64 under DP; models loaded by name in float32.

Per-sample gradients and clipping (Opacus hooks, ghost clipping) are in :mod:`hf_dp.clipping`.
"""

from .freezing import (TRAINABLE_MODES, TrainableInfo, apply_trainable, check_trainable, lora_config_of, lora_targets,
                       suffix_blocks)
from .precision import check_full_precision, model_init_kwargs

__all__ = [
    "apply_trainable",
    "TrainableInfo",
    "TRAINABLE_MODES",
    "check_trainable",
    "lora_config_of",
    "lora_targets",
    "suffix_blocks",
    "check_full_precision",
    "model_init_kwargs",
]
