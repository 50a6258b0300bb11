"""Client parts of the prototype family: ``fedproto``, ``fedgh``, ``fedre``.

All three compute class prototypes ``p_c = mean RM(g(x))`` over the client's
training samples of class ``c`` with the *trained* model in eval mode, for the
classes the client has; absent classes are simply not sent.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from client_app.base import ClientHook, ClientRun, GlobalHeadHook, head_arrays
from common.messages import PROTO, REP, SOFT_LABEL
from models.entangle import entangle_prototypes, entangle_samples
from models.privacy import protect
from models.train import EvalStats, ExtraLoss, class_means, evaluate


def prototypes(run: ClientRun) -> tuple[Tensor, Tensor]:
    """``(means [C, d], present bool [C])`` of the trained model on training data."""
    means, counts = class_means(run.model, run.data.x_train, run.data.y_train, run.data.num_classes)
    return means, counts > 0


def proto_arrays(
    run: ClientRun, means: Tensor, present: Tensor, prefix: str = PROTO
) -> dict[str, Tensor]:
    """``<prefix><c>`` (``proto.<c>``) of the present classes, each protected
    (``privacy.*``)."""
    rows = protected(run, means[present])
    classes = [c for c in range(len(present)) if present[c]]
    return {f"{prefix}{c}": rows[i] for i, c in enumerate(classes)}


def protected(run: ClientRun, vectors: Tensor) -> Tensor:
    """``privacy.clip`` / ``privacy.noise`` applied to each row (seeded by seed,
    round and partition, so a run stays reproducible)."""
    p = run.cfg.privacy
    return protect(vectors, p.clip, p.noise, run.generator(purpose=3))


def received_rows(run: ClientRun, prefix: str, width: int, what: str) -> tuple[Tensor, Tensor]:
    """The per-class vectors ``<prefix><c>`` [width] the server sent, as ``(table [C,
    width], known bool [C])``; any other key, class or shape is a ValueError naming
    the key (``what``: the vectors' name in it)."""
    num_classes = run.data.num_classes
    table = torch.zeros(num_classes, width)
    known = torch.zeros(num_classes, dtype=torch.bool)
    for key, value in run.received.items():
        if not key.startswith(prefix):
            raise ValueError(f"unexpected array '{key}' from the server")
        c = int(key.removeprefix(prefix))
        if not 0 <= c < num_classes or value.shape != (width,):
            raise ValueError(f"bad global {what} '{key}' {tuple(value.shape)}")
        table[c], known[c] = value, True
    return table, known


def received_prototypes(run: ClientRun) -> tuple[Tensor, Tensor]:
    """Global prototypes the server sent, as ``(table [C, d], known bool [C])``."""
    return received_rows(run, PROTO, run.model.feature_dim, "prototype")


class FedProtoHook(ClientHook):
    """``fedproto``: CE + λ·MSE(rep, global_proto[y]); upload class prototypes."""

    name = "fedproto"

    def install(self, run: ClientRun, arrays: dict[str, Tensor]) -> None:
        received_prototypes(run)  # validates; the loss reads run.received

    def lam(self, run: ClientRun) -> float:
        return run.cfg.fedproto.lam

    def infer(self, run: ClientRun) -> str:
        return run.cfg.fedproto.infer

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        table, known = received_prototypes(run)
        lam = self.lam(run)
        if not bool(known.any()) or lam == 0:
            return None
        table, known = table.to(run.data.x_train.device), known

        def loss(reps: Tensor, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
            mask = known.to(y.device)[y]
            if not bool(mask.any()):
                return reps.sum() * 0.0
            return lam * F.mse_loss(reps[mask], table.to(reps.device)[y[mask]])

        return loss

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return proto_arrays(run, *prototypes(run))

    def evaluate(self, run: ClientRun, x: Tensor, y: Tensor) -> EvalStats:
        if self.infer(run) == "head":
            return super().evaluate(run, x, y)
        table, known = received_prototypes(run)
        if not bool(known.any()):  # nothing global yet: fall back to the head
            return super().evaluate(run, x, y)

        def nearest(x: Tensor) -> Tensor:
            dist = torch.cdist(run.model.features(x), table.to(x.device))
            return (-dist).masked_fill(~known.to(x.device), float("-inf"))

        return evaluate(run.model, x, y, predict=nearest)


class FedTGPHook(FedProtoHook):
    """``fedtgp``: the client side of FedProto (CE + λ·MSE to the global prototype
    of y, prototypes after training), with ``fedtgp.lambda``; evaluation with the
    client's own head."""

    name = "fedtgp"

    def lam(self, run: ClientRun) -> float:
        return run.cfg.fedtgp.lam

    def infer(self, run: ClientRun) -> str:
        return "head"


class FedGHHook(GlobalHeadHook):
    """``fedgh``: install the global head, CE training, upload class prototypes."""

    name = "fedgh"

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return proto_arrays(run, *prototypes(run))


class FedREHook(GlobalHeadHook):
    """``fedre``: install the global head, CE training, upload ONE entangled
    representation ``rep`` [d] and its soft label ``soft-label`` [C]."""

    name = "fedre"

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        rep, soft = entangled(run)
        return {REP: protected(run, rep), SOFT_LABEL: soft}


def entangled(run: ClientRun) -> tuple[Tensor, Tensor]:
    """This round's entangled pairs ``([n, d], [n, C])``, n = ``fedre.reps-per-client``;
    weights drawn from (seed, round, partition), one draw per row in turn."""
    gen = run.generator(purpose=1)
    mix, n = run.cfg.fedre.mix, run.cfg.fedre.reps_per_client
    if mix == "rsr":
        with torch.no_grad():
            run.model.eval()
            reps = torch.cat(
                [
                    run.model.features(run.data.x_train[i : i + 500])
                    for i in range(0, len(run.data.y_train), 500)
                ]
            )
        pairs = [
            entangle_samples(reps, run.data.y_train, run.data.num_classes, gen) for _ in range(n)
        ]
    else:
        means, present = prototypes(run)
        pairs = [entangle_prototypes(means, present, mix, gen) for _ in range(n)]
    return torch.stack([p[0] for p in pairs]), torch.stack([p[1] for p in pairs])


__all__ = ["FedGHHook", "FedProtoHook", "FedREHook", "FedTGPHook", "head_arrays"]
