"""No private key is tracked by git, and the check that says so catches one that is."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

from cli.security import make_certificates, make_node_keys

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


def tracked_private_keys(repo: Path) -> list[str]:
    """Files tracked by git in ``repo`` (as committed or staged) holding a private key."""
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
        if PRIVATE_KEY.search(path.read_bytes()[:1_000_000]):
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
    (repo / "notes.md").write_text("the key is made by `fedhet keys`\n")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, timeout=60)
    (repo / "stand-in.txt").write_text("-----BEGIN OPENSSH PRIVATE KEY-----\nnot one\n")
    subprocess.run(["git", "-C", str(repo), "add", "-A"], check=True, timeout=60)
    assert sorted(tracked_private_keys(repo)) == ["certs/ca.key", "certs/server.key", "keys/node-0"]
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
