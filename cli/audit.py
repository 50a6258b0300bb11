"""``fedhet audit``: what an honest-but-curious server could reconstruct from uploads.

Threat model: the server sees every upload and knows each client's trained model
exactly (white box, the worst case); it inverts an upload by optimising input images
so that the model's representation (or the uploaded mix of several, whose weights the
soft label reveals) matches it. Quality is PSNR / SSIM of the reconstruction against the
client's closest training image of that class and against that class's mean image.

Per client of a finished simulation (personal models under ``<out-dir>/clients``), one
reconstruction per knowledge form, all from the same trained model and data:

* ``raw``: one training sample's representation (what FedRE's ``rsr`` mixes and what
  a raw-representation upload would send);
* ``prototype``: the class prototype of the client's largest class (FedProto, FedGH,
  FedTGP upload one per class);
* ``entangled``: FedRE's upload, Σ_c w_c p_c with the round's weights (one image per
  present class; scored on the largest class, as the prototype);
* ``gradient``: the DLG baseline, one sample's gradient of the head (label known);
* ``logit``: FD's upload, the mean logit vector of the client's largest class (over
  its training images, the trained model in eval mode), inverted through the head;
* ``guide``: FedL2G-f's upload, the meta step's guide-gradient rows (the last round's
  study and quiz batches, the run seed's initial guide table), inverted by optimising
  the study images so that the rows they give match the uploaded rows in direction.
  The attacker is also given what the upload does not reveal, the study labels and
  the quiz direction ``v`` (the quiz loss's gradient at the stepped model), so the
  rows are a closed form of the images (``models.guide.study_rows``): an upper bound
  on what inverting this form recovers. Scored on the first study sample of the
  class with the most study samples;
* ``guide-logit``: the same for FedL2G-l (rows in the logit space).

``privacy.clip`` / ``privacy.noise`` of the run apply to ``prototype``, ``entangled``,
``logit``, ``guide`` and ``guide-logit`` as they would to the uploads.
"""

from __future__ import annotations

import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from flwr.app import Context, RecordDict

FORMS = ("raw", "prototype", "entangled", "gradient", "logit", "guide", "guide-logit")


@dataclass
class Reconstruction:
    """One form's reconstruction for one client, and how close it came."""

    form: str
    partition: int
    image: torch.Tensor
    nearest: torch.Tensor
    psnr_closest: float
    ssim_closest: float
    psnr_class_mean: float
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Finished:
    """A finished simulation: its folder, run config, node count and last round."""

    out_dir: Path
    config: dict[str, Any]
    nodes: int
    last: int

    @classmethod
    def load(cls, out_dir: Path) -> Finished:
        doc = json.loads((out_dir / "results.json").read_text())
        return cls(out_dir, doc["config"], len(doc["summary"]["nodes"]), doc["rounds"][-1]["round"])


def client_run(done: Finished, partition: int):  # type: ignore[no-untyped-def]
    """The client's run as its last evaluation saw it (trained model, data)."""
    from client_app.base import open_run
    from common import methods

    ctx = Context(
        run_id=1,
        node_id=partition + 1,
        node_config={"partition-id": partition, "num-partitions": done.nodes},
        state=RecordDict(),
        # the files carry the run's lineage tag, which results.json does not record:
        # carried over, the node opens the newest version its folder holds
        run_config={**done.config, "carry-personal-state": True},
    )
    hook = methods.get(done.config["algorithm"]).client_hook()
    run = open_run(ctx, done.last, hook, str(done.out_dir / "clients"), training=False)
    if run.rounds_trained == 0:
        raise FileNotFoundError(
            f"no personal model of partition {partition} in {done.out_dir / 'clients'}"
        )
    return run.model.eval(), run


def audit_client(done: Finished, partition: int, steps: int) -> list[Reconstruction]:
    """Every form's reconstruction for one client."""
    from client_app.base import ClientRun
    from client_app.prototypes import entangled, protected
    from models.privacy import invert, invert_gradient
    from models.train import class_means

    model, run = client_run(done, partition)
    assert isinstance(run, ClientRun)
    run.server_round = done.last  # the generators of the last round's upload
    x, y = run.data.x_train.float(), run.data.y_train
    lo = x.amin(dim=(0, 2, 3), keepdim=True)[0]  # per channel: the normalised black
    hi = x.amax(dim=(0, 2, 3), keepdim=True)[0]  # and white of this client's images
    images = (x - lo) / (hi - lo)
    c, h, w = (int(v) for v in images.shape[1:])
    shape = (c, h, w)
    big = int(torch.bincount(y, minlength=run.data.num_classes).argmax())
    own = images[y == big]
    mean_image = own.mean(0)
    gen = torch.Generator().manual_seed(1_000 + partition)

    def features(t: torch.Tensor) -> torch.Tensor:
        """Images in [0, 1] -> the representation of the model's input scale."""
        return model.features(t * (hi - lo) + lo)  # type: ignore[operator]

    def score(form: str, image: torch.Tensor, pool: torch.Tensor, **extra: Any) -> Reconstruction:
        return scored(form, partition, image, pool, mean_image, **extra)

    out = []
    with torch.no_grad():
        sample = int(torch.nonzero(y == big)[0, 0])
        raw = features(images[sample : sample + 1])[0]
        means, _ = class_means(model, x, y, run.data.num_classes)
    for p in model.parameters():
        p.requires_grad_(False)
    rec = invert(features, raw, shape, steps=steps, generator=gen)[0]
    out.append(score("raw", rec, images[sample : sample + 1]))
    proto = protected(run, means[big : big + 1])[0]
    rec = invert(features, proto, shape, steps=steps, generator=gen)[0]
    out.append(score("prototype", rec, own))
    reps, soft = entangled(run)
    present = torch.nonzero(soft[0] > 0).flatten()
    target = protected(run, reps)[0]
    recs = invert(features, target, shape, weights=soft[0][present], steps=steps, generator=gen)
    at = int(torch.nonzero(present == big)[0, 0]) if bool((present == big).any()) else 0
    out.append(score("entangled", recs[at], own, classes=len(present)))
    head = model.head
    for p in head.parameters():
        p.requires_grad_(True)
    loss = F.cross_entropy(head(features(images[sample : sample + 1])), y[sample : sample + 1])
    gw, gb = torch.autograd.grad(loss, [head.weight, head.bias])
    rec = invert_gradient(features, head, big, (gw, gb), shape, steps=steps, generator=gen)[0]
    out.append(score("gradient", rec, images[sample : sample + 1]))
    for p in model.parameters():
        p.requires_grad_(False)

    def logits(t: torch.Tensor) -> torch.Tensor:
        return head(features(t))  # type: ignore[no-any-return]

    target = protected(run, class_logit(logits, own)[None])[0]
    rec = invert(logits, target, shape, steps=steps, generator=gen)[0]
    out.append(score("logit", rec, own))
    for form in ("guide", "guide-logit"):
        out.append(guide_reconstruction(form, done, run, images, (lo, hi), steps, gen))
    return out


def guide_reconstruction(  # type: ignore[no-untyped-def]
    form: str,
    done: Finished,
    run,
    images: torch.Tensor,
    scale: tuple[torch.Tensor, torch.Tensor],
    steps: int,
    gen: torch.Generator,
) -> Reconstruction:
    """The ``guide`` (FedL2G-f) or ``guide-logit`` (FedL2G-l) form: the last round's
    rows, as the client would upload them from this model and data, inverted with the
    study labels and quiz direction given (module docstring)."""
    from client_app.fedl2g import FedL2GHook, FedL2GLHook
    from common.messages import GUIDE, GUIDE_GRAD
    from models.guide import initial_table, quiz_direction, study_rows
    from models.privacy import invert_rows

    hook = FedL2GHook() if form == "guide" else FedL2GLHook()
    model, (lo, hi) = run.model, scale
    classes_n = run.data.num_classes
    width = hook.width(run)
    table = torch.from_numpy(initial_table(classes_n, width, int(done.config["seed"])))
    run.received = {GUIDE: table}
    study, quiz = hook.meta_batches(run)
    upload = hook.upload(run)  # the rows as sent: privacy.* applied
    classes = sorted(int(key[len(GUIDE_GRAD) :]) for key in upload)
    target = torch.zeros(classes_n, width)
    for c in classes:
        target[c] = upload[f"{GUIDE_GRAD}{c}"]
    v = quiz_direction(model, table, study, quiz, run.sgd.lr, hook.space)
    labels = [y for _, y in study]
    sizes = [len(y) for y in labels]

    def rows_of(t: torch.Tensor) -> torch.Tensor:
        parts = (t * (hi - lo) + lo).split(sizes)
        batch = list(zip(parts, labels, strict=True))
        return study_rows(model, batch, v, run.sgd.lr, hook.space, classes_n)

    c, h, w = (int(s) for s in images.shape[1:])
    recs = invert_rows(rows_of, target, classes, (c, h, w), sum(sizes), steps=steps, generator=gen)
    ys = torch.cat(labels)
    counts = torch.bincount(ys, minlength=classes_n)
    chosen = int(counts.argmax())
    at = int(torch.nonzero(ys == chosen)[0, 0])
    pool = images[run.data.y_train == chosen]
    extra = {"classes": len(classes), "study": sum(sizes), "of-class": int(counts[chosen])}
    return scored(form, run.node.partition_id, recs[at], pool, pool.mean(0), **extra)


def scored(
    form: str,
    partition: int,
    image: torch.Tensor,
    pool: torch.Tensor,
    mean_image: torch.Tensor,
    **extra: Any,
) -> Reconstruction:
    """``image`` scored against its closest image in ``pool`` and ``mean_image``."""
    from models.privacy import closest, psnr, ssim

    i, p = closest(image, pool)
    return Reconstruction(
        form, partition, image, pool[i], p, ssim(image, pool[i]), psnr(image, mean_image), extra
    )


def class_logit(logits: Any, images: torch.Tensor, batch: int = 500) -> torch.Tensor:
    """The mean logit vector of ``images`` (one class's, in [0, 1]): FD's upload."""
    with torch.no_grad():
        starts = range(0, len(images), batch)
        parts = [logits(images[i : i + batch]).double().sum(0) for i in starts]
    return (torch.stack(parts).sum(0) / len(images)).float()


def audit(out_dir: Path, clients: int = 20, steps: int = 300) -> list[Reconstruction]:
    """Every form for the first ``clients`` partitions of the run in ``out_dir``."""
    done = Finished.load(out_dir)
    rows = []
    for pid in range(min(clients, done.nodes)):
        rows += audit_client(done, pid, steps)
    return rows


def summarise(rows: list[Reconstruction]) -> dict[str, dict[str, float]]:
    """Per form: mean and std of each score."""
    out = {}
    for form in FORMS:
        got = [r for r in rows if r.form == form]
        if not got:
            continue
        entry: dict[str, float] = {"n": len(got)}
        for key in ("psnr_closest", "ssim_closest", "psnr_class_mean"):
            vals = [getattr(r, key) for r in got]
            entry[key] = statistics.fmean(vals)
            entry[key + "_std"] = statistics.stdev(vals) if len(vals) > 1 else 0.0
        out[form] = entry
    return out


def picture_grid(rows: list[Reconstruction], path: Path) -> Path:
    """One client's reconstructions (top) beside the nearest real image (bottom)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(rows), figsize=(2.2 * len(rows), 4.6))
    for j, r in enumerate(rows):
        for i, img in enumerate((r.image, r.nearest)):
            ax = axes[i][j]
            ax.imshow(img.permute(1, 2, 0).squeeze(-1).numpy(), cmap="gray", vmin=0, vmax=1)
            ax.set_xticks([])
            ax.set_yticks([])
        axes[0][j].set_title(f"{r.form}\nPSNR {r.psnr_closest:.1f} dB", fontsize=9)
    axes[0][0].set_ylabel("reconstruction")
    axes[1][0].set_ylabel("nearest real")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_audit(out_dir: Path, rows: list[Reconstruction]) -> tuple[Path, Path]:
    """``<out-dir>/audit.json`` (summary and every client's scores) and
    ``<out-dir>/audit.png`` (the first client's reconstructions)."""
    doc = {
        "summary": summarise(rows),
        "rows": [
            {
                "form": r.form,
                "partition": r.partition,
                "psnr_closest": r.psnr_closest,
                "ssim_closest": r.ssim_closest,
                "psnr_class_mean": r.psnr_class_mean,
                **r.extra,
            }
            for r in rows
        ],  # fmt: skip
    }
    path = out_dir / "audit.json"
    path.write_text(json.dumps(doc, indent=1))
    grid = picture_grid(
        [r for r in rows if r.partition == rows[0].partition], out_dir / "audit.png"
    )
    return path, grid
