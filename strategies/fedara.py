"""``fedara``: FedARA, server-side low-rank decomposition and reconstruction."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from logging import WARNING
from typing import Any, Literal, Self, Unpack

import numpy as np
import torch
from flwr.common.logger import log

from common.config import RunConfig
from common.messages import EXTRACTOR
from common.records import Arrays, capped_shares, invalid_reason, shapes, tensors
from models.lowrank import (
    Svd,
    _matrix_dims,
    core_energies,
    core_svd,
    factorisable_layers,
    layer_rank,
    param_count,
    top_svd,
    tracked_basis,
)
from models.lowrank_state import (
    coverage_normalised,
    decompose_state,
    served_residual,
    served_updates,
    weighted_reconstruction,
)
from strategies.base import HeteroStrategy, NodeInfo, RunSettings, Upload, run_settings
from strategies.clock import node_device
from strategies.robust import direction_outliers, flat_update, robust_mean
from strategies.timing import Phases


def relative_change(new: Arrays, old: Arrays, key: str) -> float:
    """‖new[key] − old[key]‖_F / ‖old[key]‖_F."""
    before = torch.from_numpy(old[key]).double()
    change = torch.linalg.vector_norm(torch.from_numpy(new[key]).double() - before)
    return float(change) / max(float(torch.linalg.vector_norm(before)), 1e-30)


Tier = tuple[float, tuple[str, ...]]


@dataclass
class RoundUpdates:
    """:func:`~models.lowrank_state.served_updates` of a round's uploads."""

    sizes: dict[int, tuple[Arrays, float]]
    """Node id -> (the upload's arrays, ‖its update‖)."""
    weights: list[float]
    """The weights of the mean, in upload order."""
    mean: dict[str, torch.Tensor]
    """Σ_k w_k Δ_k in the full-rank keys (float64)."""
    seconds: float

    def covers(self, uploads: list[Upload]) -> bool:
        """Computed from exactly these uploads, with their weights."""
        return [u.weight for u in uploads] == self.weights and all(
            self.sizes.get(u.node.node_id, (None,))[0] is u.arrays for u in uploads
        )


class FedARA(HeteroStrategy):
    """FedARA: one full-rank global extractor, served to each node at its rank.

    Message contract: ``train.fedara`` carries the node's extractor ``{"extractor.*"}``
    decomposed at its (rank ratio, layer set) tier — factors ``U``, ``V`` for the
    factorised layers, full weights for the others (rank ratio 1: the full
    extractor). The client installs it, computes anchors from it (round ≥ 2), trains
    extractor + personal head, and replies with its extractor in the same keys and
    shapes. Server (``fedara.aggregation``): ``reconstruct`` — reconstruct each reply
    to full rank, sample-weighted mean ``Σ_k w_k U'_k V'_kᵀ``; ``delta`` — the global
    plus the sample-weighted mean of each reply's change to what its tier was served,
    ``W + Σ_k w_k (U'_k V'_kᵀ − U_k V_kᵀ)``, one product per reply and layer, which
    also gives the reply's size for screening (full layers and biases: the plain
    weighted mean in both rules).
    Decomposition (``fedara.truncation``: the truncated SVD, or the projection onto
    directions tracked from the previous state's basis; balanced split) runs once per
    distinct tier per global state and is shared by every node of the tier. Nodes report their tier
    in ``query.profile`` (``rank-ratio``, ``layers``); all must share one base
    architecture.
    """

    name = "fedara"
    shares_model = True

    def __init__(
        self,
        *,
        aggregation: Literal["reconstruct", "delta", "coverage"] = "coverage",
        served_scale: Literal["none", "energy"] = "energy",
        truncation: Literal["svd", "tracked"] = "tracked",
        server_lr: float = 3.0,
        server_step: Literal["bounded", "fixed"] = "bounded",
        rank_policy: Literal["profile", "deadline"] = "profile",
        rank_tiers: Sequence[float] = (1, 0.5, 0.25, 0.125, 0.0625),
        local_epochs: int = 1,
        **kwargs: Unpack[RunSettings],
    ) -> None:
        super().__init__(**kwargs)
        self.rank_policy = rank_policy
        """``profile``: each node's reported tier; ``deadline``: per round, the largest
        of ``rank_tiers`` whose predicted round time meets ``round_deadline_s``."""
        self.rank_tiers = sorted(set(rank_tiers), reverse=True)
        self.local_epochs = local_epochs
        """The clients' epochs per round (for the deadline policy's prediction)."""
        self._policy: dict[int, float] = {}
        """Node id -> the rank ratio the deadline policy chose for it (last round)."""
        self._calibration: dict[int, float] = {}
        """Node id -> measured / predicted compute time of its last timed round."""
        self.aggregation = aggregation
        """How replies become the new global extractor (``fedara.aggregation``)."""
        self.served_scale = served_scale
        """``energy``: a tier's factors are scaled to the layer's norm (``none``: not)."""
        self.truncation = truncation
        """``svd``: truncated SVD per state; ``tracked``: subspace tracked across states."""
        self.server_lr = server_lr
        """η in ``W ← W + η Δ`` (1: the rule as is)."""
        self.server_step = server_step
        self._replies = 0
        """Replies aggregated this round (they bound η, see :meth:`step_size`)."""
        self._served: dict[Tier, Arrays] = {}
        self._gains: dict[Tier, dict[str, float]] = {}
        """Tier -> layer -> g: the tier was served ``g · W_r`` (``fedara.served-scale``)."""
        self._svds: dict[str, Svd] = {}
        self.svd_calls: dict[int, int] = {}
        """Version -> SVDs computed (one per decomposed layer, shared by all tiers)."""
        self.version = 0
        """Global extractor version: 0 initially, +1 per aggregation."""
        self.decompositions: dict[int, int] = {}
        """Version -> decompositions computed from it (one per distinct tier, r < 1)."""
        self.layer_shapes: dict[str, tuple[int, ...]] = {}
        self._bases: dict[str, torch.Tensor] = {}
        """Layer -> leading left singular vectors of the previous global state."""
        self._tracked: dict[str, torch.Tensor] = {}
        """Layer -> the basis (smaller side) the previous global state was truncated
        to: where this state's decomposition starts under ``fedara.truncation =
        tracked``. Fixed for the whole of a state (training and evaluation messages,
        and a run resumed from the checkpoint, all decompose from the same start)."""
        self._current: dict[str, torch.Tensor] = {}
        """Layer -> the basis of this global state (becomes ``_tracked`` with the next)."""
        self._cores: dict[str, torch.Tensor] = {}
        """Layer -> the core C of this global state's tracked basis (tracked only)."""
        self._decompose_s = 0.0
        """Seconds spent decomposing this global state (reported with its aggregation)."""
        self._updates: RoundUpdates | None = None
        """This round's uploads' updates, formed while screening them and reused by
        the rule when the same uploads are aggregated with the same weights."""

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        f = cfg.fedara
        return cls(
            aggregation=f.aggregation,
            served_scale=f.served_scale,
            truncation=f.truncation,
            server_lr=f.server_lr,
            server_step=f.server_step,
            rank_policy=f.rank_policy,
            rank_tiers=f.tiers(),
            local_epochs=cfg.train.local_epochs,
            **run_settings(cfg),
        )

    def extra_state(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "svd-calls": self.svd_calls,
            "decompositions": self.decompositions,
            "bases": self._bases,
            "tracked": self._tracked,
        }

    def load_extra_state(self, state: dict[str, Any]) -> None:
        self.version = int(state["version"])
        self.svd_calls = dict(state["svd-calls"])
        self.decompositions = dict(state["decompositions"])
        self._bases = dict(state["bases"])
        self._tracked = dict(state.get("tracked", {}))

    def tier(self, node: NodeInfo) -> Tier:
        layers = tuple(sorted(str(node.extras.get("layers", "")).split(",")))
        ratio = self._policy.get(node.node_id, float(node.extras["rank-ratio"]))
        return ratio, tuple(name for name in layers if name)

    # ------------------------------------------------------------------ deadline policy
    def plan_round(self, server_round: int, nodes: list[NodeInfo]) -> None:
        """``rank_policy = deadline``: each sampled node's tier for this round, from
        its device and what its earlier rounds measured."""
        if self.rank_policy != "deadline" or self.round_deadline_s <= 0:
            return
        self._calibrate()
        for node in nodes:
            self._policy[node.node_id] = self.deadline_ratio(node)

    def deadline_ratio(self, node: NodeInfo) -> float:
        """The largest tier whose predicted round time on the node's device meets the
        deadline (the smallest when none does): compute = its FLOPs per sample at the
        tier × its samples × epochs / device speed, scaled by what the node's last
        timed round measured against its prediction; transfers = the tier's extractor
        both ways over its links."""
        device = node_device(node)
        if device is None:
            return self.tier(node)[0]
        calibration = self._calibration.get(node.node_id, 1.0)
        for ratio in self.rank_tiers:
            flops = node.extras.get(f"flops@{ratio:g}")
            if flops is None:
                continue
            compute = calibration * float(flops) * node.num_train * self.local_epochs
            nbytes = self.tier_bytes(ratio, self.tier(node)[1])
            seconds = compute / (device.speed * 1e9) + device.transfer_seconds(nbytes, nbytes)
            if seconds <= self.round_deadline_s:
                return ratio
        return self.rank_tiers[-1]

    def tier_bytes(self, ratio: float, layers: tuple[str, ...]) -> float:
        """Bytes of the extractor a tier is served (float32): the factorised layers as
        ``r (rows + cols)``, everything else whole."""
        total = sum(v.size for v in self.global_arrays.values())
        if ratio < 1:
            for name in layers:
                shape = self.layer_shapes[name]
                rows, cols = _matrix_dims(shape)
                total += param_count(shape, layer_rank(shape, ratio)) - rows * cols
        return 4.0 * total

    def message_config(self, node: NodeInfo) -> dict[str, float | int | str]:
        """Under the deadline policy each message names the node's tier."""
        if node.node_id in self._policy:
            return {"rank-ratio": self._policy[node.node_id]}
        return {}

    def round_facts(self) -> dict[str, Any]:
        """``client-rank-ratio``: partition id -> the tier each trained node was served."""
        return {
            "client-rank-ratio": {
                str(self.nodes[n].partition_id): self.tier(self.nodes[n])[0]
                for n in sorted(self.awaiting, key=lambda n: self.nodes[n].partition_id)
                if n in self.nodes
            }
        }

    def _calibrate(self) -> None:
        """Measured over predicted compute per timed node (stragglers included)."""
        for node_id, measured in self.client_compute_s.items():
            node = self.nodes.get(node_id)
            device = node_device(node) if node is not None else None
            if node is None or device is None:
                continue
            flops = node.extras.get(f"flops@{self.tier(node)[0]:g}")
            if flops is None:
                continue
            predicted = float(flops) * node.num_train * self.local_epochs / (device.speed * 1e9)
            if predicted > 0:
                self._calibration[node_id] = measured / predicted

    def init_global(self) -> Arrays:
        model = self.shared_model("fedara (one base architecture, see fedara.base-arch)")
        self.layer_shapes = factorisable_layers(model.extractor)
        return {
            EXTRACTOR + k: v.detach().numpy().copy()
            for k, v in model.extractor.state_dict().items()
        }

    def _extractor(self, arrays: Arrays | None = None) -> dict[str, torch.Tensor]:
        """``arrays`` (default: the global state) as an extractor state dict."""
        source = self.global_arrays if arrays is None else arrays
        return {k.removeprefix(EXTRACTOR): v for k, v in tensors(source).items()}

    def served(self, tier: Tier) -> Arrays:
        """The global extractor decomposed for ``tier`` (cached per global state)."""
        if tier not in self._served:
            ratio, layers = tier
            if ratio >= 1:
                self._served[tier] = self.global_arrays
            else:
                t0 = time.perf_counter()
                wanted = {name: self.layer_shapes[name] for name in layers}
                extractor = self._extractor()
                for name, shape in wanted.items():
                    cached = self._svds.get(name)
                    if cached is None or cached[1].numel() < layer_rank(shape, ratio):
                        # one per layer, deep enough for every tier of the known nodes
                        depth = max(layer_rank(shape, t) for t in self.ratios_below_one() | {ratio})
                        self._svds[name] = self._basis(name, extractor[f"{name}.weight"], depth)
                        self.svd_calls[self.version] = self.svd_calls.get(self.version, 0) + 1
                gains = self._tier_gains(extractor, wanted, ratio)
                svds = {name: self._tier_svd(name, shape, ratio) for name, shape in wanted.items()}
                state = decompose_state(extractor, wanted, ratio, svds, gains)
                self._gains[tier] = gains
                self._served[tier] = {EXTRACTOR + k: v.numpy() for k, v in state.items()}
                self.decompositions[self.version] = self.decompositions.get(self.version, 0) + 1
                self._decompose_s += time.perf_counter() - t0
        return self._served[tier]

    def _basis(self, name: str, weight: torch.Tensor, depth: int) -> Svd:
        """The ``depth`` leading directions of a layer of this global state, as
        ``(P, e^½, Qᵀ)`` with ``Σ_{i<r} e_i`` the energy of the rank-r truncation:
        the truncated SVD (``fedara.truncation = svd``, and the first decomposition
        under ``tracked``) or one subspace-iteration step from the previous
        decomposition's basis (``tracked``, in float32: what the tiers are served is
        float32, and the delta and coverage rules use the factors actually sent)."""
        prev = self._tracked.get(name)
        if self.truncation == "tracked" and prev is not None and prev.shape[1] >= depth:
            p, core, q = tracked_basis(weight, prev[:, :depth], dtype=torch.float32)
            self._cores[name] = core
            svd = (p, core_energies(core).sqrt(), q.T)
        else:
            svd = top_svd(weight, depth)
            self._cores.pop(name, None)
        rows, cols = _matrix_dims(tuple(weight.shape))
        self._current[name] = (svd[2].T if rows >= cols else svd[0]).clone()
        return svd

    def _tier_svd(self, name: str, shape: tuple[int, ...], ratio: float) -> Svd:
        """What a tier of ``ratio`` is served of layer ``name``: the truncated SVD, or
        the exact SVD of the projection onto the first r tracked directions."""
        if name not in self._cores:
            return self._svds[name]
        p, _, qt = self._svds[name]
        return core_svd(p, self._cores[name], qt.T, layer_rank(shape, ratio))

    def _tier_gains(
        self, extractor: dict[str, torch.Tensor], layers: dict[str, tuple[int, ...]], ratio: float
    ) -> dict[str, float]:
        """``g = ‖W‖_F / ‖W_r‖_F`` per layer under ``served-scale = energy``, else 1."""
        if self.served_scale == "none":
            return {name: 1.0 for name in layers}
        gains = {}
        for name, shape in layers.items():
            total = float(extractor[f"{name}.weight"].double().square().sum())
            kept = float(self._svds[name][1][: layer_rank(shape, ratio)].square().sum())
            gains[name] = math.sqrt(total / kept) if kept > 0 else 1.0
        return gains

    def ratios_below_one(self) -> set[float]:
        """Every tier ratio the known nodes use that needs a decomposition."""
        return {r for r, _ in (self.tier(n) for n in self.nodes.values()) if r < 1}

    def payload(self, server_round: int, node: NodeInfo) -> Arrays:
        return self.served(self.tier(node))

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        return shapes(self.served(self.tier(node)))

    def check_upload(self, node: NodeInfo, arrays: Arrays) -> str | None:
        """Keys, shapes and dtype. Whether every value is finite shows in the upload's
        size, which screening forms from every value (:meth:`_screen`): the server
        reads a reply's values once."""
        return invalid_reason(arrays, self.expected_upload(node), finite=False)

    def upload_size(self, upload: Upload) -> float | None:
        """‖Δ‖, the upload's change to what its tier was served at full rank: each
        factor product divided by the gain its tier was served with, as the rule
        aggregates it, minus the same of what the node was sent."""
        done = self._updates
        known = done.sizes.get(upload.node.node_id) if done is not None else None
        if known is not None and known[0] is upload.arrays:
            return known[1]
        return self.updates([upload], [1.0]).sizes[upload.node.node_id][1]

    def upload_update(self, upload: Upload) -> np.ndarray | None:
        """The update of :meth:`upload_size`, flattened in key order."""
        update = self.updates([upload], [1.0]).mean
        return np.concatenate([update[k].numpy().ravel() for k in sorted(update)])

    def updates(self, uploads: list[Upload], weights: list[float]) -> RoundUpdates:
        """Each upload's update Δ_k (see :meth:`upload_size`), its size and the
        weighted mean Σ_k w_k Δ_k (:func:`~models.lowrank_state.served_updates`)."""
        start = time.perf_counter()
        served: dict[Tier, dict[str, torch.Tensor]] = {}
        replies = []
        for u in uploads:
            tier = self.tier(u.node)
            if tier not in served:
                served[tier] = self._extractor(self.served(tier))
            replies.append((self._extractor(u.arrays), served[tier], self._scales(tier)))
        mean, squares = served_updates(
            replies, weights, self.layer_shapes, workers=torch.get_num_threads()
        )
        sizes = {
            u.node.node_id: (u.arrays, math.sqrt(q)) for u, q in zip(uploads, squares, strict=True)
        }
        return RoundUpdates(sizes, list(weights), mean, time.perf_counter() - start)

    def _scales(self, tier: Tier) -> dict[str, float]:
        """Layer -> 1 / the gain ``tier`` was served with."""
        return {name: 1 / g for name, g in self.gains(tier).items()}

    def _screen(self, server_round: int, uploads: list[Upload]) -> list[Upload]:
        """The shared screening, then, with ``robust.min-cosine`` on, the same
        direction test on the tensors every tier sends whole (the layers no tier
        factorises, and the biases). The reconstructed update alone does not tell a
        flipped full-rank reply from an honest one: only the full-rank tier moves the
        directions beyond the lower tiers' ranks, so the round's median update is
        nearly orthogonal to a full-rank update of either sign (measured:
        docs/robustness.md); on the tensors every reply carries the replies are
        comparable."""
        if uploads:  # sizes and mean in one pass, weighted as if every upload is kept
            shares = capped_shares([u.num_examples for u in uploads], self.max_weight_share)
            self._updates = self.updates(uploads, shares)
            uploads = self._finite(server_round, uploads)
        kept = super()._screen(server_round, uploads)
        if self.min_cosine <= -1 or len(kept) < 3:
            return kept
        whole = [
            key
            for key, value in self.global_arrays.items()
            if all(key in u.arrays and u.arrays[key].shape == value.shape for u in kept)
        ]
        if not whole:
            return kept
        updates = {
            u.node.node_id: flat_update({k: u.arrays[k] for k in whole}, self.global_arrays)
            for u in kept
        }
        pid = {u.node.node_id: u.node.partition_id for u in kept}
        outliers = direction_outliers(updates, self.min_cosine)
        for nid, reason in outliers.items():
            reason = reason.replace(
                "update direction:", "update direction (the tensors every tier sends whole):"
            )
            log(
                WARNING,
                "round %d: dropped reply of node %d (partition %d): %s",
                server_round,
                nid,
                pid[nid],
                reason,
            )
            self.rejected.append((server_round, nid, reason))
        return [u for u in kept if u.node.node_id not in outliers]

    def _full(self, state: dict[str, torch.Tensor], tier: Tier) -> dict[str, torch.Tensor]:
        """One state at full rank on the global's scale (float64)."""
        return weighted_reconstruction(
            [state], [1.0], self.layer_shapes, product_scales=[self._scales(tier)]
        )

    def _finite(self, server_round: int, uploads: list[Upload]) -> list[Upload]:
        """The uploads whose size is finite; the others are logged and rejected (a
        value that is not finite makes the size so, as does an update too large for
        float32)."""
        kept = []
        for u in uploads:
            if math.isfinite(self.upload_size(u) or 0.0):
                kept.append(u)
                continue
            reason = "non-finite update (a value not finite, or beyond float32 at full rank)"
            log(
                WARNING,
                "round %d: dropped reply of %s: %s",
                server_round,
                self.describe(u.node.node_id),
                reason,
            )
            self.rejected.append((server_round, u.node.node_id, reason))
        return kept

    def _reconstruct(
        self, uploads: list[Upload], states: list[dict[str, torch.Tensor]]
    ) -> dict[str, torch.Tensor]:
        """The replies' mean at full rank: the sample-weighted mean of the factor
        products (streamed), or ``robust.aggregate``'s coordinate-wise rule over each
        reply's own reconstruction."""
        weights = [u.weight for u in uploads]
        scales = [self._scales(self.tier(u.node)) for u in uploads]
        if self.robust_aggregate == "mean":
            return weighted_reconstruction(
                states, weights, self.layer_shapes, product_scales=scales
            )
        full = [
            {k: v.numpy() for k, v in self._full(st, self.tier(u.node)).items()}
            for st, u in zip(states, uploads, strict=True)
        ]
        like = {k: v for k, v in full[0].items()}
        rule = robust_mean(full, weights, like, self.robust_aggregate, self.robust_trim)
        return {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in rule.items()}

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        """The rule as an update Δ to the global: under ``delta`` and ``coverage``
        (with ``robust.aggregate = mean``) the weighted mean of the replies' updates,
        as screening formed it (:meth:`updates`); otherwise every reply back to full
        rank on the global's scale, the rule's mean (``reconstruct``) plus the served
        residuals (``delta``, ``coverage``), minus the global. Then each direction
        averaged over the replies that cover it (``coverage``), and the server step
        ``W + η Δ``."""
        states = [self._extractor(u.arrays) for u in uploads]
        weights = [u.weight for u in uploads]
        self._replies = len(uploads)
        done, self._updates = self._updates, None
        phases = Phases(decompose=self._decompose_s, updates=done.seconds if done else 0.0)
        with phases("diagnostics"):
            self.diagnostics = self.round_diagnostics(states, weights)
        if self.aggregation != "reconstruct" and self.robust_aggregate == "mean":
            with phases("updates"):
                if done is None or not done.covers(uploads):  # a reply was screened out
                    done = self.updates(uploads, weights)
                update = done.mean
        else:
            with phases("reconstruct"):
                # each reply's factor product back on the global's scale: divided by its gain
                mean = self._reconstruct(uploads, states)
            if self.aggregation in ("delta", "coverage"):
                with phases("residuals"):
                    self._add_served_residuals(mean, uploads)
            full = self._extractor()
            update = {key: value - full[key].double() for key, value in mean.items()}
        if self.aggregation == "coverage":
            with phases("normalise"):
                self._normalise_by_coverage(update, uploads)
        with phases("step"):
            new = self._step(update)
        self.diagnostics["server-phases-s"] = phases.seconds
        return new

    def _step(self, update: dict[str, torch.Tensor]) -> Arrays:
        """``W + η Δ`` as the new global state (η: :meth:`step_size`); its tiers are
        decomposed again on demand (the tracked bases move on to this state's)."""
        full = self._extractor()
        eta = self.step_size(self.diagnostics.get("update-coherence"), self._replies)
        self.diagnostics["server-lr"] = eta
        self._served, self._svds, self._gains, self._cores = {}, {}, {}, {}
        self._decompose_s = 0.0
        self._tracked.update(self._current)
        self._current = {}
        self.version += 1
        new = {
            key: (full[name].double() + eta * update[name]).numpy().astype(np.float32)
            for key, name in ((k, k.removeprefix(EXTRACTOR)) for k in self.global_arrays)
        }
        self.diagnostics["update-norm"] = {
            layer: relative_change(new, self.global_arrays, f"{EXTRACTOR}{layer}.weight")
            for layer in self.layer_shapes
        }
        return new

    def step_size(self, coherence: float | None, replies: int) -> float:
        """η of this round's step. ``fixed``: ``fedara.server-lr``. ``bounded``: at most
        the larger of ``1 / coherence`` and ``√replies / 2``, at least 1. The weighted
        mean of the replies' updates is ``coherence`` times their mean length (K
        unrelated updates: about 1/√K), so η = 1/coherence moves the global as far as
        a client moved, and √K/2 is half of what K unrelated updates lose in averaging:
        with 50 replies η stays 3; with 2-8 agreeing nodes and long local training the
        fixed η = 3 overshot (a round-2 collapse)."""
        eta = self.server_lr
        if self.server_step == "fixed":
            return eta
        bound = max(1.0, math.sqrt(max(replies, 1)) / 2)
        if coherence and coherence > 0:
            bound = max(bound, 1.0 / coherence)
        return min(eta, bound)

    def round_diagnostics(
        self, states: list[dict[str, torch.Tensor]], weights: list[float]
    ) -> dict[str, Any]:
        """This round's :meth:`spectrum_diagnostics` and the replies'
        :func:`update_coherence`."""
        out = self.spectrum_diagnostics()
        out["update-coherence"] = update_coherence(self._extractor(), states, weights)
        return out

    def spectrum_diagnostics(self) -> dict[str, Any]:
        """Per truncated tier and decomposed layer of this round's global state:
        ``energy`` ‖U_t V_tᵀ‖²_F / ‖W‖²_F (the share a truncation keeps) and
        ``overlap`` ‖P_prevᵀ P‖²_F / r, how much of the left subspace the tier was
        served (leading singular, or tracked) it shares with the previous round's
        (1: the same subspace; about r / min(rows, cols) for unrelated ones in the
        layer's column space)."""
        out: dict[str, dict[str, float]] = {"energy": {}, "overlap": {}}
        extractor = self._extractor()
        for name, (p, s, _) in sorted(self._svds.items()):
            total = float(extractor[f"{name}.weight"].double().square().sum())
            shape = self.layer_shapes[name]
            for ratio in sorted(self.ratios_below_one()):
                r = layer_rank(shape, ratio)
                key = f"{name}@{ratio:g}"
                out["energy"][key] = float(s[:r].square().sum()) / max(total, 1e-30)
                prev = self._bases.get(name)
                if prev is not None and prev.shape[1] >= r:
                    cross = prev[:, :r].T.double() @ p[:, :r].double()
                    out["overlap"][key] = float(cross.square().sum()) / r
            self._bases[name] = p
        return dict(out)

    def gains(self, tier: Tier) -> dict[str, float]:
        """Layer -> the gain ``g`` this tier is served with (empty at rank ratio 1)."""
        self.served(tier)
        return self._gains.get(tier, {})

    def _normalise_by_coverage(
        self, update: dict[str, torch.Tensor], uploads: list[Upload]
    ) -> None:
        """``Δ`` -> ``Δ'``: each direction of the global's singular basis gets the
        mean update of the replies whose rank covers it (see
        :func:`coverage_normalised`)."""
        for name, shape in self.layer_shapes.items():
            svd = self._svds.get(name)
            if svd is None:
                continue  # no truncated tier decomposed this layer
            depth = svd[0].shape[1]
            cover, tail = torch.zeros(depth, dtype=torch.float64), 0.0
            for u in uploads:
                ratio, layers = self.tier(u.node)
                w = u.weight
                if ratio >= 1 or name not in layers:
                    cover += w
                    tail += w
                else:
                    cover[: layer_rank(shape, ratio)] += w
            key = f"{name}.weight"
            update[key] = coverage_normalised(update[key], svd, cover, tail, torch.float32)

    def _add_served_residuals(self, mean: dict[str, torch.Tensor], uploads: list[Upload]) -> None:
        """``mean += Σ_t w_t (W − U_t V_tᵀ)`` over the truncated tiers that replied
        (``w_t``: the tier's share of the replies' samples)."""
        shares: dict[Tier, float] = {}
        for u in uploads:
            tier = self.tier(u.node)
            if tier[0] < 1:
                shares[tier] = shares.get(tier, 0.0) + u.weight
        tiers = [
            (self._extractor(self.served(tier)), share, self.gains(tier))
            for tier, share in sorted(shares.items())
        ]
        for key, residual in served_residual(self._extractor(), tiers, self.layer_shapes).items():
            mean[key] += residual


def update_coherence(
    old: dict[str, torch.Tensor], states: list[dict[str, torch.Tensor]], weights: list[float]
) -> float | None:
    """‖Σ_k w_k Δ_k‖ / Σ_k w_k ‖Δ_k‖ over the tensors every reply sends in full (the
    layers no tier factorises, and the biases), w_k the sample shares, Δ_k a reply's
    change to the global: 1 when every client moves the same way, about 1/√K for K
    unrelated moves. The weighted mean update is this share of a client's own step,
    which ``fedara.server-lr`` scales back up."""
    keys = [
        k
        for k, v in old.items()
        if all(k in state and tuple(state[k].shape) == tuple(v.shape) for state in states)
    ]
    total = sum(weights)
    if not keys or total <= 0:
        return None
    mean, spread = None, 0.0
    for state, w in zip(states, weights, strict=True):
        delta = torch.cat([(state[k].double() - old[k].double()).flatten() for k in keys])
        spread += w / total * float(delta.norm())
        mean = delta * (w / total) if mean is None else mean + delta * (w / total)
    return float(mean.norm()) / spread if mean is not None and spread > 0 else None
