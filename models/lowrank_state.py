"""FedARA's factorisation at the state-dict level: what the server works on.

The server never builds modules: it decomposes the global extractor's state into the
factorised state of a tier, and reconstructs uploaded factorised states. The key
scheme of a factorised layer ``L`` (relative to the extractor):

* Linear: ``L.u`` ``[m, r]``, ``L.v`` ``[n, r]``, ``L.bias`` (unchanged name).
* Conv: ``L.v_conv.weight`` ``(r, c_in, 1, k)``, ``L.u_conv.weight`` ``(c_out, r, k, 1)``
  and ``L.u_conv.bias`` (maps back to ``L.bias``).

Keys, order and shapes equal ``factorise(extractor, layers, ratio).state_dict()``.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch
from torch import Tensor

from models.lowrank import (
    Svd,
    _as_matrix,
    _check_ratio,
    _conv_to_u,
    _conv_to_v,
    _matrix_dims,
    _u_to_conv,
    _v_to_conv,
    decompose,
    layer_rank,
    matrix_to_conv,
    reconstruct,
)

__all__ = [
    "coverage_normalised",
    "decompose_state",
    "factors_from_state",
    "factors_to_state",
    "lowrank_state_keys",
    "reconstruct_state",
    "served_residual",
    "served_updates",
    "weighted_reconstruction",
]


def lowrank_state_keys(layer: str, shape: tuple[int, ...]) -> tuple[str, str]:
    """State-dict keys ``(U key, V key)`` of a factorised ``layer``.

    ``shape`` (the original weight shape) selects the layer type: Linear
    ``("L.u", "L.v")``, conv ``("L.u_conv.weight", "L.v_conv.weight")``.
    """
    _matrix_dims(shape)
    if len(shape) == 2:
        return f"{layer}.u", f"{layer}.v"
    return f"{layer}.u_conv.weight", f"{layer}.v_conv.weight"


def _bias_keys(layer: str, shape: tuple[int, ...]) -> tuple[str, str]:
    """``(factorised bias key, original bias key)`` of ``layer``."""
    lowrank = f"{layer}.bias" if len(shape) == 2 else f"{layer}.u_conv.bias"
    return lowrank, f"{layer}.bias"


def factors_from_state(
    state: Mapping[str, Tensor], layer: str, shape: tuple[int, ...]
) -> tuple[Tensor, Tensor]:
    """Read ``(U [rows, r], V [cols, r])`` of ``layer`` from a factorised state."""
    u_key, v_key = lowrank_state_keys(layer, shape)
    u, v = state[u_key], state[v_key]
    if len(shape) == 4:
        u, v = _conv_to_u(u), _conv_to_v(v)
    if (u.shape[0], v.shape[0]) != _matrix_dims(shape) or u.shape[1] != v.shape[1]:
        raise ValueError(f"factors of {layer!r} do not fit weight shape {shape}")
    return u, v


def factors_to_state(u: Tensor, v: Tensor, layer: str, shape: tuple[int, ...]) -> dict[str, Tensor]:
    """State entries of ``layer``'s factors (module order; bias not included)."""
    u_key, v_key = lowrank_state_keys(layer, shape)
    if len(shape) == 2:
        return {u_key: u, v_key: v}
    c_out, c_in, k, _ = shape
    return {v_key: _v_to_conv(v, c_in, k), u_key: _u_to_conv(u, c_out, k)}


def _layer_of(key: str, layers: Mapping[str, tuple[int, ...]]) -> str | None:
    """The layer in ``layers`` owning ``key`` (longest matching prefix)."""
    owners = [name for name in layers if key.startswith(name + ".")]
    return max(owners, key=len) if owners else None


def _convert_state(
    state: Mapping[str, Tensor],
    layers: Mapping[str, tuple[int, ...]],
    convert: dict[str, dict[str, Tensor]],
) -> dict[str, Tensor]:
    """Copy ``state``, replacing the keys of each layer in ``convert`` (at the
    position of its first key) by ``convert[layer]``."""
    out: dict[str, Tensor] = {}
    for key, value in state.items():
        layer = _layer_of(key, layers)
        if layer is None or layer not in convert:
            out[key] = value
        elif not any(k in out for k in convert[layer]):
            out.update(convert[layer])
    return out


def reconstruct_state(
    state: Mapping[str, Tensor], layers: Mapping[str, tuple[int, ...]]
) -> dict[str, Tensor]:
    """Factorised extractor state -> full-rank extractor state.

    Each layer of ``layers`` (name -> original weight shape) whose factors are
    in ``state`` becomes ``L.weight`` (and ``L.bias``); layers stored full
    (ratio 1) and all other keys are kept unchanged, in the original order.
    """
    convert: dict[str, dict[str, Tensor]] = {}
    for layer, shape in layers.items():
        if lowrank_state_keys(layer, shape)[0] not in state:
            continue
        u, v = factors_from_state(state, layer, shape)
        entries = {f"{layer}.weight": reconstruct(u, v, shape)}
        lowrank_bias, bias = _bias_keys(layer, shape)
        if lowrank_bias in state:
            entries[bias] = state[lowrank_bias]
        convert[layer] = entries
    return _convert_state(state, layers, convert)


def decompose_state(
    state: Mapping[str, Tensor],
    layers: Mapping[str, tuple[int, ...]],
    ratio: float,
    svds: Mapping[str, Svd] | None = None,
    gains: Mapping[str, float] | None = None,
) -> dict[str, Tensor]:
    """Full-rank extractor state -> the state of ``factorise(.., ratio)``.

    Keys, order and shapes equal ``factorise(extractor, list(layers), ratio)
    .state_dict()``; ``ratio == 1`` returns a shallow copy of ``state``.
    ``svds`` (layer -> :func:`thin_svd` of its weight) avoids recomputing SVDs.
    ``gains`` (layer -> g) scales both factors by √g, so ``U Vᵀ = g · W_r``.
    """
    _check_ratio(ratio)
    if ratio == 1.0:
        return dict(state)
    convert: dict[str, dict[str, Tensor]] = {}
    for layer, shape in layers.items():
        weight = state[f"{layer}.weight"]
        if tuple(weight.shape) != tuple(shape):
            raise ValueError(f"{layer}.weight is {tuple(weight.shape)}, not {shape}")
        u, v = decompose(weight, layer_rank(shape, ratio), (svds or {}).get(layer))
        root = math.sqrt((gains or {}).get(layer, 1.0))
        if root != 1.0:
            u, v = u * root, v * root
        entries = factors_to_state(u.to(weight.dtype), v.to(weight.dtype), layer, shape)
        lowrank_bias, bias = _bias_keys(layer, shape)
        if bias in state:
            entries[lowrank_bias] = state[bias]
        convert[layer] = entries
    return _convert_state(state, layers, convert)


def weighted_reconstruction(
    states: Sequence[Mapping[str, Tensor]],
    weights: Sequence[float],
    layers: Mapping[str, tuple[int, ...]],
    product_scales: Sequence[Mapping[str, float]] | None = None,
) -> dict[str, Tensor]:
    """``Σ_k w_k · reconstruct_state(states[k])`` (weights normalised), streaming.

    ``product_scales[k][layer]`` (default 1) multiplies state k's factor product of
    that layer (FedARA divides by the gain a tier was served with).

    Each state may be factorised at its own rank or full (ratio 1). For a layer,
    ``Σ_k w_k U_k V_kᵀ`` is accumulated in place, one ``addmm`` per state into a
    float32 matrix of the weight's size: the same arithmetic as reconstructing client
    by client, without copying any factor and without holding every client's
    full-rank weights in memory. The factor products and their running sum are
    float32 (the factors' dtype); that sum and every other term are added in float64,
    which is the dtype of the returned tensors.
    """
    total = float(sum(weights))
    if not states or total <= 0:
        raise ValueError("need at least one state and a positive total weight")
    acc: dict[str, Tensor] = {}
    products: dict[str, Tensor] = {}

    def add(key: str, value: Tensor, w: float) -> None:
        if key in acc:
            acc[key].add_(value, alpha=w)  # promoted into the float64 accumulator
        else:
            acc[key] = value.double() * w

    scales = product_scales or [{}] * len(states)
    for state, weight, scale in zip(states, weights, scales, strict=True):
        w = float(weight) / total
        factorised = {n for n, sh in layers.items() if lowrank_state_keys(n, sh)[0] in state}
        for layer in factorised:
            u, v = factors_from_state(state, layer, layers[layer])
            if layer not in products:
                products[layer] = torch.zeros(_matrix_dims(layers[layer]), dtype=torch.float32)
            products[layer].addmm_(u.float(), v.float().T, alpha=w * scale.get(layer, 1.0))
            lowrank_bias, bias = _bias_keys(layer, layers[layer])
            if lowrank_bias in state:
                add(bias, state[lowrank_bias], w)
        for key, value in state.items():
            owner = _layer_of(key, layers)
            if owner is None or owner not in factorised:
                add(key, value, w)
    for layer, product in products.items():
        shape = layers[layer]
        matrix = product if len(shape) == 2 else matrix_to_conv(product, *shape[:3])
        add(f"{layer}.weight", matrix, 1.0)
    return _in_order(acc, states[0], layers)


Reply = tuple[Mapping[str, Tensor], Mapping[str, Tensor], Mapping[str, float]]
"""``(state, served, scales)``: a reply's (factorised or full) extractor state, the
state it was served (same keys and shapes) and layer -> the scale of its products."""


def served_updates(
    replies: Sequence[Reply],
    weights: Sequence[float],
    layers: Mapping[str, tuple[int, ...]],
    workers: int = 1,
) -> tuple[dict[str, Tensor], list[float]]:
    """``Σ_k w_k Δ_k`` (weights normalised) and every ``‖Δ_k‖²_F``.

    Δ_k is reply k's change to what it was served, back at full rank, in the keys of
    the full-rank state: ``s (U'V'ᵀ − U Vᵀ)`` for a layer held as factors (``s``:
    ``scales[layer]``, default 1), ``x' − x`` for every other tensor (a conv
    factorisation's ``u_conv.bias`` is the layer's bias).

    Per reply and factorised layer one float32 ``addmm`` forms ``U'V'ᵀ − U Vᵀ`` in a
    work matrix (starting from −U Vᵀ, formed once per served state); its norm and
    its addition, times ``w_k s``, to a running sum are two passes over that matrix.
    So each reply's product serves both its size and the mean, and nothing of the
    weight's size is allocated per reply. Each factorised layer is one task over the
    replies grouped by the state they were served (in the order of its first reply),
    so what is reread per reply stays in cache; the other tensors are two tasks (the
    replies alternately). Differences and their running sums are float32 (float64
    where a tensor is not float32): a sum of changes, each a small fraction of the
    weights, rounds far below the float32 weights it is added to. The returned sums
    are float64.

    ``workers > 1``: the tasks run on that many threads, torch single-threaded
    meanwhile (one product per core, the passes over one layer's matrices beside
    another layer's product, and no thread of a parallel product waits for a
    descheduled one). Each task's arithmetic is the same either way, so the result
    equals that of ``workers = 1`` under one torch thread.
    """
    total = float(sum(weights))
    if not replies or total <= 0:
        raise ValueError("need at least one reply and a positive total weight")
    first: dict[int, int] = {}
    for k, (_, served, _) in enumerate(replies):
        first.setdefault(id(served), k)
    order = sorted(range(len(replies)), key=lambda k: first[id(replies[k][1])])
    shares = [float(w) / total for w in weights]
    tasks = [
        functools.partial(_product_changes, replies, shares, order, layer, shape)
        for layer, shape in layers.items()
    ]
    tasks += [  # in two tasks, each taking the first core free
        functools.partial(_other_changes, replies, shares, order[start::2], layers)
        for start in (0, 1)
    ]
    squares = [0.0] * len(replies)
    sums: dict[str, Tensor] = {}
    for changes, task_squares in _run(tasks, workers):
        for k, square in task_squares.items():
            squares[k] += square
        for key, value in changes.items():
            sums[key] = sums[key].add_(value) if key in sums else value
    out = {key: value.double() for key, value in sums.items()}
    return _in_order(out, replies[0][0], layers), squares


Changes = tuple[dict[str, Tensor], dict[int, float]]
"""Summed changes by full-rank key, and squared norms by reply index."""


def _run(tasks: Sequence[Callable[[], Changes]], workers: int) -> list[Changes]:
    """Each task's result, in order: on ``workers`` threads with torch single-threaded."""
    if workers <= 1:
        return [task() for task in tasks]
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with ThreadPoolExecutor(workers) as pool:
            return list(pool.map(lambda task: task(), tasks))
    finally:
        torch.set_num_threads(threads)


def _product_changes(
    replies: Sequence[Reply],
    shares: Sequence[float],
    order: Sequence[int],
    layer: str,
    shape: tuple[int, ...],
) -> Changes:
    """``Σ_k w_k s_k (U'_k V'_kᵀ − U_k V_kᵀ)`` of one layer over the replies that hold
    it as factors (float32, the weight's shape), and each change's squared norm."""
    key = lowrank_state_keys(layer, shape)[0]
    held = [k for k in order if key in replies[k][0]]
    if not held:
        return {}, {}
    work = torch.empty(_matrix_dims(shape), dtype=torch.float32)
    total = torch.zeros(_matrix_dims(shape), dtype=torch.float32)
    negative, current, squares = work, -1, {}
    for k in held:
        state, served, scales = replies[k]
        if id(served) != current:
            su, sv = factors_from_state(served, layer, shape)
            negative, current = -(su.float() @ sv.float().T), id(served)
        u, v = factors_from_state(state, layer, shape)
        change = torch.addmm(negative, u.float(), v.float().T, out=work)
        scale = scales.get(layer, 1.0)
        squares[k] = scale**2 * float(torch.linalg.vector_norm(change)) ** 2
        total.add_(change, alpha=shares[k] * scale)
    matrix = total if len(shape) == 2 else matrix_to_conv(total, *shape[:3])
    return {f"{layer}.weight": matrix}, squares


def _other_changes(
    replies: Sequence[Reply],
    shares: Sequence[float],
    order: Sequence[int],
    layers: Mapping[str, tuple[int, ...]],
) -> Changes:
    """``Σ_k w_k (x'_k − x_k)`` of every tensor that is not a factor, by full-rank key,
    and each reply's squared norm of those changes (over the replies ``order`` names)."""
    sums: dict[str, Tensor] = {}
    work: dict[str, Tensor] = {}
    squares = {}
    targets: dict[tuple[str, ...], dict[str, str]] = {}
    for k in order:
        state, served, _ = replies[k]
        names = tuple(state)
        if names not in targets:
            targets[names] = _full_rank_keys(names, layers)
        squares[k] = 0.0
        for key, target in targets[names].items():
            change = _difference(state[key], served[key], work, key)
            squares[k] += float(torch.linalg.vector_norm(change)) ** 2
            if target not in sums:
                sums[target] = torch.zeros_like(change)
            sums[target].add_(change, alpha=shares[k])
    return sums, squares


def _full_rank_keys(names: Sequence[str], layers: Mapping[str, tuple[int, ...]]) -> dict[str, str]:
    """State key -> full-rank key of every key of a state that is not a factor."""
    held = [n for n, sh in layers.items() if lowrank_state_keys(n, sh)[0] in names]
    factors = {key for n in held for key in lowrank_state_keys(n, layers[n])}
    biases = dict(_bias_keys(n, layers[n]) for n in held)
    return {key: biases.get(key, key) for key in names if key not in factors}


def _difference(a: Tensor, b: Tensor, work: dict[str, Tensor], key: str) -> Tensor:
    """``a − b``: in ``work[key]`` (float32, reused) when both are float32."""
    if a.dtype != torch.float32 or b.dtype != torch.float32:
        return a.double() - b.double()
    if key not in work or work[key].shape != a.shape:
        work[key] = torch.empty_like(a)
    return torch.sub(a, b, out=work[key])


def _in_order(
    acc: dict[str, Tensor], first: Mapping[str, Tensor], layers: Mapping[str, tuple[int, ...]]
) -> dict[str, Tensor]:
    """``acc`` in the key order of the full-rank extractor state (``first``'s order,
    a factorised layer's keys replaced by its weight and bias, as
    :func:`reconstruct_state` orders them)."""
    convert = {
        layer: {k: acc[k] for k in (f"{layer}.weight", f"{layer}.bias") if k in acc}
        for layer, shape in layers.items()
        if lowrank_state_keys(layer, shape)[0] in first
    }
    order = list(_convert_state(first, layers, convert))
    return {k: acc[k] for k in order} | {k: v for k, v in acc.items() if k not in order}


def served_residual(
    full: Mapping[str, Tensor],
    tiers: Sequence[tuple[Mapping[str, Tensor], float, Mapping[str, float]]],
    layers: Mapping[str, tuple[int, ...]],
) -> dict[str, Tensor]:
    """``Σ_t s_t (W − U_t V_tᵀ / g_t)`` (float64) of every layer some tier holds as factors.

    ``tiers`` lists ``(served, s, gains)``: the factorised state a tier was served,
    decomposed from the full-rank state ``full`` with ``gains`` (layer -> g, default
    1), and the tier's weight ``s``. Each ``U_t V_tᵀ`` is formed in float64 from the
    float32 factors that were actually sent (one ``addmm`` per tier into one float64
    matrix per layer), so adding the result to what the tiers return (divided by g)
    gives back ``Σ_t s_t W`` exactly when every client returned what it was served.
    Layers a tier got full have no residual there (served = global) and add nothing.
    """
    out: dict[str, Tensor] = {}
    for layer, shape in layers.items():
        acc: Tensor | None = None
        share = 0.0
        for served, weight, gains in tiers:
            if lowrank_state_keys(layer, shape)[0] not in served:
                continue
            u, v = factors_from_state(served, layer, shape)
            if acc is None:
                acc = torch.zeros(_matrix_dims(shape), dtype=torch.float64)
            acc.addmm_(u.double(), v.double().T, alpha=weight / gains.get(layer, 1.0))
            share += weight
        if acc is None:
            continue
        key = f"{layer}.weight"
        product = acc if len(shape) == 2 else matrix_to_conv(acc, *shape[:3])
        out[key] = full[key].double() * share - product
    return out


def coverage_normalised(
    delta: Tensor, svd: Svd, cover: Tensor, tail: float, dtype: torch.dtype = torch.float64
) -> Tensor:
    """Divide each singular direction's share of an aggregated update by the weight
    of the clients that could change it.

    ``delta`` is ``Σ_k w_k Δ_k`` for one layer (weight shape, float64); ``svd`` =
    ``(P [rows, k], S, Qᵀ [k, cols])``, the leading singular vectors of the global
    layer the clients were served; ``cover[t]`` (t < k) is the total weight of the
    clients whose rank exceeds t (full-rank ones included), ``tail`` that of the
    full-rank clients. A client of rank r changes ``U Vᵀ`` only where
    ``min(i, j) < r`` in that basis (``ΔU Vᵀ`` lies in the column span of Q_r,
    ``U ΔVᵀ`` in that of P_r; the second-order ``ΔU ΔVᵀ`` is neglected), so the
    entry ``(i, j)`` is divided by ``cover[min(i, j)]``; directions outside both
    leading bases by ``tail``. Weight 0 gives 0 (nobody could change it).
    With ``cover ≡ tail ≡ 1`` the result is ``delta``.

    The result is float64; the four products of ``delta``'s size that project it
    onto the basis and back run in ``dtype`` (the server uses float32, half the
    time: they make a correction to an update, whose rounding at 1e-7 of that
    update is far below the float32 global weights it is added to).
    """
    shape = tuple(delta.shape)
    d = _as_matrix(delta).double()
    p, _, qt = svd
    p, q = p.to(dtype), qt.to(dtype).T
    k = p.shape[1]
    inv = torch.where(cover > 0, 1 / cover.double().clamp(min=1e-300), 0.0)[:k].to(dtype)
    inv_tail = 1 / tail if tail > 0 else 0.0
    # d = PAQᵀ-block + P·(rows of A off Q) + (cols of B off P)·Qᵀ + the rest; each
    # block scaled, then collected as inv_tail·d + P X + (Y + P Z) Qᵀ (four products
    # of d's size instead of eight)
    dd = d.to(dtype)
    a = p.T @ dd  # [k, cols]
    b = dd @ q  # [rows, k]
    core = a @ q  # [k, k]
    idx = torch.arange(k)
    grid = inv[torch.minimum(idx[:, None], idx[None, :])]
    extra = inv - inv_tail
    x = extra[:, None] * a
    z = core * grid - inv[:, None] * core - core * inv[None, :] + inv_tail * core
    y = b * extra[None, :] + p @ z
    correction = p @ x
    correction.addmm_(y, q.T)
    out = d * inv_tail
    out += correction
    if len(shape) == 4:
        out = matrix_to_conv(out, shape[0], shape[1], shape[2])
    return out
