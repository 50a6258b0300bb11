"""Client part of ``fedara``: a low-rank extractor at this node's rank ratio,
consistency anchors from the received (frozen) extractor, Frobenius decay."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from client_app.base import ClientHook, ClientRun
from common.config import RunConfig, Scalar
from models import family_archs
from models.lowrank import LowRankConv2d, LowRankLinear, default_layers, factorise
from models.train import ExtraLoss, class_means

EXTRACTOR = "extractor."


def rank_ratio(run: ClientRun) -> float:
    """Node-config ``rank-ratio``, else the profile's, else this partition's tier."""
    if "rank-ratio" in run.node.options:
        ratio = float(run.node.options["rank-ratio"])
        if not 0 < ratio <= 1:
            raise ValueError(f"node-config rank-ratio={ratio} must be in (0, 1]")
        return ratio
    if run.node.profile is not None:
        return run.node.profile.rank_ratio
    tiers = run.cfg.fedara.tiers()
    return tiers[run.node.partition_id % len(tiers)]


def layer_set(run: ClientRun, extractor: nn.Module) -> list[str]:
    """``fedara.layers`` or the two largest factorisable layers (first conv excluded)."""
    return run.cfg.fedara.layer_list() or default_layers(extractor)


def anchor_weight(cfg: RunConfig, server_round: int) -> float:
    """λ_t = λ · min(1, (t − 1) / W): 0 in round 1, λ from round W + 1 on."""
    if server_round <= 1:
        return 0.0
    warmup = cfg.fedara.warmup_rounds
    ramp = 1.0 if warmup == 0 else min(1.0, (server_round - 1) / warmup)
    return cfg.fedara.lam * ramp


def frobenius_sq(extractor: nn.Module) -> Tensor:
    """Σ_q ‖U_q V_qᵀ‖²_F = Σ_q tr((U_qᵀU_q)(V_qᵀV_q)), without forming U Vᵀ."""
    total = torch.zeros(())
    for module in extractor.modules():
        u: Tensor
        v: Tensor
        if isinstance(module, LowRankLinear):
            u, v = module.u, module.v
        elif isinstance(module, LowRankConv2d):
            u, v = module.factor_u(), module.factor_v()
        else:
            continue
        total = total.to(u.device) + ((u.T @ u) * (v.T @ v)).sum()
    return total


class FedARAHook(ClientHook):
    """``fedara``: train the factorised extractor + personal head; upload the
    extractor (factors and full layers)."""

    name = "fedara"

    def base_arch(self, cfg: RunConfig) -> str | None:
        return cfg.fedara.base_arch or family_archs(cfg.model.family)[0]

    def prepare(self, run: ClientRun) -> None:
        ratio, layers = rank_ratio(run), layer_set(run, run.model.extractor)
        run.notes["tier"] = (ratio, layers)
        if ratio < 1:
            # structure only: the extractor is always replaced by the server's factors
            run.model.extractor = factorise(run.model.extractor, layers, ratio, svd=False)

    def install(self, run: ClientRun, arrays: dict[str, Tensor]) -> None:
        """The whole extractor at this node's tier, nothing else (the factorised
        layers were built without weights in :meth:`prepare`)."""
        want = {k for k in run.model.state_dict() if k.startswith(EXTRACTOR)}
        if set(arrays) != want:
            raise ValueError(
                f"fedara: the server must send the whole extractor at this node's tier; "
                f"missing {sorted(want - set(arrays))[:3]}, unexpected "
                f"{sorted(set(arrays) - want)[:3]}"
            )
        super().install(run, arrays)

    def profile(self, run: ClientRun) -> dict[str, Scalar]:
        ratio, layers = run.notes["tier"]
        return {"rank-ratio": ratio, "layers": ",".join(layers)}

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        lam = anchor_weight(run.cfg, run.server_round)
        mu = run.cfg.fedara.frobenius_decay
        anchors = anchors_of(run)[0] if lam > 0 else None
        extractor = run.model.extractor

        def loss(reps: Tensor, logits: Tensor, y: Tensor) -> Tensor:
            total = mu * frobenius_sq(extractor) if mu > 0 else reps.sum() * 0.0
            if anchors is not None:
                target = anchors.to(reps.device)[y]
                total = total + lam * F.mse_loss(reps, target)
            return total

        return loss

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return {k: v for k, v in run.model.state_dict().items() if k.startswith(EXTRACTOR)}


def anchors_of(run: ClientRun) -> tuple[Tensor, Tensor]:
    """Consistency anchors: class means of RM(g(x)) under the received extractor.

    Called after the server's extractor is installed and before any training step,
    so the model's extractor *is* the frozen received one; computed without grad.
    """
    return class_means(run.model, run.data.x_train, run.data.y_train, run.data.num_classes)
