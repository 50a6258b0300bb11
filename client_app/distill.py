"""``fd``'s client part: per-class mean logits recorded while training, and a pull of
each sample's logits towards the global mean logits of its class."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from client_app.base import ClientHook, ClientRun
from client_app.prototypes import proto_arrays, received_rows
from common.messages import LOGIT
from models.train import ExtraLoss

SUMS, COUNTS = "fd-logit-sums", "fd-logit-counts"
"""``run.notes`` entries: per-class sums [C, C] and counts [C] of the logits seen while
training (this message only)."""


def received_logits(run: ClientRun) -> tuple[Tensor, Tensor]:
    """Global mean logits the server sent, as ``(table [C, C], known bool [C])``."""
    return received_rows(run, LOGIT, run.data.num_classes, "logits")


def distillation(logits: Tensor, teacher: Tensor, kind: str) -> Tensor:
    """The distillation term of a batch: ``kl`` = mean over samples of
    KL(softmax(teacher) ‖ softmax(logits)); ``mse`` = mean squared difference."""
    if kind == "mse":
        return F.mse_loss(logits, teacher)
    return F.kl_div(
        F.log_softmax(logits, 1), F.log_softmax(teacher, 1), reduction="batchmean", log_target=True
    )


def record(run: ClientRun, logits: Tensor, y: Tensor) -> None:
    """Add a batch's (finite) logits to the per-class sums in ``run.notes``."""
    num_classes = run.data.num_classes
    sums = run.notes.setdefault(SUMS, torch.zeros(num_classes, num_classes, dtype=torch.float64))
    counts = run.notes.setdefault(COUNTS, torch.zeros(num_classes, dtype=torch.int64))
    z = logits.detach().to("cpu", torch.float64)
    ok = torch.isfinite(z).all(1)
    labels = y.detach().cpu()[ok]
    sums.index_add_(0, labels, z[ok])
    counts += torch.bincount(labels, minlength=num_classes)


def mean_logits(run: ClientRun) -> tuple[Tensor, Tensor]:
    """``(means [C, C], present bool [C])``: the logits recorded while training, per
    class of the training data; a class training never recorded (a run whose every
    batch of it diverged) from the trained model in eval mode instead."""
    num_classes = run.data.num_classes
    sums = run.notes.get(SUMS, torch.zeros(num_classes, num_classes, dtype=torch.float64))
    counts = run.notes.get(COUNTS, torch.zeros(num_classes, dtype=torch.int64))
    present = torch.bincount(run.data.y_train, minlength=num_classes) > 0
    means = sums / counts.clamp(min=1).unsqueeze(1).to(sums.dtype)
    missing = present & (counts == 0)
    if bool(missing.any()):
        run.model.eval()
        with torch.no_grad():
            for c in torch.nonzero(missing).flatten().tolist():
                x = run.data.x_train[run.data.y_train == c][:500]
                means[c] = run.model(x).to(torch.float64).mean(0)
    return means.to(torch.float32), present


class FDHook(ClientHook):
    """``fd``: CE + λ·D(logits, global[y]) while recording per-class mean logits;
    upload those means (``privacy.*`` applied to each row)."""

    name = "fd"

    def install(self, run: ClientRun, arrays: dict[str, Tensor]) -> None:
        received_logits(run)  # validates; the loss reads run.received

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        table, known = received_logits(run)
        lam, kind = run.cfg.fd.lam, run.cfg.fd.loss
        run.notes.pop(SUMS, None)  # this training's logits only
        run.notes.pop(COUNTS, None)

        def loss(reps: Tensor, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
            record(run, logits, y)
            mask = known.to(y.device)[y]
            if lam == 0 or not bool(mask.any()):
                return logits.sum() * 0.0
            teacher = table.to(logits.device)[y[mask]]
            return lam * distillation(logits[mask], teacher, kind)

        return loss

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return proto_arrays(run, *mean_logits(run), prefix=LOGIT)
