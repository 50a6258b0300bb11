"""Client part of ``fedara``: a low-rank extractor at this node's rank ratio,
consistency anchors from the received (frozen) extractor, Frobenius decay."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from client_app.base import ClientHook, ClientRun
from client_app.clock import flops_per_sample
from common.config import RunConfig, Scalar
from common.messages import EXTRACTOR
from models import family_archs
from models.lowrank import LowRankConv2d, LowRankLinear, default_layers, factorise
from models.train import AfterStep, ExtraLoss, class_means, logits_and_reps


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


def factor_pairs(extractor: nn.Module) -> list[tuple[Tensor, Tensor]]:
    """``(U, V)`` of every factorised layer (differentiable views of the parameters)."""
    pairs: list[tuple[Tensor, Tensor]] = []
    for module in extractor.modules():
        if isinstance(module, LowRankLinear):
            pairs.append((module.u, module.v))
        elif isinstance(module, LowRankConv2d):
            pairs.append((module.factor_u(), module.factor_v()))
    return pairs


def factor_parameters(extractor: nn.Module) -> list[Tensor]:
    """The parameters holding the factors of every factorised layer."""
    params: list[Tensor] = []
    for module in extractor.modules():
        if isinstance(module, LowRankLinear):
            params += [module.u, module.v]
        elif isinstance(module, LowRankConv2d):
            params += [module.u_conv.weight, module.v_conv.weight]
    return params


def frobenius_sq(extractor: nn.Module) -> Tensor:
    """Σ_q ‖U_q V_qᵀ‖²_F = Σ_q tr((U_qᵀU_q)(V_qᵀV_q)), without forming U Vᵀ."""
    total = torch.zeros(())
    for u, v in factor_pairs(extractor):
        total = total.to(u.device) + ((u.T @ u) * (v.T @ v)).sum()
    return total


def anchor_loss(reps: Tensor, targets: Tensor, reduction: str) -> Tensor:
    """L_FAC of a batch: ``mean`` = MSE over all elements (``F.mse_loss``); ``sum`` =
    squared L2 distance per sample, averaged over the batch (d × ``mean``)."""
    sq = (reps - targets).square()
    return sq.mean() if reduction == "mean" else sq.sum(1).mean()


def decay_step(extractor: nn.Module, factor: float) -> None:
    """One gradient step on ``factor · Σ_q ‖U_q V_qᵀ‖²_F`` alone:
    ``U ← U − 2·factor·U(VᵀV)``, ``V ← V − 2·factor·V(UᵀU)`` (simultaneous).

    ``factor = lr · μ · s`` stands for the decay term of ``s`` SGD steps applied at
    once: O((m + n) r²) once instead of on every step."""
    params = factor_parameters(extractor)
    if not params:
        return
    with torch.enable_grad():
        grads = torch.autograd.grad(factor * frobenius_sq(extractor), params)
    with torch.no_grad():
        for p, g in zip(params, grads, strict=True):
            p.sub_(g)


def gradient_ratio(run: ClientRun, anchors: Tensor, lam: float) -> float:
    """‖∇ λ_t·L_FAC‖ / ‖∇ CE‖ over the extractor's parameters on the first training
    batch (eval mode, so no BatchNorm statistic moves); how strong the anchor term is."""
    model = run.model
    params = [p for p in model.extractor.parameters() if p.requires_grad]
    batch = slice(0, run.sgd.batch_size)
    device = next(model.parameters()).device
    x, y = run.data.x_train[batch].to(device), run.data.y_train[batch].to(device)
    was_training = model.training
    model.eval()
    try:
        with torch.enable_grad():
            reps, logits = logits_and_reps(model, x)
            ce = F.cross_entropy(logits, y)
            fac = lam * anchor_loss(reps, anchors.to(device)[y], run.cfg.fedara.anchor_reduction)
            g_ce = torch.autograd.grad(ce, params, retain_graph=True, allow_unused=True)
            g_fac = torch.autograd.grad(fac, params, allow_unused=True)
    finally:
        model.train(was_training)

    def norm(gs: tuple[Tensor | None, ...]) -> float:
        return math.sqrt(sum(float(g.square().sum()) for g in gs if g is not None))

    return norm(g_fac) / max(norm(g_ce), 1e-30)


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

    def replaced_on_install(self, key: str) -> bool:
        return key.startswith(EXTRACTOR)  # the server's extractor, at the served rank

    def profile(self, run: ClientRun) -> dict[str, Scalar]:
        """The node's tier and, with a device class, the training FLOPs per sample at
        every rank tier (``flops@<ratio>``, for the server's deadline policy)."""
        ratio, layers = run.notes["tier"]
        out: dict[str, Scalar] = {"rank-ratio": ratio, "layers": ",".join(layers)}
        if run.node.device is not None:
            for tier in sorted({*run.cfg.fedara.tiers(), ratio}):
                out[f"flops@{tier:g}"] = flops_per_sample(
                    run.node.arch,
                    run.data.in_channels,
                    run.data.num_classes,
                    run.data.image_size,
                    run.model.feature_dim,
                    run.cfg.model.small_input_stem,
                    tier,
                    tuple(layers),
                )
        return out

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        """λ_t·L_FAC against anchors of the received extractor (none in round 1).

        Anchors are computed here, once, before the first training step; the
        gradient ratio of the first batch goes to the reply's metrics."""
        lam = anchor_weight(run.cfg, run.server_round)
        run.metrics.update({"rank-ratio": run.notes["tier"][0], "anchor-weight": lam})
        if lam <= 0:
            return None
        anchors = anchors_of(run)[0]
        run.metrics["anchor-grad-ratio"] = gradient_ratio(run, anchors, lam)
        reduction = run.cfg.fedara.anchor_reduction

        def loss(reps: Tensor, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
            return lam * anchor_loss(reps, anchors.to(reps.device)[y], reduction)

        return loss

    def after_step(self, run: ClientRun) -> AfterStep | None:
        """Frobenius decay μ·Σ‖U Vᵀ‖²_F, applied every ``fedara.decay-every`` steps
        (0: at the end of each epoch) as one step for the steps since the last."""
        mu, every = run.cfg.fedara.frobenius_decay, run.cfg.fedara.decay_every
        extractor = run.model.extractor
        if mu <= 0 or not factor_parameters(extractor):
            return None
        pending = 0

        def step(epoch_end: bool) -> None:
            nonlocal pending
            pending += 1
            if epoch_end or (every > 0 and pending >= every):
                decay_step(extractor, run.sgd.lr * mu * pending)
                pending = 0

        return step

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return {k: v for k, v in run.model.state_dict().items() if k.startswith(EXTRACTOR)}


def anchors_of(run: ClientRun) -> tuple[Tensor, Tensor]:
    """Consistency anchors: class means of RM(g(x)) under the received extractor.

    Called after the server's extractor is installed and before any training step,
    so the model's extractor *is* the frozen received one; computed without grad.
    """
    return class_means(run.model, run.data.x_train, run.data.y_train, run.data.num_classes)
