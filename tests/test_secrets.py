"""No private key is tracked by git, and the check that says so catches one that is."""

from __future__ import annotations

import re
import shutil
import stat
import subprocess
import tarfile
from pathlib import Path

import pytest

from cli.security import (
    BUNDLE_FILES,
    SECRET_SUFFIX,
    bundle_node,
    make_certificates,
    make_node_keys,
    make_superexec_secrets,
)

ROOT = Path(__file__).resolve().parent.parent
PRIVATE_KEY = re.compile(
    rb"-----BEGIN ((?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?)-----\r?\n"
    rb"(?:[A-Za-z0-9+/=:,. -]*\r?\n)+"
    rb"-----END \1-----"
)
"""A PEM block holding a private key of any kind: PKCS#8 (``PRIVATE KEY``, ``ENCRYPTED
PRIVATE KEY``), traditional (``EC``/``RSA``/``DSA PRIVATE KEY``, with or without
``Proc-Type`` headers), OpenSSH (``OPENSSH PRIVATE KEY``) and PGP (``PGP PRIVATE KEY
BLOCK``): header, body lines, matching footer (a header alone, as in a test's stand-in
file, is no key)."""


SECRET_NAMES = re.compile(rf"({re.escape(SECRET_SUFFIX)}|-bundle\.tar\.gz)$")
"""What ``fedhet keys`` writes that is secret without being PEM: an executor secret
(64 hex characters) or a device's bundle."""


def tracked_private_keys(repo: Path) -> list[str]:
    """Files tracked by git in ``repo`` (as committed or staged) holding a private key,
    or named as an executor secret or a device bundle."""
    out = subprocess.run(
        ["git", "-C", str(repo), "ls-files", "-z", "--cached"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    found = []
    for name in out.stdout.decode().split("\0"):
        path = repo / name
        if not name or not path.is_file() or path.is_symlink():
            continue
        if SECRET_NAMES.search(name) or PRIVATE_KEY.search(path.read_bytes()[:1_000_000]):
            found.append(name)
    return found


def _git_checkout() -> bool:
    return shutil.which("git") is not None and (ROOT / ".git").exists()


@pytest.mark.skipif(not _git_checkout(), reason="not a git checkout (nothing is tracked)")
def test_no_tracked_file_is_a_private_key() -> None:
    assert tracked_private_keys(ROOT) == [], (
        "private keys are tracked by git; remove them (git rm --cached) and make new ones"
    )


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
def test_the_check_finds_every_key_fedhet_makes(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    repo.mkdir()
    subprocess.run(["git", "init", "-q", str(repo)], check=True, timeout=60)
    make_certificates(repo / "certs", ["superlink"])
    make_node_keys(repo / "keys", 1)
    make_superexec_secrets(repo / "keys", 1)
    bundle_node(repo / "keys", 0, repo / "certs" / "ca.crt", repo / "keys" / "node-0-bundle.tar.gz")
    (repo / "notes.md").write_text("the key is made by `fedhet keys`\n")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, timeout=60)
    (repo / "stand-in.txt").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot one\n")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, timeout=60)
    assert sorted(tracked_private_keys(repo)) == [
        "certs/ca.key",
        "certs/server.key",
        "keys/node-0",
        "keys/node-0-bundle.tar.gz",
        "keys/node-0.superexec-secret",
    ]
    # public halves are no secret
    subprocess.run(
        [
            "git",
            "-C",
            str(repo),
            "rm",
            "-q",
            "--cached",
            "certs/ca.key",
            "certs/server.key",
            "keys/node-0",
            "keys/node-0.superexec-secret",
            "keys/node-0-bundle.tar.gz",
        ],
        check=True,
        timeout=60,
    )
    assert tracked_private_keys(repo) == []


def test_deploy_folders_ignore_what_fedhet_writes_there() -> None:
    """``fedhet certs deploy/certs`` and ``fedhet keys deploy/keys`` write into
    ignored files: a regenerated key never shows up as a change to commit."""
    if not _git_checkout():
        pytest.skip("not a git checkout")
    names = [
        "deploy/certs/ca.key",
        "deploy/certs/server.key",
        "deploy/certs/ca.crt",
        "deploy/keys/node-0",
        "deploy/keys/node-7.pub",
        "deploy/keys/node-0.superexec-secret",
        "deploy/keys/node-0-bundle.tar.gz",
        ".env",
    ]
    out = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", *names],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.stdout.split() == names
    kept = subprocess.run(
        ["git", "-C", str(ROOT), "check-ignore", "--no-index", "deploy/keys/README.md"],
        capture_output=True,
        timeout=60,
    )
    assert kept.returncode == 1  # the folder's README is tracked


def test_fedhet_keys_writes_one_executor_secret_per_node(tmp_path: Path) -> None:
    """Random, distinct, 0400 from the start, replaced by a new run (a 0400 file too);
    --secrets-only adds them beside keys made earlier and keeps those keys."""
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    out = runner.invoke(app, ["keys", str(tmp_path), "--nodes", "3"])
    assert out.exit_code == 0, out.output
    secrets = [tmp_path / f"node-{i}{SECRET_SUFFIX}" for i in range(3)]
    values = [p.read_bytes() for p in secrets]
    assert len(set(values)) == 3
    assert all(re.fullmatch(rb"[0-9a-f]{64}", v) for v in values)
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o400 for p in secrets)
    assert "--superexec-auth-secret-file" in out.output
    key = (tmp_path / "node-0").read_bytes()
    again = runner.invoke(app, ["keys", str(tmp_path), "--nodes", "3", "--secrets-only"])
    assert again.exit_code == 0, again.output
    assert (tmp_path / "node-0").read_bytes() == key  # the keys stay (registered already)
    assert all(p.read_bytes() != v for p, v in zip(secrets, values, strict=True))
    assert all(stat.S_IMODE(p.stat().st_mode) == 0o400 for p in secrets)


def test_a_device_bundle_holds_exactly_its_nodes_files(tmp_path: Path) -> None:
    """`fedhet keys DIR --bundle 1 --ca ca.crt`: the CA certificate, node 1's private key
    and node 1's executor secret, nothing of another node, no CA key; the archive 0600."""
    from typer.testing import CliRunner

    from cli.main import app

    runner = CliRunner()
    certs, keys = tmp_path / "certs", tmp_path / "keys"
    make_certificates(certs, ["superlink"])
    assert runner.invoke(app, ["keys", str(keys), "--nodes", "3"]).exit_code == 0
    out = runner.invoke(app, ["keys", str(keys), "--bundle", "1", "--ca", str(certs / "ca.crt")])
    assert out.exit_code == 0, out.output
    archive = keys / "node-1-bundle.tar.gz"
    assert stat.S_IMODE(archive.stat().st_mode) == 0o600
    with tarfile.open(archive) as tar:
        members = {m.name: m for m in tar.getmembers() if m.isfile()}
        assert set(members) == {f"node-1/{name}" for name in BUNDLE_FILES}
        got = {name: tar.extractfile(m).read() for name, m in members.items()}  # type: ignore[union-attr]
        modes = {name: m.mode for name, m in members.items()}
    assert got["node-1/ca.crt"] == (certs / "ca.crt").read_bytes()
    assert got["node-1/node.key"] == (keys / "node-1").read_bytes()
    assert got["node-1/superexec.secret"] == (keys / f"node-1{SECRET_SUFFIX}").read_bytes()
    assert modes == {
        "node-1/ca.crt": 0o444,
        "node-1/node.key": 0o400,
        "node-1/superexec.secret": 0o400,
    }
    # never the CA's private key in place of its certificate; a node without keys is named
    wrong = runner.invoke(app, ["keys", str(keys), "--bundle", "1", "--ca", str(certs / "ca.key")])
    assert wrong.exit_code == 2 and "never ca.key" in wrong.output
    missing = runner.invoke(
        app, ["keys", str(keys), "--bundle", "5", "--ca", str(certs / "ca.crt")]
    )
    assert missing.exit_code == 2 and "node-5 is missing" in missing.output
    no_ca = runner.invoke(app, ["keys", str(keys), "--bundle", "1"])
    assert no_ca.exit_code == 2 and "--bundle needs --ca" in no_ca.output
