"""``fedgen``: FedGen (Zhu et al., 2021), a server-trained feature generator and one
global head (the sample-weighted mean of the clients' heads)."""

from __future__ import annotations

from typing import Self, Unpack

import numpy as np
import torch

from common.config import RunConfig
from common.messages import GENERATOR, HEAD, LABEL_COUNTS
from common.records import Arrays
from models.generator import Generator, generator_state, train_generator
from models.threads import torch_threads
from strategies.base import HeteroStrategy, NodeInfo, RunSettings, Upload, run_settings
from strategies.heads import BIAS, WEIGHT, initial_head
from strategies.timing import Phases


def head_of(arrays: Arrays) -> Arrays:
    """The ``head.*`` entries of an upload (what is averaged and screened)."""
    return {k: v for k, v in arrays.items() if k.startswith(HEAD)}


def count_problem(counts: np.ndarray, num_examples: int) -> str | None:
    """Why a reply's per-class counts are unusable: negative, not whole, or not
    summing to its ``num-examples``; None when they are fine (length and finiteness
    are the shape and value checks every reply gets)."""
    if (counts < 0).any():
        return f"negative label counts {counts.tolist()}"
    if not np.array_equal(counts, np.round(counts)):
        return "label counts are not whole numbers"
    if int(counts.sum()) != num_examples:
        return f"label counts sum to {int(counts.sum())}, not its {num_examples} examples"
    return None


def label_weights(counts: np.ndarray) -> np.ndarray:
    """``α[k, c] = n_k^c / Σ_j n_j^c`` from ``counts`` [K, C] (a class nobody has: 0)."""
    total = counts.sum(0, keepdims=True)
    return np.divide(counts, total, out=np.zeros_like(counts, dtype=np.float64), where=total > 0)


class FedGen(HeteroStrategy):
    """FedGen: personal extractors, one global head, a generator of features.

    Message contract: ``train.fedgen`` carries the global head ``{"head.weight"
    [C, d], "head.bias" [C]}`` and, from round 2 on, the generator the server trained
    (``generator.<state-dict key>``: ``hidden`` [H, m + C], ``norm`` (BatchNorm: weight,
    bias, running mean and variance [H]), ``out`` [d, H]) with the pooled label counts
    it was trained on, ``label-counts`` [C]. The client installs the head, trains
    with CE + ``fedgen.weight``·CE(head(G(ε, y)), y), labels ``y`` drawn from the pooled
    counts (one per real sample of the batch), and replies with its trained head (same
    keys and shapes) and its own ``label-counts`` [C] (float32 whole numbers summing to
    its ``num-examples``; a reply whose counts are negative, fractional or do not add
    up is refused). Server: the sample-weighted mean of the heads (``robust.aggregate``
    applies); then the generator, kept from round to round, is trained for
    ``fedgen.server-iterations`` Adam steps so that the clients' *uploaded* heads,
    combined per label ``y`` with weights ``α_k^y = n_k^y / Σ_j n_j^y`` (each
    client's share of the label; ``robust.aggregate`` applies per label), classify
    its output as ``y`` (plus ``fedgen.diversity`` × the authors' diversity term).
    ``evaluate.fedgen`` carries the same arrays; the client evaluates its extractor
    with the global head.
    """

    name = "fedgen"
    shares_model = True  # the head part of the upload is the head it was sent, trained

    def __init__(
        self,
        *,
        noise_dim: int = 512,
        hidden_dim: int = 512,
        server_iterations: int = 100,
        server_batch_size: int = 10,
        server_lr: float = 0.0003,
        diversity: float = 1.0,
        weight: float = 1.0,
        **kwargs: Unpack[RunSettings],
    ) -> None:
        super().__init__(**kwargs)
        self.noise_dim = noise_dim
        self.hidden_dim = hidden_dim
        self.server_iterations = server_iterations
        self.server_batch_size = server_batch_size
        self.server_lr = server_lr
        self.diversity = diversity
        self.weight = weight  # the client's setting, recorded with the run

    @classmethod
    def from_config(cls, cfg: RunConfig) -> Self:
        f = cfg.fedgen
        return cls(
            noise_dim=f.noise_dim,
            hidden_dim=f.hidden_dim,
            server_iterations=f.server_iterations,
            server_batch_size=f.server_batch_size,
            server_lr=f.server_lr,
            diversity=f.diversity,
            weight=f.weight,
            **run_settings(cfg),
        )

    def init_global(self) -> Arrays:
        return initial_head(self.nodes.values(), self.seed)

    def expected_upload(self, node: NodeInfo) -> dict[str, tuple[int, ...]]:
        d, c = node.feature_dim, node.num_classes
        return {WEIGHT: (c, d), BIAS: (c,), LABEL_COUNTS: (c,)}

    def check_upload(self, node: NodeInfo, arrays: Arrays) -> str | None:
        return super().check_upload(node, arrays) or count_problem(
            arrays[LABEL_COUNTS], node.num_train
        )

    def shared_part(self, arrays: Arrays) -> Arrays:
        return head_of(arrays)

    def initial_generator(self, node: NodeInfo) -> Generator:
        """The generator before any training, seeded by the run's seed."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.seed)
            return Generator(self.noise_dim, node.num_classes, self.hidden_dim, node.feature_dim)

    def current_generator(self, node: NodeInfo) -> Generator:
        """The generator as the last round left it (the initial one before round 1)."""
        gen = self.initial_generator(node)
        kept = {
            k.removeprefix(GENERATOR): torch.from_numpy(v.copy())
            for k, v in self.global_arrays.items()
            if k.startswith(GENERATOR)
        }
        if kept:
            gen.load_state_dict(kept, strict=False)
        return gen

    def teacher(self, uploads: list[Upload]) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Per label ``y``, the uploaded heads combined with weights ``α_k^y``
        (``robust.aggregate``'s rule): ``(weights [C, C, d], biases [C, C], pooled
        counts [C])``; a label nobody has gets zeros (it is never drawn)."""
        counts = np.stack([u.arrays[LABEL_COUNTS].astype(np.float64) for u in uploads])
        alpha = label_weights(counts)
        num_classes, d = self.global_arrays[WEIGHT].shape
        w = np.zeros((num_classes, num_classes, d), np.float32)
        b = np.zeros((num_classes, num_classes), np.float32)
        for c in range(num_classes):
            holders = [k for k in range(len(uploads)) if alpha[k, c] > 0]
            if not holders:
                continue
            combined = self.mean_of(
                [uploads[k] for k in holders], [float(alpha[k, c]) for k in holders]
            )
            w[c], b[c] = combined[WEIGHT], combined[BIAS]
        return torch.from_numpy(w), torch.from_numpy(b), counts.sum(0)

    def aggregate(self, server_round: int, uploads: list[Upload]) -> Arrays | None:
        phases = Phases()
        with phases("head-mean"):
            head = self.mean_of(uploads)
        with phases("generator"):
            weights, biases, pooled = self.teacher(uploads)
            gen = self.current_generator(uploads[0].node)
            rng = torch.Generator().manual_seed(self.seed * 100_003 + server_round)
            with torch_threads(1):  # a few hundred tiny steps: threads only add overhead
                before, after = train_generator(
                    gen,
                    weights,
                    biases,
                    torch.from_numpy(pooled),
                    iterations=self.server_iterations,
                    batch_size=self.server_batch_size,
                    lr=self.server_lr,
                    diversity=self.diversity,
                    rng=rng,
                )
        self.diagnostics = {
            "generator-ce-before": before,
            "generator-ce-after": after,
            **{f"{name}-s": s for name, s in phases.seconds.items()},
        }
        state = {
            GENERATOR + k: v.detach().numpy().astype(np.float32)
            for k, v in generator_state(gen).items()
        }
        return {**head, **state, LABEL_COUNTS: pooled.astype(np.float32)}
