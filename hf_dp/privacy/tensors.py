"""Tensor helpers of the privatizer (:mod:`hf_dp.privacy.privatizer`): FSDP2 shards, float64 squared norms, the
bucketed all-reduce of the noisy sums."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _is_sharded(params) -> bool:
    """True when the summed gradients are FSDP2 shards (``DTensor`` with a ``Shard`` placement)."""
    try:
        from torch.distributed.tensor import DTensor, Shard
    except ImportError:  # pragma: no cover - torch without distributed tensors
        return False
    ref = params[0].summed_grad if params else None
    return isinstance(ref, DTensor) and any(isinstance(pl, Shard) for pl in ref.placements)


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of a ``DTensor`` (the same storage), else ``t``."""
    return t.to_local() if hasattr(t, "to_local") else t


def _shard_offset(t) -> int:
    """Offset of this rank's shard in the flattened full tensor (FSDP2 shards dim 0 in rank order)."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    _, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    stride = 1
    flat = 0
    for size, off in zip(reversed(t.shape), reversed(offset)):
        flat += off * stride
        stride *= size
    return int(flat)


def _sq_norms64(g: torch.Tensor) -> torch.Tensor:
    """‖g_i‖² per row of g [B, ...] in float64, converting a slice of the columns at a time (no float64 copy of g)."""
    flat = g.reshape(len(g), -1)
    out = torch.zeros(len(g), dtype=torch.float64, device=g.device)
    step = max(1, (1 << 23) // max(1, len(g)))
    for k in range(0, flat.shape[1], step):
        out += flat[:, k : k + step].double().pow(2).sum(1)
    return out


def all_reduce_grads(params, bucket_bytes: int) -> None:
    """Sum ``p.grad`` over all ranks, in place: tensors of at least ``bucket_bytes`` alone, smaller ones packed."""
    bucket: list = []
    size = 0

    def flush():
        nonlocal bucket, size
        if len(bucket) == 1:
            p = bucket[0]
            if not p.grad.is_contiguous():  # e.g. a transposed (Conv1D) clipped sum
                p.grad = p.grad.contiguous()
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
        elif bucket:
            flat = torch.cat([p.grad.reshape(-1) for p in bucket])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            offset = 0
            for p in bucket:
                n = p.grad.numel()
                p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
                offset += n
        bucket, size = [], 0

    for p in params:
        nbytes = p.grad.numel() * p.grad.element_size()
        if bucket and (size + nbytes > bucket_bytes or p.grad.dtype != bucket[0].grad.dtype):
            flush()
        bucket.append(p)
        size += nbytes
    flush()
