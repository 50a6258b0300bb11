"""Robust aggregation: coordinate-wise trimmed means and medians, and norm screening.

``robust.aggregate`` replaces the weighted mean of the methods whose server averages
arrays; ``robust.max-norm-ratio`` rejects an upload whose size, in the form the
server aggregates, is far beyond the round's median (docs/robustness.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from common.records import Arrays, weighted_mean

HALF_TOL = 1e-12
"""Cumulative weights this close to one half count as exactly half (a tie)."""


def trimmed_mean(values: np.ndarray, weights: Sequence[float], trim: float) -> np.ndarray:
    """Coordinate-wise weighted trimmed mean of ``values`` [K, ...]: per coordinate the
    K values are sorted, the lowest and the highest ``trim`` of the total weight are
    cut (a value straddling a cut keeps the part inside), and the rest is averaged
    with its weights. ``trim = 0`` is the weighted mean; with K equal weights and
    ``trim · K`` whole it is the classic trimmed mean."""
    if not 0 <= trim < 0.5:
        raise ValueError(f"trim must be in [0, 0.5), got {trim}")
    return _window_mean(values, weights, trim, 1 - trim)


def weighted_median(values: np.ndarray, weights: Sequence[float]) -> np.ndarray:
    """Coordinate-wise weighted median of ``values`` [K, ...]: the value at half the
    total weight (the mean of the two values around it when half falls exactly
    between them, as ``np.median`` does for equal weights and an even K)."""
    w = _normalised(weights, values.shape[0])
    v = values.astype(np.float64)
    order = np.argsort(v, axis=0, kind="stable")
    sorted_v = np.take_along_axis(v, order, axis=0)
    upper = np.cumsum(w[order], axis=0)
    first = np.argmax(upper >= 0.5 - HALF_TOL, axis=0)[None]
    value = np.take_along_axis(sorted_v, first, axis=0)[0]
    tie = np.abs(np.take_along_axis(upper, first, axis=0)[0] - 0.5) <= HALF_TOL
    after = np.minimum(first + 1, v.shape[0] - 1)
    following = np.take_along_axis(sorted_v, after, axis=0)[0]
    return np.where(tie, (value + following) / 2, value)


def _normalised(weights: Sequence[float], count: int) -> np.ndarray:
    w = np.asarray(weights, dtype=np.float64)
    if count != len(w) or len(w) == 0:
        raise ValueError(f"{count} values for {len(w)} weights")
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError("weights must be non-negative with a positive sum")
    return w / w.sum()


def _window_mean(values: np.ndarray, weights: Sequence[float], lo: float, hi: float) -> np.ndarray:
    w = _normalised(weights, values.shape[0])
    v = values.astype(np.float64)
    order = np.argsort(v, axis=0, kind="stable")
    sorted_v = np.take_along_axis(v, order, axis=0)
    ws = w[order]  # each value's weight, in sorted order
    upper = np.cumsum(ws, axis=0)
    lower = upper - ws
    eff = np.clip(np.minimum(upper, hi) - np.maximum(lower, lo), 0.0, None)
    return (sorted_v * eff).sum(axis=0) / eff.sum(axis=0)


def robust_mean(
    arrays: Sequence[Arrays], weights: Sequence[float], like: Arrays, rule: str, trim: float
) -> Arrays:
    """Key by key: ``rule`` = ``mean`` (:func:`common.records.weighted_mean`, as
    without this module), ``trimmed-mean`` (:func:`trimmed_mean` with ``trim``) or
    ``median`` (:func:`weighted_median`), cast to the dtype of the same key in ``like``."""
    if not arrays:
        raise ValueError("robust_mean of no arrays")
    if rule == "mean":
        return weighted_mean(arrays, weights, like)
    out: Arrays = {}
    for key in arrays[0]:
        stacked = np.stack([a[key] for a in arrays])
        if rule == "median":
            value = weighted_median(stacked, weights)
        elif rule == "trimmed-mean":
            value = trimmed_mean(stacked, weights, trim)
        else:
            raise ValueError(f"unknown robust.aggregate {rule!r}")
        out[key] = value.astype(like[key].dtype)
    return out


def norm_outliers(norms: dict[int, float], ratio: float) -> dict[int, str]:
    """Who is beyond ``ratio`` × the median of ``norms`` (node -> reason); nobody
    when ``ratio`` is 0 (off), with fewer than 3 norms, or a zero median."""
    if ratio <= 0 or len(norms) < 3:
        return {}
    median = float(np.median(list(norms.values())))
    if median <= 0:
        return {}
    return {
        node: f"size {value:.3g} is {value / median:.1f}× the round's median {median:.3g} "
        f"(robust.max-norm-ratio {ratio:g})"
        for node, value in norms.items()
        if value > ratio * median
    }


def update_norm(upload: Arrays, served: Arrays) -> float:
    """‖upload − served‖ over the floating-point keys both have (the update a
    parameter upload makes to what it was sent)."""
    total = 0.0
    for key, value in upload.items():
        ref = served.get(key)
        if ref is None or not np.issubdtype(value.dtype, np.floating):
            continue
        diff = value.astype(np.float64) - ref.astype(np.float64)
        total += float(np.square(diff).sum())
    return float(np.sqrt(total))


def largest_row_norm(upload: Arrays) -> float:
    """The largest L2 norm of any prototype or representation in an upload (each
    1-D array, or each row of a 2-D one)."""
    best = 0.0
    for value in upload.values():
        rows = value.reshape(1, -1) if value.ndim == 1 else value.reshape(value.shape[0], -1)
        best = max(best, float(np.linalg.norm(rows.astype(np.float64), axis=1).max()))
    return best


def flat_update(upload: Arrays, served: Arrays) -> np.ndarray:
    """``upload − served`` over the floating-point keys both have, flattened in key
    order (float64)."""
    parts = [
        value.astype(np.float64).ravel() - served[key].astype(np.float64).ravel()
        for key, value in sorted(upload.items())
        if key in served
        and np.issubdtype(value.dtype, np.floating)
        and served[key].shape == value.shape
    ]
    return np.concatenate(parts) if parts else np.zeros(0)


def direction_outliers(updates: dict[int, np.ndarray], min_cosine: float) -> dict[int, str]:
    """Who points away from the round: each update's cosine with the coordinate-wise
    median update below ``min_cosine`` (node -> reason); nobody with fewer than 3
    updates or a zero median.

    Two passes: the first judges every update against the median of all of them; the
    second judges every update again, against the median of those the first kept (a
    minority that points one way drags the first median towards itself: honest
    updates then look less aligned than they are, and hostile ones more)."""
    if len(updates) < 3:
        return {}
    first = _direction_pass(updates, updates, min_cosine)
    kept = {n: v for n, v in updates.items() if n not in first}
    if not first or len(kept) < 3:
        return first
    return _direction_pass(updates, kept, min_cosine)


def _direction_pass(
    updates: dict[int, np.ndarray], reference: dict[int, np.ndarray], min_cosine: float
) -> dict[int, str]:
    median = np.median(np.stack(list(reference.values())), axis=0)
    ref = float(np.linalg.norm(median))
    if ref == 0:
        return {}
    out = {}
    for node, vector in updates.items():
        norm = float(np.linalg.norm(vector))
        cos = float(vector @ median) / (norm * ref) if norm > 0 else 0.0
        if cos < min_cosine:
            out[node] = (
                f"update direction: cosine {cos:.2f} with the round's median update "
                f"(robust.min-cosine {min_cosine:g})"
            )
    return out


PROTOTYPE_SCREENS = ("none", "screen", "median")
"""``robust.prototypes``: how the servers that train on prototypes (fedgh, fedtgp,
fedproto) or on entangled representations (fedre) treat each class's uploads."""


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    """cos(a, b); 0 when either is zero."""
    na, nb = float(np.linalg.norm(a)), float(np.linalg.norm(b))
    return float(a @ b) / (na * nb) if na > 0 and nb > 0 else 0.0


def class_outliers(
    groups: dict[int, dict[int, np.ndarray]], min_cosine: float, max_ratio: float
) -> dict[int, dict[int, str]]:
    """Per class, who does not look like the class: ``groups`` maps class -> node ->
    that node's prototype of the class. Each class with at least 3 prototypes gets its
    reference, the coordinate-wise median of its prototypes, and a prototype is an
    outlier (node -> class -> reason) when

    - its cosine with its class's median is below ``min_cosine`` (-1: no such test),
    - its norm is above ``max_ratio`` × the median norm of its class's prototypes
      (0: no such test).

    Classes with fewer than 3 prototypes have no reference: nothing in them is judged.
    """
    medians: dict[int, np.ndarray] = {}
    norms: dict[int, float] = {}
    for c, members in groups.items():
        if len(members) >= 3:
            stacked = np.stack([v.astype(np.float64).ravel() for v in members.values()])
            medians[c] = np.median(stacked, axis=0)
            norms[c] = float(np.median(np.linalg.norm(stacked, axis=1)))
    out: dict[int, dict[int, str]] = {}
    for c in sorted(medians):
        for node, value in groups[c].items():
            v = value.astype(np.float64).ravel()
            own = cosine(v, medians[c])
            why = []
            if own < min_cosine:
                why.append(
                    f"cosine {own:.2f} with the class's median "
                    f"(robust.prototype-min-cosine {min_cosine:g})"
                )
            if max_ratio > 0 and norms[c] > 0 and float(np.linalg.norm(v)) > max_ratio * norms[c]:
                ratio = float(np.linalg.norm(v)) / norms[c]
                why.append(
                    f"norm {ratio:.1f}× the class's median norm "
                    f"(robust.prototype-max-norm-ratio {max_ratio:g})"
                )
            if why:
                out.setdefault(node, {})[c] = ", ".join(why)
    return out


def mixture_outliers(
    reps: dict[int, np.ndarray], labels: dict[int, np.ndarray], min_cosine: float, max_ratio: float
) -> dict[int, str]:
    """Screening for entangled representations (FedRE): ``reps`` node -> [n, d] rows,
    each a mixture ``Σ_c w_c p_c`` of class prototypes, with its soft label ``w`` in
    ``labels`` node -> [n, C].

    Per class c the reference is the coordinate-wise median ``m_c`` of every row
    weighted by its ``w_c`` (the rows that hold class c, as much as they hold it), and
    the class's norm ``n_c`` is the median of those rows' norms, weighted the same way;
    a row's expected value is ``Σ_c w_c m_c`` over its classes and its expected norm
    ``Σ_c w_c n_c``. A node is an outlier when any of its rows has a cosine below
    ``min_cosine`` with its expected value, or a norm above ``max_ratio`` × its
    expected norm. (The norm of a coordinate-wise median is no reference for a norm:
    of sparse ReLU features it is far shorter than any of the rows it is taken of.) A
    class needs rows of 3 nodes for a median; a row with weight on a class without one
    is not judged. Node -> reason."""
    if len(reps) < 3:
        return {}
    nodes = sorted(reps)
    x = np.concatenate([reps[n].astype(np.float64).reshape(len(reps[n]), -1) for n in nodes])
    w = np.concatenate([labels[n].astype(np.float64) for n in nodes])
    owner = np.concatenate([[n] * len(reps[n]) for n in nodes])
    lengths = np.linalg.norm(x, axis=1)
    medians: dict[int, np.ndarray] = {}
    norms: dict[int, float] = {}
    for c in range(w.shape[1]):
        holds = w[:, c] > 0
        if len(set(owner[holds].tolist())) >= 3:
            medians[c] = weighted_median(x[holds], w[holds, c].tolist())
            norms[c] = float(weighted_median(lengths[holds], w[holds, c].tolist()))
    out: dict[int, str] = {}
    for i, row in enumerate(x):
        classes = np.flatnonzero(w[i] > 0)
        if any(int(c) not in medians for c in classes):
            continue
        expected = sum(w[i, c] * medians[int(c)] for c in classes)
        why = []
        cos = cosine(row, expected)
        if cos < min_cosine:
            why.append(f"cosine {cos:.2f} with its soft label's mix of class medians")
        ref = sum(float(w[i, c]) * norms[int(c)] for c in classes)
        if max_ratio > 0 and ref > 0 and lengths[i] > max_ratio * ref:
            why.append(f"norm {lengths[i] / ref:.1f}× its soft label's mix of class median norms")
        if why and int(owner[i]) not in out:
            out[int(owner[i])] = (
                f"class screening: row {i - int(np.flatnonzero(owner == owner[i])[0])}: "
                + ", ".join(why)
                + f" (robust.prototype-min-cosine {min_cosine:g}, "
                f"robust.prototype-max-norm-ratio {max_ratio:g}): reply dropped"
            )
    return out
