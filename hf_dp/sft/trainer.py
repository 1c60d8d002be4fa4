"""``DPSFTTrainer``: DP supervised fine-tuning through TRL's ``SFTTrainer`` (chat data, completion-only loss, LoRA).

``class DPSFTTrainer(DPTrainer, SFTTrainer)``: TRL prepares the data exactly as ``SFTTrainer`` does (chat template,
``completion_mask`` / ``assistant_masks`` turned into labels -100 on every prompt token, truncation to
``max_length``) and its collator pads each conversation on the right (attention 0, labels -100); DPTrainer does the
rest — Poisson sampling, per-example (or per-unit) clipping, noise once per logical batch, the accountant, the card.

The objective under DP: each conversation's loss is the **mean negative log-likelihood over its scored tokens** (the
completion or assistant tokens TRL's masks keep: by default prompt tokens are never scored — ``assistant_only_loss``
is on for ``messages`` data (:func:`hf_dp.sft.config.resolve_loss_scope`) —, :func:`hf_dp.models.loss.causal_lm_loss`), and the clipped per-conversation gradients are summed. TRL's own loss
divides the batch's summed token losses by the batch's token count, which couples the conversations; it is kept for
evaluation (``eval_loss``, which is computed on evaluation data) and for ``--disable_dp`` baselines.

``--privacy_unit_column user_id``: one unit = every conversation of one user (N = the number of users); the sampler
puts all conversations of a drawn user in the same micro-batch and their summed gradient is clipped to C —
user-level DP over conversations. The unit column is read from the training set as TRL prepared it (a conversation
TRL drops — one left with no scored token after truncation — is not counted).

What DP cannot honour is refused in one sentence before any work: the TRL flags of :data:`hf_dp.sft.config.SFT_FLAGS`
(packing and padding-free across conversations, ``loss_type dft``, ...), and the trainer's ``peft_config`` (use
``--trainable lora --lora_r R --lora_alpha A``: DPTrainer attaches the adapter so that its clipping engine and the
card see it), ``compute_loss_func`` and ``--audit_canaries`` (not supported here yet).
"""

from __future__ import annotations

import contextlib
import logging

from trl import SFTTrainer

from hf_dp.flags import length_warning_handled, quiet_length_warning
from hf_dp.hub import write_privacy_artifacts
from hf_dp.hub.describe import CARD_SETTINGS, card_fields
from hf_dp.models.precision import model_init_kwargs
from hf_dp.run.data import check_eval_is_not_train, no_progress_bar, withheld_messages
from hf_dp.sft.config import DPSFTConfig, enforce_sft, resolve_loss_scope, scored_tokens
from hf_dp.trainer import DPTrainer

logger = logging.getLogger(__name__)

#: the SFTConfig settings privacy.json and the card record (public choices of the run)
RECORDED_SETTINGS = ("max_length", "truncation_mode", "completion_only_loss", "assistant_only_loss", "packing",
                     "padding_free", "loss_type", "dataset_text_field", "chat_template_path", "eos_token")


def _first_row(dataset):
    """The first training row (TRL reads the data kind from it), or None."""
    if dataset is None:
        return None
    try:
        return dataset[0] if hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__") and len(dataset) else next(iter(dataset))
    except (StopIteration, TypeError, KeyError, IndexError):
        return None


@contextlib.contextmanager
def withheld_trl_messages(args, dataset_name: str):
    """Under DP, TRL's SFT messages while ``dataset_name`` is prepared are dropped — its prompt-prefix warning quotes
    the end of a private prompt, and whether it appears at all is a fact about the data
    (:func:`hf_dp.run.data.withheld_messages`) — and one line is logged that is the same whatever TRL said."""
    if not args.dp_enabled:
        yield
        return
    from trl.trainer import sft_trainer

    with withheld_messages(sft_trainer.logger, args):
        yield
    logger.info("hf_dp: TRL's messages while preparing the %s data are withheld under DP (they may quote private text, "
                "and whether there were any is a fact about the data)", dataset_name)

class DPSFTTrainer(DPTrainer, SFTTrainer):
    """TRL's ``SFTTrainer`` with differential privacy (see the module docstring). ``args`` must be a
    :class:`~hf_dp.sft.config.DPSFTConfig`; the other arguments are ``SFTTrainer``'s."""

    def __init__(self, model=None, args: DPSFTConfig | None = None, data_collator=None, train_dataset=None,
                 eval_dataset=None, processing_class=None, peft_config=None, formatting_func=None,
                 compute_loss_func=None, **kwargs):
        if not isinstance(args, DPSFTConfig):
            raise TypeError("DPSFTTrainer needs args=DPSFTConfig(...) (TRL's SFTConfig flags plus hf_dp's DP flags)")
        if args.dp_enabled:
            if peft_config is not None:
                raise ValueError("peft_config is not supported by DPSFTTrainer under DP: pass --trainable lora (with "
                                 "--lora_r / --lora_alpha) instead, so that the adapter is attached before the "
                                 "per-example clipping engine and recorded in the card")
            if compute_loss_func is not None:
                raise ValueError("compute_loss_func is not supported by DPSFTTrainer under DP: each conversation's loss "
                                 "is computed by hf_dp (the mean over its scored tokens), so it would be silently ignored")
            if args.audit_canaries:
                raise ValueError("--audit_canaries is not supported by DPSFTTrainer yet: its canaries are token rows "
                                 "appended to the training set before TRL prepares the conversations; audit with "
                                 "DPTrainer (recipes/clm.py)")
            enforce_sft(args)  # again: the config may have been changed since it was made
            check_eval_is_not_train(eval_dataset, train_dataset)  # the raw sets (TRL's preparation makes new ones)
        # assistant_only_loss=None (DPSFTConfig's default): the assistant's tokens on 'messages' data, else TRL's own
        # choice (the completion of prompt-completion rows, every token of plain text); a template that cannot mark the
        # assistant's tokens is refused in one sentence (hf_dp.sft.config.resolve_loss_scope)
        resolve_loss_scope(args, _first_row(train_dataset), processing_class, formatting_func)
        if isinstance(model, str):  # as SFTTrainer loads it, but before DPTrainer freezes it (--trainable)
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(model, **model_init_kwargs(args))
        self._raw_train_dataset = train_dataset
        # TRL prepares the training set with 🤗 Datasets' maps and filters, whose bars print its number of rows
        # (conversations): private under a unit column (one user's removal changes it by their conversations)
        with no_progress_bar() if args.dp_enabled and (args.privacy_unit_column or args.public_dataset_size is not None) \
                else contextlib.nullcontext():
            super().__init__(model=model, args=args, data_collator=data_collator, train_dataset=train_dataset,
                             eval_dataset=eval_dataset, processing_class=processing_class, peft_config=peft_config,
                             formatting_func=formatting_func, compute_loss_func=compute_loss_func, **kwargs)

    def _setup_privacy(self) -> None:
        # N, the units, the label and token checks and the resume fingerprint read the training set as TRL prepared it
        # (token ids, labels -100 on prompt tokens, the unit column kept), not the raw conversations
        self._fingerprint_source = self.train_dataset
        super()._setup_privacy()

    def _prepare_dataset(self, dataset, processing_class, args, packing, formatting_func, dataset_name):
        # under DP each conversation is cut to max_length (or, in the training set, refused over the run's token
        # bound): no "longer than the tokenizer's maximum" warning (hf_dp.flags.quiet_length_warning); TRL's own
        # messages withheld (withheld_trl_messages)
        with quiet_length_warning(length_warning_handled(args, dataset_name)), withheld_trl_messages(args, dataset_name):
            return super()._prepare_dataset(dataset, processing_class, args, packing, formatting_func, dataset_name)

    def _check_not_train(self, dataset) -> None:
        super()._check_not_train(dataset)
        if self.args.dp_enabled:
            check_eval_is_not_train(dataset, self._raw_train_dataset)

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix="eval"):
        if eval_dataset is not None and not isinstance(eval_dataset, str) and not self._skip_prepare_dataset:
            self._check_not_train(eval_dataset)  # the raw set, before TRL's preparation gives it a new fingerprint
            packing = self.args.packing if self.args.eval_packing is None else self.args.eval_packing
            prepare = lambda ds, name: self._prepare_dataset(ds, self.processing_class, self.args, packing,  # noqa: E731
                                                             self._formatting_func, name)
            eval_dataset = ({k: prepare(v, k) for k, v in eval_dataset.items()} if isinstance(eval_dataset, dict)
                            else prepare(eval_dataset, metric_key_prefix))
        return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)  # (no pin_memory warning: DPTrainer's)

    def hyperparameter_search(self, *args, **kwargs):
        if self.args.dp_enabled:
            raise ValueError("hyperparameter_search is not supported by DPSFTTrainer under DP yet (its trials would be "
                             "rebuilt from TRL's prepared data); run private selection with DPTrainer")
        return super().hyperparameter_search(*args, **kwargs)

    def data_kind(self) -> str:
        """What the training rows are, as TRL reads them (their first row): ``messages`` (conversations),
        ``prompt_completion`` or ``text``."""
        row = _first_row(self._raw_train_dataset)
        keys = set(row.keys()) if hasattr(row, "keys") else set()
        if "messages" in keys:
            return "messages"
        if {"prompt", "completion"} <= keys:
            return "prompt_completion"
        return "text"

    def sft_settings(self) -> dict:
        """The SFTConfig settings of this run (public), as privacy.json and the card record them: the effective values
        (``assistant_only_loss`` and ``completion_only_loss`` as resolved for this data, and where each came from)."""
        import trl

        out = {"trainer": "DPSFTTrainer (TRL SFTTrainer)", "trl_version": trl.__version__}
        out.update({k: getattr(self.args, k, None) for k in RECORDED_SETTINGS})
        # None (TRL's default) means "on for prompt-completion rows", and TRL applies it to such rows only (on
        # 'messages' or 'text' data it scores every token): the record says what was in effect
        kind = self.data_kind()
        completion_only = bool(self.completion_only_loss) and kind == "prompt_completion"
        out["completion_only_loss"] = completion_only
        out["completion_only_loss_source"] = (
            "given, but TRL applies it to prompt-completion rows only" if self.completion_only_loss and not completion_only
            else "given" if getattr(self.args, "completion_only_loss", None) is not None else
            "TRL's default: on for prompt-completion rows" if completion_only else
            "TRL's default: off for data without 'prompt'/'completion' columns")
        out["data_kind"] = kind
        out["scored_tokens"] = scored = scored_tokens(self.args, completion_only)
        out["assistant_only_loss_source"] = getattr(self.args, "_hf_dp_assistant_only_source", "given")
        out["chat_template"] = "set" if getattr(self.processing_class, "chat_template", None) else None
        row = "conversation" if kind == "messages" else "row"
        if scored == "the assistant's tokens only":
            out["per_example_loss"] = (f"each {row}'s mean negative log-likelihood over its assistant tokens; the other "
                                       "turns' tokens (user, system) and padding are never scored")
        elif scored == "the completion's tokens only":
            out["per_example_loss"] = (f"each {row}'s mean negative log-likelihood over its completion tokens; the "
                                       "prompt's tokens and padding are never scored")
        else:
            others = {"messages": "every turn's tokens, the user's included", "prompt_completion":
                      "the prompt's tokens included"}.get(kind, "all its text")
            out["per_example_loss"] = (f"each {row}'s mean negative log-likelihood over all its tokens ({others}); "
                                       "padding is never scored")
        return out

    def privacy_report(self) -> dict:
        report = super().privacy_report()
        report["sft"] = self.sft_settings()
        col = self.args.privacy_unit_column
        if self.args.dp_enabled and col is not None:
            unit = dict(report["privacy_unit"])
            unit["description"] = (f"user-level DP over conversations: one unit = all conversations with the same "
                                   f"'{col}', N = {unit['num_units']:,} users; each user's summed gradient over their "
                                   "conversations in a step is clipped to C")
            report["privacy_unit"] = unit
            report["unit_of_privacy"] = (f"all conversations with the same '{col}' — user-level DP over conversations "
                                         "(add/remove adjacency of one user)")
        elif self.args.dp_enabled:
            report["unit_of_privacy"] = "one conversation (add/remove adjacency of one training conversation)"
        return report

    def _write_privacy_files(self, output_dir: str, eval_results: dict | None = None) -> None:
        from hf_dp.hub import report as hub_report

        eval_results = eval_results if eval_results is not None else hub_report.latest_eval_metrics(self.state.log_history)
        # the user's data as given (its name, its columns), not TRL's tokenized set (input_ids, labels)
        fields = card_fields(self.model, self.args, self._raw_train_dataset, getattr(self.objective, "name", None),
                             **{k: getattr(self, k, None) for k in CARD_SETTINGS})
        s = self.sft_settings()
        what = {"messages": "conversations", "prompt_completion": "prompt-completion rows"}.get(s["data_kind"], "plain text")
        source = (s["completion_only_loss_source"] if s["scored_tokens"] == "the completion's tokens only"
                  else s["assistant_only_loss_source"])
        fields["task_description"] = (
            f"supervised fine-tuning on {what} with TRL's SFTTrainer (trl {s['trl_version']}): "
            f"completion_only_loss={s['completion_only_loss']}, assistant_only_loss={s['assistant_only_loss']}, "
            f"max_length={s['max_length']}, packing={s['packing']}, padding_free={s['padding_free']}, "
            f"loss_type={s['loss_type']}; scored tokens: {s['scored_tokens']} ({source}); "
            f"{s['per_example_loss']}")
        # TRL's evaluation loss: the evaluation rows' token losses summed over their scored tokens (the tokens training
        # scores) and divided by the batch's count of them
        fields["loss_description"] = (
            f"loss (TRL's evaluation loss: mean cross-entropy per scored token — {s['scored_tokens']} — of the "
            "evaluation rows; perplexity = exp(loss))")
        write_privacy_artifacts(output_dir, self.privacy_report(), eval_results=eval_results,
                                log_history=self.state.log_history, **fields)  # with the training-curves PNG
