"""The DP score of a private selection's trials (``score_data="private"``, :mod:`hf_dp.tuning.search`).

Each trial is scored on a held-out part of the private data (``score_dataset``, default the eval set: rows no trial
trains on) through a **DP score**: each example's score s_i in [0, 1] (``example_score(logits, labels)``, called on one
example's ``[1, ...]`` logits and labels at a time so that no row's score reads another row, default the
accuracy: 1 if the argmax prediction is the label — for a causal LM the sequence's next-token accuracy; a user
function's values are clipped to [0, 1], NaN counts 0), under ``--privacy_unit_column`` the mean over each unit's
held-out rows (so one unit moves the sum by at most 1), released as Σ s + N(0, σ_s²) with σ_s =
``score_noise_multiplier`` (default :data:`~hf_dp.privacy.selection.DEFAULT_SCORE_NOISE_MULTIPLIER`); the
trial's score is that noisy sum divided by n, the number of held-out units. **n is treated as public**, as the
accountant's q = B/N treats the training set's size. Each trial's mechanism is then its training composed with
this Gaussian (sensitivity 1), and the total of the selection counts it (:mod:`hf_dp.privacy.selection`). The
noise comes from the trial's randomness source: OS entropy; under ``--dp_seed`` a stream keyed by (seed,
"selection", "score", trial), which no training stream's key equals; ``--secure_rng``: the OS CSPRNG. No exact
statistic of the held-out set is computed outside that sum: the trials do not call ``evaluate()`` (no metrics,
no log line, no ``on_evaluate``/``on_predict`` callback, no tracker), do not evaluate during training
(``eval_strategy`` "no"; a trial refuses to evaluate the held-out set, e.g. for a callback that sets
``control.should_evaluate``), cache it without the frozen-prefix cache's size line (its total token count), read
it in order with one row per example (else refused, with public numbers only), and the record and the released
trainer hold the noisy score only. δ must be below 1/(N + n): the held-out rows are private data too.
``example_score`` must be a pure function of the one example it is given (state kept across calls can move other
examples' scores: not detectable). Afterwards the trainer refuses ``evaluate()`` and ``predict()`` on that held-out set (the same object, fingerprint or an overlapping
``Subset``: :func:`refuse_evaluating_the_score_set`; its bare ``evaluate()`` too when it is the eval set): exact
metrics of it would reach the logs, the card and ``privacy.json`` outside the guarantee. A copy of its rows is not
detected; evaluating one publishes exact statistics of private data, as any evaluation of private data does.

:func:`check_private_score` holds the refusals of such a search, one sentence each, before any model is built.
"""

from __future__ import annotations

import contextlib
import logging

from hf_dp.privacy.randomness import secure_gaussian_like, stream_generator
from hf_dp.privacy.selection import check_score_noise_multiplier


def check_private_score(args, spec, score_dataset, score_noise_multiplier, example_score, compute_objective, direction,
                        *, eval_dataset=None, train_sets=(), model=None, objective=None) -> None:
    """The refusals of ``score_data="private"`` (a DP score on held-out private data), one sentence each. ``spec``: the
    planned mechanism's numbers (``None``: not planned); ``eval_dataset``: the eval set the trainer was given
    (:func:`raw_eval`), the held-out set when ``score_dataset`` is ``None``; ``train_sets``: the training set as given
    and as the trainer reads it; ``model`` and ``objective``: the trainer's (``hf_dp.models.loss``), for the default
    score."""
    from hf_dp.run.data import check_eval_is_not_train, unit_rows

    heldout = score_dataset if score_dataset is not None else eval_dataset
    if heldout is None:
        raise ValueError("score_data='private' scores every trial on held-out private data: give score_dataset= (rows "
                         "of the private data that no trial trains on), or the DPTrainer an eval_dataset of them")
    if isinstance(heldout, dict):
        raise ValueError("score_data='private' scores on one held-out set: give score_dataset= one dataset, not a dict")
    try:
        n = len(heldout)
    except TypeError:
        raise ValueError("the held-out score set must be a sized dataset (its size n divides the noisy sum)") from None
    if n == 0:
        raise ValueError("the held-out score set is empty")
    for train in {id(x): x for x in train_sets if x is not None}.values():
        try:
            check_eval_is_not_train(heldout, train)
        except ValueError:
            raise ValueError("the held-out score set is (or overlaps) the training set: score on rows no trial trains "
                             "on") from None
    if compute_objective is not None:
        raise ValueError("under score_data='private' a trial's score is the DP mean of example_score over the held-out "
                         "set, not compute_objective(metrics) (exact metrics of private data): give example_score= "
                         "instead")
    if example_score is not None and not callable(example_score):
        raise ValueError(f"example_score must be a function (logits, labels) -> one score in [0, 1] per example, got "
                         f"{example_score!r}")
    if example_score is None:
        config = getattr(model, "config", None)
        problem = getattr(config, "problem_type", None)
        if getattr(objective, "name", None) != "causal_lm" and (problem in ("regression", "multi_label_classification")
                                         or getattr(config, "num_labels", 2) == 1):
            raise ValueError("the default DP score is the accuracy of one label per example, which a regression or "
                             "multi-label head does not have: give example_score=(logits, labels) -> one score in "
                             "[0, 1] per example")
        if direction != "maximize":
            raise ValueError("the default DP score is the accuracy (higher is better): pass direction='maximize'")
    if score_noise_multiplier is not None:
        check_score_noise_multiplier(score_noise_multiplier)
    if args.dataloader_drop_last:
        raise ValueError("score_data='private' scores every held-out row: drop --dataloader_drop_last")
    units = n
    if args.privacy_unit_column is not None:
        try:
            units = len(unit_rows(heldout, args.privacy_unit_column))
        except ValueError as e:
            raise ValueError(f"the held-out score set: {e}") from None
    if spec is not None:  # the held-out rows are private data too: delta < 1/(N + n) over both (N + n >= their union)
        total = int(spec.dataset_size) + int(units)
        if spec.delta >= 1.0 / total:
            raise ValueError(f"delta={spec.delta:g} is not below 1/(N + n) = 1/{total} = {1.0 / total:.3g} (N = "
                             f"{spec.dataset_size} training units, n = {units} held-out units, both private data): such "
                             "a delta allows a mechanism that publishes a whole record; choose a smaller delta")


def raw_eval(init_kwargs: dict, eval_dataset):
    """The eval set the trainer was given (before any frozen-prefix caching): the ``eval_dataset=`` of its
    construction (``init_kwargs``, ``DPTrainer._dp_init_kwargs``), else its ``eval_dataset``."""
    return init_kwargs["eval_dataset"] if "eval_dataset" in init_kwargs else eval_dataset


def accuracy(logits, labels):
    """The default per-example score: 1 if the argmax prediction is the label (``[B, C]`` logits, ``[B]`` labels);
    for a causal LM (``[B, T, V]`` logits, ``[B, T]`` labels) the share of the sequence's scored next tokens
    (labels shifted as the model's own loss shifts them, -100 ignored) predicted exactly, 0 with none."""
    import torch

    if labels is None:
        raise ValueError("the held-out score set has no labels: the default DP score (accuracy) needs them")
    if logits.dim() == 3:
        shift = torch.nn.functional.pad(labels, (0, 1), value=-100)[:, 1:]
        scored = shift != -100
        hits = (logits.argmax(-1) == shift) & scored
        return hits.sum(1).double() / scored.sum(1).clamp(min=1).double()
    return (logits.argmax(-1) == labels.view(-1)).double()


def heldout_scores(trainer, dataset, example_score=None):
    """Each held-out row's score in [0, 1] (float64, in the dataset's order), from ``trainer``'s model: its own
    prediction steps (no ``evaluate()``/``predict()``: no metrics, logs or callbacks). The score function is called
    on one example at a time (its ``[1, ...]`` logits and labels), so no row's score reads another row. Values outside
    [0, 1] are clipped, NaN counts 0. Exact: for :func:`dp_score` only, never to be released.
    It takes the trainer: it runs HF's prediction loop pieces (``get_test_dataloader``, ``prediction_step``)."""
    import torch
    from transformers.trainer_pt_utils import find_batch_size

    score = example_score or accuracy
    args = trainer.args
    if getattr(args, "dataloader_num_workers", 0) and getattr(args, "dataloader_in_order", True) is False:
        raise ValueError("the DP score reads the held-out rows in their order (a unit's rows by position): drop "
                         "--dataloader_in_order false (or --dataloader_num_workers)")
    loader = trainer.get_test_dataloader(dataset)  # the dataset's order (hf_dp's eval sampler), every row
    # each batch must hold one row per example: a full batch, or the last one. The messages hold public numbers only
    # (the batch size, n): a count of rows a collator made would be a statistic of the held-out data
    size = (getattr(loader, "batch_size", None) or getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
            or args.eval_batch_size)
    n = len(dataset)
    one_row_each = ("the held-out set's batches must hold exactly one row per example (batches of {size} examples, "
                    "the last one {last}): the DP score needs one row per example, so that one example moves one score "
                    "(a collator or model that makes several rows per example, or drops some, cannot be scored)")
    model = trainer.model
    was_training = model.training
    model.eval()
    out = []
    try:
        with trainer._suffix_ctx():
            for inputs in loader:
                rows = find_batch_size(inputs)
                if rows not in (size, n % size or size):
                    raise ValueError(one_row_each.format(size=size, last=n % size or size))
                _, logits, labels = trainer.prediction_step(model, inputs, prediction_loss_only=False)
                if isinstance(logits, (tuple, list)):
                    logits = logits[0]
                if logits.shape[0] != rows:
                    raise ValueError(one_row_each.format(size=size, last=n % size or size))
                # one call per example (its own logits and labels): a score whose value for one row depended on the
                # batch's other rows would let one example move the sum by up to the batch size, not 1
                values = []
                for i in range(rows):
                    value = torch.as_tensor(score(logits[i:i + 1], _row(labels, i))).detach()
                    if value.numel() != 1:
                        raise ValueError(f"example_score returned {value.numel()} values for one example: it must "
                                         "return one score per example")
                    values.append(value.to("cpu", torch.float64).reshape(()))
                values = torch.stack(values) if values else torch.zeros(0, dtype=torch.float64)
                out.append(torch.nan_to_num(values, nan=0.0, posinf=1.0, neginf=0.0).clamp(0.0, 1.0))
    finally:
        model.train(was_training)
    scores = torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)
    if scores.numel() != n:  # rows made or dropped across batches (dataloader_drop_last is refused)
        raise ValueError(one_row_each.format(size=size, last=n % size or size))
    return scores


def _row(labels, i):
    """Example ``i``'s labels (a one-row slice; each tensor of a tuple sliced; ``None`` stays ``None``)."""
    if labels is None:
        return None
    if isinstance(labels, (tuple, list)):
        return type(labels)(_row(x, i) for x in labels)
    return labels[i:i + 1]


def unit_sum(scores, units=None) -> tuple[float, int]:
    """(Σ over units of the unit's mean row score, number of units): one unit moves the sum by at most 1. ``units``:
    the row indices of each unit (``None``: every row its own unit)."""
    if units is None:
        return float(scores.sum()), int(scores.numel())
    return float(sum(float(scores[rows].mean()) for rows in units)), len(units)


def score_noise(sigma: float, *, secure: bool = False, seed: int | None = None, key=()) -> float:
    """One N(0, σ²) draw for a DP score: the OS CSPRNG (``secure``, Opacus' secure-mode construction), else a fresh
    stream: OS entropy, or under ``seed`` (``--dp_seed``) the stream keyed by (seed, "selection", "score", *key)."""
    import torch

    if secure:
        return float(secure_gaussian_like(torch.zeros((), dtype=torch.float64), float(sigma)))
    gen = stream_generator(seed, "selection", "score", *key)
    return float(torch.randn((), generator=gen, dtype=torch.float64)) * float(sigma)


def dp_score(exact_sum: float, n: int, sigma: float, **noise) -> float:
    """The released score: (Σ s + N(0, σ²)) / n (n, the number of held-out units, public)."""
    return (float(exact_sum) + score_noise(sigma, **noise)) / int(n)


class Scoring:
    """The set the trials are scored on: the eval set, or ``score_dataset`` (cached once with the trainer's frozen
    prefix under ``--cache_frozen_features``); for a DP score, its units and their number n. Built from the trainer's
    pieces: ``raw_eval`` (:func:`raw_eval`), ``eval_set`` (its eval set as it reads it, cached; read when
    ``score_dataset`` is ``None``), ``prefix_cache`` (its ``PrefixCacheManager``, ``None`` without one) and
    ``unit_column`` (``--privacy_unit_column``)."""

    def __init__(self, score_dataset, private, *, raw_eval=None, eval_set=None, prefix_cache=None, unit_column=None):
        from hf_dp.run.data import unit_rows

        self.private = private
        self.raw = score_dataset if score_dataset is not None else raw_eval
        self.is_eval_set = score_dataset is None
        if score_dataset is None:
            self.dataset = eval_set
        elif prefix_cache is not None:
            with quiet_cache_log(private):
                self.dataset = prefix_cache.cache(score_dataset, "score")
        else:
            self.dataset = score_dataset
        self.units, self.n = None, None
        if private:
            self.units = unit_rows(self.raw, unit_column) if unit_column is not None else None
            self.n = len(self.units) if self.units is not None else len(self.raw)

    def dataset_for(self, prefix_cache):
        """The score set as a trial with frozen-prefix cache ``prefix_cache`` (``None``: none) reads it: the trainer's
        cache if the trial's frozen prefix is the trainer's, else cached anew with the trial's own prefix."""
        if prefix_cache is None:
            return self.dataset
        with quiet_cache_log(self.private):
            try:
                return prefix_cache.cache(self.dataset, "score")
            except ValueError as e:
                if "prefix cache" not in str(e):
                    raise
                return prefix_cache.cache(self.raw, "score")

    def views(self, eval_dataset, *more) -> tuple:
        """Every form of the held-out set a trial whose eval set is ``eval_dataset`` could evaluate — as given, as
        cached by the trainer, that eval set when the held-out set is the eval set (a trial with another frozen prefix
        caches it anew), and ``more`` — for :func:`refuse_evaluating_the_score_set`."""
        own = (eval_dataset,) if self.is_eval_set else ()
        return tuple({id(d): d for d in (self.raw, self.dataset, *own, *more) if d is not None}.values())


class _QuietCacheLog(logging.Filter):
    def filter(self, record) -> bool:
        return not str(record.msg).startswith("hf_dp prefix cache (")


@contextlib.contextmanager
def quiet_cache_log(active: bool = True):
    """Without the frozen-prefix cache's log line: its size is the cached set's total token count × hidden size × the
    dtype's bytes, an exact statistic of the held-out private data a DP score reads (the row count is public)."""
    if not active:
        yield
        return
    log, quiet = logging.getLogger("hf_dp.models.prefix_cache"), _QuietCacheLog()
    log.addFilter(quiet)
    try:
        yield
    finally:
        log.removeFilter(quiet)


def refuse_evaluating_the_score_set(score_sets, dataset) -> None:
    """After a ``score_data="private"`` selection: refuse to evaluate (or predict on) ``dataset`` if it is one of
    ``score_sets`` (``dp.selection.score_sets``), the held-out private set its trials were scored on — the same object, the same 🤗 Datasets fingerprint, or a ``Subset`` overlapping it (a copy
    of its rows is not detectable) — whose exact metrics would go into the logs, the card and ``privacy.json`` of the
    release, outside the selection's ε (only its noisy score is covered)."""
    from hf_dp.run.data import same_dataset, subset_base

    held = score_sets or ()
    if dataset is None or not held:
        return
    for ds in dataset.values() if isinstance(dataset, dict) else [dataset]:
        base, idx = subset_base(ds)
        for h in held:
            h_base, h_idx = subset_base(h)
            if same_dataset(ds, h) or (same_dataset(base, h_base)
                                       and (idx is None or h_idx is None or not set(idx).isdisjoint(h_idx))):
                raise ValueError(
                    "this is (or overlaps) the held-out private data the private selection scored its trials on "
                    "(score_data='private'), whose exact metrics the selection's epsilon does not cover (only its "
                    "noisy score); evaluate on another dataset, e.g. trainer.evaluate(eval_dataset=public_test_set)"
                )
