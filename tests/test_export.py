"""The exported model is the model each client is evaluated with, for every algorithm.

A small federation runs through the real ServerApp (``server_app.app.serve``) on the
in-process grid; ``fedhet export`` then writes every client's ONNX file. For each
client: ONNX Runtime's scores on the client's test split equal the torch predictor's
(logits within 1e-4, the same argmax on every sample), and the ONNX model's accuracy is
exactly the accuracy results.json recorded for that client in that round. A node with
node-config ``onnx-export`` writes the same model itself after every evaluation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

ort = pytest.importorskip("onnxruntime", reason="pip install -e '.[dev]' (onnxruntime)")
pytest.importorskip("onnxscript", reason="pip install -e '.[dev]' (onnxscript)")

from cli.export import evaluated_files, export_run  # noqa: E402
from client_app import export as export_module  # noqa: E402
from client_app.app import app as client_app  # noqa: E402
from client_app.export import MODEL_FILE, predictor, replay, wants_onnx  # noqa: E402
from common.config import ConfigError, parse_run_config  # noqa: E402
from common.methods import BUILTIN  # noqa: E402
from common.methods import names as method_names  # noqa: E402
from server_app.app import serve  # noqa: E402
from server_app.inprocess import FakeGrid, small_config  # noqa: E402

BUILTIN_NAMES = {m.name for m in BUILTIN}

EXTRA: dict[str, dict[str, Any]] = {
    "fedavg": {"model.family": "fedavgcnn"},
    "fedproto-proto": {"algorithm": "fedproto", "fedproto.infer": "proto"},
}
"""Run-config overrides a method needs here, and cases beyond one per method."""
CASES: dict[str, dict[str, Any]] = {
    **{name: EXTRA.get(name, {}) for name in method_names() if name in BUILTIN_NAMES},
    **{case: keys for case, keys in EXTRA.items() if "algorithm" in keys},
}
"""Case -> run-config overrides (the case name is the algorithm unless set): every
built-in method of the registry."""
FAST: tuple[str, ...] = ()
"""In the fast tier: none (each case is a whole run, then an export of every client; the
nearest-prototype export, fedproto-proto, runs in the full tier with the others)."""


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One partition cache for the module (the synthetic data is made once)."""
    return tmp_path_factory.mktemp("partitions")


def federate(
    tmp: Path,
    cache: Path,
    nodes: int = 2,
    node_configs: list[dict] | None = None,
    simulation: bool = True,
    **overrides: Any,
) -> tuple[dict, Path]:
    """A run through the ServerApp's ``serve`` on the in-process grid: results.json
    and the out-dir (a simulation keeps the clients' state in ``<out-dir>/clients``)."""
    run_config = small_config(tmp, **{"data.cache-dir": str(cache), **overrides})
    grid = FakeGrid(client_app, run_config, nodes, node_configs)
    path = serve(grid, parse_run_config(run_config), simulation)  # type: ignore[arg-type]
    return json.loads(path.read_text()), path.parent


def scores(path: Path, x: torch.Tensor) -> np.ndarray:
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return session.run(None, {"x": x.numpy()})[0]


def assert_same_decision(onnx: np.ndarray, reference: np.ndarray) -> None:
    """Same argmax everywhere; finite scores within 1e-4, -inf where torch has -inf."""
    assert onnx.shape == reference.shape
    np.testing.assert_array_equal(onnx.argmax(1), reference.argmax(1))
    np.testing.assert_array_equal(np.isneginf(onnx), np.isneginf(reference))
    finite = np.isfinite(reference)
    np.testing.assert_allclose(onnx[finite], reference[finite], rtol=0, atol=1e-4)


def check_every_client(res: dict, out: Path, target: Path) -> list[dict]:
    """Export every client of ``out`` and check it against torch and results.json;
    the model cards."""
    last = res["rounds"][-1]
    written = export_run(out, target, echo=lambda _: None)
    assert sorted(p.name for p in written) == [f"client-{pid}.onnx" for pid in range(2)]
    cards = []
    for path in written:
        pid = int(path.stem.removeprefix("client-"))
        card = json.loads(path.with_suffix(".json").read_text())
        hook, run, doc = replay(evaluated_files(out, pid)[pid])
        x, y = run.data.x_test, run.data.y_test.numpy()
        recorded = last["client-accuracy"][str(pid)]
        # the rebuilt client evaluates exactly as it did in the run
        assert hook.evaluate(run, x, run.data.y_test).accuracy == recorded
        with torch.no_grad():
            reference = predictor(hook, run).eval()(x).numpy()
        onnx = scores(path, x)
        assert_same_decision(onnx, reference)
        assert float((onnx.argmax(1) == y).mean()) == recorded
        assert card["round"] == last["round"] == doc["round"]
        assert card["accuracy"] == recorded and card["accuracy-source"] == "results.json"
        assert card["input"]["shape"] == ["batch", *x.shape[1:]]
        assert card["partition-id"] == pid and card["num-test"] == len(y)
        cards.append(card)
    return cards


def _case(name: str) -> Any:
    marks = () if name in FAST else (pytest.mark.slow,)
    return pytest.param(name, marks=marks, id=name)


@pytest.mark.parametrize("case", [_case(n) for n in CASES])
def test_the_exported_model_decides_as_the_evaluated_one(
    tmp_path: Path, cache: Path, case: str
) -> None:
    overrides = {"algorithm": case, **CASES[case]}
    res, out = federate(tmp_path, cache, **overrides)
    cards = check_every_client(res, out, tmp_path / "onnx")
    decision = "nearest-prototype" if case == "fedproto-proto" else "head"
    assert {c["output"]["decision"] for c in cards} == {decision}
    assert {c["algorithm"] for c in cards} == {overrides["algorithm"]}
    if case == "fedara":  # partition 1 sits on the 0.5 tier: its model is smaller
        sizes = {c["partition-id"]: (tmp_path / "onnx" / f"client-{c['partition-id']}.onnx")
                 for c in cards}  # fmt: skip
        assert sizes[1].stat().st_size < 0.8 * sizes[0].stat().st_size


@pytest.mark.slow  # a whole in-process run: in the full tier (the fast tier stays under 3 min)
def test_a_node_with_onnx_export_writes_its_current_model(tmp_path: Path, cache: Path) -> None:
    """Deployment: node-config ``state-dir`` + ``onnx-export``; the node's model.onnx
    after the run is the last round's evaluated model, and ``fedhet export`` of its
    state-dir gives the same decisions. Without the key no model.onnx is written."""
    state = tmp_path / "state"
    configs: list[dict] = [
        {"state-dir": str(state / "node-0"), "onnx-export": True},
        {"state-dir": str(state / "node-1")},
    ]
    res, _ = federate(tmp_path, cache, node_configs=configs, simulation=False, algorithm="lgfedavg")
    last = res["rounds"][-1]
    model = state / "node-0" / MODEL_FILE
    card = json.loads(model.with_suffix(".json").read_text())
    assert card["round"] == last["round"] and card["accuracy-source"] == "node"
    assert card["accuracy"] == last["client-accuracy"]["0"]
    assert not (state / "node-1" / MODEL_FILE).exists()
    meta = ort.InferenceSession(str(model)).get_modelmeta().custom_metadata_map
    assert json.loads(meta["fedhet"]) == card
    exported = export_run(state / "node-0", tmp_path / "onnx", echo=lambda _: None)
    hook, run, _ = replay(evaluated_files(state / "node-0")[0])
    x = run.data.x_test
    assert_same_decision(scores(model, x), scores(exported[0], x))
    assert float((scores(model, x).argmax(1) == run.data.y_test.numpy()).mean()) == card["accuracy"]


def test_export_refuses_what_it_cannot_export(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="neither a run's out-dir"):
        evaluated_files(tmp_path / "empty")
    with pytest.raises(ConfigError, match="is not a folder"):
        evaluated_files(tmp_path / "missing")
    (tmp_path / "run" / "clients" / "node-0").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no evaluated model in"):
        evaluated_files(tmp_path / "run")
    with pytest.raises(ConfigError, match="no evaluated model of client 3"):
        evaluated_files(tmp_path / "run", 3)


def test_a_failed_node_export_is_logged_and_the_round_goes_on(
    tmp_path: Path, cache: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def missing(*args: Any, **kwargs: Any) -> None:
        raise ImportError("ONNX export needs onnxscript: pip install 'fedhet[export]'")

    monkeypatch.setattr(export_module, "to_onnx", missing)
    state = tmp_path / "state"
    configs: list[dict] = [
        {"state-dir": str(state / f"node-{i}"), "onnx-export": True} for i in (0, 1)
    ]
    res, _ = federate(tmp_path, cache, node_configs=configs, simulation=False, algorithm="local")
    assert [r["round"] for r in res["rounds"]] == [1, 2]
    assert res["rounds"][-1]["accuracy"] is not None
    assert not (state / "node-0" / MODEL_FILE).exists()
    assert evaluated_files(state / "node-0")  # the evaluated model is kept all the same
    assert "onnx-export: could not write" in caplog.text and "fedhet[export]" in caplog.text


@pytest.mark.parametrize(
    ("value", "wanted"),
    [(True, True), ("true", True), ("1", True), (False, False), ("false", False)],
)
def test_onnx_export_takes_true_or_false(value: Any, wanted: bool) -> None:
    assert wants_onnx({"onnx-export": value}) is wanted
    assert wants_onnx({}) is False


def test_onnx_export_refuses_anything_else() -> None:
    with pytest.raises(ConfigError, match="node-config onnx-export='yes' must be true or false"):
        wants_onnx({"onnx-export": "yes"})
