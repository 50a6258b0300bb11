"""Byte counting and reply checks against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from flwr.app import Array, ConfigRecord, RecordDict
from numpy.lib import format as npy

from common.records import (
    MalformedArray,
    capped_shares,
    content_bytes,
    decode,
    invalid_reason,
    payload_bytes,
    to_numpy,
    to_record,
    weighted_mean,
)


def test_payload_bytes_is_numel_times_itemsize() -> None:
    rec = to_record(
        {
            "w": torch.zeros(10, 500),
            "b": np.zeros(10, np.float64),
            "i": np.zeros(3, np.int64),
        }
    )
    assert payload_bytes(rec) == 10 * 500 * 4 + 10 * 8 + 3 * 8


def test_content_bytes_ignores_config_and_sums_records() -> None:
    content = RecordDict(
        {
            "a": to_record({"x": np.ones((2, 3), np.float32)}),
            "b": to_record({"y": np.ones(5, np.float32)}),
            "config": ConfigRecord({"k": "v" * 100}),
        }
    )
    assert content_bytes(content) == (6 + 5) * 4


def test_round_trip_keeps_names_and_values() -> None:
    arrays = {"head.weight": np.random.default_rng(0).normal(size=(3, 4)).astype(np.float32)}
    back = to_numpy(to_record(arrays))
    assert list(back) == ["head.weight"]
    np.testing.assert_array_equal(back["head.weight"], arrays["head.weight"])


def test_invalid_reason_catches_keys_shapes_and_nonfinite() -> None:
    good = {"w": np.ones((2, 2), np.float32)}
    expected = {"w": (2, 2)}
    assert invalid_reason(good, expected) is None
    assert "wrong keys" in str(invalid_reason({"v": good["w"]}, expected))
    assert "wrong shape" in str(invalid_reason({"w": np.ones((2, 3), np.float32)}, expected))
    for bad in (np.nan, np.inf, -np.inf):
        arr = good["w"].copy()
        arr[0, 1] = bad
        assert "non-finite" in str(invalid_reason({"w": arr}, expected))


def test_weighted_mean_matches_closed_form() -> None:
    rng = np.random.default_rng(1)
    a, b, c = (rng.normal(size=(4,)).astype(np.float32) for _ in range(3))
    out = weighted_mean([{"x": a}, {"x": b}, {"x": c}], [1, 2, 7], {"x": a})
    np.testing.assert_allclose(out["x"], (a + 2 * b + 7 * c) / 10, rtol=1e-6)
    assert out["x"].dtype == np.float32


def test_a_mean_takes_the_globals_dtype_not_the_first_replys() -> None:
    """On the old code the result took the first reply's dtype: an int64 reply of
    zeros first turned the mean of 0 and 0.7 into int64 0."""
    zeros, point7 = np.zeros(3, np.int64), np.full(3, 0.7, np.float32)
    out = weighted_mean([{"x": zeros}, {"x": point7}], [1, 1], {"x": point7})
    assert out["x"].dtype == np.float32
    np.testing.assert_allclose(out["x"], 0.35, rtol=1e-6)


@pytest.mark.parametrize(
    ("weights", "cap", "want"),
    [
        ([1, 1, 8], 1.0, [0.1, 0.1, 0.8]),
        ([1, 1, 8], 0.5, [0.25, 0.25, 0.5]),  # 0.3 excess shared in proportion 1:1
        ([1, 3, 96], 0.5, [0.125, 0.375, 0.5]),
        ([1, 1, 1e12], 0.4, [0.3, 0.3, 0.4]),
        ([5, 5], 0.2, [0.5, 0.5]),  # a cap below 1/n: equal shares
    ],
)
def test_capped_shares(weights: list[float], cap: float, want: list[float]) -> None:
    np.testing.assert_allclose(capped_shares(weights, cap), want, rtol=1e-9)


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        (np.zeros((2, 3), np.int64), "dtype int64"),
        (np.zeros((2, 3), np.float64), "dtype float64"),
        (np.zeros((2, 3), np.complex64), "dtype complex64"),
        (np.zeros((2, 3), np.float16), "dtype float16"),
    ],
)
def test_only_the_served_dtype_is_accepted(value: np.ndarray, reason: str) -> None:
    assert reason in str(invalid_reason({"w": value}, {"w": (2, 3)}))
    assert invalid_reason({"w": value.real.astype(np.float32)}, {"w": (2, 3)}) is None


@pytest.mark.parametrize(
    "value",
    [
        np.arange(24, dtype=np.float32).reshape(2, 3, 4),
        np.asfortranarray(np.arange(12, dtype=np.float64).reshape(3, 4)),
        np.arange(6, dtype=">i4").reshape(2, 3),
        np.array(3.5, np.float32),
        np.zeros((0, 5), np.float32),
        np.array([True, False]),
        np.arange(10, dtype=np.int8)[::3],
    ],
)
def test_decode_equals_flowers_np_load_and_is_writable(value: np.ndarray) -> None:
    arr = Array(value)
    got, want = decode("w", arr), arr.numpy()
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.flags.f_contiguous == want.flags.f_contiguous
    np.testing.assert_array_equal(got, want)
    got[...] = 0  # a copy, not a view of the message's bytes
    np.testing.assert_array_equal(decode("w", arr), want)


def _npy(value: np.ndarray) -> bytes:
    return Array(value).data


@pytest.mark.parametrize(
    "dtype, shape, data, why",
    [
        ("float32", (3,), b"garbage", "not a .npy payload"),
        ("float32", (3,), _npy(np.zeros(3, np.float32))[:-1], "11 data bytes"),
        ("float32", (3,), _npy(np.zeros(3, np.float32)) + b"\0" * 4, "16 data bytes"),
        ("float32", (4,), _npy(np.zeros(3, np.float32)), "!= declared"),
        ("float64", (3,), _npy(np.zeros(3, np.float32)), "!= declared"),
        ("object", (2,), b"", "object dtype"),
    ],
)
def test_decode_names_the_key_of_a_malformed_payload(
    dtype: str, shape: tuple[int, ...], data: bytes, why: str
) -> None:
    if dtype == "object":  # a pickled object array: its header must stop it
        buffer = __import__("io").BytesIO()
        npy.write_array(buffer, np.array([1, "x"], dtype=object), allow_pickle=True)
        data = buffer.getvalue()
    arr = Array(dtype=dtype, shape=shape, stype="numpy.ndarray", data=data)
    with pytest.raises(MalformedArray, match=f"'head.weight'.*{why}"):
        decode("head.weight", arr)
    with pytest.raises(MalformedArray, match="'head.weight'"):
        to_numpy({"head.weight": arr})  # type: ignore[arg-type]
