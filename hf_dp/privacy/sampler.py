"""Poisson sampling, exactly as the accountant assumes.

Every logical step, each example is included independently with probability q (so the logical
batch size is Binomial(N, q), mean B = qN, and may be empty). With several processes, rank r
samples its shard ``r, r+W, r+2W, …`` at the same rate q: the union over ranks is one Poisson
sample of the whole dataset at rate q. The ranks' draws are split into ``micro_batches`` physical
batches (the Trainer's gradient-accumulation steps), so the Trainer always sees the same number of
micro-batches per step; their sizes fluctuate around ``per_device_train_batch_size``.

Randomness: a ``torch.Generator`` per (seed, epoch, rank). The seed defaults to OS entropy (nobody
can predict which examples were drawn); pass ``seed`` for reproducible research runs, knowing that
whoever knows it can recompute the batches. The seed is saved with the optimizer state so that a
resumed run draws exactly the batches the uninterrupted run would have drawn.
"""

from __future__ import annotations

import hashlib
import math
import secrets

import torch
from torch.utils.data import Sampler


def _mix(*parts: int) -> int:
    h = hashlib.sha256(":".join(str(int(p)) for p in parts).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


class PoissonBatchSampler(Sampler):
    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        micro_batches: int = 1,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
    ):
        if num_samples <= 0:
            raise ValueError("the training dataset is empty")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if steps_per_epoch <= 0 or micro_batches <= 0:
            raise ValueError("steps_per_epoch and micro_batches must be positive")
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = int(steps_per_epoch)
        self.micro_batches = int(micro_batches)
        self.seed = int(seed) if seed is not None else secrets.randbits(63)
        self.rank, self.world_size = int(rank), int(world_size)
        self.epoch = 0

    @staticmethod
    def steps_for_epoch(sample_rate: float) -> int:
        """Logical steps per epoch: round(1/q), i.e. N/B (one expected pass over the data)."""
        return max(1, int(round(1.0 / sample_rate)))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch * self.micro_batches

    def __iter__(self):
        gen = torch.Generator()
        gen.manual_seed(_mix(self.seed, self.epoch, self.rank))
        shard = torch.arange(self.rank, self.num_samples, self.world_size)
        for _ in range(self.steps_per_epoch):
            drawn = shard[torch.rand(len(shard), generator=gen) < self.sample_rate]
            # split into `micro_batches` contiguous chunks of near-equal size (some may be empty)
            bounds = [math.floor(i * len(drawn) / self.micro_batches) for i in range(self.micro_batches + 1)]
            for a, b in zip(bounds[:-1], bounds[1:]):
                yield drawn[a:b].tolist()

    def state_dict(self) -> dict:
        return {"seed": self.seed, "epoch": self.epoch, "sample_rate": self.sample_rate, "num_samples": self.num_samples}

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_samples") != self.num_samples or not math.isclose(state.get("sample_rate", -1), self.sample_rate):
            raise ValueError(
                "refusing to resume: the checkpoint's sampler had "
                f"N={state.get('num_samples')}, q={state.get('sample_rate')}, now N={self.num_samples}, q={self.sample_rate}"
            )
        self.seed = int(state["seed"])
        self.epoch = int(state["epoch"])
