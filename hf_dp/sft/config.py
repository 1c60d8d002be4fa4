"""``DPSFTConfig``: TRL's ``SFTConfig`` flags plus :class:`~hf_dp.arguments.DPTrainingArguments`' DP flags, one config
dataclass for :class:`~hf_dp.sft.trainer.DPSFTTrainer` (TRL's convention: one config per trainer).

What each flag ``SFTConfig`` adds to ``TrainingArguments`` does under DP is one registry, :data:`SFT_FLAGS`, in the
format of :data:`hf_dp.flags.FLAGS` (the ``TrainingArguments`` fields themselves stay classified there). For a DP run
``__post_init__`` applies its refusals (one sentence each, the reason included) before anything else runs. The table
``docs/sft.md`` lists it (``python -m hf_dp.sft.config --markdown``; a test checks the committed copy).

The ``TrainingArguments`` fields keep ``DPTrainingArguments``' defaults (HF's, and ``optim`` a DP optimizer), not the
ones TRL's ``SFTConfig`` changes: ``gradient_checkpointing`` stays False (TRL turns it on; it is refused under DP),
``bf16`` stays False (TRL turns it on wherever it can), ``learning_rate`` 5e-5 and ``logging_steps`` 500. TRL's own
fields (``max_length``, ``packing``, ``completion_only_loss``, ...) keep TRL's defaults, except ``assistant_only_loss``:
TRL's False scores a conversation's prompt tokens too; here the default is None, per data kind
(:func:`resolve_loss_scope`: the assistant's tokens only on ``messages`` data, TRL's choice elsewhere).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

try:
    from trl import SFTConfig
except ImportError as exc:  # the sft extra is not installed
    raise ImportError('hf_dp.sft needs TRL: pip install -e ".[sft]" (or pip install "trl>=1.16,<2")') from exc

from hf_dp.arguments import DPTrainingArguments, refuse_token_weighting
from hf_dp.flags import (ADJUSTED, CHAT_TEMPLATE_PATH_RULES, REFUSED, SAFE, STATUS_TEXT, Rule, config_fields,
                         enforce_config)

_CROSS = ("a sequence's loss would depend on several conversations (of several users), so clipping the sequence bounds "
          "no single conversation's or user's influence and the reported epsilon would be false")

#: what each field SFTConfig adds to TrainingArguments does under DP (checked complete by tests/test_sft.py)
SFT_FLAGS: dict[str, tuple[Rule, ...]] = {
    "model_init_kwargs": (Rule(SAFE, "how a model given by name is loaded"),),
    "trust_remote_code": (Rule(SAFE, "whether model code from the Hub may run (DPTrainer refuses heads it cannot compute)"),),
    "router_aux_loss_coef": (
        Rule(REFUSED, "--router_aux_loss_coef is not supported with DP: a Mixture-of-Experts load-balancing loss is a "
                      "statistic of the whole batch's tokens, not a sum of per-conversation losses, so it cannot be "
                      "clipped per conversation", "≠ 0", lambda a: bool(a.router_aux_loss_coef)),
        Rule(ADJUSTED, "None/0: under DP the training loss is the per-conversation language-modelling loss only (no "
                       "auxiliary loss is added)")),
    "chat_template_path": CHAT_TEMPLATE_PATH_RULES,
    "dataset_text_field": (Rule(SAFE, "which column holds plain text"),),
    "dataset_kwargs": (Rule(SAFE, "skip_prepare_dataset: the rows are used as given; the run-time contract checks "
                                  "(one row per conversation, each loss its own) still hold"),),
    "dataset_num_proc": (Rule(ADJUSTED, "not used under DP: the data are prepared in the trainer's process, where TRL's "
                                        "messages (its prompt-prefix warning quotes the end of a prompt) are withheld; "
                                        "the processes that tokenize the data without DP"),),
    "eos_token": (Rule(SAFE, "the end-of-sequence token"),),
    "max_length": (Rule(SAFE, "each conversation truncated on its own (conversations left with no scored token are "
                              "dropped by TRL before N is counted)"),),
    "truncation_mode": (Rule(SAFE, "which end of each conversation is kept"),),
    "shuffle_dataset": (Rule(SAFE, "the order of the training rows (Poisson sampling ignores it)"),),
    "packing": (
        Rule(REFUSED, f"--packing is not supported with DP: it concatenates conversations into shared sequences, and {_CROSS}",
             "True", lambda a: bool(a.packing)),
        Rule(SAFE, "False (default)")),
    "packing_strategy": (Rule(SAFE, "only read with packing, which is refused with DP"),),
    "padding_free": (
        Rule(REFUSED, f"--padding_free is not supported with DP: it flattens the micro-batch into one sequence, and {_CROSS}",
             "True", lambda a: bool(a.padding_free)),
        Rule(SAFE, "False (default)")),
    "pad_to_multiple_of": (Rule(SAFE, "padding is masked and never scored"),),
    "eval_packing": (Rule(SAFE, "evaluation data only (not the private training set)"),),
    "completion_only_loss": (Rule(SAFE, "which tokens are scored: each conversation's loss is the mean over its scored "
                                        "(completion) tokens"),),
    "assistant_only_loss": (Rule(SAFE, "which tokens are scored: each conversation's loss is the mean over its "
                                       "assistant tokens. DPSFTConfig's default (None) is per data kind: True on "
                                       "conversational ('messages') data, False otherwise (prompt-completion rows are "
                                       "scored on the completion by completion_only_loss, plain text on every token); "
                                       "pass false to score every token of a conversation"),),
    "loss_type": (
        Rule(REFUSED, "--loss_type dft is not supported with DP: DPSFTTrainer computes each conversation's mean negative "
                      "log-likelihood itself, so DFT's token weights would be silently ignored; use --loss_type nll",
             "dft", lambda a: str(a.loss_type) == "dft"),
        Rule(ADJUSTED, "nll: TRL divides the batch's summed token losses by the batch's token count, which couples the "
                       "conversations; under DP each conversation's loss is the mean over its own scored tokens, and "
                       "the clipped per-conversation (per-user) gradients are summed")),
    "activation_offloading": (
        Rule(REFUSED, "--activation_offloading is not supported with DP: it moves saved activations through hooks that "
                      "hf_dp's per-example clipping (which reads those activations) has not been checked with",
             "True", lambda a: bool(a.activation_offloading)),
        Rule(SAFE, "False (default)")),
    "pad_token": (Rule(SAFE, "the padding token (deprecated in TRL); padding is never scored"),),
}


def sft_fields() -> list[str]:
    """The fields ``SFTConfig`` adds to ``TrainingArguments``."""
    return config_fields(SFTConfig)


def enforce_sft(args) -> None:
    """Raise the first refusal of :data:`SFT_FLAGS` (raw values); a field of a newer TRL that is not classified is
    refused when it differs from its default."""
    refuse_token_weighting(args, "an SFT conversation's loss is the mean over its scored tokens (docs/sft.md)")
    enforce_config(args, SFT_FLAGS, SFTConfig, "an SFTConfig", "hf_dp/sft/config.py")


#: what ``assistant_only_loss=None`` (DPSFTConfig's default) becomes on each kind of data: :func:`resolve_loss_scope`
ASSISTANT_ONLY_DEFAULT = "default for conversational ('messages') data"
NOT_ASSISTANT_ONLY_DEFAULT = "default for data without a 'messages' column"


@dataclass
class DPSFTConfig(DPTrainingArguments, SFTConfig):
    """``SFTConfig`` + ``DPTrainingArguments`` (see the module docstring)."""

    # TRL's default (False) scores every token of a conversation, the user's prompts included. Here None means "per
    # data kind" (resolve_loss_scope): the assistant's tokens on 'messages' data, TRL's own choice elsewhere
    assistant_only_loss: bool | None = field(
        default=None,
        # (argparse %-formats help texts: {%% … %%} shows as {% … %} in --help)
        metadata={"help": "Score only the assistant's tokens of each conversation (TRL's assistant_only_loss; needs a "
                          "chat template with {%% generation %%} markers, or one TRL can patch). Default: true on "
                          "conversational ('messages') data, false on other data (prompt-completion rows are scored on "
                          "the completion by completion_only_loss, plain text on every token); false scores every token"},
    )

    def __post_init__(self):
        if not self.disable_dp:
            enforce_sft(self)
        super().__post_init__()


def _template_file(path: str) -> str:
    """The text of a ``--chat_template_path`` .jinja/.j2 file (TRL reads it the same way), or a one-sentence error."""
    import os

    if not os.path.isfile(path):
        raise ValueError(f"--chat_template_path {path}: no such file (give a .jinja or .j2 file holding the chat template)")
    with open(path, encoding="utf-8") as f:
        return f.read()


def resolve_loss_scope(args, sample, processing_class=None, formatting_func=None) -> None:
    """``assistant_only_loss=None`` (the default) becomes True when the training data is conversational with a
    ``messages`` column (``sample``: its first row) and no ``formatting_func`` turns it into text, else False (TRL's
    ``completion_only_loss`` then scores a prompt-completion row's completion, and plain text is scored whole); where it
    came from is kept on ``args`` for the record (:data:`ASSISTANT_ONLY_DEFAULT`, "given"). A resolved default is
    resolved again for other data. What TRL would refuse deep inside its set-up, with a traceback, is refused here in
    one sentence, before any model work: ``assistant_only_loss=True`` given for data that is not conversational; and,
    with the assistant's tokens only on conversational data, a chat template — the tokenizer's, or a
    ``--chat_template_path`` .jinja/.j2 file — without ``{% generation %}`` markers that TRL cannot patch (or none)."""
    if getattr(args, "_hf_dp_assistant_only_default", False):
        args.assistant_only_loss = None  # the same config given again, with other data
    messages = (formatting_func is None and hasattr(sample, "keys") and "messages" in sample
                and isinstance(sample["messages"], list))
    if args.assistant_only_loss is None:
        args.assistant_only_loss = bool(messages)
        args._hf_dp_assistant_only_default = True
        args._hf_dp_assistant_only_source = ASSISTANT_ONLY_DEFAULT if messages else NOT_ASSISTANT_ONLY_DEFAULT
    else:
        args._hf_dp_assistant_only_default = False
        args._hf_dp_assistant_only_source = "given"
    if args.assistant_only_loss and formatting_func is None and hasattr(sample, "keys"):
        from trl.data_utils import is_conversational

        if not is_conversational(sample):
            kind = ("prompt-completion rows" if "prompt" in sample and "completion" in sample else
                    f"plain text ('{args.dataset_text_field}')" if args.dataset_text_field in sample else "this data")
            raise ValueError(
                f"--assistant_only_loss true scores the assistant's turns of conversations, but the training data is not "
                f"conversational ({kind}, not a 'messages' list of role/content turns): drop the flag — prompt-completion "
                "rows are scored on the completion only by default (--completion_only_loss), plain text on every token")
    chat_file = args.chat_template_path
    if not (args.assistant_only_loss and messages) or processing_class is None:
        return
    if chat_file is not None and not str(chat_file).endswith((".jinja", ".j2")):
        return  # a model or tokenizer name: refused under DP (SFT_FLAGS); TRL's own error otherwise
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if chat_file is not None:
        template, where = _template_file(chat_file), f"the chat template of --chat_template_path {chat_file}"
    else:
        template = getattr(processing_class, "chat_template", None) or getattr(tokenizer, "chat_template", None)
        where = "the tokenizer's chat template"
    problem = None
    if not template:
        problem = "the tokenizer has no chat template"
    else:
        from trl.chat_template_utils import get_training_chat_template, has_generation_markers

        if not has_generation_markers(template):
            holder = processing_class if hasattr(processing_class, "chat_template") else tokenizer
            before = getattr(holder, "chat_template", None)
            try:
                holder.chat_template = template  # as TRL will set it, to see whether it can patch it
                get_training_chat_template(processing_class)
            except ValueError:
                problem = f"{where} has no {{% generation %}} markers and TRL cannot patch it"
            finally:
                holder.chat_template = before
    if problem:
        default = " by default" if args._hf_dp_assistant_only_default else ""
        fix = ("give a template that marks them (--chat_template_path file.jinja, or tokenizer.chat_template)"
               if chat_file is None else "add {% generation %} … {% endgeneration %} around the assistant's text in "
               f"{chat_file}")
        raise ValueError(
            f"on conversational ('messages') data DPSFTTrainer scores only the assistant's tokens{default} "
            f"(assistant_only_loss), which needs a chat template that marks them with {{% generation %}}, but {problem}: "
            f"{fix}, or pass assistant_only_loss=False to score every token of the conversation, the user's included")


def scored_tokens(args, completion_only_loss: bool) -> str:
    """Which tokens each training row's loss is over, in words (privacy.json's ``sft.scored_tokens``, the card)."""
    if args.assistant_only_loss:
        return "the assistant's tokens only"
    if completion_only_loss:
        return "the completion's tokens only"
    return "every token"


def markdown() -> str:
    lines = ["| `SFTConfig` flag | under DP | why |", "| --- | --- | --- |"]
    for name in sft_fields():
        rules = SFT_FLAGS.get(name, ())
        for i, r in enumerate(rules):
            status = STATUS_TEXT[r.status] + (f" when {r.when}" if r.when else (" otherwise" if i else ""))
            lines.append(f"| `{name}` | {status} | {r.reason.replace('|', chr(92) + '|')} |")
    return "\n".join(lines) + "\n"



if __name__ == "__main__":  # python -m hf_dp.sft.config --markdown
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m hf_dp.sft.config --markdown")
    sys.stdout.write(markdown())
