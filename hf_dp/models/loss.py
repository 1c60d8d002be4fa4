"""The per-example loss DPTrainer clips: one loss per example, as ``*ForSequenceClassification`` would compute it."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def per_example_loss(logits: torch.Tensor, labels: torch.Tensor, config) -> torch.Tensor:
    """Per-example loss with the problem type ``*ForSequenceClassification`` would use, in float32 (float64 for a
    float64 model)."""
    if logits.dtype != torch.float64:
        logits = logits.float()
    num_labels = logits.shape[-1]
    problem = getattr(config, "problem_type", None)
    if problem is None:
        if num_labels == 1:
            problem = "regression"
        elif labels.dtype in (torch.long, torch.int):
            problem = "single_label_classification"
        else:
            problem = "multi_label_classification"
    if problem == "regression":
        return F.mse_loss(logits.squeeze(-1), labels.to(logits.dtype).view(-1), reduction="none")
    if problem == "single_label_classification":
        return F.cross_entropy(logits.view(-1, num_labels), labels.view(-1), reduction="none")
    return F.binary_cross_entropy_with_logits(logits, labels.to(logits.dtype), reduction="none").sum(-1)
