"""docker-compose.yml and Dockerfile, validated offline (no Docker engine here).

``docker-compose config`` (1.29.2, in its own virtualenv ``.venv-compose``, created
by scripts/test.sh) must accept the file, and every container command must be the
one cli/federation.py builds for the loopback federation the e2e tests run.
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest
import tomllib
import yaml

from cli.federation import superexec_command, superlink_command, supernode_command

ROOT = Path(__file__).resolve().parent.parent
COMPOSE = ROOT / ".venv-compose" / "bin" / "docker-compose"


@pytest.fixture(scope="module")
def compose() -> dict:
    assert COMPOSE.exists(), (
        f"{COMPOSE} is missing: scripts/test.sh creates it "
        "(python -m venv .venv-compose && pip install docker-compose==1.29.2)"
    )
    out = subprocess.run(
        [str(COMPOSE), "-f", str(ROOT / "docker-compose.yml"), "config"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr
    return yaml.safe_load(out.stdout)


def test_superlink_command_is_the_loopback_one(compose: dict) -> None:
    want = superlink_command(host="0.0.0.0", port=9092, certs=Path("/certs"))
    assert compose["services"]["superlink"]["command"] == want
    assert "--enable-supernode-auth" in want and "--insecure" not in want
    assert "--disable-runtime-dependency-installation" in want


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
        )
        assert cmd == want and "--isolation" in cmd  # warm: process isolation
        assert parsed["partition-id"] == i and parsed["num-partitions"] == 3
        assert parsed["state-dir"] == "/state"
        seen.append(parsed["profile"])
        assert {v.split(":")[1] for v in svc["volumes"]} >= {"/certs", "/keys"}
        assert "healthcheck" in svc
        assert svc["depends_on"]["register"]["condition"] == "service_completed_successfully"
        # its tasks: the warm executor, with the node's data cache and personal state
        executor = services[f"superexec-{i}"]
        assert executor["command"] == superexec_command(runtime_api=f"{name}:9094")
        assert {v.split(":")[1] for v in executor["volumes"]} >= {
            "/state",
            "/home/fedhet/.cache/fedhet",
        }
        assert executor["depends_on"][name]["condition"] == "service_healthy"
    assert len(set(seen)) == 3


def test_keys_reach_the_containers_through_an_init_step_not_weaker_files(compose: dict) -> None:
    """The host files stay as `fedhet certs/keys` wrote them (0600); the init service
    copies them into volumes owned by the image's user, private keys 0400."""
    services = compose["services"]
    init = services["init"]
    assert init["user"] == "root" and init["restart"] == "no"
    script = " ".join(init["command"])
    assert "chown -R 10001:10001 /certs /keys /results" in script
    assert "chmod 0400 /certs/server.key" in script
    host_sources = [v for v in init["volumes"] if v.split(":")[1].startswith("/src/")]
    assert len(host_sources) == 2 and all(v.endswith(":ro") for v in host_sources)
    for name, svc in services.items():
        if name != "init" and any(
            v.split(":")[1] in ("/certs", "/keys") for v in svc.get("volumes", [])
        ):
            assert all(
                v.endswith(":ro") for v in svc["volumes"] if v.split(":")[1] in ("/certs", "/keys")
            )
    assert (
        services["superlink"]["depends_on"]["init"]["condition"] == "service_completed_successfully"
    )
    # the run's results.json and plot land on the host
    results = [v for v in services["superlink"]["volumes"] if ":/home/fedhet/fedhet-runs" in v]
    assert results and results[0].split(":")[0].endswith("deploy/results")


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
    the warm executor on its Runtime API, the commands cli/federation.py builds."""
    node = supernode_command(
        superlink="${SUPERLINK}",
        host="127.0.0.1",
        port=9094,
        ca=Path("/etc/fedhet/ca.crt"),
        key=Path("/etc/fedhet/node.key"),
        node_config={},
    )
    node[node.index("--node-config") + 1] = "${NODE_CONFIG}"
    assert _exec_start("fedhet-supernode.service") == node
    assert _exec_start("fedhet-superexec.service") == superexec_command(
        runtime_api="127.0.0.1:9094"
    )
    executor = (ROOT / "deploy" / "systemd" / "fedhet-superexec.service").read_text()
    assert "BindsTo=fedhet-supernode.service" in executor
