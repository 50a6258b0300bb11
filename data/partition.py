"""Pure partitioners: split a label array over clients.

Every function takes an explicit :class:`numpy.random.Generator`, never touches
global random state, and returns index arrays (``int64``, sorted ascending) into
the label array it was given. The client partitioners assign every sample to
exactly one client; they raise :class:`~common.config.ConfigError` when the
requested minimum client size cannot be met.
"""

from __future__ import annotations

import numpy as np
from numpy.typing import ArrayLike, NDArray

from common.errors import ConfigError

IndexArray = NDArray[np.int64]

MAX_TRIES = 1000
"""How often :func:`dirichlet` redraws before giving up on the minimum size."""

_FEW_SAMPLES_HINT = (
    "use fewer clients, a larger data.fraction, or lower "
    "data.min-train-samples / data.min-test-samples"
)


def _check_feasible(num_samples: int, num_clients: int, min_size: int) -> None:
    """Fail early when ``num_clients`` shares of ``min_size`` cannot exist."""
    if num_clients < 1:
        raise ConfigError(f"the number of clients must be >= 1, got {num_clients}")
    if num_clients * min_size > num_samples:
        raise ConfigError(
            f"cannot give each of {num_clients} clients >= {min_size} samples "
            f"from only {num_samples} samples; {_FEW_SAMPLES_HINT}"
        )


def _by_class(labels: NDArray[np.int64]) -> list[IndexArray]:
    """The sample indices of every class present, in class order."""
    return [np.flatnonzero(labels == c).astype(np.int64) for c in np.unique(labels)]


def _finish(shares: list[list[IndexArray]]) -> list[IndexArray]:
    """Concatenate and sort each client's chunks."""
    return [
        np.sort(np.concatenate(chunks)) if chunks else np.empty(0, dtype=np.int64)
        for chunks in shares
    ]


def _as_labels(labels: ArrayLike) -> NDArray[np.int64]:
    array = np.asarray(labels)
    if array.ndim != 1:
        raise ValueError(f"labels must be 1-D, got shape {array.shape}")
    return array.astype(np.int64, copy=False)


def dirichlet(
    labels: ArrayLike,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_size: int = 1,
    max_tries: int = MAX_TRIES,
) -> list[IndexArray]:
    """Label-skewed split: per-class ``Dirichlet(alpha)`` shares over clients.

    The FedLab / PFLlib / HtFLlib scheme: for every class, draw client
    proportions from ``Dirichlet(alpha)`` (clients that already hold more than
    ``N / num_clients`` samples get no more) and cut the shuffled class samples
    accordingly. The whole draw is repeated until every client holds at least
    ``min_size`` samples.

    Parameters
    ----------
    labels : array_like of int, shape (N,)
        Class label of every sample.
    num_clients : int
        Number of shares.
    alpha : float
        Concentration; small values give few classes per client.
    rng : numpy.random.Generator
        Source of all randomness.
    min_size : int, optional
        Smallest allowed share.
    max_tries : int, optional
        Redraws before giving up.

    Returns
    -------
    list of numpy.ndarray
        One sorted ``int64`` index array per client; together a partition of
        ``range(N)``.

    Raises
    ------
    ConfigError
        When no draw within ``max_tries`` gives every client ``min_size`` samples.
    """
    y = _as_labels(labels)
    _check_feasible(len(y), num_clients, min_size)
    by_class = _by_class(y)
    for _ in range(max_tries):
        shares = _dirichlet_draw(by_class, num_clients, alpha, len(y), rng)
        if min(len(s) for s in shares) >= min_size:
            return shares
    raise ConfigError(
        f"no Dirichlet(alpha={alpha}) split in {max_tries} draws gave each of "
        f"{num_clients} clients >= {min_size} samples; raise data.alpha, or "
        f"{_FEW_SAMPLES_HINT}"
    )


def _dirichlet_draw(
    by_class: list[IndexArray],
    num_clients: int,
    alpha: float,
    num_samples: int,
    rng: np.random.Generator,
) -> list[IndexArray]:
    """One Dirichlet draw over all classes (see :func:`dirichlet`)."""
    shares: list[list[IndexArray]] = [[] for _ in range(num_clients)]
    sizes = np.zeros(num_clients, dtype=np.int64)
    for members in by_class:
        shuffled = rng.permutation(members)
        weights = rng.dirichlet(np.full(num_clients, alpha))
        weights = weights * (sizes < num_samples / num_clients)
        total = weights.sum()
        if not np.isfinite(total) or total <= 0:
            weights, total = np.ones(num_clients), float(num_clients)
        cuts = (np.cumsum(weights / total) * len(shuffled)).astype(np.int64)[:-1]
        for client, chunk in enumerate(np.split(shuffled, cuts)):
            shares[client].append(chunk)
            sizes[client] += len(chunk)
    return _finish(shares)


def _class_holders(
    num_classes: int,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
) -> list[list[int]]:
    """Which clients hold each class: round-robin over a shuffled class list.

    Client ``i`` gets the shuffled classes at positions ``i*k .. i*k+k-1``
    (modulo the number of classes), so every class is used whenever
    ``num_clients * k >= num_classes``. Otherwise the classes left over are
    dealt round-robin as extra classes, so that no sample is dropped.
    """
    order = rng.permutation(num_classes)
    holders: list[list[int]] = [[] for _ in range(num_classes)]
    slots = num_clients * classes_per_client
    for slot in range(slots):
        holders[order[slot % num_classes]].append(slot // classes_per_client)
    for extra, position in enumerate(range(slots, num_classes)):
        holders[order[position]].append(extra % num_clients)
    return holders


def pathological(
    labels: ArrayLike,
    num_clients: int,
    classes_per_client: int,
    rng: np.random.Generator,
    min_size: int = 1,
    max_tries: int = 100,
) -> list[IndexArray]:
    """Pathological split: every client holds ``classes_per_client`` classes.

    Classes are assigned round-robin over a shuffled class list (so every class
    is used), and each class's shuffled samples are split evenly among the
    clients that hold it. Every sample is assigned. When
    ``num_clients * classes_per_client`` is smaller than the number of classes,
    the leftover classes go, round-robin, to clients as extra classes.

    Parameters
    ----------
    labels : array_like of int, shape (N,)
        Class label of every sample.
    num_clients : int
        Number of shares.
    classes_per_client : int
        Classes per client; at most the number of classes present.
    rng : numpy.random.Generator
        Source of all randomness.
    min_size : int, optional
        Smallest allowed share.
    max_tries : int, optional
        Class assignments tried before giving up on ``min_size``.

    Returns
    -------
    list of numpy.ndarray
        One sorted ``int64`` index array per client.

    Raises
    ------
    ConfigError
        When ``classes_per_client`` exceeds the number of classes, or no
        assignment gives every client ``min_size`` samples.
    """
    y = _as_labels(labels)
    _check_feasible(len(y), num_clients, min_size)
    by_class = _by_class(y)
    if classes_per_client > len(by_class):
        raise ConfigError(
            f"data.classes-per-client = {classes_per_client} exceeds the "
            f"{len(by_class)} classes in the data; lower it"
        )
    for _ in range(max_tries):
        holders = _class_holders(len(by_class), num_clients, classes_per_client, rng)
        shares: list[list[IndexArray]] = [[] for _ in range(num_clients)]
        for members, owners in zip(by_class, holders, strict=True):
            chunks = np.array_split(rng.permutation(members), len(owners))
            for owner, chunk in zip(owners, chunks, strict=True):
                shares[owner].append(chunk)
        result = _finish(shares)
        if min(len(s) for s in result) >= min_size:
            return result
    raise ConfigError(
        f"no pathological split with data.classes-per-client = "
        f"{classes_per_client} gave each of {num_clients} clients >= {min_size} "
        f"samples; raise data.classes-per-client, or {_FEW_SAMPLES_HINT}"
    )


def iid(
    labels: ArrayLike, num_clients: int, rng: np.random.Generator, min_size: int = 1
) -> list[IndexArray]:
    """Uniform split: shuffle all samples, cut into near-equal shares.

    Parameters
    ----------
    labels : array_like of int, shape (N,)
        Class label of every sample (only its length is used).
    num_clients : int
        Number of shares.
    rng : numpy.random.Generator
        Source of all randomness.
    min_size : int, optional
        Smallest allowed share.

    Returns
    -------
    list of numpy.ndarray
        One sorted ``int64`` index array per client; sizes differ by at most 1.
    """
    y = _as_labels(labels)
    _check_feasible(len(y), num_clients, min_size)
    order = rng.permutation(len(y)).astype(np.int64)
    return [np.sort(part) for part in np.array_split(order, num_clients)]


def split_train_test(
    indices: ArrayLike,
    train_fraction: float,
    rng: np.random.Generator,
    min_train: int = 1,
    min_test: int = 1,
) -> tuple[IndexArray, IndexArray]:
    """Shuffle one client's samples and cut them into local train and test.

    ``floor(n * train_fraction)`` samples go to training (HtFLlib's plain split,
    no stratification), clipped so that training keeps ``min_train`` and the
    test set ``min_test`` samples.

    Parameters
    ----------
    indices : array_like of int
        The client's sample indices.
    train_fraction : float
        Share used for training, in (0, 1).
    rng : numpy.random.Generator
        Source of all randomness.
    min_train, min_test : int, optional
        Smallest allowed train and test sets.

    Returns
    -------
    tuple of numpy.ndarray
        ``(train, test)``: disjoint, sorted, together equal to ``indices``.

    Raises
    ------
    ConfigError
        When ``len(indices) < min_train + min_test``.
    """
    pool = np.asarray(indices, dtype=np.int64)
    n = len(pool)
    if n < min_train + min_test:
        raise ConfigError(
            f"a client with {n} samples cannot keep data.min-train-samples = "
            f"{min_train} and data.min-test-samples = {min_test}; lower them or "
            "give clients more data"
        )
    n_train = min(max(int(n * train_fraction), min_train), n - min_test)
    shuffled = rng.permutation(pool)
    return np.sort(shuffled[:n_train]), np.sort(shuffled[n_train:])


def stratified_fraction(labels: ArrayLike, fraction: float, rng: np.random.Generator) -> IndexArray:
    """A random, per-class share of the samples; no class is ever dropped.

    Parameters
    ----------
    labels : array_like of int, shape (N,)
        Class label of every sample.
    fraction : float
        Share to keep, in (0, 1]; each class keeps ``max(1, round(n_c * f))``.
    rng : numpy.random.Generator
        Source of all randomness.

    Returns
    -------
    numpy.ndarray
        Sorted ``int64`` indices of the kept samples.
    """
    if not 0 < fraction <= 1:
        raise ConfigError(f"data.fraction must be in (0, 1], got {fraction}")
    kept = [
        rng.choice(members, size=max(1, round(len(members) * fraction)), replace=False)
        for members in _by_class(_as_labels(labels))
    ]
    if not kept:
        return np.empty(0, dtype=np.int64)
    return np.sort(np.concatenate(kept)).astype(np.int64)
