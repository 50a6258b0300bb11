"""A torch module as an ONNX file, and the nearest-prototype decision as a module.

:func:`to_onnx` writes a module that maps images ``float32 [batch, C, H, W]`` to scores
``[batch, classes]`` (the batch size free) with PyTorch's exporter (``torch.export``
based; it needs the ``onnx`` and ``onnxscript`` packages, ``pip install
'fedhet[export]'``), with text metadata in the model's ``metadata_props`` and atomically:
the file appears complete or not at all.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from pathlib import Path

import torch
from torch import Tensor, nn

INPUT = "x"
"""Name of the exported model's input: images ``float32 [batch, C, H, W]``."""
OUTPUT = "scores"
"""Name of its output ``[batch, classes]``: the predicted class is the argmax."""
EXPORT_EXTRA = "pip install 'fedhet[export]'"


class NearestPrototype(nn.Module):
    """Scores ``−‖RM(g(x)) − p_c‖₂`` for the classes ``c`` with a prototype ``p_c`` and
    ``−inf`` for the others: the argmax is the nearest prototype (FedProto's
    ``infer = proto``). The prototypes are buffers, so an export holds them as
    constants.

    The distance is the plain formula (torch's ``cdist`` has no ONNX form), the same
    value to float rounding.
    """

    def __init__(self, model: nn.Module, table: Tensor, known: Tensor) -> None:
        super().__init__()
        self.model = model
        self.register_buffer("table", table.detach().clone().float())
        self.register_buffer("known", known.detach().clone().bool())

    def forward(self, x: Tensor) -> Tensor:
        reps = self.model.features(x)  # type: ignore[operator]
        table: Tensor = self.table  # type: ignore[assignment]
        known: Tensor = self.known  # type: ignore[assignment]
        dist = (reps.unsqueeze(1) - table.unsqueeze(0)).square().sum(-1).sqrt()
        return (-dist).masked_fill(~known, float("-inf"))


def to_onnx(
    module: nn.Module,
    input_shape: tuple[int, ...],
    path: Path,
    metadata: Mapping[str, str] | None = None,
) -> Path:
    """Export ``module`` (in eval mode, on the CPU) to ``path``, atomically.

    Parameters
    ----------
    module
        Maps ``float32 [batch, C, H, W]`` (or ``[batch, F]``) to ``[batch, classes]``.
    input_shape
        ``(C, H, W)`` of one image, or ``(F,)`` of one feature vector.
    path
        The ONNX file; written as ``<path>.tmp<pid>`` and renamed over ``path``.
    metadata
        Strings stored in the model's ``metadata_props`` (ONNX Runtime:
        ``session.get_modelmeta().custom_metadata_map``).

    Raises
    ------
    ImportError
        When the exporter's packages (``onnx``, ``onnxscript``) are missing.
    """
    try:
        import onnx  # noqa: F401
        import onnxscript  # noqa: F401
    except ImportError as exc:
        raise ImportError(f"ONNX export needs {exc.name}: {EXPORT_EXTRA}") from None
    was_training = module.training
    module.eval()
    example = torch.zeros(2, *input_shape)
    try:
        with warnings.catch_warnings(), torch.no_grad():
            warnings.simplefilter("ignore")
            program = torch.onnx.export(
                module,
                (example,),
                dynamo=True,
                verbose=False,
                input_names=[INPUT],
                output_names=[OUTPUT],
                dynamic_shapes={INPUT: {0: torch.export.Dim("batch")}},
            )
    finally:
        module.train(was_training)
    if program is None:  # pragma: no cover - the dynamo exporter always returns one
        raise RuntimeError("torch.onnx.export returned no program")
    for key, value in (metadata or {}).items():
        program.model.metadata_props[key] = value
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        program.save(str(tmp), external_data=False)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


__all__ = ["INPUT", "OUTPUT", "NearestPrototype", "to_onnx"]
