"""Model-side pieces of hf_dp: which parameters train, and how the frozen part runs.

* :func:`apply_trainable` / :class:`TrainableInfo` / :data:`TRAINABLE_MODES`
  / :func:`check_trainable` / :func:`suffix_blocks` / :func:`lora_config_of` (``hf_dp.models.freezing``):
  freezing policy (``last_block``, ``last_k:K``, ``head``, ``all``, ``bias``, ``lora``).

Per-sample gradients and clipping (Opacus hooks, ghost clipping) are in :mod:`hf_dp.clipping`.
"""

from .freezing import (TRAINABLE_MODES, TrainableInfo, apply_trainable, check_trainable, lora_config_of, lora_targets,
                       suffix_blocks)

__all__ = [
    "apply_trainable",
    "TrainableInfo",
    "TRAINABLE_MODES",
    "check_trainable",
    "lora_config_of",
    "lora_targets",
    "suffix_blocks",
]
