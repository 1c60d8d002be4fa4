"""A copy of an instrumented model is a plain model of its own (``copy.deepcopy``, ``pickle``, ``torch.save(model)``).

The engines instrument the user's model in place: ghost clipping replaces the ``forward`` of each trainable layer on
the instance (:func:`hf_dp.clipping.registry.patch_forward`, :func:`~hf_dp.clipping.registry.without_parameter_gradients`)
and adds forward hooks, the batch hooks of :func:`hf_dp.clipping.hooks.install_batch_hooks` sit on the model, and
Opacus (``--clipping hooks``) adds hooks and attributes. These are closures over the original module, its clipper and
its records: copied as they are, a deep copy's layers computed with the *original's* weights and put their gradients
on the original's parameters (issue 49, item 5: logits 1.27 off a clean model with the copy's weights), and a pickle
failed on the closures.

:func:`note_patch` and :func:`note_hooks` (called where the engines instrument) give every module that carries such
instrumentation a :class:`_CopyGuard` as its instance-level ``__reduce_ex__``, which pickle and ``copy.deepcopy`` look
up on the instance (not ``__deepcopy__``: a wrapper that forwards unknown attributes to the module it wraps, as PEFT's
do, would copy itself with the inner module's). The copy (or the pickle) is made from the module's state without the
engines' hooks, without their forward patches (the forward the module had before them: its class's, as a rule) and
without Opacus' attributes; the original is not touched and stays instrumented. So a copy is a plain model: it
computes with its own weights, gets autograd's gradients on its own parameters, carries no engine (a DPTrainer on it
instruments it afresh) and keeps what else the model carries (its ledger, :mod:`hf_dp.run.lineage`).
"""

from __future__ import annotations

import copyreg
import weakref
from collections import OrderedDict

from torch import nn
from torch.utils.hooks import RemovableHandle

__all__ = ["note_patch", "drop_patch", "note_hooks"]

#: the hook tables of ``nn.Module`` (the last three are keyed by the same handle ids as the first ones)
_HOOK_TABLES = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
                "_forward_hooks_with_kwargs", "_forward_pre_hooks_with_kwargs", "_forward_hooks_always_called")
_GUARD = "__reduce_ex__"


class _CopyGuard:
    """What the engines put on one module (hook ids, forward patches, attribute names); called as the module's
    ``__reduce_ex__``, its reduction without them (``copy.deepcopy`` rebuilds the module from it, as pickle does)."""

    def __init__(self, module: nn.Module):
        self._module = weakref.ref(module)  # no reference cycle through the module's own __dict__
        self.hook_ids: set[int] = set()
        self.patches: dict[int, tuple] = {}  # id(installed forward) -> (installed forward, the forward before it)
        self.attrs: set[str] = set()

    def plain_state(self, module: nn.Module) -> dict:
        state = module.__getstate__()  # nn.Module's: a copy of __dict__
        state = dict(state) if isinstance(state, dict) else dict(module.__dict__)
        for name in (_GUARD, *self.attrs):
            state.pop(name, None)
        forward = state.get("forward")
        while forward is not None and self.patches.get(id(forward), (None,))[0] is forward:
            forward = self.patches[id(forward)][1]
        if forward is None:
            state.pop("forward", None)
        else:
            state["forward"] = forward
        for name in _HOOK_TABLES:
            table = state.get(name)
            if table and not self.hook_ids.isdisjoint(table):
                state[name] = OrderedDict((k, v) for k, v in table.items() if k not in self.hook_ids)
                if name == "_backward_hooks" and not state[name]:
                    state["_is_full_backward_hook"] = None
        return state

    def __call__(self, protocol):
        module = self._module()
        return copyreg.__newobj__, (type(module),), self.plain_state(module)


def _guard(module: nn.Module) -> _CopyGuard:
    guard = module.__dict__.get(_GUARD)
    if not isinstance(guard, _CopyGuard) or guard._module() is not module:
        guard = _CopyGuard(module)
        module.__dict__[_GUARD] = guard
    return guard


def note_patch(module: nn.Module, forward, previous) -> None:
    """``module.forward`` was set on the instance to ``forward`` (``previous``: what the instance had before, or
    ``None``): a copy gets ``previous`` (through any number of such patches), or its class's forward."""
    _guard(module).patches[id(forward)] = (forward, previous)


def drop_patch(module: nn.Module, forward) -> None:
    """The patch ``forward`` was removed from ``module``."""
    guard = module.__dict__.get(_GUARD)
    if isinstance(guard, _CopyGuard):
        guard.patches.pop(id(forward), None)


def note_hooks(model: nn.Module, handles, attrs=()) -> None:
    """The hooks of ``handles`` (``RemovableHandle``; anything else is skipped) were registered on modules of
    ``model``: a copy of each such module has none of them, nor the attributes named in ``attrs``."""
    ids = {h.id for h in handles if isinstance(h, RemovableHandle)}
    if not ids:
        return
    for module in model.modules():
        own = {k for name in _HOOK_TABLES for k in (module.__dict__.get(name) or ()) if k in ids}
        if own:
            guard = _guard(module)
            guard.hook_ids |= own
            guard.attrs |= set(attrs)
