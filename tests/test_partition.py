"""Properties of the pure partitioners in ``data.partition``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

from common.config import ConfigError
from data.partition import (
    IndexArray,
    dirichlet,
    iid,
    pathological,
    split_train_test,
    stratified_fraction,
)

Partitioner = Callable[[np.ndarray, int, np.random.Generator, int], list[IndexArray]]

PARTITIONERS: dict[str, Partitioner] = {
    "dirichlet": lambda y, n, rng, m: dirichlet(y, n, 0.1, rng, m),
    "dirichlet-1.0": lambda y, n, rng, m: dirichlet(y, n, 1.0, rng, m),
    "pathological": lambda y, n, rng, m: pathological(y, n, 2, rng, m),
    "iid": lambda y, n, rng, m: iid(y, n, rng, m),
}


@pytest.fixture(scope="module")
def fmnist_labels() -> np.ndarray:
    """A Fashion-MNIST-sized label array: 70000 samples, 10 balanced classes."""
    return np.random.default_rng(0).permutation(np.arange(70_000) % 10)


def _assert_partition(parts: list[IndexArray], num_samples: int) -> None:
    for part in parts:
        assert part.dtype == np.int64
        assert np.all(np.diff(part) > 0), "indices must be sorted and unique"
    everything = np.concatenate(parts)
    assert len(everything) == num_samples, "a sample was dropped or duplicated"
    np.testing.assert_array_equal(np.sort(everything), np.arange(num_samples))


@pytest.mark.parametrize("kind", sorted(PARTITIONERS))
def test_every_sample_assigned_once(kind: str, fmnist_labels: np.ndarray) -> None:
    parts = PARTITIONERS[kind](fmnist_labels, 50, np.random.default_rng(1), 12)
    assert len(parts) == 50
    _assert_partition(parts, len(fmnist_labels))
    assert min(len(p) for p in parts) >= 12


@pytest.mark.parametrize("kind", sorted(PARTITIONERS))
def test_deterministic_per_seed(kind: str, fmnist_labels: np.ndarray) -> None:
    labels = fmnist_labels[:5000]
    split = PARTITIONERS[kind]
    first = split(labels, 20, np.random.default_rng(7), 5)
    again = split(labels, 20, np.random.default_rng(7), 5)
    other = split(labels, 20, np.random.default_rng(8), 5)
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_dirichlet_small_alpha_is_label_skewed(fmnist_labels: np.ndarray) -> None:
    parts = dirichlet(fmnist_labels, 50, 0.1, np.random.default_rng(0), min_size=12)
    dominant = [np.bincount(fmnist_labels[p], minlength=10).max() / len(p) for p in parts]
    assert np.mean(dominant) > 0.5
    iid_parts = iid(fmnist_labels, 50, np.random.default_rng(0))
    iid_dominant = [np.bincount(fmnist_labels[p]).max() / len(p) for p in iid_parts]
    assert np.mean(iid_dominant) < 0.2


@pytest.mark.parametrize("kind", sorted(PARTITIONERS))
def test_too_many_clients_is_a_clear_error(kind: str) -> None:
    labels = np.arange(100) % 10
    with pytest.raises(ConfigError, match="1000 clients"):
        PARTITIONERS[kind](labels, 1000, np.random.default_rng(0), 1)


def test_dirichlet_gives_up_with_a_hint() -> None:
    labels = np.repeat(np.arange(10), 10)
    with pytest.raises(ConfigError, match="data.alpha"):
        dirichlet(labels, 10, 0.001, np.random.default_rng(0), 10, max_tries=20)


def test_pathological_classes_per_client(fmnist_labels: np.ndarray) -> None:
    labels = fmnist_labels[:10_000]
    parts = pathological(labels, 20, 2, np.random.default_rng(3), min_size=10)
    held = [set(np.unique(labels[p]).tolist()) for p in parts]
    assert all(len(classes) == 2 for classes in held)
    assert set().union(*held) == set(range(10)), "every class must be used"


def test_pathological_leftover_classes_are_not_dropped() -> None:
    labels = np.repeat(np.arange(10), 30)
    parts = pathological(labels, 3, 2, np.random.default_rng(0))
    _assert_partition(parts, len(labels))
    held = sorted(len(np.unique(labels[p])) for p in parts)
    assert sum(held) == 10 and held[0] >= 2


def test_pathological_rejects_too_many_classes() -> None:
    with pytest.raises(ConfigError, match="data.classes-per-client"):
        pathological(np.arange(40) % 4, 2, 5, np.random.default_rng(0))


def test_iid_sizes_are_balanced() -> None:
    parts = iid(np.zeros(1003, dtype=np.int64), 10, np.random.default_rng(0))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1
    _assert_partition(parts, 1003)


def test_split_train_test_plain_75_25() -> None:
    indices = np.arange(100, 300)
    train, test = split_train_test(indices, 0.75, np.random.default_rng(0))
    assert (len(train), len(test)) == (150, 50)
    assert not set(train.tolist()) & set(test.tolist())
    np.testing.assert_array_equal(np.sort(np.concatenate([train, test])), indices)
    again = split_train_test(indices, 0.75, np.random.default_rng(0))
    np.testing.assert_array_equal(train, again[0])


def test_split_train_test_respects_minimums() -> None:
    train, test = split_train_test(np.arange(5), 0.75, np.random.default_rng(0), 2, 2)
    assert (len(train), len(test)) == (3, 2)
    train, test = split_train_test(np.arange(4), 0.9, np.random.default_rng(0), 1, 2)
    assert (len(train), len(test)) == (2, 2)
    with pytest.raises(ConfigError, match="data.min-train-samples"):
        split_train_test(np.arange(11), 0.75, np.random.default_rng(0), 10, 2)


def test_stratified_fraction_keeps_every_class_and_is_seeded() -> None:
    labels = np.concatenate([np.repeat(np.arange(9), 100), [9]])  # class 9: 1 sample
    kept = stratified_fraction(labels, 0.1, np.random.default_rng(0))
    assert set(np.unique(labels[kept]).tolist()) == set(range(10))
    assert len(kept) == 9 * 10 + 1
    assert np.all(np.diff(kept) > 0)
    same = stratified_fraction(labels, 0.1, np.random.default_rng(0))
    other = stratified_fraction(labels, 0.1, np.random.default_rng(1))
    np.testing.assert_array_equal(kept, same)
    assert not np.array_equal(kept, other)
    full = stratified_fraction(labels, 1.0, np.random.default_rng(0))
    np.testing.assert_array_equal(full, np.arange(len(labels)))
