"""The shared training loop's divergence guard (models.train.train)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from models.train import SGDSettings, train


class Tiny(nn.Module):
    """A HetNet-like model: features() then classify()."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(4, 3)
        self.head = nn.Linear(3, 2)

    def features(self, x: Tensor) -> Tensor:
        return self.body(x)

    def classify(self, r: Tensor) -> Tensor:
        return self.head(r)


def _data() -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(1)
    return torch.randn(200, 4, generator=g), torch.randint(0, 2, (200,), generator=g)


def _quadratic(model: nn.Module, c: float):  # type: ignore[no-untyped-def]
    """c·‖θ‖²: one SGD step multiplies θ by (1 − 2·c·lr), so it explodes for lr > 1/c."""

    def extra(reps: Tensor, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
        return c * sum((p**2).sum() for p in model.parameters())

    return extra


def test_a_diverging_epoch_is_redone_at_half_the_learning_rate() -> None:
    """lr 8 with 1·‖θ‖²: factor −15 per step, inf within 100 steps; lr 1 (three
    halvings) is the first that does not explode, so training ends finite after ≥ 3."""
    x, y = _data()
    model = Tiny()
    stats = train(
        model,
        x,
        y,
        SGDSettings(epochs=2, batch_size=2, lr=8.0),
        torch.Generator().manual_seed(0),
        extra_loss=_quadratic(model, 1.0),
    )
    assert stats.backoffs >= 3 and not stats.gave_up
    assert stats.steps == 200  # both epochs were completed after the redo
    for p in model.parameters():
        assert torch.isfinite(p).all()


def test_without_room_to_back_off_training_stops_at_the_last_finite_state() -> None:
    x, y = _data()
    model = Tiny()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    stats = train(
        model,
        x,
        y,
        SGDSettings(epochs=1, batch_size=2, lr=8.0),
        torch.Generator().manual_seed(0),
        extra_loss=_quadratic(model, 1.0),
        max_backoffs=1,
    )
    assert stats.gave_up and stats.backoffs == 1 and stats.steps == 0
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key


def test_the_guard_changes_nothing_when_training_stays_finite() -> None:
    """Bit-identical to a plain SGD loop with the same shuffles (weights and loss)."""
    import torch.nn.functional as F

    x, y = _data()
    settings = SGDSettings(epochs=3, batch_size=10, lr=0.1, momentum=0.9)
    model = Tiny()
    stats = train(model, x, y, settings, torch.Generator().manual_seed(0))
    assert stats.backoffs == 0 and not stats.gave_up

    ref = Tiny()
    opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    g, total, steps = torch.Generator().manual_seed(0), 0.0, 0
    for _ in range(settings.epochs):
        order = torch.randperm(len(y), generator=g)
        for i in range(0, len(y), settings.batch_size):
            idx = order[i : i + settings.batch_size]
            loss = F.cross_entropy(ref.classify(ref.features(x[idx])), y[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += float(loss.detach())
            steps += 1
    assert stats.loss == total / steps and stats.steps == steps
    for key, value in ref.state_dict().items():
        assert torch.equal(value, model.state_dict()[key]), key
