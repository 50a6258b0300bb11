"""A message's records as one packed array (deployment): exactly the same records back;
anything malformed is one PackingError line, an error reply on the server, never
aggregated."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict

from common.packing import (
    INLINE_MAX,
    MAGIC,
    PACKED,
    PACKED_RECORDS,
    PackingError,
    is_packed,
    pack,
    unpack,
)


def _content(rng: np.random.Generator) -> RecordDict:
    return RecordDict(
        {
            "arrays": ArrayRecord(
                {
                    "w": Array(rng.normal(size=(7, 3)).astype(np.float32)),
                    "scalar": Array(np.array(2.5)),
                    "empty": Array(np.zeros((0, 4), np.float32)),
                    "counts": Array(rng.integers(0, 9, 5)),
                    "fortran": Array(np.asfortranarray(rng.normal(size=(3, 4)))),
                }
            ),
            "config": ConfigRecord(
                {"round": 3, "lr": 0.1 + 1e-17, "name": "x", "raw": b"\x00\xff", "on": True,
                 "ids": [1, 2], "raws": [b"a"]}
            ),
            "metrics": MetricRecord({"num-examples": 40, "loss": 1 / 3, "per-class": [0.5, 0.25]}),
        }
    )  # fmt: skip


def test_unpack_gives_back_exactly_what_was_packed() -> None:
    content = _content(np.random.default_rng(0))
    packed = pack(content)
    assert is_packed(packed) and list(packed) == [PACKED] and not is_packed(content)
    back = unpack(packed)
    assert list(back) == list(content)
    for key, array in content["arrays"].items():
        got = back["arrays"][key].numpy()
        want = array.numpy()
        assert got.dtype == want.dtype and got.shape == want.shape and np.array_equal(got, want)
    assert dict(back["config"]) == dict(content["config"])
    assert dict(back["metrics"]) == dict(content["metrics"])
    assert type(back["config"]) is ConfigRecord and type(back["metrics"]) is MetricRecord


@pytest.mark.parametrize("inline_max", [INLINE_MAX, 0])
def test_packing_makes_the_bytes_flower_makes(inline_max: int) -> None:
    """Arrays built straight from the packed bytes (one copy) are byte for byte what
    ``Array(ndarray)`` makes, so their object ids are Flower's; the split layout's
    packed array too."""
    content = _content(np.random.default_rng(1))
    packed = pack(content, inline_max=inline_max)
    for key, array in unpack(packed)["arrays"].items():
        want = content["arrays"][key].numpy().copy(order="C")
        assert array.data == Array(want).data, key
        assert (array.dtype, array.shape) == (str(want.dtype), want.shape)
    if inline_max == 0:
        blob = packed[PACKED]["blob"]
        assert blob.data == Array(blob.numpy()).data


def _blob(content: RecordDict) -> bytes:
    record = content[PACKED]
    if isinstance(record, ConfigRecord):
        return record["blob"]  # type: ignore[return-value]
    return bytes(record["blob"].numpy())


def _with_blob(data: bytes, inline: bool = True) -> RecordDict:
    if inline:
        return RecordDict({PACKED: ConfigRecord({"blob": data})})
    return RecordDict({PACKED: ArrayRecord({"blob": Array(np.frombuffer(data, np.uint8))})})


def _objects(content: RecordDict) -> int:
    from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

    return len(get_all_nested_objects(Message(content, dst_node_id=9, message_type="train")))


def test_a_packed_message_is_three_objects_and_a_large_one_goes_chunked() -> None:
    content = _content(np.random.default_rng(4))
    assert _objects(content) == 15  # message, record dict, 3 records, 5 arrays, 5 chunks
    small = pack(content)
    assert isinstance(small[PACKED], ConfigRecord) and _objects(small) == 3
    big = pack(content, inline_max=100)  # over the inline size: the arrays as one uint8
    # array (chunked), the other records beside it: message, record dict, 2 records,
    # the array and its one chunk
    assert list(big) == [PACKED, PACKED_RECORDS] and isinstance(big[PACKED], ArrayRecord)
    assert _objects(big) == 6
    for packed in (small, big):
        back = unpack(packed)
        assert list(back) == list(content)
        assert np.array_equal(back["arrays"]["w"].numpy(), content["arrays"]["w"].numpy())
        assert dict(back["config"]) == dict(content["config"])


def test_large_messages_with_the_same_arrays_share_one_packed_array() -> None:
    """A server's messages to nodes of one tier: the arrays packed once, one object."""
    rng = np.random.default_rng(5)
    shared_arrays = ArrayRecord({"w": Array(rng.normal(size=(40, 30)).astype(np.float32))})
    other = ArrayRecord({"w": Array(rng.normal(size=(40, 30)).astype(np.float32))})

    def message(arrays: ArrayRecord, node: int) -> RecordDict:
        return RecordDict({"arrays": arrays, "config": ConfigRecord({"node": node})})

    cache: dict = {}
    a, b, c = (pack(message(r, i), 100, cache) for i, r in enumerate([shared_arrays] * 2 + [other]))
    assert a[PACKED] is b[PACKED] and a[PACKED] is not c[PACKED]
    assert a[PACKED_RECORDS]["blob"] != b[PACKED_RECORDS]["blob"]
    for i, (packed, arrays) in enumerate([(a, shared_arrays), (b, shared_arrays), (c, other)]):
        back = unpack(packed)
        assert back["config"]["node"] == i
        assert np.array_equal(back["arrays"]["w"].numpy(), arrays["w"].numpy())
    # without the cache: equal bytes, so Flower's object ids still match
    alone = pack(message(shared_arrays, 1), 100)
    assert alone[PACKED] is not a[PACKED] and alone[PACKED].object_id == a[PACKED].object_id


def test_a_malformed_split_message_is_one_line() -> None:
    content = _content(np.random.default_rng(6))
    big = pack(content, inline_max=100)
    head = big[PACKED_RECORDS]["blob"]
    cases = [
        (head.replace(b'["arrays","arrays",null]', b'["other","arrays",null]'), "not in the"),
        (head.replace(b'["arrays","arrays",null],', b""), "packed arrays of no record"),
        (head.replace(b'["arrays","arrays",null]', b'["arrays","arrays",[]]'), "not in the"),
    ]
    for blob, says in cases:
        assert blob != head
        size = len(blob) - len(MAGIC) - 4
        blob = blob[:8] + size.to_bytes(4, "little") + blob[12:]
        mangled = RecordDict({PACKED: big[PACKED], PACKED_RECORDS: ConfigRecord({"blob": blob})})
        with pytest.raises(PackingError, match=says):
            unpack(mangled)


@pytest.mark.parametrize(
    ("mangle", "says"),
    [
        (lambda b: b"NOTFEDHT" + b[8:], "fedhet's mark"),
        (lambda b: b[:12] + b"{" + b[13:], "unreadable header"),
        (lambda b: b[:-5], "does not fit"),
        (lambda b: b[:8] + (10**6).to_bytes(4, "little") + b[12:], "a header of 1000000 bytes"),
        (lambda b: b.replace(b'"<f4"', b'"|O8"'), "not a number type"),
        (lambda b: b.replace(b',"arrays",[', b',"tensor",[', 1), "unknown kind"),
    ],
)
@pytest.mark.parametrize("inline", [True, False], ids=["bytes", "array"])
def test_a_malformed_packed_message_is_one_line(mangle, says: str, inline: bool) -> None:  # type: ignore[no-untyped-def]
    blob = _blob(pack(_content(np.random.default_rng(1))))
    assert blob.startswith(MAGIC)
    with pytest.raises(PackingError, match=says):
        unpack(_with_blob(mangle(blob), inline))


def test_a_packed_record_of_another_shape_is_one_line() -> None:
    blob = _blob(pack(_content(np.random.default_rng(1))))
    extra = _with_blob(blob)
    extra["more"] = MetricRecord({"x": 1})
    cases = [
        (extra, "holds records"),
        (RecordDict({PACKED: ConfigRecord({"blob": "text"})}), "not bytes"),
        (RecordDict({PACKED: ConfigRecord({"blob": blob, "b": blob})}), "not one 'blob'"),
        (RecordDict({PACKED: MetricRecord({"blob": 1.0})}), "is a MetricRecord"),
        (RecordDict({PACKED: ArrayRecord({"blob": Array(np.zeros(3, np.float32))})}), "not uint8"),
    ]
    for content, says in cases:
        with pytest.raises(PackingError, match=says):
            unpack(content)


class _Grid:
    """A grid that delivers every message to ``answer`` at once."""

    def __init__(self, answer) -> None:  # type: ignore[no-untyped-def]
        self.answer, self.pending, self.wire = answer, [], []

    def push_messages(self, messages):  # type: ignore[no-untyped-def]
        ids = []
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id
            self.wire.append(m.content)
            self.pending.append(self.answer(m))
            ids.append(m.metadata.message_id)
        return ids

    def pull_messages(self, message_ids):  # type: ignore[no-untyped-def]
        out, self.pending = self.pending, []
        return out


def _query(content: RecordDict) -> Message:
    return Message(content, dst_node_id=9, message_type="train.x")


def test_the_server_packs_what_it_sends_and_unpacks_or_rejects_what_comes_back() -> None:
    from server_app.grid import PollingGrid

    content = _content(np.random.default_rng(2))

    def node(m: Message) -> Message:  # the ClientApp's packing mod: unpack, answer, pack
        got = unpack(m.content)
        return Message(pack(RecordDict({"metrics": got["metrics"]})), reply_to=m)

    inner = _Grid(node)
    grid = PollingGrid(inner, pack=True)  # type: ignore[arg-type]
    [reply] = grid.send_and_receive([_query(content)])
    assert is_packed(inner.wire[0])
    assert dict(reply.content["metrics"]) == dict(content["metrics"])
    broken = _Grid(lambda m: Message(_with_blob(b"garbage"), reply_to=m))
    [reply] = PollingGrid(broken, pack=True).send_and_receive([_query(content)])  # type: ignore[arg-type]
    assert reply.has_error() and "does not unpack" in reply.error.reason
    plain = _Grid(lambda m: Message(RecordDict({"metrics": m.content["metrics"]}), reply_to=m))
    [reply] = PollingGrid(plain).send_and_receive([_query(content)])  # type: ignore[arg-type]
    assert not is_packed(plain.wire[0]) and "metrics" in reply.content


def test_the_clientapp_answers_packed_with_packed_and_plain_with_plain() -> None:
    from client_app.app import packing

    seen = []

    def handler(msg: Message, context: Context) -> Message:
        seen.append(dict(msg.content["config"]))
        return Message(RecordDict({"metrics": MetricRecord({"ok": 1})}), reply_to=msg)

    context = Context(run_id=1, node_id=9, node_config={}, state=RecordDict(), run_config={})
    content = _content(np.random.default_rng(3))
    packed = _query(pack(content))
    packed.metadata.__dict__["_message_id"] = packed.object_id
    reply = packing(packed, context, handler)
    assert is_packed(reply.content) and dict(unpack(reply.content)["metrics"]) == {"ok": 1}
    assert seen[-1] == dict(content["config"])  # the handler saw the records
    plain = _query(_content(np.random.default_rng(3)))
    plain.metadata.__dict__["_message_id"] = plain.object_id
    assert not is_packed(packing(plain, context, handler).content)
    bad = _query(_with_blob(b"garbage"))
    bad.metadata.__dict__["_message_id"] = bad.object_id
    answer = packing(bad, context, handler)
    assert answer.has_error() and "unpack" in answer.error.reason


def test_a_pulled_reply_is_unpacked_as_it_is_inflated() -> None:
    """Part unpack-on-arrival: the packing grid has Flower's pull inflate each reply
    unpacked, so a pull of many replies never holds them all packed; one that does
    not unpack stays packed for the grid to reject."""
    import importlib

    from server_app.grid import HTTP_GRID, PollingGrid, UnpackOnArrival

    content = _content(np.random.default_rng(3))
    PollingGrid(_Grid(lambda m: m), pack=True)  # type: ignore[arg-type]
    inflate = importlib.import_module(HTTP_GRID).inflate_object_from_contents
    assert isinstance(inflate, UnpackOnArrival)
    PollingGrid(_Grid(lambda m: m), pack=True)  # type: ignore[arg-type]
    again = importlib.import_module(HTTP_GRID).inflate_object_from_contents
    assert again.inflate is inflate.inflate  # wrapped once, however many grids

    sent = Message(pack(content, inline_max=0), dst_node_id=9, message_type="train.x")
    got = UnpackOnArrival(lambda *_: sent)("id", {})
    assert not is_packed(got.content) and list(got.content) == list(content)
    bad = Message(_with_blob(b"garbage"), dst_node_id=9, message_type="train.x")
    assert is_packed(UnpackOnArrival(lambda *_: bad)("id", {}).content)
