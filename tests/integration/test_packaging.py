"""What a user installs: the wheel holds the package and its data only, and the runtime
dependencies are exactly what the package imports."""

from __future__ import annotations

import ast
import re
import shutil
import sys
import zipfile
from pathlib import Path

import pytest

from test_startup import REPO, _run, venv  # noqa: F401  (venv: a fresh venv with setuptools)

PACKAGE = REPO / "monstack"

#: Every file a wheel may hold, besides its ``*.dist-info/``: the modules of the package
#: and its subpackages (pyproject's ``packages``), the stored machine code and manifests.
ALLOWED = re.compile(
    r"^(monstack-startup\.pth"
    r"|_monstack_pytest\.py"  # the pytest plugin's entry point, outside the package
    r"|_monstack_boot\.py"  # what the .pth line runs, outside the package
    r"|monstack/((_boot|_bench|_points)/)?[A-Za-z_][A-Za-z0-9_]*\.py"
    r"|monstack/py\.typed"
    r"|monstack/_native/[A-Za-z0-9_.-]+\.(bin|json|manifest))$"
)


@pytest.fixture(scope="module")
def wheel(venv, tmp_path_factory) -> Path:  # noqa: F811
    """A wheel built from a copy of the whole work tree (C sources, bench, tools and docs
    included: the build must leave them out, not the copy)."""
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"
    shutil.copytree(
        REPO, src,
        ignore=shutil.ignore_patterns(".git", ".venvs", "__pycache__", "*.egg-info", "build", "dist",
                                      ".pytest_cache", ".hypothesis", "*.so"),
    )
    out = _run(venv["pip"] + ["wheel", "--no-deps", "--no-build-isolation", "-w", str(root / "dist"), str(src)])
    assert out.returncode == 0, out.stdout + out.stderr
    [whl] = (root / "dist").glob("monstack-*.whl")
    return whl


def test_wheel_holds_the_package_and_its_data_only(wheel):
    names = [n for n in zipfile.ZipFile(wheel).namelist() if ".dist-info/" not in n]
    assert [n for n in names if not ALLOWED.match(n)] == []
    for ext in (".c", ".h", ".s", ".sh", ".md", ".toml"):
        assert not [n for n in names if n.endswith(ext)], ext
    # ... and all of the package: every module, every shipped blob and manifest
    shipped = {
        p.relative_to(REPO).as_posix()
        for p in PACKAGE.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts and p.suffix in (".py", ".bin", ".json", ".manifest", ".typed")
    }
    assert shipped and shipped <= set(names), sorted(shipped - set(names))
    assert "monstack-startup.pth" in names
    assert "_monstack_pytest.py" in names and "_monstack_boot.py" in names
    assert {"monstack/_bench/__init__.py", "monstack/_boot/sitecustomize.py"} <= set(names)


def test_the_wheel_declares_its_license(wheel):
    with zipfile.ZipFile(wheel) as zf:
        [metadata] = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        text = zf.read(metadata).decode("utf-8")
        licenses = [n for n in zf.namelist() if ".dist-info/" in n and n.rsplit("/", 1)[-1] == "LICENSE"]
        assert licenses, zf.namelist()
        assert zf.read(licenses[0]).decode("utf-8").startswith("MIT License")
    assert "License-File: LICENSE" in text
    assert "License: MIT" in text or "License-Expression: MIT" in text
    assert "Classifier: License :: OSI Approved :: MIT License" in text


def test_the_allowed_pattern_rejects_development_files():
    for bad in ("native/sysmon.c", "bench/opqueue_cost.py", "tools/cpython_suites.py", "docs/design.md",
                "monstack/_native/shim311.c", "tests/unit/test_layers.py", "monstack/_native/build.py"):
        assert not ALLOWED.match(bad), bad


def _top_level_imports(path: Path) -> tuple[set[str], set[str]]:
    """(required, optional) top-level module names ``path`` imports; optional = inside a
    ``try`` whose handlers catch ImportError (or Exception)."""
    required: set[str] = set()
    optional: set[str] = set()

    def names(node: ast.AST) -> list[str]:
        if isinstance(node, ast.Import):
            return [a.name.split(".")[0] for a in node.names]
        if isinstance(node, ast.ImportFrom) and not node.level and node.module:
            return [node.module.split(".")[0]]
        return []

    def visit(node: ast.AST, guarded: bool) -> None:
        if isinstance(node, ast.Try):
            catches = any(
                h.type is None or any(
                    isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception")
                    for n in ast.walk(h.type)
                )
                for h in node.handlers
            )
            for child in node.body:
                visit(child, guarded or catches)
            for child in node.handlers + node.orelse + node.finalbody:
                visit(child, guarded)
            return
        for name in names(node):
            (optional if guarded else required).add(name)
        for child in ast.iter_child_nodes(node):
            visit(child, guarded)

    visit(ast.parse(path.read_text(encoding="utf-8")), False)
    return required, optional


def test_runtime_dependencies_are_exactly_what_the_package_imports():
    import tomllib

    declared = {
        re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0].lower().replace("-", "_")
        for d in tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["dependencies"]
    }
    third_party: set[str] = set()
    for path in PACKAGE.rglob("*.py"):
        required, _optional = _top_level_imports(path)
        third_party |= {n for n in required if n not in sys.stdlib_module_names and n != "monstack"}
    assert third_party == declared
