"""Which trainable layer types ghost clipping handles, and how: one registry, the single source of truth.

Ghost clipping (:mod:`hf_dp.clipping.ghost`) names no layer type. For every module with trainable parameters,
:meth:`~hf_dp.clipping.ghost.GhostClipper.check_supported` asks :func:`layer_type_for` for the registered
:class:`GhostLayerType`; the clipper then calls that entry's :meth:`~GhostLayerType.instrument` (what the
backward must record) and its :meth:`~GhostLayerType.terms` (each example's squared gradient norm and the
clipped sum). A module no entry handles is refused, and ``--clipping auto`` falls back to the Opacus hooks.

Adding a layer type is one new file (``linear.py``, ``layernorm.py`` and ``embedding.py`` are the examples)::

    @register_layer(MyLayer)
    class MyLayerType(GhostLayerType):
        def terms(self, layer, scale, affine, dt, work):
            x, g = cat_records(layer.records, scale, dt)   # its inputs and output gradients, [B, T, ·]
            ...                                            # per-example gradient of each parameter
            return sq, clipped                             # ‖v_i‖² [B], and c -> {param: Σ_i c_i v_i}

imported in ``hf_dp/clipping/__init__.py`` (or by the code that uses the layer). The default
:meth:`~GhostLayerType.instrument` records (input, output gradient) per call with a forward hook, which is what a
layer whose per-example gradient is a function of those two needs; override it to record something else or to
avoid the autograd weight gradient (``linear.py``); record only while :func:`recording` ``(module, layer)`` says so
(DPTrainer pauses each clipper outside its training steps), and while it does not, call the forward the module had
before the patch. Patch a forward with :func:`patch_forward` and return every hook's handle: a copy of the model
(``copy.deepcopy``, a pickle) is then made without them (:mod:`hf_dp.clipping.copies`). Test the new type against
the per-example loop (``tests/test_ghost_clipping.py``, ``tests/test_clipping_registry.py``).

A module is matched by its class's MRO: the entry of the most specific registered class wins (so a subclass can
get its own entry). :func:`unregister_layer` removes an entry. A family of classes that share no base class —
transformers defines one ``RMSNorm`` class per model family (``LlamaRMSNorm``, ``MistralRMSNorm``, …) — is matched
by a predicate instead (:func:`register_matcher`), consulted only when no class of the MRO is registered; the
entry's :meth:`~GhostLayerType.check` then verifies what the predicate could only guess (``rmsnorm.py``).

An entry may cover several modules that share a parameter (:meth:`GhostLayerType.members`): the tied input/output
embeddings (``tied.py``) are one :class:`Layer` whose records come from both modules.
"""

from __future__ import annotations

import torch
from torch import nn

from . import copies

__all__ = ["GhostLayerType", "Layer", "register_layer", "unregister_layer", "register_matcher", "unregister_matcher",
           "layer_type_for", "registered_layers", "patch_forward", "without_parameter_gradients", "recording"]

_REGISTRY: dict[type, "GhostLayerType"] = {}
_MATCHERS: list = []  # (predicate, entry), consulted in order after the MRO


def recording(module: nn.Module, layer: "Layer | None" = None) -> bool:
    """Whether an instrumented module's call is recorded for ``layer`` (and, for the types that skip it, computes no
    weight gradient): training mode, gradients enabled, and ``layer``'s clipper not paused
    (:meth:`GhostClipper.pause <hf_dp.clipping.ghost.GhostClipper.pause>` — per clipper, so a second clipper on the
    same model records only for itself). Every entry's instrumentation asks this."""
    return module.training and torch.is_grad_enabled() and not (layer is not None and layer.state["paused"])


class GhostLayerType:
    """How ghost clipping handles one type of trainable layer (subclass it and decorate with :func:`register_layer`)."""

    #: a short name for messages (the class name without ``Type`` if not set)
    name: str = ""

    #: for an entry covering several modules (:meth:`members`): the tag each member's records carry as their last
    #: element, in the order of :meth:`members` (``None``: one module, untagged records)
    record_tags: tuple | None = None

    def check(self, module: nn.Module, name: str) -> None:
        """Raise ``ValueError`` if this module uses an option ghost clipping cannot handle (default: none)."""

    def members(self, module: nn.Module) -> list:
        """The modules whose parameters and records this entry handles as one layer (default: ``[module]``)."""
        return [module]

    def instrument(self, layer: "Layer") -> list:
        """Make a one-pass backward append what :meth:`terms` needs to ``layer.records``; return handles with
        ``remove()``. Default: a forward hook that records (input, output gradient) of every training-mode call.
        (Two passes use the same recording for every type, see :class:`~hf_dp.clipping.ghost.GhostClipper`.)"""

        def fwd_hook(module, args, out, _rec=layer.records):
            if not recording(module, layer) or not out.requires_grad:
                return
            x = args[0].detach()
            out.register_hook(lambda g, _x=x: _rec.append((_x, g)))

        return [layer.module.register_forward_hook(fwd_hook)]

    def terms(self, layer: "Layer", scale: float, affine: dict, dt: torch.dtype, work):
        """(‖v_i‖² over this layer's trainable parameters [B], function c -> {param: Σ_i c_i v_i}) from
        ``layer.records`` (the output gradients are divided by ``scale``, the loss scale, first).

        v_i = (∇ℓ_i + o) ⊙ s per parameter with (o, s) = :func:`~hf_dp.clipping.common.affine_of` ``(affine, p)``
        (default: v_i = ∇ℓ_i); ``dt``: the working precision (float32 or float64); ``work``: the
        :class:`~hf_dp.clipping.common.Workspace` of this collection (Gram cache, materialisation budget).

        ‖v_i‖² should be an upper bound of the exact value, in float64, allowing for the rounding and underflow of
        the products it is computed from (:func:`~hf_dp.clipping.common.dense_sq` for a per-example vector that is
        itself what ``clipped`` sums, :func:`~hf_dp.clipping.common.summed_sq`, :func:`~hf_dp.clipping.common.gram_bound`;
        "Norms are upper bounds" in :mod:`hf_dp.clipping.ghost`)."""
        raise NotImplementedError


class Layer:
    """One trainable module under ghost clipping: its registered type and what its backward recorded."""

    def __init__(self, module: nn.Module, ltype: GhostLayerType):
        self.module = module
        self.type = ltype
        self.modules = ltype.members(module)  # usually [module]; both modules of a tied pair
        self.records: list = []  # appended during backward (one-pass: by the type's instrumentation)
        self.state = {"paused": False}  # GhostClipper.pause (shared with the members' views of a tied pair)
        self.calls = 0  # two-pass: forward calls since the last clear
        self.done = False  # two-pass: norms computed in this pass 1

    @property
    def kind(self) -> str:
        return self.type.name

    def params(self):
        out, seen = [], set()
        for m in self.modules:
            for p in m.parameters(recurse=False):
                if p.requires_grad and id(p) not in seen:
                    seen.add(id(p))
                    out.append(p)
        return out


def register_layer(*module_types: type):
    """Class decorator: ghost clipping handles modules of ``module_types`` (and their subclasses) with an
    instance of the decorated :class:`GhostLayerType` subclass. Re-registering a module type replaces its entry."""
    types = tuple(t for t in module_types if isinstance(t, type))  # an optional dependency may give ()

    def deco(cls):
        entry = _entry_of(cls)
        for t in types:
            _REGISTRY[t] = entry
        return cls

    return deco


def unregister_layer(*module_types: type) -> None:
    """Remove the entries of ``module_types`` (ghost clipping then refuses such trainable modules)."""
    for t in module_types:
        _REGISTRY.pop(t, None)


def _entry_of(cls) -> "GhostLayerType":
    if not (isinstance(cls, type) and issubclass(cls, GhostLayerType)):
        raise TypeError(f"a GhostLayerType subclass is needed, got {cls!r}")
    entry = cls()
    if not entry.name:
        entry.name = cls.__name__.removesuffix("Type").lower()
    return entry


def register_matcher(predicate):
    """Class decorator: ghost clipping handles every module for which ``predicate(module)`` is true and whose MRO
    has no registered class, with an instance of the decorated :class:`GhostLayerType` subclass (for a family of
    classes without a common base, e.g. transformers' per-model ``*RMSNorm``; the entry's ``check`` should verify
    the module's computation, since a predicate can only look at names and shapes)."""

    def deco(cls):
        _MATCHERS.append((predicate, _entry_of(cls)))
        return cls

    return deco


def unregister_matcher(predicate) -> None:
    """Remove the entries registered with ``predicate``."""
    _MATCHERS[:] = [(p, e) for p, e in _MATCHERS if p is not predicate]


def layer_type_for(module: nn.Module) -> GhostLayerType | None:
    """The entry of the most specific registered class in ``type(module).__mro__``, else of the first matcher whose
    predicate accepts the module (:func:`register_matcher`), or ``None``."""
    for cls in type(module).__mro__:
        entry = _REGISTRY.get(cls)
        if entry is not None:
            return entry
    for predicate, entry in _MATCHERS:
        if predicate(module):
            return entry
    return None


def registered_layers() -> dict[type, GhostLayerType]:
    """A copy of the registry: module class -> entry."""
    return dict(_REGISTRY)


class _ForwardPatch:
    """An instance-level ``forward`` override, undone by :meth:`remove` (the handle :func:`patch_forward` returns). A
    copy of the module (``copy.deepcopy``, a pickle) runs the forward it had before (:mod:`hf_dp.clipping.copies`):
    the patch names the original module, whose weights a copy must not compute with."""

    def __init__(self, module: nn.Module, forward):
        self.module, self.old, self.forward = module, module.__dict__.get("forward"), forward
        module.forward = forward
        copies.note_patch(module, forward, self.old)

    def remove(self) -> None:
        copies.drop_patch(self.module, self.forward)
        if self.old is None:
            self.module.__dict__.pop("forward", None)
        else:
            self.module.forward = self.old


def patch_forward(module: nn.Module, forward) -> _ForwardPatch:
    """Replace ``module.forward`` on the instance by ``forward``; ``remove()`` on the result restores it."""
    return _ForwardPatch(module, forward)


def without_parameter_gradients(module: nn.Module, layer: "Layer | None" = None) -> _ForwardPatch:
    """Make the module's training forward compute no gradient for its own parameters (they enter it detached), so
    autograd skips their weight-gradient products and, under FSDP2, no parameter of the layer has a gradient to
    reduce-scatter — for a layer whose per-example gradients come from its records alone (one pass: the
    normalisation layers). The output still needs a gradient (the records hold it): when no tensor input requires
    one, the first tensor input is made a leaf that does. ``remove()`` on the result restores the forward."""
    inner = module.__dict__.get("forward") or type(module).forward.__get__(module)

    def forward(*args, _m=module, _inner=inner, **kwargs):
        if not recording(_m, layer):
            return _inner(*args, **kwargs)
        tensors = [v for v in (*args, *kwargs.values()) if torch.is_tensor(v)]
        if tensors and not any(t.requires_grad for t in tensors) and tensors[0].is_floating_point():
            first = tensors[0]
            promoted = first.detach().requires_grad_(True)
            args = tuple(promoted if v is first else v for v in args)
            kwargs = {k: promoted if v is first else v for k, v in kwargs.items()}
        saved = dict(_m._parameters)
        try:
            for name, p in saved.items():
                if p is not None:
                    _m._parameters[name] = p.detach()
            return _inner(*args, **kwargs)
        finally:
            _m._parameters.update(saved)

    return _ForwardPatch(module, forward)
