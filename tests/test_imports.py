"""Imports run one way: each package imports only the floors below its own (the
launcher ``cli`` above the apps, ``common`` and ``models`` at the bottom), benchmarks
use project code only, and no two project modules import each other, directly or
around a circle.

Every project ``.py`` file is parsed (no module is imported): its imports, at the top
or inside a function, are the edges of a graph over the project's modules. An import
under ``if TYPE_CHECKING:`` never runs, so it is no edge of a circle; the floors count
it all the same (a type named from an upper floor is a dependency on it).
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "benchmarks",
    "cli",
    "client_app",
    "common",
    "data",
    "models",
    "server_app",
    "strategies",
    "tests",
)
BELOW_CLI = ("server_app", "client_app", "strategies", "models", "data", "common")
"""Packages that never import the launcher (and so never ship it to a ClientApp)."""
FLOORS: tuple[tuple[str, ...], ...] = (
    ("benchmarks",),
    ("cli",),
    ("server_app",),
    ("client_app",),
    ("strategies", "data"),
    ("common",),
    ("models",),
)
"""The project's packages, top floor first: the launcher, the ServerApp, the ClientApp,
the strategies and data, the shared config and registry, the models. A module imports
its own package and the floors below, never a floor above nor a neighbour on its own
floor; ``tests`` stand above them all."""
PATH_HACK = re.compile(r"sys\.path\.(insert|append)\b")

Graph = dict[str, dict[str, bool]]
"""module -> {imported project module: whether the import runs (not TYPE_CHECKING)}."""


def project_files() -> dict[str, Path]:
    """Dotted module name -> file, for every ``.py`` file of the project's packages."""
    files = {}
    for package in PACKAGES:
        for path in sorted((ROOT / package).rglob("*.py")):
            if "__pycache__" in path.parts:
                continue
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            files[".".join(parts)] = path
    return files


def _imported(node: ast.Import | ast.ImportFrom, module: str, is_package: bool) -> Iterator[str]:
    """Dotted names an import statement may load: ``import a.b`` -> ``a.b``;
    ``from a import b, c`` -> ``a.b``, ``a.c`` (submodules or names of ``a``)."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: from the module's own package upwards
        package = module.split(".") if is_package else module.split(".")[:-1]
        package = package[: len(package) - (node.level - 1)]
        base = ".".join([*package, *([base] if base else [])])
    for alias in node.names:
        yield f"{base}.{alias.name}" if base else alias.name


def _type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imports(tree: ast.AST, guarded: bool = False) -> Iterator[tuple[ast.AST, bool]]:
    """Every import statement under ``tree`` and whether it runs (False: under
    ``if TYPE_CHECKING:``)."""
    for child in ast.iter_child_nodes(tree):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child, not guarded
        elif isinstance(child, ast.If) and _type_checking(child.test):
            for stmt in child.body:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), True)
            for stmt in child.orelse:
                yield from _imports(ast.Module(body=[stmt], type_ignores=[]), guarded)
        else:
            yield from _imports(child, guarded)


def import_graph(files: dict[str, Path]) -> Graph:
    """Edges from each project module to the project modules it imports (a name
    imported from a module is an edge to that module)."""
    graph: Graph = {}
    for module, path in files.items():
        edges: dict[str, bool] = {}
        tree = ast.parse(path.read_text(), filename=str(path))
        for node, runs in _imports(tree):
            assert isinstance(node, ast.Import | ast.ImportFrom)
            for name in _imported(node, module, path.name == "__init__.py"):
                target = name
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges[target] = edges.get(target, False) or runs
        graph[module] = edges
    return graph


def find_cycle(graph: Graph) -> list[str] | None:
    """A circle of imports that run (``[a, b, ..., a]``), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = 1
        path.append(module)
        for target, runs in sorted(graph.get(module, {}).items()):
            if not runs:
                continue
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if target not in state and (cycle := visit(target)):
                return cycle
        path.pop()
        state[module] = 2
        return None

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return None


def floor(module: str) -> str:
    return module.partition(".")[0]


def imports_of_floor(graph: Graph, floors: tuple[str, ...], banned: str) -> list[str]:
    """``module -> target`` for every module on ``floors`` that imports ``banned``."""
    return [
        f"{module} -> {target}"
        for module, edges in sorted(graph.items())
        if floor(module) in floors
        for target in sorted(edges)
        if floor(target) == banned
    ]


def upward_imports(graph: Graph, floors: tuple[tuple[str, ...], ...]) -> list[str]:
    """``module -> target`` for every import of a package on the same floor or a
    higher one, whether or not it runs (``TYPE_CHECKING`` imports included)."""
    level = {package: i for i, packages in enumerate(floors) for package in packages}
    return [
        f"{module} -> {target}"
        for module, edges in sorted(graph.items())
        if floor(module) in level
        for target in sorted(edges)
        if floor(target) != floor(module) and level.get(floor(target), -1) <= level[floor(module)]
    ]


def path_hacks(files: dict[str, Path]) -> list[str]:
    """``file:line`` of every ``sys.path`` insert or append, in code or in a script
    held in a string (plain text search)."""
    scripts = sorted((ROOT / "scripts").glob("*"))
    found = []
    for path in [*files.values(), *scripts]:
        if not path.is_file():
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PATH_HACK.search(line):
                found.append(f"{path.relative_to(ROOT)}:{number}")
    return found


GRAPH = import_graph(project_files())


def test_the_graph_sees_the_project() -> None:
    """The parser finds what it checks (a broken walk would pass every test below)."""
    assert {"cli.main", "server_app.app", "client_app.app", "benchmarks.tables"} <= set(GRAPH)
    assert GRAPH["server_app.app"], "server_app.app imports project modules"


def test_the_apps_and_their_libraries_never_import_the_launcher() -> None:
    assert imports_of_floor(GRAPH, BELOW_CLI, "cli") == []


def test_every_package_imports_only_the_floors_below_it() -> None:
    """Typing-only imports count: ``common`` naming ``client_app.base.ClientHook``
    under ``TYPE_CHECKING`` is the ground floor depending on an upper one."""
    assert {p for floor_ in FLOORS for p in floor_} == set(PACKAGES) - {"tests"}
    assert upward_imports(GRAPH, FLOORS) == []


def test_a_typing_only_import_is_an_upward_edge() -> None:
    """The walk sees an import under ``if TYPE_CHECKING:`` (not run, still counted)."""
    tree = ast.parse(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from strategies.base import HeteroStrategy\n"
    )
    found = [(node, runs) for node, runs in _imports(tree) if isinstance(node, ast.ImportFrom)]
    assert [(n.module, runs) for n, runs in found] == [("typing", True), ("strategies.base", False)]
    graph: Graph = {"common.x": {"strategies.base": False}, "strategies.base": {}}
    assert upward_imports(graph, FLOORS) == ["common.x -> strategies.base"]


def test_benchmarks_import_no_test_module() -> None:
    assert imports_of_floor(GRAPH, ("benchmarks",), "tests") == []


def test_no_import_circle_between_project_modules() -> None:
    cycle = find_cycle(GRAPH)
    assert cycle is None, "import circle: " + " -> ".join(cycle or [])


def test_nothing_puts_itself_on_sys_path() -> None:
    """Benchmarks run as ``python -m benchmarks.NAME`` from the repository root; child
    scripts get the root as their working directory or ``PYTHONPATH``."""
    assert path_hacks(project_files()) == []


# ------------------------------------------- the warm executor's children and the FAB

APP = ("common", "data", "models", "strategies", "server_app", "client_app")
AS_A_TASK_CHILD = f"""
import runpy, sys
main = runpy.run_module("cli.warm", run_name="__mp_main__", alter_sys=True)  # as a child does
def imported(*tops):
    return sorted(m for m in sys.modules if m.partition(".")[0] in tops)
app = {APP!r}
"""


def _last_line(code: str) -> str:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()[-1]


def test_the_warm_parents_main_module_imports_no_app_package_and_no_torch() -> None:
    """Every task child imports ``cli.warm`` (the fork server's main module) before its
    ClientApp: an app package imported then would be the installed one, not the one in
    the run's FAB; torch and flwr come from the parent's preload."""
    assert _last_line(AS_A_TASK_CHILD + "print(imported(*app, 'torch', 'flwr'))") == "[]"


def test_a_warm_task_child_forgets_the_app_package_it_imported_for_its_patches() -> None:
    """When Flower's ``flwr-clientapp`` starts in a task child, no app module is
    imported (the child imported ``common.flower_runtime`` for its patches)."""
    start_the_task = (
        "from flwr.supernode import cli\n"
        "cli.flwr_clientapp = lambda: print(imported(*app))\n"
        "main['_clientapp_child'](['flwr-clientapp'], False)\n"
    )
    assert _last_line(AS_A_TASK_CHILD + start_the_task) == "[]"
