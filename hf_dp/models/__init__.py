"""Model-side pieces of hf_dp: which parameters train, and per-sample gradients.

* :func:`apply_trainable` / :class:`TrainableInfo` / :data:`TRAINABLE_MODES`
  / :func:`check_trainable` / :func:`suffix_blocks` (``hf_dp.models.freezing``):
  freezing policy (``last_block``, ``last_k:K``, ``head``, ``all``, ``bias``, ``lora``).
* :func:`attach_grad_sampler` / :class:`GradSamplerHandle` /
  :func:`assert_grad_samples_complete` / :func:`unwrap_for_save`
  (``hf_dp.models.grad_sample``): Opacus per-sample-gradient hooks on the
  plain model, their validation, and the model to save.
"""

from .freezing import TRAINABLE_MODES, TrainableInfo, apply_trainable, check_trainable, suffix_blocks
from .grad_sample import (
    GradSamplerHandle,
    assert_grad_samples_complete,
    attach_grad_sampler,
    unwrap_for_save,
)

__all__ = [
    "apply_trainable",
    "TrainableInfo",
    "TRAINABLE_MODES",
    "check_trainable",
    "suffix_blocks",
    "attach_grad_sampler",
    "GradSamplerHandle",
    "assert_grad_samples_complete",
    "unwrap_for_save",
]
