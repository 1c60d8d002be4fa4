"""Frozen-prefix caching: compute the frozen part of the network once, train the suffix from a cache.

With ``--trainable last_block`` (or ``head``) everything computed *before* the last transformer block
is a fixed function of the input (with ``--trainable last_k:K``: everything before the last K blocks).
:func:`build_prefix_cache` runs the model once over a dataset (in eval mode, under ``torch.no_grad()``)
and stores, for every example, the hidden states that enter the last block (``suffix_blocks=K``: the
K-th last block).  Training then runs only the trainable suffix (those blocks, pooler, head) from these
states, under the :func:`suffix_forward` context manager (given the same ``suffix_blocks``).

Privacy is unchanged: the cache is a function of the (public) frozen weights and one example only; each
training step still computes one per-example gradient per sampled example, clips and noises it.

**The one semantic difference**: the frozen prefix runs in *eval mode* (no dropout in the embeddings
and in the frozen blocks), once.  Without the cache, ``model.train()`` also applies dropout in the
frozen blocks at every step.  Dropout of the trainable suffix (its blocks, head) is unaffected.

Pieces
------
:func:`build_prefix_cache` -> :class:`CachedFeatures`
    Per-example states without padding waste: one flat ``[sum_i L_i, H]`` tensor plus offsets, where
    ``L_i = attention_mask[i].sum()`` (inputs must be right-padded; left padding raises).  In memory,
    or in a ``numpy.memmap`` file when ``cache_dir`` is given; the buffer is preallocated from the rows'
    lengths (no second copy) and the forward passes run on length-sorted batches (about half the
    padding compute on GLUE-like data); the cache itself is in dataset order.  ``CachedFeatures`` is a
    ``torch.utils.data.Dataset`` whose items are ``{"hf_dp_cached_hidden": [L_i, H],
    "attention_mask": ones(L_i), "labels": ..., "hf_dp_prefix_signature": id}``; ``nbytes`` is the size of the
    states.  The signature (where in which model the prefix was cut, and a fingerprint of its frozen weights) rides
    in every collated batch: :func:`suffix_forward` refuses a batch of a cache that is not its model's.
:class:`CachedFeaturesCollator`
    Right-pads states (with zeros) and masks to the batch maximum length; use it for train and eval.
:func:`suffix_forward` (context manager) / :func:`run_suffix`
    Inside the context, ``model(hf_dp_cached_hidden=h, attention_mask=m, [labels=...])`` returns the
    output the full model would return (with an eval-mode prefix) while skipping the prefix.  Outside
    the context (and inside it, for calls without ``hf_dp_cached_hidden``) the model is unchanged.
    Defined in :mod:`hf_dp.models.suffix` (how it works, what it checks on entry) and re-exported here;
    the structure comes from :func:`hf_dp.models.architecture.discover`; the last block runs for
    position 0 only where that is exact (:mod:`hf_dp.models.first_token`).

Supported trainable modes: ``last_block`` (the intended one), ``last_k:K`` (``suffix_blocks=K``) and ``head``
(the last block then runs frozen from the cache; correct but less savings).  Other modes train parameters of
the prefix and are rejected.

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
import logging
import os
import tempfile
import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch import nn

from .architecture import (
    PrefixCacheError,
    arch_name,
    check_suffix_blocks,
    cut_signature,
    hidden_arg,
    model_device,
    modules_before,
    prefix_signature,
    without_amp_wrapper,
)
from .freezing import find_blocks
from .suffix import CACHED_HIDDEN_KEY, PREFIX_SIGNATURE_KEY, run_suffix, signature_id, suffix_forward

logger = logging.getLogger(__name__)

__all__ = [
    "CACHED_HIDDEN_KEY",
    "PREFIX_SIGNATURE_KEY",
    "prefix_signature",
    "PrefixCacheError",
    "CachedFeatures",
    "CachedFeaturesCollator",
    "build_prefix_cache",
    "suffix_forward",
    "run_suffix",
]

CACHE_FILE_PREFIX = "_hf_dp_prefix_"  # leading "_": Trainer.push_to_hub ignores "_*" in output_dir
_LABEL_KEYS = ("labels", "label", "label_ids")


class _StopForward(Exception):
    """Raised by the capture hook to skip the (unneeded) rest of the forward pass while caching."""


# --------------------------------------------------------------------------------------------- helpers


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


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes} B"


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
        suffix_blocks: the states are the input of ``blocks[-suffix_blocks]`` (pass the same value to
            :func:`suffix_forward`).
        prefix_signature: where in which model the prefix was cut and a fingerprint of its frozen weights
            (``build_prefix_cache`` records it; ``None`` for a cache made by hand).  Each item, and so each collated
            batch, carries it: :func:`suffix_forward` refuses a batch whose signature is not its model's (another
            model, depth, checkpoint or ``suffix_blocks``), and ``DPTrainer`` refuses such a dataset up front.
    """

    def __init__(self, hidden: torch.Tensor, offsets: torch.Tensor, labels: torch.Tensor | None = None,
                 path: str | None = None, file_backed: bool | None = None, suffix_blocks: int = 1,
                 prefix_signature: str | None = None):
        if hidden.dim() != 2 or offsets.dim() != 1 or int(offsets[-1]) != hidden.shape[0]:
            raise ValueError("CachedFeatures: hidden must be [sum(L_i), H] and offsets [N+1] ending at sum(L_i)")
        if labels is not None and labels.shape[0] != offsets.shape[0] - 1:
            raise ValueError("CachedFeatures: one label per example expected")
        self.hidden = hidden
        self.offsets = offsets
        self.labels = labels
        self.path = path
        self.file_backed = path is not None if file_backed is None else file_backed
        if isinstance(suffix_blocks, bool) or not isinstance(suffix_blocks, int) or suffix_blocks < 1:
            raise ValueError(f"CachedFeatures: suffix_blocks must be a whole number >= 1, got {suffix_blocks!r}")
        self.suffix_blocks = suffix_blocks
        self.prefix_signature = prefix_signature
        self._signature_id = None if prefix_signature is None else signature_id(prefix_signature)

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

    def __getitem__(self, i: int) -> dict:
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
        if self._signature_id is not None:
            item[PREFIX_SIGNATURE_KEY] = torch.tensor(self._signature_id, dtype=torch.long)
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

    def __call__(self, features: list[dict]) -> dict:
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
        ids = [f.get(PREFIX_SIGNATURE_KEY) for f in features]
        if len({None if i is None else int(i) for i in ids}) > 1:
            raise PrefixCacheError("CachedFeaturesCollator: the batch mixes rows of prefix caches built differently")
        if ids[0] is not None:
            batch[PREFIX_SIGNATURE_KEY] = torch.stack([torch.as_tensor(i) for i in ids])
        if "labels" in features[0]:
            batch["labels"] = torch.stack([torch.as_tensor(f["labels"]) for f in features])
        return batch


# --------------------------------------------------------------------------------------- building


def row_length(row: dict) -> int | None:
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
    progress: bool = False,
    name: str = "dataset",
    suffix_blocks: int = 1,
    quiet: bool = False,
) -> CachedFeatures:
    """Run the frozen prefix of ``model`` once over ``dataset`` and cache the input of the last block
    (of ``blocks[-suffix_blocks]``).

    Args:
        model: a ``*ForSequenceClassification`` model (any trainable mode; the prefix = everything before
            the first suffix block, ``blocks[-suffix_blocks]`` of :func:`hf_dp.models.freezing.find_blocks`).  Run in eval mode under
            ``torch.no_grad()``; its training mode is restored afterwards.  The forward pass stops at the
            first suffix block (the suffix is not computed).
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
        progress: show a tqdm progress bar over the rows (the trainer passes ``not args.disable_tqdm``).
        name: what is cached (``train``, ``eval`` ...), for the bar and the log line.
        suffix_blocks: K: cache the input of ``blocks[-K]`` (1: the last block; ``--trainable last_k:K``).
        quiet: no progress bar and no log line (their row count would be secret, e.g. under ``--audit_canaries``
            the training set's rows are the real ones plus the canaries a secret draw included).

    Logs one INFO line when done: rows, seconds, rows/s, the cache's size and where it lives.  The size is the
    dataset's total token count times the hidden size: for a private training set a non-private statistic in the
    logs, like HF's logged training loss (docs/guarantee.md, "Not private").

    Returns:
        :class:`CachedFeatures` with ``L_i = attention_mask[i].sum()`` positions per example.

    Raises:
        PrefixCacheError: the blocks cannot be found, the last block is not called exactly once, or an
            example is not right-padded.
    """
    try:
        blocks_name, blocks = find_blocks(model)
    except ValueError as e:
        raise PrefixCacheError(f"{arch_name(model)}: {e}") from e
    cut = len(blocks) - check_suffix_blocks(model, blocks, blocks_name, suffix_blocks)
    last = blocks[cut]
    n = len(dataset)
    if n == 0:
        raise ValueError("build_prefix_cache: empty dataset")
    device = model_device(model)
    accepted = _model_input_keys(model) | set(_LABEL_KEYS)
    if "attention_mask" not in accepted:
        raise PrefixCacheError(f"{arch_name(model)}: its forward takes no attention_mask; cannot cache variable-length inputs.")

    # pass 1: lengths -> offsets, preallocated storage
    row_lengths = []
    for j in range(n):
        length = row_length(dataset[j])
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
        hidden, _ = hidden_arg(args, kwargs)
        if hidden is None:
            raise PrefixCacheError(f"{arch_name(model)}: could not find the hidden_states argument of the first suffix block.")
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
    signature: str | None = None
    call_order: dict[int, int] = {}  # call order of the modules in the first forward: the prefix's modules, for its signature

    def record(module, _args):
        call_order.setdefault(id(module), len(call_order))

    order_handles = [m.register_forward_pre_hook(record) for m in model.modules()]
    handle = last.register_forward_pre_hook(capture, with_kwargs=True)
    from tqdm.auto import tqdm

    bar = tqdm(total=n, desc=f"Caching the frozen prefix ({name})", unit=" rows", disable=quiet or not progress)
    t0 = time.perf_counter()
    try:
        model.eval()
        with torch.no_grad(), without_amp_wrapper(model):  # the prefix at the model's precision, even after --bf16's prepare
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
                    raise PrefixCacheError(f"{arch_name(model)}: the first suffix block was not called during the forward pass.")
                if order_handles:
                    for h in order_handles:
                        h.remove()
                    order_handles = []
                    signature = cut_signature(model, blocks_name, len(blocks), cut, modules_before(model, call_order, last))
                hidden = captured[0]
                if hidden.shape[:2] != mask.shape:
                    raise PrefixCacheError(
                        f"{arch_name(model)}: the first suffix block's input has shape {tuple(hidden.shape)}, expected "
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
                bar.update(len(idx))
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
        bar.close()
        handle.remove()
        for h in order_handles:
            h.remove()
        model.train(was_training)
        if fobj is not None:
            fobj.close()
            if not done and not unlinked:  # a failed build leaves no (partial) file, kept or not
                _remove_quietly(path)
    features = CachedFeatures(storage, offsets, labels_all, path=path if keep_file else None,
                              file_backed=fobj is not None, suffix_blocks=suffix_blocks, prefix_signature=signature)
    seconds = time.perf_counter() - t0
    where = f"file-backed in {cache_dir}" if fobj is not None else "in memory"
    if not quiet:
        logger.info("hf_dp prefix cache (%s): %s rows in %.1f s (%.0f rows/s), %s of %s states %s", name, f"{n:,}", seconds,
                    n / max(seconds, 1e-9), _size(features.nbytes), str(dtype).replace("torch.", ""), where)
    if fobj is not None and not keep_file and not unlinked:
        weakref.finalize(features, _remove_quietly, path)  # runs on garbage collection or at exit
        warnings.warn(f"could not unlink the open prefix cache file {path}; it is removed when the cache is released")
    return features
