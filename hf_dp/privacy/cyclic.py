"""Cyclic Poisson sampling's partitions: each unit's partition 0..b−1, a fixed public function of the unit itself.

Under ``--noise_mechanism banded_sqrt --noise_bands b`` (:mod:`hf_dp.privacy.banded`) a unit may join only the steps
t with t mod b = its partition (:class:`hf_dp.privacy.sampler.PoissonBatchSampler`). The partition must not depend on
the unit's index in the dataset: under add/remove adjacency removing one unit shifts the indices of the units after
it, and their partitions (and so their participations) would change with it. It is

    int(SHA-256(canonical bytes of the unit's identity)) mod b

where the identity is, under ``--privacy_unit_column``, the unit's column value (:func:`unit_partitions`), and
otherwise the row's own training features, every column of the row as the training set given to the trainer holds
it (:func:`row_partitions`). The bytes (:func:`canonical_bytes`) are a typed, ordered encoding of the value (strings,
numbers, lists, dicts by sorted key, arrays and tensors by their elements), so equal values get equal partitions in
every process. The assignment is computed once, before training; it is public (the amplification theorem holds for any
fixed assignment: a unit placed in any partition is covered, and an attacker who puts every row in one partition only
costs utility: that partition's steps draw them all at rate b·q, the others draw nothing).
"""

from __future__ import annotations

import hashlib
import math
from typing import Iterable

import torch

#: rows read at a time from a 🤗 Dataset (column slices, not one row at a time)
CHUNK_ROWS = 4096


def canonical_bytes(value) -> bytes:
    """A typed, unambiguous byte encoding of ``value``: ``None``, bools, integers (numpy and 0-d tensors as Python
    numbers), floats (``repr``, so ``1.0`` and ``1`` differ; NaN one value), strings, bytes, sequences (lists, tuples,
    arrays and tensors by their elements) and dicts (by sorted key)."""
    out: list[bytes] = []
    _encode(value, out)
    return b"".join(out)


def _encode(v, out: list) -> None:
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):  # torch / numpy: elements (a 0-d one: a number)
        v = v.tolist()
    if v is None:
        out.append(b"N;")
    elif isinstance(v, bool):
        out.append(b"T;" if v else b"F;")
    elif isinstance(v, int):
        out.append(b"i" + str(v).encode() + b";")
    elif isinstance(v, float):
        out.append(b"f" + (b"nan" if math.isnan(v) else repr(v).encode()) + b";")
    elif isinstance(v, str):
        data = v.encode("utf-8")
        out.append(b"s" + str(len(data)).encode() + b":" + data)
    elif isinstance(v, (bytes, bytearray)):
        out.append(b"b" + str(len(v)).encode() + b":" + bytes(v))
    elif isinstance(v, dict):
        keys = sorted(v, key=lambda k: canonical_bytes(k))
        out.append(b"d" + str(len(keys)).encode() + b"{")
        for k in keys:
            _encode(k, out)
            _encode(v[k], out)
        out.append(b"}")
    elif isinstance(v, (list, tuple)):
        out.append(b"l" + str(len(v)).encode() + b"[")
        for x in v:
            _encode(x, out)
        out.append(b"]")
    else:
        raise ValueError(f"cyclic Poisson sampling cannot hash a training value of type {type(v).__name__} into a "
                         "partition (strings, numbers, lists, dicts, arrays and tensors can be)")


def partition_of(value, bands: int) -> int:
    """int(SHA-256(:func:`canonical_bytes` of ``value``)) mod ``bands``."""
    return int.from_bytes(hashlib.sha256(canonical_bytes(value)).digest(), "big") % int(bands)


def unit_partitions(values: Iterable, bands: int) -> torch.Tensor:
    """``[U]`` partitions of the units whose column values are ``values`` (in the units' order)."""
    return torch.tensor([partition_of(v, bands) for v in values], dtype=torch.long)


def row_partitions(dataset, bands: int) -> torch.Tensor:
    """``[N]`` partitions of a training set's rows, each from the row's own columns (a dict row: every column; any
    other row: the row itself). A 🤗 Dataset is read a slice of columns at a time, from its stored content: without its
    format or transform (``with_format(None)``), so that a ``set_format`` column subset, a tensor format or a random
    ``set_transform`` cannot give a row another partition on another read (a resume, another ``train()``)."""
    if callable(getattr(dataset, "with_format", None)) and getattr(dataset, "column_names", None) is not None:
        dataset = dataset.with_format(None)  # every stored column, as stored (no format, no transform)
    n = len(dataset)
    columns = getattr(dataset, "column_names", None)
    out = torch.empty(n, dtype=torch.long)
    if columns is not None and hasattr(dataset, "__getitem__"):
        try:
            for start in range(0, n, CHUNK_ROWS):
                chunk = dataset[start : start + CHUNK_ROWS]
                names = sorted(chunk)
                for i in range(min(CHUNK_ROWS, n - start)):
                    out[start + i] = partition_of({c: chunk[c][i] for c in names}, bands)
            return out
        except (TypeError, KeyError, IndexError):
            pass  # not sliceable by columns: row by row
    for i in range(n):
        row = dataset[i]
        out[i] = partition_of(dict(row) if hasattr(row, "keys") else row, bands)
    return out


def partitions_digest(partitions: torch.Tensor | None, bands: int) -> str | None:
    """SHA-256 of b and every unit's partition (``None`` without cyclic sampling): a checkpoint records it, and a
    resume or another ``train()`` whose partitions differ is refused (a unit moved to another partition could enter
    two steps less than b apart, and the accountant's ⌈T/b⌉ rounds would undercount it)."""
    if partitions is None:
        return None
    return hashlib.sha256(f"bands={int(bands)}|".encode() + partitions.to(torch.long).numpy().tobytes()).hexdigest()
