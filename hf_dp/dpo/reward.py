"""``DPRewardTrainer``: DP reward modelling through TRL's ``RewardTrainer``, one preference pair = one example.

``class DPRewardTrainer(DPTrainer, RewardTrainer)``: TRL prepares the pairs as ``RewardTrainer`` does (the prompt
joined to each answer, chat template for conversational pairs, EOS, ``chosen_ids`` / ``rejected_ids``, the pairs with
an answer longer than ``max_length`` dropped); the model is a sequence classifier with one output, the reward. Under DP
each drawn pair becomes two consecutive rows (:class:`hf_dp.dpo.pairs.RewardPairCollator`), clipped together, and the
pair's loss is −log σ(r_chosen − r_rejected − margin) (:func:`hf_dp.dpo.pairs.reward_pair_losses`), its own term: TRL's
batch mean is kept for evaluation (``eval_accuracy``: the share of held-out pairs whose chosen answer gets the higher
reward, ``eval_margin``) and for ``--disable_dp``. ``--privacy_unit_column``: every pair of one user is one unit.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math

from trl import RewardTrainer

from hf_dp.dpo.checks import check_pair_lengths, reward_row_length
from hf_dp.dpo.config import DPRewardConfig, enforce_reward
from hf_dp.dpo.pairs import RewardPairCollator, reward_pair_losses, row_losses, trl_layout
from hf_dp.dpo.trainer import refuse_under_dp, unit_text, with_lengths
from hf_dp.flags import length_warning_handled, quiet_length_warning
from hf_dp.hub import write_privacy_artifacts
from hf_dp.hub.describe import CARD_SETTINGS, card_fields
from hf_dp.models.loss import OBJECTIVES
from hf_dp.models.precision import model_init_kwargs
from hf_dp.run.data import check_eval_is_not_train, no_progress_bar
from hf_dp.trainer import DPTrainer


def reward_objective(center: float | None):
    """The per-row objective of reward pairs: each pair's loss on its chosen row (``labels``: the pair's margin)."""

    def per_pair(logits, labels, config):
        return row_losses(reward_pair_losses(logits.float(), labels, center))

    return dataclasses.replace(OBJECTIVES["sequence_classification"], name="reward_pairs", per_example=per_pair,
                               label_column=False)


class DPRewardTrainer(DPTrainer, RewardTrainer):
    """TRL's ``RewardTrainer`` with differential privacy (see the module docstring). ``args`` must be a
    :class:`~hf_dp.dpo.config.DPRewardConfig`; the other arguments are ``RewardTrainer``'s."""

    def __init__(self, model=None, args: DPRewardConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), optimizer_cls_and_kwargs=None, preprocess_logits_for_metrics=None,
                 peft_config=None):
        if not isinstance(args, DPRewardConfig):
            raise TypeError("DPRewardTrainer needs args=DPRewardConfig(...) (TRL's RewardConfig flags plus hf_dp's DP "
                            "flags)")
        if isinstance(model, str):  # as RewardTrainer loads it, before DPTrainer freezes it (--trainable)
            from transformers import AutoModelForSequenceClassification

            model = AutoModelForSequenceClassification.from_pretrained(model, num_labels=1,
                                                                       **model_init_kwargs(args))
        if args.dp_enabled:
            given = {"peft_config": (peft_config, "pass --trainable lora (with --lora_r / --lora_alpha) instead, so "
                                                  "that the adapter is attached before the per-example clipping engine"),
                     "data_collator": (data_collator, "its pair collator puts each pair's chosen and rejected "
                                                      "sequences in two consecutive rows, clipped together"),
                     "optimizer_cls_and_kwargs": (optimizer_cls_and_kwargs, "DPTrainer builds its DP optimizer from "
                                                                            "--optim")}
            refuse_under_dp("DPRewardTrainer", args, train_dataset, eval_dataset,
                            {k: why for k, (v, why) in given.items() if v is not None})
            if getattr(getattr(model, "config", None), "num_labels", 1) != 1:
                raise ValueError(f"a reward model scores each sequence with one number, but the model has "
                                 f"num_labels={model.config.num_labels}: load it with num_labels=1")
            enforce_reward(args)  # again: the config may have been changed since it was made
        self._raw_train_dataset = train_dataset
        quiet = args.dp_enabled and (args.privacy_unit_column or args.public_dataset_size is not None)
        with no_progress_bar() if quiet else contextlib.nullcontext():
            super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class,
                             compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                             optimizer_cls_and_kwargs=optimizer_cls_and_kwargs,
                             preprocess_logits_for_metrics=preprocess_logits_for_metrics, peft_config=peft_config)

    def _setup_privacy(self) -> None:
        trl = self.data_collator  # TRL's reward DataCollatorForPreference
        self.data_collator = RewardPairCollator(trl.pad_token_id, trl.pad_to_multiple_of)
        self._has_margin = "margin" in (getattr(self.train_dataset, "column_names", None) or [])
        if self._has_margin and not all(math.isfinite(float(m)) for m in self.train_dataset["margin"]):
            raise ValueError("a preference pair's margin is NaN or infinite: each pair's loss −log σ(r_chosen − "
                             "r_rejected − margin) needs a finite margin; fix or drop those pairs")
        self.objective = reward_objective(self.args.center_rewards_coefficient)
        longest = lambda r: max(len(r["chosen_ids"]), len(r["rejected_ids"]))  # noqa: E731
        self.train_dataset = with_lengths(self.train_dataset, self.args, longest)  # group_by_length
        self._fingerprint_source = self.train_dataset
        super()._setup_privacy()
        bound = self.dp.bounds.max_length  # before any step: every pair within the run's public token bound
        check_pair_lengths(self.train_dataset, bound, reward_row_length,
                           f"set --max_length {bound} or less (TRL then drops the longer pairs before N is counted), "
                           "or raise --dp_max_length")

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        # under DP each pair is dropped beyond max_length or refused over the token bound: no "longer than the
        # tokenizer's maximum" warning (hf_dp.flags.quiet_length_warning)
        with quiet_length_warning(length_warning_handled(args, dataset_name)):
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _check_not_train(self, dataset) -> None:
        super()._check_not_train(dataset)
        if self.args.dp_enabled:
            check_eval_is_not_train(dataset, self._raw_train_dataset)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.args.dp_enabled and not model.training:  # evaluation: TRL's loss and metrics, on TRL's layout
            margin = inputs.get("labels")
            inputs = trl_layout(inputs, ("input_ids", "attention_mask"))
            if self._has_margin and margin is not None:
                inputs["margin"] = margin[0::2]
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    def hyperparameter_search(self, *args, **kwargs):
        if self.args.dp_enabled:
            raise ValueError("hyperparameter_search is not supported by DPRewardTrainer under DP yet; run private "
                             "selection with DPTrainer")
        return super().hyperparameter_search(*args, **kwargs)

    def reward_settings(self) -> dict:
        import trl

        return {"trainer": "DPRewardTrainer (TRL RewardTrainer)", "trl_version": trl.__version__,
                "max_length": self.args.max_length, "center_rewards_coefficient": self.args.center_rewards_coefficient,
                "margin": bool(getattr(self, "_has_margin", False)),
                "per_example_loss": "each preference pair's −log σ(r_chosen − r_rejected − margin) from the rewards "
                                    "of its two sequences, forwarded and clipped together"}

    def privacy_report(self) -> dict:
        report = super().privacy_report()
        report["reward_model"] = self.reward_settings()
        return unit_text(report, self.args, "preference pairs")

    def _write_privacy_files(self, output_dir: str, eval_results: dict | None = None) -> None:
        from hf_dp.hub import report as hub_report

        eval_results = eval_results if eval_results is not None else hub_report.latest_eval_metrics(self.state.log_history)
        fields = card_fields(self.model, self.args, self.train_dataset, "sequence_classification",
                             **{k: getattr(self, k, None) for k in CARD_SETTINGS})
        s = self.reward_settings()
        fields["task_description"] = (f"reward modelling on preference pairs with TRL's RewardTrainer (trl "
                                      f"{s['trl_version']}), max_length={s['max_length']}; {s['per_example_loss']}")
        fields["loss_description"] = ("loss (TRL's evaluation loss: the mean over the evaluation pairs of "
                                      "−log σ(r_chosen − r_rejected − margin))")
        write_privacy_artifacts(output_dir, self.privacy_report(), eval_results=eval_results,
                                log_history=self.state.log_history, **fields)
