"""docs/configuration.md is generated from the run-config model and must stay equal to it;
the README's short run-config table and the links around it must stay true."""

from __future__ import annotations

import difflib
import re
import subprocess
import sys
from pathlib import Path

import pytest
from pydantic import BaseModel

from common import config_doc
from common.config import RunConfig, flatten, known_keys
from common.sections import DataConfig

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "configuration.md"
README = ROOT / "README.md"


def _leaves(model: type[BaseModel], prefix: str = "") -> list[tuple[str, str | None]]:
    """(dotted key, description) of every scalar field, sections walked."""
    out: list[tuple[str, str | None]] = []
    for name, info in model.model_fields.items():
        key = prefix + (info.alias or name.replace("_", "-"))
        annotation = info.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out += _leaves(annotation, key + ".")
        else:
            out.append((key, info.description))
    return out


def test_committed_doc_is_what_the_model_renders() -> None:
    committed = DOC.read_text(encoding="utf-8")
    rendered = config_doc.render()
    diff = "".join(
        list(
            difflib.unified_diff(
                committed.splitlines(keepends=True),
                rendered.splitlines(keepends=True),
                "docs/configuration.md (committed)",
                "render()",
            )
        )[:40]
    )
    assert committed == rendered, (
        "docs/configuration.md is stale: regenerate it with `python -m common.config_doc` "
        f"and commit it\n{diff}"
    )


def test_every_known_key_is_in_the_doc() -> None:
    text = DOC.read_text(encoding="utf-8")
    rows = {m.group(1) for m in re.finditer(r"^\| `([^`]+)` \|", text, re.M)}
    assert set(known_keys()) <= rows, sorted(set(known_keys()) - rows)
    assert rows == {key for key, _ in _leaves(RunConfig)}


def test_every_key_and_section_has_a_description() -> None:
    leaves = _leaves(RunConfig)
    assert [key for key, _ in leaves] == known_keys()
    undescribed = [key for key, text in leaves if not (text or "").strip()]
    assert not undescribed, f"fields without an attribute docstring: {undescribed}"
    for name, info in RunConfig.model_fields.items():
        section = info.annotation
        if isinstance(section, type) and issubclass(section, BaseModel):
            assert (section.__doc__ or "").strip(), f"section {name} has no docstring"


def test_a_changed_docstring_makes_the_doc_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(DataConfig.model_fields["alpha"], "description", "Changed.")
    assert "| Changed. |" in config_doc.render()
    assert config_doc.render() != DOC.read_text(encoding="utf-8")


def test_rows_show_choices_bounds_and_toml_defaults() -> None:
    text = config_doc.render()
    assert '| `data.partition` | one of `dirichlet`, `pathological`, `iid` | `"dirichlet"` |' in (
        text
    )
    assert "| `data.fraction` | number, 0 < x ≤ 1 | `1.0` |" in text
    assert "| `num-server-rounds` | integer, ≥ 1 | `10` |" in text
    assert "| `data.download` | boolean | `false` |" in text
    assert "| `fedara.lambda` | number, ≥ 0 | `2.0` |" in text  # the alias, not `lam`
    assert "`algorithm` | one of `local`, `fedavg`, `lgfedavg`," in text
    heads = [line for line in text.splitlines() if line.startswith("## ")]
    assert heads[:5] == [
        "## Top-level keys",
        "## `data.*`",
        "## `model.*`",
        "## `train.*`",
        "## `privacy.*`",
    ]
    assert config_doc.render() == text  # deterministic


def test_check_mode_fails_on_a_stale_file_and_write_mode_fixes_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    doc = tmp_path / "configuration.md"
    assert config_doc.main(["--check", "--path", str(doc)]) == 1  # missing
    doc.write_text(config_doc.render().replace("`0.1`", "`0.2`"), encoding="utf-8")
    assert config_doc.main(["--check", "--path", str(doc)]) == 1
    err = capsys.readouterr().err
    assert "is stale" in err and "python -m common.config_doc" in err
    assert config_doc.main(["--path", str(doc)]) == 0
    assert config_doc.main(["--check", "--path", str(doc)]) == 0
    assert doc.read_text(encoding="utf-8") == config_doc.render()


def test_the_generator_does_not_import_torch() -> None:
    code = (
        "import sys; from common import config_doc; config_doc.render(); "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr


def _readme_default(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if value == "":
        return '""'
    return str(value)


def test_readme_table_names_known_keys_with_the_models_defaults() -> None:
    text = README.read_text(encoding="utf-8")
    section = text[text.index("\n## Run-config\n") :]
    section = section[: section.index("\n## ", 1)]
    assert "](docs/configuration.md)" in section
    defaults = flatten(RunConfig())
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]+) \|", section, re.M)
    assert len(rows) >= 10
    for key, default in rows:
        assert key in defaults, f"README's run-config table names unknown key {key!r}"
        shown = default.strip().strip("`")
        assert shown == _readme_default(defaults[key]), (
            f"README: {key} default {shown!r}, the model's {defaults[key]!r}"
        )


_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(encoding="utf-8"), flags=re.M | re.S)
    return {config_doc.slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+?)\s*$", text, re.M)}


@pytest.mark.parametrize("source", [README, DOC], ids=lambda p: p.name)
def test_relative_links_and_anchors_resolve(source: Path) -> None:
    text = re.sub(r"^```.*?^```", "", source.read_text(encoding="utf-8"), flags=re.M | re.S)
    broken = []
    for target in _LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue  # http(s), mailto
        file, _, anchor = target.partition("#")
        path = (source.parent / file).resolve() if file else source
        missing = not path.exists()
        if missing or (anchor and path.suffix == ".md" and anchor not in _anchors(path)):
            broken.append(target)
    assert not broken, f"{source.name}: links that do not resolve: {broken}"
