"""Evaluation metrics of ``recipes/clm.py``: perplexity = exp(eval_loss), as run_clm.py computes it.

``eval_loss`` is transformers' evaluation loss: the model's own mean next-token cross-entropy over the non-padding
tokens of each evaluation batch, averaged over batches weighted by their rows. It is computed on the validation data
(public or held out), not on the private training data, and is not a DP quantity: the card reports it as such.
"""

from __future__ import annotations

import math
from typing import Any


def perplexity(eval_loss: float) -> float:
    """exp(eval_loss); ``inf`` when it overflows (run_clm's convention)."""
    try:
        return math.exp(eval_loss)
    except OverflowError:
        return float("inf")


def with_perplexity(metrics: dict[str, Any], prefix: str = "eval") -> dict[str, Any]:
    """``metrics`` plus ``<prefix>_perplexity`` (the ``eval_`` prefix keeps it among the results the card lists)."""
    out = dict(metrics)
    loss = out.get(f"{prefix}_loss")
    if isinstance(loss, (int, float)):
        out[f"{prefix}_perplexity"] = perplexity(float(loss))
    return out
