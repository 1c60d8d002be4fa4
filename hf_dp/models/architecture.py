"""What hf_dp learns about a transformer's structure, shared by :mod:`hf_dp.models.prefix_cache` and
:mod:`hf_dp.models.first_token`.

* :func:`discover` runs one eval-mode dummy forward (:func:`dummy_ids`: 2 x 8 tokens, one row
  right-padded) with hooks and returns a :class:`StructurePlan`: the blocks (from
  :func:`hf_dp.models.freezing.find_blocks`), the modules that run before them (embeddings,
  projections), a block's output structure, the input of the first suffix block (the last block, or the
  K-th last with ``suffix_blocks=K``), and whether the first-token-only last block applies.  It raises
  :class:`PrefixCacheError` when a block runs more than once (ALBERT), a parameter computed before the
  first suffix block is trainable, or the structure is unknown.
* :func:`first_token_structure_ok` / :func:`first_token_supported`: is the last block a BERT-style
  layer (:data:`FIRST_TOKEN_LAYERS`) *and* do the logits read position 0 of its output only (probed by
  perturbing positions 1..)?  Supporting a new model family for the first-token block starts here.
* Small helpers both features use (:func:`eval_logits`, :func:`logits_match`, :func:`hidden_arg`, ...)
  and :data:`ACTIVE_SUFFIX`, the models currently inside a :func:`~hf_dp.models.prefix_cache.suffix_forward`
  context (written there, read by :func:`~hf_dp.models.first_token.first_token_forward`).
"""

from __future__ import annotations

import contextlib
import hashlib
import weakref
from dataclasses import dataclass, field
from typing import Any, Iterator

import torch
from torch import nn

from .freezing import find_blocks


class PrefixCacheError(ValueError):
    """The model / data cannot be used with frozen-prefix caching (the message says why)."""



def _base_model(model: nn.Module) -> nn.Module:
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model


def model_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def arch_name(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} (model_type={model_type!r})"


def _logits(output) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output[0] if isinstance(output, (tuple, list)) else output
    return logits


@contextlib.contextmanager
def without_amp_wrapper(model: nn.Module) -> Iterator[None]:
    """Run ``model(...)`` without Accelerate's mixed-precision wrapper (``--bf16``: ``prepare`` replaces the instance's
    ``forward`` by an autocast one and keeps the one it wrapped as ``_original_forward``); any other instance-level
    ``forward`` stays. The frozen prefix is cached, and probed, at the model's own precision, before and after
    ``prepare`` alike. Hooks still run (the call still goes through ``model(...)``); the wrapper is put back on exit."""
    d = model.__dict__
    wrapper, original = d.get("forward"), d.get("_original_forward")
    if wrapper is None or original is None:
        yield
        return
    d["forward"] = original  # the instance dict directly: a forward that is a module must not become a submodule
    try:
        yield
    finally:
        d["forward"] = wrapper


def eval_logits(model: nn.Module, **inputs) -> torch.Tensor:
    """The model's logits in eval mode without gradients (and without Accelerate's autocast wrapper, so the probes and
    exactness checks that use this compare computations at the model's own precision); the train/eval mode is
    restored."""
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad(), without_amp_wrapper(model):
            return _logits(model(**inputs)).detach().clone()
    finally:
        model.train(was_training)


def logits_match(got: torch.Tensor, reference: torch.Tensor) -> bool:
    scale = max(1.0, float(reference.abs().max()))
    return got.shape == reference.shape and torch.allclose(got, reference, rtol=1e-4, atol=1e-4 * scale)


def hidden_arg(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, Any]:
    """The hidden states a block is called with: ``(tensor, 0)`` if positional, ``(tensor, key)`` if keyword."""
    if args and torch.is_tensor(args[0]):
        return args[0], 0
    for key in ("hidden_states", "hidden_state", "x", "hidden"):
        if torch.is_tensor(kwargs.get(key)):
            return kwargs[key], key
    return None, None


@dataclass
class StructurePlan:
    """What :func:`discover` learned about a model from one dummy forward."""

    blocks_name: str
    blocks: nn.ModuleList
    input_modules: list[tuple[str, nn.Module, int, torch.dtype]]  # (name, module, out_dim, out dtype)
    block_output: Any  # "tensor" or the tuple length a block returns
    hidden_size: int
    hidden_dtype: torch.dtype
    hidden_key: Any  # 0 (positional) or the keyword of the last block's hidden states
    pad_id: int
    filler_id: int
    first_token_only: bool = False  # run the last block for position 0 only (see first_token_block)
    suffix_blocks: int = 1  # the cache holds the input of blocks[-suffix_blocks]; those blocks run from it
    prefix_signature: str = ""  # cut_signature: caches built with another one are refused
    state: dict = field(default_factory=lambda: {"hidden": None, "mask": None})


def dummy_ids(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise PrefixCacheError(f"{arch_name(model)}: no config.vocab_size; cannot build a dummy input.")
    pad = getattr(config, "pad_token_id", None)
    pad = int(pad) if pad is not None else 0
    special = {pad}
    for name in ("bos_token_id", "eos_token_id", "sep_token_id", "cls_token_id", "unk_token_id", "mask_token_id"):
        v = getattr(config, name, None)
        if isinstance(v, int):
            special.add(v)
    ids = [i for i in range(min(vocab, 200)) if i not in special][:8]
    if len(ids) < 8:
        ids = [i for i in range(vocab) if i != pad][:8]
    filler = ids[0]
    device = model_device(model)
    input_ids = torch.tensor([ids, ids[::-1]], dtype=torch.long, device=device)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3], dtype=torch.long, device=device)
    input_ids[mask == 0] = pad
    return input_ids, mask, pad, filler


def discover(model: nn.Module, first_token_only: bool | None = None,
             suffix_blocks: int = 1) -> tuple[StructurePlan, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Learn the structure from one eval-mode dummy forward; return the plan, the input of the first suffix
    block (``blocks[-suffix_blocks]``), the dummy mask and the reference logits."""
    try:
        blocks_name, blocks = find_blocks(model)
    except ValueError as e:
        raise PrefixCacheError(f"{arch_name(model)}: {e}") from e
    k = check_suffix_blocks(model, blocks, blocks_name, suffix_blocks)
    base = _base_model(model)
    input_ids, mask, pad, filler = dummy_ids(model)
    batch, seq = input_ids.shape

    order: dict[int, int] = {}
    counts: dict[int, int] = {}
    outputs: dict[int, Any] = {}
    captured: dict[str, Any] = {}
    children = [(name, m) for name, m in base.named_children()]

    def pre(module, _args):
        order.setdefault(id(module), len(order))
        counts[id(module)] = counts.get(id(module), 0) + 1

    def post(module, _args, out):
        outputs.setdefault(id(module), out)

    def capture_last(_module, args, kwargs):
        if "hidden" not in captured:
            captured["hidden"], captured["key"] = hidden_arg(args, kwargs)

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for _, m in children]
    handles.append(blocks[0].register_forward_hook(post))
    handles.append(blocks[len(blocks) - k].register_forward_pre_hook(capture_last, with_kwargs=True))
    try:
        reference = eval_logits(model, input_ids=input_ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()

    for i, block in enumerate(blocks):
        c = counts.get(id(block), 0)
        if c != 1:
            raise PrefixCacheError(
                f"{arch_name(model)}: block {blocks_name}.{i} is called {c} times per forward pass (e.g. ALBERT's "
                "shared layers); frozen-prefix caching needs each block to run exactly once. Train without "
                "the prefix cache."
            )
    hidden, key = captured.get("hidden"), captured.get("key")
    if hidden is None or hidden.shape[:2] != (batch, seq):
        raise PrefixCacheError(
            f"{arch_name(model)}: could not identify the [batch, seq_len, hidden] input of the block "
            f"{blocks_name}.{len(blocks) - k}; frozen-prefix caching is not supported for this architecture."
        )

    # output structure of a block
    out0 = outputs.get(id(blocks[0]))
    if torch.is_tensor(out0):
        block_output: Any = "tensor"
    elif isinstance(out0, tuple) and out0 and torch.is_tensor(out0[0]) and type(out0) is tuple:
        block_output = len(out0)
    else:
        raise PrefixCacheError(
            f"{arch_name(model)}: its blocks return {type(out0).__name__}, not a tensor or a tuple; frozen-prefix "
            "caching is not supported for this architecture."
        )

    # modules of the base model that run before the first block (embeddings, projections)
    first_block = order[id(blocks[0])]
    input_modules = []
    for name, m in children:
        if id(m) not in order or order[id(m)] >= first_block:
            continue
        if any(sub is blocks[0] for sub in m.modules()):
            continue  # the encoder itself (its own code must run)
        out = outputs.get(id(m))
        if not torch.is_tensor(out) or out.dim() != 3 or tuple(out.shape[:2]) != (batch, seq):
            raise PrefixCacheError(
                f"{arch_name(model)}: module {name!r} runs before the blocks and returns "
                f"{type(out).__name__ if not torch.is_tensor(out) else tuple(out.shape)}, not [batch, seq_len, dim]; "
                "frozen-prefix caching is not supported for this architecture."
            )
        input_modules.append((name, m, int(out.shape[-1]), out.dtype))

    # every trainable parameter must be computed at or after the first suffix block
    first = blocks[len(blocks) - k]
    start = order[id(first)]
    suffix = {id(p) for b in list(blocks)[len(blocks) - k:] for p in b.parameters()}
    for module in model.modules():
        if order.get(id(module), -1) > start:
            suffix.update(id(p) for p in module.parameters(recurse=False))
    prefix_trainable = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in suffix]
    if prefix_trainable:
        shown = ", ".join(prefix_trainable[:5]) + (", ..." if len(prefix_trainable) > 5 else "")
        raise PrefixCacheError(
            f"{arch_name(model)}: {len(prefix_trainable)} trainable parameter(s) are computed before the block "
            f"{blocks_name}.{len(blocks) - k} where the cached prefix ends ({shown}); the cached prefix would be stale. "
            "Frozen-prefix caching needs trainable='last_block', 'last_k:K' (the cache then ends below the last K "
            "blocks) or 'head'."
        )

    first_token = first_token_only is not False and first_token_supported(model, blocks[-1], input_ids, mask, reference)
    if first_token_only and not first_token:
        raise PrefixCacheError(
            f"{arch_name(model)}: first_token_only=True, but its last block is not a supported BERT-style layer or its "
            "head reads more than the first position of the last block's output."
        )

    plan = StructurePlan(
        blocks_name=blocks_name,
        blocks=blocks,
        input_modules=input_modules,
        block_output=block_output,
        hidden_size=int(hidden.shape[-1]),
        hidden_dtype=hidden.dtype,
        hidden_key=key,
        pad_id=pad,
        filler_id=filler,
        first_token_only=first_token,
        suffix_blocks=k,
        prefix_signature=cut_signature(model, blocks_name, len(blocks), len(blocks) - k,
                                       modules_before(model, order, blocks[len(blocks) - k])),
    )
    return plan, hidden, mask, reference


def check_suffix_blocks(model: nn.Module, blocks: nn.ModuleList, blocks_name: str, suffix_blocks) -> int:
    """``suffix_blocks`` as an int in 1..len(blocks), else :class:`PrefixCacheError`."""
    if isinstance(suffix_blocks, bool) or not isinstance(suffix_blocks, int) or not 1 <= suffix_blocks <= len(blocks):
        raise PrefixCacheError(
            f"{arch_name(model)}: suffix_blocks must be a whole number between 1 and {len(blocks)} (its blocks "
            f"{blocks_name}), got {suffix_blocks!r}."
        )
    return suffix_blocks


#: model -> (key of the prefix parameters' identity and versions, fingerprint): the fingerprint is recomputed only when
#: a prefix parameter was replaced, moved, cast or modified in place (``Tensor._version``)
_FINGERPRINTS: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, str]]" = weakref.WeakKeyDictionary()
_CHUNK = 1 << 24  # bytes hashed at a time (bounds the host copy of a large GPU tensor)


def _weights_fingerprint(named: list[tuple[str, torch.Tensor]]) -> str:
    """SHA-256 of the names, shapes, dtypes and exact bits of ``named`` (the same on every device and memory layout)."""
    h = hashlib.sha256()
    for name, p in named:
        h.update(f"{name}|{tuple(p.shape)}|{p.dtype};".encode())
        flat = p.detach().reshape(-1)  # logical (row-major) order, whatever the strides
        if flat.numel() == 0:
            continue
        raw = flat.contiguous().view(torch.uint8)
        for start in range(0, raw.numel(), _CHUNK):
            h.update(raw[start : start + _CHUNK].cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def cut_signature(model: nn.Module, blocks_name: str, num_blocks: int, cut: int, prefix_modules: list[nn.Module]) -> str:
    """Where a prefix cache of ``model`` ends (the input of ``blocks[cut]``) and a fingerprint of the weights it was
    computed with: the own parameters of ``prefix_modules`` (the modules that run before ``blocks[cut]``, not its
    ancestors) by name, shape, dtype and exact bits (so the same on CPU and GPU).  Caches with different signatures
    were cut at another place or computed with other weights; a cache is only valid for a model with its signature
    (a correctness check against using a cache with another model, depth, checkpoint or K — not a cryptographic one;
    it does not cover the config, e.g. ``layer_norm_eps``, nor buffers).  Memoised per model."""
    names = {id(m): n for n, m in model.named_modules()}
    named = [(f"{names.get(id(m), '?')}.{pname}", p)
             for m in sorted(prefix_modules, key=lambda m: names.get(id(m), ""))
             for pname, p in m.named_parameters(recurse=False)]
    key = (cut, num_blocks, tuple((n, id(p), p._version, p.data_ptr(), p.dtype, str(p.device)) for n, p in named))
    cached = _FINGERPRINTS.get(model)
    if cached is None or cached[0] != key:
        cached = (key, _weights_fingerprint(named))
        _FINGERPRINTS[model] = cached
    return f"{arch_name(model)} {blocks_name}[{cut}] of {num_blocks} blocks, prefix weights {cached[1]}"


def prefix_signature(model: nn.Module, suffix_blocks: int = 1) -> str:
    """The :attr:`~hf_dp.models.prefix_cache.CachedFeatures.prefix_signature` a cache of ``model`` built with
    ``suffix_blocks`` has (one tiny dummy forward).  ``model`` must be frozen below ``blocks[-suffix_blocks]`` (as a
    trainer's model is): like :func:`~hf_dp.models.suffix.suffix_forward` it raises :class:`PrefixCacheError` where
    caching is not supported or a prefix parameter is trainable."""
    return discover(model, False, suffix_blocks)[0].prefix_signature


def modules_before(model: nn.Module, order: dict[int, int], first: nn.Module) -> list[nn.Module]:
    """The modules whose forward starts before ``first``'s (``order``: id -> call rank), less ``first``'s ancestors."""
    ancestors = {id(m) for m in model.modules() if any(sub is first for sub in m.modules())}
    start = order[id(first)]
    return [m for m in model.modules() if order.get(id(m), start) < start and id(m) not in ancestors]


# Layer classes whose forward is (self-attention -> attention.output(ctx, h) -> feed_forward_chunk), all
# copies of transformers' BertLayer; first_token_block re-runs exactly that for query position 0.
FIRST_TOKEN_LAYERS = {
    "BertLayer", "RobertaLayer", "XLMRobertaLayer", "CamembertLayer", "ElectraLayer", "Data2VecTextLayer",
}


def first_token_structure_ok(layer: nn.Module) -> bool:
    sa = getattr(getattr(layer, "attention", None), "self", None)
    return (
        type(layer).__name__ in FIRST_TOKEN_LAYERS
        and type(sa).__name__.endswith("SelfAttention")
        and all(isinstance(getattr(sa, n, None), nn.Linear) for n in ("query", "key", "value"))
        and isinstance(getattr(sa, "scaling", None), float)
        and isinstance(getattr(sa, "attention_head_size", None), int)
        and isinstance(getattr(sa, "dropout", None), nn.Dropout)
        and callable(getattr(layer.attention, "output", None))
        and callable(getattr(layer, "feed_forward_chunk", None))
        and not getattr(layer, "is_decoder", False)
        and not getattr(layer, "add_cross_attention", False)
        and not hasattr(layer, "crossattention")
    )


def first_token_supported(model: nn.Module, last: nn.Module, input_ids, mask, reference) -> bool:
    """True if the last block is a supported BERT-style layer *and* the logits depend on position 0 of
    its output only (probed: perturbing positions 1.. of that output must leave the logits unchanged)."""
    if not first_token_structure_ok(last):
        return False

    def perturb(_module, _args, out):
        hidden = out if torch.is_tensor(out) else out[0]
        bumped = hidden.clone()
        bumped[:, 1:] += 3.0 + torch.arange(bumped.shape[1] - 1, device=bumped.device, dtype=bumped.dtype)[:, None]
        return bumped if torch.is_tensor(out) else (bumped,) + tuple(out[1:])

    handle = last.register_forward_hook(perturb)
    try:
        probed = eval_logits(model, input_ids=input_ids, attention_mask=mask)
    finally:
        handle.remove()
    return probed.shape == reference.shape and bool(torch.equal(probed, reference))



#: models inside an active ``suffix_forward`` context -> [its patches, nesting depth]
ACTIVE_SUFFIX: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()
