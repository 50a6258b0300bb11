"""Every archived row says which code made it and what a rerun at later code found
(``benchmarks.reproduce`` and the tables' code column)."""

from __future__ import annotations

import gzip
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from benchmarks import reproduce, results_page
from benchmarks.reproduce import archived_in, compare
from benchmarks.results_page import Entry, code_cell
from common.report import Run

ROOT = Path(__file__).resolve().parent.parent


def rounds(*accuracies: dict[str, float]) -> list[dict[str, Any]]:
    return [
        {"round": i + 1, "accuracy": sum(a.values()) / len(a), "client-accuracy": a}
        for i, a in enumerate(accuracies)
    ]


def test_compare_counts_equal_rounds_and_names_the_first_difference() -> None:
    old = rounds({"0": 0.5, "1": 0.25}, {"0": 0.75, "1": 0.5}, {"0": 0.8, "1": 0.6})
    assert compare(old, old) == {"same-rounds": 3, "first-difference": None}
    new = rounds({"0": 0.5, "1": 0.25}, {"0": 0.75, "1": 0.5 + 1e-12}, {"0": 0.9, "1": 0.6})
    found = compare(old, new)
    assert found["same-rounds"] == 1
    diff = found["first-difference"]
    assert diff["round"] == 2 and diff["clients"] == 1
    assert diff["max-abs"] == pytest.approx(1e-12)
    assert diff["accuracy"] == [old[1]["accuracy"], new[1]["accuracy"]]
    # a client missing from the rerun is a difference too
    missing = rounds({"0": 0.5})
    assert compare(old[:1], missing)["first-difference"]["clients"] == 1


def _git(root: Path, *args: str) -> None:
    done = subprocess.run(
        ["git", "-C", str(root), "-c", "user.name=t", "-c", "user.email=t@t", *args],
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr


def _head(root: Path) -> str:
    return subprocess.run(
        ["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True
    ).stdout.strip()


def test_the_archiving_commit_is_the_last_content_change_through_renames(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "a").mkdir(parents=True)
    run = repo / "a" / "seed0.json.gz"
    run.write_bytes(b"first")
    _git(repo, "init", "-q")
    _git(repo, "add", ".")
    _git(repo, "commit", "-qm", "add")
    run.write_bytes(b"second run")
    _git(repo, "commit", "-qam", "rerun")
    made = _head(repo)
    (repo / "b").mkdir()
    _git(repo, "mv", "a/seed0.json.gz", "b/seed0.json.gz")
    _git(repo, "commit", "-qm", "move")
    assert _head(repo) != made
    assert archived_in(repo / "b" / "seed0.json.gz", repo) == made
    outside = tmp_path / "plain"
    outside.mkdir()
    (outside / "x.json.gz").write_bytes(b"x")
    assert archived_in(outside / "x.json.gz", outside) is None


def _entry(tmp_path: Path, name: str, seed: int, versions: dict[str, Any]) -> Entry:
    path = tmp_path / "archive" / "scarce" / name / f"seed{seed}.json.gz"
    return Entry(seed, Run(path, {"seed": seed}, [], {}), versions)


def test_the_code_column_says_what_made_a_row_and_what_its_rerun_found(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(results_page, "ARCHIVE", tmp_path / "archive")
    record = {
        "runs": {
            "scarce/old/seed0.json.gz": {
                "archived-in": "a" * 40,
                "check": {
                    "git-commit": "c" * 40,
                    "machine": {"cpu-capability": "AVX512"},
                    "same-rounds": 3,
                    "first-difference": {"round": 4, "clients": 2, "max-abs": 0.0125},
                },
                "check-avx2": {
                    "git-commit": "f" * 40,
                    "machine": {"cpu-capability": "AVX2"},
                    "same-rounds": 5,
                    "first-difference": None,
                },
            },
            "scarce/old/seed1.json.gz": {"archived-in": "a" * 40},
            "scarce/same/seed0.json.gz": {
                "archived-in": "b" * 40,
                "check": {
                    "git-commit": "c" * 40,
                    "machine": {"cpu-capability": "AVX512"},
                    "same-rounds": 5,
                    "first-difference": None,
                },
            },
        }
    }
    monkeypatch.setattr(results_page, "load", lambda name: record)
    old = [_entry(tmp_path, "old", s, {"fedhet": "0.1.0"}) for s in (0, 1)]
    assert code_cell(old) == (
        "`aaaaaaa`; rerun at `ccccccc`: AVX512 from round 4 (2 clients, ≤ 0.013); "
        "at `fffffff`: AVX2 1-5 same"
    )
    assert code_cell([_entry(tmp_path, "same", 0, {})]) == (
        "`bbbbbbb`; rerun at `ccccccc`: AVX512 1-5 same"
    )
    new = {"source": "d" * 64, "git-commit": "e" * 40, "git-dirty": True}
    assert code_cell([_entry(tmp_path, "new", 0, new)]) == "`eeeeeee`+dirty"
    new["machine"] = {"cpu-capability": "AVX512"}
    assert code_cell([_entry(tmp_path, "new", 0, new)]) == "`eeeeeee`+dirty (AVX512)"
    mixed = [_entry(tmp_path, "new", 0, new), _entry(tmp_path, "lost", 1, {})]
    assert code_cell(mixed) == "`eeeeeee`+dirty (AVX512), not recorded; not rerun"
    assert code_cell([_entry(tmp_path, "lost", 0, {})]) == "not recorded; not rerun"


def test_every_archived_run_without_its_code_has_its_archiving_commit() -> None:
    """``reproduced.json`` covers the archive: a run added without ``versions.source``
    (or a moved one) shows up here until ``python -m benchmarks.reproduce
    --provenance-only`` records it."""
    record = json.loads(reproduce.REPRODUCED.read_text())["runs"]
    unrecorded = set()
    for path in results_page.ARCHIVE.glob("*/*/*.json.gz"):
        doc = json.loads(gzip.decompress(path.read_bytes()))
        if path.parts[-3] != "fleet" and not doc.get("versions", {}).get("source"):
            unrecorded.add(str(path.relative_to(results_page.ARCHIVE)))
    assert unrecorded, "the archive has runs from before results recorded their code"
    assert {k for k, v in record.items() if v.get("archived-in")} >= unrecorded
    # and nothing else: a run archived again with its code recorded has no entry left
    assert set(record) == unrecorded, (
        "stale entries: python -m benchmarks.reproduce --provenance-only"
    )
    for info in record.values():
        assert len(info["archived-in"]) == 40
