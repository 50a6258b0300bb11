"""``fedgen``'s client part: install the global head and the server's generator, add
the head's cross-entropy on generated features to training, upload the head and the
label counts."""

from __future__ import annotations

import torch
from torch import Tensor

from client_app.base import ClientRun, GlobalHeadHook, head_arrays
from common.messages import GENERATOR, HEAD, LABEL_COUNTS
from models.generator import Generator, generated_ce, generator_from_state
from models.train import ExtraLoss

SUM, STEPS = "fedgen-ce-sum", "fedgen-ce-steps"
"""``run.notes`` entries: the generated-feature cross-entropy summed over this
training's batches, and their number (this message only)."""


def received_generator(run: ClientRun) -> tuple[Generator, Tensor] | None:
    """The generator and pooled label counts the server sent (None before the server
    has trained one, in round 1); a ValueError for any key, shape or count that is
    not a generator's."""
    c = run.data.num_classes
    state = {
        k.removeprefix(GENERATOR): v for k, v in run.received.items() if k.startswith(GENERATOR)
    }
    counts = run.received.get(LABEL_COUNTS)
    other = sorted(
        k for k in run.received if not k.startswith((GENERATOR, HEAD)) and k != LABEL_COUNTS
    )
    if other:
        raise ValueError(f"unexpected arrays from the server: {other[:3]}")
    if not state and counts is None:
        return None
    if counts is None or counts.shape != (c,):
        raise ValueError(f"the generator came without '{LABEL_COUNTS}' [{c}]")
    if not bool(torch.isfinite(counts).all()) or bool((counts < 0).any()) or counts.sum() <= 0:
        raise ValueError(f"bad pooled '{LABEL_COUNTS}' {counts.tolist()}")
    gen = generator_from_state(state, c)
    if gen.out.out_features != run.model.feature_dim:
        raise ValueError(
            f"the generator makes {gen.out.out_features} features, the head takes "
            f"{run.model.feature_dim}"
        )
    return gen, counts


class FedGenHook(GlobalHeadHook):
    """``fedgen``: install the global head (:class:`GlobalHeadHook`); train with CE +
    ``fedgen.weight`` · CE of the head on generated features (labels from the pooled
    counts, as many as the batch has samples); upload the trained head and the
    node's label counts; report ``generated-ce`` (the term's mean over the batches,
    before the weight)."""

    name = "fedgen"

    def install(self, run: ClientRun, arrays: dict[str, Tensor]) -> None:
        received_generator(run)  # validates; the loss reads run.received
        super().install(run, {k: v for k, v in arrays.items() if k.startswith(HEAD)})

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        got = received_generator(run)
        weight = run.cfg.fedgen.weight
        if got is None or weight == 0:
            return None
        gen, counts = got
        rng = run.generator(purpose=4)
        run.notes[SUM], run.notes[STEPS] = 0.0, 0

        def loss(reps: Tensor, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
            ce = generated_ce(run.model.head, gen, counts, len(y), rng)
            run.notes[SUM] += float(ce.detach())
            run.notes[STEPS] += 1
            return weight * ce

        return loss

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        if run.notes.get(STEPS):
            run.metrics["generated-ce"] = run.notes[SUM] / run.notes[STEPS]
        counts = torch.bincount(run.data.y_train, minlength=run.data.num_classes)
        return {**head_arrays(run), LABEL_COUNTS: counts.to(torch.float32)}
