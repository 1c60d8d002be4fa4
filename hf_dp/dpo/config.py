"""``DPDPOConfig`` and ``DPRewardConfig``: TRL's ``DPOConfig`` / ``RewardConfig`` flags plus
:class:`~hf_dp.arguments.DPTrainingArguments`' DP flags, one config dataclass per trainer (TRL's convention).

What each flag those configs add to ``TrainingArguments`` does under DP is a registry in the format of
:data:`hf_dp.flags.FLAGS`: :data:`DPO_FLAGS`, :data:`REWARD_FLAGS`, and for each of TRL's DPO loss types
:data:`LOSS_TYPES` (checked in trl 1.16.0: a type that couples pairs — sorts the batch, keeps a running statistic — is
refused; a per-pair one is allowed). For a DP run ``__post_init__`` applies the refusals (one sentence each, the reason
included) before anything else; a field or loss type of a newer TRL that is not classified here is refused when used.
``python -m hf_dp.dpo.config --markdown`` prints the tables of ``docs/dpo.md`` (a test checks the committed copy).

The ``TrainingArguments`` fields keep ``DPTrainingArguments``' defaults, not TRL's: ``gradient_checkpointing`` stays
False (TRL turns it on; refused under DP), ``bf16`` False, ``learning_rate`` 5e-5 (TRL's DPO: 1e-6).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

try:
    from trl import DPOConfig, RewardConfig
except ImportError as exc:  # the sft extra is not installed
    raise ImportError('hf_dp.dpo needs TRL: pip install -e ".[sft]" (or pip install "trl>=1.16,<2")') from exc

from hf_dp.arguments import DPTrainingArguments, refuse_token_weighting
from hf_dp.flags import (ADJUSTED, CHAT_TEMPLATE_PATH_RULES, REFUSED, SAFE, STATUS_TEXT, Rule, config_fields,
                         enforce_config)

_PAIR = "per pair: a function of the pair's own log-ratios"
_SORTS = ("sorts the batch's {what} and matches the k-th smallest with the k-th smallest, so each pair's loss depends "
          "on the other pairs of its batch (of other users) and clipping it bounds no single pair's influence")

#: each of TRL's DPO loss types under DP (checked complete against the installed TRL by tests/test_dpo.py)
LOSS_TYPES: dict[str, Rule] = {
    "sigmoid": Rule(SAFE, f"{_PAIR}: −log σ(β·Δ), the original DPO loss"),
    "hinge": Rule(SAFE, f"{_PAIR}: relu(1 − β·Δ)"),
    "ipo": Rule(SAFE, f"{_PAIR}: (Δ/len − 1/(2β))², each answer's log-ratio divided by its own completion length"),
    "exo_pair": Rule(SAFE, f"{_PAIR} (TRL requires label_smoothing > 0, a public constant)"),
    "nca_pair": Rule(SAFE, f"{_PAIR}: −log σ(β·r_c) − ½ log σ(−β·r_c) − ½ log σ(−β·r_r)"),
    "robust": Rule(SAFE, f"{_PAIR}; label_smoothing (the assumed flip rate) is a public constant"),
    "bco_pair": Rule(SAFE, f"{_PAIR} in trl 1.16: −log σ(β·r_c) − log σ(−β·r_r); the BCO paper's reward shift δ, a "
                           "running mean of the batches' rewards (TRL < 1.0), is not part of it (it would couple "
                           "batches and be refused)"),
    "sppo_hard": Rule(SAFE, f"{_PAIR}: (r_c − 1/(2β))² + (r_r + 1/(2β))²"),
    "aot": Rule(REFUSED, "--loss_type aot is not supported with DP: it " + _SORTS.format(
        what="policy and reference log-ratio differences")),
    "aot_unpaired": Rule(REFUSED, "--loss_type aot_unpaired is not supported with DP: it " + _SORTS.format(
        what="chosen and rejected log-ratios separately")),
    "apo_zero": Rule(SAFE, f"{_PAIR}: 1 − σ(β·r_c) + σ(β·r_r)"),
    "apo_down": Rule(SAFE, f"{_PAIR}: σ(β·r_c) + 1 − σ(β·(r_c − r_r))"),
    "discopop": Rule(SAFE, f"{_PAIR}: DiscoPOP's blend of the logistic and exponential losses (discopop_tau public)"),
    "sft": Rule(ADJUSTED, "TRL averages the chosen answers' token NLLs over the whole batch (its token count couples "
                          "the pairs); under DP each pair's term is the mean NLL over its own chosen completion tokens "
                          "(with loss_weights: RPO's α·NLL on the chosen answer)"),
    "sigmoid_norm": Rule(SAFE, f"{_PAIR}: −log σ(β·Δ/len), each answer normalized by its own completion length"),
}

_PACK = ("flattens the micro-batch's sequences into one, and a sequence's loss would then depend on several pairs (of "
         "several users), so clipping it bounds no single pair's or user's influence and the reported epsilon would "
         "be false")
_OFFLOAD = Rule(REFUSED, "--activation_offloading is not supported with DP: it moves saved activations through hooks "
                         "that hf_dp's per-example clipping (which reads those activations) has not been checked with",
                "True", lambda a: bool(a.activation_offloading))
_MODEL = {"model_init_kwargs": (Rule(SAFE, "how a model given by name is loaded"),),
          "trust_remote_code": (Rule(SAFE, "whether model code from the Hub may run (DPTrainer refuses heads it "
                                           "cannot compute)"),),
          "dataset_num_proc": (Rule(SAFE, "processes that tokenize the data"),),
          "pad_to_multiple_of": (Rule(SAFE, "padding is masked and never scored"),),
          "pad_token": (Rule(SAFE, "the padding token (deprecated in TRL); padding is never scored"),)}

#: what each field DPOConfig adds to TrainingArguments does under DP (checked complete by tests/test_dpo.py)
DPO_FLAGS: dict[str, tuple[Rule, ...]] = {
    **_MODEL,
    "dataset_num_proc": (Rule(ADJUSTED, "not used under DP: the pairs are prepared in the trainer's process, where TRL's "
                                        "messages that quote a prompt are withheld (a worker process would log them); "
                                        "the processes that tokenize the data without DP"),),
    "router_aux_loss_coef": (
        Rule(REFUSED, "--router_aux_loss_coef is not supported with DP: a Mixture-of-Experts load-balancing loss is a "
                      "statistic of the whole batch's tokens, not a sum of per-pair losses, so it cannot be clipped per "
                      "pair", "≠ 0", lambda a: bool(a.router_aux_loss_coef)),
        Rule(ADJUSTED, "None/0: under DP the training loss is the per-pair preference loss only (no auxiliary loss)")),
    "disable_dropout": (Rule(SAFE, "dropout off in the policy and the reference (TRL's default); with dropout each "
                                   "row still draws its own"),),
    "max_length": (Rule(SAFE, "each sequence (prompt + answer) truncated on its own; a pair whose prompt alone fills "
                              "max_length is dropped by TRL before N is counted"),),
    "truncation_mode": (Rule(SAFE, "which end of each sequence is kept"),),
    "padding_free": (
        Rule(REFUSED, f"--padding_free is not supported with DP: it {_PACK}", "True", lambda a: bool(a.padding_free)),
        Rule(SAFE, "False (default)")),
    "precompute_ref_log_probs": (
        Rule(REFUSED, "--precompute_ref_log_probs is not supported with DP: TRL writes the reference model's "
                      "log-probabilities of every private pair to a 🤗 Datasets cache file and adds them to the "
                      "training set, where they outlive the run; under DP the reference forward runs inside each step "
                      "(with LoRA: the base model, adapter disabled, no second copy)", "True",
             lambda a: bool(a.precompute_ref_log_probs)),
        Rule(SAFE, "False (default): the reference log-probabilities are computed in each step, kept in memory for "
                   "that step only")),
    "precompute_ref_batch_size": (Rule(SAFE, "only read with precompute_ref_log_probs (refused with DP)"),),
    "loss_type": (Rule(ADJUSTED, "each listed type as the loss-type table says (refused types first); TRL averages "
                                 "the pairs' losses over the batch, under DP each pair's loss is its own term and the "
                                 "clipped per-pair (per-user) gradients are summed"),),
    "loss_weights": (Rule(SAFE, "public constants weighting each loss type's per-pair term"),),
    "ld_alpha": (Rule(SAFE, "per pair: LD-DPO weighs the answer tokens beyond the length the pair's own two answers "
                            "share"),),
    "f_divergence_type": (Rule(SAFE, "per pair: f-DPO's f'(π/π_ref) of each answer's own log-ratio"),),
    "f_alpha_divergence_coef": (Rule(SAFE, "a public constant of the α-divergence"),),
    "label_smoothing": (Rule(SAFE, "a public constant (robust, exo_pair)"),),
    "beta": (Rule(REFUSED, "--beta above 10 is not supported with DP: a pair's gradient scales with β·σ(−β·Δ), so β "
                           "multiplies the float32 rounding by which a pair's log-ratio Δ depends on its micro-batch's "
                           "padding (docs/guarantee.md), and at β in the thousands one pair beside 256 copies moved "
                           "the clipped sum by 16 C; DPO uses β ≤ 1 (TRL's default 0.1)", "> 10",
                  lambda a: a.beta is not None and a.beta > 10),
             Rule(SAFE, "≤ 10: a public constant, the deviation from the reference")),
    "use_weighting": (Rule(SAFE, "per pair: WPO weighs a pair by its two answers' own length-normalized "
                                 "probabilities (without gradient, as TRL)"),),
    "discopop_tau": (Rule(SAFE, "a public constant of the DiscoPOP loss"),),
    "activation_offloading": (_OFFLOAD, Rule(SAFE, "False (default)")),
    "sync_ref_model": (Rule(SAFE, "TR-DPO (full fine-tuning only; TRL refuses it with LoRA): every "
                                  "ref_model_sync_steps steps the reference becomes a mix with the policy, a function "
                                  "of the noisy steps released so far, so it stays a post-processing of DP outputs"),),
    "ref_model_mixup_alpha": (Rule(SAFE, "a public constant of TR-DPO"),),
    "ref_model_sync_steps": (Rule(SAFE, "a public constant of TR-DPO"),),
}

#: what each field RewardConfig adds to TrainingArguments does under DP (checked complete by tests/test_dpo.py)
REWARD_FLAGS: dict[str, tuple[Rule, ...]] = {
    **_MODEL,
    "chat_template_path": CHAT_TEMPLATE_PATH_RULES,
    "disable_dropout": (Rule(SAFE, "dropout off (TRL's default)"),),
    "eos_token": (Rule(SAFE, "the end-of-sequence token"),),
    "max_length": (Rule(SAFE, "a pair with an answer longer than max_length is dropped by TRL before N is counted"),),
    "center_rewards_coefficient": (Rule(ADJUSTED, "TRL adds coef × the batch's mean of (r_c + r_r)²; under DP each "
                                                  "pair's term is coef·(r_c + r_r)², its own"),),
    "activation_offloading": (_OFFLOAD, Rule(SAFE, "False (default)")),
}


def new_fields(config_cls) -> list[str]:
    """The fields a TRL config class adds to ``TrainingArguments``."""
    return config_fields(config_cls)


def loss_types_of(args) -> list[str]:
    return [args.loss_type] if isinstance(args.loss_type, str) else list(args.loss_type or [])


#: TRL's f-DPO divergences (trl 1.16 DPOTrainer._compute_loss); hf_dp.dpo.pairs.PairLoss.scores computes each
F_DIVERGENCES = ("reverse_kl", "forward_kl", "js_divergence", "alpha_divergence")


def enforce(args, registry: dict, config_cls, what: str) -> None:
    """Raise the first refusal of ``registry`` (raw values); a field of a newer TRL that is not classified is refused
    when it differs from its default. For DPO, each loss type first (:data:`LOSS_TYPES`), and an f-divergence TRL does
    not compute (which would otherwise stop the run at its first step)."""
    import trl

    if config_cls is DPOConfig:
        for kind in loss_types_of(args):
            rule = LOSS_TYPES.get(kind)
            if rule is None:
                raise ValueError(f"--loss_type {kind} is not a DPO loss type hf_dp has classified for privacy (trl "
                                 f"{trl.__version__}; hf_dp/dpo/config.py LOSS_TYPES), so it is not allowed with DP")
            if rule.status == REFUSED:
                raise ValueError(rule.reason)
        kind = str(getattr(args.f_divergence_type, "value", args.f_divergence_type))
        if kind not in F_DIVERGENCES:
            raise ValueError(f"--f_divergence_type {kind} is not one of TRL's f-divergences ({', '.join(F_DIVERGENCES)}), "
                             "so the first step would stop the run: choose one of them")
    enforce_config(args, registry, config_cls, f"a {what}", "hf_dp/dpo/config.py")


def enforce_dpo(args) -> None:
    refuse_token_weighting(args, "a DPO pair's loss is TRL's per-pair formula")
    enforce(args, DPO_FLAGS, DPOConfig, "DPOConfig")


def enforce_reward(args) -> None:
    refuse_token_weighting(args, "a reward pair's loss is one margin per pair")
    enforce(args, REWARD_FLAGS, RewardConfig, "RewardConfig")


@dataclass
class DPDPOConfig(DPTrainingArguments, DPOConfig):
    """``DPOConfig`` + ``DPTrainingArguments`` (see the module docstring)."""

    def __post_init__(self):
        if not self.disable_dp:
            enforce_dpo(self)
        super().__post_init__()


@dataclass
class DPRewardConfig(DPTrainingArguments, RewardConfig):
    """``RewardConfig`` + ``DPTrainingArguments`` (see the module docstring)."""

    def __post_init__(self):
        if not self.disable_dp:
            enforce_reward(self)
        super().__post_init__()


def _rows(registry: dict, names: list[str], title: str) -> list[str]:
    lines = [f"| `{title}` flag | under DP | why |", "| --- | --- | --- |"]
    for name in names:
        rules = registry.get(name, ())
        for i, r in enumerate(rules):
            status = STATUS_TEXT[r.status] + (f" when {r.when}" if r.when else (" otherwise" if i else ""))
            lines.append(f"| `{name}` | {status} | {r.reason.replace('|', chr(92) + '|')} |")
    return lines


def markdown() -> str:
    """The three tables of docs/dpo.md: TRL's DPO loss types, DPOConfig's flags, RewardConfig's flags."""
    lines = ["| `loss_type` | under DP | why |", "| --- | --- | --- |"]
    lines += [f"| `{k}` | {STATUS_TEXT[r.status]} | {r.reason} |" for k, r in LOSS_TYPES.items()]
    lines += [""] + _rows(DPO_FLAGS, new_fields(DPOConfig), "DPOConfig")
    lines += [""] + _rows(REWARD_FLAGS, new_fields(RewardConfig), "RewardConfig")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":  # python -m hf_dp.dpo.config --markdown
    if sys.argv[1:] != ["--markdown"]:
        sys.exit("usage: python -m hf_dp.dpo.config --markdown")
    sys.stdout.write(markdown())
