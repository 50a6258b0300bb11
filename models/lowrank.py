"""Low-rank factorisation of extractor layers (FedARA).

A Linear weight ``W`` (``m x n``, stored ``[out, in]``) is approximated by
``U V^T`` with ``U: m x r`` and ``V: n x r``. A square-kernel convolution weight
``W`` of shape ``(c_out, c_in, k, k)`` is permuted to ``(c_out, k, c_in, k)`` and
reshaped to the ``(c_out k) x (c_in k)`` matrix ``W'`` with
``W'[o k + i, c k + j] = W[o, c, i, j]`` (``i`` vertical, ``j`` horizontal
kernel index). ``W' ~ U V^T`` runs as a ``1 x k`` convolution ``c_in -> r`` built
from ``V`` followed by a ``k x 1`` convolution ``r -> c_out`` built from ``U``.

State-dict key scheme of a factorised layer ``L`` (relative to the extractor):

* Linear: ``L.u`` ``[m, r]``, ``L.v`` ``[n, r]``, ``L.bias`` (unchanged name).
* Conv: ``L.v_conv.weight`` ``(r, c_in, 1, k)`` with
  ``[s, c, 0, j] = V[c k + j, s]``, ``L.u_conv.weight`` ``(c_out, r, k, 1)`` with
  ``[o, s, i, 0] = U[o k + i, s]`` and ``L.u_conv.bias`` (maps back to ``L.bias``).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = [
    "LowRankConv2d",
    "LowRankLinear",
    "conv_to_matrix",
    "core_energies",
    "core_svd",
    "decompose",
    "default_layers",
    "eckart_young_error",
    "factorisable_layers",
    "factorise",
    "layer_rank",
    "matrix_to_conv",
    "param_count",
    "reconstruct",
    "thin_svd",
    "top_svd",
    "tracked_basis",
]


def _pair(value: int | tuple[int, ...]) -> tuple[int, int]:
    return (value, value) if isinstance(value, int) else (value[0], value[1])


def _matrix_dims(shape: Sequence[int]) -> tuple[int, int]:
    """Rows and columns of the matrix of a Linear or square-kernel conv weight."""
    if len(shape) == 2:
        return int(shape[0]), int(shape[1])
    if len(shape) == 4:
        if shape[2] != shape[3]:
            raise ValueError(f"non-square conv kernel {tuple(shape)} is unsupported")
        return int(shape[0] * shape[2]), int(shape[1] * shape[3])
    raise ValueError(f"expected a 2-D or 4-D weight shape, got {tuple(shape)}")


def conv_to_matrix(w: Tensor) -> Tensor:
    """Reshape a conv weight ``(c_out, c_in, k, k)`` to ``(c_out k, c_in k)``."""
    c_out, c_in, k, _ = w.shape
    _matrix_dims(w.shape)
    return w.permute(0, 2, 1, 3).reshape(c_out * k, c_in * k)


def matrix_to_conv(m: Tensor, c_out: int, c_in: int, k: int) -> Tensor:
    """Exact inverse of :func:`conv_to_matrix`."""
    return m.reshape(c_out, k, c_in, k).permute(0, 2, 1, 3).contiguous()


def _u_to_conv(u: Tensor, c_out: int, k: int) -> Tensor:
    """``U [c_out k, r]`` -> ``u_conv`` weight ``(c_out, r, k, 1)``."""
    return u.reshape(c_out, k, -1).permute(0, 2, 1).unsqueeze(3).contiguous()


def _conv_to_u(weight: Tensor) -> Tensor:
    """``u_conv`` weight ``(c_out, r, k, 1)`` -> ``U [c_out k, r]``."""
    c_out, r, k, _ = weight.shape
    return weight[..., 0].permute(0, 2, 1).reshape(c_out * k, r)


def _v_to_conv(v: Tensor, c_in: int, k: int) -> Tensor:
    """``V [c_in k, r]`` -> ``v_conv`` weight ``(r, c_in, 1, k)``."""
    return v.reshape(c_in, k, -1).permute(2, 0, 1).unsqueeze(2).contiguous()


def _conv_to_v(weight: Tensor) -> Tensor:
    """``v_conv`` weight ``(r, c_in, 1, k)`` -> ``V [c_in k, r]``."""
    r, c_in, _, k = weight.shape
    return weight[:, :, 0, :].permute(1, 2, 0).reshape(c_in * k, r)


class LowRankLinear(nn.Module):
    """Linear layer ``x -> x V U^T + b`` with ``U: [m, r]``, ``V: [n, r]``, ``b: [m]``.

    Parameters
    ----------
    in_features, out_features, rank : int
        ``n``, ``m`` and the inner rank ``r``.
    bias : bool, optional
        Whether to learn the bias (default True).
    """

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = True) -> None:
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.u = nn.Parameter(torch.empty(out_features, rank, dtype=torch.float32))
        self.v = nn.Parameter(torch.empty(in_features, rank, dtype=torch.float32))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=torch.float32)) if bias else None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Random factors whose product has ``nn.Linear``'s default variance."""
        bound = 1.0 / math.sqrt(self.in_features)
        factor_bound = math.sqrt(3.0) * (bound**2 / (3.0 * self.rank)) ** 0.25
        nn.init.uniform_(self.u, -factor_bound, factor_bound)
        nn.init.uniform_(self.v, -factor_bound, factor_bound)
        if self.bias is not None:
            nn.init.uniform_(self.bias, -bound, bound)

    @classmethod
    def from_linear(cls, linear: nn.Linear, rank: int, svd: bool = True) -> LowRankLinear:
        """Factorise ``linear`` at ``rank`` by :func:`decompose` (``svd=False``: only
        the shapes, factors freshly initialised)."""
        w = linear.weight
        new = cls(w.shape[1], w.shape[0], rank, linear.bias is not None)
        if svd:
            new.load_factors(*decompose(w.detach().cpu(), rank))
        if new.bias is not None:
            new.bias.data.copy_(linear.bias.detach())  # type: ignore[union-attr]
        return new.to(device=w.device, dtype=w.dtype)

    def load_factors(self, u: Tensor, v: Tensor) -> None:
        """Copy ``U [m, r]`` and ``V [n, r]`` into the parameters."""
        with torch.no_grad():
            self.u.copy_(u)
            self.v.copy_(v)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x @ self.v, self.u, self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"rank={self.rank}, bias={self.bias is not None}"
        )


class LowRankConv2d(nn.Module):
    """Conv ``k x k`` as ``v_conv`` (``1 x k``, ``c_in -> r``, no bias) then
    ``u_conv`` (``k x 1``, ``r -> c_out``, with the bias).

    ``v_conv`` takes the horizontal stride/padding/dilation, ``u_conv`` the
    vertical ones; a string ``padding`` (``"same"``/``"valid"``) goes to both.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        rank: int,
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
    ) -> None:
        super().__init__()
        k, (sh, sw), (dh, dw) = kernel_size, _pair(stride), _pair(dilation)
        if isinstance(padding, str):
            pad_v: int | tuple[int, int] | str = padding
            pad_u: int | tuple[int, int] | str = padding
        else:
            ph, pw = _pair(padding)
            pad_v, pad_u = (0, pw), (ph, 0)
        mode: Any = padding_mode
        self.v_conv = nn.Conv2d(
            in_channels, rank, (1, k), (1, sw), pad_v, (1, dw),
            bias=False, padding_mode=mode,
        )  # fmt: skip
        self.u_conv = nn.Conv2d(
            rank, out_channels, (k, 1), (sh, 1), pad_u, (dh, 1),
            bias=bias, padding_mode=mode,
        )  # fmt: skip
        self.in_channels, self.out_channels = in_channels, out_channels
        self.kernel_size, self.rank = k, rank

    @classmethod
    def from_conv(cls, conv: nn.Conv2d, rank: int, svd: bool = True) -> LowRankConv2d:
        """Factorise ``conv`` (groups 1, square kernel) at ``rank`` (``svd=False``:
        only the shapes, factors freshly initialised)."""
        if conv.groups != 1 or conv.kernel_size[0] != conv.kernel_size[1]:
            raise ValueError(f"{conv} is not factorisable (groups or kernel)")
        w = conv.weight
        new = cls(
            conv.in_channels, conv.out_channels, conv.kernel_size[0], rank,
            conv.stride, conv.padding, conv.dilation,  # type: ignore[arg-type]
            conv.bias is not None, conv.padding_mode,
        )  # fmt: skip
        if svd:
            new.load_factors(*decompose(w.detach().cpu(), rank))
        if conv.bias is not None:
            new.u_conv.bias.data.copy_(conv.bias.detach())  # type: ignore[union-attr]
        return new.to(device=w.device, dtype=w.dtype)

    def factor_u(self) -> Tensor:
        """``U [c_out k, r]`` (differentiable function of ``u_conv.weight``)."""
        return _conv_to_u(self.u_conv.weight)

    def factor_v(self) -> Tensor:
        """``V [c_in k, r]`` (differentiable function of ``v_conv.weight``)."""
        return _conv_to_v(self.v_conv.weight)

    def load_factors(self, u: Tensor, v: Tensor) -> None:
        """Copy ``U [c_out k, r]`` and ``V [c_in k, r]`` into the conv weights."""
        k = self.kernel_size
        with torch.no_grad():
            self.u_conv.weight.copy_(_u_to_conv(u, self.out_channels, k))
            self.v_conv.weight.copy_(_v_to_conv(v, self.in_channels, k))

    def forward(self, x: Tensor) -> Tensor:
        return self.u_conv(self.v_conv(x))


def _check_ratio(ratio: float) -> None:
    if not 0.0 < ratio <= 1.0:
        raise ValueError(f"rank ratio must be in (0, 1], got {ratio}")


def layer_rank(shape: tuple[int, ...], ratio: float) -> int:
    """Rank ``max(1, round(ratio * min(rows, cols)))`` (halves round up).

    ``shape`` is a Linear ``(m, n)`` or conv ``(c_out, c_in, k, k)`` weight shape;
    rows and columns are those of its (reshaped) matrix; ``ratio`` in (0, 1].
    """
    _check_ratio(ratio)
    rows, cols = _matrix_dims(shape)
    return max(1, min(rows, cols, math.floor(ratio * min(rows, cols) + 0.5)))


def _as_matrix(weight: Tensor) -> Tensor:
    return weight if weight.dim() == 2 else conv_to_matrix(weight)


Svd = tuple[Tensor, Tensor, Tensor]
"""A thin SVD ``(P, S, Qᵀ)`` of a weight's matrix, float64."""


def thin_svd(weight: Tensor) -> Svd:
    """``torch.linalg.svd`` of the (reshaped) weight in float64, thin."""
    p, s, qt = torch.linalg.svd(_as_matrix(weight.detach()).to(torch.float64), full_matrices=False)
    return p, s, qt


def top_svd(weight: Tensor, k: int) -> Svd:
    """The ``k`` leading singular triplets, from the eigendecomposition of the smaller
    Gram matrix (float64).

    Same subspaces and singular values as :func:`thin_svd` truncated to ``k`` (each
    singular vector pair up to a common sign, which ``U Vᵀ`` does not see), about 2.5×
    faster on the server's layer sizes. Components whose singular value is below
    ``1e-7 · σ_max`` are returned as zeros (they carry nothing a factor could use).
    """
    w = _as_matrix(weight.detach()).to(torch.float64)
    rows, cols = w.shape
    if not 1 <= k <= min(rows, cols):
        raise ValueError(f"k={k} outside [1, {min(rows, cols)}]")
    tall = rows >= cols
    gram = w.T @ w if tall else w @ w.T
    evals, evecs = torch.linalg.eigh(gram)  # ascending
    top = evecs[:, -k:].flip(1)
    s = evals[-k:].flip(0).clamp(min=0).sqrt()
    keep = s > 1e-7 * s[0].clamp(min=torch.finfo(torch.float64).tiny)
    inv = torch.where(keep, 1 / s.clamp(min=torch.finfo(torch.float64).tiny), 0.0)
    if tall:
        q = top
        p = (w @ q) * inv
    else:
        p = top
        q = (w.T @ p) * inv
    return p, s * keep, q.T


def _qr_positive(m: Tensor) -> tuple[Tensor, Tensor]:
    """Thin QR with a non-negative diagonal of R (so a column of Q keeps the sign of
    the column of ``m`` it comes from)."""
    q, r = torch.linalg.qr(m)
    signs = torch.where(torch.diagonal(r) < 0, -1.0, 1.0).to(m.dtype)
    return q * signs, r * signs[:, None]


def tracked_basis(
    weight: Tensor, prev: Tensor, dtype: torch.dtype = torch.float64
) -> tuple[Tensor, Tensor, Tensor]:
    """One step of block subspace iteration from a previous basis: nested leading
    subspaces that follow the weight's spectrum without jumping between rounds.

    ``prev`` ``[min(rows, cols), k]`` is an orthonormal basis of the smaller side
    (the right singular side of a tall matrix, the left one of a wide matrix), for
    example the one this function or :func:`top_svd` returned for the previous
    global state. With ``A`` the matrix oriented tall, ``Q = orth(AᵀA·prev)`` and
    ``A Q = P R`` (both QRs column-order preserving, so every prefix of ``Q`` spans
    one power-iteration step of the same prefix of ``prev``).

    Returns ``(P [rows, k], C [k, k], Q [cols, k])``, P and Q orthonormal, such that
    for every ``r ≤ k`` the projection of the weight's matrix ``W`` onto the first
    ``r`` tracked directions is ``P_r C[:r, :r] Q_rᵀ`` (``W Q_r Q_rᵀ`` when tall,
    ``P_r P_rᵀ W`` when wide; C upper triangular when tall, lower when wide). Where
    the spectrum has a gap the iteration converges to the leading singular subspace
    at rate (σ_{r+1}/σ_r)² per call; where it is flat the subspace stays put, while a
    fresh truncated SVD may pick an unrelated one.

    Computed in ``dtype`` (the server uses float32, half the time of float64: the
    QRs re-orthonormalise the basis on every call, so rounding does not accumulate
    across rounds, and what a tier is served is float32 anyway).
    """
    w = _as_matrix(weight.detach()).to(dtype)
    tall = w.shape[0] >= w.shape[1]
    a = w if tall else w.T
    prev = prev.to(dtype)
    if prev.shape[0] != a.shape[1] or not 1 <= prev.shape[1] <= a.shape[1]:
        raise ValueError(
            f"basis of shape {tuple(prev.shape)} does not fit a {tuple(w.shape)} matrix"
        )
    q, _ = _qr_positive(a.T @ (a @ prev))
    p, r = _qr_positive(a @ q)
    return (p, r, q) if tall else (q, r.T, p)


def core_energies(core: Tensor) -> Tensor:
    """``e`` with ``Σ_{i<r} e_i = ‖C[:r, :r]‖²_F`` for every r (C triangular or not):
    the energy each tracked direction adds to the truncation."""
    sq = core.square()
    return torch.tril(sq).sum(1) + torch.triu(sq, 1).sum(0)


def core_svd(p: Tensor, core: Tensor, q: Tensor, rank: int) -> Svd:
    """The exact SVD ``(P', S, Q'ᵀ)`` of ``P_r C[:r, :r] Q_rᵀ`` (a :func:`tracked_basis`
    truncation), from the SVD of the r×r core."""
    a, s, bt = torch.linalg.svd(core[:rank, :rank])
    return p[:, :rank] @ a, s, (q[:, :rank] @ bt.T).T


def decompose(weight: Tensor, rank: int, svd: Svd | None = None) -> tuple[Tensor, Tensor]:
    """Balanced truncated SVD ``U = P_r S_r^1/2``, ``V = Q_r S_r^1/2`` (float32).

    Parameters
    ----------
    weight : Tensor
        Linear ``[m, n]`` or conv ``(c_out, c_in, k, k)`` weight.
    rank : int
        Target rank, ``1 <= rank <= min(rows, cols)``.
    svd : optional
        :func:`thin_svd` of ``weight``, when already computed: every rank is a
        truncation of the same SVD, so one SVD per weight serves every tier.

    Returns
    -------
    tuple of Tensor
        ``U [rows, rank]`` and ``V [cols, rank]`` with ``W' ~ U V^T``.
    """
    rows, cols = _matrix_dims(weight.shape)
    if not 1 <= rank <= min(rows, cols):
        raise ValueError(f"rank {rank} outside [1, {min(rows, cols)}]")
    p, s, qt = svd if svd is not None else thin_svd(weight)
    root = s[:rank].sqrt()
    u = p[:, :rank] * root
    v = qt[:rank].T * root
    return u.to(torch.float32), v.to(torch.float32)


def reconstruct(u: Tensor, v: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``U V^T`` brought back to the weight's original ``shape``."""
    rows, cols = _matrix_dims(shape)
    m = u @ v.T
    if m.shape != (rows, cols):
        raise ValueError(f"factors give {tuple(m.shape)}, expected {(rows, cols)}")
    return m if len(shape) == 2 else matrix_to_conv(m, shape[0], shape[1], shape[2])


def eckart_young_error(weight: Tensor, rank: int) -> float:
    """SVD tail norm ``sqrt(sum_{i > rank} s_i^2)`` of the weight's matrix."""
    s = torch.linalg.svdvals(_as_matrix(weight.detach()).to(torch.float64))
    return float(s[rank:].square().sum().sqrt())


def param_count(shape: tuple[int, ...], rank: int) -> int:
    """Factor weights: ``r (m + n)`` for Linear, ``r k (c_in + c_out)`` for conv."""
    rows, cols = _matrix_dims(shape)
    return rank * (rows + cols)


def _is_factorisable(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    return (
        isinstance(module, nn.Conv2d)
        and module.groups == 1
        and module.kernel_size[0] == module.kernel_size[1]
    )


def factorisable_layers(module: nn.Module) -> dict[str, tuple[int, ...]]:
    """Qualified name -> weight shape of every Linear / groups-1 square conv.

    Layers inside already factorised modules are not listed.
    """
    out: dict[str, tuple[int, ...]] = {}
    skip: list[str] = []
    for name, sub in module.named_modules():
        if any(name.startswith(prefix) for prefix in skip):
            continue
        if isinstance(sub, (LowRankLinear, LowRankConv2d)):
            skip.append(name + ".")
        elif _is_factorisable(sub):
            out[name] = tuple(sub.weight.shape)  # type: ignore[union-attr]
    return out


def default_layers(extractor: nn.Module, count: int = 2) -> list[str]:
    """The ``count`` largest factorisable layers, first conv excluded.

    Size is the number of weight parameters; ties go to the earlier layer in
    module order; the result is in module order.
    """
    layers = factorisable_layers(extractor)
    first_conv = next((n for n, s in layers.items() if len(s) == 4), None)
    names = [n for n in layers if n != first_conv]
    order = {n: i for i, n in enumerate(names)}
    ranked = sorted(names, key=lambda n: (-math.prod(layers[n]), order[n]))
    return sorted(ranked[:count], key=order.__getitem__)


def factorise(
    extractor: nn.Module, layers: Sequence[str], ratio: float, svd: bool = True
) -> nn.Module:
    """A deep copy of ``extractor`` with ``layers`` factorised at ``ratio``.

    Each layer gets rank :func:`layer_rank` and factors from :func:`decompose`
    of its current weight; ``ratio == 1`` returns an unmodified copy. With
    ``svd=False`` only the structure is built (for a model whose weights are
    loaded right after, as a FedARA client does with the server's factors).
    """
    _check_ratio(ratio)
    out = copy.deepcopy(extractor)
    if ratio == 1.0:
        return out
    for name in layers:
        old = out.get_submodule(name)
        if not _is_factorisable(old):
            raise ValueError(f"layer {name!r} ({old}) is not factorisable")
        assert isinstance(old, (nn.Linear, nn.Conv2d))
        rank = layer_rank(tuple(old.weight.shape), ratio)
        if isinstance(old, nn.Linear):
            new: nn.Module = LowRankLinear.from_linear(old, rank, svd)
        else:
            new = LowRankConv2d.from_conv(old, rank, svd)
        parent, _, child = name.rpartition(".")
        setattr(out.get_submodule(parent), child, new)
    return out
