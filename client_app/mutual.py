"""Client parts of ``fml`` and ``fedkd``: the own model and a small shared model
trained together on the one training loop.

The shared model (``meme`` / ``mentee``) and FedKD's projection ``W_h`` are
submodules of the client's model, so they persist with the personal state and train
with it; evaluation runs the client's own model only.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from client_app.base import ClientHook, ClientRun, initial_seed
from common.messages import FACTOR_US, FACTOR_VT, MEME, MENTEE
from models import HetNet, build_model, smallest_arch
from models.mutual import compress, energy_at, fedkd_loss, fml_loss
from models.train import ExtraLoss


class MutualHook(ClientHook):
    """Installs the server's shared model into ``model.<prefix>`` and trains both."""

    prefix: ClassVar[str] = ""

    def shared_arch(self, run: ClientRun) -> str:
        raise NotImplementedError

    def prepare(self, run: ClientRun) -> None:
        run.model.add_module(self.prefix, self.build_shared(run, run.model.feature_dim))

    def build_shared(self, run: ClientRun, feature_dim: int) -> HetNet:
        """The shared model (:meth:`shared_arch`, else the family's smallest) for this
        node's data, with representation size ``feature_dim``; its initial weights are
        replaced by the server's."""
        arch = self.shared_arch(run) or smallest_arch(
            run.cfg.model.family,
            run.data.in_channels,
            run.data.image_size,
            run.cfg.model.small_input_stem,
        )
        return build_model(
            arch,
            in_channels=run.data.in_channels,
            num_classes=run.data.num_classes,
            image_size=run.data.image_size,
            feature_dim=feature_dim,
            small_stem=run.cfg.model.small_input_stem,
            seed=initial_seed(run.cfg, run.node) + 1,
        )

    def shared(self, run: ClientRun) -> nn.Module:
        return run.model.get_submodule(self.prefix)

    def shared_state(self, run: ClientRun) -> dict[str, Tensor]:
        """The shared model's floating-point state, by its key in the client model."""
        return {
            f"{self.prefix}.{k}": v
            for k, v in self.shared(run).state_dict().items()
            if v.is_floating_point()
        }


class FMLHook(MutualHook):
    """``fml``: ``α·CE + (1−α)·KL(meme‖local)`` for the own model,
    ``β·CE + (1−β)·KL(local‖meme)`` for the meme; upload the meme."""

    name = "fml"
    prefix = MEME.rstrip(".")

    def shared_arch(self, run: ClientRun) -> str:
        return run.cfg.fml.meme_arch

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        meme, f = self.shared(run), run.cfg.fml

        def loss(reps: Tensor, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
            # the loop adds CE(logits) itself: remove it, the total is FML's objective
            total = fml_loss(logits, meme(x), y, f.alpha, f.beta)
            return total - F.cross_entropy(logits, y)

        return loss

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return self.shared_state(run)


class FedKDHook(MutualHook):
    """``fedkd``: adaptive mutual distillation between the own model and the mentee
    (with a personal projection ``W_h``); upload the mentee's update, SVD-compressed."""

    name = "fedkd"
    prefix = MENTEE.rstrip(".")

    def shared_arch(self, run: ClientRun) -> str:
        return run.cfg.fedkd.mentee_arch

    def prepare(self, run: ClientRun) -> None:
        super().prepare(run)
        d = run.model.feature_dim
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(initial_seed(run.cfg, run.node) + 2)
            run.model.add_module("projection", nn.Linear(d, d, bias=False))

    def extra_loss(self, run: ClientRun) -> ExtraLoss | None:
        mentee = self.shared(run)
        projection = run.model.get_submodule("projection")

        def loss(reps: Tensor, logits: Tensor, y: Tensor, x: Tensor) -> Tensor:
            m_reps = mentee.features(x)  # type: ignore[operator]
            m_logits = mentee.classify(m_reps)  # type: ignore[operator]
            total = fedkd_loss(logits, m_logits, reps, projection(m_reps), y)
            return total - F.cross_entropy(logits, y)

        return loss

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        """Per mentee key: the update whole, or the factors of its truncated SVD."""
        f = run.cfg.fedkd
        energy = energy_at(
            run.server_round, run.cfg.num_server_rounds, f.energy_start, f.energy_end
        )
        out: dict[str, Tensor] = {}
        for key, value in self.shared_state(run).items():
            update = value.detach().cpu() - run.received[key].to(value.dtype)
            factors = compress(update, energy)
            if factors is None:
                out[key] = update
            else:
                out[key + FACTOR_US], out[key + FACTOR_VT] = factors
        run.metrics["upload-energy"] = energy
        return out
