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

from cli.federation import superlink_command, supernode_command

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
    nodes = {k: v for k, v in compose["services"].items() if k.startswith("supernode-")}
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
        assert cmd == want
        assert parsed["partition-id"] == i and parsed["num-partitions"] == 3
        assert parsed["state-dir"] == "/state"
        seen.append(parsed["profile"])
        mounts = {v.split(":")[1] for v in svc["volumes"]}
        assert {"/certs", "/keys", "/state"} <= mounts
        assert "healthcheck" in svc
        assert svc["depends_on"]["register"]["condition"] == "service_completed_successfully"
    assert len(set(seen)) == 3


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
