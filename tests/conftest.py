"""Shared pytest fixtures."""

import pytest
import torch


@pytest.fixture(scope="module")
def single_thread():
    """Tiny models: one intra-op thread is faster than two and does not oversubscribe CI's cores."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
