"""The ``fedhet`` command: partition, report, certs, keys (in-process with typer)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest
from cryptography import x509
from typer.testing import CliRunner

from cli.main import app
from common.config import known_keys

ROOT = Path(__file__).resolve().parent.parent
runner = CliRunner()


def test_partition_prints_counts_writes_heatmap_and_exports(tmp_path: Path) -> None:
    args = [
        "partition",
        "-c",
        f"data.name='synthetic' data.cache-dir='{tmp_path / 'c'}'",
        "-c",
        "data.alpha=0.5",
        "-n",
        "4",
        "--heatmap",
        str(tmp_path / "h.png"),
        "--export",
        str(tmp_path / "split"),
    ]
    out = runner.invoke(app, args)
    assert out.exit_code == 0, out.output
    rows = [ln for ln in out.output.splitlines() if re.match(r"^\s+\d+\s+\d+\s+\d+\s+\|", ln)]
    assert len(rows) == 4
    assert (tmp_path / "h.png").stat().st_size > 0
    total = sum(int(r.split()[1]) + int(r.split()[2]) for r in rows)
    exported = sum(len(np.load(f)["y"]) for f in (tmp_path / "split").glob("*/*.npz"))
    assert total == exported == 2500  # synthetic: 2000 + 500, nothing dropped


def test_partition_rejects_a_bad_key_with_one_line(tmp_path: Path) -> None:
    out = runner.invoke(app, ["partition", "-c", "data.alpha=-2.0"])
    assert out.exit_code == 2
    assert "data.alpha" in out.output and "greater than 0" in out.output


def _results(path: Path, algo: str, seed: int, accs: list[float]) -> Path:
    rounds = [
        {
            "round": i + 1,
            "accuracy": a,
            "bytes-up-per-client": 100.0,
            "bytes-down-per-client": 200.0,
        }
        for i, a in enumerate(accs)
    ]
    doc = {
        "config": {"algorithm": algo, "seed": seed, "out-dir": str(path)},
        "rounds": rounds,
        "summary": {
            "accuracy-last": accs[-1],
            "accuracy-best": max(accs),
            "wall-time-s": 10.0 + seed,
        },
    }
    path.mkdir(parents=True)
    (path / "results.json").write_text(json.dumps(doc))
    return path / "results.json"


def test_report_folds_seeds_into_mean_and_std(tmp_path: Path) -> None:
    files = [_results(tmp_path / f"a{s}", "fedre", s, [0.5, 0.6 + 0.1 * s]) for s in range(3)]
    files.append(_results(tmp_path / "b", "local", 0, [0.4, 0.45]))
    out = runner.invoke(app, ["report", *map(str, files), "--plot", str(tmp_path / "p.png")])
    assert out.exit_code == 0, out.output
    fedre = next(ln for ln in out.output.splitlines() if ln.startswith("| fedre"))
    assert "| 3 |" in fedre and "0.7000 ± 0.1000" in fedre
    assert "100 B" in fedre and "200 B" in fedre
    assert any(ln.startswith("| local | 1 | 0.4500") for ln in out.output.splitlines())
    assert (tmp_path / "p.png").stat().st_size > 0


def test_report_takes_the_run_folder_a_run_prints(tmp_path: Path) -> None:
    folder = _results(tmp_path / "fedre-20261204-101500", "fedre", 0, [0.5, 0.75]).parent
    out = runner.invoke(app, ["report", str(folder), "--plot", str(tmp_path / "p.png")])
    assert out.exit_code == 0, out.output
    assert any(ln.startswith("| fedre | 1 | 0.7500") for ln in out.output.splitlines())
    empty = tmp_path / "empty"
    empty.mkdir()
    out = runner.invoke(app, ["report", str(empty), "--plot", str(tmp_path / "q.png")])
    assert out.exit_code == 2 and "a folder without results.json" in out.output


def test_certs_and_keys(tmp_path: Path) -> None:
    out = runner.invoke(
        app, ["certs", str(tmp_path / "c"), "--host", "superlink", "--host", "127.0.0.1"]
    )
    assert out.exit_code == 0, out.output
    cert = x509.load_pem_x509_certificate((tmp_path / "c" / "server.pem").read_bytes())
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert "superlink" in san.get_values_for_type(x509.DNSName)
    assert [str(ip) for ip in san.get_values_for_type(x509.IPAddress)] == ["127.0.0.1"]
    assert (tmp_path / "c" / "ca.key").stat().st_mode & 0o077 == 0
    out = runner.invoke(app, ["keys", str(tmp_path / "k"), "--nodes", "2"])
    assert out.exit_code == 0, out.output
    pub = (tmp_path / "k" / "node-1.pub").read_text()
    assert pub.startswith("ecdsa-sha2-nistp384 ")


def test_every_run_config_key_is_documented() -> None:
    """The full reference is docs/configuration.md (tests/test_config_doc.py keeps it
    equal to what the model renders); the README shows the common keys and links it."""
    reference = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    missing = [k for k in known_keys() if f"`{k}`" not in reference]
    assert not missing, f"docs/configuration.md lacks run-config keys: {missing}"
    assert "](docs/configuration.md)" in (ROOT / "README.md").read_text()


def test_ci_runs_the_readme_test_command() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    assert "bash scripts/test.sh" in readme and "bash scripts/test.sh" in ci


def test_connections_are_added_replaced_and_removed(tmp_path: Path) -> None:
    import tomllib

    from cli.launch import remove_connection, write_connection

    write_connection(tmp_path, "a", "127.0.0.1:1")
    write_connection(tmp_path, "b", "127.0.0.1:2", root_certificates=tmp_path / "ca.crt")
    write_connection(tmp_path, "a", "127.0.0.1:3")
    doc = tomllib.loads((tmp_path / "config.toml").read_text())["superlink"]
    assert doc["a"] == {"address": "127.0.0.1:3", "insecure": True}
    assert doc["b"]["root-certificates"] == str(tmp_path / "ca.crt")
    assert doc["default"] == "local" and doc["local"]["address"] == ":local:"
    remove_connection(tmp_path, "a")
    doc = tomllib.loads((tmp_path / "config.toml").read_text())["superlink"]
    assert "a" not in doc and "b" in doc


@pytest.mark.parametrize("durable", [True, False])
def test_federation_superlink_state_file_or_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, durable: bool
) -> None:
    """``fedhet federation`` keeps the SuperLink's state in <workdir>/superlink.db;
    ``--memory-state`` leaves it to Flower's in-memory state (no --database)."""
    import cli.federation as fedmod

    started: list[list[str]] = []
    fed = fedmod.Federation(
        tmp_path, [{"partition-id": 0}], tmp_path, secure=False, durable=durable
    )
    monkeypatch.setattr(fed.procs, "start", lambda name, cmd, cwd=None: started.append(cmd))
    monkeypatch.setattr(fedmod, "wait_http", lambda *a, **k: None)
    fed.start_superlink()
    (cmd,) = started
    if durable:
        assert cmd[cmd.index("--database") + 1] == str(tmp_path / "superlink.db")
    else:
        assert "--database" not in cmd


def test_fedhet_run_exits_1_when_the_run_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    """`flwr run --stream` exits 0 on a failed run; `fedhet run` reads the status."""
    import cli.launch
    from cli.launch import RunOutcome

    seen: dict[str, object] = {}

    def fake(app_dir, connection, overrides, **kwargs):  # type: ignore[no-untyped-def]
        seen.update(connection=connection, overrides=overrides)
        return RunOutcome(7, seen["status"], Path("/tmp/x.log"))  # type: ignore[arg-type]

    monkeypatch.setattr(cli.launch, "run_deployed", fake)
    for status, code in (("finished:failed", 1), ("finished:completed", 0)):
        seen["status"] = status
        out = runner.invoke(app, ["run", "compose", "-c", "num-server-rounds=2"])
        assert out.exit_code == code, out.output
        assert f"run 7: {status}" in out.output
    assert seen["connection"] == "compose" and seen["overrides"] == {"num-server-rounds": 2}
    bad = runner.invoke(app, ["run", "compose", "-c", "no-such-key=1"])
    assert bad.exit_code == 2


@pytest.mark.e2e
def test_fedhet_run_on_a_running_federation_reports_completed_and_failed(tmp_path: Path) -> None:
    """On a running federation (as the Docker stack is): a run whose ServerApp cannot
    write its out-dir (the issue's first compose run on a root-owned deploy/results)
    ends finished:failed and `fedhet run` exits 1; a good run exits 0."""
    import os
    import subprocess
    import sys

    from cli.federation import CONNECTION, Federation
    from tests.federation_support import run_overrides

    configs = [{"partition-id": 0, "num-partitions": 1}]
    with Federation(tmp_path / "fed", configs, ROOT, secure=False, durable=False) as fed:
        one = {"num-server-rounds": 1, "min-train-nodes": 1, "min-evaluate-nodes": 1}
        one["min-available-nodes"] = 1
        not_a_folder = tmp_path / "a-file"
        not_a_folder.write_text("")
        fedhet = Path(sys.executable).with_name("fedhet")
        codes = {}
        for name, out_dir in (("failed", not_a_folder / "out"), ("ok", tmp_path / "out")):
            overrides = {**run_overrides(fed, name, "local", **one), "out-dir": str(out_dir)}
            pairs = " ".join(f"{k}={json.dumps(v)}" for k, v in overrides.items())
            done = subprocess.run(
                [str(fedhet), "run", CONNECTION, "-c", pairs],
                capture_output=True,
                text=True,
                timeout=600,
                cwd=tmp_path,
                env={**os.environ, "FLWR_HOME": str(fed.home)},
            )
            codes[name] = (done.returncode, done.stdout[-2000:] + done.stderr[-2000:])
        assert codes["failed"][0] == 1 and "finished:failed" in codes["failed"][1], codes
        assert codes["ok"][0] == 0 and "finished:completed" in codes["ok"][1], codes
        assert (tmp_path / "out" / "results.json").exists()


def test_sourcing_setup_leaves_the_callers_shell_as_it_was() -> None:
    """`source scripts/setup.sh` (as the README says) in an interactive shell: the
    shell's options stay as they were, and a failing command after it does not end
    the shell."""
    import subprocess
    from pathlib import Path

    setup = Path(__file__).resolve().parent.parent / "scripts" / "setup.sh"
    script = (
        f'source {setup}; echo "opts=$-"; set -o | grep -c "pipefail *on"; '
        "ls /nonexistent; echo alive"
    )
    out = subprocess.run(
        ["bash", "-ic", script],
        capture_output=True,
        text=True,
        timeout=300,
        stdin=subprocess.DEVNULL,
    )
    lines = out.stdout.splitlines()
    assert lines[-1] == "alive", out.stdout + out.stderr
    opts = next(line for line in lines if line.startswith("opts="))
    assert "e" not in opts.removeprefix("opts=") and "u" not in opts.removeprefix("opts=")
    assert "0" in lines  # pipefail off


def test_simulate_and_federation_take_the_same_node_count_option() -> None:
    """One name for the node count in both commands (`--num-supernodes`, Flower's), the
    other kept as an alias (`--nodes`)."""
    import typer.main

    from cli.main import app

    group = typer.main.get_command(app)
    for name, dest in (("simulate", "num_supernodes"), ("federation", "nodes")):
        [option] = [p for p in group.commands[name].params if p.name == dest]
        assert set(option.opts) == {"--num-supernodes", "--nodes"}, name


def test_federation_node_config_reaches_every_node_and_refuses_the_partition() -> None:
    import pytest as _pytest

    from cli.main import parse_node_config

    assert parse_node_config("onnx-export=true  rate=0.5 n=3 label='rpi 4' name=x") == {
        "onnx-export": True,
        "rate": 0.5,
        "n": 3,
        "label": "rpi 4",
        "name": "x",
    }
    assert parse_node_config("") == {}
    for bad, says in (("partition-id=1", "set by the federation"), ("oops", "not key=value")):
        with _pytest.raises(ValueError, match=says):
            parse_node_config(bad)


def test_results_name_the_partition_and_the_command_that_writes_it_again(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """results.json's summary.partition: the folder with each client's test/<i>.npz,
    and a `fedhet partition ... --export` command that writes the same files."""
    import shlex

    import numpy as np
    from typer.testing import CliRunner

    from cli.main import app
    from common.config import parse_run_config
    from data import prepare_partition
    from server_app.results import partition_record

    cfg = parse_run_config({"data.name": "synthetic", "data.cache-dir": str(tmp_path / "c")})
    folder = prepare_partition(cfg.data, 3, cfg.seed)
    record = partition_record(cfg, 3)
    assert record["folder"] == str(folder) and record["num-partitions"] == 3
    args = shlex.split(record["export"].replace("<folder>", str(tmp_path / "again")))[1:]
    done = CliRunner().invoke(app, [*args, "--heatmap", str(tmp_path / "h.png")])
    assert done.exit_code == 0, done.output
    for name in ("test/1.npz", "train/2.npz"):
        with np.load(folder / name) as a, np.load(tmp_path / "again" / name) as b:
            assert all(np.array_equal(a[k], b[k]) for k in a.files)
