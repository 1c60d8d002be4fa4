"""What DPTrainer feeds the model, and what it may evaluate on.

* :class:`PoissonDataLoader` / :class:`EmptySafeCollator`: the training loader over HF's dataset and collator,
  drawn by :class:`~hf_dp.privacy.sampler.PoissonBatchSampler`; an empty Poisson micro-batch becomes a placeholder
  row marked with :data:`EMPTY_KEY` that contributes nothing.
* :func:`check_eval_is_not_train`: under DP, an eval set that is or overlaps the training set is refused.
* :func:`no_progress_bar` / :func:`withheld_messages`: what 🤗 Datasets and TRL would print about private rows while
  they are prepared, kept off the console.
* :func:`refuse_sharding`: under DP, FSDP and DeepSpeed are refused (docs/fsdp.md).
* :func:`example_lengths`: each training example's token count, for ``--train_sampling_strategy group_by_length``.
"""

from __future__ import annotations

import contextlib

import torch
from torch.utils.data import DataLoader

from hf_dp.run.contract import check_rows
from hf_dp.run.draws import DRAWN_KEY, ROW_DRAW_KEY, DrawStamped, draw_of  # noqa: F401  (ROW_DRAW_KEY: for hf_dp.audit)
from hf_dp.models.prefix_cache import CachedFeatures
from hf_dp.models.prefix_cache import row_length

EMPTY_KEY = "_hf_dp_empty_batch"
#: the batch key of each row's privacy unit within the micro-batch (0..U-1), with ``--privacy_unit_column``
UNITS_KEY = "_hf_dp_units"
#: the feature key :class:`UnitTagged` adds to each training row: the index of its unit in the training set
UNIT_OF_ROW_KEY = "_hf_dp_unit"
#: the batch key of the run's step a micro-batch was drawn for, under cyclic Poisson sampling (``--noise_bands`` > 1):
#: set when the micro-batch is collated, right after the sampler yields it, so it travels with the batch through any
#: loader that draws ahead; the step checks it against the step it is accumulated into (:func:`hf_dp.run.step.private_loss`)
PHASE_KEY = "_hf_dp_drawn_for"


@contextlib.contextmanager
def no_progress_bar():
    """🤗 Datasets' progress bars off (then as they were): a bar over the rows of a unit-level training set prints
    their number, which is private (one unit's removal changes it by its rows)."""
    import datasets

    was_off = datasets.are_progress_bars_disabled()
    datasets.disable_progress_bars()
    try:
        yield
    finally:
        if not was_off:
            datasets.enable_progress_bars()


@contextlib.contextmanager
def withheld_messages(log, args):
    """Under DP, around TRL's preparation of private data: every record of ``log`` (a TRL trainer module's logger,
    whose messages may quote a row's text) dropped, with the preparation in this process (``args.dataset_num_proc``
    None meanwhile: a worker process would log outside the filter). The caller logs one line that is the same whatever
    was dropped — whether anything was is a fact about the data."""
    log = getattr(log, "logger", log)  # accelerate's adapter around a logging.Logger
    num_proc, args.dataset_num_proc = args.dataset_num_proc, None
    log.addFilter(_drop_record)
    try:
        yield
    finally:
        log.removeFilter(_drop_record)
        args.dataset_num_proc = num_proc


def _drop_record(record) -> bool:
    return False


class TaggedRows(torch.utils.data.Dataset):
    """The training set as the loader reads it, each row (a dict) given one extra feature: ``KEY`` = :meth:`tag`
    of its index. Everything else (``column_names``, ``_fingerprint``, ...) is the wrapped dataset's. ``FLAG`` names
    the option that needs dict rows (in the refusal of any other row)."""

    KEY: str
    FLAG: str
    _OWN: tuple = ("dataset",)

    def __len__(self) -> int:
        return len(self.dataset)

    def tag(self, i: int) -> int:
        raise NotImplementedError

    def _tag(self, row, i: int):
        if not hasattr(row, "keys"):
            raise ValueError(f"{self.FLAG} needs training rows that are dicts (column -> value)")
        row = dict(row)
        row[self.KEY] = self.tag(i)
        return row

    def __getitem__(self, i):
        return self._tag(self.dataset[i], int(i))

    def __getitems__(self, indices):
        get = getattr(self.dataset, "__getitems__", None)
        rows = get(list(indices)) if get is not None else [self.dataset[i] for i in indices]
        return [self._tag(r, int(i)) for r, i in zip(rows, indices)]

    def __getattr__(self, name):  # column_names, _fingerprint, ... of the wrapped dataset
        if name in self._OWN:
            raise AttributeError(name)
        return getattr(self.dataset, name)


class UnitTagged(TaggedRows):
    """The training set as the loader reads it under ``--privacy_unit_column``: each row (a dict) gets
    :data:`UNIT_OF_ROW_KEY`, the index of its unit (from the unit column of the dataset given at construction, read
    once). :class:`EmptySafeCollator` takes it out before the user's collator sees the rows."""

    KEY, FLAG, _OWN = UNIT_OF_ROW_KEY, "--privacy_unit_column", ("dataset", "unit_of_row")

    def __init__(self, dataset, unit_of_row: torch.Tensor):
        if len(dataset) != len(unit_of_row):
            raise ValueError(f"{len(unit_of_row)} unit ids for a training set of {len(dataset)} rows")
        self.dataset, self.unit_of_row = dataset, unit_of_row

    def tag(self, i: int) -> int:
        return int(self.unit_of_row[i])


class PoissonDataLoader(DataLoader):
    """A DataLoader whose epoch reaches the Poisson sampler (HF calls ``set_epoch`` each epoch)."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class EmptySafeCollator:
    """Poisson batches can be empty. An empty micro-batch becomes one placeholder row (the first
    example) whose loss is multiplied by 0, so every rank still runs forward/backward (DDP stays in
    step); DPTrainer then discards what its backward left, so it adds nothing to the clipped sum (a
    zero gradient alone would not do for rules with a per-sample offset such as DP-SGD-L2's λθ).

    With ``units=True`` (``--privacy_unit_column``, rows from :class:`UnitTagged`) each row's unit index is taken out
    before the user's collator sees the rows, and the batch gets :data:`UNITS_KEY`: each row's unit as 0..U-1 in order
    of first appearance (the sampler puts all rows of a drawn unit in the same micro-batch).

    A collator that emits several consecutive rows for one example (a long document cut into blocks) is served by
    the same mechanism: :meth:`_attribute` checks that each example's rows are what the collator makes of that example
    alone, and the batch's :data:`UNITS_KEY` then says which rows are one example (or one unit), clipped together.
    Any other row count (packing, views appended after the batch, rows that differ from the example's own) is refused
    (:func:`hf_dp.run.contract.check_rows`).

    First of all, the rows given must be exactly one Poisson draw (their :data:`hf_dp.run.draws.ROW_DRAW_KEY` stamps, taken out here:
    every position of one draw once, nothing else), else ValueError; the batch's :data:`DRAWN_KEY` then records the
    draw and the batch's rows (rows read one by one carry no stamp: draw 0, which ``training_step`` refuses)."""

    def __init__(self, collate_fn, dataset, units: bool = False, unit_column: str | None = None, attribute: bool = False,
                 drawn_for=None, token: int | None = None):
        self.collate_fn = collate_fn
        #: the trainer's loader token: each batch's :data:`DRAWN_KEY` (with the draw its rows carry, :class:`DrawStamped`)
        self.token = token
        #: cyclic Poisson sampling: a callable giving the step the sampler drew the batch being collated for
        #: (``PoissonBatchSampler.drawn_for``), put in the batch as :data:`PHASE_KEY`; ``None``: no tag
        self.drawn_for = drawn_for
        self.dataset = dataset
        self.units = bool(units)
        self.unit_column = unit_column  # dropped from the rows too (with remove_unused_columns=False it stays in them)
        #: attribute rows to examples on every micro-batch (a collator seen to emit several rows for one example)
        self.attribute = bool(attribute)

    def _split_units(self, features):
        if not self.units:
            return features, None
        index: dict = {}
        units, plain = [], []
        for f in features:
            if not hasattr(f, "keys") or UNIT_OF_ROW_KEY not in f:
                raise ValueError("internal error: a training row reached the collator without its privacy unit")
            f = dict(f)
            units.append(index.setdefault(int(f.pop(UNIT_OF_ROW_KEY)), len(index)))
            if self.unit_column is not None:
                f.pop(self.unit_column, None)
            plain.append(f)
        return plain, torch.tensor(units, dtype=torch.long)

    def __call__(self, features):
        features, draw = draw_of(features)  # the Poisson draw these rows are, exactly (None: rows read one by one)
        empty = len(features) == 0
        if empty:
            features = [self.dataset[0]]
        features, units = self._split_units(features)
        batch = self.collate_fn(features)
        own = [k for k in (UNITS_KEY, EMPTY_KEY, PHASE_KEY, DRAWN_KEY) if hasattr(batch, "keys") and k in batch]
        if own:
            raise ValueError(
                f"the data collator returned the key '{own[0]}', which DPTrainer sets itself (which rows form one "
                "privacy unit, an empty micro-batch, the step a batch was drawn for); rename or drop it"
            )
        rows = _rows(batch)
        if rows is not None and (self.attribute or rows != len(features)):
            # several rows of one example: each must be the collator's own output for that example alone
            owner = self._attribute(features, batch, rows)
            units = owner if units is None else units[owner]
            units = torch.unique(units, return_inverse=True)[1]  # an example with no row leaves no gap in 0..U-1
        else:
            check_rows(batch, len(features))  # one row per drawn example (hf_dp.run.contract)
        if empty:
            batch[EMPTY_KEY] = True
            units = None if units is None else torch.zeros_like(units)
        if units is not None:
            batch[UNITS_KEY] = units
        if self.drawn_for is not None:  # the sampler's draw of this very batch (collated in the loop that drew it)
            batch[PHASE_KEY] = self.drawn_for()
        if self.token is not None:  # the draw these rows are (0: rows not drawn by the sampler) and the batch's rows
            batch[DRAWN_KEY] = (self.token,) + (draw if draw is not None else (0, 0, 0)) + (_batch_rows(batch),)
        return batch

    def _attribute(self, features, batch, rows: int) -> torch.Tensor:
        """Each row's example (``[rows]``) for a collator that emits several consecutive rows per example, or the
        one-row-per-example refusal. Every example is collated alone again: its rows must be exactly the rows at its
        place in the batch (up to padding, which must be one constant per key), so that no row carries another
        example's data; the rows of one example are then one unit, clipped together."""
        singles = [self.collate_fn([f]) for f in features]
        counts = [_rows(b) for b in singles]
        ok = all(c is not None for c in counts) and sum(counts) == rows
        keys = [k for k, v in batch.items() if torch.is_tensor(v) and v.dim() >= 1]
        pads: dict = {k: [] for k in keys}
        offset = 0
        for single, count in zip(singles, counts if ok else []):
            for key in keys:
                part = single.get(key) if hasattr(single, "get") else None
                if not (torch.is_tensor(part) and part.dim() == batch[key].dim() and part.shape[0] == count):
                    ok = False
                    break
                pad = _same_rows(batch[key][offset : offset + count], part)
                if pad is None:
                    ok = False
                    break
                pads[key].append(pad)
            if not ok:
                break
            offset += count
        ok = ok and _neutral_padding(pads)
        if not ok:
            if rows != len(features):
                check_rows(batch, len(features))  # raises: the one-row-per-example message
            raise ValueError(
                "the data collator's rows are not what it makes of each drawn example alone (an example's rows must be "
                "consecutive and its own, padded only with masked, unscored positions): a collator that mixes, packs or "
                "reorders examples across rows gives one example influence beyond the clip norm C, and the reported "
                "epsilon would be false; give each example its own rows"
            )
        return torch.repeat_interleave(torch.arange(len(features)), torch.tensor(counts))


def _rows(batch) -> int | None:
    """The number of rows of a collated batch (its first tensor's first dimension), ``None`` if it has no tensor."""
    if not hasattr(batch, "items"):
        return None
    for v in batch.values():
        if torch.is_tensor(v) and v.dim() >= 1:
            return int(v.shape[0])
    return None


def _batch_rows(batch) -> int | None:
    """The first dimension every batched value of a collated batch has (:func:`hf_dp.run.contract.check_rows`: the
    first value with a shape, a tensor or an array), ``None`` if none has one: the rows :data:`DRAWN_KEY` records."""
    for v in batch.values() if hasattr(batch, "values") else ():
        shape = getattr(v, "shape", None)
        if shape is not None and len(shape) > 0:
            return int(shape[0])
    return None


def _same_rows(full: torch.Tensor, alone: torch.Tensor):
    """The padding ``full`` (rows of a batch, padded to the batch's length) adds to ``alone`` (the same rows collated
    alone) along dimension 1, on the right or the left: an empty tensor when they are equal, ``None`` when ``full``
    does not hold ``alone``."""
    if full.dim() == 1 or full.shape[1:] == alone.shape[1:]:
        return full.new_zeros((0,)) if torch.equal(full, alone) else None
    if full.dim() != alone.dim() or full.shape[2:] != alone.shape[2:] or full.shape[1] < alone.shape[1]:
        return None
    width, extra = alone.shape[1], full.shape[1] - alone.shape[1]
    for kept, pad in ((full[:, :width], full[:, width:]), (full[:, extra:], full[:, :extra])):
        if torch.equal(kept, alone):
            return pad.reshape(-1)
    return None


#: the only padding values that carry nothing: a masked position, an unscored label
_NEUTRAL_PAD = {"attention_mask": 0, "labels": -100}


def _neutral_padding(pads: dict) -> bool:
    """The padding the batch added beyond each example's own width is inert: ``attention_mask`` 0 and ``labels`` -100
    where the batch has them, and for every other key one constant across the whole batch (so that no example's
    rows are padded with another example's values)."""
    for key, parts in pads.items():
        values = torch.cat([p.reshape(-1) for p in parts]) if parts else torch.zeros(0)
        if values.numel() == 0:
            continue
        if key in _NEUTRAL_PAD:
            if not bool((values == _NEUTRAL_PAD[key]).all()):
                return False
        elif not bool((values == values[0]).all()):
            return False
    return True


def _hashable(v):
    if torch.is_tensor(v):
        return v.item() if v.numel() == 1 else tuple(v.reshape(-1).tolist())
    if isinstance(v, list):
        return tuple(v)
    return v


def unit_rows(dataset, column: str) -> list[list[int]]:
    """The rows of each privacy unit of a training set (units in order of first appearance), from its ``column``.
    One sentence (ValueError) for a missing column or a missing (None/NaN/empty) unit value."""
    columns = getattr(dataset, "column_names", None)
    if columns is not None:
        if column not in columns:
            raise ValueError(
                f"--privacy_unit_column {column}: the training set has no column '{column}' (it has {sorted(columns)})"
            )
        values = list(dataset[column])
    else:
        values = []
        for i in range(len(dataset)):
            row = dataset[i]
            if not hasattr(row, "keys") or column not in row:
                have = sorted(row.keys()) if hasattr(row, "keys") else type(row).__name__
                raise ValueError(f"--privacy_unit_column {column}: training row {i} (counting from 0) has no '{column}' (it has {have})")
            values.append(row[column])
    for i, v in enumerate(values):
        if v is None or (isinstance(v, float) and v != v) or (isinstance(v, str) and not v.strip()):
            raise ValueError(
                f"--privacy_unit_column {column}: training row {i} (counting from 0) has no unit ({v!r}); every row must name its unit"
            )
        if isinstance(v, (list, tuple, dict, set)) or (torch.is_tensor(v) and v.numel() != 1):
            raise ValueError(
                f"--privacy_unit_column {column}: training row {i} (counting from 0) has the unit {v!r}, not a single value (a string or "
                "a number); one value must name one unit"
            )
    from hf_dp.privacy.sampler import PoissonBatchSampler

    return PoissonBatchSampler.group_rows([_hashable(v) for v in values])


def refuse_sharding(args, fsdp_enabled: bool = False, deepspeed_enabled: bool = False) -> None:
    """Under DP, refuse DeepSpeed (from the arguments, or from an Accelerate config), and what FSDP does not support
    (:func:`hf_dp.clipping.sharding.check_args`: FSDP2 with two-pass ghost clipping is supported): see docs/fsdp.md."""
    if getattr(args, "deepspeed", None) or deepspeed_enabled:
        raise ValueError(
            "--deepspeed is not supported with DP: DeepSpeed's engine runs the backward, the gradient reduction, "
            "the loss scaling and the optimizer step itself, bypassing hf_dp's per-example clipping and noise; use "
            "several processes with DDP (ghost clipping, --clipping auto) or FSDP2 (--fsdp full_shard) (docs/fsdp.md)"
        )
    from hf_dp.clipping import sharding

    if fsdp_enabled or sharding.fsdp_requested(args):
        sharding.check_args(args)


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


# ---------------------------------------------------------------------------------------------------
# the training loader of a DPTrainer
# ---------------------------------------------------------------------------------------------------
def group_by_length(args) -> bool:
    """``--train_sampling_strategy group_by_length``."""
    return str(getattr(args.train_sampling_strategy, "value", args.train_sampling_strategy)) == "group_by_length"


def set_sampler_lengths(dp, args, dataset) -> None:
    """group_by_length: the run's Poisson sampler (``dp.sampler``, ``dp`` the run's privacy state) orders each draw by
    the lengths of ``dataset``'s rows (in memory only); else no order."""
    if not group_by_length(args):
        dp.sampler.lengths, dp.lengths_of = None, None
    elif dp.lengths_of is not dataset:  # computed once per dataset object
        dp.sampler.lengths = example_lengths(dataset, args.length_column_name)
        dp.lengths_of = dataset


def poisson_loader(dp, args, base: DataLoader, train_dataset, audit_parts=None) -> PoissonDataLoader:
    """``DPTrainer.get_train_dataloader`` under DP: HF's loader ``base`` (its column removal, collator, worker settings)
    drawn by the run's Poisson sampler (``dp``: the run's privacy state), its rows tagged with their units under
    ``--privacy_unit_column``, every micro-batch checked and made safe by :class:`EmptySafeCollator`; the sampler's
    lengths are ``train_dataset``'s (:func:`set_sampler_lengths`). Refuses a training set whose size is not the one
    the noise was calibrated for. ``audit_parts(dp, dataset, collate)``: the one-run audit's tagging of its canaries
    (:func:`hf_dp.audit.canaries.loader_parts`), passed by the trainer."""
    dataset = base.dataset
    if len(dataset) != dp.sampler.num_rows:
        raise ValueError(
            f"the training dataset has {len(dataset)} rows, but this DPTrainer calibrated the noise for "
            f"{dp.sampler.num_rows} rows (N = {dp.sampler.num_samples}, q = B/N, delta < 1/N): "
            "train_dataset was replaced after the trainer was made; make a new DPTrainer for other data"
        )
    set_sampler_lengths(dp, args, train_dataset)
    units = dp.units.of_row is not None
    if units:
        dataset = UnitTagged(dataset, dp.units.of_row)
    collate = base.collate_fn
    if audit_parts is not None:  # --audit_kind gradient: the canaries' tags
        dataset, collate = audit_parts(dp, dataset, collate)
    stamped = DrawStamped(dataset)  # each drawn row stamped with its draw, checked by the collator
    # the training loader's datasets (HF's; with unit or canary tags; stamped): a wrapper showing any of them is the
    # training loader to DPTrainer.num_examples, which logs public counts only
    dp.contract.loader_dataset = (base.dataset, dataset, stamped)
    return PoissonDataLoader(
        stamped,
        batch_sampler=dp.sampler,
        collate_fn=EmptySafeCollator(collate, dataset, units=units, unit_column=args.privacy_unit_column,
                                     attribute=dp.contract.several_rows,
                                     drawn_for=(lambda: dp.sampler.drawn_for) if dp.sampler.bands > 1 else None,
                                     token=dp.contract.loader_token),
        num_workers=args.dataloader_num_workers,
        pin_memory=args.dataloader_pin_memory and torch.accelerator.is_available(),  # no CPU-only warning
    )


# ---------------------------------------------------------------------------------------------------
# micro-batches within the public token bound of the clipping engine
# ---------------------------------------------------------------------------------------------------
def split_to_bounds(inputs: dict, bounds, fsdp: bool = False) -> list:
    """``inputs`` (one micro-batch) as a list of micro-batches of at most ``bounds.max_tokens`` tokens each (rows ×
    padded length), privacy units whole (:data:`UNITS_KEY`, renumbered 0..U'-1 in each part; a unit whose rows alone
    exceed the bound is a part of its own): ghost clipping's rounding allowance is computed from these public bounds
    (:class:`hf_dp.clipping.common.TokenBounds`), so every float32 clipped sum must run over no more tokens. A
    micro-batch within the bound (the usual case: the bound allows for a Poisson micro-batch far above its mean) is
    returned as it is. ``ValueError`` for a padded length above ``bounds.max_length``, and under FSDP for a micro-batch
    that would need splitting (the ranks' collectives must stay in step). Which rows go together changes no clip
    factor and no sum: each example's clipped contribution is a function of that example alone."""
    ids = next((inputs[k] for k in ("input_ids", "inputs_embeds", "attention_mask") if torch.is_tensor(inputs.get(k))), None)
    if ids is None:  # a model of other inputs: the rows of its first batched tensor, their longest second axis
        ids = next((v for k, v in inputs.items() if torch.is_tensor(v) and v.dim() > 0 and k != UNITS_KEY), None)
    if ids is None or ids.dim() == 0 or bool(inputs.get(EMPTY_KEY, False)):
        return [inputs]
    rows = int(ids.shape[0])
    length = int(ids.shape[1]) if ids.dim() > 1 else max(
        [int(v.shape[1]) for v in inputs.values() if torch.is_tensor(v) and v.dim() > 1 and v.shape[0] == rows] or [1])
    mask = inputs.get("attention_mask")
    real = int((mask != 0).sum(-1).max()) if torch.is_tensor(mask) and mask.dim() == 2 and mask.numel() else length
    if real > bounds.max_length:  # (padding beyond it, e.g. pad_to_multiple_of, adds only exact zeros to the sums)
        raise ValueError(f"a training row of {real} tokens exceeds the run's public --dp_max_length "
                         f"{bounds.max_length}: truncate the rows to it, or raise --dp_max_length")
    if rows * length <= bounds.max_tokens:
        return [inputs]
    if fsdp:
        raise ValueError(f"a micro-batch of {rows} rows x {length} tokens exceeds the run's public token bound "
                         f"({bounds.max_tokens}); under FSDP it cannot be split (the ranks' collectives must stay in "
                         "step): raise --gradient_accumulation_steps or lower --dp_max_length")
    cap = max(1, bounds.max_tokens // length)
    units = inputs.get(UNITS_KEY)
    unit_of = units.tolist() if torch.is_tensor(units) else list(range(rows))
    members: dict = {}
    for r, u in enumerate(unit_of):
        members.setdefault(u, []).append(r)
    parts, current = [], []
    for rs in members.values():  # units in order of first appearance, whole
        if current and len(current) + len(rs) > cap:
            parts.append(current)
            current = []
        current = current + rs
    if current:
        parts.append(current)
    out = []
    for part in parts:
        index = torch.tensor(part, dtype=torch.long)
        piece = {}
        for k, v in inputs.items():
            if torch.is_tensor(v) and v.dim() > 0 and v.shape[0] == rows:
                piece[k] = v.index_select(0, index.to(v.device))
            else:
                piece[k] = v
        if torch.is_tensor(units):
            first: dict = {}
            piece[UNITS_KEY] = torch.tensor([first.setdefault(u, len(first)) for u in piece[UNITS_KEY].tolist()],
                                            dtype=units.dtype, device=units.device)
        out.append(type(inputs)(piece) if not isinstance(inputs, dict) else piece)
    return out
