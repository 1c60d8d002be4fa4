"""One-pass ghost clipping under FSDP2 (``--fsdp full_shard``, ``--clipping ghost``, the default under FSDP).

The single backward is HF's own (no second backward, so FSDP gathers every layer once for the forward and once for
the backward, as without DP). Each rank records, for its own examples, every trainable layer's input and output
gradient (full-size: only the parameters are sharded; the layer types' own recording, :mod:`hf_dp.clipping.registry`
— a linear or embedding layer computes no weight gradient at all). After the backward:

1. the per-example squared norms over **all** layers of the whole model, ‖v_i‖² = Σ_layers ‖v_i^(l)‖², each rank for
   its own examples (:meth:`hf_dp.clipping.ghost.GhostClipper._collect`, the same code as one pass without FSDP, incl.
   privacy units and non-finite examples) — complete before any clipped sum is formed;
2. c_i = min(1, C/(‖v_i‖(1 + 1e-5) + 1e-6)) (:func:`hf_dp.clipping.ghost.clip_factors`);
3. layer by layer, the clipped sum Σ_i c_i v_i^(l) (full-size, this rank's examples), packed into buckets of about
   :data:`BUCKET_BYTES` and summed over ranks (a plain SUM) into each parameter's shard, laid out as FSDP2 shards it
   (``Shard(0)``, ``torch.chunk`` rows: rank r holds rows [r·⌈n/W⌉, (r+1)·⌈n/W⌉)): a **reduce-scatter** as FSDP2's
   (NCCL and other backends), or on gloo an all-reduce of which each rank keeps its rows (gloo's reduce-scatter
   measured slower than an all-reduce of twice the bytes). Each bucket's collective is asynchronous, sent while the
   next bucket's sums are computed; at most two buckets are in flight, and a full-size sum lives only until its
   bucket is sent.

Each rank ends with its shard of Σ_ranks Σ_i c_i v_i — the privatizer then adds N(0, σ²C²) on its own shard
(:meth:`hf_dp.privacy.privatizer.PrivateOptimizer._add_shard_noise`), exactly as after two passes. The backward
computes no parameter gradient at all (the linear and embedding layers' own autograd functions, the normalisation
layers' forward with detached parameters), so FSDP2 has nothing to reduce-scatter and runs no collective of its own
after the backward (``tests/test_fsdp.py`` counts none); whatever autograd might still leave in ``.grad`` is dropped
(``p.grad = None``) after each micro-batch. An empty micro-batch's
placeholder row has zero output gradients (its loss enters the backward multiplied by 0), so it contributes exactly 0;
its rank still joins every collective, which keeps the ranks in step.

Memory: as one pass without FSDP, every layer's input and output gradient stay alive until the end of the backward
(``--clipping ghost_two_pass`` keeps none: choose it when those records do not fit; it runs a second backward and
gathers every layer once more). The parameters, the privatized gradients and the optimizer state stay sharded.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .engines import GhostEngine
from .ghost import _no_autocast, clip_factors

__all__ = ["ShardedGhostEngine", "BUCKET_BYTES", "reduce_scatter_to_shards"]

#: the size at which a bucket of full-size clipped sums is sent (bytes; each bucket's collective runs while the next
#: bucket's sums are computed)
BUCKET_BYTES = 8 * 2**20


def _shard_layout(p, world: int) -> tuple[int, int, int]:
    """(rows of the full parameter, rows per rank ⌈n/W⌉, elements per row) of an FSDP2 parameter sharded on dim 0;
    ``RuntimeError`` for any other placement (FSDP2's ``shard_placement_fn`` is not used by Accelerate)."""
    from torch.distributed.tensor import DTensor, Shard

    if not isinstance(p, DTensor) or len(p.placements) != 1 or p.placements[0] != Shard(0):
        raise RuntimeError("one-pass ghost clipping under FSDP needs every trainable parameter sharded by fully_shard on "
                           "its first dimension (a DTensor with placement Shard(0)); use --clipping ghost_two_pass")
    n = int(p.shape[0]) if p.dim() else 1
    per_row = math.prod(p.shape[1:]) if p.dim() else 1
    return n, -(-n // world), per_row


def _method(group) -> str:
    """``all_reduce`` on gloo (its ``reduce_scatter_tensor`` measured slower than an all-reduce of twice the bytes,
    torch 2.13, 2 CPU processes), else ``reduce_scatter`` (half the bytes of an all-reduce, as FSDP2 does)."""
    return "all_reduce" if dist.get_backend(group) == "gloo" else "reduce_scatter"


class _Reducer:
    """Sums full-size local tensors over ranks into their parameters' shards, bucket by bucket, each bucket's
    collective asynchronous (sent while the next bucket's sums are computed); :meth:`finish` waits and returns
    {parameter: DTensor of its layout}. The same sequence of :meth:`add` calls (shapes, dtypes) on every rank."""

    def __init__(self, group=None, bucket_bytes: int = 0, method: str | None = None):
        self.group, self.bucket_bytes = group, bucket_bytes
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.method = method or _method(group)
        self.items: list = []
        self.size = 0
        self.pending: list = []  # (work, buffers, [(parameter, start, numel)]): at most two buckets in flight
        self.out: dict = {}

    def add(self, p, t: torch.Tensor) -> None:
        if self.items and t.dtype != self.items[0][1].dtype:
            self.flush()
        self.items.append((p, t))
        self.size += t.numel() * t.element_size()
        if self.size >= self.bucket_bytes:
            self.flush()

    def flush(self) -> None:
        if not self.items:
            return
        items, self.items, self.size = self.items, [], 0
        world = self.world
        layouts = [_shard_layout(p, world) for p, _ in items]
        dtype, device = items[0][1].dtype, items[0][1].device
        placed = []
        if self.method == "all_reduce":  # the full tensors back to back; each rank then reads its own rows
            buf = torch.cat([t.reshape(-1) for _, t in items])
            offset = 0
            for (p, t), (n, chunk, per_row) in zip(items, layouts):
                lo, hi = min(self.rank * chunk, n), min((self.rank + 1) * chunk, n)
                placed.append((p, offset + lo * per_row, (hi - lo) * per_row))  # this rank's rows of the full tensor
                offset += t.numel()
            work = dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=self.group, async_op=True)
        else:  # rank r's rows of every tensor in row r of the send buffer (zero-padded to ⌈n/W⌉ rows), as FSDP2 packs
            width = sum(chunk * per_row for _, chunk, per_row in layouts)
            send = torch.zeros(world, width, dtype=dtype, device=device)
            offset = 0
            for (p, t), (n, chunk, per_row) in zip(items, layouts):
                flat = t.reshape(n, per_row)
                for r in range(world):
                    lo, hi = min(r * chunk, n), min((r + 1) * chunk, n)
                    if hi > lo:
                        send[r, offset : offset + (hi - lo) * per_row].copy_(flat[lo:hi].reshape(-1))
                lo, hi = min(self.rank * chunk, n), min((self.rank + 1) * chunk, n)
                placed.append((p, offset, (hi - lo) * per_row))  # this rank's rows: its row of the send buffer
                offset += chunk * per_row
            buf = torch.empty(width, dtype=dtype, device=device)
            work = dist.reduce_scatter_tensor(buf, send.view(-1), op=dist.ReduceOp.SUM, group=self.group, async_op=True)
            buf = (buf, send)  # the send buffer lives until the collective is done
        del items
        self.pending.append((work, buf, placed))
        while len(self.pending) > 2:  # a bounded number of full-size buckets alive at once
            self._complete(self.pending.pop(0))

    def _complete(self, entry) -> None:
        from torch.distributed.tensor import DTensor

        work, buf, placed = entry
        work.wait()
        full = not isinstance(buf, tuple)  # all_reduce: copy this rank's rows out, so that the full buffer is freed
        buf = buf if full else buf[0]
        for p, start, numel in placed:
            local = buf[start : start + numel].view(p.to_local().shape)
            self.out[p] = DTensor.from_local(local.clone() if full else local, p.device_mesh, p.placements,
                                             run_check=False, shape=p.shape, stride=p.stride())

    def finish(self) -> dict:
        self.flush()
        while self.pending:
            self._complete(self.pending.pop(0))
        out, self.out = self.out, {}
        return out


@torch.no_grad()
def reduce_scatter_to_shards(items: list, group=None, method: str | None = None) -> dict:
    """``items``: [(sharded parameter, full-size local tensor of its shape)], the same list (shapes, dtypes, order) on
    every rank. Returns {parameter: DTensor of the parameter's layout holding Σ_ranks tensor}, each rank its shard
    (``method``: ``reduce_scatter`` or ``all_reduce``; default by backend, :func:`_method`)."""
    reducer = _Reducer(group, bucket_bytes=1 << 62, method=method)
    for p, t in items:
        reducer.add(p, t)
    return reducer.finish()


class ShardedGhostEngine(GhostEngine):
    """``--clipping ghost`` under FSDP2 (see the module docstring); ``--clipping auto`` chooses it there."""

    name = "ghost"
    bucket_bytes = BUCKET_BYTES

    @torch.no_grad()
    def after_backward(self, optimizer, loss_scale: float, rows: int, units: torch.Tensor | None = None) -> None:
        opt = optimizer
        if opt.rule.per_sample_affine(opt.params):  # refused at set-up (sharding.check_args): checked once more here
            raise ValueError("update rules with a per-sample affine map are not supported under FSDP")
        clipper = self.clipper
        try:
            # 1. every layer's per-example squared norms, summed over the whole model, before any clipped sum
            sq, terms = clipper._collect(loss_scale, None, release=True, units=units)
            c = clip_factors(sq, opt.max_grad_norm)
            del sq
            # 2. layer by layer: the clipped sums, in buckets, reduce-scattered into the shards
            reducer = _Reducer(self._group(opt.params), self.bucket_bytes)
            terms.reverse()
            with _no_autocast():
                while terms:
                    for p, v in terms.pop()[1](c).items():
                        reducer.add(p, v)
                sharded = reducer.finish()
        finally:
            clipper.clear()
            for p in opt.params:  # anything autograd still computed (none for the registered layer types)
                p.grad = None
        opt.add_clipped_sum(sharded)

    @staticmethod
    def _group(params):
        """The process group of the parameters' device mesh (FSDP2's one-dimensional mesh)."""
        mesh = getattr(params[0], "device_mesh", None) if params else None
        if mesh is None or mesh.ndim != 1:
            raise RuntimeError("one-pass ghost clipping under FSDP needs FSDP2 parameters on a one-dimensional device mesh; "
                               "use --clipping ghost_two_pass")
        return mesh.get_group()

    def discard(self, optimizer) -> None:
        super().discard(optimizer)
        for p in optimizer.params:
            p.grad = None
