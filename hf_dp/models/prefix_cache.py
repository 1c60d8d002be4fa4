"""Frozen-prefix caching: compute the frozen part of the network once, train the suffix from a cache.

With ``--trainable last_block`` (or ``head``) everything computed *before* the last transformer block
is a fixed function of the input.  :func:`build_prefix_cache` runs the model once over a dataset (in
eval mode, under ``torch.no_grad()``) and stores, for every example, the hidden states that enter the
last block.  Training then runs only the trainable suffix (last block, pooler, head) from these
states, under the :func:`suffix_forward` context manager.

Privacy is unchanged: the cache is a function of the (public) frozen weights and one example only; each
training step still computes one per-example gradient per sampled example, clips and noises it.

**The one semantic difference**: the frozen prefix runs in *eval mode* (no dropout in the embeddings
and in the frozen blocks), once.  Without the cache, ``model.train()`` also applies dropout in the
frozen blocks at every step.  Dropout of the trainable suffix (last block, head) is unaffected.

Pieces
------
:func:`build_prefix_cache` -> :class:`CachedFeatures`
    Per-example states without padding waste: one flat ``[sum_i L_i, H]`` tensor plus offsets, where
    ``L_i = attention_mask[i].sum()`` (inputs must be right-padded; left padding raises).  In memory,
    or in a ``numpy.memmap`` file when ``cache_dir`` is given; the buffer is preallocated from the rows'
    lengths (no second copy) and the forward passes run on length-sorted batches (about half the
    padding compute on GLUE-like data); the cache itself is in dataset order.  ``CachedFeatures`` is a
    ``torch.utils.data.Dataset`` whose items are ``{"hf_dp_cached_hidden": [L_i, H],
    "attention_mask": ones(L_i), "labels": ...}``; ``nbytes`` is the size of the states.
:class:`CachedFeaturesCollator`
    Right-pads states (with zeros) and masks to the batch maximum length; use it for train and eval.
:func:`suffix_forward` (context manager) / :func:`run_suffix`
    Inside the context, ``model(hf_dp_cached_hidden=h, attention_mask=m, [labels=...])`` returns the
    output the full model would return (with an eval-mode prefix) while skipping the prefix.  Outside
    the context (and inside it, for calls without ``hf_dp_cached_hidden``) the model is unchanged.

How the suffix forward works (generic, the model's own code still runs):

* A forward pre-hook on the top model pops ``hf_dp_cached_hidden`` and passes placeholder
  ``input_ids`` of the right shape (pad id where the mask is 0) so that the model's own forward builds
  the attention mask, and the other inputs as given.
* The modules of the base model that run before the blocks (``embeddings``, ELECTRA's
  ``embeddings_project``) return a zero placeholder of their real output shape/dtype; the frozen blocks
  ``blocks[:-1]`` return their input unchanged in the output structure a real call returns (learned
  from one real call); a forward pre-hook on the last block replaces its ``hidden_states`` input by
  the cached states.  The last block, pooler and head then run normally (in train mode if the model
  is), so Opacus' per-sample-gradient hooks on them work as usual.
* **First-token-only last block** (automatic where it is exact): a sequence classifier whose head reads
  only position 0 of the last block's output (BERT's pooler, RoBERTa/ELECTRA's classification heads)
  needs that block's output at position 0 only.  For BERT-style layers (BERT/MiniLM, RoBERTa,
  XLM-R, CamemBERT, ELECTRA, Data2VecText) the last block then computes keys and values for all positions
  but queries, attention output, feed-forward and layer norms for position 0 only: the same logits,
  loss and (per-example) gradients, with several times fewer FLOPs in the suffix.  It is enabled only
  when the layer has the expected structure *and* a probe shows that perturbing positions 1.. of the
  last block's output leaves the logits unchanged; the base model's ``last_hidden_state`` then has
  length 1 (only the head's output is meaningful inside the context).  :func:`first_token_forward`
  applies the same block to the *full* model (no cache; DPTrainer's ``--first_token_only auto``).
* These are instance-level ``forward`` overrides and hooks installed on entry and removed on exit; the
  ``state_dict`` never changes (``save_pretrained`` works inside and after the context).

On entry, :func:`suffix_forward` runs one tiny dummy batch (2 x 8 tokens, one row right-padded)
through the full model and through the cached path and raises :class:`PrefixCacheError` if the logits
differ, if a block is not called exactly once per forward (ALBERT's shared layer group), if a
parameter computed before the last block is trainable (the cache would be stale), or if the blocks'
outputs have an unknown structure.  Verified: BERT (incl. MiniLM), RoBERTa, ELECTRA (with and without
``embeddings_project``), DistilBERT.

Supported trainable modes: ``last_block`` (the intended one) and ``head`` (the last block then runs
frozen from the cache; correct but less savings).  Other modes train parameters of the prefix and are
rejected.

Cache files (``cache_dir``)
---------------------------
Each :func:`build_prefix_cache` call creates its *own* file, ``<cache_dir>/_hf_dp_prefix_<random>.bin``
(:func:`tempfile.mkstemp`: a name no other build, in this or another process, can get), so the train and
eval caches (and the caches of concurrent ranks or runs sharing the folder) never overwrite each other.
By default the file is **unlinked right after it is created**, before any state is written: the open
descriptor and then the memory map keep the data readable (and disk-backed: the kernel pages it out to
the file's blocks, not to RAM/swap), and the disk space returns when the last reference to the
:class:`CachedFeatures` goes away (at the latest at process exit).  Nothing is left in ``cache_dir``
after the run, even after a crash or ``SIGKILL``, and a push of the folder can never upload it.  With
``keep_file=True`` the file stays (``CachedFeatures.path``) for inspection; it holds the hidden states
of every cached example (hf_dp does not reload it).  The leading ``_`` makes ``Trainer.push_to_hub``
skip it when the folder is the pushed ``output_dir`` itself (its upload ignores ``_*``); DPTrainer
refuses a cache folder inside ``output_dir`` otherwise.  (Where unlinking an open file is not possible,
e.g. Windows, the file is removed when the cache is garbage-collected or at exit.)  Without
``cache_dir`` the cache is an ordinary in-memory tensor and no file is created.

Caveats: the cache is tied to the frozen weights and the tokenization used to build it (rebuild when
either changes); the states are stored in ``dtype`` (``float16`` / ``bfloat16`` halve the memory, at
the price of rounding the suffix input); a memmap-backed cache is copied when a DataLoader worker
process pickles it (use ``dataloader_num_workers=0``).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import tempfile
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch import nn

from .freezing import find_blocks
from .ghost_clipping import single_query_heads

__all__ = [
    "CACHED_HIDDEN_KEY",
    "PrefixCacheError",
    "CachedFeatures",
    "CachedFeaturesCollator",
    "build_prefix_cache",
    "suffix_forward",
    "run_suffix",
    "first_token_forward",
]

CACHED_HIDDEN_KEY = "hf_dp_cached_hidden"
CACHE_FILE_PREFIX = "_hf_dp_prefix_"  # leading "_": Trainer.push_to_hub ignores "_*" in output_dir
_LABEL_KEYS = ("labels", "label", "label_ids")
_TOKEN_INPUTS = ("input_ids", "inputs_embeds")


class PrefixCacheError(ValueError):
    """The model / data cannot be used with frozen-prefix caching (the message says why)."""


class _StopForward(Exception):
    """Raised by the capture hook to skip the (unneeded) rest of the forward pass while caching."""


# --------------------------------------------------------------------------------------------- helpers


def _base_model(model: nn.Module) -> nn.Module:
    base = getattr(model, "base_model", None)
    return base if isinstance(base, nn.Module) else model


def _device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _arch(model: nn.Module) -> str:
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    return f"{type(model).__name__} (model_type={model_type!r})"


def _logits(output) -> torch.Tensor:
    logits = getattr(output, "logits", None)
    if logits is None:
        logits = output[0] if isinstance(output, (tuple, list)) else output
    return logits


def _eval_logits(model: nn.Module, **inputs) -> torch.Tensor:
    """The model's logits in eval mode without gradients; the train/eval mode is restored."""
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            return _logits(model(**inputs)).detach().clone()
    finally:
        model.train(was_training)


def _logits_match(got: torch.Tensor, reference: torch.Tensor) -> bool:
    scale = max(1.0, float(reference.abs().max()))
    return got.shape == reference.shape and torch.allclose(got, reference, rtol=1e-4, atol=1e-4 * scale)


def _hidden_arg(args: tuple, kwargs: dict) -> tuple[torch.Tensor | None, Any]:
    """The hidden states a block is called with: ``(tensor, 0)`` if positional, ``(tensor, key)`` if keyword."""
    if args and torch.is_tensor(args[0]):
        return args[0], 0
    for key in ("hidden_states", "hidden_state", "x", "hidden"):
        if torch.is_tensor(kwargs.get(key)):
            return kwargs[key], key
    return None, None


def _check_right_padding(mask: torch.Tensor, row_ids: list[int] | None = None) -> torch.Tensor:
    """Return ``L_i = mask.sum(1)``; raise :class:`PrefixCacheError` unless each row is ``1..1 0..0``."""
    mask = mask.to(torch.long)
    lengths = mask.sum(1)
    expected = torch.arange(mask.shape[1], device=mask.device)[None, :] < lengths[:, None]
    bad = (mask.bool() != expected).any(1)
    if bad.any():
        r = int(bad.nonzero()[0, 0])
        row = row_ids[r] if row_ids is not None else r
        raise PrefixCacheError(
            f"row {row}: attention_mask {mask[r].tolist()} is not right-padded (1...1 0...0). "
            "The prefix cache stores the first attention_mask.sum() positions of each example; tokenize with "
            "tokenizer.padding_side = 'right' (or do not pad before collating)."
        )
    return lengths


def _model_input_keys(model: nn.Module) -> set[str]:
    try:
        params = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # pragma: no cover
        return set()
    return {name for name, p in params.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _uint_dtype(itemsize: int):
    return {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]


def _remove_quietly(path: str) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _create_cache_file(cache_dir: str | os.PathLike, keep: bool):
    """A new, uniquely named cache file in ``cache_dir`` opened ``w+b``: ``(file, path, unlinked)``.

    Unless ``keep``, the name is unlinked at once (the open file and later its memory map keep the
    data; see "Cache files" in the module docstring)."""
    os.makedirs(cache_dir, exist_ok=True)
    fd, path = tempfile.mkstemp(prefix=CACHE_FILE_PREFIX, suffix=".bin", dir=os.fspath(cache_dir))
    f = os.fdopen(fd, "w+b")
    unlinked = False
    if not keep:
        try:
            os.unlink(path)
            unlinked = True
        except OSError:  # e.g. Windows: an open file cannot be removed; removed when the cache is collected
            pass
    return f, path, unlinked


# ---------------------------------------------------------------------------------------- the dataset


class CachedFeatures(torch.utils.data.Dataset):
    """Cached hidden states of a dataset (see the module docstring), usable as a training dataset.

    Attributes:
        hidden: ``[sum_i L_i, H]`` tensor (memmap-backed when built with ``cache_dir``).
        offsets: ``[N + 1]`` int64 tensor; example ``i`` is ``hidden[offsets[i]:offsets[i+1]]``.
        labels: ``[N, ...]`` tensor or ``None`` if the collated batches had no labels.
        path: the kept memmap file (``keep_file=True``), else ``None`` (in memory, or an unlinked file).
        file_backed: whether ``hidden`` is a memory map of a file (kept or unlinked).
    """

    def __init__(self, hidden: torch.Tensor, offsets: torch.Tensor, labels: torch.Tensor | None = None,
                 path: str | None = None, file_backed: bool | None = None):
        if hidden.dim() != 2 or offsets.dim() != 1 or int(offsets[-1]) != hidden.shape[0]:
            raise ValueError("CachedFeatures: hidden must be [sum(L_i), H] and offsets [N+1] ending at sum(L_i)")
        if labels is not None and labels.shape[0] != offsets.shape[0] - 1:
            raise ValueError("CachedFeatures: one label per example expected")
        self.hidden = hidden
        self.offsets = offsets
        self.labels = labels
        self.path = path
        self.file_backed = path is not None if file_backed is None else file_backed

    def __len__(self) -> int:
        return self.offsets.shape[0] - 1

    @property
    def hidden_size(self) -> int:
        return self.hidden.shape[1]

    @property
    def lengths(self) -> torch.Tensor:
        """``[N]`` number of (non-pad) tokens per example."""
        return self.offsets[1:] - self.offsets[:-1]

    @property
    def num_tokens(self) -> int:
        return self.hidden.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes of the cached states: ``sum_i L_i * H * dtype size`` (no padding)."""
        return self.hidden.numel() * self.hidden.element_size()

    @property
    def total_nbytes(self) -> int:
        """:attr:`nbytes` plus offsets and labels."""
        extra = self.offsets.numel() * self.offsets.element_size()
        if self.labels is not None:
            extra += self.labels.numel() * self.labels.element_size()
        return self.nbytes + extra

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"index {i} out of range for {n} cached examples")
        start, end = int(self.offsets[i]), int(self.offsets[i + 1])
        item = {
            CACHED_HIDDEN_KEY: self.hidden[start:end],
            "attention_mask": torch.ones(end - start, dtype=torch.long),
        }
        if self.labels is not None:
            item["labels"] = self.labels[i]
        return item

    def __repr__(self) -> str:
        where = f"memmap {self.path}" if self.path else ("an unlinked memmap file" if self.file_backed else "memory")
        return (
            f"CachedFeatures({len(self)} examples, {self.num_tokens} tokens x {self.hidden_size}, "
            f"{self.hidden.dtype}, {self.nbytes / 2**20:.1f} MiB in {where})"
        )


@dataclass
class CachedFeaturesCollator:
    """Collate :class:`CachedFeatures` items: right-pad states with zeros and masks with 0 to the batch max.

    Args:
        pad_to_multiple_of: optionally round the padded length up to a multiple of this.
    """

    pad_to_multiple_of: int | None = None

    def __call__(self, features: list[dict]) -> dict[str, torch.Tensor]:
        if not features:
            raise ValueError("CachedFeaturesCollator: empty batch")
        states = [f[CACHED_HIDDEN_KEY] for f in features]
        lengths = [s.shape[0] for s in states]
        max_len = max(lengths)
        if self.pad_to_multiple_of:
            m = self.pad_to_multiple_of
            max_len = (max_len + m - 1) // m * m
        hidden = states[0].new_zeros((len(states), max_len, states[0].shape[-1]))
        mask = torch.zeros((len(states), max_len), dtype=torch.long)
        for i, (s, n) in enumerate(zip(states, lengths)):
            hidden[i, :n] = s
            mask[i, :n] = 1
        batch = {CACHED_HIDDEN_KEY: hidden, "attention_mask": mask}
        if "labels" in features[0]:
            batch["labels"] = torch.stack([torch.as_tensor(f["labels"]) for f in features])
        return batch


# --------------------------------------------------------------------------------------- building


def _row_length(row: dict) -> int | None:
    """Non-pad tokens of one (uncollated) row: ``sum(attention_mask)``, else ``len(input_ids)``."""
    mask = row.get("attention_mask")
    if mask is not None:
        return int(sum(mask)) if not torch.is_tensor(mask) else int(mask.sum())
    ids = row.get("input_ids")
    return len(ids) if ids is not None else None


def build_prefix_cache(
    model: nn.Module,
    dataset,
    collate_fn: Callable[[list[dict]], dict],
    batch_size: int = 64,
    dtype: torch.dtype = torch.float32,
    cache_dir: str | os.PathLike | None = None,
    sort_by_length: bool = True,
    keep_file: bool = False,
) -> CachedFeatures:
    """Run the frozen prefix of ``model`` once over ``dataset`` and cache the input of the last block.

    Args:
        model: a ``*ForSequenceClassification`` model (any trainable mode; the prefix = everything before
            the last block found by :func:`hf_dp.models.freezing.find_blocks`).  Run in eval mode under
            ``torch.no_grad()``; its training mode is restored afterwards.  The forward pass stops at the
            last block (the block and head are not computed).
        dataset: indexable rows (``datasets.Dataset``, list of dicts, ...) with tokenized, unpadded (or
            right-padded) ``input_ids``.  Keys that the model's forward does not accept (text columns,
            ``idx``) are dropped before ``collate_fn``; ``label`` / ``label_ids`` / ``labels`` are kept.
            Example ``i`` of the cache is row ``i`` of the dataset.
        collate_fn: e.g. ``DataCollatorWithPadding(tokenizer)`` (must right-pad).
        batch_size: rows per forward pass.
        dtype: storage dtype of the states (``float32``; ``float16``/``bfloat16`` halve the memory).
        cache_dir: if given, the states are written to a new file ``<cache_dir>/_hf_dp_prefix_<random>.bin``
            (unique per call) and memory-mapped (copy-on-write) instead of being kept in RAM.  The file is
            unlinked as soon as it is created unless ``keep_file`` (see "Cache files" in the module docstring).
        sort_by_length: run the forward passes on length-sorted batches (less padding, faster; the
            cache is still in dataset order).  The states are written into a buffer preallocated from a
            first pass over the rows' lengths (no second copy in memory).
        keep_file: keep the ``cache_dir`` file after the cache is gone (its path is ``CachedFeatures.path``).

    Returns:
        :class:`CachedFeatures` with ``L_i = attention_mask[i].sum()`` positions per example.

    Raises:
        PrefixCacheError: the blocks cannot be found, the last block is not called exactly once, or an
            example is not right-padded.
    """
    try:
        _, blocks = find_blocks(model)
    except ValueError as e:
        raise PrefixCacheError(f"{_arch(model)}: {e}") from e
    last = blocks[-1]
    n = len(dataset)
    if n == 0:
        raise ValueError("build_prefix_cache: empty dataset")
    device = _device(model)
    accepted = _model_input_keys(model) | set(_LABEL_KEYS)
    if "attention_mask" not in accepted:
        raise PrefixCacheError(f"{_arch(model)}: its forward takes no attention_mask; cannot cache variable-length inputs.")

    # pass 1: lengths -> offsets, preallocated storage
    row_lengths = []
    for j in range(n):
        length = _row_length(dataset[j])
        if length is None:
            raise ValueError(f"build_prefix_cache: row {j} has no input_ids / attention_mask")
        row_lengths.append(length)
    lengths = torch.tensor(row_lengths, dtype=torch.long)
    offsets = torch.zeros(n + 1, dtype=torch.long)
    offsets[1:] = torch.cumsum(lengths, 0)
    total = int(offsets[-1])
    order = sorted(range(n), key=row_lengths.__getitem__) if sort_by_length else list(range(n))

    captured: list[torch.Tensor] = []
    calls = [0]

    def capture(_module, args, kwargs):
        calls[0] += 1
        hidden, _ = _hidden_arg(args, kwargs)
        if hidden is None:
            raise PrefixCacheError(f"{_arch(model)}: could not find the hidden_states argument of the last block.")
        captured.append(hidden)
        raise _StopForward

    storage = None  # torch tensor or numpy memmap, [total, H]
    path = None
    mm = None
    fobj = None  # the open cache file (cache_dir)
    unlinked = False
    done = False
    labels_all: torch.Tensor | None = None
    label_batches = 0
    num_batches = 0
    was_training = model.training
    handle = last.register_forward_pre_hook(capture, with_kwargs=True)
    try:
        model.eval()
        with torch.no_grad():
            for start in range(0, n, batch_size):
                idx = order[start : start + batch_size]
                num_batches += 1
                rows = [{k: v for k, v in dict(dataset[j]).items() if k in accepted} for j in idx]
                batch = collate_fn(rows)
                labels = None
                for key in _LABEL_KEYS:
                    if key in batch:
                        labels = batch[key]
                        break
                inputs = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()
                          if k not in _LABEL_KEYS and k in accepted}
                ref = inputs.get("input_ids", inputs.get("inputs_embeds"))
                if ref is None:
                    raise ValueError("build_prefix_cache: the collated batch has no input_ids")
                mask = inputs.get("attention_mask")
                if mask is None:
                    mask = torch.ones(ref.shape[:2], dtype=torch.long, device=ref.device)
                got = _check_right_padding(mask, idx).cpu()
                expected = lengths[idx]
                if not torch.equal(got, expected):
                    bad = int((got != expected).nonzero()[0, 0])
                    raise PrefixCacheError(
                        f"row {idx[bad]}: the collated attention_mask has {int(got[bad])} ones but the row has "
                        f"{int(expected[bad])} tokens; the collator must not truncate or drop tokens."
                    )
                captured.clear()
                calls[0] = 0
                try:
                    model(**inputs)
                except _StopForward:
                    pass
                if calls[0] != 1:
                    raise PrefixCacheError(f"{_arch(model)}: the last block was not called during the forward pass.")
                hidden = captured[0]
                if hidden.shape[:2] != mask.shape:
                    raise PrefixCacheError(
                        f"{_arch(model)}: the last block's input has shape {tuple(hidden.shape)}, expected "
                        f"[batch, seq_len, hidden] = [{mask.shape[0]}, {mask.shape[1]}, ...]."
                    )
                if storage is None:
                    hidden_size = hidden.shape[-1]
                    if cache_dir is not None:
                        fobj, path, unlinked = _create_cache_file(cache_dir, keep_file)
                        itemsize = torch.empty((), dtype=dtype).element_size()
                        mm = np.memmap(fobj, dtype=_uint_dtype(itemsize), mode="w+", shape=(max(total, 1), hidden_size))
                        storage = torch.from_numpy(mm).view(dtype)  # writes go to the file's pages
                    else:
                        storage = torch.empty((total, hidden_size), dtype=dtype)
                flat = hidden[mask.to(torch.bool)].to(device="cpu", dtype=dtype)  # example by example
                dest = torch.cat([torch.arange(int(offsets[j]), int(offsets[j + 1])) for j in idx])
                storage[dest] = flat
                if labels is not None:
                    labels = torch.as_tensor(labels).cpu()
                    if labels_all is None:
                        labels_all = torch.zeros((n, *labels.shape[1:]), dtype=labels.dtype)
                    labels_all[torch.tensor(idx)] = labels
                    label_batches += 1
        if label_batches not in (0, num_batches):
            raise ValueError("build_prefix_cache: some collated batches have labels and some do not")
        if mm is not None:
            mm.flush()
            del storage, mm
            itemsize = torch.empty((), dtype=dtype).element_size()
            # mapped through the open file object: works after the name is unlinked (mmap keeps its own descriptor)
            mm = np.memmap(fobj, dtype=_uint_dtype(itemsize), mode="c", shape=(max(total, 1), hidden_size))
            storage = torch.from_numpy(mm).view(dtype)[:total]
        done = True
    finally:
        handle.remove()
        model.train(was_training)
        if fobj is not None:
            fobj.close()
            if not done and not unlinked:  # a failed build leaves no (partial) file, kept or not
                _remove_quietly(path)
    features = CachedFeatures(storage, offsets, labels_all, path=path if keep_file else None,
                              file_backed=fobj is not None)
    if fobj is not None and not keep_file and not unlinked:
        weakref.finalize(features, _remove_quietly, path)  # runs on garbage collection or at exit
        warnings.warn(f"could not unlink the open prefix cache file {path}; it is removed when the cache is released")
    return features


# ------------------------------------------------------------------------------------ suffix forward


@dataclass
class _Plan:
    """What :func:`_discover` learned about a model from one dummy forward."""

    blocks_name: str
    blocks: nn.ModuleList
    input_modules: list[tuple[str, nn.Module, int, torch.dtype]]  # (name, module, out_dim, out dtype)
    block_output: Any  # "tensor" or the tuple length a block returns
    hidden_size: int
    hidden_dtype: torch.dtype
    hidden_key: Any  # 0 (positional) or the keyword of the last block's hidden states
    pad_id: int
    filler_id: int
    first_token_only: bool = False  # run the last block for position 0 only (see _first_token_block)
    state: dict = field(default_factory=lambda: {"hidden": None, "mask": None})


def _dummy_ids(model: nn.Module) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    config = getattr(model, "config", None)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if vocab <= 0:
        raise PrefixCacheError(f"{_arch(model)}: no config.vocab_size; cannot build a dummy input.")
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
    device = _device(model)
    input_ids = torch.tensor([ids, ids[::-1]], dtype=torch.long, device=device)
    mask = torch.tensor([[1] * 8, [1] * 5 + [0] * 3], dtype=torch.long, device=device)
    input_ids[mask == 0] = pad
    return input_ids, mask, pad, filler


def _discover(model: nn.Module, first_token_only: bool | None = None) -> tuple[_Plan, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Learn the structure from one eval-mode dummy forward; return the plan, the last block's input,
    the dummy mask and the reference logits."""
    try:
        blocks_name, blocks = find_blocks(model)
    except ValueError as e:
        raise PrefixCacheError(f"{_arch(model)}: {e}") from e
    base = _base_model(model)
    input_ids, mask, pad, filler = _dummy_ids(model)
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
            captured["hidden"], captured["key"] = _hidden_arg(args, kwargs)

    handles = [m.register_forward_pre_hook(pre) for m in model.modules()]
    handles += [m.register_forward_hook(post) for _, m in children]
    handles.append(blocks[0].register_forward_hook(post))
    handles.append(blocks[-1].register_forward_pre_hook(capture_last, with_kwargs=True))
    try:
        reference = _eval_logits(model, input_ids=input_ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()

    for i, block in enumerate(blocks):
        c = counts.get(id(block), 0)
        if c != 1:
            raise PrefixCacheError(
                f"{_arch(model)}: block {blocks_name}.{i} is called {c} times per forward pass (e.g. ALBERT's "
                "shared layers); frozen-prefix caching needs each block to run exactly once. Train without "
                "the prefix cache."
            )
    hidden, key = captured.get("hidden"), captured.get("key")
    if hidden is None or hidden.shape[:2] != (batch, seq):
        raise PrefixCacheError(
            f"{_arch(model)}: could not identify the [batch, seq_len, hidden] input of the last block "
            f"{blocks_name}.{len(blocks) - 1}; frozen-prefix caching is not supported for this architecture."
        )

    # output structure of a block
    out0 = outputs.get(id(blocks[0]))
    if torch.is_tensor(out0):
        block_output: Any = "tensor"
    elif isinstance(out0, tuple) and out0 and torch.is_tensor(out0[0]) and type(out0) is tuple:
        block_output = len(out0)
    else:
        raise PrefixCacheError(
            f"{_arch(model)}: its blocks return {type(out0).__name__}, not a tensor or a tuple; frozen-prefix "
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
                f"{_arch(model)}: module {name!r} runs before the blocks and returns "
                f"{type(out).__name__ if not torch.is_tensor(out) else tuple(out.shape)}, not [batch, seq_len, dim]; "
                "frozen-prefix caching is not supported for this architecture."
            )
        input_modules.append((name, m, int(out.shape[-1]), out.dtype))

    # every trainable parameter must be computed at or after the last block
    last = blocks[-1]
    start = order[id(last)]
    suffix = {id(p) for p in last.parameters()}
    for module in model.modules():
        if order.get(id(module), -1) > start:
            suffix.update(id(p) for p in module.parameters(recurse=False))
    prefix_trainable = [n for n, p in model.named_parameters() if p.requires_grad and id(p) not in suffix]
    if prefix_trainable:
        shown = ", ".join(prefix_trainable[:5]) + (", ..." if len(prefix_trainable) > 5 else "")
        raise PrefixCacheError(
            f"{_arch(model)}: {len(prefix_trainable)} trainable parameter(s) are computed before the last block "
            f"({shown}); the cached prefix would be stale. Frozen-prefix caching needs trainable='last_block' "
            "(or 'head')."
        )

    first_token = first_token_only is not False and _first_token_supported(model, blocks[-1], input_ids, mask, reference)
    if first_token_only and not first_token:
        raise PrefixCacheError(
            f"{_arch(model)}: first_token_only=True, but its last block is not a supported BERT-style layer or its "
            "head reads more than the first position of the last block's output."
        )

    plan = _Plan(
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
    )
    return plan, hidden, mask, reference


# Layer classes whose forward is (self-attention -> attention.output(ctx, h) -> feed_forward_chunk), all
# copies of transformers' BertLayer; _first_token_block re-runs exactly that for query position 0.
_FIRST_TOKEN_LAYERS = {
    "BertLayer", "RobertaLayer", "XLMRobertaLayer", "CamembertLayer", "ElectraLayer", "Data2VecTextLayer",
}


def _first_token_structure_ok(layer: nn.Module) -> bool:
    sa = getattr(getattr(layer, "attention", None), "self", None)
    return (
        type(layer).__name__ in _FIRST_TOKEN_LAYERS
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


def _first_token_supported(model: nn.Module, last: nn.Module, input_ids, mask, reference) -> bool:
    """True if the last block is a supported BERT-style layer *and* the logits depend on position 0 of
    its output only (probed: perturbing positions 1.. of that output must leave the logits unchanged)."""
    if not _first_token_structure_ok(last):
        return False

    def perturb(_module, _args, out):
        hidden = out if torch.is_tensor(out) else out[0]
        bumped = hidden.clone()
        bumped[:, 1:] += 3.0 + torch.arange(bumped.shape[1] - 1, device=bumped.device, dtype=bumped.dtype)[:, None]
        return bumped if torch.is_tensor(out) else (bumped,) + tuple(out[1:])

    handle = last.register_forward_hook(perturb)
    try:
        probed = _eval_logits(model, input_ids=input_ids, attention_mask=mask)
    finally:
        handle.remove()
    return probed.shape == reference.shape and bool(torch.equal(probed, reference))


def _first_token_block(layer: nn.Module, hidden: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
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


class _Patches:
    """Hooks + instance ``forward`` overrides of one active :func:`suffix_forward` context."""

    def __init__(self, model: nn.Module, plan: _Plan):
        self.model = model
        self.plan = plan
        self.state = plan.state
        self.handles: list = []
        self.overrides: list[tuple[nn.Module, Callable, bool, Any]] = []  # (module, new, had_instance_attr, old)

    # -- installed pieces ---------------------------------------------------------------------------
    def _top_pre_hook(self, _module, args, kwargs):
        if CACHED_HIDDEN_KEY not in kwargs:
            return None
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
        current, key = _hidden_arg(args, kwargs)
        if current is None or current.shape[:2] != cached.shape[:2]:
            raise RuntimeError(
                f"suffix_forward: the last block received {None if current is None else tuple(current.shape)}, "
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
            hidden, _ = _hidden_arg(args, kwargs)
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
            hidden, _ = _hidden_arg(args, kwargs)
            out = _first_token_block(layer, hidden, state["mask"])
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
            self.handles.append(self.plan.blocks[-1].register_forward_pre_hook(self._last_pre_hook, with_kwargs=True))
            for _, module, dim, dtype in self.plan.input_modules:
                self._override(module, lambda orig, d=dim, t=dtype: self._make_input_forward(orig, d, t))
            for block in list(self.plan.blocks)[:-1]:
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


_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


def _self_check(model: nn.Module, hidden: torch.Tensor, mask: torch.Tensor, reference: torch.Tensor) -> None:
    states = hidden * mask[..., None].to(hidden.dtype)  # the cache stores no pad positions
    got = _eval_logits(model, **{CACHED_HIDDEN_KEY: states, "attention_mask": mask})
    if not _logits_match(got, reference):
        diff = float((got - reference).abs().max()) if got.shape == reference.shape else float("nan")
        raise PrefixCacheError(
            f"{_arch(model)}: the cached-prefix forward does not reproduce the model's logits on a dummy batch "
            f"(max abs diff {diff:.3g}); frozen-prefix caching is not supported for this architecture."
        )


@contextlib.contextmanager
def suffix_forward(model: nn.Module, verify: bool = True, first_token_only: bool | None = None) -> Iterator[_Plan]:
    """Context under which ``model(hf_dp_cached_hidden=..., attention_mask=...)`` runs only the suffix.

    Re-entrant (a nested ``with`` on the same model reuses the active patches).  On entry, checks the
    architecture and (``verify=True``) compares the cached path with the full model on a dummy batch;
    raises :class:`PrefixCacheError` when caching would be wrong (see the module docstring).  Calls
    without ``hf_dp_cached_hidden`` run the full model, unchanged.  Everything is removed on exit.

    ``first_token_only`` (default ``None`` = automatic): run the last block for position 0 only when
    the head reads nothing else (see the module docstring); ``False`` never, ``True`` requires it.
    """
    entry = _ACTIVE.get(model)
    if entry is not None:
        entry[1] += 1
        try:
            yield entry[0].plan
        finally:
            entry[1] -= 1
        return
    plan, hidden, mask, reference = _discover(model, first_token_only)
    patches = _Patches(model, plan)
    patches.install()
    _ACTIVE[model] = [patches, 1]
    try:
        if verify:
            _self_check(model, hidden, mask, reference)
        yield plan
    finally:
        _ACTIVE.pop(model, None)
        patches.remove()


def run_suffix(model: nn.Module, batch: dict):
    """``model(**batch)`` for a batch of :class:`CachedFeaturesCollator` under :func:`suffix_forward`."""
    with suffix_forward(model):
        return model(**batch)


# ------------------------------------------------------------------------------ first token, no cache

_FT_ACTIVE: "weakref.WeakKeyDictionary[nn.Module, list]" = weakref.WeakKeyDictionary()


class _FirstTokenPatch:
    """The first-token-only last block on the *full* model (no cache): a top-level pre-hook records
    the call's 2-D ``attention_mask``; the last block's forward runs :func:`_first_token_block`
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
            hidden, _ = _hidden_arg(args, kwargs)
            if hidden is None or hidden.dim() != 3:
                return orig(*args, **kwargs)
            out = _first_token_block(layer, hidden, state["mask"])
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
    cache_entry = _ACTIVE.get(model)
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
        and _first_token_structure_ok(blocks[-1])
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
        input_ids, mask, _, _ = _dummy_ids(model)
    except PrefixCacheError:
        return None
    outs: list = []
    handle = last.register_forward_hook(lambda _m, _a, out: outs.append(out))
    try:
        reference = _eval_logits(model, input_ids=input_ids, attention_mask=mask)
    finally:
        handle.remove()
    if len(outs) != 1 or not _first_token_supported(model, last, input_ids, mask, reference):
        return None
    out = outs[0]
    kind: Any = "tensor" if torch.is_tensor(out) else (len(out) if type(out) is tuple and out and torch.is_tensor(out[0]) else None)
    if kind is None:
        return None
    patch = _FirstTokenPatch(model, last, kind)
    patch.install()
    if not _logits_match(_eval_logits(model, input_ids=input_ids, attention_mask=mask), reference):
        patch.remove()
        import warnings

        warnings.warn(f"{_arch(model)}: the first-token-only last block does not reproduce the model's logits; not used")
        return None
    return patch
