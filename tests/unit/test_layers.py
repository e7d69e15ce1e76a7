"""The package's import graph: layers import downward only, and nothing imports in a
cycle (function-level imports included; imports under ``if TYPE_CHECKING:`` never run
and are left out)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "monstack"

#: The layering docs/design.md draws, bottom first. A module may import modules of its own
#: layer or of a lower one, never of a higher one.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("_env", "_settings", "_errors"),  # facts and settings
    ("_policy", "_stack", "_colorize", "_format", "_snapshot"),  # the stack core
    ("_backend", "_cdata", "_native", "_accel", "_sysmon", "_evalframe", "_walk", "_select"),  # backends
    ("_capture", "_threads", "_origin", "_points", "_propagate", "_install"),  # install, origins, propagation
    ("_startup", "_dump", "_dumpproto", "_dumpsig", "_dumptrust", "_dumpext", "_dumpcli", "_pytest_plugin", "_run", "logging", "_demo", "_bench", "sentry", "otel", "__main__", "__init__", "_boot"),  # faces
)


def _module_name(path: Path, package: Path = PACKAGE) -> str:
    rel = path.relative_to(package).with_suffix("")
    parts = rel.parts
    if parts[-1] == "__init__" and len(parts) > 1:
        parts = parts[:-1]
    return ".".join(parts)


def _top(name: str) -> str:
    """The package-level module a dotted name belongs to (``_bench._report`` -> ``_bench``)."""
    return name.split(".")[0]


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(path: Path, package: Path = PACKAGE) -> set[str]:
    """monstack modules ``path`` imports anywhere (as package-level names)."""
    name = _module_name(path, package)
    package_parts = name.split(".")[:-1] if path.name != "__init__.py" else name.split(".")
    if name == "__init__":
        package_parts = []
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "monstack" or alias.name.startswith("monstack."):
                    rest = alias.name.split(".")[1:]
                    found.add(_top(".".join(rest)) if rest else "__init__")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package_parts[: len(package_parts) - (node.level - 1)] if node.level > 1 else package_parts
                target = base + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "monstack" or node.module.startswith("monstack.")):
                target = node.module.split(".")[1:]
            else:
                target = None
            if target is not None:
                if target:
                    found.add(_top(".".join(target)))
                else:  # from . import a, b (not a name such as __version__)
                    for alias in node.names:
                        if not (alias.name.startswith("__") and alias.name.endswith("__")):
                            found.add(alias.name)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8"), str(path)))
    found.discard(_top(name) if name else "__init__")
    return found


def graph() -> dict[str, set[str]]:
    out: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        mod = _top(_module_name(path))
        out.setdefault(mod, set()).update(imports_of(path))
    return out


def layer_of(mod: str) -> int:
    for i, layer in enumerate(LAYERS):
        if mod in layer:
            return i
    raise AssertionError(f"monstack/{mod}: not in any layer of tests/unit/test_layers.py (add it where it belongs)")


def find_cycle(g: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``g`` as a path (first == last), or [] if none."""
    color: dict[str, int] = {}
    stack: list[str] = []

    def dfs(n: str) -> list[str]:
        color[n] = 1
        stack.append(n)
        for m in sorted(g.get(n, ())):
            if color.get(m) == 1:
                return stack[stack.index(m):] + [m]
            if m not in color:
                found = dfs(m)
                if found:
                    return found
        stack.pop()
        color[n] = 2
        return []

    for n in sorted(g):
        if n not in color:
            found = dfs(n)
            if found:
                return found
    return []


def test_every_module_is_in_a_layer():
    for mod in graph():
        layer_of(mod)


def test_layers_import_downward_only():
    wrong = []
    for mod, deps in sorted(graph().items()):
        for dep in sorted(deps):
            if layer_of(dep) > layer_of(mod):
                wrong.append(f"{mod} (layer {layer_of(mod)}) imports {dep} (layer {layer_of(dep)})")
    assert not wrong, "upward imports:\n" + "\n".join(wrong)


def test_no_import_cycle():
    cycle = find_cycle(graph())
    assert not cycle, "import cycle: " + " -> ".join(cycle)


def test_the_checker_sees_function_level_and_relative_imports(tmp_path):
    """The checks above cannot pass vacuously: the parser finds the kinds of import the
    package uses, skips TYPE_CHECKING blocks, and the cycle finder finds a cycle."""
    sample = PACKAGE / "_capture.py"
    deps = imports_of(sample)
    assert {"_stack", "_backend", "_policy", "_snapshot", "_walk"} <= deps
    assert "_install" not in deps
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) in (["a", "b", "c", "a"],)
    assert find_cycle({"a": {"b"}, "b": set()}) == []
    fake = tmp_path / "monstack"
    fake.mkdir()
    mod = fake / "_x.py"
    mod.write_text(
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n    from ._hidden import T\n"
        "def f():\n    from . import _lazy\n    from ._other import g\n    import monstack._abs\n",
        encoding="utf-8",
    )
    assert imports_of(mod, fake) == {"_lazy", "_other", "_abs"}


@pytest.mark.parametrize("mod", ["_settings", "_errors", "_env"])
def test_bottom_modules_import_nothing_of_monstack(mod):
    assert imports_of(PACKAGE / f"{mod}.py") == set()


def test_import_monstack_works_from_any_module_first(tmp_path):
    """With no cycle, any module can be imported first in a fresh interpreter."""
    import subprocess
    import sys

    mods = sorted(m for m in graph() if m not in ("__init__", "__main__"))
    code = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module('monstack.' + m)\n"
    root = str(PACKAGE.parent)
    env = dict(os.environ, PYTHONPATH=root)
    env.pop("MONSTACK", None)
    for m in mods:
        out = subprocess.run([sys.executable, "-c", code, m], capture_output=True, text=True, env=env, cwd=str(tmp_path))
        assert out.returncode == 0, f"importing monstack.{m} first failed:\n{out.stderr}"


# -- inside the propagation points' package -------------------------------------------------

POINTS = PACKAGE / "_points"


def _points_imports(path: Path) -> set[str]:
    """What a module of ``monstack/_points/`` imports: monstack's modules by package-level
    name, and the package's own modules as ``_points.<name>`` (``_points`` for its base,
    the package's ``__init__``)."""
    found = set()
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and _is_type_checking(node.test):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                found.add(f"_points.{node.module.split('.')[0]}")
            else:
                found.update(f"_points.{alias.name}" if (POINTS / f"{alias.name}.py").exists() else "_points"
                             for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 2:
            found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def test_the_points_base_is_below_the_families_and_nothing_there_imports_the_switch():
    """``_points/__init__`` (the contract, the registry, the shared state) imports no family;
    the families import the base and each other, never ``_propagate`` or anything above it."""
    base = _points_imports(POINTS / "__init__.py")
    assert not [m for m in base if m.startswith("_points.")], base
    families = sorted(p for p in POINTS.glob("*.py") if p.name != "__init__.py")
    assert {p.stem for p in families} >= {"threading", "futures", "asyncio", "multiprocessing", "trio",
                                          "celery", "dask", "rq", "ray", "greenlet"}
    layer = layer_of("_points")
    for path in [POINTS / "__init__.py", *families]:
        deps = _points_imports(path)
        assert "_propagate" not in deps and "_install" not in deps, (path.name, deps)
        upward = [d for d in deps if not d.startswith("_points") and layer_of(d) >= layer and d != "_origin"
                  and d not in ("_capture", "_threads")]
        assert not upward, (path.name, upward)


def test_the_registry_names_families_that_exist():
    from monstack import _points

    for parts in (*_points.REGISTRY.values(), _points.GREENLET_PARTS, _points.REPORT_PARTS):
        for _trigger, where in parts:
            family, _, function = where.rpartition(".")  # (no family: a function of _points itself)
            source = (POINTS / (f"{family}.py" if family else "__init__.py")).read_text(encoding="utf-8")
            assert f"\ndef {function}(" in source, where
