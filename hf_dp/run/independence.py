"""Each example's loss depends on that example alone: the probe DPTrainer runs at every ``train()``, before any step.

On a probe micro-batch of training rows (the training loader's dataset and collator), replacing one example, removing
one, and lengthening one must leave every other example's model output and loss gradient unchanged
(:func:`probe_independence`, given the trainer's ``compute_loss`` and ``_prepare_inputs`` as callables). Catches a
``compute_loss`` override with a batch-level term or a denominator counted over the batch (rows, tokens,
``num_items_in_batch``), a collator that mixes examples, and a model whose forward mixes the batch or lets a row see
the batch's padding. The other checks of the per-example contract are :mod:`hf_dp.run.contract`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from hf_dp.models.loss import IGNORE_INDEX


class _OutputTap:
    """Runs the model's forward without autograd and hands its logits to the loss as fresh leaves, so the probe
    differentiates the loss (and only the loss) with respect to each row's logits — no engine hook fires."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.leaves: list[torch.Tensor] = []
        self._grad_modes: list[bool] = []
        self._handles = []

    def __enter__(self):
        self._handles = [
            self.model.register_forward_pre_hook(self._pre, with_kwargs=True),
            self.model.register_forward_hook(self._post, with_kwargs=True),
        ]
        self._outer = torch.is_grad_enabled()
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        torch.set_grad_enabled(self._outer)
        return False

    def _pre(self, module, args, kwargs):
        self._grad_modes.append(torch.is_grad_enabled())
        torch.set_grad_enabled(False)

    def _post(self, module, args, kwargs, out):
        torch.set_grad_enabled(self._grad_modes.pop() if self._grad_modes else self._outer)
        logits = out.get("logits") if hasattr(out, "get") else None
        if torch.is_tensor(logits) and logits.is_floating_point():
            leaf = logits.detach().requires_grad_(True)
            out["logits"] = leaf
            self.leaves.append(leaf)
        return out


@contextlib.contextmanager
def _no_dropout(model: nn.Module):
    """Dropout off (p = 0 on dropout modules and on float ``attention_dropout`` attributes) while the model stays in
    training mode, so that two probe forwards compute the same function of each row."""
    saved = []
    for m in model.modules():
        if isinstance(m, nn.modules.dropout._DropoutNd):
            saved.append((m, "p", m.p))
            m.p = 0.0
        v = m.__dict__.get("attention_dropout")
        if isinstance(v, float):
            saved.append((m, "attention_dropout", v))
            m.attention_dropout = 0.0
    try:
        yield
    finally:
        for m, name, v in saved:
            setattr(m, name, v)


def _row_length(batch, i: int) -> int:
    for key in ("attention_mask", "labels"):
        v = batch.get(key) if hasattr(batch, "get") else None
        if torch.is_tensor(v) and v.dim() >= 2:
            if v.shape[0] <= i:  # a collator that makes no row for this example
                return 0
            return int((v[i] != (IGNORE_INDEX if key == "labels" else 0)).sum())
    ids = batch.get("input_ids") if hasattr(batch, "get") else None
    return int(ids.shape[1]) if torch.is_tensor(ids) and ids.dim() >= 2 else 0


def _lengthened(collate, base_rows: list, longest: int):
    """The probe batch with its last row replaced by its first row with every per-token field repeated twice (longer
    than every probe row), or ``None`` if the collator cannot take such a row."""
    first = base_rows[0]
    ids = first.get("input_ids") if hasattr(first, "get") else None
    if not isinstance(ids, (list, tuple)) or not ids:
        return None
    n = len(ids)
    row = {key: (list(v) + list(v) if isinstance(v, (list, tuple)) and len(v) == n else v) for key, v in first.items()}
    try:
        if _row_length(collate([row]), 0) <= longest:
            return None
        return collate(base_rows[:-1] + [row])
    except Exception:  # noqa: BLE001 - a collator that cannot take it (fixed-length fields): no lengthened variant
        return None


def _shapes(batch) -> dict:
    return {k: tuple(v.shape) for k, v in batch.items() if torch.is_tensor(v)}


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal up to float rounding; non-finite entries must be the same non-finite value in both (a NaN label made by
    a collator gives the same NaN gradient in every variant, which is not a coupling)."""
    a, b = a.double(), b.double()
    finite_a, finite_b = torch.isfinite(a), torch.isfinite(b)
    if not torch.equal(finite_a, finite_b):
        return False
    same_special = torch.where(finite_a, True, (a == b) | (a.isnan() & b.isnan()))
    if not bool(same_special.all()):
        return False
    if not bool(finite_a.any()):
        return True
    a, b = a[finite_a], b[finite_a]
    scale = max(float(a.abs().max()), float(b.abs().max()), 1e-30)
    return bool(((a - b).abs() <= 1e-5 * scale).all())


def probe_independence(dataset, collate, model, dp, *, compute_loss, prepare_inputs, probe_rows: int = 4,
                       candidates: int = 12) -> str:
    """Check on training rows that each example's output and loss gradient depend on that example alone.

    Builds a probe micro-batch of ``probe_rows`` rows through the training loader's ``dataset`` and ``collate``
    function, then the same batch with its last row replaced by another row (of another length where one exists) and
    with its last row removed; runs ``compute_loss(model, prepare_inputs(batch), num_items_in_batch=…)`` (the
    trainer's) on each (model in training mode, dropout off, the forward without autograd, ``dp.contract.probe`` set:
    no engine records) and compares, for every other row, the model's logits and the gradient of the returned loss
    with respect to them; ``dp`` (the run's :class:`~hf_dp.run.state.PrivacyState`) keeps no step state and its
    engine no records afterwards. Raises ``ValueError`` when they differ; returns ``"passed"`` or why it could not run
    (``"skipped: ..."``)."""
    n = len(dataset)
    if n < 3:
        return "skipped: fewer than 3 training rows"
    take = min(n, probe_rows + candidates)
    rows = [dataset[i] for i in range(take)]
    k = min(probe_rows, take - 1)
    # the probe batch, longest rows first, so that the row replaced / removed (the last) never sets the padding
    lengths = [_row_length(collate([r]), 0) for r in rows]
    order = sorted(range(k), key=lambda i: -lengths[i])
    base_rows = [rows[i] for i in order]
    base = collate(base_rows)
    shapes = _shapes(base)
    j_len = lengths[order[-1]]
    replacement = None
    for c in sorted(range(k, take), key=lambda c: lengths[c] == j_len):  # another length first
        b = collate(base_rows[:-1] + [rows[c]])
        if _shapes(b) == shapes and lengths[c] <= lengths[order[0]]:
            replacement = b
            break
    removed = collate(base_rows[:-1])
    # a replacement longer than every probe row changes the padded length: a model whose rows see the padding (no
    # attention mask, left padding with absolute positions) then changes the other rows' outputs
    longer = [c for c in range(k, take) if lengths[c] > lengths[order[0]]]
    padded = collate(base_rows[:-1] + [rows[max(longer, key=lambda c: lengths[c])]]) if longer else None
    made = padded is None
    if made:  # no longer row among the candidates: make one (a probe row's tokens twice)
        padded = _lengthened(collate, base_rows, lengths[order[0]])
    was_training = model.training
    model.train()
    dp.contract.probe = True
    results = []
    try:
        with _no_dropout(model):
            for batch in [base, replacement, removed, padded]:
                if batch is None:
                    results.append(None)
                    continue
                inputs = prepare_inputs(dict(batch))
                labels = inputs.get("labels")
                items = None
                if torch.is_tensor(labels):
                    items = (labels != IGNORE_INDEX).sum() if labels.dim() > 1 else torch.tensor(labels.shape[0])
                with _OutputTap(model) as tap, torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    if made and batch is padded:
                        try:  # the made row may be longer than the model takes (its position table)
                            loss = compute_loss(model, inputs, num_items_in_batch=items)
                        except (IndexError, RuntimeError, ValueError):
                            results.append(None)
                            continue
                    else:
                        loss = compute_loss(model, inputs, num_items_in_batch=items)
                    if isinstance(loss, tuple):
                        loss = loss[0]
                    if not tap.leaves or not torch.is_tensor(loss) or not loss.requires_grad:
                        return "skipped: the loss is not a differentiable function of the model's logits"
                    grads = torch.autograd.grad(loss, tap.leaves, allow_unused=True)
                results.append([(leaf.detach(), torch.zeros_like(leaf) if g is None else g.detach())
                                for leaf, g in zip(tap.leaves, grads)])
    finally:
        dp.contract.probe = False
        dp.step.loss_scale = None
        dp.step.empty = False
        engine = dp.engine
        if engine is not None:
            engine.clear()  # the probe's forwards ran without autograd: nothing recorded, cleared all the same
        model.train(was_training)
    ref = results[0]
    keep = k - 1  # rows 0..k-2 are the same examples in every variant
    for name, other in (("replacing", results[1]), ("removing", results[2]), ("lengthening", results[3])):
        if other is None:
            continue
        if len(other) != len(ref):
            raise _coupled(name, "the number of model calls")
        for (la, ga), (lb, gb) in zip(ref, other):
            if la.shape[0] < keep or lb.shape[0] < keep:
                continue
            outputs_ok, grads_ok = False, False
            for a_la, a_lb, a_ga, a_gb in _aligned(la[:keep], lb[:keep], ga[:keep], gb[:keep]):
                o, g = _close(a_la, a_lb), _close(a_ga, a_gb)
                outputs_ok, grads_ok = outputs_ok or o, grads_ok or (o and g)
            if not outputs_ok:
                raise _coupled(name, "outputs")
            if not grads_ok:
                raise _coupled(name, "loss gradients")
    return "passed"


def _aligned(la, lb, ga, gb):
    """The ways to compare per-token outputs of the same rows padded to two lengths: the same positions when the
    lengths agree; else the first positions of both (right padding) or the last (left padding). Per-example outputs
    ([rows, classes]) have one way."""
    if la.shape == lb.shape or la.dim() < 3 or la.shape[2:] != lb.shape[2:]:
        return [(la, lb, ga, gb)]
    t = min(la.shape[1], lb.shape[1])
    return [(la[:, :t], lb[:, :t], ga[:, :t], gb[:, :t]), (la[:, -t:], lb[:, -t:], ga[:, -t:], gb[:, -t:])]


def _coupled(how: str, what: str) -> ValueError:
    if what == "outputs":
        cause = ("the model's forward or the data collator mixes the examples of a batch (e.g. mixup, BatchNorm, or a "
                 "row that sees the batch's padding: no attention mask, or left padding with absolute positions)")
    else:
        cause = ("the loss handed to backward is not a sum of per-example terms (e.g. a compute_loss override that "
                 "adds a batch-level term, or divides by the batch's row or token count or num_items_in_batch)")
    return ValueError(
        f"the per-example contract does not hold: {how} one example of a probe micro-batch changed the other "
        f"examples' {what}, so {cause}; one example could then move the update by more than the clip norm C and the "
        "reported epsilon would be false — make each example's loss a function of that example alone"
    )
