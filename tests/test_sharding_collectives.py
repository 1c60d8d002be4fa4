"""The loss-scale check under FSDP (:func:`hf_dp.clipping.sharding.check_loss_scale_agrees`) all-reduces a tensor on
the default group's device: NCCL reduces CUDA tensors only, so a CPU tensor would fail there."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_dp.clipping import sharding


@pytest.mark.parametrize("backend,device", [("nccl", "cuda"), ("gloo", "cpu")])
def test_collective_device_follows_the_backend(monkeypatch, backend, device):
    monkeypatch.setattr(dist, "get_backend", lambda *a, **k: backend)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    assert sharding.collective_device().type == device


def test_loss_scale_check_reduces_on_the_collective_device(monkeypatch):
    seen = []

    class Stop(Exception):
        pass

    def all_reduce(t, op=None):
        seen.append(t.device)
        raise Stop

    monkeypatch.setattr(sharding, "collective_device", lambda: torch.device("meta"))
    monkeypatch.setattr(dist, "all_reduce", all_reduce)
    with pytest.raises(Stop):
        sharding.check_loss_scale_agrees(0.5)
    assert seen == [torch.device("meta")]
