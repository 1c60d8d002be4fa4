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
import struct
from typing import Iterable

import numpy as np
import torch

#: the partition hash's version (in :func:`partitions_digest`): 2 packs numbers at a fixed width (1 wrote their repr)
SCHEME = "cyclic-partitions-v2"
#: rows read at a time from a 🤗 Dataset (column slices, not one row at a time)
CHUNK_ROWS = 4096


def canonical_bytes(value) -> bytes:
    """A typed, unambiguous byte encoding of ``value``: ``None``, bools, integers (numpy and 0-d tensors as Python
    numbers; 8 bytes big-endian, or their digits beyond 64 bits), floats (the 8 bytes of the IEEE double, big-endian,
    so ``1.0`` and ``1`` differ; NaN one value), strings, bytes, sequences (lists, tuples, arrays and tensors by their
    elements) and dicts (by sorted key). A numeric array or tensor is encoded in one vectorized pass, to the bytes of the
    nested list of its elements (:func:`_array_bytes`): a cached frozen-prefix row (thousands of floats) costs
    microseconds, not the seconds a Python loop over its elements took."""
    out: list[bytes] = []
    _encode(value, out)
    return b"".join(out)


_INT64 = struct.Struct(">q")
_DOUBLE = struct.Struct(">d")
#: every NaN is encoded as this one quiet NaN
_NAN = _DOUBLE.pack(float("nan"))
_INT_MIN, _INT_MAX = -(2**63), 2**63 - 1


def _number(v) -> bytes:
    if isinstance(v, bool):
        return b"T;" if v else b"F;"
    if isinstance(v, int):
        return b"i" + _INT64.pack(v) if _INT_MIN <= v <= _INT_MAX else b"I" + str(v).encode() + b";"
    return b"f" + (_NAN if math.isnan(v) else _DOUBLE.pack(v))


def _encode(v, out: list) -> None:
    if not isinstance(v, (str, bytes, bytearray)):
        fast = _array_bytes(v)
        if fast is not None:  # a numeric tensor or array (or a list of plain ints or floats): one vectorized pass
            out.append(fast)
            return
    if hasattr(v, "tolist") and not isinstance(v, (str, bytes)):  # torch / numpy: elements (a 0-d one: a number)
        try:
            v = v.tolist()
        except Exception as e:  # a sparse, meta, quantized or nested tensor: one sentence, not a traceback
            raise ValueError(f"cyclic Poisson sampling cannot hash a training value of type {type(v).__name__} into a "
                             f"partition ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); give the "
                             "trainer dense tensors, arrays, numbers, strings, lists or dicts") from None
    if v is None:
        out.append(b"N;")
    elif isinstance(v, (bool, int, float)):
        out.append(_number(v))
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


def _as_numeric_array(v):
    """``v`` as a numpy array of int64, float64 or bool holding exactly its elements' values, or ``None`` (not a
    tensor, an array or a flat list of plain ints or plain floats; another dtype; an integer beyond int64)."""
    if isinstance(v, torch.Tensor):
        if v.is_sparse or v.is_complex() or v.dtype == getattr(torch, "uint64", None):
            return None
        t = v.detach().cpu().resolve_conj().resolve_neg()  # a lazily negated view (.imag of a conjugate): its values
        if t.dtype == torch.bool:
            return t.numpy()
        return (t.to(torch.float64) if t.is_floating_point() else t.to(torch.int64)).numpy()
    if type(v) is np.ndarray:  # a subclass (a masked array: its .tolist() hides masked entries) takes the element path
        kind = v.dtype.kind
        if kind == "b":
            return v
        if kind == "f" and v.dtype.itemsize <= 8:
            return v.astype(np.float64)
        if kind == "i" or (kind == "u" and v.dtype.itemsize < 8):
            return v.astype(np.int64)
        return None
    if isinstance(v, list) and len(v) > 8:  # shorter lists: the element loop is as fast
        kinds = {type(x) for x in v}
        if kinds == {int}:
            try:
                return np.array(v, dtype=np.int64)
            except OverflowError:
                return None
        if kinds == {float}:
            return np.array(v, dtype=np.float64)
    return None


def _array_bytes(v) -> bytes | None:
    """The canonical bytes of a numeric tensor, array or flat list, equal to those of the nested list of its elements
    (``None`` if ``v`` is none of these): each element tagged and packed at a fixed width in one numpy pass, then each
    dimension, innermost first, wrapped in its ``l<n>[`` … ``]``."""
    a = _as_numeric_array(v)
    if a is None:
        return None
    a = np.ascontiguousarray(a).reshape(a.shape)  # (ascontiguousarray makes a 0-d array 1-d)
    if a.dtype == np.bool_:
        flat = np.array([b"F;", b"T;"], dtype="S2")[a.astype(np.int64)]
        blob = flat.reshape(-1).view(np.uint8).reshape(a.shape + (2,))
    else:
        if a.dtype == np.float64:
            a = np.where(np.isnan(a), np.nan, a)  # one NaN
            tag, value = b"f", ">f8"
        else:
            tag, value = b"i", ">i8"
        packed = np.empty(a.shape, dtype=[("tag", "S1"), ("value", value)])
        packed["tag"], packed["value"] = tag, a
        blob = packed.reshape(-1).view(np.uint8).reshape(a.shape + (9,))
    for n in reversed(a.shape):  # [..., n, w] -> [..., len(prefix) + n·w + 1]
        lead = blob.shape[:-2]
        prefix = np.frombuffer(b"l" + str(n).encode() + b"[", dtype=np.uint8)
        body = blob.reshape(lead + (n * blob.shape[-1],))
        blob = np.concatenate([np.broadcast_to(prefix, lead + prefix.shape), body,
                               np.full(lead + (1,), ord("]"), dtype=np.uint8)], axis=-1)
    return blob.tobytes()


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
    two steps less than b apart, and the accountant's ⌈T/b⌉ rounds would undercount it). :data:`SCHEME` is part of it:
    a checkpoint whose partitions were hashed by an earlier encoding is refused, not resumed on other partitions."""
    if partitions is None:
        return None
    head = f"{SCHEME}|bands={int(bands)}|".encode()
    return hashlib.sha256(head + partitions.to(torch.long).numpy().tobytes()).hexdigest()
