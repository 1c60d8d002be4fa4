"""One preference pair = one example: the rows a pair becomes, and each pair's own loss.

**The rows.** :class:`PairRowsCollator` (DPO) and :class:`RewardPairCollator` (reward models) turn each drawn pair into
two consecutive rows of the micro-batch — its chosen sequence, then its rejected one — right-padded, so that DPTrainer's
loader attributes both rows to the pair that made them (:class:`hf_dp.run.data.EmptySafeCollator`: the rows of one
example are one privacy unit, clipped together; under ``--privacy_unit_column`` the rows of all pairs of one user). A
DPO row holds the prompt and one answer; its ``labels`` are -100 on the prompt and on padding (only completion tokens
are scored, as TRL's ``completion_mask`` does); truncation is TRL's collator's (``max_length``, ``truncation_mode``).

**The loss.** :func:`pair_losses` is TRL's per-pair DPO loss (``trl.DPOTrainer._compute_loss`` of trl 1.16, term by
term) of each pair from the policy's and the reference's summed completion log-probabilities
(:func:`completion_logps`), for the loss types :data:`hf_dp.dpo.config.LOSS_TYPES` allows; it never reads another
pair: no batch mean, no sort, no running statistic. TRL's ``sft`` term (the NLL of the chosen answer, RPO's α-weighted
term) is each pair's own mean over its chosen completion tokens (TRL's divides the batch's summed token losses by the
batch's count). :func:`reward_pair_losses` is TRL's ``RewardTrainer`` loss per pair. :func:`row_losses` puts each
pair's loss on its chosen row (0 on the rejected row): the loss handed to backward is the sum of the pairs' losses,
and the gradient of a pair's loss reaches both of its rows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from hf_dp.models.loss import IGNORE_INDEX, token_cross_entropy


# ---------------------------------------------------------------------------------------------------------- the rows
def _pad(rows: list[list[int]], value: int, width: int) -> torch.Tensor:
    out = torch.full((len(rows), width), value, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _width(rows: list[list[int]], multiple: int | None) -> int:
    width = max([len(r) for r in rows] + [1])
    if multiple:
        width = -(-width // multiple) * multiple
    return width


@dataclass
class PairRowsCollator:
    """Each preference pair (``prompt_ids``, ``chosen_ids``, ``rejected_ids``, as TRL's DPO preparation makes them)
    as two consecutive rows: ``input_ids`` (prompt + answer, truncated as TRL's ``DataCollatorForPreference``
    truncates), ``attention_mask``, ``completion_mask`` (1 on the answer's tokens) and ``labels`` (the answer's tokens,
    -100 elsewhere); right padding (``pad_token_id``, attention 0, completion 0, labels -100)."""

    pad_token_id: int
    max_length: int | None = None
    truncation_mode: str = "keep_start"
    pad_to_multiple_of: int | None = None

    def _cut(self, seq: list) -> list:
        if self.max_length is None:
            return seq
        if self.truncation_mode == "keep_end":
            return seq[-self.max_length:]
        return seq[: self.max_length]

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, comp = [], []
        for ex in examples:
            prompt = list(ex["prompt_ids"])
            for answer in (ex["chosen_ids"], ex["rejected_ids"]):
                ids.append(self._cut(prompt + list(answer)))
                comp.append(self._cut([0] * len(prompt) + [1] * len(answer)))
        width = _width(ids, self.pad_to_multiple_of)
        input_ids = _pad(ids, self.pad_token_id, width)
        attention = _pad([[1] * len(r) for r in ids], 0, width)
        completion = _pad(comp, 0, width)
        labels = input_ids.masked_fill(completion == 0, IGNORE_INDEX)
        return {"input_ids": input_ids, "attention_mask": attention, "completion_mask": completion, "labels": labels}


@dataclass
class RewardPairCollator:
    """Each pair (``chosen_ids``, ``rejected_ids``: the prompt included, as TRL's reward preparation makes them) as two
    consecutive rows, right-padded; ``labels`` carries the pair's ``margin`` on both rows (0 without one)."""

    pad_token_id: int
    pad_to_multiple_of: int | None = None

    def __call__(self, examples: list[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, margins = [], []
        for ex in examples:
            ids += [list(ex["chosen_ids"]), list(ex["rejected_ids"])]
            margins += [float(ex.get("margin", 0.0) or 0.0)] * 2
        width = _width(ids, self.pad_to_multiple_of)
        return {"input_ids": _pad(ids, self.pad_token_id, width),
                "attention_mask": _pad([[1] * len(r) for r in ids], 0, width),
                "labels": torch.tensor(margins, dtype=torch.float32)}


def trl_layout(inputs: dict, keys: tuple[str, ...]) -> dict:
    """A batch of consecutive (chosen, rejected) rows in TRL's layout: every chosen row, then every rejected row."""
    out = {}
    for k in keys:
        v = inputs.get(k)
        if torch.is_tensor(v) and v.dim() >= 1:
            out[k] = torch.cat([v[0::2], v[1::2]], dim=0)
    return out


def row_losses(pair_loss: torch.Tensor) -> torch.Tensor:
    """``[2P]``: each pair's loss on its chosen row, 0 on its rejected row (rows in the collators' order)."""
    return torch.stack([pair_loss, torch.zeros_like(pair_loss)], dim=1).reshape(-1)


# ---------------------------------------------------------------------------------------------- log-probabilities
def per_token_logps(logits: torch.Tensor, labels: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
    """``[R, T-1]``: log p(labels[:, t+1] | tokens ≤ t) where the label is scored, 0 elsewhere (TRL's fused LM head's
    ``log_probs``, from the logits the model returns: hf_dp's clipping engines see the LM head as a module). In float32
    (float64 for a float64 model)."""
    logits = logits if logits.dtype == torch.float64 else logits.float()
    shift = F.pad(labels, (0, 1), value=IGNORE_INDEX)[:, 1:]
    if attention_mask is not None:  # no padding position predicts, no padding target is scored
        real = attention_mask.to(torch.bool)
        shift = shift.masked_fill(real.logical_not() | F.pad(real, (0, 1), value=False)[:, 1:].logical_not(), IGNORE_INDEX)
    R, T = shift.shape
    nll = token_cross_entropy(logits.reshape(R * T, logits.shape[-1]), shift.reshape(-1)).view(R, T)
    return -nll[:, :-1]


@torch.no_grad()
def log_sum_sq_probs(logits: torch.Tensor) -> torch.Tensor:
    """``[R, T-1]``: log Σ_v p_v² at each position (WPO's weights, ``use_weighting``), without autograd."""
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    return torch.logsumexp(2 * logp, dim=-1)


def completion_logps(tok: torch.Tensor, shift_mask: torch.Tensor, ld_alpha: float | None) -> torch.Tensor:
    """``[2P]``: each row's summed completion log-probability (rows: chosen, rejected, chosen, …). With ``ld_alpha``
    (LD-DPO) the tokens beyond the length the pair's two answers share count with weight α — the pair's own lengths."""
    if ld_alpha is None:
        return tok.sum(dim=1)
    pos = shift_mask.cumsum(dim=1)
    lens = shift_mask.sum(dim=1).long()
    shared = torch.minimum(lens[0::2], lens[1::2]).repeat_interleave(2)
    shared_mask = (pos > 0) & (pos <= shared.unsqueeze(1))
    tail = pos > shared.unsqueeze(1)
    return (tok * shared_mask).sum(dim=1) + ld_alpha * (tok * tail).sum(dim=1)


# --------------------------------------------------------------------------------------------------- the pair loss
@dataclass(frozen=True)
class PairLoss:
    """The DPO settings each pair's loss reads (a ``DPOConfig``'s, public constants)."""

    loss_types: tuple[str, ...] = ("sigmoid",)
    loss_weights: tuple[float, ...] = (1.0,)
    beta: float = 0.1
    label_smoothing: float = 0.0
    ld_alpha: float | None = None
    f_divergence_type: str = "reverse_kl"
    f_alpha_divergence_coef: float = 0.5
    discopop_tau: float = 0.05
    use_weighting: bool = False

    @classmethod
    def from_args(cls, args) -> "PairLoss":
        types = [args.loss_type] if isinstance(args.loss_type, str) else list(args.loss_type)
        weights = list(args.loss_weights) if args.loss_weights is not None else [1.0] * len(types)
        return cls(tuple(types), tuple(float(w) for w in weights), float(args.beta), float(args.label_smoothing),
                   args.ld_alpha, str(args.f_divergence_type), float(args.f_alpha_divergence_coef),
                   float(args.discopop_tau), bool(args.use_weighting))

    def scores(self, logratios: torch.Tensor) -> torch.Tensor:
        """The f-divergence's f'(π/π_ref) of each row's log-ratio (f-DPO; reverse KL: the log-ratio itself)."""
        kind = self.f_divergence_type
        if kind == "reverse_kl" or (kind == "alpha_divergence" and abs(self.f_alpha_divergence_coef - 1.0) < 1e-6):
            return logratios
        if kind == "forward_kl":
            return 1 - torch.exp(-logratios)
        if kind == "js_divergence":
            return math.log(2) + F.logsigmoid(logratios)
        if kind == "alpha_divergence":
            coef = 1.0 / (self.f_alpha_divergence_coef - 1.0)
            t = torch.clamp(((self.f_alpha_divergence_coef - 1.0) * logratios).float(), max=80.0)
            return (torch.exp(t) - 1.0).to(logratios.dtype) * coef
        raise ValueError(f"unknown f_divergence_type {kind!r}")


def pair_losses(cfg: PairLoss, policy: torch.Tensor, reference: torch.Tensor, *, completion_mask: torch.Tensor,
                shift_mask: torch.Tensor, tok: torch.Tensor, weights: torch.Tensor | None = None) -> torch.Tensor:
    """``[P]``: each pair's loss, TRL's per-pair formula for every loss type of ``cfg`` (weighted sum). ``policy``,
    ``reference``: ``[2P]`` summed completion log-probabilities per row (chosen, rejected, …); ``completion_mask`` /
    ``shift_mask``: ``[2P, T]`` / ``[2P, T-1]``; ``tok``: the policy's per-token log-probabilities ``[2P, T-1]`` (for
    ``sft``); ``weights``: ``[2P]`` WPO weights (``use_weighting``) or None."""
    chosen_lr = policy[0::2] - reference[0::2]
    rejected_lr = policy[1::2] - reference[1::2]
    chosen_s, rejected_s = cfg.scores(chosen_lr), cfg.scores(rejected_lr)
    delta = chosen_s - rejected_s
    beta, eps = cfg.beta, cfg.label_smoothing
    counts = completion_mask.sum(dim=1).clamp(min=1.0)
    total = 0.0
    for kind, w in zip(cfg.loss_types, cfg.loss_weights, strict=True):
        if kind == "sigmoid":
            loss = -F.logsigmoid(beta * delta)
        elif kind == "hinge":
            loss = torch.relu(1 - beta * delta)
        elif kind in ("ipo", "sigmoid_norm"):  # normalized by the pair's own completion lengths
            norm = chosen_s / counts[0::2] - rejected_s / counts[1::2]
            loss = (norm - 1 / (2 * beta)) ** 2 if kind == "ipo" else -F.logsigmoid(beta * norm)
        elif kind == "exo_pair":
            e = torch.tensor(eps, device=delta.device, dtype=delta.dtype)
            loss = (torch.sigmoid(beta * delta) * (F.logsigmoid(beta * delta) - torch.log1p(-e))
                    + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(e)))
        elif kind == "nca_pair":
            loss = (-F.logsigmoid(beta * chosen_lr) - 0.5 * F.logsigmoid(-beta * chosen_lr)
                    - 0.5 * F.logsigmoid(-beta * rejected_lr))
        elif kind == "robust":
            loss = (-(1 - eps) * F.logsigmoid(beta * delta) + eps * F.logsigmoid(-beta * delta)) / (1 - 2 * eps)
        elif kind == "bco_pair":
            loss = -F.logsigmoid(beta * chosen_lr) - F.logsigmoid(-beta * rejected_lr)
        elif kind == "sppo_hard":
            loss = (chosen_lr - 0.5 / beta) ** 2 + (rejected_lr + 0.5 / beta) ** 2
        elif kind == "apo_zero":
            loss = 1 - torch.sigmoid(beta * chosen_lr) + torch.sigmoid(beta * rejected_lr)
        elif kind == "apo_down":
            loss = torch.sigmoid(beta * chosen_lr) + 1 - torch.sigmoid(beta * (chosen_lr - rejected_lr))
        elif kind == "discopop":
            z = beta * delta
            mod = torch.sigmoid(z / cfg.discopop_tau)
            loss = -F.logsigmoid(z) * (1 - mod) + torch.exp(-z) * mod
        elif kind == "sft":  # the chosen answer's mean NLL over its own scored tokens (TRL: the batch's token mean)
            m = shift_mask[0::2]
            loss = -(tok[0::2] * m).sum(dim=1) / m.sum(dim=1).clamp(min=1)
        else:
            raise ValueError(f"loss type {kind!r} has no per-pair form in hf_dp (hf_dp/dpo/config.py LOSS_TYPES)")
        if weights is not None:
            loss = loss * (weights[0::2] * weights[1::2])
        total = total + w * loss
    return total


@torch.no_grad()
def wpo_weights(tok: torch.Tensor, lssp: torch.Tensor, shift_mask: torch.Tensor) -> torch.Tensor:
    """``[2P]``: WPO's weight of each row, exp(mean over its completion of log p − log Σ p²) — the row's own tokens."""
    aligned = (tok - lssp) * shift_mask
    return torch.exp(aligned.sum(dim=1) / shift_mask.sum(dim=1).clamp_min(1))


def reward_pair_losses(rewards: torch.Tensor, margins: torch.Tensor, center: float | None = None) -> torch.Tensor:
    """``[P]``: −log σ(r_chosen − r_rejected − margin) for each pair (TRL's ``RewardTrainer`` loss), plus
    ``center``·(r_chosen + r_rejected)² (TRL's ``center_rewards_coefficient`` term, per pair rather than the batch's
    mean). ``rewards``, ``margins``: ``[2P]`` per row (chosen, rejected, …)."""
    r = rewards.reshape(-1)
    chosen, rejected = r[0::2], r[1::2]
    loss = -F.logsigmoid(chosen - rejected - margins[0::2].to(r.dtype))
    if center:
        loss = loss + center * (chosen + rejected) ** 2
    return loss
