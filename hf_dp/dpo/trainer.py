"""``DPDPOTrainer``: DP direct preference optimization through TRL's ``DPOTrainer``, one preference pair = one example.

``class DPDPOTrainer(DPTrainer, DPOTrainer)``: TRL prepares the pairs exactly as ``DPOTrainer`` does (prompt extraction,
chat template for conversational pairs, EOS, tokenization into ``prompt_ids`` / ``chosen_ids`` / ``rejected_ids``, the
pairs whose prompt fills ``max_length`` dropped); DPTrainer does the rest — Poisson sampling of pairs, per-pair (or
per-user) clipping, noise once per logical batch, the accountant, the card.

**One pair is one example.** Under DP the collator is :class:`hf_dp.dpo.pairs.PairRowsCollator`: a drawn pair becomes
two consecutive rows (prompt + chosen, prompt + rejected), and DPTrainer's loader attributes both to the pair that made
them, so they are drawn, forwarded and clipped together (one privacy unit; under ``--privacy_unit_column`` every pair
of one user is one unit). Each pair's loss is TRL's per-pair DPO loss (:func:`hf_dp.dpo.pairs.pair_losses`) from the
policy's and the reference's summed log-probabilities of its completion tokens (never the prompt's: labels -100 there);
nothing divides by the batch. TRL's own training loss (the batch mean) is kept for evaluation and ``--disable_dp``.

**The reference model is public**: with ``--trainable lora`` the model itself with the adapter disabled (the starting
model: LoRA's B starts at 0; TRL's "ref" adapter copy is removed, no second copy), otherwise a frozen copy of the
starting model made before training (or the ``ref_model`` given, which must not depend on the private data: one that
carries a DP training record this run's ledger does not count is refused, :mod:`hf_dp.dpo.checks`). Its
log-probabilities of a private pair live in memory inside the step that draws the pair: TRL's
``precompute_ref_log_probs``, which writes them to a 🤗 Datasets cache file, is refused (:data:`hf_dp.dpo.config.DPO_FLAGS`).

What DP cannot honour is refused in one sentence before any work: the loss types and flags of
:mod:`hf_dp.dpo.config`, and ``peft_config`` (use ``--trainable lora``), ``data_collator``, ``quantization_config``,
vision data, ``--audit_canaries`` and ``hyperparameter_search``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses

import torch
from trl import DPOTrainer

from hf_dp.dpo.checks import check_pair_lengths, check_reference_ledger, dpo_row_length, quiet_preparation
from hf_dp.dpo.config import DPDPOConfig, enforce_dpo, loss_types_of
from hf_dp.dpo.pairs import (PairLoss, PairRowsCollator, completion_logps, log_sum_sq_probs, pair_losses,
                             per_token_logps, row_losses, trl_layout, wpo_weights)
from hf_dp.hub import write_privacy_artifacts
from hf_dp.hub.describe import CARD_SETTINGS, card_fields
from hf_dp.models.loss import IGNORE_INDEX, OBJECTIVES, positions_from_mask
from hf_dp.models.precision import check_full_precision, check_output_precision, model_init_kwargs
from hf_dp.run import step
from hf_dp.run.data import check_eval_is_not_train, group_by_length, no_progress_bar
from hf_dp.trainer import DPTrainer

#: the DPOConfig settings privacy.json and the card record (public choices of the run)
RECORDED_SETTINGS = ("beta", "loss_type", "loss_weights", "label_smoothing", "ld_alpha", "f_divergence_type",
                     "use_weighting", "max_length", "truncation_mode", "sync_ref_model")


def first_row(dataset):
    """The first training row, or None."""
    try:
        return dataset[0] if dataset is not None and len(dataset) else None
    except (TypeError, KeyError, IndexError):
        return None


def refuse_under_dp(trainer: str, args, train_dataset, eval_dataset, reason: dict) -> None:
    """The construction-time refusals shared by the pair trainers (``reason``: argument name -> why, for those given)."""
    for arg, why in reason.items():
        raise ValueError(f"{arg} is not supported by {trainer} under DP: {why}")
    if args.audit_canaries:
        raise ValueError(f"--audit_canaries is not supported by {trainer} yet: its canaries are single rows, not "
                         "preference pairs; audit with DPTrainer (recipes/clm.py)")
    if args.fsdp:
        raise ValueError(f"--fsdp is not supported by {trainer} yet: FSDP's token bound counts rows, and each "
                         "preference pair is two; train in one process or with DDP (torchrun without --fsdp)")
    if args.cache_frozen_features:
        raise ValueError(f"--cache_frozen_features is not supported by {trainer}: the frozen-prefix cache is built from "
                         "rows of input_ids, not from preference pairs; drop the flag")
    row = first_row(train_dataset)
    if hasattr(row, "keys") and ("image" in row or "images" in row):
        raise ValueError(f"vision preference data is not supported by {trainer} under DP: TRL prepares it inside the "
                         "collator, which hf_dp's pair rows do not cover yet")
    check_eval_is_not_train(eval_dataset, train_dataset)  # the raw sets (TRL's preparation makes new ones)


def with_lengths(dataset, args, length):
    """The prepared training set with a ``--length_column_name`` column (each pair's longest row, ``length(row)``,
    capped at ``max_length``) under ``--train_sampling_strategy group_by_length``, which orders each Poisson draw by it;
    added in memory (``Dataset.add_column``: no cache file). Unchanged otherwise."""
    name = args.length_column_name
    if not (args.dp_enabled and group_by_length(args)) or name in (getattr(dataset, "column_names", None) or [name]):
        return dataset
    cap = args.max_length or float("inf")
    return dataset.add_column(name, [int(min(length(r), cap)) for r in dataset])


def unit_text(report: dict, args, what: str) -> dict:
    """privacy.json's unit descriptions for preference pairs (``what``: e.g. "preference pairs")."""
    col = args.privacy_unit_column
    if args.dp_enabled and col is not None:
        unit = dict(report["privacy_unit"])
        unit["description"] = (f"user-level DP over {what}: one unit = all {what} with the same '{col}', N = "
                               f"{unit['num_units']:,} users; each user's summed gradient over their pairs (each pair's "
                               "chosen and rejected answers together) in a step is clipped to C")
        report["privacy_unit"] = unit
        report["unit_of_privacy"] = (f"all {what} with the same '{col}' — user-level DP over {what} (add/remove "
                                     "adjacency of one user)")
    elif args.dp_enabled:
        unit = dict(report.get("privacy_unit") or {})
        unit["description"] = (f"example-level DP over {what}: one unit = one pair (its prompt, chosen and rejected "
                               f"answers, forwarded and clipped together), N = {unit.get('num_units', 0):,} pairs")
        report["privacy_unit"] = unit
        report["unit_of_privacy"] = ("one preference pair — its prompt, chosen and rejected answers together "
                                     "(add/remove adjacency of one pair)")
    return report


class DPDPOTrainer(DPTrainer, DPOTrainer):
    """TRL's ``DPOTrainer`` with differential privacy (see the module docstring). ``args`` must be a
    :class:`~hf_dp.dpo.config.DPDPOConfig`; the other arguments are ``DPOTrainer``'s."""

    def __init__(self, model=None, ref_model=None, args: DPDPOConfig | None = None, data_collator=None,
                 train_dataset=None, eval_dataset=None, processing_class=None, compute_metrics=None, callbacks=None,
                 optimizers=(None, None), quantization_config=None, peft_config=None):
        if not isinstance(args, DPDPOConfig):
            raise TypeError("DPDPOTrainer needs args=DPDPOConfig(...) (TRL's DPOConfig flags plus hf_dp's DP flags)")
        if args.dp_enabled:
            given = {"peft_config": "pass --trainable lora (with --lora_r / --lora_alpha) instead, so that the adapter "
                                    "is attached before the per-example clipping engine and recorded in the card",
                     "data_collator": "its pair collator puts each pair's chosen and rejected sequences in two "
                                      "consecutive rows, clipped together (hf_dp.dpo.pairs.PairRowsCollator)",
                     "quantization_config": "DP training needs float32 trainable parameters"}
            passed = {"peft_config": peft_config, "data_collator": data_collator,
                      "quantization_config": quantization_config}
            refuse_under_dp("DPDPOTrainer", args, train_dataset, eval_dataset,
                            {k: v for k, v in given.items() if passed[k] is not None})
            enforce_dpo(args)  # again: the config may have been changed since it was made
        if isinstance(model, str):  # as DPOTrainer loads it, but before DPTrainer freezes it (--trainable)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, **model_init_kwargs(args))
        self._reference = "given (ref_model=)" if ref_model is not None else None
        self._given_ref = ref_model is not None  # its DP training is checked against the ledger (hf_dp.dpo.checks)
        if ref_model is None and args.trainable != "lora" and model is not None:
            # the starting model, frozen: public (it never sees the private pairs); a --disable_dp baseline gets the
            # same reference (TRL would reload the model by its name, which a model built from a config has not)
            ref_model = copy.deepcopy(model)
            ref_model.requires_grad_(False).eval()
            self._reference = "a frozen copy of the starting model"
        elif args.dp_enabled and ref_model is None:
            self._reference = "the starting model: the policy with its LoRA adapter disabled (no second copy)"
        self._raw_train_dataset = train_dataset
        # TRL prepares the pairs with 🤗 Datasets' maps and filters, whose bars print the number of rows (pairs):
        # private under a unit column (one user's removal changes it by their pairs)
        quiet = args.dp_enabled and (args.privacy_unit_column or args.public_dataset_size is not None)
        with no_progress_bar() if quiet else contextlib.nullcontext():
            super().__init__(model=model, ref_model=ref_model, args=args, data_collator=data_collator,
                             train_dataset=train_dataset, eval_dataset=eval_dataset, processing_class=processing_class,
                             compute_metrics=compute_metrics, callbacks=callbacks, optimizers=optimizers,
                             quantization_config=quantization_config, peft_config=peft_config)

    def _setup_privacy(self) -> None:
        peft_config = getattr(self.model, "peft_config", None)
        if isinstance(peft_config, dict) and "ref" in peft_config:  # TRL's copy of the adapter: the base is the reference
            self.model.delete_adapter("ref")
        trl = self.data_collator  # TRL's DataCollatorForPreference, whose truncation the pair rows keep
        self.data_collator = PairRowsCollator(trl.pad_token_id, trl.max_length, trl.truncation_mode,
                                              trl.pad_to_multiple_of)
        self.pair_loss = PairLoss.from_args(self.args)
        # N, the units and the fingerprint read the training set as TRL prepared it (the unit column kept)
        longest = lambda r: len(r["prompt_ids"]) + max(len(r["chosen_ids"]), len(r["rejected_ids"]))  # noqa: E731
        self.train_dataset = with_lengths(self.train_dataset, self.args, longest)  # group_by_length
        self._fingerprint_source = self.train_dataset
        super()._setup_privacy()
        # before any step: every pair within the run's public token bound, and a given reference's DP training counted
        bound = self.dp.bounds.max_length
        check_pair_lengths(self.train_dataset, bound, dpo_row_length(self.args.max_length),
                           f"set --max_length {bound} or less (TRL's collator then cuts every sequence to it), or raise "
                           "--dp_max_length")
        if self.ref_model is not None:  # its log-probabilities enter every pair's loss: the model's precision rule
            check_full_precision(self.ref_model, "the reference model (ref_model=)")
        note = check_reference_ledger(self.dp.ledger, self.args, self.ref_model if self._given_ref else None)
        if note:
            self._reference = f"given (ref_model=): {note}"

    def _prepare_dataset(self, dataset, processing_class, args, dataset_name):
        # under DP, TRL's preparation messages that quote the pairs' text are withheld (hf_dp.dpo.checks)
        with quiet_preparation(args, dataset_name):
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

    def _check_not_train(self, dataset) -> None:
        super()._check_not_train(dataset)
        if self.args.dp_enabled:
            check_eval_is_not_train(dataset, self._raw_train_dataset)

    # ------------------------------------------------------------------------------------------------ the step
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if self.args.dp_enabled and model.training:
            return self._private_pairs(model, inputs, return_outputs)
        if self.args.dp_enabled:  # evaluation: TRL's loss and metrics, on TRL's layout of the pair rows
            inputs = trl_layout(inputs, ("input_ids", "attention_mask", "completion_mask"))
        return super().compute_loss(model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch)

    @torch.no_grad()
    def reference_logps(self, model, inputs: dict) -> torch.Tensor:
        """``[2P, T-1]``: the reference's per-token log-probabilities of the rows' completion tokens (in memory only)."""
        kw = {k: inputs[k] for k in ("input_ids", "attention_mask", "position_ids") if k in inputs}
        if self.args.dp_enabled and self.ref_model is not None:  # every DP step: also a reference cast since it was built
            check_full_precision(self.ref_model, "the reference model (ref_model=)")
        if self.ref_model is not None:
            logits = self.ref_model(**kw, use_cache=False).logits
        else:
            policy = self.accelerator.unwrap_model(model)
            with policy.disable_adapter():
                logits = policy(**kw, use_cache=False).logits
        if self.args.dp_enabled:  # no autocast, as for the policy's output (hf_dp.run.step)
            check_output_precision(logits, "the reference model")
        return per_token_logps(logits, inputs["labels"], inputs.get("attention_mask"))

    def pair_objective(self, model, inputs: dict):
        """``(inputs, objective)`` for DPTrainer's step: the batch of pair rows without ``completion_mask``, with each
        row's own positions, and the objective whose per-row losses are each pair's DPO loss on its chosen row (0 on
        its rejected row) from this batch's reference log-probabilities (:mod:`hf_dp.dpo.pairs`)."""
        inputs = dict(inputs)
        completion = inputs.pop("completion_mask")
        mask = inputs.get("attention_mask")
        if torch.is_tensor(mask):  # the policy's positions (hf_dp.run.step) and the reference's: each row's own
            inputs["position_ids"] = positions_from_mask(mask)
        inputs["use_cache"] = False
        ref_tok = self.reference_logps(model, inputs)
        cfg = self.pair_loss

        def per_pair(logits, labels, config, attention_mask=None):
            tok = per_token_logps(logits, labels, attention_mask)
            scored = labels[:, 1:] != IGNORE_INDEX  # TRL's shifted completion mask
            if attention_mask is not None:
                scored = scored & attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
            scored = scored.to(tok.dtype)
            weights = wpo_weights(tok.detach(), log_sum_sq_probs(logits.detach()), scored) if cfg.use_weighting else None
            losses = pair_losses(cfg, completion_logps(tok, scored, cfg.ld_alpha),
                                 completion_logps(ref_tok, scored, cfg.ld_alpha), completion_mask=completion,
                                 shift_mask=scored, tok=tok, weights=weights)
            return row_losses(losses)

        return inputs, dataclasses.replace(OBJECTIVES["causal_lm"], name="dpo_pairs", per_example=per_pair)

    def _private_pairs(self, model, inputs, return_outputs):
        """DP training: each pair's DPO loss on its chosen row, through DPTrainer's step (hf_dp.run.step)."""
        inputs, objective = self.pair_objective(model, inputs)
        loss, outputs = step.private_loss(self.dp, model, inputs, objective, self.model.config, self.args.world_size)
        return (loss, outputs) if return_outputs else loss

    def hyperparameter_search(self, *args, **kwargs):
        if self.args.dp_enabled:
            raise ValueError("hyperparameter_search is not supported by DPDPOTrainer under DP yet (its trials would be "
                             "rebuilt from TRL's prepared pairs); run private selection with DPTrainer")
        return super().hyperparameter_search(*args, **kwargs)

    # ------------------------------------------------------------------------------------------------ the release
    def dpo_settings(self) -> dict:
        """The DPOConfig settings of this run (public), as privacy.json and the card record them."""
        import trl

        out = {"trainer": "DPDPOTrainer (TRL DPOTrainer)", "trl_version": trl.__version__}
        out.update({k: getattr(self.args, k, None) for k in RECORDED_SETTINGS})
        out["loss_type"] = loss_types_of(self.args)
        out["reference_model"] = self._reference or "TRL's (non-private run)"
        out["scored_tokens"] = "the completion's tokens only (prompt and padding tokens are never scored)"
        out["per_example_loss"] = ("each preference pair's DPO loss (TRL's per-pair formula of the loss types above) "
                                   "from the policy's and the reference's summed log-probabilities of its chosen and "
                                   "rejected completions; the pair's two sequences are forwarded and clipped together")
        return out

    def privacy_report(self) -> dict:
        report = super().privacy_report()
        report["dpo"] = self.dpo_settings()
        return unit_text(report, self.args, "preference pairs")

    def _write_privacy_files(self, output_dir: str, eval_results: dict | None = None) -> None:
        from hf_dp.hub import report as hub_report

        eval_results = eval_results if eval_results is not None else hub_report.latest_eval_metrics(self.state.log_history)
        fields = card_fields(self.model, self.args, self.train_dataset, "causal_lm",
                             **{k: getattr(self, k, None) for k in CARD_SETTINGS})
        s = self.dpo_settings()
        fields["task_description"] = (
            f"direct preference optimization with TRL's DPOTrainer (trl {s['trl_version']}): loss_type="
            f"{','.join(s['loss_type'])}, beta={s['beta']}, max_length={s['max_length']}; reference model: "
            f"{s['reference_model']}; {s['per_example_loss']}; scored tokens: {s['scored_tokens']}")
        fields["loss_description"] = ("loss (TRL's evaluation loss: the mean over the evaluation pairs of each pair's "
                                      f"DPO loss, loss_type={','.join(s['loss_type'])}, beta={s['beta']})")
        write_privacy_artifacts(output_dir, self.privacy_report(), eval_results=eval_results,
                                log_history=self.state.log_history, **fields)
