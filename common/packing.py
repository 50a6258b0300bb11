"""A message's records as one array on the wire (deployment), and back on arrival.

Flower moves a message as a tree of objects (the message, its record dict, every
record, every array and every 5 MB chunk of it), one SuperLink request per object each
way: a head-sized fedhet message was 14 objects, each pulled by the node and each of
its reply's pushed, then pulled again by the ServerApp. Packed, a message is the
record dict, one :class:`~flwr.app.ConfigRecord` holding the packed bytes, and the
message: 3 objects (a config record has no children, where an array record is a
record, an array and its chunks: 5 objects). A message over :data:`INLINE_MAX` bytes
(Flower's 5 MB chunk size: one object must fit one request) goes as its arrays in one
``uint8`` array in an :class:`~flwr.app.ArrayRecord` (chunked by Flower, so that its
chunks move concurrently) and its other records beside it in a config record
(:data:`PACKED_RECORDS`): 5 objects plus one per 5 MB. Messages whose arrays are the
same (a server's nodes of one tier) share that array: Flower stores and moves it once.
The numbers are the same bytes:
:func:`unpack` gives back exactly what :func:`pack` was given (array dtypes, shapes and
bytes; metric and config values through JSON, which keeps Python's floats exactly).

Layout of the array: :data:`MAGIC`, a 4-byte little-endian header length, the header
(JSON: ``[[name, "arrays", [[key, dtype, shape, offset, nbytes], ...]], [name,
"metrics", {...}], [name, "configs", {...}]]``, in the content's order), then the
arrays' bytes (a large message: the array holds its array records' entries, and the
config record beside it a header without bytes, in the content's order, each array
record as ``[name, "arrays", null]``). :func:`unpack` checks every field against the
array it came in and raises :class:`PackingError` with one line for anything else.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import io
import json
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict
from flwr.common.constant import SType
from numpy.lib import format as npy

PACKED = "fedhet-packed"
"""The one record of a packed message's content (a large one's arrays)."""
PACKED_RECORDS = "fedhet-packed-records"
"""A large packed message's other records (and the order of all), beside its arrays."""
MAGIC = b"FEDHETP1"
DTYPES = "fiub"
"""Array dtype kinds a packed message may hold (float, int, unsigned, bool)."""


class PackingError(ValueError):
    """A packed message that does not unpack; the message is one line."""


INLINE_MAX = 5 * 1024 * 1024
"""Largest packed message carried as bytes in a config record (one object); larger
ones go as an array, chunked by Flower (``FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE``, 5 MB)."""


def is_packed(content: RecordDict) -> bool:
    return PACKED in content.array_records or PACKED in content.config_records


def _value(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"b64": base64.b64encode(value).decode()}
    if isinstance(value, list):
        return [_value(v) for v in value]
    return value


def _back(value: Any) -> Any:
    if isinstance(value, dict):
        if set(value) != {"b64"}:
            raise PackingError(f"a record value {value!r} is no scalar")
        return base64.b64decode(value["b64"])
    if isinstance(value, list):
        return [_back(v) for v in value]
    return value


@functools.lru_cache(maxsize=256)
def _npy_header(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The ``.npy`` header :func:`numpy.save` writes for a C-ordered array (what
    Flower's :class:`~flwr.app.Array` holds before the values)."""
    out = io.BytesIO()
    descr = npy.dtype_to_descr(np.dtype(dtype))
    npy.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def _values_of(array: Array) -> tuple[np.dtype, tuple[int, ...], bytes | memoryview]:
    """An array's dtype, shape and values in C order: a view of the bytes it holds
    (a C-ordered ``.npy``, as Flower makes them), a copy only otherwise."""
    if array.stype == SType.NUMPY:
        with contextlib.suppress(ValueError, TypeError):
            data = array.data
            fp = io.BytesIO(data)
            version = npy.read_magic(fp)
            read = npy.read_array_header_1_0 if version == (1, 0) else npy.read_array_header_2_0
            shape, fortran, dtype = read(fp)
            start = fp.tell()
            size = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            if not fortran and not dtype.hasobject and start + size == len(data):
                return dtype, tuple(shape), memoryview(data)[start:]
    value = array.numpy()  # (np.ascontiguousarray would make a 0-d array 1-d)
    value = value if value.flags.c_contiguous else value.copy(order="C")
    return value.dtype, tuple(value.shape), value.tobytes()


def _npy_array(dtype: np.dtype, shape: tuple[int, ...], values: bytes | memoryview) -> Array:
    """The :class:`~flwr.app.Array` of these values: the same bytes as
    ``Array(ndarray)`` (tests/test_packing.py), made with one copy where that takes
    three."""
    header = _npy_header(dtype.str, shape)
    return Array(dtype=str(dtype), shape=shape, stype=SType.NUMPY, data=header + values)


def _arrays(
    record: ArrayRecord, offset: int, chunks: list[bytes | memoryview]
) -> tuple[list[Any], int]:
    items = []
    for key, array in record.items():
        dtype, shape, raw = _values_of(array)
        items.append([key, dtype.str, list(shape), offset, len(raw)])
        chunks.append(raw)
        offset += len(raw)
    return items, offset


def _encoded(header: list[Any]) -> bytes:
    return json.dumps(header, separators=(",", ":")).encode()


def _framed(
    header: list[Any] | bytes, chunks: list[bytes | memoryview], before: bytes = b""
) -> bytes:
    text = header if isinstance(header, bytes) else _encoded(header)
    return b"".join([before, MAGIC, len(text).to_bytes(4, "little"), text, *chunks])


def _values(name: str, record: Any) -> list[Any]:
    if isinstance(record, MetricRecord):
        return [name, "metrics", {k: _value(v) for k, v in record.items()}]
    if isinstance(record, ConfigRecord):
        return [name, "configs", {k: _value(v) for k, v in record.items()}]
    raise TypeError(f"record {name!r}: {type(record).__name__} cannot be packed")


def pack(
    content: RecordDict, inline_max: int = INLINE_MAX, shared: dict[Any, Any] | None = None
) -> RecordDict:
    """``content`` as one record: its bytes in a config record, or, when they are over
    ``inline_max``, its arrays as one ``uint8`` array and its other records beside it
    in a config record (:data:`PACKED_RECORDS`).

    ``shared``: a dict the caller keeps while it packs several messages (the server's
    round): large messages whose array records are the same objects get the same
    packed array, packed once. Flower stores an object once, so what nodes of one
    tier are sent is held and pushed once, not once per node (a thousand FedARA
    messages of 7.8 MB: 7.8 GB otherwise)."""
    arrays = [(n, r) for n, r in content.items() if isinstance(r, ArrayRecord)]
    key = tuple((n, id(r)) for n, r in arrays)
    if shared is not None and key in shared:
        return _split(content, shared[key][1])
    chunks: list[bytes | memoryview] = []
    offset = 0
    header: list[Any] = []
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            items, offset = _arrays(record, offset, chunks)
            header.append([name, "arrays", items])
        else:
            header.append(_values(name, record))
    text = _encoded(header)
    if len(MAGIC) + 4 + len(text) + offset <= inline_max:
        return RecordDict({PACKED: ConfigRecord({"blob": _framed(text, chunks)})})
    part = _encoded([h for h in header if h[1] == "arrays"])
    size = len(MAGIC) + 4 + len(part) + offset  # the blob, framed once as its .npy
    npy_blob = _framed(part, chunks, before=_npy_header("|u1", (size,)))
    blob = Array(dtype="uint8", shape=(size,), stype=SType.NUMPY, data=npy_blob)
    packed = ArrayRecord({"blob": blob})
    if shared is not None:  # the records stay referenced: their ids are not reused
        shared[key] = ([r for _, r in arrays], packed)
    return _split(content, packed)


def _split(content: RecordDict, packed: ArrayRecord) -> RecordDict:
    head = [
        [n, "arrays", None] if isinstance(r, ArrayRecord) else _values(n, r)
        for n, r in content.items()
    ]
    return RecordDict({PACKED: packed, PACKED_RECORDS: ConfigRecord({"blob": _framed(head, [])})})


def _data(record: Any, name: str) -> bytes | memoryview:
    if list(record) != ["blob"]:
        raise PackingError(f"record {name!r} holds {sorted(record)}, not one 'blob'")
    if isinstance(record, ConfigRecord):
        data = record["blob"]
        if not isinstance(data, bytes):
            raise PackingError(f"the packed value is {type(data).__name__}, not bytes")
        return data
    if isinstance(record, ArrayRecord):
        try:
            dtype, shape, values = _values_of(record["blob"])
        except (ValueError, TypeError) as exc:
            raise PackingError(f"the packed array does not decode ({exc})") from None
        if dtype != np.uint8 or len(shape) != 1:
            raise PackingError(f"the packed array is {dtype} {list(shape)}, not uint8 [n]")
        return memoryview(values)
    raise PackingError(f"record {name!r} is a {type(record).__name__}")


def _parse(data: bytes | memoryview) -> tuple[Any, memoryview]:
    if len(data) < len(MAGIC) + 4 or bytes(data[: len(MAGIC)]) != MAGIC:
        raise PackingError("the packed array does not start with fedhet's mark")
    size = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4 + size
    if start > len(data):
        raise PackingError(f"a header of {size} bytes in {len(data)}")
    try:
        header = json.loads(bytes(data[len(MAGIC) + 4 : start]))
    except (ValueError, UnicodeDecodeError) as exc:
        raise PackingError(f"an unreadable header ({exc})") from None
    if not isinstance(header, list):
        raise PackingError("a malformed header (not a list)")
    return header, memoryview(data)[start:]


def unpack(content: RecordDict) -> RecordDict:
    """The content :func:`pack` packed; :class:`PackingError` names what does not fit."""
    split = list(content) == [PACKED, PACKED_RECORDS]
    if list(content) != [PACKED] and not split:
        raise PackingError(f"a packed message holds records {sorted(content)}, not {PACKED!r}")
    header, body = _parse(_data(content[PACKED], PACKED))
    out = RecordDict()
    try:
        if split:
            arrays = {}
            for name, kind, items in header:
                if kind != "arrays":
                    raise PackingError(f"record {name!r} of kind {kind!r} in the packed arrays")
                arrays[name] = items
            header, _ = _parse(_data(content[PACKED_RECORDS], PACKED_RECORDS))
            for entry in header:
                if entry[1] == "arrays":
                    if entry[2] is not None or entry[0] not in arrays:
                        raise PackingError(f"record {entry[0]!r} not in the packed arrays")
                    entry[2] = arrays.pop(entry[0])
            if arrays:
                raise PackingError(f"packed arrays of no record: {sorted(arrays)}")
        for name, kind, items in header:
            if kind == "arrays":
                out[name] = ArrayRecord({key: _array(body, *spec) for key, *spec in items})
            elif kind == "metrics":
                out[name] = MetricRecord({k: _back(v) for k, v in items.items()})
            elif kind == "configs":
                out[name] = ConfigRecord({k: _back(v) for k, v in items.items()})
            else:
                raise PackingError(f"record {name!r} of unknown kind {kind!r}")
    except (TypeError, ValueError, AttributeError, IndexError) as exc:
        if isinstance(exc, PackingError):
            raise
        raise PackingError(f"a malformed header ({type(exc).__name__}: {exc})") from None
    return out


def _array(body: memoryview, dtype: str, shape: list[int], offset: int, nbytes: int) -> Array:
    kind = np.dtype(dtype)
    if kind.kind not in DTYPES:
        raise PackingError(f"dtype {dtype} is not a number type")
    if any(not isinstance(s, int) or s < 0 for s in shape):
        raise PackingError(f"shape {shape}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * kind.itemsize != nbytes or offset < 0 or offset + nbytes > len(body):
        raise PackingError(f"an array of {nbytes} bytes at {offset} does not fit {dtype} {shape}")
    return _npy_array(kind, tuple(shape), body[offset : offset + nbytes])
