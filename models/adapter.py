"""FedLoRA's homogeneous low-rank adapter: Δ(z) = (α/r) · B(A z), B = 0 at start.

An adapter is a LoRA branch in parallel with a named ``nn.Linear`` of the model (by
default the head). It is attached with a forward hook, so the model's own state-dict
keys do not change; the adapters live under ``adapters.<target>.A`` / ``.B`` with
``.`` in the target name written as ``-``. Their shapes depend only on (d, C, r),
which is what makes them aggregatable across architectures.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn

ADAPTERS = "adapters"


class LoRA(nn.Module):
    """``Δ(z) = (alpha / rank) · B (A z)`` with ``A: r×n``, ``B: m×r``, ``B = 0``."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))

    def forward(self, z: Tensor) -> Tensor:
        return self.scale * (z @ self.A.T) @ self.B.T


def module_key(target: str) -> str:
    return target.replace(".", "-")


def adapter_shapes(
    targets: Sequence[str], d: int, num_classes: int, rank: int
) -> dict[str, tuple[int, ...]]:
    """State-dict keys and shapes of the adapters (head: d→C; others: d→d)."""
    out: dict[str, tuple[int, ...]] = {}
    for target in targets:
        m = num_classes if target == "head" else d
        out[f"{ADAPTERS}.{module_key(target)}.A"] = (rank, d)
        out[f"{ADAPTERS}.{module_key(target)}.B"] = (m, rank)
    return out


def _target_layer(model: nn.Module, target: str, d: int) -> nn.Linear:
    try:
        layer = model.get_submodule(target)
    except AttributeError:
        raise ValueError(
            f"fedlora.targets: {type(model).__name__} "
            f"'{getattr(model, 'arch', '?')}' has no layer '{target}'"
        ) from None
    if not isinstance(layer, nn.Linear):
        raise ValueError(f"fedlora.targets: '{target}' is not a Linear layer")
    if target != "head" and (layer.in_features, layer.out_features) != (d, d):
        raise ValueError(
            f"fedlora.targets: '{target}' of '{getattr(model, 'arch', '?')}' is "
            f"{layer.in_features}→{layer.out_features}, not d→d ({d}→{d}); only "
            "layers every client has with that shape can carry a shared adapter"
        )
    return layer


def attach_adapters(
    model: nn.Module, targets: Sequence[str], rank: int, alpha: float
) -> nn.ModuleDict:
    """Add a LoRA branch to each target Linear of ``model`` (in place)."""
    d = int(model.feature_dim)  # type: ignore[arg-type]
    adapters = nn.ModuleDict()
    for target in targets:
        layer = _target_layer(model, target, d)
        lora = LoRA(layer.in_features, layer.out_features, rank, alpha)
        adapters[module_key(target)] = lora
        layer.register_forward_hook(_adding(lora))
    model.add_module(ADAPTERS, adapters)
    return adapters


def _adding(lora: LoRA):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        return output + lora(inputs[0])

    return hook


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return list(model.get_submodule(ADAPTERS).parameters())


def local_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter that is not part of an adapter."""
    ids = {id(p) for p in adapter_parameters(model)}
    return [p for p in model.parameters() if id(p) not in ids]
