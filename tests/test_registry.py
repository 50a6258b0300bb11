"""The method registry and what is derived from it: names, the README's lists.

Nothing here counts the methods: every expectation is derived from
:data:`common.methods.BUILTIN`, so adding a method (docs/adding-a-method.md) keeps
these tests true once its files are in place.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from common import methods
from common.config import ConfigError, parse_run_config
from common.methods import BUILTIN, Method, check_name, registry

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"


# --------------------------------------------------------------------------- names
@pytest.mark.parametrize("name", ["fedre", "fed2", "my_method", "x"])
def test_a_method_name_is_one_lower_case_word(name: str) -> None:
    assert check_name(name) == name


@pytest.mark.parametrize("name", ["toy-head", "ToyHead", "2fed", "_fed", "fed.re", "", "fed re"])
def test_a_name_flower_cannot_route_is_refused(name: str) -> None:
    with pytest.raises(ValueError, match="one lower-case word"):
        check_name(name)


def test_built_in_names_are_checked_when_the_registry_is_built() -> None:
    """Built-in methods skip :func:`register`; the registry checks them itself."""
    assert list(registry(BUILTIN)) == [m.name for m in BUILTIN]
    assert all(methods.METHODS[m.name] is m for m in BUILTIN)
    bad = Method("Toy-Head", strategy="strategies.lgfedavg:LGFedAvg", hook="x:y")
    with pytest.raises(ValueError, match="'Toy-Head'.*one lower-case word"):
        registry([*BUILTIN, bad])
    twice = Method(BUILTIN[0].name, strategy="strategies.lgfedavg:LGFedAvg", hook="x:y")
    with pytest.raises(ValueError, match="two built-in methods"):
        registry([*BUILTIN, twice])


# --------------------------------------------------------------------------- README
def _section(text: str, start: str, end: str) -> str:
    """``text`` from ``start`` to the next ``end`` after it."""
    begin = text.index(start)
    return text[begin : text.index(end, begin + len(start))]


def test_the_readme_algorithm_table_has_one_row_per_method() -> None:
    """The table at the top: a row per built-in method, none for anything else."""
    table = _section(README.read_text(encoding="utf-8"), "| `algorithm` |", "\n\n")
    rows = re.findall(r"^\| `([^`]+)` \|", table, re.M)[1:]  # the header names the column
    want = [m.name for m in BUILTIN]
    assert sorted(rows) == sorted(want), (
        f"README's algorithm table: add a row for {sorted(set(want) - set(rows))}, "
        f"remove {sorted(set(rows) - set(want))}"
    )


def test_the_readme_run_config_row_lists_every_method_in_registry_order() -> None:
    section = _section(README.read_text(encoding="utf-8"), "\n## Run-config\n", "\n## ")
    row = re.search(r"^\| `algorithm` \| `[^`]+` \| (.*) \|$", section, re.M)
    assert row, "README's run-config table has no `algorithm` row"
    listed = row.group(1).partition(" (")[0]
    want = ", ".join(f"`{m.name}`" for m in BUILTIN)
    assert listed == want, f"README's `algorithm` row should list: {want}"


def test_the_readme_error_examples_are_what_the_config_says() -> None:
    """Each example line of a bad key is the line ``fedhet`` prints for it."""
    text = README.read_text(encoding="utf-8")
    examples = re.findall(r"^fedhet: run-config key '([^']+)' = (.+?) is invalid: .*$", text, re.M)
    assert any(key == "algorithm" for key, _ in examples)
    for key, value in examples:
        with pytest.raises(ConfigError) as err:
            parse_run_config({key: ast.literal_eval(value)})
        line = f"fedhet: {err.value}"
        assert f"\n{line}\n" in text, f"README's example for {key!r} should read:\n{line}"
