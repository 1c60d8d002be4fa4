"""The frozen-prefix cache of one trainer (``--cache_frozen_features``): which datasets it caches, which given caches it
accepts, and the forward context its training, evaluation and prediction run in.

:class:`PrefixCacheManager` holds what :mod:`hf_dp.models.prefix_cache` (the cache itself: dataset, collator,
builder) needs from a trainer — the model, its ``--trainable`` cut, the cache flags — so that ``DPTrainer`` only
hands it its datasets. Every given :class:`~hf_dp.models.prefix_cache.CachedFeatures` is checked before any (slow)
build: the same cut (K blocks) and the same frozen weights (its ``prefix_signature``); after a resume HF has loaded
the checkpoint's weights, and the caches must still be caches of that prefix.
"""

from __future__ import annotations

import contextlib
import os

import torch

from .first_token import first_token_forward
from .prefix_cache import CachedFeatures, build_prefix_cache, prefix_signature, suffix_forward


class PrefixCacheManager:
    """The cache of ``model``'s frozen prefix below the trainable suffix of ``trainable_info`` (from
    :func:`~hf_dp.models.freezing.apply_trainable`), with the trainer's ``args`` (cache folder, dtype, batch size)."""

    def __init__(self, model, args, trainable_info, raw_collator):
        if trainable_info is None or trainable_info.suffix_blocks is None:
            raise ValueError("--cache_frozen_features needs --trainable last_block (or last_k:K, or head): the cached "
                             "prefix must be frozen")
        self.model, self.args, self.info = model, args, trainable_info
        self.raw_collator = raw_collator  # HF's resolved collator (tokenizer padding): builds the caches
        self.expected_signature: str | None = None
        self.check_dir()

    @property
    def suffix_blocks(self) -> int:
        return self.info.suffix_blocks

    def check_dir(self) -> None:
        """A ``--cache_frozen_features_dir`` inside ``output_dir`` only where a push cannot upload its files.

        Each cached dataset gets its own file, unlinked at creation unless ``--keep_frozen_features_cache``
        (see "Cache files" in :mod:`hf_dp.models.prefix_cache`); without a folder the cache is in memory."""
        cache_dir, out = self.args.cache_frozen_features_dir, self.args.output_dir
        if cache_dir is None or out is None:
            return
        cache_dir, out = os.path.realpath(cache_dir), os.path.realpath(out)
        if os.path.commonpath([cache_dir, out]) != out:
            return
        rel = os.path.relpath(cache_dir, out)
        if not (self.args.keep_frozen_features_cache and (rel == "." or rel.split(os.sep)[0].startswith("_"))):
            raise ValueError(
                f"--cache_frozen_features_dir {self.args.cache_frozen_features_dir} is inside --output_dir {self.args.output_dir}, "
                "whose files are saved and pushed with the model, and the cache holds the hidden states of every training "
                "example; use a folder outside output_dir (or, with --keep_frozen_features_cache, output_dir itself or a "
                "subfolder whose name starts with '_', which pushes skip)"
            )

    def check_given(self, dataset, name: str) -> None:
        """A :class:`CachedFeatures` passed in must be a cache of this model's frozen prefix, cut where the trainable
        suffix starts (same K, same depth, same frozen weights: its ``prefix_signature``)."""
        if not isinstance(dataset, CachedFeatures):
            return
        k = self.suffix_blocks
        if dataset.suffix_blocks != k:
            raise ValueError(
                f"the {name} dataset is a prefix cache of the input of the last {dataset.suffix_blocks} block(s), but "
                f"--trainable {self.info.mode} runs the last {k} from the cache; build it with suffix_blocks={k}"
            )
        if dataset.prefix_signature is not None:
            if self.expected_signature is None:
                self.expected_signature = prefix_signature(self.model, k)
            if dataset.prefix_signature != self.expected_signature:
                raise ValueError(
                    f"the {name} dataset is a prefix cache of {dataset.prefix_signature}, but this model's cached prefix "
                    f"is {self.expected_signature} (another model, depth or checkpoint); rebuild it from this model"
                )

    def check_after_resume(self, named_datasets, checkpoint: str) -> None:
        """HF has just loaded the checkpoint's weights, frozen prefix included: the caches (built from the weights the
        trainer was given) must still be caches of this prefix, else training would resume on stale states."""
        self.expected_signature = None
        for name, ds in named_datasets:
            try:
                self.check_given(ds, name)
            except ValueError as e:
                raise ValueError(f"resuming from {checkpoint}: {e} — the checkpoint's frozen weights differ from the model's "
                                 "the caches were built from; pass the model the checkpoint was trained from") from None

    def cache(self, dataset, name: str = "dataset"):
        """``dataset`` as a cache of the frozen prefix (a given cache is checked and returned as is; same N)."""
        self.check_given(dataset, name)
        if dataset is None or isinstance(dataset, CachedFeatures):
            return dataset
        return build_prefix_cache(
            self.model, dataset, self.raw_collator, batch_size=self.args.per_device_eval_batch_size,
            dtype=getattr(torch, self.args.cache_frozen_features_dtype), cache_dir=self.args.cache_frozen_features_dir,
            keep_file=self.args.keep_frozen_features_cache, name=name,
            progress=not self.args.disable_tqdm and self.args.process_index == 0,  # one bar under several processes
            suffix_blocks=self.suffix_blocks,
            # --audit_canaries: the training set's row count is real rows + the canaries a secret draw included;
            # --public_dataset_size: the actual count is private
            quiet=name == "train" and (bool(getattr(self.args, "audit_canaries", None))
                                       or getattr(self.args, "public_dataset_size", None) is not None),
        )

    def cache_all(self, train_dataset, eval_dataset):
        """(train cached, eval as given): every given cache checked before any build; the training set is cached now,
        the evaluation set(s) when first evaluated (:meth:`cache_eval`) — not before the first training step."""
        evals = eval_dataset.items() if isinstance(eval_dataset, dict) else [("", eval_dataset)]
        for name, ds in [("train", train_dataset)] + [(f"eval {k}".strip(), v) for k, v in evals]:
            self.check_given(ds, name)
        return self.cache(train_dataset, "train"), eval_dataset  # same N: q and δ unchanged

    def cache_eval(self, eval_dataset, key: str | None = None):
        """The trainer's eval set cached (a dict: its entry ``key``, or every entry when ``key`` is None; an eval dict
        stays a dict); an entry already cached is returned as is."""
        if isinstance(eval_dataset, dict):
            return {k: self.cache(v, f"eval {k}") if key is None or k == key else v for k, v in eval_dataset.items()}
        return self.cache(eval_dataset, "eval")


def forward_context(model, manager: PrefixCacheManager | None, first_token_only: str = "auto"):
    """Forward-pass context for train/evaluate/predict: the cached suffix (``manager`` given), or the full model with
    the first-token-only last block (``--first_token_only auto``), or the model unchanged."""
    auto = first_token_only == "auto"
    if manager is not None:
        return suffix_forward(model, first_token_only=None if auto else False, suffix_blocks=manager.suffix_blocks)
    return first_token_forward(model) if auto else contextlib.nullcontext()
