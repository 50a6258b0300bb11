"""Inference cost of a personal model: ONNX Runtime against torch, one image at a time.

For each model (CNN-1..CNN-5 on Fashion-MNIST's 1x28x28 inputs, d = 500, 10 classes;
FedARA's model, CNN-1 with its two default layers factorised at rank ratio 1 and 1/4)
and each runtime, a fresh process loads the model, classifies one image 50 times to
warm up and then 500 times, each call timed alone (batch 1, one thread: an edge
application answering one request). Reported: the median and 90th percentile of the
per-image latency, the process's peak RSS (``VmHWM``, MiB: interpreter, runtime, model
and its buffers), the seconds from the script's first line (imports included) to a
loaded model, and the files' sizes. A bare interpreter with numpy is measured the same
way as the baseline. The ONNX files are written by fedhet's exporter
(:func:`models.export.to_onnx`), each in a fresh process as a node with node-config
``onnx-export`` does after an evaluation: the export's wall and CPU seconds, the same
from the process's start (torch and the exporter imported) and its peak RSS are reported
too (CPU seconds: what the export costs a device whatever else runs beside it).
The torch process rebuilds the model from fedhet's code and loads its state dict.

    nice -n 10 python -m benchmarks.inference          # docs/results/inference.{json,md}
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.probe import archive_rows, peak_mb

START = time.perf_counter()
EXPORT_KEYS = ("export-s", "export-cpu-s", "start-to-file-s", "start-to-file-cpu-s")
WARMUP, CALLS = 50, 500
SHAPE = (1, 28, 28)
CLASSES, DIM = 10, 500
MODELS: dict[str, tuple[str, float]] = {
    **{f"cnn-{k}": (f"cnn-{k}", 1.0) for k in range(1, 6)},
    "fedara rank 1": ("cnn-1", 1.0),
    "fedara rank 1/4": ("cnn-1", 0.25),
}
"""Row name -> (architecture, FedARA rank ratio; 1.0 for the plain model)."""


def build(arch: str, ratio: float, fedara: bool) -> Any:
    """The model as a client holds it (FedARA: the extractor factorised by SVD)."""
    from models import build_model
    from models.lowrank import default_layers, factorise

    model = build_model(
        arch, in_channels=SHAPE[0], num_classes=CLASSES, image_size=SHAPE[1], feature_dim=DIM,
        seed=0,
    )  # fmt: skip
    if fedara and ratio < 1:
        model.extractor = factorise(model.extractor, default_layers(model.extractor), ratio)
    return model.eval()


def _timed(call: Any, x: Any) -> list[float]:
    for _ in range(WARMUP):
        call(x)
    times = []
    for _ in range(CALLS):
        t0 = time.perf_counter()
        call(x)
        times.append(time.perf_counter() - t0)
    return times


def child(runtime: str, path: str, arch: str, ratio: float, fedara: bool) -> dict[str, Any]:
    """One measurement, in this (fresh) process."""
    import numpy as np

    x = np.random.default_rng(0).standard_normal((1, *SHAPE)).astype(np.float32)
    if runtime == "onnxruntime":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = 1
        session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
        loaded = time.perf_counter() - START
        times = _timed(lambda v: session.run(None, {"x": v})[0], x)
    elif runtime == "torch":
        import torch

        torch.set_num_threads(1)
        model = build(arch, ratio, fedara)
        model.load_state_dict(torch.load(path, weights_only=True))
        xt = torch.from_numpy(x)
        loaded = time.perf_counter() - START

        def call(v: Any) -> Any:
            with torch.inference_mode():
                return model(v)

        times = _timed(call, xt)
    elif runtime == "export":  # what a node with onnx-export adds to an evaluation
        from models.export import to_onnx

        model = build(arch, ratio, fedara)
        t0, c0 = time.perf_counter(), time.process_time()
        to_onnx(model, SHAPE, Path(path))
        done, cpu = time.perf_counter(), time.process_time()
        return {
            "export-s": done - t0,
            "export-cpu-s": cpu - c0,
            "start-to-file-s": done - START,
            "start-to-file-cpu-s": cpu,
            "peak-rss-mib": peak_mb(),
        }
    else:  # the baseline: the interpreter and numpy
        loaded, times = time.perf_counter() - START, [0.0]
    return {
        "median-ms": statistics.median(times) * 1e3,
        "p90-ms": statistics.quantiles(times, n=10)[-1] * 1e3 if len(times) > 1 else 0.0,
        "peak-rss-mib": peak_mb(),
        "load-s": loaded,
    }


def measure(runtime: str, path: Path, arch: str, ratio: float, fedara: bool) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.inference", "--child", runtime, str(path), arch,
         str(ratio), str(int(fedara))],
        capture_output=True, text=True, check=True, timeout=600,
    )  # fmt: skip
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def export_all(folder: Path) -> dict[str, dict[str, Any]]:
    """Each model's ONNX file, written by a fresh process (its time and memory), and
    its state dict."""
    import torch

    files = {}
    for name, (arch, ratio) in MODELS.items():
        fedara = name.startswith("fedara")
        state = folder / f"{name.replace(' ', '-').replace('/', '_')}.pt"
        torch.save(build(arch, ratio, fedara).state_dict(), state)
        onnx = state.with_suffix(".onnx")
        files[name] = {"onnx": onnx, "torch": state, **measure("export", onnx, arch, ratio, fedara)}
    return files


def run() -> list[dict[str, Any]]:
    import numpy as np
    import onnxruntime as ort
    import torch

    rows: list[dict[str, Any]] = []
    load_before = os.getloadavg()[0]
    base = measure("none", Path("-"), "-", 1.0, False)
    machine = f"{platform.machine()}, {platform.processor() or platform.system()}"
    versions = {"torch": torch.__version__, "onnxruntime": ort.__version__, "numpy": np.__version__}
    rows.append({"model": "python + numpy", "runtime": "none", **base})
    with tempfile.TemporaryDirectory() as tmp:
        files = export_all(Path(tmp))
        for name, (arch, ratio) in MODELS.items():
            fedara = name.startswith("fedara")
            for runtime in ("onnxruntime", "torch"):
                path = files[name]["onnx" if runtime == "onnxruntime" else "torch"]
                row = {
                    "model": name,
                    "runtime": runtime,
                    **measure(runtime, path, arch, ratio, fedara),
                    "file-mb": path.stat().st_size / 1e6,
                    **(
                        {k: files[name][k] for k in EXPORT_KEYS}
                        | {"export-peak-rss-mib": files[name]["peak-rss-mib"]}
                        if runtime == "onnxruntime"
                        else {}
                    ),
                }
                rows.append(row)
                print(json.dumps(row), flush=True)
    load = {"before": load_before, "after": os.getloadavg()[0]}
    for row in rows:
        row.update(
            {
                "machine": machine,
                "threads": 1,
                "calls": CALLS,
                "versions": versions,
                "load-1min": load,
            }
        )
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| model | runtime | median ms / image | p90 ms | peak RSS (MiB) | start to loaded (s) "
        "| file (MB) | export CPU s (fresh process: start to file) | export peak RSS (MiB) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        size = f"{r['file-mb']:.2f}" if "file-mb" in r else "-"
        export, export_rss = "-", "-"
        if "export-cpu-s" in r:
            export = f"{r['export-cpu-s']:.1f} ({r['start-to-file-cpu-s']:.1f})"
            export_rss = f"{r['export-peak-rss-mib']:.0f}"
        lines.append(
            f"| {r['model']} | {r['runtime']} | {r['median-ms']:.3f} | {r['p90-ms']:.3f} | "
            f"{r['peak-rss-mib']:.0f} | {r['load-s']:.2f} | {size} | {export} | {export_rss} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=5, metavar=("RUNTIME", "PATH", "ARCH", "RATIO", "FEDARA"))
    args = parser.parse_args()
    if args.child:
        runtime, path, arch, ratio, fedara = args.child
        print(json.dumps(child(runtime, path, arch, float(ratio), fedara == "1")))
        return
    rows = run()
    md = table(rows)
    folder = archive_rows("inference", rows, md)
    print(md)
    print(f"archived: {folder / 'inference.json'}, {folder / 'inference.md'}")


if __name__ == "__main__":
    main()
