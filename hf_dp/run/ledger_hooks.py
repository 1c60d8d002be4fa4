"""``DPTrainer``'s ledger overrides: ε as the model's ledger counts it, the record of steps spent, and what every log
line adds or drops (``get_epsilon``, ``_record_spent``, ``floating_point_ops``, ``log``).

:class:`LedgerOverrides` is a mixin of :class:`hf_dp.trainer.DPTrainer` (one of its own modules): each method does HF's
part through ``super()`` and the DP part through :mod:`hf_dp.run.lineage`, reading the run's state ``self.dp``
(:class:`hf_dp.run.state.PrivacyState`); it sets no attribute of the trainer.
"""

from __future__ import annotations

import math

from hf_dp.run import lineage


class LedgerOverrides:
    """``get_epsilon``, ``_record_spent``, ``floating_point_ops``, ``log`` of :class:`hf_dp.trainer.DPTrainer`."""

    def get_epsilon(self) -> float:
        """ε spent so far at δ (0 before training; ``inf`` for a non-private run, as built: ``dp.enabled``)."""
        if not self.dp.enabled:
            return math.inf
        selection = self.dp.selection.record
        if selection is not None:  # the model a private selection released: the selection's total (hf_dp.tuning.search)
            return float(selection["total_epsilon"])
        return lineage.take_later_runs(self.dp, self.args, self.model).get_epsilon()  # every step of the model

    def _record_spent(self, compute_epsilon: bool = True) -> None:
        """Write the record of steps taken (the count is what resumes rely on; ε is informative, and with
        ``compute_epsilon=False`` written only when the ledger already has it), the run's records in the checkpoints
        it resumed from, and the model's public ledger record (:func:`hf_dp.run.lineage.record_spent`)."""
        if self.dp.enabled:
            lineage.record_spent(self.dp, self.args, self.model, self._train_fingerprint, compute_epsilon)
        else:  # a DP-trained model trained further without DP: its config says so
            lineage.mark_non_private(self.model, self.state.global_step)

    def floating_point_ops(self, inputs) -> int:
        """0 under DP: HF adds 6·params·(tokens of every private Poisson batch, padding included) into
        ``state.total_flos``, logged as ``total_flos`` and saved in ``trainer_state.json`` — a statistic of the
        batch sizes and lengths outside the mechanism, like ``include_num_input_tokens_seen``."""
        return 0 if self.args.dp_enabled else super().floating_point_ops(inputs)

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if self.args.dp_enabled:
            logs.pop("grad_norm", None)  # norm of the non-private gradient: never logged
            self._record_spent()  # persisted before it is reported (see hf_dp.run.spent)
            logs["epsilon"] = self.get_epsilon()
            rule = getattr(self.dp.optimizer, "rule", None)
            if getattr(rule, "last_clamp_rate", None) is not None:
                logs["bc_clamp_rate"] = rule.last_clamp_rate
        super().log(logs, start_time)

