"""docs/adding-a-method.md stays true: its example method runs, and adding it as a
built-in method touches exactly the files the page lists.

The page's code blocks whose first line is ``# <path>`` are the example's files
(``# common/methods.py: add to BUILTIN`` is its registration). In this process they
are loaded as modules, registered and their tests run (fast tier); in a copy of the
tree they are written as files, the method added to ``BUILTIN``, and the project's
registry tests run there against it (``slow``: a pytest of its own).
"""

from __future__ import annotations

import ast
import importlib.util
import inspect
import os
import re
import shutil
import subprocess
import sys
import textwrap
import types
from collections.abc import Iterator
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "adding-a-method.md"
REGISTRATION = "common/methods.py: add to BUILTIN"
NAME = "medhead"


def doc_blocks() -> dict[str, str]:
    """``{first-line label: code}`` of the page's python blocks that start with a label."""
    blocks = re.findall(r"^```python\n# ([^\n]+)\n(.*?)^```", DOC.read_text(), re.M | re.S)
    return {label: code for label, code in blocks}


def example_files() -> dict[str, str]:
    """``{relative path: source}`` of the example's new files."""
    return {label: code for label, code in doc_blocks().items() if label.endswith(".py")}


def registration() -> str:
    """The ``Method(...)`` entry the page adds to ``BUILTIN``."""
    return textwrap.dedent(doc_blocks()[REGISTRATION]).strip().rstrip(",")


def test_the_page_has_the_example_files_and_its_registration() -> None:
    files = example_files()
    assert set(files) == {f"strategies/{NAME}.py", f"client_app/{NAME}.py", f"tests/test_{NAME}.py"}
    assert registration().startswith(f'Method(\n    "{NAME}",')
    for path, code in files.items():
        ast.parse(code, filename=path)


def test_the_example_is_lint_clean(tmp_path: Path) -> None:
    """What a contributor copies passes the project's ruff settings."""
    for path, code in example_files().items():
        (tmp_path / path).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / path).write_text(code)
    # the project's settings; the example's modules are first-party as the project's are
    config = [
        "--config",
        str(ROOT / "pyproject.toml"),
        "--config",
        f"src = {[str(ROOT), str(tmp_path)]}",
    ]
    for cmd in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        done = subprocess.run(
            [sys.executable, "-m", "ruff", *cmd, *config, str(tmp_path)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stdout + done.stderr


# ------------------------------------------------------------- registered in this process
def _load(name: str, code: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__file__ = str(DOC)
    sys.modules[name] = module
    exec(compile(code, f"{DOC}:{name}", "exec"), module.__dict__)
    return module


@pytest.fixture
def medhead(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, types.ModuleType]]:
    """The example's modules under their own names, the method registered, and the
    ClientApp that ``run_inprocess`` uses rebuilt to route it."""
    import client_app.app
    from common import messages, methods

    loaded: dict[str, types.ModuleType] = {}
    try:
        for path, code in example_files().items():
            if not path.startswith("tests/"):
                name = path.removesuffix(".py").replace("/", ".")
                loaded[name] = _load(name, code)
        method = eval(registration(), {"Method": methods.Method, "keys": messages})
        methods.register(method)
        monkeypatch.setattr(client_app.app, "app", client_app.app.make_app())
        yield loaded
    finally:
        if NAME in methods.METHODS and methods.METHODS[NAME] not in methods.BUILTIN:
            methods.unregister(NAME)
        for name in loaded:
            sys.modules.pop(name, None)


def test_the_examples_tests_pass_with_the_method_registered(
    medhead: dict[str, types.ModuleType], tmp_path: Path
) -> None:
    tests = _load(f"tests.test_{NAME}_from_the_doc", example_files()[f"tests/test_{NAME}.py"])
    try:
        ran = []
        for name, test in inspect.getmembers(tests, inspect.isfunction):
            if name.startswith("test_") and test.__module__ == tests.__name__:
                params = inspect.signature(test).parameters
                test(**({"tmp_path": tmp_path / name} if "tmp_path" in params else {}))
                ran.append(name)
        assert len(ran) == 3, ran
    finally:
        sys.modules.pop(tests.__name__, None)


def test_the_examples_strategy_test_fails_for_a_mean(medhead: dict[str, types.ModuleType]) -> None:
    """The page's strategy test can fail: with the mean instead of the median it does."""
    import numpy as np

    strategy = medhead[f"strategies.{NAME}"].MedHead
    original = strategy.aggregate

    def mean(self, server_round, uploads):  # type: ignore[no-untyped-def]
        return {k: np.mean([u.arrays[k] for u in uploads], axis=0) for k in self.global_arrays}

    tests = _load(f"tests.test_{NAME}_from_the_doc", example_files()[f"tests/test_{NAME}.py"])
    try:
        strategy.aggregate = mean
        with pytest.raises(AssertionError):
            tests.test_the_global_head_is_the_coordinate_wise_median()
        strategy.aggregate = original
        strategy.shares_model = False  # quorum one reply: the head changes
        with pytest.raises(AssertionError):
            tests.test_bad_replies_are_refused_and_too_few_keep_the_head()
    finally:
        strategy.aggregate, strategy.shares_model = original, True
        sys.modules.pop(tests.__name__, None)


# ------------------------------------------------------------- built in, in a copy of the tree
REGISTRY_TESTS = [
    "tests/test_strategies.py::test_registry_names_are_the_config_values",
    "tests/test_strategies.py::test_every_strategy_in_the_package_is_registered",
    "tests/test_methods.py::test_strategy_constructors_mirror_their_config_sections",
    "tests/test_inprocess.py::test_every_method_routes_train_and_evaluate_to_its_hook",
    "tests/test_registry.py",
    "tests/test_config_doc.py",
    "tests/test_config.py",
    "tests/test_imports.py::test_every_package_imports_only_the_floors_below_it",
    "tests/test_imports.py::test_no_import_circle_between_project_modules",
    "tests/test_reference.py::test_the_reference_covers_every_method",
    f"tests/test_{NAME}.py",
]
"""The fast tier's tests that derive from the registry, and the example's own."""
NEEDS_REGENERATION = [
    "tests/test_config_doc.py::test_committed_doc_is_what_the_model_renders",
    "tests/test_registry.py::test_the_readme_algorithm_table_has_one_row_per_method",
    "tests/test_registry.py::test_the_readme_run_config_row_lists_every_method_in_registry_order",
    "tests/test_registry.py::test_the_readme_error_examples_are_what_the_config_says",
    "tests/test_reference.py::test_the_reference_covers_every_method",
]
"""What fails until docs/configuration.md is regenerated, README.md updated and the
method's reference numbers added."""


def _copy_tree(dest: Path) -> None:
    """The working tree as git sees it (tracked and untracked files, ignored ones
    left out), or the whole folder minus caches outside a checkout."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        capture_output=True,
    )
    if listed.returncode != 0:
        ignore = shutil.ignore_patterns(".git", ".venv*", ".flwr", "__pycache__", "*_cache", "out")
        shutil.copytree(ROOT, dest, ignore=ignore, dirs_exist_ok=True)
        return
    for rel in listed.stdout.decode().split("\0"):
        source = ROOT / rel
        if rel and source.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)


def _add_builtin(tree: Path) -> None:
    """The page's steps 1-4: its files, its entry at the end of ``BUILTIN``."""
    for path, code in example_files().items():
        (tree / path).write_text(code)
    methods = tree / "common" / "methods.py"
    text = methods.read_text()
    start = text.index("BUILTIN: tuple[Method, ...] = (")
    end = text.index("\n)\n", start)
    entry = "\n".join("    " + line for line in registration().splitlines())
    methods.write_text(text[:end] + "\n" + entry + "," + text[end:])


def _last() -> str:
    from common.methods import BUILTIN

    return BUILTIN[-1].name


def _update_readme(tree: Path) -> None:
    """The page's step 5 for README.md: a table row, the name after the last one in
    the run-config row and in the error example."""
    readme = tree / "README.md"
    text = readme.read_text()
    last = _last()
    text = text.replace(
        "\n| `local` | nothing | nothing |\n",
        f"\n| `local` | nothing | nothing |\n| `{NAME}` | the head | coordinate-wise median |\n",
        1,
    )
    row = rf"(^\| `algorithm` \| `[^`]+` \| [^(]*?`{last}`)"
    text = re.sub(row, rf"\1, `{NAME}`", text, count=1, flags=re.M)
    error = rf"(is invalid: must be one of [^\n]*'{last}')"
    text = re.sub(error, rf"\1, '{NAME}'", text, count=1)
    readme.write_text(text)


def _pytest(tree: Path, tests: list[str]) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_")}
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "", *tests],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )


@pytest.mark.slow
def test_a_built_in_method_takes_the_files_the_page_lists(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    _copy_tree(tree)
    before = _snapshot(tree)
    _add_builtin(tree)
    # without docs/configuration.md and README.md the registry tests say what is missing
    early = _pytest(tree, NEEDS_REGENERATION)
    failed = set(re.findall(r"^FAILED (\S+)", early.stdout, re.M))
    assert failed == set(NEEDS_REGENERATION), early.stdout[-3000:]
    regenerate = subprocess.run(
        [sys.executable, "-m", "common.config_doc"], cwd=tree, capture_output=True, text=True
    )
    assert regenerate.returncode == 0, regenerate.stderr
    add = subprocess.run(
        [sys.executable, "-m", "tests.test_reference", "--add"],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert add.returncode == 0 and f"{NAME}: new" in add.stderr, add.stderr[-2000:]
    _update_readme(tree)
    done = _pytest(tree, REGISTRY_TESTS)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    assert f"`{NAME}`" in (tree / "docs" / "configuration.md").read_text()
    after = _snapshot(tree)
    assert {rel for rel in after if after[rel] != before.get(rel)} == {
        f"strategies/{NAME}.py",
        f"client_app/{NAME}.py",
        f"tests/test_{NAME}.py",
        "common/methods.py",
        "docs/configuration.md",
        "README.md",
        "tests/reference_accuracies.json",
    }


def _snapshot(tree: Path) -> dict[str, bytes]:
    """Every file of ``tree`` (bytecode aside) by relative path: its content."""
    return {
        path.relative_to(tree).as_posix(): path.read_bytes()
        for path in tree.rglob("*")
        if path.is_file() and "__pycache__" not in path.parts
    }


def test_the_copy_steps_find_their_places() -> None:
    """The copy test's edits apply to this tree's README and registry (fast check)."""
    text = (ROOT / "README.md").read_text()
    last = _last()
    assert "\n| `local` | nothing | nothing |\n" in text
    assert re.search(rf"^\| `algorithm` \| `[^`]+` \| [^(]*?`{last}`", text, re.M)
    assert re.search(rf"is invalid: must be one of [^\n]*'{last}'", text)
    assert "BUILTIN: tuple[Method, ...] = (" in (ROOT / "common" / "methods.py").read_text()
    assert importlib.util.find_spec(f"strategies.{NAME}") is None, "the example is not built in"
