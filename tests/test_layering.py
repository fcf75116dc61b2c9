"""Which app may import which: read from the source with ast, no module is imported.

    control           the management API, on top: may import accounts, budgets and inference; no app imports it
    accounts          imports no other app of ours
    budgets           may import accounts, never inference (inference listens to budgets.signals)
    inference.engine  the model runtime: no Django, Channels, Celery, nor any app, nor the rest of
                      inference (so it can run and be benchmarked on its own)
    no circles        no two modules of ours import each other, directly or through others: each
                      file can be read, and tested, after the ones it imports

Every import counts, also those inside functions and under TYPE_CHECKING: a function-local import
is still a dependency, only a later one. Relative imports are resolved against the file's package.
Migrations are left out: Django writes their cross-app dependencies itself.
"""

from __future__ import annotations

import ast
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FRAMEWORKS = ("django", "channels", "celery")


@dataclass(frozen=True)
class Import:
    file: str  # relative to the repository root
    line: int
    statement: str  # as written, e.g. "from ..bus import channel_sender"
    target: str  # the absolute dotted name it reaches, e.g. "inference.bus.channel_sender"

    def __str__(self) -> str:
        # A relative import is shown with what it resolves to; an absolute one says it already.
        shown = f"{self.statement}  (→ {self.target})" if self.statement.startswith("from .") else self.statement
        return f"{self.file}:{self.line} {shown}"


def python_files(root: Path, folder: str) -> Iterator[Path]:
    """The .py files under root/folder, as paths relative to root, migrations left out."""
    for path in sorted((root / folder).rglob("*.py")):
        relative = path.relative_to(root)
        if "migrations" not in relative.parts:
            yield relative


def imports_in(root: Path, file: Path) -> Iterator[Import]:
    tree = ast.parse((root / file).read_text(encoding="utf-8"), filename=str(file))
    for node in ast.walk(tree):  # walk, not tree.body: function-local imports count too
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(str(file), node.lineno, ast.unparse(node), alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = resolve(file, node.module, node.level)
            for alias in node.names:
                # `from pkg import name` may import the submodule pkg.name: check that, not just pkg.
                target = base if alias.name == "*" else f"{base}.{alias.name}" if base else alias.name
                yield Import(str(file), node.lineno, ast.unparse(node), target)


def resolve(file: Path, module: str | None, level: int) -> str:
    """The absolute module of `from <level dots><module> import ...` written in `file` (relative to the root).

    The file's package is its folder (a package's __init__.py included); each dot after the first
    goes one package up, as the import system does.
    """
    if level == 0:
        return module or ""
    package = list(file.with_suffix("").parts[:-1])
    if level - 1 >= len(package):
        raise ValueError(f"{file}: a relative import goes above the top-level package")
    parts = package[: len(package) - (level - 1)]
    return ".".join([*parts, *([module] if module else [])])


def top(target: str) -> str:
    return target.split(".", 1)[0]


def within(target: str, package: str) -> bool:
    return target == package or target.startswith(package + ".")


def offending(folder: str, forbidden: Callable[[str], bool], root: Path = ROOT) -> list[str]:
    """Every import in root/folder whose target `forbidden` refuses, as "file:line statement", once each."""
    found = (str(i) for file in python_files(root, folder) for i in imports_in(root, file) if forbidden(i.target))
    return list(dict.fromkeys(found))  # `from x import a, b` is one line to fix, not two


def assert_none(offenders: list[str], rule: str) -> None:
    assert not offenders, f"{rule}; {len(offenders)} import(s) break it:\n  " + "\n  ".join(offenders)


def test_budgets_imports_nothing_of_inference():
    assert_none(
        offending("budgets", lambda target: top(target) == "inference"),
        "budgets/ must not import inference (send a signal from budgets.signals instead)",
    )


@pytest.mark.parametrize("app", ["accounts", "budgets", "inference"])
def test_no_app_imports_the_management_api(app):
    assert_none(
        offending(app, lambda target: top(target) == "control"),
        f"{app}/ must not import control (the management API sits on top; it calls the apps, never the reverse)",
    )


def test_accounts_imports_no_other_app():
    assert_none(
        offending("accounts", lambda target: top(target) in ("budgets", "inference", "project", "control")),
        "accounts/ must not import budgets, inference or project (it is the bottom app)",
    )


def engine_forbidden(target: str) -> bool:
    name = top(target)
    if name in FRAMEWORKS or name in ("accounts", "budgets", "project", "control"):
        return True
    return name == "inference" and not within(target, "inference.engine")


def test_the_engine_imports_no_framework_and_no_app():
    if not (ROOT / "inference" / "engine").is_dir():
        pytest.skip("inference/engine/ does not exist yet")
    assert_none(
        offending("inference/engine", engine_forbidden),
        "inference/engine/ must not import django, channels, celery, another app, or inference outside inference.engine",
    )


# --- the checker itself ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("file", "module", "level", "expected"),
    [
        ("inference/engine/foo.py", "x", 2, "inference.x"),
        ("inference/engine/foo.py", None, 2, "inference"),
        ("inference/engine/foo.py", "loop", 1, "inference.engine.loop"),
        ("inference/engine/__init__.py", "loop", 1, "inference.engine.loop"),
        ("inference/engine/patches/linears.py", None, 2, "inference.engine"),
        ("budgets/views/config.py", "actions", 2, "budgets.actions"),
        ("budgets/views/config.py", "forms", 0, "forms"),
    ],
)
def test_relative_imports_resolve_against_the_files_package(file, module, level, expected):
    assert resolve(Path(file), module, level) == expected


def test_imports_inside_functions_and_from_parent_packages_are_found(tmp_path):
    engine = tmp_path / "inference" / "engine"
    (engine / "migrations").mkdir(parents=True)
    (engine / "loop.py").write_text(
        "import math\n"
        "from . import stream\n"
        "from .. import metrics\n"
        "def run():\n"
        "    from django.conf import settings\n"
    )
    (engine / "migrations" / "0001_initial.py").write_text("from django.db import migrations\n")
    assert offending("inference/engine", engine_forbidden, root=tmp_path) == [
        "inference/engine/loop.py:3 from .. import metrics  (→ inference.metrics)",
        "inference/engine/loop.py:5 from django.conf import settings",
    ]


APP_FOLDERS = ("accounts", "budgets", "inference", "project")


def module_name(file: Path) -> str:
    name = ".".join(file.with_suffix("").parts)
    return name.removesuffix(".__init__")


def import_graph(root: Path = ROOT, folders: tuple[str, ...] = APP_FOLDERS) -> dict[str, dict[str, Import]]:
    """module → {module it imports: the first import statement that does}, for our own modules.

    `from pkg import name` counts as importing pkg.name when that is a module, else pkg. A module's
    import of its own package (`from . import x` reaching inference/__init__.py) is not an edge:
    the package is run before any of its modules anyway."""
    files = {module_name(file): file for folder in folders for file in python_files(root, folder)}
    graph: dict[str, dict[str, Import]] = {name: {} for name in files}
    for name, file in files.items():
        for found in imports_in(root, file):
            target = found.target
            while target and target not in files:
                target = target.rpartition(".")[0]
            if target and target != name and not name.startswith(target + "."):
                graph[name].setdefault(target, found)
    return graph


def circles(graph: dict[str, dict[str, Import]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(graph[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    group.append(member)
                    if member == node:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return found


def describe(group: list[str], graph: dict[str, dict[str, Import]]) -> str:
    """A circle with the import statements that close it."""
    members = set(group)
    lines = [str(found) for name in group for target, found in graph[name].items() if target in members]
    return " ↔ ".join(group) + "\n    " + "\n    ".join(lines)


def test_no_two_modules_import_each_other():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles (move what both sides need into a lower module):\n" + "\n".join(
        describe(group, graph) for group in found)


def test_a_circle_through_a_function_local_import_is_found(tmp_path):
    web = tmp_path / "inference" / "web"
    web.mkdir(parents=True)
    (web / "frames.py").write_text("from .params import parse\n")
    (web / "params.py").write_text("def parse():\n    from .frames import storable\n")
    (web / "text.py").write_text("import json\n")
    graph = import_graph(tmp_path, ("inference",))
    assert circles(graph) == [["inference.web.frames", "inference.web.params"]]
