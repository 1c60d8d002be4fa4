"""The Poisson draw, carried with its rows: what lets DPTrainer check that every micro-batch it trains on is exactly
one draw of its sampler, once, in its step.

* :class:`DrawStamped`: the training loader's dataset; the rows read for a draw (a
  :class:`hf_dp.privacy.sampler.DrawnIndices`) each get :data:`ROW_DRAW_KEY` and come in a :class:`StampedRows`.
* :func:`draw_of`: the training collator's check that it was given exactly one draw's rows (their stamps taken out).
* :data:`DRAWN_KEY`: the tag the collator then puts in the batch, checked by :func:`hf_dp.run.step.check_drawn_by`.

Nothing here is private: a draw's numbers count micro-batches (public: the plan fixes them), never rows drawn.
"""

from __future__ import annotations

import torch

#: the batch key DPTrainer's training loader puts in every micro-batch it collates: ``(token, draw, logical, micro,
#: rows)``, the trainer's random ``dp.contract.loader_token``, the Poisson sampler's numbers of the micro-batch
#: (:class:`hf_dp.privacy.sampler.DrawnIndices`: its serial ``draw`` 1, 2, ..., its logical draw and its position in
#: it) and the collated batch's rows. The collator sets them only when the rows it was given are exactly one draw of the
#: sampler (each row's :data:`ROW_DRAW_KEY`), else draw 0. ``DPTrainer.training_step`` refuses a micro-batch without
#: this trainer's token, with draw 0, whose draw does not increase, whose rows differ from the tag's, or that is not the
#: next micro-batch of its step's logical draw: :func:`hf_dp.run.step.check_drawn_by`
DRAWN_KEY = "_hf_dp_drawn"
#: the feature key :class:`DrawStamped` adds to each row it reads for a Poisson draw: ``(draw, logical, micro, n,
#: position)`` — the draw's numbers, its number of rows and the row's place in it; the collator takes it out
ROW_DRAW_KEY = "_hf_dp_row_draw"


class StampedRows(list):
    """The rows :class:`DrawStamped` read for one draw, with the draw's ``stamp`` ``(draw, logical, micro, n)`` (an
    empty draw's only mark)."""

    def __init__(self, rows, stamp):
        super().__init__(rows)
        self.stamp = stamp


class DrawStamped(torch.utils.data.Dataset):
    """The training loader's dataset: ``dataset`` as it is, except that the rows read for a Poisson draw
    (``__getitems__`` of a :class:`hf_dp.privacy.sampler.DrawnIndices`) each get :data:`ROW_DRAW_KEY` and come in a
    :class:`StampedRows`, so that the training collator can check it was given exactly that draw's rows. Rows read one
    by one (``dataset[i]``: the independence probe, the contract's row check, the empty batch's placeholder) carry no
    stamp. A draw whose index list a batch-sampler wrapper changed in place is refused."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]

    def __getitems__(self, indices):
        from hf_dp.privacy.sampler import DrawnIndices

        get = getattr(self.dataset, "__getitems__", None)
        rows = get(list(indices)) if get is not None else [self.dataset[i] for i in indices]
        if not isinstance(indices, DrawnIndices):
            return rows
        if not indices.intact():
            raise ValueError(
                f"the index list of Poisson draw {indices.draw} was changed after the sampler drew it ({len(indices.drawn)} "
                f"indices, now {len(indices)}): the accountant assumes each example joins a step by its own draw at rate "
                "q; a batch-sampler wrapper must yield DPTrainer's sampler's lists unchanged")
        n = len(indices)
        stamp = (indices.draw, indices.logical, indices.micro, n)
        out = []
        for pos, row in enumerate(rows):
            if hasattr(row, "keys"):
                row = dict(row)
                row[ROW_DRAW_KEY] = stamp + (pos,)
            out.append(row)
        return StampedRows(out, stamp)

    def __getattr__(self, name):  # column_names, _fingerprint, ... of the wrapped dataset
        if name == "dataset":
            raise AttributeError(name)
        return getattr(self.dataset, name)


def draw_of(features):
    """``(features without their stamps, (draw, logical, micro))`` of the rows given to the training collator:
    ``None`` for rows that carry no stamp (read one by one, or drawn by a sampler of one's own); ValueError unless
    the rows are exactly one draw — every position 0..n−1 of one draw once (an empty draw: its list's stamp)."""
    stamp = getattr(features, "stamp", None)
    seen, plain = [], []
    for f in features:
        if hasattr(f, "keys") and ROW_DRAW_KEY in f:
            f = dict(f)
            seen.append(f.pop(ROW_DRAW_KEY))
        else:
            seen.append(None)
        plain.append(f)
    if stamp is None and all(s is None for s in seen):
        return plain, None
    n = len(plain)
    if any(s is not None for s in seen) or any(hasattr(f, "keys") for f in plain):  # dict rows: each its own stamp
        ok = all(s is not None for s in seen)
        draws = {tuple(s[:4]) for s in seen if s is not None} | ({tuple(stamp)} if stamp is not None else set())
        positions = sorted(int(s[4]) for s in seen if s is not None)
    else:  # rows that cannot carry a stamp: the list's
        ok, draws, positions = stamp is not None, {tuple(stamp)} if stamp is not None else set(), list(range(n))
    one = next(iter(draws)) if len(draws) == 1 else None
    ok = ok and one is not None and int(one[3]) == n and positions == list(range(n))
    if not ok:
        raise ValueError(
            f"DPTrainer's training collator was given {len(plain)} row(s) that are not exactly one Poisson draw of its "
            "sampler (rows repeated, added, dropped, or mixed from several draws): the accountant assumes each example "
            "joins a step once, by its own draw at rate q; a collate_fn wrapper must pass the features it is given, "
            "unchanged, to DPTrainer's collator")
    return plain, one[:3]
