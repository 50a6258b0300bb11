"""docker-compose.yml and Dockerfile, validated offline (no Docker engine here).

``docker-compose config`` (1.29.2, in its own virtualenv ``.venv-compose``, created
by scripts/test.sh) must accept the file, and every container command must be the
one cli/federation.py builds for the loopback federation the e2e tests run.
"""

from __future__ import annotations

import importlib.util
import os
import re
import stat
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import tomllib
import yaml

from cli.federation import superexec_command, superlink_command, supernode_command

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("process_uids", ROOT / "scripts" / "process_uids.py")
assert _spec is not None and _spec.loader is not None
process_uids = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(process_uids)
COMPOSE = ROOT / ".venv-compose" / "bin" / "docker-compose"
HOST_UID = "4242"
SECRET = Path("/secrets/superexec.secret")
"""Where a node's SuperNode and executor containers find the node's executor secret."""


def compose_config(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    assert COMPOSE.exists(), f"{COMPOSE} is missing: scripts/compose-venv.sh creates it"
    clean = {k: v for k, v in os.environ.items() if not k.startswith("FEDHET_")}
    with tempfile.TemporaryDirectory() as tmp:
        no_dotenv = Path(tmp) / "empty.env"  # not the user's .env
        no_dotenv.touch()
        return subprocess.run(
            [str(COMPOSE), "-f", str(ROOT / "docker-compose.yml"), "--env-file", str(no_dotenv)]
            + ["config"],
            capture_output=True,
            text=True,
            timeout=120,
            cwd=ROOT,
            env={**clean, **env},
        )


@pytest.fixture(scope="module")
def compose() -> dict:
    out = compose_config({"FEDHET_UID": HOST_UID})
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


@pytest.mark.slow  # docker-compose config: .venv-compose (test.sh --all)
def test_without_the_host_uid_compose_refuses_and_says_what_to_set() -> None:
    out = compose_config({})
    assert out.returncode != 0 and "set FEDHET_UID (your id -u) in .env" in out.stderr


@pytest.mark.slow  # docker-compose config: .venv-compose (test.sh --all)
def test_superlink_command_is_the_loopback_one(compose: dict) -> None:
    want = superlink_command(host="0.0.0.0", port=9092, certs=Path("/certs"))
    assert compose["services"]["superlink"]["command"] == want
    assert "--enable-supernode-auth" in want and "--insecure" not in want
    assert "--disable-runtime-dependency-installation" in want


@pytest.mark.slow  # docker-compose config: .venv-compose (test.sh --all)
def test_three_supernodes_with_distinct_partitions_and_profiles(compose: dict) -> None:
    services = compose["services"]
    nodes = {k: v for k, v in services.items() if k.startswith("supernode-")}
    assert len(nodes) == 3
    seen = []
    for name, svc in sorted(nodes.items()):
        i = int(name.removeprefix("supernode-"))
        cmd = svc["command"]
        node_config = cmd[cmd.index("--node-config") + 1]
        pairs = dict(re.findall(r'(\S+)=("[^"]*"|\S+)', node_config))
        parsed = {k: tomllib.loads(f"v = {v}")["v"] for k, v in pairs.items()}
        want = supernode_command(
            superlink="superlink:9092",
            host="0.0.0.0",
            port=9094,
            ca=Path("/certs/ca.crt"),
            key=Path(f"/keys/node-{i}"),
            node_config=parsed,
            superexec_secret=SECRET,
        )
        assert cmd == want and "--isolation" in cmd  # warm: process isolation
        assert parsed["partition-id"] == i and parsed["num-partitions"] == 3
        assert parsed["state-dir"] == "/state" and parsed["data-cache"] == "own"
        seen.append(parsed["profile"])
        assert _mounts(svc) == {
            "/certs": "ca",
            "/keys": f"node-key-{i}",
            "/secrets": f"exec-secret-{i}",
        }
        assert "healthcheck" in svc
        assert svc["depends_on"]["register"]["condition"] == "service_completed_successfully"
        # its tasks: the warm executor, with the node's data cache and personal state
        executor = services[f"superexec-{i}"]
        assert executor["command"] == superexec_command(runtime_api=f"{name}:9094", secret=SECRET)
        assert _mounts(executor)["/secrets"] == f"exec-secret-{i}"
        assert {v.split(":")[1] for v in executor["volumes"]} >= {
            "/state",
            "/home/fedhet/.cache/fedhet",
        }
        # its own data cache (its partition) and state: no other service mounts them
        for path in ("/home/fedhet/.cache/fedhet", "/state"):
            own = _mounts(executor)[path]
            others = [
                n
                for n, s in services.items()
                if n != f"superexec-{i}" and own in _mounts(s).values()
            ]
            assert others in ([], [name]), (own, others)  # at most its own SuperNode
        assert executor["depends_on"][name]["condition"] == "service_healthy"
    assert len(set(seen)) == 3


SECRET_VOLUMES = {
    "superlink-tls",
    "ca",
    "public-keys",
    *(f"node-key-{i}" for i in range(3)),
    *(f"exec-secret-{i}" for i in range(3)),
}


def _mounts(svc: dict) -> dict[str, str]:
    """A service's mounts: container path -> source (volume name or host path)."""
    out = {}
    for volume in svc.get("volumes", []):
        parts = volume.split(":")
        out[parts[1]] = parts[0]
    return out


@pytest.mark.slow  # docker-compose config: .venv-compose (test.sh --all)
def test_each_service_mounts_only_the_secrets_it_needs(compose: dict) -> None:
    """A SuperNode sees the CA certificate, its own private key and its executor secret,
    its executor that secret only, the SuperLink its own certificate and key,
    ``register`` the public keys; only the one-shot ``init`` reads the host's
    deploy/certs and deploy/keys. Every secret mount is read-only."""
    services = compose["services"]
    want = {
        "superlink": {"superlink-tls"},
        "register": {"ca", "public-keys"},
        **{f"supernode-{i}": {"ca", f"node-key-{i}", f"exec-secret-{i}"} for i in range(3)},
        **{f"superexec-{i}": {f"exec-secret-{i}"} for i in range(3)},
    }
    assert set(services) == {"init", *want}
    for name, secrets in want.items():
        mounts = _mounts(services[name])
        assert {src for src in mounts.values() if src in SECRET_VOLUMES} == secrets, name
        assert not any("deploy/certs" in src or "deploy/keys" in src for src in mounts.values())
        for volume in services[name].get("volumes", []):
            if volume.split(":")[0] in SECRET_VOLUMES:
                assert volume.endswith(":ro"), (name, volume)
    init = _mounts(services["init"])
    assert init["/src/certs"].endswith("deploy/certs") and init["/src/keys"].endswith("deploy/keys")
    assert all(v.endswith(":ro") for v in services["init"]["volumes"] if ":/src/" in v)
    assert set(compose["volumes"]) >= SECRET_VOLUMES


@pytest.mark.slow  # docker-compose config: .venv-compose (test.sh --all)
def test_the_superlink_writes_results_to_the_host_as_the_host_user(compose: dict) -> None:
    """The SuperLink runs as FEDHET_UID (the image's group, whose home and FLWR_HOME are
    group-writable) and writes ./deploy/results; ``init`` sees that folder (to make it the
    user's when the engine created it: see the init script's test)."""
    superlink = compose["services"]["superlink"]
    assert superlink["user"] == f"{HOST_UID}:49999"
    assert superlink["environment"]["HOME"] == "/home/fedhet"
    assert _mounts(superlink)["/home/fedhet/fedhet-runs"].endswith("deploy/results")
    init = compose["services"]["init"]
    assert _mounts(init)["/results"].endswith("deploy/results")
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert "useradd --create-home --uid 49999 --gid 49999 fedhet" in dockerfile
    assert "chmod -R g+w /flwr-home /home/fedhet" in dockerfile


@pytest.mark.slow  # docker-compose config: .venv-compose (test.sh --all)
@pytest.mark.skipif(os.geteuid() != 0, reason="chown to other uids needs root, as in the container")
def test_the_init_script_gives_each_volume_its_files_only(compose: dict, tmp_path: Path) -> None:
    """The ``init`` service's own script, run here with its paths moved into a temporary
    folder: each volume receives exactly its files, private keys 0400 owned by their reader."""
    from cli.security import make_node_keys

    src, out = tmp_path / "src", tmp_path / "out"
    script, env = _init_script(compose, tmp_path)
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    want = {
        "superlink-tls": {
            "ca.crt": (0o444, 4242),
            "server.pem": (0o444, 4242),
            "server.key": (0o400, 4242),
        },
        "ca": {"ca.crt": (0o444, 49999)},
        "public-keys": {f"node-{i}.pub": (0o444, 49999) for i in range(3)},
        **{f"node-key-{i}": {f"node-{i}": (0o400, 49999)} for i in range(3)},
        **{f"exec-secret-{i}": {"superexec.secret": (0o400, 49999)} for i in range(3)},
    }
    for volume, files in want.items():
        got = {
            f.name: (f.stat().st_mode & 0o777, f.stat().st_uid) for f in (out / volume).iterdir()
        }
        assert got == files, volume
    for i in range(3):
        assert (out / f"node-key-{i}" / f"node-{i}").read_bytes() == (
            src / "keys" / f"node-{i}"
        ).read_bytes()
        assert (out / f"exec-secret-{i}" / "superexec.secret").read_bytes() == (
            src / "keys" / f"node-{i}.superexec-secret"
        ).read_bytes()
        assert stat.S_IMODE((out / f"exec-secret-{i}").stat().st_mode) == 0o500
    # a missing key stops the init step, naming the file
    (src / "keys" / "node-2").unlink()
    failed = subprocess.run(
        ["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert failed.returncode != 0 and "deploy/keys/node-2 is missing" in failed.stdout
    make_node_keys(src / "keys", 1, start=2)
    (src / "keys" / "node-1.superexec-secret").unlink()  # keys made before the secrets
    failed = subprocess.run(
        ["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60
    )
    assert failed.returncode != 0
    assert "deploy/keys/node-1.superexec-secret is missing" in failed.stdout


def _init_script(compose: dict, tmp_path: Path) -> tuple[str, dict[str, str]]:
    """The ``init`` service's script with its paths moved under ``tmp_path`` (sources
    made there: certificates, keys, secrets; an empty results folder owned by root, as
    the engine creates a missing one), and its environment."""
    from cli.security import make_certificates, make_node_keys, make_superexec_secrets

    src, out = tmp_path / "src", tmp_path / "out"
    if not (src / "certs").exists():
        make_certificates(src / "certs", ["superlink"])
        make_node_keys(src / "keys", 3)
        make_superexec_secrets(src / "keys", 3)
    init = compose["services"]["init"]
    for volume in init["volumes"]:
        path = volume.split(":")[1]
        if path.startswith("/out/"):
            (tmp_path / path.lstrip("/")).mkdir(parents=True, exist_ok=True)
    (tmp_path / "results").mkdir(exist_ok=True)
    script = init["command"][0].replace("$$", "$")
    script = script.replace("/src/", f"{src}/").replace("/out/", f"{out}/")
    script = re.sub(r"(?<=\s)/results\b", str(tmp_path / "results"), script)
    return script, {**os.environ, **init["environment"]}


@pytest.mark.slow  # docker-compose config: .venv-compose (test.sh --all)
@pytest.mark.skipif(os.geteuid() != 0, reason="chown to other uids needs root, as in the container")
@pytest.mark.parametrize(
    ("owner", "content", "ok", "owner_after"),
    [
        (0, False, True, int(HOST_UID)),  # made by the engine for a missing folder: given
        (int(HOST_UID), True, True, int(HOST_UID)),  # the user's own: left as it is
        (1234, False, False, 1234),  # someone else's: refused, not changed
        (0, True, False, 0),  # root's with files in it: refused, not changed
    ],
)
def test_the_init_script_makes_the_results_folder_the_users_or_stops(
    compose: dict, tmp_path: Path, owner: int, content: bool, ok: bool, owner_after: int
) -> None:
    """A fresh clone has no deploy/results: the engine creates it for root and the
    SuperLink (FEDHET_UID) could not write there (round 1 failed with a PermissionError).
    ``init`` gives an empty root-owned folder to FEDHET_UID and stops, saying whose it
    is, when the folder belongs to someone else."""
    script, env = _init_script(compose, tmp_path)
    results = tmp_path / "results"
    if content:
        (results / "old-run").mkdir()
    os.chown(results, owner, 0)
    done = subprocess.run(["sh", "-c", script], env=env, capture_output=True, text=True, timeout=60)
    assert (done.returncode == 0) == ok, done.stdout + done.stderr
    assert results.stat().st_uid == owner_after
    if not ok:
        assert f"deploy/results belongs to uid {owner}" in done.stdout
        assert f"FEDHET_UID={HOST_UID}" in done.stdout


@pytest.mark.slow  # docker-compose config: .venv-compose (test.sh --all)
def test_only_init_runs_as_root_and_only_the_superlink_as_the_host_user(compose: dict) -> None:
    """What each service's processes run as: ``init`` root, the SuperLink FEDHET_UID,
    every other service the image's USER, 49999 (scripts/compose-check.sh checks the
    live processes against this same table)."""
    uids = process_uids.expected_uids(
        compose, process_uids.image_uid((ROOT / "Dockerfile").read_text())
    )
    assert uids.pop("init") == 0
    assert uids.pop("superlink") == int(HOST_UID)
    assert set(uids.values()) == {49999}
    assert set(uids) == {
        "register",
        *(f"{r}-{i}" for r in ("supernode", "superexec") for i in range(3)),
    }


def test_the_image_runs_as_49999_and_the_check_reads_the_final_stage() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    assert process_uids.image_uid(dockerfile) == 49999
    assert process_uids.image_uid("FROM a AS build\nUSER 1\nFROM b\nRUN x\n") == 0
    with pytest.raises(ValueError, match="as a number"):
        process_uids.image_uid("FROM b\nUSER fedhet\n")


EXPECTED = {"init": 0, "register": 49999, "superlink": 1000, "supernode-0": 49999}
TOP = """\
superlink 1000 101 /opt/fedhet/bin/python /opt/fedhet/bin/flower-superlink --ssl-ca-certfile
superlink 1000 102 /opt/fedhet/bin/python -m flwr.superexec ...
supernode-0 49999 201 /opt/fedhet/bin/python /opt/fedhet/bin/fedhet supernode --superlink
"""


def test_the_process_check_passes_the_right_uids_and_names_a_wrong_one() -> None:
    rows = process_uids.parse_rows(["UID PID CMD", *TOP.splitlines()])
    assert len(rows) == 3 and process_uids.check(rows, EXPECTED) == []
    assert "supernode-0    1 processes, uid 49999 (want 49999)" in process_uids.table(
        rows, EXPECTED
    )
    # a ClientApp task child running as root in supernode-0's container
    rows.append(("supernode-0", 0, 202, "python -c from multiprocessing"))
    assert process_uids.check(rows, EXPECTED) == [
        "supernode-0: pid 202 runs as uid 0, want 49999: python -c from multiprocessing"
    ]
    # a service that should run but has no process; a container the file does not know
    rows = [r for r in rows if r[0] != "supernode-0"] + [("intruder", 0, 9, "sh")]
    assert process_uids.check(rows, EXPECTED) == [
        "intruder: not a service of the compose file (pid 9)",
        "supernode-0: no running process",
    ]


def test_the_process_check_exits_1_on_a_wrong_uid(tmp_path: Path) -> None:
    config = tmp_path / "config.yml"
    config.write_text(
        yaml.safe_dump({"services": {"superlink": {"user": "1000:49999"}, "supernode-0": {}}})
    )
    script = ROOT / "scripts" / "process_uids.py"
    args = [
        sys.executable,
        str(script),
        "--config",
        str(config),
        "--dockerfile",
        str(ROOT / "Dockerfile"),
    ]
    good = subprocess.run(args, input=TOP, capture_output=True, text=True, timeout=60)
    assert good.returncode == 0, good.stderr
    bad = subprocess.run(
        args,
        input=TOP.replace("supernode-0 49999", "supernode-0 0"),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert bad.returncode == 1 and "supernode-0: pid 201 runs as uid 0, want 49999" in bad.stderr


@pytest.mark.slow  # docker-compose config: .venv-compose (test.sh --all)
def test_registration_and_health_checks(compose: dict) -> None:
    services = compose["services"]
    assert services["superlink"]["healthcheck"]["test"][-1].startswith("https://")
    register = " ".join(services["register"]["command"])
    assert register.count("/keys/node-") == 3 and "flwr supernode register" in register
    assert services["register"]["depends_on"]["superlink"]["condition"] == "service_healthy"


def test_dockerfile_pins_and_copies_every_package() -> None:
    text = (ROOT / "Dockerfile").read_text()
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for package in pyproject["tool"]["setuptools"]["packages"]:
        assert re.search(rf"^COPY {package} {package}$", text, re.M), package
    assert "torch==2.14.1" in text and "torchvision==0.29.1" in text
    assert "download.pytorch.org/whl/cpu" in text  # CPU wheels for amd64 and arm64
    assert re.search(r"^ARG BASE=python:3.11-slim-bookworm$", text, re.M)
    # a build CA bundle is used in the build stage only: the final stage copies the venv
    final = text.rsplit("FROM ", 1)[1]
    assert "build-ca" not in final and "COPY --from=build /opt/fedhet /opt/fedhet" in final


def _exec_start(unit: str) -> list[str]:
    text = (ROOT / "deploy" / "systemd" / unit).read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("ExecStart="))
    argv = line.removeprefix("ExecStart=").split()
    assert argv[0] == "/opt/fedhet/bin/fedhet"
    return ["fedhet", *argv[1:]]


def test_the_device_units_run_the_warm_node_as_the_loopback_federation_does() -> None:
    """The systemd pair for a Raspberry Pi / Jetson: SuperNode in process isolation and
    the warm executor on its Runtime API (loopback), both with the node's executor
    secret, the commands cli/federation.py builds."""
    node = supernode_command(
        superlink="${SUPERLINK}",
        host="127.0.0.1",
        port=9094,
        ca=Path("/etc/fedhet/ca.crt"),
        key=Path("/etc/fedhet/node.key"),
        node_config={},
        superexec_secret=Path("/etc/fedhet/superexec.secret"),
    )
    node[node.index("--node-config") + 1] = "${NODE_CONFIG}"
    assert _exec_start("fedhet-supernode.service") == node
    assert _exec_start("fedhet-superexec.service") == superexec_command(
        runtime_api="127.0.0.1:9094", secret=Path("/etc/fedhet/superexec.secret")
    )
    executor = (ROOT / "deploy" / "systemd" / "fedhet-superexec.service").read_text()
    assert "BindsTo=fedhet-supernode.service" in executor
