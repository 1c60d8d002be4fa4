"""``DPTrainer``'s checkpoint overrides (private transformers API: :data:`hf_dp.run.hf_api.HF_PRIVATE_OVERRIDES` says
why each is needed): the completion marker around HF's save, the privatizer's sharded state under FSDP2, and at a
resume the ledger checked and topped up with the steps taken past the checkpoint.

:class:`CheckpointOverrides` is a mixin of :class:`hf_dp.trainer.DPTrainer` (one of its own modules): each method does
HF's part through ``super()`` and the DP part through :mod:`hf_dp.run.checkpointing`, :mod:`hf_dp.run.spent`,
:mod:`hf_dp.run.lineage` and :mod:`hf_dp.clipping.sharding`, reading the run's state ``self.dp``; it sets no attribute
of the trainer.
"""

from __future__ import annotations

from hf_dp.clipping import sharding
from hf_dp.run import checkpointing, lineage, spent


class CheckpointOverrides:
    """``_load_optimizer_and_scheduler``, ``_save_checkpoint``, ``_save_optimizer_and_scheduler`` of
    :class:`hf_dp.trainer.DPTrainer`."""

    def _load_optimizer_and_scheduler(self, checkpoint):  # private HF API: see HF_PRIVATE_OVERRIDES
        # steps taken by an earlier train() of this trainer (not those of earlier runs its ledger started from)
        taken_here = (self.dp.ledger.steps if self.dp.lineage.resumed_ledger_steps is not None else self.dp.ledger.own_steps) if self.args.dp_enabled else 0
        if checkpoint is not None and self._prefix_cache:
            evals = self.eval_dataset.values() if isinstance(self.eval_dataset, dict) else [self.eval_dataset]
            self.prefix_cache.check_after_resume([("train", self.train_dataset)] + [("eval", v) for v in evals], checkpoint)
        if checkpoint is not None and self.args.dp_enabled and self.dp.fsdp:
            sharding.load_checkpoint_state(self.dp.optimizer, self.lr_scheduler, checkpoint)  # sharded state, ledger, scheduler
        else:
            super()._load_optimizer_and_scheduler(checkpoint)
        if self.args.dp_enabled:
            lineage.after_optimizer_load(self.dp, checkpoint)
        if checkpoint is not None and self.args.dp_enabled:
            spent.reconcile_resumed_ledger(self.dp, self.args, checkpoint, taken_here, self.state.global_step,
                                           self._train_data_info, self.get_epsilon)

    def _save_checkpoint(self, model, trial):  # private HF API: see HF_PRIVATE_OVERRIDES
        # the completion marker before HF's rotation of old checkpoints (hf_dp.run.checkpointing.save_around)
        with checkpointing.save_around(self._get_output_dir(trial=trial), self.dp, self.args, self.state, self.accelerator,
                                       self._record_spent, self._train_data_info, self.get_epsilon, self.is_fsdp_enabled):
            super()._save_checkpoint(model, trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:  # private HF API: see HF_PRIVATE_OVERRIDES
        if self.args.dp_enabled and self.dp.fsdp:
            sharding.save_checkpoint_state(self.accelerator, self.model, self.dp.optimizer, self.lr_scheduler,
                                           self.args.should_save, output_dir)  # the model's and the privatizer's shards
        else:
            super()._save_optimizer_and_scheduler(output_dir)

