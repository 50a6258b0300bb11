"""What a server could reconstruct from an upload, and noise that makes it harder.

Pure PyTorch with explicit generators; no Flower imports.

* :func:`protect`: clip each uploaded vector to an L2 bound and add Gaussian noise
  (σ as a multiple of the bound), the Gaussian mechanism per vector.
* :func:`invert`: a white-box inversion, the strongest honest-but-curious server: it
  knows the client's extractor and optimises input images in [0, 1] (a sigmoid
  parametrisation, Adam, a total-variation prior, a fixed budget of steps) so that the
  extractor's representation — or the uploaded mix of several, with the weights the
  upload reveals — matches the uploaded vector.
* :func:`invert_gradient`: the DLG baseline, images whose gradient of the head matches
  an observed one.
* :func:`invert_rows`: images whose rows of a per-class upload computed from them
  (FedL2G's guide-gradient rows) match the uploaded rows in direction.
* :func:`psnr`, :func:`ssim`: image similarity against the client's real images.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

Extractor = Callable[[Tensor], Tensor]
"""``images [n, c, h, w] in [0, 1] -> representations [n, d]``."""


def protect(vectors: Tensor, clip: float, noise: float, generator: torch.Generator) -> Tensor:
    """Each row scaled to L2 norm ≤ ``clip``, then N(0, (noise·clip)²) added per element
    (``clip`` 0: unchanged)."""
    if clip <= 0:
        return vectors
    norms = vectors.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    clipped = vectors * torch.clamp(clip / norms, max=1.0)
    if noise <= 0:
        return clipped
    draw = torch.randn(clipped.shape, generator=generator, dtype=torch.float64)
    return (clipped.double() + noise * clip * draw).to(vectors.dtype)


def total_variation(x: Tensor) -> Tensor:
    """Mean absolute difference of neighbouring pixels."""
    return (x[..., 1:, :] - x[..., :-1, :]).abs().mean() + (
        x[..., :, 1:] - x[..., :, :-1]
    ).abs().mean()


def invert(
    extractor: Extractor,
    target: Tensor,
    shape: tuple[int, int, int],
    *,
    weights: Tensor | None = None,
    steps: int = 300,
    lr: float = 0.1,
    tv: float = 0.01,
    generator: torch.Generator,
) -> Tensor:
    """Images ``[k, c, h, w]`` whose representations (mixed with ``weights`` [k], if
    given; k = 1 otherwise) match ``target`` [d]; starts from noise."""
    k = 1 if weights is None else len(weights)
    logits = torch.randn((k, *shape), generator=generator) * 0.1
    logits.requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=lr)
    mix = None if weights is None else weights.to(target.dtype)
    for _ in range(steps):
        x = torch.sigmoid(logits)
        reps = extractor(x)
        rep = reps[0] if mix is None else mix @ reps
        loss = F.mse_loss(rep, target) + tv * total_variation(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return torch.sigmoid(logits).detach()


def invert_gradient(
    extractor: Extractor,
    head: torch.nn.Linear,
    label: int,
    grads: tuple[Tensor, Tensor],
    shape: tuple[int, int, int],
    *,
    steps: int = 300,
    lr: float = 0.1,
    tv: float = 0.01,
    generator: torch.Generator,
) -> Tensor:
    """DLG with a known label (iDLG): one image whose cross-entropy gradient of the
    head's (weight, bias) matches ``grads``; cosine distance, as the later DLG work."""
    logits = (torch.randn((1, *shape), generator=generator) * 0.1).requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=lr)
    y = torch.tensor([label])
    want = torch.cat([g.flatten() for g in grads])
    for _ in range(steps):
        x = torch.sigmoid(logits)
        loss_ce = F.cross_entropy(head(extractor(x)), y)
        got = torch.autograd.grad(loss_ce, [head.weight, head.bias], create_graph=True)
        flat = torch.cat([g.flatten() for g in got])
        loss = 1 - F.cosine_similarity(flat, want, dim=0) + tv * total_variation(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return torch.sigmoid(logits).detach()


def invert_rows(
    rows_of: Callable[[Tensor], Tensor],
    target: Tensor,
    classes: list[int],
    shape: tuple[int, int, int],
    count: int,
    *,
    steps: int = 300,
    lr: float = 0.1,
    tv: float = 0.01,
    generator: torch.Generator,
) -> Tensor:
    """``count`` images ``[count, c, h, w]`` whose per-class rows (``rows_of(images)``
    [C, w]) match ``target``'s rows of ``classes`` in direction: the mean cosine
    distance over those rows, as :func:`invert_gradient`; starts from noise."""
    logits = (torch.randn((count, *shape), generator=generator) * 0.1).requires_grad_(True)
    opt = torch.optim.Adam([logits], lr=lr)
    want = target[classes]
    for _ in range(steps):
        x = torch.sigmoid(logits)
        got = rows_of(x)[classes]
        distance = 1 - F.cosine_similarity(got, want.to(got.dtype), dim=1).mean()
        loss = distance + tv * total_variation(x)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return torch.sigmoid(logits).detach()


def psnr(a: Tensor, b: Tensor) -> float:
    """Peak signal-to-noise ratio in dB of two images in [0, 1]."""
    mse = float(F.mse_loss(a.double(), b.double()))
    return float("inf") if mse == 0 else 10.0 * float(torch.log10(torch.tensor(1.0 / mse)))


def ssim(a: Tensor, b: Tensor, window: int = 7) -> float:
    """Structural similarity of two images ``[c, h, w]`` in [0, 1] (uniform window,
    the usual constants)."""
    x, y = a.double().unsqueeze(0), b.double().unsqueeze(0)
    c1, c2 = 0.01**2, 0.03**2
    pool = lambda t: F.avg_pool2d(t, window, 1)  # noqa: E731
    mx, my = pool(x), pool(y)
    vx, vy = pool(x * x) - mx * mx, pool(y * y) - my * my
    cov = pool(x * y) - mx * my
    score = ((2 * mx * my + c1) * (2 * cov + c2)) / ((mx**2 + my**2 + c1) * (vx + vy + c2))
    return float(score.mean())


def closest(image: Tensor, candidates: Tensor) -> tuple[int, float]:
    """Index and PSNR of the candidate ``[n, c, h, w]`` closest to ``image``."""
    mse = ((candidates.double() - image.double()) ** 2).flatten(1).mean(1)
    i = int(mse.argmin())
    return i, psnr(image, candidates[i])
