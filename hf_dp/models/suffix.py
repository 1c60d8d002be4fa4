"""The suffix forward: run a model from cached hidden states (the input of its last block, or of its K-th last block
with ``suffix_blocks=K``), skipping the prefix.

Used with :mod:`hf_dp.models.prefix_cache`, whose :class:`~hf_dp.models.prefix_cache.CachedFeatures`
hold, per example, the states that enter the first suffix block (``blocks[-K]``; K = 1 unless
``--trainable last_k:K``).  Inside :func:`suffix_forward`,
``model(hf_dp_cached_hidden=h, attention_mask=m, [labels=...])`` returns the output the full model would
return (with an eval-mode prefix) while skipping the prefix.  Outside the context (and inside it, for
calls without ``hf_dp_cached_hidden``) the model is unchanged.

How the suffix forward works (generic, the model's own code still runs; the structure comes from
:func:`hf_dp.models.architecture.discover`):

* A forward pre-hook on the top model pops ``hf_dp_prefix_signature`` (the cache's signature id, per row) and
  refuses it when it is not this model's prefix (another model, depth, checkpoint or ``suffix_blocks``); then it pops
  ``hf_dp_cached_hidden`` and passes placeholder
  ``input_ids`` of the right shape (pad id where the mask is 0) so that the model's own forward builds
  the attention mask, and the other inputs as given.
* The modules of the base model that run before the blocks (``embeddings``, ELECTRA's
  ``embeddings_project``) return a zero placeholder of their real output shape/dtype; the frozen blocks
  ``blocks[:-K]`` return their input unchanged in the output structure a real call returns (learned
  from one real call); a forward pre-hook on ``blocks[-K]`` replaces its ``hidden_states`` input by
  the cached states.  The last K blocks, pooler and head then run normally (in train mode if the model
  is), so Opacus' per-sample-gradient hooks on them work as usual.
* **First-token-only last block** (automatic where it is exact, :mod:`hf_dp.models.first_token`): the
  last block runs for position 0 only when the head reads nothing else (``first_token_only``).
* These are instance-level ``forward`` overrides and hooks installed on entry and removed on exit; the
  ``state_dict`` never changes (``save_pretrained`` works inside and after the context).

On entry, :func:`suffix_forward` runs one tiny dummy batch (2 x 8 tokens, one row right-padded)
through the full model and through the cached path and raises :class:`PrefixCacheError` if the logits
differ, if a block is not called exactly once per forward (ALBERT's shared layer group), if a
parameter computed before the first suffix block (``blocks[-K]``) is trainable (the cache would be stale), or if the blocks'
outputs have an unknown structure.  Verified: BERT (incl. MiniLM), RoBERTa, ELECTRA (with and without
``embeddings_project``), DistilBERT.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Any, Callable, Iterator

import torch
from torch import nn

from .architecture import (
    ACTIVE_SUFFIX,
    PrefixCacheError,
    StructurePlan,
    arch_name,
    discover,
    eval_logits,
    hidden_arg,
    logits_match,
)
from .first_token import first_token_block

__all__ = ["CACHED_HIDDEN_KEY", "PREFIX_SIGNATURE_KEY", "signature_id", "suffix_forward", "run_suffix"]

CACHED_HIDDEN_KEY = "hf_dp_cached_hidden"
#: batch key: per row, the :func:`signature_id` of the cache's
#: :attr:`~hf_dp.models.prefix_cache.CachedFeatures.prefix_signature` (a ``[batch]`` int64 tensor, which loaders,
#: collators and Accelerate's split / gather / broadcast handle like any other column; a string would not broadcast)
PREFIX_SIGNATURE_KEY = "hf_dp_prefix_signature"
_SIGNATURES: dict[int, str] = {}  # id -> signature, for error messages


def signature_id(signature: str) -> int:
    """The 63-bit id of a prefix signature that batches carry (the first 8 bytes of its SHA-256)."""
    i = int.from_bytes(hashlib.sha256(signature.encode()).digest()[:8], "big") >> 1
    _SIGNATURES.setdefault(i, signature)
    return i


_TOKEN_INPUTS = ("input_ids", "inputs_embeds")


class _Patches:
    """Hooks + instance ``forward`` overrides of one active :func:`suffix_forward` context."""

    def __init__(self, model: nn.Module, plan: StructurePlan):
        self.model = model
        self.plan = plan
        self.state = plan.state
        self.signature_id = signature_id(plan.prefix_signature)  # what this model's cached batches carry
        self.handles: list = []
        self.overrides: list[tuple[nn.Module, Callable, bool, Any]] = []  # (module, new, had_instance_attr, old)

    # -- installed pieces ---------------------------------------------------------------------------
    def _top_pre_hook(self, _module, args, kwargs):
        signature = kwargs.pop(PREFIX_SIGNATURE_KEY, None)
        if signature is not None:
            expected = self.signature_id
            ids = torch.as_tensor(signature).reshape(-1)
            if ids.numel() and bool((ids != expected).any()):
                got = int(ids[ids != expected][0])
                raise PrefixCacheError(
                    f"this batch comes from a prefix cache of {_SIGNATURES.get(got, f'signature id {got}')}, but the "
                    f"model runs from the input of {self.plan.prefix_signature}: rebuild the cache for this model with "
                    f"suffix_blocks={self.plan.suffix_blocks} (or run the suffix with the suffix_blocks it was built with)"
                )
        if CACHED_HIDDEN_KEY not in kwargs:
            return (args, kwargs) if signature is not None else None
        if self.state["hidden"] is not None:
            raise RuntimeError("suffix_forward: nested cached forward passes are not supported")
        hidden = kwargs.pop(CACHED_HIDDEN_KEY)
        if args or any(kwargs.get(k) is not None for k in _TOKEN_INPUTS):
            raise ValueError(f"pass either {CACHED_HIDDEN_KEY}=... or input_ids/inputs_embeds, not both")
        if not torch.is_tensor(hidden) or hidden.dim() != 3 or hidden.shape[-1] != self.plan.hidden_size:
            raise ValueError(
                f"{CACHED_HIDDEN_KEY} must be a [batch, seq_len, {self.plan.hidden_size}] tensor, got "
                f"{tuple(hidden.shape) if torch.is_tensor(hidden) else type(hidden).__name__}"
            )
        batch, seq = hidden.shape[:2]
        mask = kwargs.get("attention_mask")
        if mask is None:
            mask = torch.ones((batch, seq), dtype=torch.long, device=hidden.device)
            kwargs["attention_mask"] = mask
        elif tuple(mask.shape) != (batch, seq):
            raise ValueError(f"attention_mask {tuple(mask.shape)} does not match {CACHED_HIDDEN_KEY} {tuple(hidden.shape)}")
        ids = torch.full((batch, seq), self.plan.filler_id, dtype=torch.long, device=hidden.device)
        ids[mask == 0] = self.plan.pad_id
        kwargs["input_ids"] = ids
        self.state["hidden"] = hidden
        self.state["mask"] = mask
        return args, kwargs

    def _top_post_hook(self, _module, _args, _output):
        self.state["hidden"] = None
        self.state["mask"] = None

    def _last_pre_hook(self, _module, args, kwargs):
        cached = self.state["hidden"]
        if cached is None:
            return None
        current, key = hidden_arg(args, kwargs)
        if current is None or current.shape[:2] != cached.shape[:2]:
            raise RuntimeError(
                f"suffix_forward: the first suffix block received {None if current is None else tuple(current.shape)}, "
                f"expected [{cached.shape[0]}, {cached.shape[1]}, ...]"
            )
        cached = cached.to(device=current.device, dtype=current.dtype)
        if key == 0:
            args = (cached,) + tuple(args[1:])
        else:
            kwargs = dict(kwargs)
            kwargs[key] = cached
        return args, kwargs

    def _make_input_forward(self, orig: Callable, dim: int, dtype: torch.dtype) -> Callable:
        state = self.state

        def forward(*args, **kwargs):
            cached = state["hidden"]
            if cached is None:
                return orig(*args, **kwargs)
            return torch.zeros((cached.shape[0], cached.shape[1], dim), dtype=dtype, device=cached.device)

        return forward

    def _make_block_forward(self, orig: Callable) -> Callable:
        state = self.state
        kind = self.plan.block_output

        def forward(*args, **kwargs):
            if state["hidden"] is None:
                return orig(*args, **kwargs)
            hidden, _ = hidden_arg(args, kwargs)
            if kind == "tensor":
                return hidden
            return (hidden,) + (None,) * (kind - 1)

        return forward

    def _make_first_token_forward(self, orig: Callable) -> Callable:
        state = self.state
        kind = self.plan.block_output
        layer = self.plan.blocks[-1]

        def forward(*args, **kwargs):
            if state["hidden"] is None:
                return orig(*args, **kwargs)
            hidden, _ = hidden_arg(args, kwargs)
            out = first_token_block(layer, hidden, state["mask"])
            return out if kind == "tensor" else (out,) + (None,) * (kind - 1)

        return forward

    def _override(self, module: nn.Module, make: Callable[[Callable], Callable]) -> None:
        had = "forward" in module.__dict__
        old = module.__dict__.get("forward")
        new = make(module.forward)
        module.forward = new
        self.overrides.append((module, new, had, old))

    # -- install / remove -----------------------------------------------------------------------------
    def install(self) -> None:
        try:
            self.handles.append(self.model.register_forward_pre_hook(self._top_pre_hook, with_kwargs=True, prepend=True))
            self.handles.append(self.model.register_forward_hook(self._top_post_hook, always_call=True))
            blocks = list(self.plan.blocks)
            first = len(blocks) - self.plan.suffix_blocks
            self.handles.append(blocks[first].register_forward_pre_hook(self._last_pre_hook, with_kwargs=True))
            for _, module, dim, dtype in self.plan.input_modules:
                self._override(module, lambda orig, d=dim, t=dtype: self._make_input_forward(orig, d, t))
            for block in blocks[:first]:
                self._override(block, self._make_block_forward)
            if self.plan.first_token_only:
                self._override(self.plan.blocks[-1], self._make_first_token_forward)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        for module, new, had, old in reversed(self.overrides):
            if module.__dict__.get("forward") is new:
                if had:
                    module.forward = old
                else:
                    del module.forward
        self.overrides = []
        self.state["hidden"] = None
        self.state["mask"] = None


def _self_check(model: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, reference: torch.Tensor) -> None:
    states = hidden * mask[..., None].to(hidden.dtype)  # the cache stores no pad positions
    got = eval_logits(model, **{CACHED_HIDDEN_KEY: states, "attention_mask": mask})
    if not logits_match(got, reference):
        diff = float((got - reference).abs().max()) if got.shape == reference.shape else float("nan")
        raise PrefixCacheError(
            f"{arch_name(model)}: the cached-prefix forward does not reproduce the model's logits on a dummy batch "
            f"(max abs diff {diff:.3g}); frozen-prefix caching is not supported for this architecture."
        )


@contextlib.contextmanager
def suffix_forward(model: nn.Module, verify: bool = True, first_token_only: bool | None = None,
                   suffix_blocks: int = 1) -> Iterator[StructurePlan]:
    """Context under which ``model(hf_dp_cached_hidden=..., attention_mask=...)`` runs only the suffix.

    ``suffix_blocks`` (K): the cached states are the input of ``blocks[-K]``, and the last K blocks run from them
    (1: the last block; ``--trainable last_k:K`` caches below K blocks).  It must be the value the cache was built
    with (:attr:`~hf_dp.models.prefix_cache.CachedFeatures.suffix_blocks`).

    Re-entrant (a nested ``with`` on the same model with the same ``suffix_blocks`` reuses the active patches).  On entry, checks the
    architecture and (``verify=True``) compares the cached path with the full model on a dummy batch;
    raises :class:`PrefixCacheError` when caching would be wrong (see the module docstring).  Calls
    without ``hf_dp_cached_hidden`` run the full model, unchanged.  Everything is removed on exit.

    ``first_token_only`` (default ``None`` = automatic): run the last block for position 0 only when
    the head reads nothing else (see the module docstring); ``False`` never, ``True`` requires it.
    """
    entry = ACTIVE_SUFFIX.get(model)
    if entry is not None:
        if entry[0].plan.suffix_blocks != suffix_blocks:
            raise PrefixCacheError(
                f"suffix_forward(suffix_blocks={suffix_blocks}) inside an active suffix_forward(suffix_blocks="
                f"{entry[0].plan.suffix_blocks}) on the same model"
            )
        entry[1] += 1
        try:
            yield entry[0].plan
        finally:
            entry[1] -= 1
        return
    plan, hidden, mask, reference = discover(model, first_token_only, suffix_blocks)
    patches = _Patches(model, plan)
    patches.install()
    ACTIVE_SUFFIX[model] = [patches, 1]
    try:
        if verify:
            _self_check(model, hidden, mask, reference)
        yield plan
    finally:
        ACTIVE_SUFFIX.pop(model, None)
        patches.remove()


def run_suffix(model: nn.Module, batch: dict, suffix_blocks: int = 1):
    """``model(**batch)`` for a batch of :class:`CachedFeaturesCollator` under :func:`suffix_forward`."""
    with suffix_forward(model, suffix_blocks=suffix_blocks):
        return model(**batch)
