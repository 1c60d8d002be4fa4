"""What model code tells the clipping engines about the layers it calls (read by :mod:`hf_dp.clipping.linear`).

:func:`single_query_heads`: the linear layers called inside the block feed single-query attention (the
first-token-only last block, :mod:`hf_dp.models.first_token`), so ghost clipping may use its factorised norms and
sums. Only a hint: ghost clipping checks it and otherwise takes its generic path.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

__all__ = ["single_query_heads", "single_query_head_size"]

_hints = threading.local()


@contextmanager
def single_query_heads(head_size: int):
    """Linear layers called inside this block feed single-query attention with heads of ``head_size``
    outputs (their output gradient is rank one across positions per example and head); ghost clipping
    then uses the factorised norms and sums (see :mod:`hf_dp.clipping.linear`). Only a hint: it is checked."""
    old = getattr(_hints, "head_size", None)
    _hints.head_size = int(head_size)
    try:
        yield
    finally:
        _hints.head_size = old


def single_query_head_size() -> int | None:
    """The head size declared by the innermost :func:`single_query_heads` of this thread, or ``None``."""
    return getattr(_hints, "head_size", None)
