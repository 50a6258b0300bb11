"""results.json names the code that made it: a hash of the app's sources, the same in
the checkout and in the bundle a SuperLink unpacks, and the launcher's git commit."""

from __future__ import annotations

import gzip
import io
import json
import shutil
import subprocess
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
import tomllib

from common import provenance
from common.provenance import (
    APP_PACKAGES,
    GIT_ENV,
    code_identity,
    describe,
    machine_identity,
    source_hash,
)

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _fresh_identity(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(GIT_ENV, raising=False)
    code_identity.cache_clear()
    yield
    code_identity.cache_clear()


def _copy_app(dest: Path) -> Path:
    for package in APP_PACKAGES:
        shutil.copytree(ROOT / package, dest / package, ignore=shutil.ignore_patterns("*.pyc"))
    return dest


def _git(root: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(root), *args], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_the_app_packages_are_what_the_bundle_carries() -> None:
    doc = tomllib.loads((ROOT / "pyproject.toml").read_text())
    include = doc["tool"]["flwr"]["app"]["fab-include"]
    assert sorted(pattern.removesuffix("/**") for pattern in include) == sorted(APP_PACKAGES)


@pytest.mark.slow  # builds the run bundle with flwr
def test_the_hash_is_the_same_in_the_bundle_flower_unpacks(tmp_path: Path) -> None:
    """What ``flwr run`` ships (Flower's own FAB builder) hashes as the checkout does."""
    from flwr.cli.build import build_fab_from_disk

    zipfile.ZipFile(io.BytesIO(build_fab_from_disk(ROOT))).extractall(tmp_path)
    assert (tmp_path / "server_app" / "results.py").is_file()
    assert source_hash(tmp_path) == source_hash(ROOT)


def test_the_hash_changes_with_a_byte_or_a_name_and_ignores_bytecode(tmp_path: Path) -> None:
    app = _copy_app(tmp_path / "app")
    before = source_hash(app)
    (app / "common" / "__pycache__").mkdir(exist_ok=True)
    (app / "common" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    (app / "common" / "notes.txt").write_text("not code")
    assert source_hash(app) == before
    target = app / "strategies" / "fedre.py"
    target.write_bytes(target.read_bytes() + b"\n")
    changed = source_hash(app)
    assert changed != before
    target.rename(app / "strategies" / "fedre2.py")
    assert source_hash(app) not in (before, changed)


def test_git_identity_of_a_checkout_and_its_dirty_flag(tmp_path: Path) -> None:
    repo = _copy_app(tmp_path / "repo")
    (repo / "README.md").write_text("readme\n")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "c")
    head = _git(repo, "rev-parse", "HEAD")
    assert provenance.git_identity(repo) == {"commit": head, "dirty": False}
    (repo / "README.md").write_text("changed\n")  # not app code
    assert provenance.git_identity(repo) == {"commit": head, "dirty": False}
    (repo / "models" / "new.py").write_text("x = 1\n")  # untracked app code
    assert provenance.git_identity(repo) == {"commit": head, "dirty": True}
    (repo / "models" / "new.py").unlink()
    fedre = repo / "strategies" / "fedre.py"
    fedre.write_text(fedre.read_text() + "\n")
    assert provenance.git_identity(repo) == {"commit": head, "dirty": True}
    # a folder inside a checkout (a bundle unpacked under FLWR_HOME) is not one
    inner = _copy_app(repo / "unpacked")
    assert provenance.git_identity(inner) is None
    assert provenance.git_identity(_copy_app(tmp_path / "plain")) is None


def test_the_launchers_commit_is_taken_only_for_the_same_source(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(provenance, "git_identity", lambda root=None: None)  # as in a bundle
    assert code_identity() == {"source": source_hash(), "git-commit": None, "git-dirty": None}
    claim = {"commit": "c0ffee" * 6 + "c0ff", "dirty": True, "source": source_hash()}
    monkeypatch.setenv(GIT_ENV, json.dumps(claim))
    code_identity.cache_clear()
    assert code_identity() == {
        "source": source_hash(),
        "git-commit": claim["commit"],
        "git-dirty": True,
    }
    monkeypatch.setenv(GIT_ENV, json.dumps({**claim, "source": "other code"}))
    code_identity.cache_clear()
    assert code_identity()["git-commit"] is None
    monkeypatch.setenv(GIT_ENV, "not json")
    code_identity.cache_clear()
    assert code_identity()["git-commit"] is None


def test_the_launcher_passes_this_checkouts_commit_to_the_superlink(tmp_path: Path) -> None:
    from cli.launch import flower_env

    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout: the launcher has no commit to pass")
    before = _git(ROOT, "rev-parse", "HEAD")
    env = flower_env(tmp_path)
    claim = json.loads(env[GIT_ENV])
    assert claim["commit"] in (before, _git(ROOT, "rev-parse", "HEAD"))  # a commit meanwhile
    assert claim["source"] == source_hash()
    assert isinstance(claim["dirty"], bool)


def test_results_record_the_code_and_old_rows_read_as_unrecorded(tmp_path: Path) -> None:
    from server_app.results import versions

    recorded = versions()
    assert {"fedhet", "flwr", "torch", "source", "git-commit", "git-dirty"} <= set(recorded)
    assert recorded["source"] == source_hash()
    assert recorded["machine"] == machine_identity()
    here = source_hash()
    line = describe(recorded, here, machine_identity())
    assert "this tree's code" in line and line.endswith(": this machine's kernels")
    old = tmp_path / "seed0.json.gz"  # an archived row from before: no source
    old.write_bytes(gzip.compress(json.dumps({"versions": {"fedhet": "0.1.0"}}).encode()))
    assert provenance.recorded(old) == {"fedhet": "0.1.0"}
    assert describe(provenance.recorded(old), here).startswith("code not recorded")
    other = tmp_path / "results.json"
    other.write_text(json.dumps({"versions": {**recorded, "source": "0" * 64}}))
    other_kernels = {**machine_identity(), "cpu-capability": "OTHER"}
    line = describe(provenance.recorded(other), here, other_kernels)
    assert "other code than this tree's" in line and line.endswith(
        "other kernels than this machine's"
    )
    assert provenance.main([str(old), str(other)]) == 0


def test_the_archive_keeps_the_code_and_takes_rows_without_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``benchmarks.tables`` archives runs with their ``versions`` (whatever it holds)."""
    from benchmarks import results_page
    from benchmarks.suites import ROUNDS

    out, archive = tmp_path / "out", tmp_path / "archive"
    monkeypatch.setattr(results_page, "OUT", out)
    monkeypatch.setattr(results_page, "ARCHIVE", archive)
    new = {"fedhet": "0.1.0", **code_identity()}
    for seed, versions in ((0, new), (1, {"fedhet": "0.1.0"}), (2, None)):
        run = out / "scarce" / "lgfedavg" / f"seed{seed}"
        run.mkdir(parents=True)
        doc = {"config": {"seed": seed}, "rounds": [{"round": r} for r in range(ROUNDS)]}
        doc["summary"] = {"wall-time-s": 1.0}
        if versions is not None:
            doc["versions"] = versions
        (run / "results.json").write_text(json.dumps(doc))
    assert results_page.archive() == 3
    kept = {p.name: provenance.recorded(p) for p in (archive / "scarce" / "lgfedavg").iterdir()}
    assert kept == {"seed0.json.gz": new, "seed1.json.gz": {"fedhet": "0.1.0"}, "seed2.json.gz": {}}
    here = source_hash()
    assert "this tree's code" in describe(kept["seed0.json.gz"], here)
    assert describe(kept["seed2.json.gz"], here).startswith("code not recorded")


def test_the_machine_names_the_kernels_torch_dispatches_and_their_overrides(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Numbers move with the CPU kernels (tests/test_reference.py shows it); the identity
    says which ran, and that an override of them was set."""
    import torch

    machine_identity.cache_clear()
    monkeypatch.delenv("ATEN_CPU_CAPABILITY", raising=False)
    plain = machine_identity()
    assert plain["cpu-capability"] == torch.backends.cpu.get_cpu_capability()
    assert plain["torch"] == torch.__version__ and plain["arch"] and plain["cpu"]
    assert "kernel-env" not in plain
    machine_identity.cache_clear()
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert machine_identity()["kernel-env"] == {"ATEN_CPU_CAPABILITY": "default"}
    machine_identity.cache_clear()
