"""Poisson sampling, exactly as the accountant assumes.

Every logical step, each example is included independently with probability q (so the logical
batch size is Binomial(N, q), mean B = qN, and may be empty). With several processes (W ranks), every rank
draws the **same** Poisson sample of the whole dataset — the same stream, keyed without the rank: ``--dp_seed``'s,
or a key of 256 bits of OS entropy that rank 0 draws at every ``train()`` and broadcasts in memory
(``shared_key``, :func:`hf_dp.privacy.randomness.shared_entropy_key`) — and takes its share of it
(:func:`balanced_shares`): the drawn examples dealt out in turn (with privacy units, each unit whole to the rank with
the fewest rows so far), so the ranks' sizes differ by at most one example (with units, by at most the largest unit's rows) and the slowest rank no longer
sets the pace of a step by a Poisson fluctuation (with per-rank draws it processed about B/W + 0.56·√(B/W) examples
for two ranks, + 1.4·√(B/W) for eight). The shares are disjoint and their union is the one draw, so each example
enters a step at most once, with probability q, as the accountant assumes — provided every rank draws alike: the
shares are cut from the draw in index order (never after a length order, which a rank's data transform could
change), and at every ``train()`` the ranks compare a digest of everything else that decides the draw (N, units,
q, steps, ledger step, stream tag, key: :meth:`PoissonBatchSampler.draw_digest`,
:func:`hf_dp.run.contract.check_ranks_share_draw`) and refuse to train if it differs. Under ``--secure_rng`` (the OS CSPRNG
draws every example's coin, which no rank can share without a collective per step) rank r samples its shard
``r, r+W, r+2W, …`` at the same rate q instead: the union over ranks is again one Poisson sample at rate q. The
ranks' draws are split into ``micro_batches`` physical
batches (the Trainer's gradient-accumulation steps), so the Trainer always sees the same number of
micro-batches per step; their sizes fluctuate around ``per_device_train_batch_size``. With ``lengths``
(``--train_sampling_strategy group_by_length``) each rank's draw (its share) is ordered by length before it is cut, so each
micro-batch pads to a length near its own rows' (less padding, less compute); which examples are drawn, and so
the clipped sum, the noise and the accountant's q, are unchanged — the cut only decides which micro-batch computes
which example's clipped gradient.

**Privacy units** (``units=``, ``--privacy_unit_column``): the draw is over units — groups of rows (a user's
messages, a document's blocks) — each included independently with probability q; every row of a drawn unit enters
that logical batch (or, with ``max_rows_per_unit=k``, a uniform random subset of k of its rows drawn afresh from the
same stream), and all of a unit's rows go to the same micro-batch of the same rank, so that the clipping engine can
clip the unit's summed gradient. Ranks share out units, not rows. ``num_samples`` is then the number of units (the
accountant's N).

Randomness (:mod:`hf_dp.privacy.randomness`): every iteration (one epoch of HF's loop) draws from a
new stream — OS entropy by default (with several ranks: keyed by their shared key of this ``train()`` and the ledger
step at which the iteration starts), the OS CSPRNG with ``secure=True``, or, with a fixed ``seed``,
a stream keyed by (seed, the ledger's stream tag when set, the ledger step at which the iteration starts) — with
several ranks sharing the draw, exactly the stream one process would draw from. The
tag is ``None`` for a fresh run and a clean continuation of a checkpoint, and a new id for a resume from which other
steps were already computed (:func:`hf_dp.run.spent.reconcile_resumed_ledger`) or for a ``train()`` that continues
a ledger without resuming (:func:`hf_dp.run.lineage.before_train`). So the draws of a second
``train()``, of a resumed run (with or without HF's data skip), of two resumes from checkpoints of one run and of a
new epoch are never those of an earlier step: nothing is replayed, and no seed or key is saved anywhere.

**Cyclic Poisson sampling** (``bands=b`` > 1, ``partitions=``: ``--noise_mechanism banded_sqrt``,
:mod:`hf_dp.privacy.banded`): every unit belongs to one partition 0..b−1, a fixed public function of its own identity
(:mod:`hf_dp.privacy.cyclic`); the logical batch of the run's step t (``phase()``, read when that batch is drawn: the
ledger's own steps, so a resume, HF's data skip and an epoch stop keep every batch on its step) takes only the units
of partition t mod b, each with probability p = b·q (:func:`hf_dp.privacy.banded.cyclic_rate`). The uniforms are drawn
for the whole population as above (the stream is unchanged) and a unit of another partition is left out; everything
else (shared draw, shares, micro-batches, row caps, secure mode, lengths) is unchanged. ``drawn_for`` records the step
the last batch was drawn for: the privatizer refuses to noise a batch drawn for another step. With b = 1 the draw is the
plain Poisson draw, bit for bit.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

import torch
from torch.utils.data import Sampler

from .banded import cyclic_rate
from .randomness import csprng_uniform, source_name, stream_generator


class DrawnIndices(list):
    """One micro-batch's indices as :class:`PoissonBatchSampler` yields them: a list with public metadata — ``draw``
    (the sampler's serial number of this micro-batch: 1, 2, ...), ``logical`` (the serial of the logical draw, i.e.
    the optimizer step, it belongs to: 1, 2, ...), ``micro`` (its position 0..m−1 in that logical draw) and ``drawn``
    (the indices as drawn, a tuple). The training loader's dataset (:class:`hf_dp.run.draws.DrawStamped`) stamps every
    row it reads for such a list, and the training collator checks that the rows it is given are exactly that draw's
    (:data:`hf_dp.run.draws.ROW_DRAW_KEY`). Slicing or concatenating gives a plain list (no stamp); it pickles (to
    loader workers) with its metadata."""

    def __init__(self, indices=(), draw: int = 0, logical: int = 0, micro: int = 0):
        super().__init__(indices)
        self.draw, self.logical, self.micro = int(draw), int(logical), int(micro)
        self.drawn = tuple(self)

    def __reduce__(self):
        return (DrawnIndices, (list(self.drawn), self.draw, self.logical, self.micro))

    def intact(self) -> bool:
        """The list still holds exactly the indices drawn (no wrapper padded, cut or changed it in place)."""
        return tuple(self) == self.drawn


class PoissonBatchSampler(Sampler):
    """Yields ``steps_per_epoch × micro_batches`` lists of indices per iteration, each a :class:`DrawnIndices` (its
    serial number, its logical draw and its position in it: the training loader's draw stamps).

    ``position``: a callable giving the number of noisy steps taken so far (the ledger's); it keys a
    seeded stream (default: the number of logical batches this sampler has drawn).
    ``stream_tag``: a callable giving the tag keying a seeded stream with the position (``None``: none; the trainer's
    gives the ledger's ``meta["stream_tag"]``, see :attr:`hf_dp.privacy.privatizer.PrivateOptimizer.stream_tag`).
    ``lengths``: optional ``[num_samples]`` token counts; when set, each draw is sorted by them (stable) before it is
    cut into micro-batches. It changes no draw: the same stream yields the same set of indices with or without it.
    ``shared_key``: with ``world_size > 1``, no ``seed`` and not ``secure``, a callable giving the key (an int of 256
    random bits) every rank holds for the current ``train()``; iterating without one is refused (each rank would draw
    its own sample of the whole dataset, and an example could enter one step on two ranks).
    ``bands``, ``partitions`` (``[num_samples]``, values 0..bands−1) and ``phase`` (a callable giving the run's step the
    next logical batch is for; default: the logical batches this sampler has drawn): cyclic Poisson sampling (see the
    module docstring).
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        steps_per_epoch: int,
        micro_batches: int = 1,
        seed: int | None = None,
        rank: int = 0,
        world_size: int = 1,
        secure: bool = False,
        position: Callable[[], int] | None = None,
        lengths: Sequence[int] | torch.Tensor | None = None,
        units: Sequence[Sequence[int]] | None = None,
        max_rows_per_unit: int | None = None,
        allow_empty_units: bool = False,
        stream_tag: Callable[[], str | None] | None = None,
        shared_key: Callable[[], int | None] | None = None,
        bands: int = 1,
        partitions: Sequence[int] | torch.Tensor | None = None,
        phase: Callable[[], int] | None = None,
    ):
        if num_samples <= 0:
            raise ValueError("the training dataset is empty")
        if not 0 < sample_rate <= 1:
            raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}")
        if steps_per_epoch <= 0 or micro_batches <= 0:
            raise ValueError("steps_per_epoch and micro_batches must be positive")
        if units is not None and len(units) != int(num_samples):
            raise ValueError(f"{len(units)} units given for num_samples={num_samples} (the number of units)")
        if units is not None and not allow_empty_units and any(len(u) == 0 for u in units):
            raise ValueError("every privacy unit needs at least one row")  # (empty units: --audit_canaries' excluded canaries)
        if max_rows_per_unit is not None and max_rows_per_unit < 1:
            raise ValueError(f"max_rows_per_unit must be >= 1, got {max_rows_per_unit}")
        #: rows of each unit (``None``: unit i is row i)
        self.units = None if units is None else [torch.as_tensor(list(u), dtype=torch.long) for u in units]
        self.max_rows_per_unit = None if max_rows_per_unit is None else int(max_rows_per_unit)
        self.num_rows = int(num_samples) if units is None else int(sum(len(u) for u in self.units))
        self.num_samples = int(num_samples)
        self.sample_rate = float(sample_rate)
        self.steps_per_epoch = int(steps_per_epoch)
        self.micro_batches = int(micro_batches)
        self.source = source_name(seed, secure)
        self._seed = None if seed is None else int(seed)
        self._secure = bool(secure)
        self.rank, self.world_size = int(rank), int(world_size)
        self._drawn = 0  # logical batches drawn by this object (the default position)
        self._position = position if position is not None else (lambda: self._drawn)
        self._stream_tag = stream_tag if stream_tag is not None else (lambda: None)
        self._shared_key = shared_key if shared_key is not None else (lambda: None)
        self.epoch = 0
        self.lengths = lengths
        self.bands = int(bands)
        self.draw_rate = cyclic_rate(self.sample_rate, self.bands)  # p = b·q (q for b = 1); refused above 1
        if self.bands > 1:
            if partitions is None:
                raise ValueError("cyclic Poisson sampling (bands > 1) needs each unit's partition")
            parts = torch.as_tensor(partitions, dtype=torch.long).reshape(-1)
            if parts.numel() != self.num_samples or (parts.numel() and (int(parts.min()) < 0 or int(parts.max()) >= self.bands)):
                raise ValueError(f"partitions must give each of the {self.num_samples} units a value in 0..{self.bands - 1}")
            self.partitions = parts
        else:
            self.partitions = None
        self._phase = phase if phase is not None else (lambda: self._drawn)
        #: the run's step the last logical batch was drawn for (cyclic Poisson sampling; ``None`` before any)
        self.drawn_for: int | None = None
        #: micro-batches yielded so far by this sampler (every epoch): each one's ``DrawnIndices.draw``, so that a batch
        #: not drawn here, or drawn here and trained on twice, is refused (hf_dp.run.step.check_drawn_by)
        self.yielded = 0
        #: logical draws (steps' worth of micro-batches) yielded so far: each micro-batch's ``DrawnIndices.logical``
        self.logical = 0

    @property
    def lengths(self) -> torch.Tensor | None:
        return self._lengths

    @lengths.setter
    def lengths(self, lengths: Sequence[int] | torch.Tensor | None) -> None:
        if lengths is None:
            self._lengths = None
            return
        t = torch.as_tensor(lengths).reshape(-1)
        if t.numel() != self.num_rows:
            raise ValueError(f"lengths has {t.numel()} entries for a dataset of {self.num_rows} examples")
        t = t.to(torch.long)
        if self.units is not None:  # a unit's length: its longest row (its rows share a micro-batch)
            t = torch.stack([t[u].max() if len(u) else torch.zeros((), dtype=torch.long) for u in self.units])
        self._lengths = t

    @staticmethod
    def steps_for_epoch(sample_rate: float) -> int:
        """Logical steps per epoch: round(1/q), i.e. N/B (one expected pass over the data)."""
        return max(1, int(round(1.0 / sample_rate)))

    def set_epoch(self, epoch: int) -> None:
        """HF calls this every epoch; the draws do not depend on it (each iteration is a new stream)."""
        self.epoch = int(epoch)

    @staticmethod
    def group_rows(values: Sequence) -> list[list[int]]:
        """The rows of each unit, from each row's unit value (units in order of first appearance)."""
        index: dict = {}
        out: list[list[int]] = []
        for row, v in enumerate(values):
            j = index.get(v)
            if j is None:
                index[v] = j = len(out)
                out.append([])
            out[j].append(row)
        return out

    def __len__(self) -> int:
        return self.steps_per_epoch * self.micro_batches

    @property
    def shared(self) -> bool:
        """Every rank draws the one sample of the whole dataset and takes its share (see the module docstring)."""
        return self.world_size > 1 and not self._secure

    def _generator(self):
        """This iteration's stream (``None`` under ``secure``): keyed by (seed or the ranks' shared key, "poisson",
        the stream tag when set, the rank, the position) — the rank 0 on every rank that shares the draw, so that with
        a seed the ranks' shares are exactly one process's draw."""
        if self._secure:
            return None
        seed = self._seed
        if self.shared and seed is None:
            seed = self._shared_key()
            if seed is None:
                raise RuntimeError(
                    "a Poisson sampler over several ranks without --dp_seed needs the ranks' shared key of this train() "
                    "(hf_dp.privacy.randomness.shared_entropy_key); without it each rank would draw its own sample")
        tag = self._stream_tag()
        key = ("poisson",) + (() if tag is None else (tag,)) + (0 if self.shared else self.rank, int(self._position()))
        return stream_generator(seed, *key)

    def __iter__(self):
        population = torch.arange(self.num_samples) if self.shared else torch.arange(self.rank, self.num_samples, self.world_size)
        gen = self._generator()
        part_of = None if self.partitions is None else self.partitions[population]
        for _ in range(self.steps_per_epoch):
            u = csprng_uniform(len(population)) if self._secure else torch.rand(len(population), generator=gen, dtype=torch.float64)
            if part_of is None:
                drawn = population[u < self.sample_rate]  # in index order
            else:  # cyclic Poisson: the partition of the step this batch is for, each of its units at p = b·q
                step = int(self._phase())
                self.drawn_for = step
                drawn = population[(u < self.draw_rate) & (part_of == step % self.bands)]
            self._drawn += 1
            # the share (several ranks) is cut from the draw in index order and only then ordered by length, so that
            # it depends on the stream, N and the units alone (a rank whose lengths differ changes only its own order)
            if self.units is None:
                if self.shared:  # dealt out in turn (balanced_shares of equal sizes): this rank's share
                    drawn = drawn[self.rank :: self.world_size]
                if self._lengths is not None:  # order only: the set drawn (and so the clipped sum) is the same
                    drawn = drawn[torch.argsort(self._lengths[drawn], stable=True)]
                # split into `micro_batches` contiguous chunks of near-equal size (some may be empty)
                bounds = [math.floor(i * len(drawn) / self.micro_batches) for i in range(self.micro_batches + 1)]
                self.logical += 1
                for micro, (a, b) in enumerate(zip(bounds[:-1], bounds[1:])):
                    self.yielded += 1
                    yield DrawnIndices(drawn[a:b].tolist(), self.yielded, self.logical, micro)
                continue
            rows = [self._rows_of(int(j), gen) for j in drawn]  # every drawn unit's, in index order: the stream is shared
            if self.shared:
                mine = balanced_shares([len(r) for r in rows], self.world_size)[self.rank]
                drawn, rows = drawn[mine], [rows[i] for i in mine]
            if self._lengths is not None:  # order only (a unit's length: its longest row)
                order = torch.argsort(self._lengths[drawn], stable=True).tolist()
                rows = [rows[i] for i in order]
            # whole units per micro-batch, cut where the running row count crosses each equal share of the rows
            sizes = torch.tensor([0] + [len(r) for r in rows], dtype=torch.float64).cumsum(0)
            total = float(sizes[-1])
            cuts = [0] + [int(torch.searchsorted(sizes, i * total / self.micro_batches, right=False)) for i in range(1, self.micro_batches)] + [len(rows)]
            cuts = [min(max(c, 0), len(rows)) for c in cuts]
            for i in range(1, len(cuts)):
                cuts[i] = max(cuts[i], cuts[i - 1])
            self.logical += 1
            for micro, (a, b) in enumerate(zip(cuts[:-1], cuts[1:])):
                self.yielded += 1
                yield DrawnIndices([r for unit_rows in rows[a:b] for r in unit_rows], self.yielded, self.logical, micro)

    def draw_digest(self, *extra) -> str:
        """SHA-256 of everything besides the key, tag and position that decides which examples this sampler's stream
        draws and how a shared draw is dealt out (N, the rows, q, steps, micro-batches, world size, the units and
        their row cap, the source, a SHA-256 of the seed, cyclic Poisson's b and partitions), with ``extra``: ranks
        that share a draw must agree on it (:func:`hf_dp.run.contract.check_ranks_share_draw`). Lengths are not in it:
        they only order a rank's share."""
        import hashlib

        seed = None if self._seed is None else hashlib.sha256(str(self._seed).encode()).hexdigest()
        h = hashlib.sha256(repr((self.num_samples, self.num_rows, self.sample_rate, self.steps_per_epoch, self.micro_batches,
                                 self.world_size, self.max_rows_per_unit, self._secure, seed, extra)).encode())
        if self.partitions is not None:  # cyclic Poisson: b and every unit's partition
            h.update(f"bands={self.bands}|".encode() + self.partitions.numpy().tobytes())
        for rows in self.units or ():
            h.update(rows.numpy().tobytes() + b"|")
        return h.hexdigest()

    def _rows_of(self, unit: int, gen) -> list[int]:
        """The rows of a drawn unit that enter this step: all, or a uniform random subset of ``max_rows_per_unit``
        (from the sampler's own stream), in their dataset order."""
        rows = self.units[unit]
        k = self.max_rows_per_unit
        if k is None or len(rows) <= k:
            return rows.tolist()
        keys = csprng_uniform(len(rows)) if self._secure else torch.rand(len(rows), generator=gen, dtype=torch.float64)
        keep = torch.argsort(keys)[:k].sort().values
        return rows[keep].tolist()

    def partitions_digest(self) -> str | None:
        """SHA-256 of cyclic Poisson sampling's b and partitions (``None`` without them): :func:`hf_dp.privacy.cyclic.partitions_digest`."""
        from .cyclic import partitions_digest

        return partitions_digest(self.partitions, self.bands)

    def state_dict(self) -> dict:
        """What a checkpoint needs to refuse a different dataset size or rate (and, under cyclic Poisson sampling,
        other partitions: their public digest) — no seed, no generator state."""
        state = {"sample_rate": self.sample_rate, "num_samples": self.num_samples}
        if self.partitions is not None:
            state["partitions_sha256"] = self.partitions_digest()
        return state

    def load_state_dict(self, state: dict) -> None:
        if state.get("num_samples") != self.num_samples or not math.isclose(state.get("sample_rate", -1), self.sample_rate):
            raise ValueError(
                "refusing to resume: the checkpoint's sampler had "
                f"N={state.get('num_samples')}, q={state.get('sample_rate')}, now N={self.num_samples}, q={self.sample_rate}"
            )
        if state.get("partitions_sha256") != self.partitions_digest():
            raise ValueError(
                "refusing to resume: the cyclic Poisson partitions (--noise_bands) of this training set differ from the "
                "checkpoint's (the rows' stored content or order changed, the bands did, or an hf_dp before the partition hash "
                "of cyclic-partitions-v2 wrote the checkpoint): a unit in another "
                "partition could enter two steps less than b apart, which the accountant's ceil(T/b) rounds do not count"
            )


def balanced_shares(sizes: Sequence[int], world_size: int) -> list[list[int]]:
    """The positions 0..len(sizes)−1 of one draw dealt out to ``world_size`` ranks, each list in increasing order —
    disjoint, and together every position once. Equal sizes (rows): dealt in turn, position i to rank i mod W, so
    the shares differ by at most one. Otherwise (units of ``sizes[i]`` rows): the largest first (ties: the earlier
    position), each to the rank with the fewest rows so far (ties: the lower rank), so the ranks' rows differ by at
    most the largest unit. A function of the sizes alone: every rank computes the same shares."""
    world_size = int(world_size)
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    shares: list[list[int]] = [[] for _ in range(world_size)]
    if len(set(sizes)) <= 1:
        for i in range(len(sizes)):
            shares[i % world_size].append(i)
        return shares
    load = [0] * world_size
    for i in sorted(range(len(sizes)), key=lambda i: (-int(sizes[i]), i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        shares[r].append(i)
        load[r] += int(sizes[i])
    return [sorted(share) for share in shares]
