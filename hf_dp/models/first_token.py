"""The first-token-only last block: run the last transformer block for position 0 only, where that is exact.

A sequence classifier whose head reads only position 0 of the last block's output (BERT's pooler,
RoBERTa/ELECTRA's classification heads) needs that block's output at position 0 only.  For BERT-style
layers (BERT/MiniLM, RoBERTa, XLM-R, CamemBERT, ELECTRA, Data2VecText; the list is
:data:`hf_dp.models.architecture.FIRST_TOKEN_LAYERS`) the last block then computes keys and values for
all positions but queries, attention output, feed-forward and layer norms for position 0 only
(:func:`first_token_block`): the same logits, loss and (per-example) gradients, with several times fewer
FLOPs in the block.  It is enabled only when the layer has the expected structure *and* a probe shows that
perturbing positions 1.. of the last block's output leaves the logits unchanged
(:func:`hf_dp.models.architecture.first_token_supported`); the base model's ``last_hidden_state`` then
has length 1 (only the head's output is meaningful inside the context).

* :func:`first_token_forward` applies the block to the *full* model (no cache; DPTrainer's
  ``--first_token_only auto``).
* :func:`hf_dp.models.prefix_cache.suffix_forward` uses :func:`first_token_block` for the cached suffix.

Both are instance-level ``forward`` overrides and hooks installed on entry and removed on exit; the
``state_dict`` never changes.  The key/value projections see one query per head, which ghost clipping
exploits (:func:`hf_dp.models.hints.single_query_heads`, :mod:`hf_dp.clipping.linear`).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Iterator

import torch
from torch import nn

from .architecture import (
    ACTIVE_SUFFIX,
    PrefixCacheError,
    arch_name,
    dummy_ids,
    eval_logits,
    first_token_structure_ok,
    first_token_supported,
    hidden_arg,
    logits_match,
)
from .freezing import find_blocks
from .hints import single_query_heads

__all__ = ["first_token_forward"]


def first_token_block(layer: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """A BERT-style layer's output at position 0 only, ``[B, 1, H]``.

    Exact: position 0's output depends on all positions only through the keys and values, so the
    queries, attention output projection, feed-forward and layer norms run on one position instead of
    ``L`` (about ``L``/(2 + 10/``L``) times fewer FLOPs for BERT's 12·H² per position).  Padding keys
    are masked as the model's own attention mask does; attention dropout as in train mode.
    """
    sa = layer.attention.self
    b, t, _ = hidden.shape
    d = sa.attention_head_size
    h0 = hidden[:, :1]
    q = sa.query(h0).view(b, 1, -1, d).transpose(1, 2)
    with single_query_heads(d):  # one query: their output gradients are rank one per head (ghost clipping's fast path)
        k = sa.key(hidden).view(b, t, -1, d).transpose(1, 2)
        v = sa.value(hidden).view(b, t, -1, d).transpose(1, 2)
    scores = torch.matmul(q, k.transpose(2, 3)) * sa.scaling
    if mask is not None:
        scores = scores.masked_fill(mask[:, None, None, :].to(scores.device) == 0, torch.finfo(scores.dtype).min)
    probs = nn.functional.dropout(nn.functional.softmax(scores, dim=-1), p=sa.dropout.p, training=sa.training)
    ctx = torch.matmul(probs, v).transpose(1, 2).reshape(b, 1, -1)
    return layer.feed_forward_chunk(layer.attention.output(ctx, h0))



_FT_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


class _FirstTokenPatch:
    """The first-token-only last block on the *full* model (no cache): a top-level pre-hook records
    the call's 2-D ``attention_mask``; the last block's forward runs :func:`first_token_block`
    during such a call (not when attentions / hidden states are requested, or for a non-2-D mask)."""

    def __init__(self, model: nn.Module, layer: nn.Module, block_output: Any):
        self.model, self.layer, self.kind = model, layer, block_output
        self.state = {"active": False, "mask": None}
        self.handles: list = []
        self.orig = None

    def _pre(self, _module, args, kwargs):
        mask = kwargs.get("attention_mask")
        wants_more = any(kwargs.get(k) for k in ("output_attentions", "output_hidden_states"))
        ok_mask = mask is None or (torch.is_tensor(mask) and mask.dim() == 2)
        self.state["active"] = not wants_more and ok_mask and not args
        self.state["mask"] = mask
        return None

    def _post(self, _module, _args, _output):
        self.state["active"], self.state["mask"] = False, None

    def install(self) -> None:
        self.handles.append(self.model.register_forward_pre_hook(self._pre, with_kwargs=True, prepend=True))
        self.handles.append(self.model.register_forward_hook(self._post, always_call=True))
        orig = self.layer.forward
        state, kind, layer = self.state, self.kind, self.layer

        def forward(*args, **kwargs):
            if not state["active"]:
                return orig(*args, **kwargs)
            hidden, _ = hidden_arg(args, kwargs)
            if hidden is None or hidden.dim() != 3:
                return orig(*args, **kwargs)
            out = first_token_block(layer, hidden, state["mask"])
            return out if kind == "tensor" else (out,) + (None,) * (kind - 1)

        self.had = "forward" in layer.__dict__
        self.old = layer.__dict__.get("forward")
        self.new = forward
        layer.forward = forward

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
        if self.layer.__dict__.get("forward") is self.new:
            if self.had:
                self.layer.forward = self.old
            else:
                del self.layer.forward
        self.state["active"], self.state["mask"] = False, None


@contextlib.contextmanager
def first_token_forward(model: nn.Module) -> Iterator[bool]:
    """Run the *full* model's last block for position 0 only, where that is exact (no cache needed).

    The same first-token-only block as :func:`suffix_forward` uses (see the module docstring): enabled
    only for a supported BERT-style last block whose output the head reads at position 0 only (probed
    on a dummy batch), and only if the patched model reproduces the model's own logits on that batch
    (otherwise it stays off, with a warning).  Yields whether it is active.  Calls that ask for
    attentions or hidden states, or pass a non-2-D mask, run the model unchanged.  Re-entrant;
    removed on exit; the ``state_dict`` never changes.
    """
    entry = _FT_ACTIVE.get(model)
    if entry is not None:
        entry[1] += 1
        try:
            yield entry[0] is not None
        finally:
            entry[1] -= 1
        return
    cache_entry = ACTIVE_SUFFIX.get(model)
    if cache_entry is not None:  # inside suffix_forward: it has its own first-token block
        yield cache_entry[0].plan.first_token_only
        return
    patch = None
    config = getattr(model, "config", None)
    try:
        _, blocks = find_blocks(model)
    except ValueError:
        blocks = None
    if (
        blocks is not None
        and first_token_structure_ok(blocks[-1])
        and not getattr(config, "output_attentions", False)
        and not getattr(config, "output_hidden_states", False)
    ):
        patch = _install_first_token(model, blocks[-1])
    _FT_ACTIVE[model] = [patch, 1]
    try:
        yield patch is not None
    finally:
        _FT_ACTIVE.pop(model, None)
        if patch is not None:
            patch.remove()


def _install_first_token(model: nn.Module, last: nn.Module) -> "_FirstTokenPatch | None":
    try:
        input_ids, mask, _, _ = dummy_ids(model)
    except PrefixCacheError:
        return None
    outs: list = []
    handle = last.register_forward_hook(lambda _m, _a, out: outs.append(out))
    try:
        reference = eval_logits(model, input_ids=input_ids, attention_mask=mask)
    finally:
        handle.remove()
    if len(outs) != 1 or not first_token_supported(model, last, input_ids, mask, reference):
        return None
    out = outs[0]
    kind: Any = "tensor" if torch.is_tensor(out) else (len(out) if type(out) is tuple and out and torch.is_tensor(out[0]) else None)
    if kind is None:
        return None
    patch = _FirstTokenPatch(model, last, kind)
    patch.install()
    if not logits_match(eval_logits(model, input_ids=input_ids, attention_mask=mask), reference):
        patch.remove()
        import warnings

        warnings.warn(f"{arch_name(model)}: the first-token-only last block does not reproduce the model's logits; not used")
        return None
    return patch
