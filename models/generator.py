"""FedGen's conditional feature generator and its two losses (pure PyTorch).

The generator maps noise ``ε`` [B, m] and a one-hot label ``y`` [B, C] to a feature
vector in the heads' input space: ``out(ReLU(BN(hidden([ε, onehot(y)]))))`` [B, d]
(the FedGen authors' and HtFLlib's shape). The server trains it so that the clients'
heads, ensembled per class, classify its output as ``y``; the clients then train their
heads on its output as extra labelled data. Randomness comes only from the explicit
``torch.Generator`` each function takes.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn


class Generator(nn.Module):
    """``G(ε, y)``: ``Linear(m + C, H)`` → ``BatchNorm1d(H)`` → ReLU → ``Linear(H, d)``."""

    def __init__(self, noise_dim: int, num_classes: int, hidden_dim: int, feature_dim: int):
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        self.hidden = nn.Linear(noise_dim + num_classes, hidden_dim)
        self.norm = nn.BatchNorm1d(hidden_dim)
        self.out = nn.Linear(hidden_dim, feature_dim)

    def forward(self, noise: Tensor, labels: Tensor) -> Tensor:
        onehot = F.one_hot(labels, self.num_classes).to(noise.dtype)
        return self.out(F.relu(self.norm(self.hidden(torch.cat([noise, onehot], 1)))))

    def sample(self, labels: Tensor, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        """``(noise, features)`` for ``labels``; the noise ``ε ~ N(0, I)`` from ``gen``."""
        noise = torch.randn(len(labels), self.noise_dim, generator=gen)
        return noise, self(noise.to(labels.device), labels)


def generator_state(gen: Generator) -> dict[str, Tensor]:
    """What the server sends of a generator: its weights and BatchNorm running
    statistics (float32), not the batch counter (nothing reads it in eval mode)."""
    return {k: v for k, v in gen.state_dict().items() if not k.endswith("num_batches_tracked")}


def generator_from_state(state: dict[str, Tensor], num_classes: int) -> Generator:
    """A generator rebuilt from :func:`generator_state` (its sizes read off the
    shapes), in eval mode: a ValueError when the keys or shapes are not a generator's."""
    try:
        hidden, inputs = state["hidden.weight"].shape
        feature_dim = state["out.weight"].shape[0]
    except (KeyError, ValueError):
        raise ValueError(f"not a generator's arrays: {sorted(state)[:5]}") from None
    if inputs <= num_classes:
        raise ValueError(f"generator input {inputs} leaves no noise beside {num_classes} classes")
    gen = Generator(inputs - num_classes, num_classes, hidden, feature_dim)
    want = generator_state(gen)
    if set(state) != set(want) or any(state[k].shape != want[k].shape for k in want):
        raise ValueError(f"generator arrays {sorted(state)} do not fit one of {sorted(want)}")
    gen.load_state_dict(state, strict=False)
    return gen.eval()


def draw_labels(counts: Tensor, n: int, gen: torch.Generator) -> Tensor:
    """``n`` labels drawn with replacement, label ``c`` with probability
    ``counts[c] / Σ counts`` (HtFLlib's and the authors' sampling from the pooled
    label counts)."""
    return torch.multinomial(counts.to(torch.float64), n, replacement=True, generator=gen)


def diversity_loss(noise: Tensor, features: Tensor) -> Tensor:
    """The FedGen authors' diversity term ``exp(−mean_ij(‖ε_i − ε_j‖²/m · ‖z_i −
    z_j‖₁/d))``: small when samples with distant noise get distant features (their
    ``DiversityLoss(metric='l1')``, after Mao et al., 2019)."""
    noise_dist = (noise.unsqueeze(0) - noise.unsqueeze(1)).pow(2).mean(2)
    feature_dist = (features.unsqueeze(0) - features.unsqueeze(1)).abs().mean(2)
    return torch.exp(-(noise_dist * feature_dist).mean())


def ensemble_logits(weights: Tensor, biases: Tensor, z: Tensor, labels: Tensor) -> Tensor:
    """The teacher's logits of ``z`` [B, d] whose labels are ``labels`` [B]:
    ``weights[y] @ z + biases[y]``, where ``weights`` [C, C, d] / ``biases`` [C, C]
    hold, per label ``y``, the clients' heads combined with that label's weights
    (for linear heads, ``Σ_k α_k^y (W_k z + b_k)`` is exactly this)."""
    return torch.einsum("bcd,bd->bc", weights[labels], z) + biases[labels]


def train_generator(
    gen: Generator,
    weights: Tensor,
    biases: Tensor,
    label_counts: Tensor,
    *,
    iterations: int,
    batch_size: int,
    lr: float,
    diversity: float,
    rng: torch.Generator,
    probe: int = 256,
) -> tuple[float, float]:
    """Train ``gen`` in place: ``iterations`` Adam steps (lr ``lr``, a fresh
    optimiser, as HtFLlib's) on batches of ``batch_size`` labels drawn from
    ``label_counts`` (:func:`draw_labels`), loss ``CE(ensemble_logits(G(ε, y)), y) +
    diversity · diversity_loss``. The heads are fixed. Returns the teacher's CE on a
    ``probe`` batch (drawn once from ``rng``, the generator in eval mode) before and
    after training, so the step can report what it achieved."""
    probe_labels = draw_labels(label_counts, probe, rng)
    probe_noise = torch.randn(probe, gen.noise_dim, generator=rng)

    def probe_ce() -> float:
        gen.eval()
        with torch.no_grad():
            logits = ensemble_logits(weights, biases, gen(probe_noise, probe_labels), probe_labels)
            return float(F.cross_entropy(logits, probe_labels))

    before = probe_ce()
    opt = torch.optim.Adam(gen.parameters(), lr=lr)
    gen.train()
    for _ in range(iterations):
        labels = draw_labels(label_counts, batch_size, rng)
        noise, z = gen.sample(labels, rng)
        loss = F.cross_entropy(ensemble_logits(weights, biases, z, labels), labels)
        if diversity > 0:
            loss = loss + diversity * diversity_loss(noise, z)
        opt.zero_grad()
        loss.backward()
        opt.step()
    after = probe_ce()
    return before, after


def generated_ce(
    head: nn.Module, gen: Generator, label_counts: Tensor, n: int, rng: torch.Generator
) -> Tensor:
    """The client's term: the cross-entropy of ``head`` on ``n`` generated features
    of labels drawn from ``label_counts`` (the generator fixed, in eval mode, no
    gradient through it)."""
    device = next(head.parameters()).device
    labels = draw_labels(label_counts, n, rng)
    with torch.no_grad():
        _, z = gen.sample(labels, rng)
    labels = labels.to(device)
    return F.cross_entropy(head(z.to(device)), labels)
