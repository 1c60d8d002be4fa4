"""Per-example clipping: the engines DPTrainer hands each micro-batch to, and ghost clipping's layer types.

* :mod:`hf_dp.clipping.engines` — the engine protocol (``hooks``, ``ghost``, ``ghost_two_pass``) and
  ``--clipping auto`` (:func:`choose_engine`, :func:`make_engine`).
* :mod:`hf_dp.clipping.ghost` — :class:`GhostClipper` (one or two backward passes), :func:`clip_factors`.
* :mod:`hf_dp.clipping.registry` — which trainable layer types ghost clipping handles (:func:`register_layer`),
  one file per type: :mod:`hf_dp.clipping.linear` (``nn.Linear``, ``Conv1D``), :mod:`hf_dp.clipping.layernorm`,
  :mod:`hf_dp.clipping.rmsnorm` (``nn.RMSNorm`` and transformers' per-family ``*RMSNorm``),
  :mod:`hf_dp.clipping.embedding`, :mod:`hf_dp.clipping.tied` (tied input/output embeddings);
  :mod:`hf_dp.clipping.common` holds what they share (incl. the regrouping of records by privacy unit).
* :mod:`hf_dp.clipping.hooks` — Opacus per-sample gradients on the plain model (:func:`attach_grad_sampler`),
  their check, the batch hooks every engine installs, and the model to save (:func:`unwrap_for_save`).

Imports: torch, Opacus, transformers, :mod:`hf_dp.models.hints`; never the trainer (the engines take the
optimizer as an argument).
"""

from . import embedding, layernorm, linear, rmsnorm, tied  # noqa: F401  (the layer files register themselves)
from .engines import ENGINES, ClippingEngine, choose_engine, make_engine
from .ghost import NORM_MARGIN, GhostClipper, clip_factors
from .hooks import GradSamplerHandle, assert_grad_samples_complete, attach_grad_sampler, install_batch_hooks, unwrap_for_save
from .registry import GhostLayerType, layer_type_for, register_layer, register_matcher, registered_layers, unregister_layer, unregister_matcher

__all__ = [
    "ClippingEngine",
    "ENGINES",
    "choose_engine",
    "make_engine",
    "GhostClipper",
    "clip_factors",
    "NORM_MARGIN",
    "GhostLayerType",
    "register_layer",
    "unregister_layer",
    "register_matcher",
    "unregister_matcher",
    "layer_type_for",
    "registered_layers",
    "GradSamplerHandle",
    "attach_grad_sampler",
    "assert_grad_samples_complete",
    "install_batch_hooks",
    "unwrap_for_save",
]
