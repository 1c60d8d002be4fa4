"""What DPTrainer feeds the model, and what it may evaluate on.

* :class:`PoissonDataLoader` / :class:`EmptySafeCollator`: the training loader over HF's dataset and collator,
  drawn by :class:`~hf_dp.privacy.sampler.PoissonBatchSampler`; an empty Poisson micro-batch becomes a placeholder
  row marked with :data:`EMPTY_KEY` that contributes nothing.
* :func:`check_eval_is_not_train`: under DP, an eval set that is or overlaps the training set is refused.
* :func:`refuse_sharding`: under DP, FSDP and DeepSpeed are refused (docs/fsdp.md).
* :func:`example_lengths`: each training example's token count, for ``--train_sampling_strategy group_by_length``.
"""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader

from hf_dp.contract import check_rows
from hf_dp.models.prefix_cache import CachedFeatures
from hf_dp.models.prefix_cache import row_length

EMPTY_KEY = "_hf_dp_empty_batch"


class PoissonDataLoader(DataLoader):
    """A DataLoader whose epoch reaches the Poisson sampler (HF calls ``set_epoch`` each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class EmptySafeCollator:
    """Poisson batches can be empty. An empty micro-batch becomes one placeholder row (the first
    example) whose loss is multiplied by 0, so every rank still runs forward/backward (DDP stays in
    step); DPTrainer then discards what its backward left, so it adds nothing to the clipped sum (a
    zero gradient alone would not do for rules with a per-sample offset such as DP-SGD-L2's λθ)."""

    def __init__(self, collate_fn, dataset):
        self.collate_fn = collate_fn
        self.dataset = dataset

    def __call__(self, features):
        if len(features) == 0:
            batch = self.collate_fn([self.dataset[0]])
            check_rows(batch, 1)
            batch[EMPTY_KEY] = True
            return batch
        batch = self.collate_fn(features)
        check_rows(batch, len(features))  # one row per drawn example (hf_dp.contract)
        return batch


def refuse_sharding(args, fsdp_enabled: bool = False, deepspeed_enabled: bool = False) -> None:
    """Under DP, refuse FSDP and DeepSpeed (from the arguments, or from an Accelerate config): see docs/fsdp.md."""
    if args.fsdp or args.fsdp_config or fsdp_enabled:
        raise ValueError(
            "--fsdp/--fsdp_config is not supported with DP: FSDP reduce-scatters the summed gradient of each shard "
            "during backward, before hf_dp can clip each example's gradient and add the noise once; use several "
            "processes with DDP (ghost clipping, --clipping auto) or --trainable last_block/lora to fit the model "
            "(plan: docs/fsdp.md)"
        )
    if getattr(args, "deepspeed", None) or deepspeed_enabled:
        raise ValueError(
            "--deepspeed is not supported with DP: DeepSpeed's engine runs the backward, the gradient reduction, "
            "the loss scaling and the optimizer step itself, bypassing hf_dp's per-example clipping and noise; use "
            "several processes with DDP (ghost clipping, --clipping auto) (plan: docs/fsdp.md)"
        )


def same_dataset(a, b) -> bool:
    """``a`` is ``b``: the same object, or 🤗 Datasets with the same ``_fingerprint`` (same data and transforms)."""
    if a is b:
        return True
    fa, fb = getattr(a, "_fingerprint", None), getattr(b, "_fingerprint", None)
    return fa is not None and fa == fb


def subset_base(ds):
    """``(base, indices)`` of a (nested) ``torch.utils.data.Subset``, else ``(ds, None)``."""
    indices = None
    while isinstance(ds, torch.utils.data.Subset):
        idx = list(ds.indices)
        indices = idx if indices is None else [idx[i] for i in indices]
        ds = ds.dataset
    return ds, indices


def check_eval_is_not_train(eval_dataset, train_dataset) -> None:
    """Refuse (under DP) an eval set that is the training set, contains it, or is a ``Subset`` overlapping it.

    Detected: the same object, the same 🤗 Datasets fingerprint (any value of an eval dict), and
    ``torch.utils.data.Subset`` views of the same base dataset whose indices overlap. Not detectable in
    general: a ``select``/``shuffle``/``filter``/``train_test_split`` of the training set (new fingerprint) or
    a copy of its rows; keeping evaluation data disjoint from the training data is the user's job."""
    if eval_dataset is None or train_dataset is None:
        return
    train_base, train_idx = subset_base(train_dataset)
    for ds in eval_dataset.values() if isinstance(eval_dataset, dict) else [eval_dataset]:
        base, idx = subset_base(ds)
        same = same_dataset(ds, train_dataset) or (
            same_dataset(base, train_base)
            and (idx is None or train_idx is None or not set(idx).isdisjoint(train_idx))
        )
        if same:
            raise ValueError(
                "the eval dataset is (or overlaps) the private training set, so its metrics and any model selection or "
                "early stopping on them would publish non-private statistics of the training data; evaluate on held-out data"
            )


def example_lengths(dataset, length_column_name: str = "length") -> torch.Tensor:
    """``[N]`` token count of each example, for ``--train_sampling_strategy group_by_length``.

    From, in order: a prefix cache's own lengths (``CachedFeatures.lengths``); the dataset's ``length_column_name``
    column; the sum of each row's ``attention_mask``; the length of its ``input_ids``. The counts only order the rows
    of a Poisson draw (:class:`~hf_dp.privacy.sampler.PoissonBatchSampler`); they are kept in memory only."""
    if isinstance(dataset, CachedFeatures):
        return dataset.lengths.to(torch.long)
    columns = getattr(dataset, "column_names", None)
    if columns is not None:  # a 🤗 Dataset: read whole columns
        if length_column_name in columns:
            return torch.as_tensor(list(dataset[length_column_name]), dtype=torch.long)
        if "attention_mask" in columns:
            return torch.tensor([int(sum(m)) for m in dataset["attention_mask"]], dtype=torch.long)
        if "input_ids" in columns:
            return torch.tensor([len(x) for x in dataset["input_ids"]], dtype=torch.long)
    else:
        rows = (dataset[i] for i in range(len(dataset)))
        lengths = [row_length(r) if isinstance(r, dict) else None for r in rows]
        if all(n is not None for n in lengths):
            return torch.tensor(lengths, dtype=torch.long)
    raise ValueError(
        f"--train_sampling_strategy group_by_length needs each training example's length: give the dataset a "
        f"'{length_column_name}' column (--length_column_name), or 'attention_mask' / 'input_ids'"
    )
