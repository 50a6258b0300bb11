"""The results blocks of the README and docs/ are what the archived runs give now.

``python -m benchmarks.tables --readme`` regenerates them; a change to the config
model or the tables code that would empty or alter a table shows up here, not on
the next regeneration.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from benchmarks import tables

ROOT = Path(__file__).resolve().parent.parent


def blocks() -> dict[str, str]:
    found = {}
    for name in tables.BLOCK_FILES:
        text = (ROOT / name).read_text()
        for m in re.finditer(r"<!-- results:([\w-]+) -->\n(.*?)<!-- /results:\1 -->", text, re.S):
            found[m.group(1)] = m.group(2)
    return found


SECTIONS = {
    "summary": tables.summary_section,
    "overhead": tables.overhead_section,
    "fedara-cost": tables.fedara_cost_section,
    "deployment": tables.deployment_section,
    "scale": tables.scale_section,
    "privacy": tables.privacy_section,
    "faults": tables.faults_section,
    "attacks": tables.attack_section,
    "profiles": tables.profiles_section,
}


@pytest.mark.parametrize("tag", sorted(SECTIONS))
def test_results_block_is_what_the_archive_gives(tag: str) -> None:
    body = SECTIONS[tag]()
    if not body:  # no measurement archived (benchmarks/out is not committed): kept as is
        assert tag in blocks()
        return
    assert blocks()[tag] == body, (
        f"the {tag} block differs from the archived runs: run python -m benchmarks.tables --readme"
    )


def test_the_summary_shows_every_method_of_both_regimes() -> None:
    body = tables.summary_section()
    rows = [line for line in body.splitlines() if line.startswith("| ") and "---" not in line]
    names = {line.split("|")[1].strip().split(" (")[0] for line in rows}
    for name in ("local", "lgfedavg", "fedre", "fedgh", "fedtgp", "fedkd", "fml"):
        assert name in names


def test_the_fleet_results_are_what_the_fleet_archive_gives() -> None:
    from benchmarks import fleet

    summary = fleet.summarise()
    assert summary["rows"], "no archived fleet run (docs/results/archive/fleet)"
    page = fleet.PAGE.read_text()
    m = fleet.BLOCK.search(page)
    assert m is not None
    shown = page[m.end(1) : m.start(2)]
    assert shown == fleet.block(summary), "run python -m benchmarks.fleet --table"
    readme = fleet.README.read_text()
    m = fleet.SUMMARY_BLOCK.search(readme)
    assert m is not None
    assert readme[m.end(1) : m.start(2)] == fleet.readme_block(summary)
