"""Byte counting and reply checks against hand-computed values."""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ConfigRecord, RecordDict

from common.records import (
    content_bytes,
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
    out = weighted_mean([{"x": a}, {"x": b}, {"x": c}], [1, 2, 7])
    np.testing.assert_allclose(out["x"], (a + 2 * b + 7 * c) / 10, rtol=1e-6)
    assert out["x"].dtype == np.float32
