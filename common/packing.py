"""A message's records as one array on the wire (deployment), and back on arrival.

Flower moves a message as a tree of objects (the message, its record dict, every
record, every array and every 5 MB chunk of it), one SuperLink request per object each
way: a head-sized fedhet message was 14 objects, each pulled by the node and each of
its reply's pushed, then pulled again by the ServerApp. Packed, a message is the
record dict, one :class:`~flwr.app.ConfigRecord` holding the packed bytes, and the
message: 3 objects (a config record has no children, where an array record is a
record, an array and its chunks: 5 objects). A message over :data:`INLINE_MAX` bytes
(Flower's 5 MB chunk size: one object must fit one request) goes as one ``uint8``
array in an :class:`~flwr.app.ArrayRecord` instead, 4 objects plus one per 5 MB, so
that its chunks move concurrently. The numbers are the same bytes:
:func:`unpack` gives back exactly what :func:`pack` was given (array dtypes, shapes and
bytes; metric and config values through JSON, which keeps Python's floats exactly).

Layout of the array: :data:`MAGIC`, a 4-byte little-endian header length, the header
(JSON: ``[[name, "arrays", [[key, dtype, shape, offset, nbytes], ...]], [name,
"metrics", {...}], [name, "configs", {...}]]``, in the content's order), then the
arrays' bytes. :func:`unpack` checks every field against the array it came in and
raises :class:`PackingError` with one line for anything else.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, MetricRecord, RecordDict

PACKED = "fedhet-packed"
"""The one record of a packed message's content."""
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


def pack(content: RecordDict, inline_max: int = INLINE_MAX) -> RecordDict:
    """``content`` as one record: its bytes in a config record, or one ``uint8`` array
    when they are over ``inline_max``."""
    header: list[Any] = []
    chunks: list[bytes] = []
    offset = 0
    for name, record in content.items():
        if isinstance(record, ArrayRecord):
            items = []
            for key, array in record.items():
                value = array.numpy()  # (np.ascontiguousarray would make a 0-d array 1-d)
                value = value if value.flags.c_contiguous else value.copy(order="C")
                raw = value.tobytes()
                items.append([key, value.dtype.str, list(value.shape), offset, len(raw)])
                chunks.append(raw)
                offset += len(raw)
            header.append([name, "arrays", items])
        elif isinstance(record, MetricRecord):
            header.append([name, "metrics", {k: _value(v) for k, v in record.items()}])
        elif isinstance(record, ConfigRecord):
            header.append([name, "configs", {k: _value(v) for k, v in record.items()}])
        else:
            raise TypeError(f"record {name!r}: {type(record).__name__} cannot be packed")
    text = json.dumps(header, separators=(",", ":")).encode()
    blob = b"".join([MAGIC, len(text).to_bytes(4, "little"), text, *chunks])
    if len(blob) <= inline_max:
        return RecordDict({PACKED: ConfigRecord({"blob": blob})})
    return RecordDict({PACKED: ArrayRecord({"blob": Array(np.frombuffer(blob, np.uint8))})})


def unpack(content: RecordDict) -> RecordDict:
    """The content :func:`pack` packed; :class:`PackingError` names what does not fit."""
    if list(content) != [PACKED]:
        raise PackingError(f"a packed message holds records {sorted(content)}, not {PACKED!r}")
    record = content[PACKED]
    if list(record) != ["blob"]:
        raise PackingError(f"record {PACKED!r} holds {sorted(record)}, not one 'blob'")
    if isinstance(record, ConfigRecord):
        data = record["blob"]
        if not isinstance(data, bytes):
            raise PackingError(f"the packed value is {type(data).__name__}, not bytes")
    elif isinstance(record, ArrayRecord):
        blob = record["blob"].numpy()
        if blob.dtype != np.uint8 or blob.ndim != 1:
            shape = list(blob.shape)
            raise PackingError(f"the packed array is {blob.dtype} {shape}, not uint8 [n]")
        data = blob.tobytes()
    else:
        raise PackingError(f"record {PACKED!r} is a {type(record).__name__}")
    if data[: len(MAGIC)] != MAGIC or len(data) < len(MAGIC) + 4:
        raise PackingError("the packed array does not start with fedhet's mark")
    size = int.from_bytes(data[len(MAGIC) : len(MAGIC) + 4], "little")
    start = len(MAGIC) + 4 + size
    if start > len(data):
        raise PackingError(f"a header of {size} bytes in {len(data)}")
    try:
        header = json.loads(data[len(MAGIC) + 4 : start])
    except (ValueError, UnicodeDecodeError) as exc:
        raise PackingError(f"an unreadable header ({exc})") from None
    body = memoryview(data)[start:]
    out = RecordDict()
    try:
        for name, kind, items in header:
            if kind == "arrays":
                out[name] = ArrayRecord({key: Array(_array(body, *spec)) for key, *spec in items})
            elif kind == "metrics":
                out[name] = MetricRecord({k: _back(v) for k, v in items.items()})
            elif kind == "configs":
                out[name] = ConfigRecord({k: _back(v) for k, v in items.items()})
            else:
                raise PackingError(f"record {name!r} of unknown kind {kind!r}")
    except (TypeError, ValueError, AttributeError) as exc:
        if isinstance(exc, PackingError):
            raise
        raise PackingError(f"a malformed header ({type(exc).__name__}: {exc})") from None
    return out


def _array(body: memoryview, dtype: str, shape: list[int], offset: int, nbytes: int) -> np.ndarray:
    kind = np.dtype(dtype)
    if kind.kind not in DTYPES:
        raise PackingError(f"dtype {dtype} is not a number type")
    if any(not isinstance(s, int) or s < 0 for s in shape):
        raise PackingError(f"shape {shape}")
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    if count * kind.itemsize != nbytes or offset < 0 or offset + nbytes > len(body):
        raise PackingError(f"an array of {nbytes} bytes at {offset} does not fit {dtype} {shape}")
    return np.frombuffer(body[offset : offset + nbytes], dtype=kind).reshape(tuple(shape)).copy()
