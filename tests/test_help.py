"""``fedhet --help`` and each command's help: whole sentences, no docstring line breaks.

A command's first paragraph is its line in the top-level help; every paragraph of its
help shows as one paragraph (the source's line breaks are not the reader's).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import click
import pytest
import typer.rich_utils
from typer.main import get_command
from typer.testing import CliRunner

from cli.main import PASS_THROUGH, app

ROOT = Path(__file__).resolve().parent.parent
WIDE = 2000
"""Columns of the rendered help: wide enough that no paragraph is wrapped."""
COMMANDS: dict[str, click.Command] = get_command(app).commands  # type: ignore[attr-defined]


def plain(markdown: str) -> str:
    """A help paragraph as the reader sees it: one line, code spans without backticks."""
    return re.sub(r"\s+", " ", markdown.replace("`", "")).strip()


def paragraphs(command: click.Command) -> list[str]:
    return [plain(p) for p in (command.help or "").split("\n\n") if p.strip()]


def lines(text: str) -> list[str]:
    """Rendered help lines without the panels' borders and padding."""
    return [plain(line.strip(" │")) for line in text.splitlines()]


@pytest.fixture
def wide(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(typer.rich_utils, "MAX_WIDTH", WIDE)


def test_every_command_has_a_summary_sentence() -> None:
    assert {"simulate", "federation", "supernode", "superexec", "audit"} <= set(COMMANDS)
    for name, command in COMMANDS.items():
        summary = (paragraphs(command) or [""])[0]
        assert re.fullmatch(r"[A-Z].*[.)]", summary) and summary.endswith("."), (name, summary)


def test_the_top_level_help_shows_each_summary_whole_on_one_line(wide: None) -> None:
    out = CliRunner().invoke(app, ["--help"])
    assert out.exit_code == 0, out.output
    shown = lines(out.output)
    for name, command in COMMANDS.items():
        summary = paragraphs(command)[0]
        assert f"{name} {summary}" in shown, (name, summary, [s for s in shown if name in s])


@pytest.mark.parametrize(
    "name", [n for n, c in COMMANDS.items() if c.context_settings != PASS_THROUGH]
)
def test_a_commands_help_shows_each_paragraph_whole(wide: None, name: str) -> None:
    out = CliRunner().invoke(app, [name, "--help"])
    assert out.exit_code == 0, out.output
    shown = lines(out.output)
    for paragraph in paragraphs(COMMANDS[name]):
        assert paragraph in shown, (name, paragraph)


def test_pass_through_commands_show_their_own_help_then_flowers() -> None:
    """``fedhet supernode --help`` (and superexec): fedhet's text, then Flower's flags."""
    env = {**os.environ, "TERMINAL_WIDTH": str(WIDE), "COLUMNS": str(WIDE)}
    for name, flower in (("supernode", "flower-supernode"), ("superexec", "flower-superexec")):
        done = subprocess.run(
            [str(Path(sys.executable).parent / "fedhet"), name, "--help"],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr[-2000:]
        shown = lines(done.stdout)
        for paragraph in paragraphs(COMMANDS[name]):
            assert paragraph in shown, (name, paragraph)
        assert f"usage: {flower}" in done.stdout
