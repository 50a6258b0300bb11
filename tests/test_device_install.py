"""scripts/device-install.sh: its refusals (fast), and one real dry-run install into a
temporary prefix from an offline wheelhouse (e2e).

The e2e test needs the pinned runtime as wheels without a network. It takes them from
the environment running pytest (the project's .venv, which scripts/setup.sh installs
from the same pins): each distribution the device needs is packed back into a wheel
from the files its RECORD lists (stored, not compressed: the bytes pip installed,
nothing rebuilt). The script then builds a fresh virtualenv from that wheelhouse with
`pip --no-index`, builds fedhet's wheel from this checkout, and the test imports the
ClientApp and the warm executor in the new environment. On x86_64 the pinned torch
2.14.1 is PyPI's CUDA build, so the environment is about 6 GB here (a device gets the
CPU build); the wheelhouse and the environment are deleted at the end.
"""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import json
import os
import platform
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import time
import zipfile
from base64 import urlsafe_b64encode
from pathlib import Path

import pytest
import tomllib
from packaging.requirements import Requirement
from packaging.tags import sys_tags
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "device-install.sh"
REQUIREMENTS = ROOT / "deploy" / "device-requirements.txt"
SUPERLINK = "superlink.example.org:9092"
NODE_CONFIG = 'partition-id=0 num-partitions=20 profile="auto" state-dir="/var/lib/fedhet"'
ARCH = {"arm64": "aarch64", "amd64": "x86_64"}.get(platform.machine().lower(), platform.machine())
OTHER_ARCH = "x86_64" if ARCH == "aarch64" else "aarch64"
CP = f"cp{sys.version_info[0]}{sys.version_info[1]}"
DEAD_PROXY = "http://127.0.0.1:9"  # nothing listens there: any download fails at once
SYS_TAGS = {str(t) for t in sys_tags()}


def device_requirements() -> list[Requirement]:
    lines = REQUIREMENTS.read_text().splitlines()
    return [Requirement(ln) for ln in lines if ln.strip() and not ln.startswith("#")]


def pin(name: str) -> str:
    req = next(r for r in device_requirements() if r.name == name)
    (spec,) = req.specifier
    assert spec.operator == "==", req
    return spec.version


def offline_env(home: Path) -> dict[str, str]:
    """The caller's environment without pip settings, virtualenv or Python paths; pip
    reads no configuration file and every proxy points at a closed port."""
    drop = ("PIP_", "VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(sys.prefix)
    )
    env.update(
        PIP_CONFIG_FILE=os.devnull,
        PIP_INDEX_URL=f"{DEAD_PROXY}/simple",
        HTTP_PROXY=DEAD_PROXY,
        HTTPS_PROXY=DEAD_PROXY,
        http_proxy=DEAD_PROXY,
        https_proxy=DEAD_PROXY,
        NO_PROXY="",
        no_proxy="",
        HOME=str(home),
        XDG_CACHE_HOME=str(home / ".cache"),
        TMPDIR=str(home),
    )
    return env


def run_script(
    args: list[str], home: Path, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(SCRIPT), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=offline_env(home),
        cwd=home,
    )


def make_node_files(work: Path) -> dict[str, Path]:
    """An install root, a HOME, and stand-ins for the CA certificate and node key."""
    files = {"prefix": work / "root", "home": work / "home"}
    for folder in files.values():
        folder.mkdir()
    files["ca"] = work / "ca.crt"
    files["ca"].write_text("-----BEGIN CERTIFICATE-----\nnot a real one\n")
    files["key"] = work / "node-0"
    files["key"].write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot a real one\n")
    files["key"].chmod(0o600)
    files["secret"] = work / "node-0.superexec-secret"
    files["secret"].write_bytes(b"0123456789abcdef" * 4)
    files["secret"].chmod(0o400)
    return files


@pytest.fixture
def node_files(tmp_path: Path) -> dict[str, Path]:
    return make_node_files(tmp_path)


def settings(files: dict[str, Path]) -> list[str]:
    return [
        "--dry-run",
        "--prefix",
        str(files["prefix"]),
        "--superlink",
        SUPERLINK,
        "--node-config",
        NODE_CONFIG,
        "--ca",
        str(files["ca"]),
        "--key",
        str(files["key"]),
        "--superexec-secret",
        str(files["secret"]),
    ]


def fake_python(folder: Path, answer: str) -> Path:
    """An 'interpreter' that answers the script's probe (version, machine, bits)."""
    path = folder / "python-fake"
    path.write_text(f"#!/bin/sh\necho '{answer}'\n")
    path.chmod(0o755)
    return path


def refused(proc: subprocess.CompletedProcess[str], prefix: Path, *words: str) -> None:
    """Exit status 2, a message naming each of ``words``, and nothing written."""
    assert proc.returncode == 2, proc.stdout + proc.stderr
    message = proc.stderr.lower()
    for word in words:
        assert word.lower() in message, (word, proc.stderr)
    assert not any(prefix.iterdir()), list(prefix.rglob("*"))


# ------------------------------------------------------------------ one place for pins


def test_device_requirements_are_pyprojects_pins_without_simulation_and_plots() -> None:
    """deploy/device-requirements.txt (what the script installs) has pyproject's pins,
    less Ray (flwr's [simulation] extra) and matplotlib (plots only), plus the `export`
    extra (the install turns node-config onnx-export on)."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    needed = project["dependencies"] + project["optional-dependencies"]["export"]
    pyproject = {canonicalize_name(r.name): r for r in map(Requirement, needed)}
    device = {canonicalize_name(r.name): r for r in device_requirements()}
    assert set(pyproject) - set(device) == {"matplotlib"}
    assert set(device) <= set(pyproject)
    assert {"onnx", "onnxscript"} <= set(device)
    for name, req in device.items():
        assert req.specifier == pyproject[name].specifier, name
        assert not req.extras and req.marker is None, name
    assert pyproject[canonicalize_name("flwr")].extras == {"simulation"}
    assert pin("torch") == "2.14.1" and pin("torchvision") == "0.29.1" and pin("flwr") == "1.42.0"


def test_the_device_code_imports_no_plotting_or_ray() -> None:
    """What a device runs (ClientApp, `fedhet supernode` / `superexec`) imports neither
    matplotlib nor ray, so the device requirements may leave them out."""
    code = (
        "import sys, cli.main, cli.warm, client_app.app\n"
        "print([m for m in ('matplotlib', 'ray') if m in sys.modules])"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# ------------------------------------------------------------------------ refusals


@pytest.mark.parametrize(
    ("probe", "words"),
    [
        ("3.11 armv7l 32", ["32-bit", "64-bit os"]),
        ("3.11 aarch64 32", ["32-bit", "64-bit os"]),  # 64-bit kernel, 32-bit userland
        ("3.11 armv7l 64", ["32-bit architecture"]),
        ("3.11 riscv64 64", ["riscv64", "aarch64 and x86_64"]),
        ("3.13 aarch64 64", ["python 3.13", "3.10-3.12", "--python"]),
        ("3.9 x86_64 64", ["python 3.9", "3.10-3.12"]),
        ("not a python", ["does not run as a python"]),
    ],
)
def test_it_refuses_an_architecture_or_python_without_wheels(
    node_files: dict[str, Path], probe: str, words: list[str]
) -> None:
    python = fake_python(node_files["home"], probe)
    proc = run_script([*settings(node_files), "--python", str(python)], node_files["home"])
    refused(proc, node_files["prefix"], *words)


def test_a_64_bit_python_3_11_on_aarch64_passes_the_checks(node_files: dict[str, Path]) -> None:
    """The control for the refusals above: the same fake interpreter with a supported
    answer gets past every check and fails only when it cannot make a virtualenv."""
    python = fake_python(node_files["home"], "3.11 aarch64 64")
    proc = run_script([*settings(node_files), "--python", str(python)], node_files["home"])
    assert proc.returncode == 1, proc.stderr
    assert "could not create a virtualenv" in proc.stderr


def fake_wheelhouse(folder: Path, *names: str) -> Path:
    folder.mkdir(exist_ok=True)
    for name in names:
        (folder / name).write_bytes(b"")
    return folder


@pytest.mark.parametrize(
    ("wheels", "words"),
    [
        (
            [
                f"torch-2.14.1-{CP}-{CP}-manylinux_2_28_{OTHER_ARCH}.whl",
                f"torchvision-0.29.1-{CP}-{CP}-manylinux_2_28_{OTHER_ARCH}.whl",
            ],
            [f"{CP}/manylinux_2_28_{OTHER_ARCH}", f"needs {CP} on {ARCH}", "--platform"],
        ),
        (
            [
                f"torch-2.14.1-cp30-cp30-manylinux_2_28_{ARCH}.whl",
                f"torchvision-0.29.1-cp30-cp30-manylinux_2_28_{ARCH}.whl",
            ],
            [f"cp30/manylinux_2_28_{ARCH}", f"needs {CP} on {ARCH}", "--python-version"],
        ),
        (
            [
                f"torch-2.13.0-{CP}-{CP}-manylinux_2_28_{ARCH}.whl",
                f"torchvision-0.29.1-{CP}-{CP}-manylinux_2_28_{ARCH}.whl",
            ],
            ["no torch 2.14.1 wheel"],
        ),
        (
            [f"torch-2.14.1+cpu-{CP}-{CP}-manylinux_2_28_{ARCH}.whl"],
            ["no torchvision 0.29.1 wheel"],
        ),
    ],
)
def test_it_refuses_a_wheelhouse_built_for_another_python_or_machine(
    node_files: dict[str, Path], wheels: list[str], words: list[str]
) -> None:
    house = fake_wheelhouse(node_files["home"] / "wheelhouse", *wheels)
    proc = run_script(
        [*settings(node_files), "--python", sys.executable, "--wheelhouse", str(house)],
        node_files["home"],
    )
    refused(proc, node_files["prefix"], *words)


def test_it_refuses_torch_wheels_for_another_machine(node_files: dict[str, Path]) -> None:
    house = fake_wheelhouse(
        node_files["home"] / "jetpack",
        f"torch-2.8.0-{CP}-{CP}-linux_{OTHER_ARCH}.whl",
        f"torchvision-0.23.0-{CP}-{CP}-linux_{OTHER_ARCH}.whl",
    )
    proc = run_script(
        [*settings(node_files), "--python", sys.executable, "--torch-wheels", str(house)],
        node_files["home"],
    )
    refused(proc, node_files["prefix"], "--torch-wheels", f"needs {CP} on {ARCH}")


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (["--superlink", "superlink.example.org"], ["is not host:port"]),
        (["--node-config", "partition-id=0\nnum-partitions=2"], ["one line"]),
        (["--ca", "/nonexistent/ca.crt"], ["--ca /nonexistent/ca.crt"]),
        (["--user", "Fed Het"], ["not a valid user name"]),
        (["--prefix", "relative/root"], ["absolute path"]),
        (["--bogus", "x"], ["unknown option --bogus"]),
        (["--frobnicate"], ["unknown option --frobnicate"]),  # last, without a value
    ],
)
def test_it_refuses_bad_settings(
    node_files: dict[str, Path], change: list[str], words: list[str]
) -> None:
    proc = run_script(
        [*settings(node_files), *change, "--python", sys.executable], node_files["home"]
    )
    refused(proc, node_files["prefix"], *words)


@pytest.mark.parametrize(
    ("drop", "words"),
    [
        ("--ca", ["pass --ca file"]),
        ("--key", ["pass --key file", "flwr supernode register"]),
        ("--superexec-secret", ["pass --superexec-secret file", "--secrets-only"]),
        ("--node-config", ["--superlink without --node-config"]),
    ],
)
def test_a_first_install_needs_every_setting(
    node_files: dict[str, Path], drop: str, words: list[str]
) -> None:
    args = settings(node_files)
    at = args.index(drop)
    del args[at : at + 2]
    proc = run_script([*args, "--python", sys.executable], node_files["home"])
    refused(proc, node_files["prefix"], *words)


def test_a_real_install_into_another_prefix_is_refused(node_files: dict[str, Path]) -> None:
    """A virtualenv cannot be moved: only a dry run may build one under a prefix."""
    args = [a for a in settings(node_files) if a != "--dry-run"]
    proc = run_script([*args, "--python", sys.executable], node_files["home"])
    refused(proc, node_files["prefix"], "only with --dry-run")


def test_an_unknown_last_flag_is_named_not_asked_for_a_value(node_files: dict[str, Path]) -> None:
    proc = run_script([*settings(node_files), "--frobnicate"], node_files["home"])
    assert proc.returncode == 2
    assert "unknown option --frobnicate" in proc.stderr and "needs a value" not in proc.stderr


def test_a_dry_run_without_prefix_uses_a_new_temporary_folder_and_says_so(
    node_files: dict[str, Path],
) -> None:
    """No --prefix: the dry run makes its own prefix under TMPDIR (never /), says which,
    and gets past every check (it stops only where the fake interpreter cannot make a
    virtualenv); the prefix holds what it wrote and nothing is outside it."""
    args = [a for a in settings(node_files) if a != str(node_files["prefix"]) and a != "--prefix"]
    python = fake_python(node_files["home"], "3.11 aarch64 64")
    proc = run_script([*args, "--python", str(python)], node_files["home"])
    assert proc.returncode == 1 and "could not create a virtualenv" in proc.stderr, proc.stderr
    said = re.search(r"new temporary folder (\S+)", proc.stdout)
    assert said, proc.stdout
    prefix = Path(said.group(1))
    assert prefix.parent == node_files["home"] and prefix.name.startswith("fedhet-dry-run.")
    assert f"prefix {prefix}, dry run" in proc.stdout
    # a failed dry run removes its own folder and says so (it wrote there before failing)
    assert f"removed the dry run's folder {prefix}" in proc.stderr
    assert not prefix.exists()


def test_a_plan_checks_everything_and_changes_nothing(node_files: dict[str, Path]) -> None:
    """--plan: no root, no prefix, no virtualenv, no download; every step printed."""
    args = [a for a in settings(node_files) if a not in (str(node_files["prefix"]), "--prefix")]
    args = [a for a in args if a != "--dry-run"]
    python = fake_python(node_files["home"], "3.11 aarch64 64")
    before = sorted(node_files["home"].rglob("*"))
    proc = run_script([*args, "--plan", "--python", str(python)], node_files["home"])
    assert proc.returncode == 0, proc.stderr
    assert "plan (nothing was downloaded, built, written or changed)" in proc.stdout
    for step in (
        "a virtualenv at /opt/fedhet",
        "torch 2.14.1",
        "/etc/fedhet: node.env",
        "state folder /var/lib/fedhet",
        "systemd units",
    ):
        assert step in proc.stdout, step
    assert sorted(node_files["home"].rglob("*")) == before
    bad = run_script(
        [*args, "--plan", "--python", str(fake_python(node_files["home"], "3.11 armv7l 32"))],
        node_files["home"],
    )
    assert bad.returncode == 2 and "32-bit" in bad.stderr  # the same checks as an install


def test_a_refused_dry_run_without_prefix_leaves_no_folder(node_files: dict[str, Path]) -> None:
    args = [a for a in settings(node_files) if a != str(node_files["prefix"]) and a != "--prefix"]
    python = fake_python(node_files["home"], "3.11 armv7l 32")
    before = set(node_files["home"].iterdir())
    proc = run_script([*args, "--python", str(python)], node_files["home"])
    assert proc.returncode == 2 and "32-bit" in proc.stderr
    assert "new temporary folder" in proc.stdout
    assert set(node_files["home"].iterdir()) == before


def test_a_dry_run_into_the_root_is_refused(node_files: dict[str, Path]) -> None:
    args = settings(node_files)
    args[args.index("--prefix") + 1] = "/"
    proc = run_script([*args, "--python", sys.executable], node_files["home"])
    assert proc.returncode == 2 and "never writes outside a prefix of its own" in proc.stderr


@pytest.mark.parametrize(
    ("node_config", "added"),
    [
        ("partition-id=0 num-partitions=20", 'state-dir="/var/lib/fedhet" onnx-export=true'),
        ('partition-id=0 state-dir="/srv/node" onnx-export=false', None),
        ('partition-id=0 state-dir="/srv/node"', "onnx-export=true"),
    ],
)
def test_the_node_keeps_its_state_on_disk_and_exports_onnx_unless_told_otherwise(
    node_files: dict[str, Path], node_config: str, added: str | None
) -> None:
    """What the install adds to a node config that names no state folder or export (the
    e2e test below reads node.env back)."""
    args = settings(node_files)
    args[args.index("--node-config") + 1] = node_config
    python = fake_python(node_files["home"], "3.11 aarch64 64")
    proc = run_script([*args, "--python", str(python)], node_files["home"])
    assert proc.returncode == 1, proc.stderr  # past every check: the fake cannot make a venv
    if added is None:
        assert "node config: added" not in proc.stdout
    else:
        assert f"node config: added {added} " in proc.stdout


def test_a_relative_state_dir_is_refused(node_files: dict[str, Path]) -> None:
    args = settings(node_files)
    args[args.index("--node-config") + 1] = 'partition-id=0 state-dir="state"'
    proc = run_script([*args, "--python", sys.executable], node_files["home"])
    refused(proc, node_files["prefix"], "not an absolute path")


def test_the_help_example_keeps_state_on_disk_and_uses_one_nodes_bundle() -> None:
    """The --help example is a node whose personal model survives a restart
    (state-dir) and that gets only its own files (the bundle's three)."""
    out = subprocess.run(
        ["bash", str(SCRIPT), "--help"], capture_output=True, text=True, timeout=30
    ).stdout
    example = out[out.index("sudo bash scripts/device-install.sh --superlink") :].split("\n\n")[0]
    assert 'state-dir="/var/lib/fedhet"' in example
    assert (
        "--ca node-0/ca.crt --key node-0/node.key --superexec-secret node-0/superexec.secret"
        in example
    )
    assert "--bundle 0" in out


# -------------------------------------------------------- the e2e dry-run install


def _record_hash(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return "sha256=" + urlsafe_b64encode(digest.digest()).rstrip(b"=").decode()


def repack(dist: md.Distribution, out: Path, prefix: Path = Path(sys.prefix)) -> Path:
    """Pack an installed distribution back into a wheel from the files its RECORD lists
    (bytecode and installer records left out; files pip placed outside site-packages go
    back under ``<name>.data``; console scripts are left to the installer)."""
    files = dist.files or []
    info = next(f.parts[0] for f in files if f.parts[0].endswith(".dist-info"))
    tags = [
        ln.split(":", 1)[1].strip()
        for ln in (dist.read_text("WHEEL") or "").splitlines()
        if ln.startswith("Tag:")
    ]
    fits = [t for t in tags if t in SYS_TAGS]  # the name's tag must fit this interpreter
    assert fits, f"{dist.metadata['Name']}: no tag of {tags} fits this interpreter"
    name = re.sub(r"[-_.]+", "_", dist.metadata["Name"])
    data = f"{name}-{dist.version}.data"
    generated = {ep.name for ep in dist.entry_points if ep.group.endswith("_scripts")}
    site = Path(str(dist.locate_file("")))
    wheel = out / f"{name}-{dist.version}-{fits[0]}.whl"
    record: list[str] = []
    with zipfile.ZipFile(wheel, "w", zipfile.ZIP_STORED) as zf:
        for entry in files:
            rel = entry.as_posix()
            if "__pycache__" in entry.parts or rel.endswith(".pyc"):
                continue
            if entry.parts[0] == info and entry.name in {
                "RECORD",
                "INSTALLER",
                "REQUESTED",
                "direct_url.json",
            }:
                continue
            source = Path(os.path.normpath(site / rel))
            arcname = rel
            if rel.startswith("../"):
                under = source.relative_to(prefix)
                if under.parts[0] == "bin":
                    if under.name in generated:
                        continue
                    arcname = f"{data}/scripts/{under.name}"
                else:
                    arcname = f"{data}/data/{under.as_posix()}"
                head = source.read_bytes()[:2]
                if head == b"#!":  # pip wrote this venv's interpreter into it: undo
                    body = source.read_bytes().split(b"\n", 1)[1]
                    content = b"#!python\n" + body
                    info_z = zipfile.ZipInfo(arcname)
                    info_z.external_attr = (stat.S_IFREG | 0o755) << 16
                    zf.writestr(info_z, content)
                    digest = hashlib.sha256(content).digest()
                    encoded = urlsafe_b64encode(digest).rstrip(b"=").decode()
                    record.append(f"{arcname},sha256={encoded},{len(content)}")
                    continue
            zf.write(source, arcname)
            known = entry.hash.mode + "=" + entry.hash.value if entry.hash else None
            record.append(f"{arcname},{known or _record_hash(source)},{source.stat().st_size}")
        record.append(f"{info}/RECORD,,")
        zf.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return wheel


def runtime_closure() -> list[md.Distribution]:
    """The installed distributions deploy/device-requirements.txt resolves to here
    (extras followed, markers evaluated for this interpreter)."""
    found: dict[str, tuple[md.Distribution, set[str]]] = {}
    todo = list(device_requirements())
    while todo:
        req = todo.pop()
        key = canonicalize_name(req.name)
        try:
            dist = md.distribution(req.name)
        except md.PackageNotFoundError:
            pytest.fail(
                f"{req.name} is not installed in {sys.prefix}: this test packs the device "
                "runtime from the environment that runs pytest (scripts/setup.sh makes it)"
            )
        if not req.specifier.contains(dist.version, prereleases=True):
            pytest.fail(
                f"{sys.prefix} has {req.name} {dist.version}, the device needs {req}: "
                "run scripts/setup.sh to install the pinned packages"
            )
        known = found.get(key)
        extras = set(req.extras) | (known[1] if known else set())
        if known and extras == known[1]:
            continue
        found[key] = (dist, extras)
        for text in dist.requires or []:
            sub = Requirement(text)
            if sub.marker is None or any(
                sub.marker.evaluate({"extra": e}) for e in ["", *sorted(extras)]
            ):
                todo.append(sub)
    return [dist for dist, _ in found.values()]


def _on_host(path: str) -> float | None:
    return os.stat(path).st_mtime if os.path.exists(path) else None


def _has_user(name: str) -> bool:
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


@pytest.mark.e2e
def test_dry_run_builds_a_device_environment_from_an_offline_wheelhouse() -> None:
    if not sys.platform.startswith("linux"):
        pytest.fail("device-install.sh is for Linux devices; run this test on Linux")
    host_files = [
        "/etc/systemd/system/fedhet-supernode.service",
        "/etc/systemd/system/fedhet-superexec.service",
        "/etc/fedhet/node.env",
        "/opt/fedhet/bin/python",
    ]
    before = [_on_host(p) for p in host_files]
    had_user = _has_user("fedhet")
    with tempfile.TemporaryDirectory(prefix="fedhet-device-install-") as tmp:
        work = Path(tmp)
        files = make_node_files(work)
        house = work / "wheelhouse"
        house.mkdir()

        t0 = time.monotonic()
        dists = runtime_closure()
        size = sum(f.size or 0 for d in dists for f in d.files or [])
        free = shutil.disk_usage(work).free
        if free < 2.2 * size:  # the wheelhouse, the environment, pip's unpacking
            pytest.fail(
                f"{work} has {free / 1e9:.1f} GB free; this test writes a wheelhouse and a "
                f"virtualenv of {size / 1e9:.1f} GB each: free space or set TMPDIR"
            )
        wheels = [repack(d, house) for d in dists]
        packed_s = time.monotonic() - t0
        names = {w.name.split("-")[0] for w in wheels}
        assert {"torch", "torchvision", "flwr", "numpy", "pydantic", "typer"} <= names
        assert "ray" not in names and "matplotlib" not in names

        proc = run_script(
            [*settings(files), "--python", sys.executable, "--wheelhouse", str(house)],
            files["home"],
            timeout=1200,
        )
        installed_s = time.monotonic() - t0 - packed_s
        print(
            f"wheelhouse: {len(wheels)} wheels packed in {packed_s:.0f} s; "
            f"device-install.sh --dry-run: {installed_s:.0f} s"
        )
        assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
        out = proc.stdout
        print(out[out.rfind("[device-install] done") :])

        # the environment: its own interpreter, the pinned runtime, the device code
        venv = files["prefix"] / "opt" / "fedhet"
        probe = (
            "import importlib.util, json, sys, torch, torchvision, flwr\n"
            "from flwr.clientapp import ClientApp\n"
            "import cli.warm, client_app.app\n"
            "print(json.dumps({'prefix': sys.prefix, 'torch': torch.__version__,\n"
            "  'torchvision': torchvision.__version__, 'flwr': flwr.__version__,\n"
            "  'torch_file': torch.__file__, 'app_file': client_app.app.__file__,\n"
            "  'client_app': isinstance(client_app.app.app, ClientApp),\n"
            "  'absent': [m for m in ('matplotlib', 'ray')\n"
            "             if importlib.util.find_spec(m) is None]}))"
        )
        env = offline_env(files["home"])
        got = subprocess.run(
            [str(venv / "bin" / "python"), "-c", probe],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=files["home"],
        )
        assert got.returncode == 0, got.stderr
        facts = json.loads(got.stdout.strip().splitlines()[-1])
        assert Path(facts["prefix"]) == venv
        assert facts["torch"].split("+")[0] == pin("torch")
        assert facts["torchvision"].split("+")[0] == pin("torchvision")
        assert facts["flwr"] == pin("flwr")
        assert Path(facts["torch_file"]).is_relative_to(venv)
        assert Path(facts["app_file"]).is_relative_to(venv)  # the wheel, not this checkout
        assert facts["client_app"] is True
        assert facts["absent"] == ["matplotlib", "ray"]
        node = subprocess.run(
            [str(venv / "bin" / "fedhet"), "supernode", "--help"],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            cwd=files["home"],
        )
        assert node.returncode == 0 and "usage: flower-supernode" in node.stdout, node.stderr

        # the node's settings, as systemd (and sh) read node.env
        etc = files["prefix"] / "etc" / "fedhet"
        shell = subprocess.run(
            [
                "bash",
                "-c",
                'set -a; . "$1"; printf "%s\\n%s" "$SUPERLINK" "$NODE_CONFIG"',
                "-",
                str(etc / "node.env"),
            ],
            capture_output=True,
            text=True,
            timeout=30,
        )
        # the install adds the ONNX export (NODE_CONFIG names its state folder already)
        assert shell.stdout.split("\n", 1) == [SUPERLINK, NODE_CONFIG + " onnx-export=true"]
        settings_text = (etc / "node.env").read_text()
        assert (etc / "ca.crt").read_text() == files["ca"].read_text()
        assert (etc / "node.key").read_text() == files["key"].read_text()
        assert stat.S_IMODE((etc / "node.key").stat().st_mode) == 0o400
        assert (etc / "superexec.secret").read_bytes() == files["secret"].read_bytes()
        assert stat.S_IMODE((etc / "superexec.secret").stat().st_mode) == 0o400
        state = files["prefix"] / "var" / "lib" / "fedhet"
        assert stat.S_IMODE(state.stat().st_mode) == 0o750
        assert f"dry run, not running: chown fedhet: {state}" in out
        for unit in ("fedhet-supernode.service", "fedhet-superexec.service"):
            installed = files["prefix"] / "etc" / "systemd" / "system" / unit
            assert installed.read_text() == (ROOT / "deploy" / "systemd" / unit).read_text()

        # a dry run prints what it would change outside the prefix, and changes nothing
        assert "dry run, not running: systemctl enable fedhet-supernode.service" in out
        assert "dry run, not running: chown fedhet:" in out
        if not had_user:
            assert "dry run, not running: useradd --system" in out
        assert [_on_host(p) for p in host_files] == before
        assert _has_user("fedhet") == had_user

        # run again to upgrade: the venv and /etc/fedhet are kept, the given wheel goes in
        # (fedhet's wheel as the first run installed it, packed back from the venv), torch
        # and torchvision from a folder of their own (as NVIDIA's wheels on a Jetson);
        # the service user now an existing account, which gets the state folder
        (fedhet,) = md.distributions(name="fedhet", path=[str(Path(facts["app_file"]).parents[1])])
        wheel = repack(fedhet, work, prefix=venv)
        existing = next(
            u.pw_name
            for u in pwd.getpwall()
            if u.pw_uid != 0 and re.fullmatch(r"[a-z_][a-z0-9_-]*", u.pw_name)
        )
        jetpack = work / "torch-wheels"
        jetpack.mkdir()
        for whl in wheels:
            if whl.name.startswith(("torch-", "torchvision-")):
                (jetpack / whl.name).symlink_to(whl)
        again = run_script(
            [
                "--dry-run",
                "--prefix",
                str(files["prefix"]),
                "--python",
                sys.executable,
                "--wheelhouse",
                str(house),
                "--wheel",
                str(wheel),
                "--torch-wheels",
                str(jetpack),
                "--user",
                existing,
            ],
            files["home"],
            timeout=600,
        )
        assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
        done = again.stdout
        for kept in ("reusing the virtualenv", f"installed {wheel.name}", "kept " + str(etc)):
            assert kept in done, kept
        assert (
            f"installed torch-{pin('torch')}" in done and "the project pins and tests torch" in done
        )
        assert "built fedhet" not in again.stdout
        assert (etc / "node.env").read_text() == settings_text
        assert f"service user {existing} exists" in done and "running: useradd" not in done
        assert f"dry run, not running: chown {existing}: {state}" in done
        assert (
            f"dry run, not running: chown {existing}: {etc}/node.key {etc}/superexec.secret" in done
        )
        dropin = files["prefix"] / "etc/systemd/system/fedhet-superexec.service.d/user.conf"
        assert dropin.read_text() == f"[Service]\nUser={existing}\n"
        print(f"all: {time.monotonic() - t0:.0f} s")


def _device_guides() -> list[tuple[str, str]]:
    """(where, text) of the device guides: docs/devices.md, and docs/deployment.md's
    section "Running a client on a Raspberry Pi / Jetson"."""
    deployment = (ROOT / "docs" / "deployment.md").read_text()
    start = deployment.index("## Running a client on a Raspberry Pi / Jetson")
    end = deployment.index("\n## ", start + 1)
    return [
        ("docs/devices.md", (ROOT / "docs" / "devices.md").read_text()),
        ("docs/deployment.md (devices)", deployment[start:end]),
    ]


def test_the_guides_give_a_device_only_its_own_bundle() -> None:
    """No command in the device guides copies deploy/keys (but one node's bundle),
    deploy/certs or a CA key anywhere; the guides make the bundle and install from it."""
    copy = re.compile(r"^\s*(sudo\s+)?(scp|rsync|cp|install|tar\s+-?c)\b")
    for where, text in _device_guides():
        blocks = re.findall(r"```(?:bash)?\n(.*?)```", text, re.S)
        lines = [ln for block in blocks for ln in block.splitlines()]
        for line in lines:
            if copy.search(line):
                assert "deploy/certs" not in line and "ca.key" not in line, (where, line)
                if "deploy/keys" in line:
                    assert re.search(r"deploy/keys/node-\d+-bundle\.tar\.gz", line), (where, line)
        commands = "\n".join(lines)
        assert "--superexec-secret node-0/superexec.secret" in commands, where
        assert "--ca node-0/ca.crt --key node-0/node.key" in commands, where
    devices = _device_guides()[0][1]
    assert "fedhet keys deploy/keys --bundle 0 --ca deploy/certs/ca.crt" in devices
