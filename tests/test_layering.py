"""Which app may import which: read from the source with ast, no module is imported.

    control           the management API, on top: may import accounts, budgets and inference; no app imports it
    accounts          imports no other app of ours
    budgets           may import accounts, never inference (inference listens to budgets.signals)
    inference.engine  the model runtime: no Django, Channels, Celery, nor any app, nor the rest of
                      inference (so it can run and be benchmarked on its own)

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
