"""The private transformers API ``DPTrainer`` depends on: the one list to re-check on a transformers upgrade.

Checked against transformers 5.23.0 and 5.24.0 (5.24 changed neither method; :func:`hf_dp.run.setup.check_transformers_version`
admits >=5.0,<6). Everything else DPTrainer overrides is public — ``__init__``, ``get_train_dataloader``,
``create_optimizer``, ``compute_loss``, ``training_step``, ``log``, ``train``, ``evaluate``, ``predict``,
``save_model``, ``create_model_card``, ``create_accelerator_and_postprocess`` (``--fsdp`` on CPU:
:mod:`hf_dp.clipping.sharding`), ``num_examples``, ``hyperparameter_search`` (under DP: :mod:`hf_dp.tuning.search`) —
and the budget stop is a ``TrainerCallback`` (:class:`hf_dp.run.spent.BudgetGuard`). ``hf_dp.trainer`` re-exports
these names.
"""

from __future__ import annotations

import contextlib

HF_PRIVATE_API_CHECKED_WITH = ("5.23.0", "5.24.0")
HF_PRIVATE_OVERRIDES = {
    # method: why no public hook serves
    "_save_checkpoint": "the completion marker must be written after HF's files and before old checkpoints are "
    "rotated; HF rotates inside _save_checkpoint, and on_save (the first public hook) runs after the rotation",
    "_save_optimizer_and_scheduler": "under DP with FSDP the privatizer's state (the sharded rule state and the ledger) "
    "is written with torch.distributed.checkpoint (hf_dp.clipping.sharding.save_checkpoint_state): Accelerate's "
    "save_fsdp_optimizer, which HF calls there, reads torch's optimizer state format only; elsewhere HF's own",
    "_load_optimizer_and_scheduler": "the ledger that optimizer.pt just restored must be checked (marker, data "
    "fingerprint, budget) and topped up with steps taken past the checkpoint before training resumes, and the "
    "frozen-prefix caches checked against the weights HF has just loaded; "
    "on_train_begin runs later and gets neither the checkpoint nor the ledger as it was before the load; under DP "
    "with FSDP the privatizer's sharded state is loaded there (hf_dp.clipping.sharding.load_checkpoint_state: Accelerate's "
    "load_fsdp_optimizer would step the empty optimizer on zero gradients first)",
    "_get_train_sampler": "under DP the Poisson sampler replaces HF's, so HF's is not built (its group_by_length "
    "sampler would read every row's input_ids, which a prefix cache does not have); without DP a prefix cache's own "
    "lengths go to HF's LengthGroupedSampler",
    "_get_eval_sampler": "under DP, group_by_length orders the training draws only: evaluation and predict() keep "
    "the dataset's order (HF's grouped eval sampler would permute predict()'s rows); without DP a prefix cache, which "
    "has no input_ids, gets HF's LengthGroupedSampler with the cache's own lengths",
}
HF_PRIVATE_CALLS = (
    "_set_signature_columns_if_needed / _signature_columns: keep the cached-states column through HF's column removal",
    "_get_output_dir(trial): the checkpoint folder _save_checkpoint writes",
)


@contextlib.contextmanager
def library_bars_off():
    """transformers' own progress bars ("Writing model shards" at every checkpoint save, "Loading weights" when a
    checkpoint is loaded) are off while the training bar is on screen, so they do not interleave with it; the
    previous setting is restored afterwards (``transformers.utils.logging.enable/disable_progress_bar``)."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


@contextlib.contextmanager
def no_cpu_pin_memory_warning():
    """HF's evaluation loader pins memory by default (``dataloader_pin_memory=True``); on a machine without an
    accelerator torch then warns at every evaluation that nothing is pinned — a no-op the user cannot act on. That one
    warning is filtered in ``DPTrainer.evaluate`` / ``predict`` (the training loader pins only where there is an
    accelerator: :mod:`hf_dp.run.data`)."""
    import warnings

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="'pin_memory' argument is set as true but no accelerator is found",
                                category=UserWarning)
        yield
