"""One micro-batch of a DP step, between HF's ``training_step`` and the clipping engine (``DPTrainer.compute_loss``,
``DPTrainer.training_step``): **the loss-scaling contract**.

:func:`private_loss` returns Σ_i ℓ_i / (B / world size) and hooks Σ_i ℓ_i to measure the factor every later scaling
(the Trainer's gradient-accumulation division, Accelerate, mixed precision) applied before the backward pass;
:func:`after_micro_batch` hands the engine's clipped sum (ghost) or per-sample gradients (hooks) to the privatizer,
divided by exactly that factor, so each example's clipped vector is clip_C(∇ℓ_i) whatever the Trainer does to the loss.
What one micro-batch leaves between the two lives in ``dp.step`` (:class:`hf_dp.run.state.MicroBatch`).
"""

from __future__ import annotations

import contextlib

import torch

from hf_dp.clipping import sharding
from hf_dp.models.loss import per_example_loss, positions_from_mask
from hf_dp.models.precision import check_full_precision, check_output_precision
from hf_dp.run import contract
from hf_dp.run.data import EMPTY_KEY, PHASE_KEY, UNITS_KEY
from hf_dp.run.draws import DRAWN_KEY


def unit_kw(dp) -> dict:
    """``units=`` for the engine under ``--privacy_unit_column`` (rows -> 0..U-1); nothing when each row is a unit."""
    return {} if dp.step.units is None else {"units": dp.step.units}


_BUILD_ON = ("a get_train_dataloader override must build on super().get_train_dataloader() (wrap its batches, keep "
             "its sampler and collator)")


def check_drawn_by(dp, inputs) -> None:
    """Every micro-batch trained on under DP must come from this trainer's Poisson loader
    (:func:`hf_dp.run.data.poisson_loader`), as it collated it, once, and in its step: the collator tags it with
    :data:`~hf_dp.run.draws.DRAWN_KEY` ``(token, draw, logical, micro, rows)`` (popped here) only when the rows it was
    given were exactly one draw of the sampler. Refused: no tag of this trainer (a loader of one's own, batches made
    by hand; or a wrapper that dropped the tag), draw 0 (rows the sampler did not draw as one micro-batch: a sampler of
    one's own), a draw not above the last one trained on (a replay), a batch whose rows are not the tag's (rows added
    or removed after collation, micro-batches merged), and a micro-batch that is not the next of its step's logical
    draw (micro-batches skipped or mixed across steps): the accountant assumes each example (or unit) joins each step
    once, by its own draw at rate q. One sentence each."""
    tag = inputs.pop(DRAWN_KEY, None) if hasattr(inputs, "pop") else None
    ok = isinstance(tag, tuple) and len(tag) == 5 and tag[0] == dp.contract.loader_token
    if not ok:
        yielded = int(getattr(dp.sampler, "yielded", 0) or 0)
        drew, dp.contract.seen_yielded = yielded > dp.contract.seen_yielded, yielded
        if tag is None and drew:  # DPTrainer's loader is being iterated: a wrapper lost its non-tensor keys
            raise RuntimeError(
                f"a training micro-batch reached training_step without DPTrainer's key '{DRAWN_KEY}' (its tag of the "
                "Poisson draw) although DPTrainer's training loader is drawing: a wrapper of its batches dropped "
                "DPTrainer's non-tensor keys; a wrapper must keep every key of each batch")
        raise RuntimeError(
            "a training micro-batch did not come from DPTrainer's training loader (Poisson sampling): the accountant "
            "assumes each example (or unit) joins each step by its own draw at rate q, which a loader of one's own "
            f"does not do; {_BUILD_ON}, or train with --disable_dp")
    _, draw, logical, micro, rows = tag
    if not draw or draw <= 0:
        raise RuntimeError(
            "a training micro-batch was collated by DPTrainer's training collator but its rows were not one draw of its "
            "Poisson sampler (a sampler or batch sampler of one's own): the accountant assumes each example (or unit) "
            f"joins each step by its own draw at rate q; {_BUILD_ON}")
    if dp.contract.last_draw is not None and draw <= dp.contract.last_draw:
        raise RuntimeError(
            f"a training micro-batch was trained on before (draw {draw} of DPTrainer's Poisson sampler, after draw "
            f"{dp.contract.last_draw}): each draw may reach the model once; a get_train_dataloader override must pass "
            "super().get_train_dataloader()'s batches through once each")
    bad = next((k for k, v in inputs.items() if getattr(v, "shape", None) is not None and len(v.shape) > 0
                and int(v.shape[0]) != rows), None) if hasattr(inputs, "items") else None
    if bad is not None:
        raise RuntimeError(
            f"a training micro-batch reached training_step with {int(inputs[bad].shape[0])} rows in '{bad}' where "
            f"DPTrainer's collator made {rows} (rows added, removed or merged from other micro-batches after "
            "collation, by a loader wrapper or a training_step override): each drawn example must reach the step "
            "once and no other row; pass the collated batches on unchanged")
    m = int(getattr(dp.sampler, "micro_batches", 1) or 1)
    acc = dp.contract.accumulating
    expect = (acc[0], acc[1]) if acc is not None and acc[1] < m else None  # the step's logical draw is not complete
    if (expect is None and micro != 0) or (expect is not None and (logical, micro) != expect):
        want = (f"micro-batch {expect[1]} of logical draw {expect[0]} (the step has taken {expect[1]} of its {m})"
                if expect is not None else "micro-batch 0 of a new logical draw")
        raise RuntimeError(
            f"a training micro-batch is micro-batch {micro} of logical draw {logical} where the step being accumulated "
            f"needs {want}: each optimizer step must take the {m} micro-batch(es) of one Poisson draw, in order (none "
            "skipped, none from another step's draw); pass DPTrainer's loader's batches on unchanged, each once")
    dp.contract.last_draw = draw
    dp.contract.accumulating = (logical, micro + 1)


def check_drawn_for(dp, drawn_for) -> None:
    """Cyclic Poisson sampling (``--noise_bands`` > 1): the micro-batch must have been drawn for the step it is
    accumulated into (the ledger's own steps so far), i.e. from that step's partition. A loader that draws ahead of
    the steps (worker processes, a wrapper that fetches the next batch early) would put another partition's units into
    the step, and their participations would no longer be b steps apart: refused in one sentence."""
    if getattr(dp.sampler, "bands", 1) <= 1 or dp.contract.probe:  # the independence probe's rows are no step's
        return
    step = dp.ledger.own_steps if dp.ledger is not None else None
    if drawn_for is None or step is None or int(drawn_for) != int(step):
        raise RuntimeError(
            f"a micro-batch of step {step} was drawn for step {drawn_for} (a loader that draws batches ahead of the "
            "steps, e.g. worker processes or a wrapper that prefetches): cyclic Poisson sampling (--noise_bands > 1) "
            "needs every batch drawn at its own step; use hf_dp's training loader with dataloader_num_workers=0")


def private_loss(dp, model, inputs: dict, objective, config, world_size: int, audit_losses=None):
    """``DPTrainer.compute_loss`` under DP, in training: ``(loss, outputs)`` with loss = Σ_i ℓ_i / (B / world size).
    ``audit_losses(losses, empty)``: ``--audit_canaries``' canary rows' losses (the trainer's hook), else none."""
    empty = bool(inputs.pop(EMPTY_KEY, False))
    units = inputs.pop(UNITS_KEY, None)
    inputs.pop(DRAWN_KEY, None)  # checked by DPTrainer.training_step before the micro-batch was split (check_drawn_by)
    check_drawn_for(dp, inputs.pop(PHASE_KEY, None))
    if "labels" not in inputs:
        raise ValueError(
            "the training batch has no 'labels': DP training computes each example's loss from them (a causal LM's "
            "collator makes them: DataCollatorForLanguageModeling(tokenizer, mlm=False))"
        )
    labels = inputs.pop("labels")
    if objective.positions_from_mask and "position_ids" not in inputs and torch.is_tensor(inputs.get("attention_mask")):
        # each row's positions count its own tokens: a left-padded row's must not depend on the batch's padding
        inputs["position_ids"] = positions_from_mask(inputs["attention_mask"])
    # Under DDP the forward runs in no_sync for every micro-batch, the last one included: DDP's reducer then
    # expects no gradient (ghost clipping leaves none for linear weights) and all-reduces nothing — it would
    # only average the raw, unclipped gradients, which no DP engine uses. Each rank clips its own examples; the
    # privatizer adds the noise on rank 0 and all-reduces the noisy sum once per logical batch.
    sync = model.no_sync() if isinstance(model, torch.nn.parallel.DistributedDataParallel) else contextlib.nullcontext()
    check_full_precision(model, "the model")  # every micro-batch: also after a callback cast it since train() began
    with sync:
        outputs = model(**inputs)
    check_output_precision(outputs.logits)  # and no autocast the weights do not show
    contract.check_logits(outputs.logits, labels, objective)
    losses = per_example_loss(outputs.logits, labels, config, objective, inputs.get("attention_mask"),
                              token_norm=dp.loss_token_norm)
    if audit_losses is not None:  # a gradient canary's loss is 0 (its gradient: the engine's wrapper)
        losses = audit_losses(losses, empty)
    dp.step.empty = empty
    dp.step.units = None if units is None else units.to(losses.device)
    fsdp = dp.fsdp and sharding.is_fsdp_model(model)
    if fsdp:  # every micro-batch's pass 2 reduce-scattered, summed over ranks (hf_dp.clipping.sharding)
        sharding.prepare_micro_batch(model)
    # ghost_two_pass: its pass 1 (the norms) runs here; under FSDP on every rank for every micro-batch, the empty
    # one's placeholder included (its loss is then multiplied by 0), so that the ranks' all-gathers stay in step
    if (not empty or fsdp) and not dp.contract.probe:
        losses = dp.engine.before_backward(losses, dp.optimizer, **unit_kw(dp))
    total = losses.sum() * 0.0 if empty else losses.sum()
    if total.requires_grad:
        step = dp.step

        def capture(grad: torch.Tensor) -> None:  # the factor HF applied to the loss before backward
            step.loss_scale = float(grad.detach().float().reshape(-1)[0])
        total.register_hook(capture)
    dp.step.rows = labels.shape[0]
    return total / (dp.spec.expected_batch_size / max(1, world_size)), outputs


def after_micro_batch(dp, model) -> None:
    """After HF's backward of one micro-batch: the clipped sum (ghost) or the per-sample gradients (hooks) to the
    privatizer, undoing the measured loss scale; an empty micro-batch's placeholder row adds nothing."""
    if dp.step.loss_scale is None:
        raise RuntimeError("internal error: the loss-scale hook did not fire during backward")
    if dp.fsdp:  # the ranks' gradients were summed before each undoes its own scale
        if not sharding.is_fsdp_model(model):
            raise RuntimeError("--fsdp was given but Accelerate did not shard the model (fully_shard); refusing "
                               "to train it as another parallel mode")
        sharding.check_loss_scale_agrees(dp.step.loss_scale)
    if dp.step.empty and not dp.fsdp:  # (FSDP: the placeholder's 0 is in the sum)
        # an empty micro-batch's placeholder row adds nothing, not even a rule's per-sample offset (λθ, −m̂/b: else
        # up to 2C between neighbours when the one extra example is alone in its micro-batch)
        dp.engine.discard(dp.optimizer)
    else:
        dp.engine.after_backward(dp.optimizer, dp.step.loss_scale, dp.step.rows, **unit_kw(dp))
    dp.step.loss_scale, dp.step.units = None, None
