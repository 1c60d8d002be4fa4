"""Several ranks draw one Poisson sample of the whole dataset and share it out (hf_dp.privacy.sampler): the ranks'
shares in every step are disjoint, together exactly the draw one process makes from the same key (so each example
enters a step at most once, with probability q), and balanced — rows dealt out in turn (sizes differ by at most one),
units whole to the rank with the fewest rows. Without --dp_seed the ranks need their shared key of the train() (a
sampler without one refuses to draw); under --secure_rng each rank samples its own shard."""

from __future__ import annotations

import random

import pytest
import torch

from hf_dp.privacy.sampler import PoissonBatchSampler, balanced_shares


def _steps(sampler, micro_batches):
    """[step][micro-batch] index lists of one iteration."""
    lists = list(sampler)
    return [lists[t * micro_batches : (t + 1) * micro_batches] for t in range(len(lists) // micro_batches)]


def _ranks(world, **kw):
    return [PoissonBatchSampler(rank=r, world_size=world, **kw) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 8])
@pytest.mark.parametrize("lengths", [False, True], ids=["unordered", "group_by_length"])
def test_ranks_share_one_processes_draw_disjointly_and_evenly(world, lengths):
    n, q, steps, m = 500, 0.1, 12, 2
    lens = torch.randint(1, 100, (n,), generator=torch.Generator().manual_seed(3)) if lengths else None
    kw = dict(num_samples=n, sample_rate=q, steps_per_epoch=steps, micro_batches=m, seed=11, lengths=lens)
    one = _steps(PoissonBatchSampler(**kw), m)
    shares = [_steps(s, m) for s in _ranks(world, **kw)]
    for t in range(steps):
        per_rank = [[i for b in shares[r][t] for i in b] for r in range(world)]
        union = [i for p in per_rank for i in p]
        assert len(union) == len(set(union))  # no example twice in one step
        assert sorted(union) == sorted(i for b in one[t] for i in b)  # exactly one process's draw
        sizes = [len(p) for p in per_rank]
        assert max(sizes) - min(sizes) <= 1, sizes
        for r in range(world):  # micro-batches of one rank: near-equal, as for one process
            assert max(len(b) for b in shares[r][t]) - min(len(b) for b in shares[r][t]) <= 1
            if lengths:  # each rank's share keeps the draw's length order
                assert lens[per_rank[r]].tolist() == sorted(lens[per_rank[r]].tolist())


def test_each_example_is_drawn_at_rate_q_across_ranks():
    n, q, steps = 40, 0.25, 2000
    counts = torch.zeros(n)
    for s in _ranks(2, num_samples=n, sample_rate=q, steps_per_epoch=steps, seed=5):
        for b in s:
            counts[b] += 1
    sd = (steps * q * (1 - q)) ** 0.5
    assert float((counts - steps * q).abs().max()) < 5 * sd, counts


def test_units_stay_whole_on_one_rank_and_the_rows_balance():
    g = random.Random(0)
    units = []
    row = 0
    for _ in range(120):  # users with 1..9 rows
        k = g.randint(1, 9)
        units.append(list(range(row, row + k)))
        row += k
    kw = dict(num_samples=len(units), sample_rate=0.2, steps_per_epoch=10, micro_batches=2, seed=4, units=units,
              max_rows_per_unit=6)
    one = _steps(PoissonBatchSampler(**kw), 2)
    shares = [_steps(s, 2) for s in _ranks(2, **kw)]
    unit_of = {r: u for u, rows in enumerate(units) for r in rows}
    for t in range(10):
        per_rank = [[i for b in shares[r][t] for i in b] for r in range(2)]
        assert sorted(per_rank[0] + per_rank[1]) == sorted(i for b in one[t] for i in b)  # the same rows subsets too
        on = [{unit_of[i] for i in p} for p in per_rank]
        assert not on[0] & on[1]  # a unit's rows on one rank only
        for r in range(2):  # and in one micro-batch
            mb = [{unit_of[i] for i in b} for b in shares[r][t]]
            assert not mb[0] & mb[1]
        assert abs(len(per_rank[0]) - len(per_rank[1])) <= 6  # at most the largest unit's rows apart


def test_balanced_shares_cover_every_position_once():
    g = random.Random(1)
    for _ in range(200):
        sizes = [g.randint(1, 12) for _ in range(g.randint(0, 30))]
        world = g.randint(1, 5)
        shares = balanced_shares(sizes, world)
        assert len(shares) == world and sorted(i for s in shares for i in s) == list(range(len(sizes)))
        assert all(s == sorted(s) for s in shares)
        load = [sum(sizes[i] for i in s) for s in shares]
        assert max(load) - min(load) <= max(sizes, default=0)
        assert balanced_shares(sizes, world) == shares  # every rank computes the same
    assert balanced_shares([1] * 5, 2) == [[0, 2, 4], [1, 3]]


def test_os_entropy_over_ranks_needs_the_shared_key_and_uses_it():
    kw = dict(num_samples=200, sample_rate=0.1, steps_per_epoch=5, world_size=2)
    with pytest.raises(RuntimeError, match="shared key"):
        list(PoissonBatchSampler(rank=0, **kw))
    key = 2**255 + 12345
    shares = [list(PoissonBatchSampler(rank=r, shared_key=lambda: key, **kw)) for r in (0, 1)]
    one = list(PoissonBatchSampler(200, 0.1, 5, seed=key))  # the key keys the stream as a seed would
    assert [sorted(a + b) for a, b in zip(*shares)] == [sorted(b) for b in one]
    other = [list(PoissonBatchSampler(rank=r, shared_key=lambda: key + 1, **kw)) for r in (0, 1)]
    assert other != shares


def test_secure_rng_ranks_sample_their_own_shards():
    kw = dict(num_samples=300, sample_rate=0.2, steps_per_epoch=6, secure=True, world_size=3)
    for r in range(3):
        assert all(i % 3 == r for b in PoissonBatchSampler(rank=r, **kw) for i in b)


@pytest.mark.parametrize("units", [False, True], ids=["rows", "units"])
def test_ranks_whose_lengths_differ_still_share_the_draw_disjointly(units):
    """The share is cut before the length order: a rank whose lengths differ from the others' (a random transform of
    the dataset that the ranks' fingerprint does not see) changes only the order of its own share."""
    n = 300
    unit_rows = [[2 * u, 2 * u + 1] for u in range(n // 2)] if units else None
    kw = dict(num_samples=len(unit_rows) if units else n, sample_rate=0.2, steps_per_epoch=8, micro_batches=2, seed=9,
              units=unit_rows)
    lens = [torch.randint(1, 50, (n,), generator=torch.Generator().manual_seed(r)) for r in (0, 1)]
    ranks = [PoissonBatchSampler(rank=r, world_size=2, lengths=lens[r], **kw) for r in (0, 1)]
    one = _steps(PoissonBatchSampler(**kw), 2)
    shares = [_steps(s, 2) for s in ranks]
    for t in range(8):
        per_rank = [[i for b in shares[r][t] for i in b] for r in (0, 1)]
        assert not set(per_rank[0]) & set(per_rank[1])
        assert sorted(per_rank[0] + per_rank[1]) == sorted(i for b in one[t] for i in b)


def test_draw_digest_changes_with_what_decides_the_draw():
    base = dict(num_samples=40, sample_rate=0.25, steps_per_epoch=4, micro_batches=2, seed=3, world_size=2)
    d = PoissonBatchSampler(**base).draw_digest(5, None, "k")
    assert d == PoissonBatchSampler(**base, rank=1).draw_digest(5, None, "k")  # the rank is not in it
    assert d == PoissonBatchSampler(**base, lengths=list(range(40))).draw_digest(5, None, "k")  # nor the lengths
    for change in (dict(num_samples=41), dict(sample_rate=0.2), dict(micro_batches=1), dict(world_size=3)):
        assert PoissonBatchSampler(**{**base, **change}).draw_digest(5, None, "k") != d, change
    assert PoissonBatchSampler(**base).draw_digest(6, None, "k") != d  # the position
    assert PoissonBatchSampler(**base).draw_digest(5, "tag", "k") != d
    units = [[2 * u, 2 * u + 1] for u in range(20)]
    other = [[0]] + [[2 * u, 2 * u + 1] for u in range(1, 20)] + [[1]]
    u1 = PoissonBatchSampler(**{**base, "num_samples": 20}, units=units).draw_digest()
    assert u1 != PoissonBatchSampler(**{**base, "num_samples": 21}, units=other).draw_digest()
    assert u1 != PoissonBatchSampler(**{**base, "num_samples": 20}, units=units, max_rows_per_unit=1).draw_digest()


def test_ranks_that_would_draw_differently_are_refused(monkeypatch):
    """hf_dp.run.contract.check_ranks_share_draw with a second rank (simulated) whose ledger step differs."""
    import types

    import torch.distributed as dist

    from hf_dp.run import contract

    sampler = PoissonBatchSampler(40, 0.25, 4, seed=3, world_size=2)
    ledger = types.SimpleNamespace(steps=5, own_steps=5, meta={})
    theirs = {"digest": sampler.draw_digest(5, 5, None, None)}
    monkeypatch.setattr(dist, "is_initialized", lambda: True)
    monkeypatch.setattr(dist, "get_world_size", lambda group=None: 2)

    def all_gather_object(out, obj):
        out[0], out[1] = obj, theirs["digest"]

    monkeypatch.setattr(dist, "all_gather_object", all_gather_object)
    contract.check_ranks_share_draw(sampler, ledger, None)  # the same: accepted
    theirs["digest"] = sampler.draw_digest(6, 6, None, None)
    with pytest.raises(ValueError, match="would draw different Poisson samples"):
        contract.check_ranks_share_draw(sampler, ledger, None)
    # the same total steps split otherwise between earlier runs and this one: cyclic Poisson sampling's phase is this
    # run's own steps, so ranks that disagree on it would keep different partitions of one shared draw
    theirs["digest"] = sampler.draw_digest(5, 3, None, None)
    with pytest.raises(ValueError, match="would draw different Poisson samples"):
        contract.check_ranks_share_draw(sampler, ledger, None)
