"""The canary rows of ``--audit_canaries`` as the training loader and ``compute_loss`` see them
(:mod:`hf_dp.audit.canaries` re-exports these hooks; DPTrainer calls them there with the audit state,
``trainer.dp.audit``, or the run's privacy state ``trainer.dp``, and the pieces they use).

The loader tags every training row with :data:`CANARY_KEY` (:func:`loader_parts`): under ``--audit_kind gradient`` a
row's canary id (-1 for a real row; the tags are the secret draw: never pickled), under ``--audit_kind input`` its place
among the appended canary rows (the training set holds them anyway). ``compute_loss`` takes the tags out
(:func:`pop_rows`), gives a gradient canary's row a model loss of exactly 0 (:func:`zero_canary_losses`: its gradient is
the auditor's, added by the engine's wrapper) and hands an input canary's loss to ``training_step``, which leaves it out
of the loss it reports (:func:`input_canary_loss`): the logged training loss is the real rows' only.
"""

from __future__ import annotations

import numpy as np

from hf_dp.run.data import TaggedRows

#: the batch key of each training row's canary tag (-1: a real row)
CANARY_KEY = "_hf_dp_canary"


def _gradient_state(state):
    """The audit state ``state`` (``dp.audit``) under ``--audit_kind gradient``, else ``None``."""
    return state if state is not None and state.kind == "gradient" else None


class _CanaryTagged(TaggedRows):
    """The training set as the loader reads it under ``--audit_kind gradient``: each row (a dict) gets
    :data:`CANARY_KEY`, its canary id (-1 for a real row). Not picklable (the ids of the rows are the draw)."""

    KEY, FLAG, _OWN = CANARY_KEY, "--audit_kind gradient", ("dataset", "real_rows", "row_canary")

    def __init__(self, dataset, real_rows: int, row_canary: np.ndarray):
        self.dataset, self.real_rows, self.row_canary = dataset, int(real_rows), row_canary

    def tag(self, i: int) -> int:
        return int(self.row_canary[i - self.real_rows]) if i >= self.real_rows else -1

    def __reduce__(self):
        raise TypeError("the canary-tagged training set cannot be pickled: its tags are the inclusion draw "
                        "(--audit_kind gradient needs --dataloader_num_workers 0 or fork-started workers)")


class _InputCanaryTagged(TaggedRows):
    """The training set as the loader reads it under ``--audit_kind input``: each row (a dict) gets :data:`CANARY_KEY`,
    -1 for a real row and its place among the appended canary rows otherwise, so that ``compute_loss`` can leave the
    canaries out of the logged training loss (:func:`input_canary_loss`). It holds nothing the training set it wraps
    does not (the included canaries are its last rows), so it pickles as that set does."""

    KEY, FLAG, _OWN = CANARY_KEY, "--audit_canaries", ("dataset", "real_rows")

    def __init__(self, dataset, real_rows: int):
        self.dataset, self.real_rows = dataset, int(real_rows)

    def tag(self, i: int) -> int:
        return i - self.real_rows if i >= self.real_rows else -1


def _batch_rows(batch) -> int | None:
    import torch

    return next((v.shape[0] for v in batch.values() if torch.is_tensor(v) and v.dim() >= 1), None) if hasattr(
        batch, "values") else None


class _CanaryCollator:
    """Takes :data:`CANARY_KEY` out of the rows before the user's collator (``collate_fn``) sees them and puts the
    rows' ids back as a batch key; one row per example (a collator that emits several is refused), or with
    ``several_rows=True`` (``--audit_kind input``: the ids only mark which rows' losses are not logged) each example's
    id repeated over the rows the collator makes of it alone (the trainer's own check then holds it to that)."""

    def __init__(self, collate_fn, several_rows: bool = False):
        self.collate_fn = collate_fn
        self.several_rows = bool(several_rows)
        self.data_collator = getattr(collate_fn, "data_collator", collate_fn)  # what hf_dp.run.contract inspects

    def __call__(self, features):
        import torch

        ids = [int(f.get(CANARY_KEY, -1)) if hasattr(f, "get") else -1 for f in features]
        plain = [{k: v for k, v in f.items() if k != CANARY_KEY} if hasattr(f, "items") else f for f in features]
        batch = self.collate_fn(plain)
        if hasattr(batch, "keys"):
            rows = _batch_rows(batch)
            rows = len(plain) if rows is None else rows
            tags = torch.tensor(ids, dtype=torch.long)
            if rows != len(plain) and self.several_rows:
                counts = [_batch_rows(self.collate_fn([f])) for f in plain]
                if all(c is not None for c in counts) and sum(counts) == rows:
                    tags = torch.repeat_interleave(tags, torch.tensor(counts))
            if rows != tags.shape[0]:
                if not self.several_rows:
                    raise ValueError("--audit_kind gradient needs a data collator that makes one row per example; this "
                                     f"one made {rows} rows of {len(plain)} examples")
                tags = torch.full((rows,), -1, dtype=torch.long)  # the trainer's row check refuses such a collator
            batch[CANARY_KEY] = tags
        return batch


def loader_parts(dp, dataset, collate_fn):
    """DPTrainer's ``get_train_dataloader`` (the hook ``audit_parts`` of :func:`hf_dp.run.data.poisson_loader`; ``dp``
    the run's privacy state): (dataset, collator) with the canary tags under ``--audit_canaries`` (unchanged
    otherwise): each row's canary id under ``--audit_kind gradient``, its place among the canary rows under
    ``--audit_kind input`` (only to leave their losses out of the logged training loss)."""
    state = dp.audit
    if state is None:
        return dataset, collate_fn
    if state.kind != "gradient":
        return _InputCanaryTagged(dataset, state.real_rows), _CanaryCollator(collate_fn, several_rows=True)
    if state.row_canary is None:
        raise ValueError("--audit_canaries audits one train() call: the inclusion draw was dropped after the first "
                         "audit; make a new DPTrainer")
    return _CanaryTagged(dataset, state.real_rows, state.row_canary), _CanaryCollator(collate_fn)


def pop_rows(state, inputs):
    """DPTrainer's ``compute_loss``: the micro-batch's canary tags (a tensor, -1 for real rows), taken out of
    ``inputs``; ``None`` without canaries (``state``: the audit state ``dp.audit``, ``None`` without the flag)."""
    rows = inputs.pop(CANARY_KEY, None) if hasattr(inputs, "pop") else None
    return rows if state is not None else None


def input_canary_loss(state, losses, rows, empty: bool):
    """``--audit_kind input``: the summed model loss of the micro-batch's canary rows (detached), which
    ``DPTrainer.training_step`` takes out of the loss it reports — the logged training loss is the real rows' (the
    canaries are trained on as any row; gradient canaries' model loss is 0 already). ``None`` otherwise (``state``:
    the audit state ``dp.audit``)."""
    if state is None or state.kind == "gradient" or rows is None or empty:
        return None
    rows = rows.to(losses.device).view(-1)
    if rows.shape[0] != losses.shape[0]:
        raise ValueError(f"internal: {rows.shape[0]} canary tags for {losses.shape[0]} per-example losses")
    canary = rows >= 0
    return losses.detach()[canary].sum() if bool(canary.any()) else None


def logged_loss(dp, loss, world_size: int):
    """``DPTrainer.training_step``: the loss a micro-batch reports (HF sums it into the logged training loss) without
    its input canary rows' share (:func:`input_canary_loss`, kept by ``compute_loss`` as ``dp.step.canary_loss``;
    ``dp`` the run's privacy state, ``world_size`` the number of processes)."""
    excluded, dp.step.canary_loss = dp.step.canary_loss, None
    if excluded is None:
        return loss
    divisor = dp.spec.expected_batch_size / max(1, world_size)  # compute_loss's own
    return loss - (excluded / divisor).to(loss.device, loss.dtype)


def zero_canary_losses(state, losses, rows, empty: bool, probe: bool = False):
    """A canary row's model loss is exactly 0 (its gradient through the model too); the micro-batch's canary ids are
    kept for the engine's ``after_backward`` (not for an empty micro-batch's placeholder or the contract's
    independence probe, ``probe``). ``state``: the audit state ``dp.audit``."""
    import torch

    state = _gradient_state(state)
    if state is None or rows is None:
        return losses
    rows = rows.to(losses.device).view(-1)
    if rows.shape[0] != losses.shape[0]:
        raise ValueError(f"internal: {rows.shape[0]} canary tags for {losses.shape[0]} per-example losses")
    canary = rows >= 0
    if not empty and not probe:
        state.pending = [int(k) for k in rows[canary].tolist()]
    return torch.where(canary, torch.zeros_like(losses), losses)
