"""The one place where named tensors become Flower records and back.

Arrays always travel by name (state-dict keys), never as positional lists.
"""

from __future__ import annotations

import functools
import io
import math
import warnings
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, RecordDict
from flwr.common.constant import SType
from numpy.lib import format as npy

Arrays = dict[str, np.ndarray]
"""Named arrays as the server handles them (numpy, by state-dict key)."""


def to_record(tensors: Mapping[str, torch.Tensor | np.ndarray]) -> ArrayRecord:
    """Wrap named tensors or arrays into an :class:`ArrayRecord` (CPU copies)."""
    record = ArrayRecord()
    for key, value in tensors.items():
        if isinstance(value, torch.Tensor):
            value = value.detach().cpu().numpy()
        record[key] = Array(np.ascontiguousarray(value))
    return record


class MalformedArray(ValueError):
    """An array in a record that is not a well-formed ``.npy`` payload."""


def _header_end(data: bytes) -> int:
    """Where a ``.npy`` payload's data starts (magic, version, length, header)."""
    if len(data) < 10 or data[:6] != npy.MAGIC_PREFIX:
        raise ValueError("no .npy magic")
    if data[6] == 1:
        return 10 + int.from_bytes(data[8:10], "little")
    if len(data) < 12:
        raise ValueError("truncated .npy header")
    return 12 + int.from_bytes(data[8:12], "little")


@functools.lru_cache(maxsize=4096)
def _npy_header(header: bytes) -> tuple[tuple[int, ...], bool, np.dtype, int]:
    """``(shape, fortran order, dtype, data offset)`` of a ``.npy`` header (cached:
    the replies of a round repeat a few dozen headers)."""
    stream = io.BytesIO(header)
    version = npy.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = npy.read_array_header_1_0(stream)
    elif version == (2, 0):
        shape, fortran, dtype = npy.read_array_header_2_0(stream)
    else:
        raise ValueError(f"unsupported .npy version {version}")
    if stream.tell() != len(header):
        raise ValueError("truncated .npy header")
    return tuple(shape), bool(fortran), dtype, len(header)


def decode(key: str, arr: Array, copy: bool = True) -> np.ndarray:
    """The numpy array an :class:`Array` carries (a writable copy, or with ``copy``
    False a read-only view of its bytes), strictly.

    The same result as ``Array.numpy()`` for every array ``Array.from_numpy_ndarray``
    writes, in one copy of the data (none without ``copy``) and with each distinct
    header parsed once (``np.load`` reads in chunks and parses every header: that was
    half of FedARA's aggregation time at 100 clients). Raises :class:`MalformedArray`, naming
    ``key``, when the payload is not numpy-serialised, its header is not a ``.npy``
    header, holds objects, disagrees with the Array's declared dtype or shape, or
    the data is not exactly ``numel × itemsize`` bytes; pickled data is never loaded.
    """
    if arr.stype != SType.NUMPY:
        raise MalformedArray(f"array '{key}': serialisation {arr.stype!r}, not numpy.ndarray")
    data = arr.data
    try:
        shape, fortran, dtype, offset = _npy_header(bytes(data[: _header_end(data)]))
    except (ValueError, SyntaxError, TypeError) as exc:
        raise MalformedArray(f"array '{key}': not a .npy payload ({exc})") from None
    if dtype.hasobject:
        raise MalformedArray(f"array '{key}': object dtype {dtype} (never unpickled)")
    if tuple(shape) != tuple(arr.shape) or str(dtype) != arr.dtype:
        raise MalformedArray(
            f"array '{key}': payload {dtype} {tuple(shape)} != declared {arr.dtype} "
            f"{tuple(arr.shape)}"
        )
    count = math.prod(shape)
    if len(data) - offset != count * dtype.itemsize:
        raise MalformedArray(
            f"array '{key}': {len(data) - offset} data bytes for {dtype} {tuple(shape)} "
            f"(needs {count * dtype.itemsize})"
        )
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=offset)
    view = flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    return view.copy(order="K") if copy else view


def to_numpy(record: ArrayRecord, copy: bool = True) -> Arrays:
    """Named numpy arrays from an :class:`ArrayRecord` (:func:`decode`: raises
    :class:`MalformedArray` naming the first malformed key)."""
    return {key: decode(key, arr, copy) for key, arr in record.items()}


def tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Named tensors sharing the memory of ``arrays``, which may be read-only views
    (:func:`decode` without ``copy``): never write to them (torch warns that it
    cannot mark them read-only; that warning is silenced here)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given NumPy array is not writable")
        return {key: torch.from_numpy(value) for key, value in arrays.items()}


def to_torch(record: ArrayRecord) -> dict[str, torch.Tensor]:
    """Named torch tensors from an :class:`ArrayRecord`."""
    return {key: torch.from_numpy(value) for key, value in to_numpy(record).items()}


def payload_bytes(record: ArrayRecord) -> int:
    """Bytes of array contents in ``record``: Σ numel × itemsize (no framing)."""
    return sum(
        int(np.prod(arr.shape, dtype=np.int64)) * np.dtype(arr.dtype).itemsize
        for arr in record.values()
    )


def content_bytes(content: RecordDict) -> int:
    """Array payload bytes of every :class:`ArrayRecord` in a message's content."""
    return sum(payload_bytes(rec) for rec in content.array_records.values())


def shapes(arrays: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """``{key: shape}`` of named arrays."""
    return {key: tuple(value.shape) for key, value in arrays.items()}


def invalid_reason(
    arrays: Mapping[str, np.ndarray],
    expected: Mapping[str, tuple[int, ...]] | None = None,
    dtype: np.dtype | type | None = np.float32,
    finite: bool = True,
) -> str | None:
    """Why ``arrays`` must not be aggregated, or ``None`` when they are fine.

    Checks, in order: the exact key set and shapes (when ``expected`` is given), the
    dtype (exactly ``dtype``, the one the server sends; ``None``: any real number
    type), and that every floating value is finite (unless ``finite`` is False: for a
    caller that sees it in what it computes from every value anyway).
    """
    if expected is not None:
        missing = sorted(set(expected) - set(arrays))
        extra = sorted(set(arrays) - set(expected))
        if missing or extra:
            return f"wrong keys (missing {missing[:3]}, unexpected {extra[:3]})"
        for key, shape in expected.items():
            if tuple(arrays[key].shape) != tuple(shape):
                return f"wrong shape for '{key}': {arrays[key].shape} != {shape}"
    for key, value in arrays.items():
        if dtype is not None and value.dtype != np.dtype(dtype):
            return f"dtype {value.dtype} for '{key}' (expected {np.dtype(dtype)})"
        if not np.issubdtype(value.dtype, np.number) or np.iscomplexobj(value):
            return f"non-real dtype {value.dtype} for '{key}'"
        if finite and np.issubdtype(value.dtype, np.inexact) and not np.isfinite(value).all():
            return f"non-finite values in '{key}'"
    return None


def weighted_mean(arrays: Sequence[Arrays], weights: Sequence[float], like: Arrays) -> Arrays:
    """Σ_k w_k / Σw · arrays_k, key by key, in float64, cast to the dtype of the same
    key in ``like`` (the global state: a reply never changes the global's dtype).

    Summation follows the order of ``arrays``; callers sort replies (by partition)
    so the result does not depend on reply arrival order.
    """
    if not arrays:
        raise ValueError("weighted_mean of no arrays")
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {total}")
    out: Arrays = {}
    for key, ref in arrays[0].items():
        acc = np.zeros(ref.shape, dtype=np.float64)
        for item, weight in zip(arrays, weights, strict=True):
            acc += item[key].astype(np.float64) * (weight / total)
        out[key] = acc.astype(like[key].dtype)
    return out


def capped_shares(weights: Sequence[float], cap: float = 1.0) -> list[float]:
    """``weights`` normalised to sum 1 with no share above ``cap``: shares over the
    cap are set to it and the excess goes to the others in proportion to their
    weights, until none is over (a cap below 1/n gives equal shares)."""
    total = float(sum(weights))
    if total <= 0:
        raise ValueError(f"weights must sum to a positive number, got {total}")
    shares = [w / total for w in weights]
    if cap >= 1.0:
        return shares
    if cap * len(shares) <= 1.0:
        return [1.0 / len(shares)] * len(shares)
    fixed: set[int] = set()
    while True:
        over = [i for i, s in enumerate(shares) if i not in fixed and s > cap + 1e-15]
        if not over:
            return shares
        fixed.update(over)
        free = [i for i in range(len(shares)) if i not in fixed]
        rest = 1.0 - cap * len(fixed)
        mass = sum(weights[i] for i in free)
        shares = [cap if i in fixed else rest * weights[i] / mass for i in range(len(shares))]
