"""``fedhet predict``: an exported model classifies images and .npz arrays with ONNX
Runtime alone (torch unimportable), as the torch model does; bad input is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime", reason="pip install -e '.[dev]' (onnxruntime)")
pytest.importorskip("onnxscript", reason="pip install -e '.[dev]' (onnxscript)")
Image = pytest.importorskip("PIL.Image", reason="pip install -e '.[dev]' (pillow)")

from cli.export import evaluated_files, export_run  # noqa: E402
from cli.predict import Model, run  # noqa: E402
from client_app.app import app as client_app  # noqa: E402
from client_app.export import predictor, replay  # noqa: E402
from common.config import parse_run_config  # noqa: E402
from data.layout import client_files  # noqa: E402
from data.store import prepare_partition  # noqa: E402
from server_app.app import serve  # noqa: E402
from server_app.inprocess import FakeGrid, small_config  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
NO_TORCH = """
import sys
class _NoTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is not installed here")
        return None
sys.meta_path.insert(0, _NoTorch())
"""
"""Prepended to a child's code: any import of torch fails."""


class Exported:
    """Client 0 of a finished run: its ONNX file, raw test images and torch's classes."""

    def __init__(self, root: Path) -> None:
        run_config = small_config(
            root, algorithm="fedproto", **{"fedproto.infer": "proto", "num-server-rounds": 1}
        )
        cfg = parse_run_config(run_config)
        path = serve(FakeGrid(client_app, run_config, 2), cfg, True)  # type: ignore[arg-type]
        out = path.parent
        self.model = export_run(out, root / "onnx", client=0, echo=lambda _: None)[0]
        self.card = json.loads(self.model.with_suffix(".json").read_text())
        self.npz = client_files(prepare_partition(cfg.data, 2, cfg.seed), 0)[1]
        hook, client, _ = replay(evaluated_files(out, 0)[0])
        with torch.no_grad():
            self.torch_classes = predictor(hook, client).eval()(client.data.x_test).argmax(1)
        self.y = client.data.y_test.numpy()
        self.x = client.data.x_test.numpy()
        with np.load(self.npz) as archive:
            self.pixels = archive["x"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> Exported:
    return Exported(tmp_path_factory.mktemp("predict"))


def predicted(out: str) -> list[int]:
    return [int(line.split("\t")[1]) for line in out.splitlines()]


def test_an_npz_of_raw_test_images_is_classified_as_torch_classifies_it(
    exported: Exported, capsys: pytest.CaptureFixture[str]
) -> None:
    """The test split's uint8 pixels, normalised by the model card, give torch's
    classes on the loader's normalised tensors; the accuracy is the recorded one."""
    assert exported.pixels.dtype == np.uint8
    pixels = exported.pixels.transpose(0, 3, 1, 2)  # [n, H, W, 1] -> [n, 1, H, W]
    np.testing.assert_allclose(Model(exported.model).normalise(pixels), exported.x, atol=1e-5)
    assert run(exported.model, [exported.npz]) == 0
    out = capsys.readouterr()
    assert predicted(out.out) == exported.torch_classes.tolist()
    assert out.err.strip() == f"accuracy {exported.card['accuracy']:.6f}"
    first = out.out.splitlines()[0].split("\t")
    assert first[0] == f"{exported.npz}[0]" and first[2] == exported.card["classes"][int(first[1])]


def test_image_files_and_folders_are_classified_in_order(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    folder = tmp_path / "images"
    folder.mkdir()
    for i in range(5):
        Image.fromarray(exported.pixels[i, ..., 0], mode="L").save(folder / f"{i:02d}.png")
    assert run(exported.model, [folder / "03.png", folder]) == 0
    out = capsys.readouterr().out
    expected = exported.torch_classes[:5].tolist()
    assert predicted(out) == [expected[3], *expected]
    assert out.splitlines()[1].startswith(str(folder / "00.png"))


def test_predict_runs_without_torch(exported: Exported, tmp_path: Path) -> None:
    """Both entry points (`fedhet predict` through cli.main, and cli/predict.py copied
    to a device as one file) work where importing torch fails, and leave nothing in the
    user's home (onnxruntime's device id and telemetry queue are turned off)."""
    home = tmp_path / "home"
    home.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "ORT_DISABLE_TELEMETRY"}
    env |= {"HOME": str(home), "XDG_CACHE_HOME": ""}
    inputs = [str(exported.model), str(exported.npz)]
    via_cli = f"from cli.main import app\napp(['predict', *{inputs!r}])"
    copied = (
        "import runpy, sys\n"
        f"sys.argv = ['predict.py', *{inputs!r}]\n"
        f"runpy.run_path({str(ROOT / 'cli' / 'predict.py')!r}, run_name='__main__')"
    )
    for code in (via_cli, copied):
        done = subprocess.run(
            [sys.executable, "-c", NO_TORCH + code],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=120,
            env=env,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        assert predicted(done.stdout) == exported.torch_classes.tolist()
        assert [p.relative_to(home) for p in home.rglob("*")] == []


def _bad_inputs(exported: Exported, tmp: Path) -> dict[str, tuple[list[Path], str, str]]:
    """Case -> (model + inputs, --dataset, what the one line says)."""
    truncated = tmp / "truncated.onnx"
    data = exported.model.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    small = tmp / "small.png"
    Image.fromarray(np.zeros((32, 32), np.uint8), mode="L").save(small)
    rgb = tmp / "rgb.png"
    Image.fromarray(np.zeros((28, 28, 3), np.uint8), mode="RGB").save(rgb)
    labels = tmp / "other.npz"
    np.savez(labels, x=exported.pixels[:4], y=np.array([0, 1, 2, 57]))
    image = tmp / "ok.png"
    Image.fromarray(exported.pixels[0, ..., 0], mode="L").save(image)
    return {
        "missing model": ([tmp / "nope.onnx", image], "", "no such model file"),
        "truncated model": ([truncated, image], "", "not a readable ONNX model"),
        "wrong size": ([exported.model, small], "", "32x32 pixels; the model takes 1 channel"),
        "wrong channels": ([exported.model, rgb], "", "images of 3 channel(s)"),
        "labels of another dataset": ([exported.model, labels], "", "labels 0..57"),
        "model of another dataset": ([exported.model, image], "cifar10", "not 'cifar10'"),
        "missing input": ([exported.model, tmp / "nope.png"], "", "no such file or folder"),
    }


CASES = [
    "missing model",
    "truncated model",
    "wrong size",
    "wrong channels",
    "labels of another dataset",
    "model of another dataset",
    "missing input",
]


@pytest.mark.parametrize("case", CASES)
def test_bad_input_is_one_line_and_exit_1(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    paths, dataset, says = _bad_inputs(exported, tmp_path)[case]
    assert run(paths[0], paths[1:], dataset) == 1
    out = capsys.readouterr()
    assert out.out == ""
    lines = out.err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("fedhet predict: "), out.err
    assert says in lines[0]


def test_the_right_dataset_passes_the_check(
    exported: Exported, capsys: pytest.CaptureFixture[str]
) -> None:
    assert exported.card["dataset"] == "synthetic"
    assert run(exported.model, [exported.npz], "synthetic") == 0
    assert predicted(capsys.readouterr().out) == exported.torch_classes.tolist()


def test_the_cli_commands_exit_1_with_one_line(tmp_path: Path) -> None:
    """`fedhet export` of a folder with nothing evaluated, `fedhet predict` of a missing
    model: exit status 1 and one line on stderr."""
    from typer.testing import CliRunner

    from cli.main import app

    (tmp_path / "empty").mkdir()
    runner = CliRunner()
    for args, says in (
        (["export", str(tmp_path / "empty"), "--out", str(tmp_path / "o")], "neither a run's"),
        (["predict", str(tmp_path / "nope.onnx"), str(tmp_path)], "no such model file"),
    ):
        done = runner.invoke(app, args)
        assert done.exit_code == 1, done.output
        lines = done.stderr.splitlines()
        assert len(lines) == 1 and says in lines[0], done.stderr


@pytest.mark.parametrize("case", ["npy named npz", "no images", "batch 0", "batch -1"])
def test_more_bad_input_is_one_line_and_exit_1(
    exported: Exported, tmp_path: Path, capsys: pytest.CaptureFixture[str], case: str
) -> None:
    npy = tmp_path / "array.npz"
    with npy.open("wb") as fh:
        np.save(fh, exported.pixels[:2])  # a .npy archive under an .npz name
    empty = tmp_path / "empty.npz"
    np.savez(empty, x=exported.pixels[:0])
    inputs, batch, says = {
        "npy named npz": (npy, 256, "a single array (.npy), not an .npz archive"),
        "no images": (empty, 256, "'x' holds no images"),
        "batch 0": (exported.npz, 0, "--batch-size 0: must be at least 1"),
        "batch -1": (exported.npz, -1, "--batch-size -1: must be at least 1"),
    }[case]
    assert run(exported.model, [inputs], "", batch) == 1
    out = capsys.readouterr()
    lines = out.err.splitlines()
    assert out.out == "" and len(lines) == 1 and says in lines[0], out.err


@pytest.mark.slow  # a run and an export: 30 s
def test_a_model_trained_on_resized_images_gets_them_resized_the_same_way(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """8x8 images, resized to 16x16 as nodes load them: the card says so, and predict
    resizes the raw 8x8 pixels the same way (numpy), giving torch's classes."""
    rng = np.random.default_rng(0)
    data = tmp_path / "digits8.npz"
    np.savez(data, x=rng.integers(0, 256, (300, 8, 8), dtype=np.uint8), y=rng.integers(0, 4, 300))
    run_config = small_config(
        tmp_path,
        algorithm="local",
        **{"num-server-rounds": 1, "data.name": "npz", "data.root": str(data)},
    )
    cfg = parse_run_config(run_config)
    out = serve(FakeGrid(client_app, run_config, 2), cfg, True).parent  # type: ignore[arg-type]
    model = export_run(out, tmp_path / "onnx", client=0, echo=lambda _: None)[0]
    card = json.loads(model.with_suffix(".json").read_text())
    assert card["input"]["shape"][1:] == [1, 16, 16] and card["input"]["resized-from"] == [8, 8]
    hook, client, _ = replay(evaluated_files(out, 0)[0])
    with torch.no_grad():
        want = predictor(hook, client).eval()(client.data.x_test).argmax(1).tolist()
    npz = client_files(prepare_partition(cfg.data, 2, cfg.seed), 0)[1]
    assert run(model, [npz]) == 0
    assert predicted(capsys.readouterr().out) == want
