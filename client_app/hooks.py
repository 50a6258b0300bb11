"""Client parts of the foundation algorithms: ``local``, ``fedavg``, ``lgfedavg``."""

from __future__ import annotations

from torch import Tensor

from client_app.base import ClientHook, ClientRun, GlobalHeadHook, head_arrays


class LocalHook(ClientHook):
    """``local``: train alone, upload nothing."""

    name = "local"


class FedAvgHook(ClientHook):
    """``fedavg``: install the global model, upload the whole trained model."""

    name = "fedavg"

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return dict(run.model.state_dict())


class LGFedAvgHook(GlobalHeadHook):
    """``lgfedavg``: install the global head, upload the trained head."""

    name = "lgfedavg"

    def upload(self, run: ClientRun) -> dict[str, Tensor]:
        return head_arrays(run)
