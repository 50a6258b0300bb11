"""``fedkd``: FedKD, adaptive mutual distillation with an SVD-compressed mentee update."""

from __future__ import annotations

from typing import Self, Unpack

import numpy as np

from common.config import RunConfig
from common.messages import FACTOR_US as US
from common.messages import FACTOR_VT as VT
from common.messages import MENTEE
from common.records import Arrays, invalid_reason, shapes, tensors
from models.mutual import decompress
from strategies.base import HeteroStrategy, NodeInfo, RunSettings, Upload, run_settings
from strategies.fml import float_state, shared_arch
from strategies.robust import robust_mean


def compressed_shapes(key: str, shape: tuple[int, ...], rank: int) -> dict[str, tuple[int, ...]]:
    """Keys and shapes of ``key``'s update sent as rank-``rank`` factors."""
    rows, cols = shape[0], int(np.prod(shape[1:]))
    return {key + US: (rows, rank), key + VT: (rank, cols)}


class FedKD(HeteroStrategy):
    """FedKD: a shared mentee distilled mutually with each client's own model.

    Message contract: ``train.fedkd`` carries the global mentee ``{"mentee.<key>"}``
    (its floating-point state; architecture ``fedkd.mentee-arch``, default the
    family's smallest), sent whole. The client trains its own model, the mentee and
    a personal projection ``W_h`` (d→d) with adaptive mutual distillation, and replies
    with the mentee's *update* (trained − received) per key: a vector (or a matrix
    whose factors would not be smaller) whole under its key, otherwise the factors
    of its truncated SVD, ``"<key>.us"`` [rows, r] (U·S) and ``"<key>.vt"`` [r, cols]
    of the matrix ``[shape[0], rest]``, with the smallest r that keeps the round's
    share of the energy Σσ² (``fedkd.energy-start`` in round 1 rising linearly to
    ``fedkd.energy-end`` in the last). Server: reconstructs each update,
    sample-weighted mean, added to the global mentee.
    """

    name = "fedkd"
    shares_model = True

    def __init__(
        self, *, mentee_arch: str = "", family: str = "cnn", **kwargs: Unpack[RunSettings]
    ) -> None:
        super().__init__(**kwargs)
        self.mentee_arch = mentee_arch
        """Architecture of the mentee; empty = the smallest of ``family``."""
        self.family = family
        """The federation's model family (``model.family``)."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        return cls(mentee_arch=cfg.fedkd.mentee_arch, family=cfg.model.family, **run_settings(cfg))

    def init_global(self) -> Arrays:
        model = self.build_for_nodes(shared_arch(self, self.mentee_arch, self.family))
        return float_state(model, MENTEE)

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]] | None:
        return None  # ranks vary: see check_upload

    def check_upload(self, node: NodeInfo, arrays: Arrays) -> str | None:
        """Every mentee key exactly once, whole or as factors of a rank in
        [1, min(rows, cols)]; finite floats."""
        wanted: dict[str, tuple[int, ...]] = {}
        for key, shape in shapes(self.global_arrays).items():
            if key in arrays or len(shape) < 2 or key + US not in arrays:
                wanted[key] = shape
                continue
            rank = arrays[key + US].shape[-1] if arrays[key + US].ndim == 2 else 0
            cols = int(np.prod(shape[1:]))
            if not 1 <= rank <= min(shape[0], cols):
                return f"bad rank {rank} for '{key}'"
            wanted.update(compressed_shapes(key, shape, rank))
        return invalid_reason(arrays, wanted)

    def upload_update(self, upload: Upload) -> np.ndarray | None:
        """Not screened by direction (``robust.min-cosine``): its uploads are updates
        (whole or as factors), screened by their size only."""
        return None

    def upload_size(self, upload: Upload) -> float | None:
        """The norm of the whole reconstructed update."""
        total = sum(
            float(np.square(update_of(upload.arrays, key, value.shape)).sum())
            for key, value in self.global_arrays.items()
        )
        return float(np.sqrt(total))

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        new: Arrays = {}
        for key, value in self.global_arrays.items():
            acc = value.astype(np.float64)
            if self.robust_aggregate == "mean":
                for u in uploads:
                    acc = acc + update_of(u.arrays, key, value.shape) * u.weight
            else:
                updates = [{key: update_of(u.arrays, key, value.shape)} for u in uploads]
                acc = (
                    acc
                    + robust_mean(
                        updates,
                        [u.weight for u in uploads],
                        {key: acc},
                        self.robust_aggregate,
                        self.robust_trim,
                    )[key]
                )
            new[key] = acc.astype(value.dtype)
        sent = sum(v.size for u in uploads for v in u.arrays.values())
        dense = sum(v.size for v in self.global_arrays.values()) * len(uploads)
        self.diagnostics = {"upload-compression": sent / max(dense, 1)}
        return new


def update_of(arrays: Arrays, key: str, shape: tuple[int, ...]) -> np.ndarray:
    """One key's update from an upload, reconstructed (float64)."""
    if key in arrays:
        return arrays[key].astype(np.float64)
    factors = tensors({US: arrays[key + US], VT: arrays[key + VT]})
    us, vt = factors[US], factors[VT]
    return decompress(us, vt, shape).numpy()
