"""Cyclic Poisson sampling (``--noise_mechanism banded_sqrt --noise_bands b``; hf_dp.privacy.sampler,
hf_dp.privacy.cyclic): each unit joins only the steps of its partition, at rate b·q; partitions are a fixed function
of the unit itself (removing another unit changes none); what cannot be sampled is refused in one sentence."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from datasets import Dataset

from hf_dp.privacy.cyclic import canonical_bytes, partition_of, row_partitions, unit_partitions
from hf_dp.privacy.mechanism import Mechanism
from hf_dp.privacy.sampler import PoissonBatchSampler
from hf_dp.run.setup import cyclic_partitions, setup_units
from hf_dp.run.state import Units

from tests.helpers import dp_args


def _draws(sampler, iterations=1):
    out = []
    for _ in range(iterations):
        out += [list(b) for b in sampler]
    return out


def test_every_unit_joins_only_the_steps_of_its_partition_at_rate_bq():
    n, b, q, steps = 600, 3, 0.1, 300
    parts = unit_partitions([f"user-{i}" for i in range(n)], b)
    assert sorted(set(parts.tolist())) == [0, 1, 2]
    sampler = PoissonBatchSampler(n, q, steps, seed=4, bands=b, partitions=parts)
    draws = _draws(sampler)
    assert len(draws) == steps and sampler.drawn_for == steps - 1
    seen: dict[int, list[int]] = {}
    for t, batch in enumerate(draws):
        assert all(int(parts[i]) == t % b for i in batch), t
        for i in batch:
            seen.setdefault(i, []).append(t)
    assert min(b2 - a for steps_of in seen.values() for a, b2 in zip(steps_of, steps_of[1:])) >= b
    for j in range(b):  # the rate within a partition: b·q, within 5 binomial standard deviations
        opportunities = int((parts == j).sum()) * len(range(j, steps, b))
        hits = sum(len(batch) for t, batch in enumerate(draws) if t % b == j)
        p = b * q
        assert abs(hits / opportunities - p) < 5 * math.sqrt(p * (1 - p) / opportunities), (j, hits / opportunities)
    # the expected batch stays B = qN
    assert abs(sum(map(len, draws)) / steps - q * n) < 5 * math.sqrt(q * n / steps * 3)


def test_one_band_draws_exactly_the_poisson_batches():
    plain = _draws(PoissonBatchSampler(200, 0.05, 40, seed=9))
    one = _draws(PoissonBatchSampler(200, 0.05, 40, seed=9, bands=1, partitions=torch.zeros(200, dtype=torch.long)))
    assert plain == one


def test_the_phase_is_the_step_the_batch_is_drawn_for():
    """The sampler reads the run's step when it draws each logical batch (a resume, HF's data skip or an epoch stop
    never puts a batch on another partition's step): here the phase callable jumps as a ledger would."""
    n, b = 90, 3
    parts = unit_partitions(list(range(n)), b)
    clock = {"step": 7}
    sampler = PoissonBatchSampler(n, 1 / 3, 5, seed=1, bands=b, partitions=parts, phase=lambda: clock["step"])
    it = iter(sampler)
    for t in (7, 8, 8, 11):  # 8 twice: a batch drawn again at the same step (an epoch stop, a data skip)
        clock["step"] = t
        batch = next(it)
        assert batch and all(int(parts[i]) == t % b for i in batch) and sampler.drawn_for == t


def test_partitions_do_not_move_when_another_unit_is_removed():
    rows = {"input_ids": [[101, i % 7, i % 13, 102] for i in range(50)], "label": [i % 2 for i in range(50)],
            "user_id": [f"u{i // 5}" for i in range(50)]}
    full = Dataset.from_dict(rows)
    without = full.select([i for i in range(50) if i != 23])  # one row (unit) removed from the middle
    b = 4
    p_full, p_without = row_partitions(full, b), row_partitions(without, b)
    assert p_without.tolist() == [int(p_full[i]) for i in range(50) if i != 23]
    assert p_full.tolist() != [i % b for i in range(50)]  # a function of the rows, not of their index
    # a row's partition is the hash of its own columns, however the dataset is read
    assert int(p_full[3]) == partition_of(dict(full[3]), b) == partition_of(full.with_format("torch")[3], b)
    # units: the partition of each unit's value; removing a whole unit (u2: rows 10-14) moves no other unit
    units, units_without = Units(), Units()
    setup_units(units, 50, "user_id", full)
    kept = full.select([i for i in range(50) if not 10 <= i < 15])
    setup_units(units_without, 45, "user_id", kept)
    a, c = cyclic_partitions(b, full, "user_id", units), cyclic_partitions(b, kept, "user_id", units_without)
    assert c.tolist() == [int(a[j]) for j in range(10) if j != 2]
    assert a.tolist() == unit_partitions([f"u{j}" for j in range(10)], b).tolist()
    assert cyclic_partitions(1, full, None, Units()) is None


def test_the_canonical_bytes_tell_types_and_structures_apart():
    assert canonical_bytes(1) != canonical_bytes(1.0) != canonical_bytes("1") != canonical_bytes(True)
    assert canonical_bytes([1, [2, 3]]) != canonical_bytes([[1, 2], 3])
    assert canonical_bytes({"a": 1, "b": 2}) == canonical_bytes({"b": 2, "a": 1})
    assert canonical_bytes(torch.tensor([1, 2])) == canonical_bytes([1, 2]) and canonical_bytes(torch.tensor(5)) == canonical_bytes(5)
    with pytest.raises(ValueError, match="cannot hash a training value of type object"):
        canonical_bytes(object())
    with pytest.raises(ValueError, match=r"^cyclic Poisson sampling cannot hash a training value of type Tensor"):
        canonical_bytes(torch.eye(3).to_sparse())


def _element_bytes(value) -> bytes:
    """The canonical bytes through the element-by-element path only (the vectorized one switched off)."""
    import hf_dp.privacy.cyclic as cyclic

    out, fast = [], cyclic._array_bytes
    cyclic._array_bytes = lambda v: None
    try:
        cyclic._encode(value, out)
    finally:
        cyclic._array_bytes = fast
    return b"".join(out)


@pytest.mark.parametrize("value", [
    torch.randn(3, 4), torch.randn(2, 3, 5).half(), torch.randn(7).bfloat16(), torch.tensor(5), torch.tensor(-2.5),
    torch.tensor([True, False, True]), torch.zeros(0), torch.zeros(2, 0, 3), torch.arange(-10, 20),
    torch.tensor([float("nan"), -float("nan"), -0.0, 0.0, float("inf"), -float("inf")]),
    torch.tensor([[1, 2], [3, 255]], dtype=torch.uint8), np.arange(12).reshape(3, 4).astype(np.uint16), np.float32(3.5),
    np.array(7), np.array([1.5, np.nan, 1e300]), np.array([True] * 3), list(range(-5, 30)), [0.1 * i for i in range(20)],
    [2**70] + list(range(20)), [1, 2.0] * 10, {"hf_dp_cached_hidden": torch.randn(9, 16), "labels": 1},
    torch.randn(3, 5).t(), torch.randn(4, dtype=torch.complex128).conj().imag,  # strided; a lazily negated view
    np.ma.array([1.0, 2.0, 3.0], mask=[0, 1, 0]),  # a masked array: its entries as .tolist() gives them (None)
], ids=lambda v: type(v).__name__)
def test_a_tensor_hashes_as_the_list_of_its_elements_at_array_speed(value):
    """Arrays and tensors (a cached frozen-prefix row: thousands of floats) are encoded in one vectorized pass
    (:func:`hf_dp.privacy.cyclic._array_bytes`; the element loop took 7.7 s per 1,000 cached rows of 25 × 384 floats,
    benchmarks/RESULTS.md §13): the bytes are exactly the element loop's, which are the element list's, so a row
    gets the same partition however it is read (a tensor, an array, a list)."""
    fast = canonical_bytes(value)
    assert fast == _element_bytes(value)
    if hasattr(value, "tolist"):
        assert fast == canonical_bytes(value.tolist())
    with_nan = canonical_bytes(torch.tensor([float("nan")]))
    assert with_nan == canonical_bytes([float("-nan")]) and canonical_bytes(-0.0) != canonical_bytes(0.0)


def test_bq_above_one_and_loaders_that_draw_ahead_are_refused(tmp_path):
    parts = torch.zeros(100, dtype=torch.long)
    with pytest.raises(ValueError, match=r"^--noise_bands 3 with q = B/N = 0.4: cyclic Poisson sampling draws each unit"):
        PoissonBatchSampler(100, 0.4, 3, bands=3, partitions=parts)
    with pytest.raises(ValueError, match=r"b\*q = 1.2 > 1; lower --noise_bands \(at most 2\)"):
        Mechanism.plan(n=100, declared=False, per_device_batch=40, accumulation=1, world_size=1, delta=1e-5, epsilon=None,
                       noise_multiplier=1.0, max_grad_norm=1.0, accountant="prv", max_steps=10, num_train_epochs=1,
                       noise_mechanism="banded_sqrt", noise_bands=3)
    with pytest.raises(ValueError, match=r"^--noise_bands 2 with --dataloader_num_workers 2: worker processes draw"):
        dp_args(tmp_path, noise_mechanism="banded_sqrt", noise_bands=2, dataloader_num_workers=2)
    with pytest.raises(ValueError, match=r"^--noise_bands 4 needs --noise_mechanism banded_sqrt"):
        dp_args(tmp_path, noise_bands=4)
    with pytest.raises(ValueError, match=r"^--noise_bands must be a whole number >= 1, got 0"):
        dp_args(tmp_path, noise_mechanism="banded_sqrt", noise_bands=0)
    with pytest.raises(ValueError, match=r"^--noise_mechanism must be one of independent, banded_sqrt"):
        dp_args(tmp_path, noise_mechanism="toeplitz")
    # --audit_canaries with --noise_bands > 1 is accepted (its canaries get partitions: tests/test_audit_banded.py)
    dp_args(tmp_path, noise_mechanism="banded_sqrt", noise_bands=2, audit_canaries=100)


def test_the_privatizer_refuses_a_batch_drawn_for_another_step():
    from hf_dp.optim import make_optimizer

    p = torch.nn.Parameter(torch.zeros(3))
    opt = make_optimizer("dp_sgd", [p], lr=0.0, noise_multiplier=1.0, max_grad_norm=1.0, expected_batch_size=1.0,
                         noise_seed=0, noise_mechanism="banded_sqrt", noise_bands=2)
    opt.sampler = PoissonBatchSampler(10, 0.1, 4, seed=0, bands=2, partitions=torch.zeros(10, dtype=torch.long))
    it = iter(opt.sampler)
    next(it)
    next(it)  # drawn ahead: the batch of step 1 before step 0 is taken
    opt.add_clipped_sum({p: torch.zeros(3)})
    with pytest.raises(RuntimeError, match="the batch of step 0 was drawn for step 1's partition"):
        opt.step()


def test_partitions_read_the_stored_rows_not_a_format_or_a_transform():
    """A 🤗 Dataset read through set_format (a column subset, tensors) or a random set_transform gives each row the
    partition of its stored content: a resume or a later train() that reads it another way finds the same partitions
    (before, a resume through set_format moved 26 of 32 units to other partitions, accepted)."""
    import random

    ds = Dataset.from_dict({"input_ids": [[i, i + 1, 7 * i % 5] for i in range(64)], "labels": [i % 2 for i in range(64)]})
    plain = row_partitions(ds, 4)
    formatted = ds.with_format("torch", columns=["input_ids"])
    noisy = ds.with_transform(lambda b: {"input_ids": [[random.random()] for _ in b["input_ids"]], "labels": b["labels"]})
    assert torch.equal(row_partitions(formatted, 4), plain) and torch.equal(row_partitions(noisy, 4), plain)
    units = Units()
    setup_units(units, 64, None, ds)
    assert torch.equal(cyclic_partitions(4, formatted, None, units), plain)


def test_a_checkpoint_of_other_partitions_is_refused():
    """The sampler's state holds the partitions' public digest; loading it into a sampler whose partitions differ (the
    rows' content or order changed, or b) is refused, as a different N or q is."""
    parts = torch.tensor([i % 2 for i in range(16)])
    a = PoissonBatchSampler(16, 0.25, 4, bands=2, partitions=parts)
    state = a.state_dict()
    assert state["partitions_sha256"] == a.partitions_digest() and len(state["partitions_sha256"]) == 64
    PoissonBatchSampler(16, 0.25, 4, bands=2, partitions=parts.clone()).load_state_dict(state)  # the same: accepted
    with pytest.raises(ValueError, match="cyclic Poisson partitions .* differ from the checkpoint's"):
        PoissonBatchSampler(16, 0.25, 4, bands=2, partitions=parts.flip(0)).load_state_dict(state)
    with pytest.raises(ValueError, match="cyclic Poisson partitions"):
        PoissonBatchSampler(16, 0.25, 4).load_state_dict(state)  # independent noise resuming a banded checkpoint
    assert "partitions_sha256" not in PoissonBatchSampler(16, 0.25, 4).state_dict()  # independent: as before
    # a checkpoint whose digest was written by the earlier partition hash (no scheme in it) is refused, not resumed
    import hashlib

    earlier = {**state, "partitions_sha256": hashlib.sha256(b"bands=2|" + parts.numpy().tobytes()).hexdigest()}
    with pytest.raises(ValueError, match="an hf_dp before the partition hash of cyclic-partitions-v2"):
        PoissonBatchSampler(16, 0.25, 4, bands=2, partitions=parts.clone()).load_state_dict(earlier)
