"""FedLoRA's homogeneous low-rank adapter: Δ(z) = (α/r) · B(A z), B = 0 at start.

An adapter is a LoRA branch in parallel with a named ``nn.Linear`` of the model (by
default the head: ``h(z) + Δ(z)``), or, for the target ``rep``, a residual branch on
the representation the head reads (``h(z + Δ(z))``, Δ: d→d). It is attached with a
hook, so the model's own state-dict keys do not change; the adapters live under
``adapters.<target>.A`` / ``.B`` with ``.`` in the target name written as ``-``.
Their shapes depend only on (d, C, r), which is what makes them aggregatable across
architectures.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence

import torch
from torch import Tensor, nn

ADAPTERS = "adapters"
REP = "rep"
"""Target name of the residual adapter on the representation (d→d, before the head)."""


class LoRA(nn.Module):
    """``Δ(z) = (alpha / rank) · B (A z)`` with ``A: r×n``, ``B: m×r``, ``B = 0``."""

    def __init__(self, in_features: int, out_features: int, rank: int, alpha: float) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.empty(rank, in_features))
        self.B = nn.Parameter(torch.zeros(out_features, rank))
        self.scale = alpha / rank
        self.enabled = True
        self.target = ""
        """What the branch is attached to (a Linear's name, or ``rep``)."""
        nn.init.kaiming_uniform_(self.A, a=math.sqrt(5))

    def forward(self, z: Tensor) -> Tensor:
        if not self.enabled:
            return torch.zeros((), dtype=z.dtype, device=z.device)
        return self.scale * (z @ self.A.T) @ self.B.T


def module_key(target: str) -> str:
    return target.replace(".", "-")


def adapter_shapes(
    targets: Sequence[str], d: int, num_classes: int, rank: int
) -> dict[str, tuple[int, ...]]:
    """State-dict keys and shapes of the adapters (head: d→C; ``rep`` and others: d→d)."""
    out: dict[str, tuple[int, ...]] = {}
    for target in targets:
        m = num_classes if target == "head" else d
        out[f"{ADAPTERS}.{module_key(target)}.A"] = (rank, d)
        out[f"{ADAPTERS}.{module_key(target)}.B"] = (m, rank)
    return out


def _target_layer(model: nn.Module, target: str, d: int) -> nn.Linear:
    if target == REP:
        return model.get_submodule("head")  # type: ignore[return-value]
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
        if target == REP:
            lora = LoRA(d, d, rank, alpha)
            layer.register_forward_pre_hook(_residual(lora))
        else:
            lora = LoRA(layer.in_features, layer.out_features, rank, alpha)
            layer.register_forward_hook(_adding(lora))
        lora.target = target
        adapters[module_key(target)] = lora
    model.add_module(ADAPTERS, adapters)
    return adapters


def _adding(lora: LoRA):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, inputs: tuple[Tensor, ...], output: Tensor) -> Tensor:
        return output + lora(inputs[0])

    return hook


def _residual(lora: LoRA):  # type: ignore[no-untyped-def]
    def hook(module: nn.Module, inputs: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        return (inputs[0] + lora(inputs[0]), *inputs[1:])

    return hook


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as if it had no adapters (every branch contributes 0)."""
    loras = [m for m in model.modules() if isinstance(m, LoRA)]
    for lora in loras:
        lora.enabled = False
    try:
        yield
    finally:
        for lora in loras:
            lora.enabled = True


def adapter_weight_ratios(model: nn.Module) -> dict[str, float]:
    """Per target ``‖(α/r)·B A‖_F / ‖W‖_F``: the branch against the weight it sits
    beside (for ``rep``, the identity map the residual adds to)."""
    out = {}
    with torch.no_grad():
        for lora in (m for m in model.modules() if isinstance(m, LoRA)):
            delta = torch.linalg.matrix_norm(lora.scale * (lora.B @ lora.A))
            if lora.target == REP:
                base = float(lora.A.shape[1]) ** 0.5  # ‖I_d‖_F
            else:
                base = float(torch.linalg.matrix_norm(model.get_submodule(lora.target).weight))
            out[lora.target] = float(delta) / max(base, 1e-30)
    return out


def adapter_parameters(model: nn.Module) -> list[nn.Parameter]:
    return list(model.get_submodule(ADAPTERS).parameters())


def local_parameters(model: nn.Module) -> list[nn.Parameter]:
    """Every parameter that is not part of an adapter."""
    ids = {id(p) for p in adapter_parameters(model)}
    return [p for p in model.parameters() if id(p) not in ids]
