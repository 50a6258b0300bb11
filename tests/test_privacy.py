"""The privacy audit's tools and the protection of representation uploads."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from client_app.base import open_run
from common import methods
from models.privacy import closest, invert, invert_rows, protect, psnr, ssim
from server_app.inprocess import client_context


def _image(seed: int = 0) -> torch.Tensor:
    """A smooth 1×12×12 image in [0, 1] (a blob)."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.arange(12.0), torch.arange(12.0), indexing="ij")
    cx, cy = torch.rand(2, generator=g) * 6 + 3
    return torch.exp(-((xx - cx) ** 2 + (yy - cy) ** 2) / 8).unsqueeze(0)


def test_the_attack_recovers_an_image_through_the_identity_almost_exactly() -> None:
    """A check that the optimiser works: with the identity as 'extractor' the upload
    is the image itself."""
    image = _image()
    rec = invert(lambda x: x.flatten(1), image.flatten(), (1, 12, 12), steps=400, lr=0.1,
                 tv=0.0, generator=torch.Generator().manual_seed(1))[0]  # fmt: skip
    assert psnr(rec, image) > 30
    assert ssim(rec, image) > 0.95


def test_the_row_attack_recovers_the_images_whose_rows_it_is_shown() -> None:
    """``invert_rows`` (the ``guide`` form's attack) with rows that are the centred
    images themselves (class c's row: image c − 0.5): the images of the rows it matches
    come back in direction; the one whose row it is not given does not."""
    images = torch.stack([_image(s) for s in range(3)])

    def rows_of(x: torch.Tensor) -> torch.Tensor:
        return x.flatten(1) - 0.5  # image i is class i's row

    rec = invert_rows(rows_of, rows_of(images), [0, 2], (1, 12, 12), 3, steps=300, tv=0.0,
                      generator=torch.Generator().manual_seed(1))  # fmt: skip
    cos = torch.nn.functional.cosine_similarity(rows_of(rec), rows_of(images), dim=1)
    assert float(cos[0]) > 0.99 and float(cos[2]) > 0.99
    assert float(cos[1]) < 0.5


def test_the_logit_form_is_the_class_mean_logit_over_every_batch() -> None:
    """``fedhet audit``'s ``logit`` target (FD's upload): the mean of the logits of a
    class's images, whatever the batching: against the closed form of a linear model."""
    from cli.audit import class_logit

    g = torch.Generator().manual_seed(3)
    w, b = torch.randn(144, 10, generator=g), torch.randn(10, generator=g)
    images = torch.rand(7, 1, 12, 12, generator=g)
    got = class_logit(lambda x: x.flatten(1) @ w + b, images, batch=3)
    torch.testing.assert_close(got, images.flatten(1).mean(0) @ w + b, rtol=1e-5, atol=1e-5)


def test_from_pure_noise_it_recovers_nothing_useful() -> None:
    """An upload of noise gives noise: the reconstruction is no closer to real images
    than a random image is (chance level)."""
    g = torch.Generator().manual_seed(2)
    noise = torch.rand(144, generator=g)
    rec = invert(lambda x: x.flatten(1), noise, (1, 12, 12), steps=400, tv=0.0, generator=g)[0]
    real = torch.stack([_image(s) for s in range(20)])
    _, got = closest(rec, real)
    chance = [closest(torch.rand(1, 12, 12, generator=g), real)[1] for _ in range(20)]
    assert got < np.percentile(chance, 95) + 1.0
    assert got < psnr(real[0], real[0] * 0.9) - 10


def test_psnr_and_ssim_against_closed_forms() -> None:
    a = torch.zeros(1, 8, 8)
    assert psnr(a, a + 0.1) == pytest.approx(20.0)  # mse 0.01
    assert ssim(_image(), _image()) == pytest.approx(1.0)
    assert ssim(_image(), 1 - _image()) < 0


def test_clipping_bounds_every_vector_and_the_noise_has_the_stated_sigma() -> None:
    g = torch.Generator().manual_seed(3)
    vectors = torch.randn(4000, 50, generator=g) * 5
    clipped = protect(vectors, 2.0, 0.0, g)
    assert float(clipped.norm(dim=1).max()) <= 2.0 + 1e-5
    small = vectors[:1] / vectors[:1].norm() * 1.5  # inside the bound: unchanged
    torch.testing.assert_close(protect(small, 2.0, 0.0, g), small)
    noisy = protect(vectors, 2.0, 0.5, g)
    residual = (noisy - clipped).flatten()
    assert float(residual.std()) == pytest.approx(0.5 * 2.0, rel=0.02)
    assert abs(float(residual.mean())) < 0.01
    assert torch.equal(protect(vectors, 0.0, 3.0, g), vectors)  # clip 0: off


@pytest.mark.parametrize("algorithm", ["fedre", "fedproto"])
def test_uploaded_representations_are_clipped_and_noised(tmp_path: Path, algorithm: str) -> None:
    def upload(**cfg):  # type: ignore[no-untyped-def]
        ctx = client_context(tmp_path, algorithm, pid=1, **cfg)
        run = open_run(ctx, 2, methods.get(algorithm).client_hook())
        return {
            k: v
            for k, v in methods.get(algorithm).client_hook().upload(run).items()
            if k != "soft-label"
        }

    plain = upload()
    clipped = upload(**{"privacy.clip": 0.5})
    noisy = upload(**{"privacy.clip": 0.5, "privacy.noise": 1.0})
    for key, value in plain.items():
        assert float(value.norm()) > 0.5
        assert float(clipped[key].norm()) == pytest.approx(0.5, rel=1e-5)
        assert not torch.allclose(noisy[key], clipped[key])
        assert noisy[key].dtype == torch.float32
    again = upload(**{"privacy.clip": 0.5, "privacy.noise": 1.0})
    assert all(torch.equal(again[k], noisy[k]) for k in noisy)  # seeded: reproducible


def test_parameter_uploads_go_through_flowers_local_dp_mod(tmp_path: Path) -> None:
    """privacy.dp-clip > 0: the head update is clipped to that norm and noised by
    Flower's LocalDpMod; the reply stays float32 (the server accepts only that)."""
    from flwr.app import ConfigRecord, Message, RecordDict

    from client_app.app import app
    from common.records import to_numpy, to_record

    head = {"head.weight": np.zeros((10, 500), np.float32), "head.bias": np.zeros(10, np.float32)}

    def upload(**cfg):  # type: ignore[no-untyped-def]
        ctx = client_context(tmp_path, "lgfedavg", pid=1, **cfg)
        content = {"arrays": to_record(head), "config": ConfigRecord({"server-round": 1})}
        msg = Message(RecordDict(content), dst_node_id=ctx.node_id, message_type="train.lgfedavg")
        return to_numpy(app(msg, ctx).content.array_records["arrays"])

    plain = upload()
    private = upload(**{"privacy.dp-clip": 0.01, "privacy.dp-epsilon": 1e6})  # ~no noise
    noisy = upload(**{"privacy.dp-clip": 0.01, "privacy.dp-epsilon": 1.0})
    norm = np.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in private.values()))
    assert norm == pytest.approx(0.01, rel=1e-3)  # the update (from zeros) clipped
    assert np.sqrt(sum(float((v**2).sum()) for v in plain.values())) > 0.01
    assert all(v.dtype == np.float32 for v in noisy.values())
    assert not np.allclose(noisy["head.bias"], private["head.bias"])


@pytest.mark.slow  # a 2-round in-process run, then the audit of one client
def test_the_audit_scores_every_form_of_a_finished_run(tmp_path: Path) -> None:
    """``fedhet audit`` finds a finished run's personal models (their files carry the
    run's lineage tag) and scores one reconstruction per knowledge form."""
    from cli.audit import FORMS, audit, summarise
    from server_app.inprocess import run_inprocess

    res, _ = run_inprocess(tmp_path, algorithm="fedre", keep_clients=True)
    out = Path(res["config"]["out-dir"])
    rows = audit(out, clients=1, steps=2)
    assert [r.form for r in rows] == list(FORMS)
    for r in rows:
        assert r.image.shape == r.nearest.shape and float(r.image.min()) >= 0
        assert np.isfinite(r.psnr_closest) and np.isfinite(r.psnr_class_mean)
    assert set(summarise(rows)) == set(FORMS)
