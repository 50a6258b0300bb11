"""``fedhet predict``: classify images or feature vectors with an exported model, ONNX
Runtime only.

Standalone on purpose: this file imports only the standard library, numpy, onnxruntime
and (for image files) Pillow, never torch or the rest of fedhet, so an inference-only
device can run it as ``python predict.py MODEL.onnx INPUT...`` with just those three
packages (docs/personal-models.md).

Inputs: image files (PNG, JPEG, ...; mode ``L`` for a 1-channel model, ``RGB`` for a
3-channel one, exactly the model's height and width), folders of them, or ``.npz``
files with an ``x`` array: ``uint8 [n, H, W]`` / ``[n, H, W, C]`` pixels (normalised
here with the model card's mean and std) or ``float32 [n, C, H, W]`` already
normalised. An ``.npz`` that also holds labels ``y`` gets its accuracy printed.

A model of feature vectors (card layout ``NF``) takes ``.npz`` files with ``x [n, F]``
(raw values in the training data's units, standardised here with the card's per-feature
mean and std; optional labels ``y``) and ``.csv`` files: one sample per row, ``F``
comma-separated numbers, or ``F + 1`` with the last one an integer label (an optional
first row of column names is skipped).

One line per input on stdout: ``<input>\\t<class index>\\t<class name>``. Any bad input
(a missing or unreadable model, an image of the wrong size or channel count, labels
the model has no class for, a model of another dataset than ``--dataset``) stops
with one line on stderr and exit status 1.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp", ".gif", ".tif", ".tiff", ".webp", ".pgm")
METADATA_KEY = "fedhet"
"""Key of the model card in the ONNX model's metadata (as ``client_app.export`` writes)."""


class PredictError(Exception):
    """Bad input: the message is the one line printed."""


class Model:
    """An exported model and its card, in an ONNX Runtime session."""

    def __init__(self, path: Path) -> None:
        # onnxruntime's builds record a device id and queue telemetry events in
        # ~/.cache/Microsoft/DeveloperTools/.onnxruntime on import unless this is set
        os.environ.setdefault("ORT_DISABLE_TELEMETRY", "1")
        try:
            import onnxruntime as ort
        except ImportError:
            raise PredictError("predict needs onnxruntime: pip install onnxruntime") from None
        if not path.is_file():
            raise PredictError(f"{path}: no such model file")
        options = ort.SessionOptions()
        options.log_severity_level = 3  # errors only: the one line below says what failed
        try:
            self.session = ort.InferenceSession(
                str(path), options, providers=["CPUExecutionProvider"]
            )
        except Exception as exc:  # noqa: BLE001 - a truncated or foreign file
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise PredictError(f"{path}: not a readable ONNX model ({first[:200]})") from None
        self.card = self._card(path)
        shape = self.card["input"]["shape"]
        self.tabular = len(shape) == 2
        """Whether the model takes feature vectors ``[n, F]`` (else images)."""
        if self.tabular:
            self.channels, self.height, self.width = int(shape[1]), 0, 0
        else:
            self.channels, self.height, self.width = int(shape[1]), int(shape[2]), int(shape[3])
        self.classes: list[str] = [str(c) for c in self.card["classes"]]
        norm = self.card["normalisation"]
        # features: float64 statistics, as the ClientApp standardised them (same inputs)
        dtype: Any = np.float64 if self.tabular else np.float32
        view = (1, -1) if self.tabular else (1, -1, 1, 1)
        self.mean: np.ndarray = np.asarray(norm["mean"], dtype).reshape(view)
        self.std: np.ndarray = np.asarray(norm["std"], dtype).reshape(view)
        source = self.card["input"].get("resized-from")
        self.source: tuple[int, int] | None = (int(source[0]), int(source[1])) if source else None
        """The images' own size when the model was trained on them resized (the card's
        ``input.resized-from``): such images are resized the same way here."""
        self.input = self.session.get_inputs()[0].name

    def _card(self, path: Path) -> dict[str, Any]:
        """The model card: from the model's metadata, else the JSON beside it."""
        text = self.session.get_modelmeta().custom_metadata_map.get(METADATA_KEY)
        side = path.with_suffix(".json")
        if text is None and side.is_file():
            text = side.read_text()
        if text is None:
            raise PredictError(f"{path}: no model card (not exported by fedhet, and no {side})")
        try:
            card: dict[str, Any] = json.loads(text)
            ok = len(card["input"]["shape"]) in (2, 4) and len(card["classes"]) > 0
            ok = ok and len(card["normalisation"]["mean"]) == len(card["normalisation"]["std"])
        except (ValueError, KeyError, TypeError) as exc:
            raise PredictError(f"{path}: unreadable model card ({exc})") from None
        if not ok:
            raise PredictError(f"{path}: malformed model card")
        return card

    def normalise(self, pixels: np.ndarray) -> np.ndarray:
        """``uint8 [n, C, H, W]`` -> the model's input (the card's mean and std; resized
        as in training when the card says the model was trained on resized images)."""
        x = pixels.astype(np.float32) / np.float32(255.0)
        return self.resized(((x - self.mean) / self.std).astype(np.float32))

    def standardise(self, values: np.ndarray, where: str) -> np.ndarray:
        """Feature vectors ``[n, F]`` in the training data's units -> the model's
        input ``(x - mean) / std`` (the card's per-feature statistics)."""
        if values.ndim != 2 or values.shape[1] != self.channels:
            raise PredictError(
                f"{where}: samples of shape {list(values.shape[1:])}; the model takes "
                f"{self.channels} features (dataset {self.card.get('dataset')})"
            )
        if not np.isfinite(values).all():
            row = int(np.flatnonzero(~np.isfinite(values).all(axis=1))[0])
            raise PredictError(f"{where}: NaN or infinite value in sample {row}")
        return ((values.astype(np.float64) - self.mean) / self.std).astype(np.float32)

    def resized(self, x: np.ndarray) -> np.ndarray:
        """``x`` at the model's input size when it has the card's ``resized-from`` size."""
        if self.source is None or tuple(x.shape[2:]) != self.source:
            return x
        return bilinear(x, self.height, self.width)

    def check(self, x: np.ndarray, where: str) -> None:
        want = (self.channels, self.height, self.width)
        if self.source is not None and tuple(x.shape[1:]) == (self.channels, *self.source):
            return  # resized as in training
        if tuple(x.shape[1:]) != want:
            raise PredictError(
                f"{where}: images of {x.shape[1]} channel(s), {x.shape[2]}x{x.shape[3]} "
                f"pixels; the model takes {self.channels} channel(s), "
                f"{self.height}x{self.width} (dataset {self.card.get('dataset')})"
            )

    def scores(self, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
        """The model's scores ``[n, classes]`` for normalised ``x [n, C, H, W]``."""
        out = [
            self.session.run(None, {self.input: x[i : i + batch_size]})[0]
            for i in range(0, len(x), batch_size)
        ]
        return np.concatenate(out) if out else np.zeros((0, len(self.classes)), np.float32)


def bilinear(x: np.ndarray, height: int, width: int) -> np.ndarray:
    """``float32 [n, C, h, w]`` resized to ``[n, C, height, width]`` as torch's
    ``interpolate(mode="bilinear", align_corners=False)`` does (half-pixel centres,
    source positions below 0 clamped), without torch."""

    def taps(n_in: int, n_out: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        src = np.maximum((np.arange(n_out) + 0.5) * (n_in / n_out) - 0.5, 0.0)
        low = np.minimum(np.floor(src).astype(np.int64), n_in - 1)
        high = np.minimum(low + 1, n_in - 1)
        return low, high, (src - low).astype(np.float32)

    r0, r1, rw = taps(x.shape[2], height)
    c0, c1, cw = taps(x.shape[3], width)
    rows = x[:, :, r0, :] * (1 - rw)[:, None] + x[:, :, r1, :] * rw[:, None]
    return (rows[..., c0] * (1 - cw) + rows[..., c1] * cw).astype(np.float32)


def read_image(path: Path, model: Model) -> np.ndarray:
    """One image file as ``uint8 [1, C, H, W]``, checked against the model."""
    try:
        from PIL import Image
    except ImportError:
        raise PredictError("image files need Pillow: pip install pillow") from None
    try:
        with Image.open(path) as img:
            mode = img.mode
            if mode not in ("1", "L", "RGB"):
                raise PredictError(
                    f"{path}: image mode {mode}; use a grayscale (L) or RGB image "
                    f"(the model takes {model.channels} channel(s))"
                )
            gray = img.convert("L") if mode == "1" else img
            pixels = np.asarray(gray, dtype=np.uint8)
    except PredictError:
        raise
    except Exception as exc:  # noqa: BLE001 - PIL raises several kinds
        raise PredictError(f"{path}: not a readable image ({exc})") from None
    chw = pixels[None, :, :] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
    x = chw[None]
    model.check(x, str(path))
    return x


def read_npz(path: Path, model: Model) -> tuple[np.ndarray, np.ndarray | None]:
    """``x`` of an ``.npz`` as the model's input, and its labels ``y`` if present."""
    try:
        archive = np.load(path, allow_pickle=False)
        if not isinstance(archive, np.lib.npyio.NpzFile):
            raise PredictError(
                f"{path}: a single array (.npy), not an .npz archive; save it with "
                "numpy.savez(path, x=images[, y=labels])"
            )
        with archive:
            x = archive["x"]
            y = archive["y"] if "y" in archive.files else None
    except KeyError:
        raise PredictError(f"{path}: no array 'x'") from None
    except (OSError, ValueError) as exc:
        raise PredictError(f"{path}: not a readable .npz ({exc})") from None
    if model.tabular:
        if not (np.issubdtype(x.dtype, np.floating) or np.issubdtype(x.dtype, np.integer)):
            raise PredictError(f"{path}: 'x' is {x.dtype}; expected numbers [n, F]")
        inputs = model.standardise(x, f"{path} 'x'")
    elif x.dtype == np.uint8 and x.ndim in (3, 4):
        pixels = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)
        model.check(pixels, f"{path} 'x'")
        inputs = model.normalise(pixels)
    elif x.dtype == np.float32 and x.ndim == 4:
        model.check(x, f"{path} 'x'")
        inputs = model.resized(np.ascontiguousarray(x))
    else:
        raise PredictError(
            f"{path}: 'x' is {x.dtype} {list(x.shape)}; expected uint8 [n, H, W(, C)] "
            "pixels or float32 [n, C, H, W] normalised images"
        )
    if len(x) == 0:
        raise PredictError(f"{path}: 'x' holds no {'samples' if model.tabular else 'images'}")
    check_labels(y, len(x), model, path)
    return inputs, y


def check_labels(y: np.ndarray | None, count: int, model: Model, path: Path) -> None:
    """Labels, when given: one integer per sample, each a class the model knows."""
    if y is not None:
        if not np.issubdtype(y.dtype, np.integer) or y.shape != (count,):
            raise PredictError(f"{path}: 'y' must hold one integer label per image")
        if len(y) and (y.min() < 0 or y.max() >= len(model.classes)):
            raise PredictError(
                f"{path}: labels {int(y.min())}..{int(y.max())}, but the model knows "
                f"{len(model.classes)} classes (dataset {model.card.get('dataset')}): "
                "a model of another dataset"
            )


def read_csv(path: Path, model: Model) -> tuple[np.ndarray, np.ndarray | None]:
    """Rows of a ``.csv`` as the model's input (``F`` numbers per row, or ``F + 1``
    with an integer label last; a first row that is not numbers is a header)."""
    if not model.tabular:
        raise PredictError(
            f"{path}: CSV rows are for models of feature vectors; this one takes images"
        )
    try:
        lines = [line.strip() for line in path.read_text().splitlines()]
    except (OSError, UnicodeDecodeError) as exc:
        raise PredictError(f"{path}: not a readable text file ({exc})") from None
    rows: list[list[float]] = []
    for number, line in enumerate(lines, start=1):
        if not line:
            continue
        try:
            rows.append([float(v) for v in line.split(",")])
        except ValueError:
            if rows or number > 1:
                raise PredictError(f"{path} line {number}: not {model.channels} numbers") from None
    if not rows:
        raise PredictError(f"{path}: no rows")
    widths = {len(r) for r in rows}
    if len(widths) != 1 or widths.pop() not in (model.channels, model.channels + 1):
        raise PredictError(
            f"{path}: rows of {sorted({len(r) for r in rows})} values; the model takes "
            f"{model.channels} features (and optionally a label last)"
        )
    table = np.asarray(rows, dtype=np.float64)
    y = None
    if table.shape[1] == model.channels + 1:
        labels = table[:, -1]
        if not np.all(labels == np.round(labels)):
            raise PredictError(f"{path}: the last column holds non-integer labels")
        y, table = labels.astype(np.int64), table[:, :-1]
    check_labels(y, len(table), model, path)
    return model.standardise(table, str(path)), y


def expand(inputs: Sequence[Path]) -> Iterator[Path]:
    """Files in order; a folder gives its image files, sorted by name."""
    for path in inputs:
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.suffix.lower() in IMAGE_SUFFIXES)
            if not found:
                raise PredictError(f"{path}: no image files ({', '.join(IMAGE_SUFFIXES)})")
            yield from found
        elif path.is_file():
            yield path
        else:
            raise PredictError(f"{path}: no such file or folder")


def predict(
    model_path: Path, inputs: Sequence[Path], dataset: str = "", batch_size: int = 256
) -> tuple[list[tuple[str, int, str]], float | None]:
    """``(input, class index, class name)`` per input, and the accuracy over the
    labelled ``.npz`` inputs (None without labels)."""
    if batch_size < 1:
        raise PredictError(f"--batch-size {batch_size}: must be at least 1")
    model = Model(model_path)
    if dataset and model.card.get("dataset") != dataset:
        raise PredictError(
            f"{model_path}: a model of dataset {model.card.get('dataset')!r}, "
            f"not {dataset!r} (--dataset)"
        )
    rows: list[tuple[str, int, str]] = []
    hits = labelled = 0
    images: list[tuple[str, np.ndarray]] = []

    def flush() -> None:  # images in a row: one batch, in input order
        if images:
            scores = model.scores(np.concatenate([x for _, x in images]), batch_size)
            for (name, _), c in zip(images, scores.argmax(1), strict=True):
                rows.append((name, int(c), model.classes[int(c)]))
            images.clear()

    for path in expand(inputs):
        suffix = path.suffix.lower()
        if suffix not in (".npz", ".csv"):
            if model.tabular:
                raise PredictError(
                    f"{path}: the model takes feature vectors: give .npz (x [n, F]) or .csv"
                )
            images.append((str(path), model.normalise(read_image(path, model))))
            continue
        flush()
        x, y = read_npz(path, model) if suffix == ".npz" else read_csv(path, model)
        classes = model.scores(x, batch_size).argmax(1)
        rows += [(f"{path}[{i}]", int(c), model.classes[int(c)]) for i, c in enumerate(classes)]
        if y is not None:
            hits += int((classes == y).sum())
            labelled += len(y)
    flush()
    return rows, (hits / labelled if labelled else None)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="predict",
        description="Classify images or feature vectors with a model `fedhet export` wrote.",
    )
    parser.add_argument("model", type=Path, help="the .onnx file")
    parser.add_argument(
        "inputs",
        type=Path,
        nargs="+",
        help="image files, folders, .npz files, .csv files (feature vectors)",
    )
    parser.add_argument("--dataset", default="", help="refuse a model of another dataset")
    parser.add_argument("--batch-size", type=int, default=256)
    args = parser.parse_args(argv)
    return run(args.model, args.inputs, args.dataset, args.batch_size)


def run(model: Path, inputs: Sequence[Path], dataset: str = "", batch_size: int = 256) -> int:
    """Print the predictions (and the accuracy on labelled inputs); the exit status."""
    try:
        rows, accuracy = predict(model, inputs, dataset, batch_size)
    except PredictError as exc:
        print(f"fedhet predict: {exc}", file=sys.stderr)
        return 1
    for name, index, label in rows:
        print(f"{name}\t{index}\t{label}")
    if accuracy is not None:
        print(f"accuracy {accuracy:.6f}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
