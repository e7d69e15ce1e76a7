"""monstack._env: the facts it computes without ``sysconfig`` or ``platform`` (both cost
start-up time, and sysconfig imports threading) agree with what those modules say."""

from __future__ import annotations

import ast
import platform
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

from monstack import _env


def test_machine_is_platform_machine():
    machine = platform.machine().lower()
    assert _env.MACHINE == {"amd64": "x86_64", "arm64": "aarch64"}.get(machine, machine)


def test_free_threaded_is_py_gil_disabled():
    assert _env.FREE_THREADED == bool(sysconfig.get_config_var("Py_GIL_DISABLED"))


def test_config_var_is_sysconfigs():
    for name in ("Py_GIL_DISABLED", "Py_DEBUG", "LDLIBRARY", "SOABI", "Py_TAIL_CALL_INTERP",
                 "_Py_TAIL_CALL_INTERP", "Py_ENABLE_SHARED", "WITH_PYMALLOC", "no such variable"):
        assert _env.config_var(name) == sysconfig.get_config_var(name), name


def test_config_vars_read_from_the_text_agree_with_the_module():
    # the build's _sysconfigdata source is read as text (importing it costs ~2.5M
    # instructions at start-up); a value the text cannot give for sure is _UNREAD, and
    # config_var imports the module for it
    module = (f"_sysconfigdata_{getattr(sys, 'abiflags', '')}_{sys.platform}_"
              f"{getattr(sys.implementation, '_multiarch', '')}")
    try:
        data = __import__(module).build_time_vars
    except ImportError:
        pytest.skip(f"no {module} here")
    text = _env._sysconfigdata_source(module)
    read = 0
    for name in [*data, "no such variable"]:
        got = _env._config_var_from_text(text, name)
        if got is not _env._UNREAD:
            assert got == data.get(name), name
            read += 1
    assert read > len(data) * 0.9
    for name in ("Py_GIL_DISABLED", "Py_TAIL_CALL_INTERP", "_Py_TAIL_CALL_INTERP", "no such variable"):
        assert _env._config_var_from_text(text, name) is not _env._UNREAD, name
    assert _env.config_vars("Py_DEBUG", "no such variable") == [sysconfig.get_config_var("Py_DEBUG"), None]


def test_tail_call_interp_is_read_when_asked_and_agrees_with_sysconfig():
    expected = bool(sysconfig.get_config_var("Py_TAIL_CALL_INTERP") or sysconfig.get_config_var("_Py_TAIL_CALL_INTERP"))
    assert _env.TAIL_CALL_INTERP == expected
    assert "TAIL_CALL_INTERP" in vars(_env)  # computed once, then a plain attribute




# -- version facts live in _env -------------------------------------------------------------

REPO = Path(__file__).resolve().parents[2]

#: Modules whose source also runs alone in another interpreter, where ``monstack._env``
#: cannot be imported: they name their own few version facts, in module-level constants
#: (``READS_NON_ASCII = sys.version_info >= (3, 15)``), and compare nowhere else.
SELF_CONTAINED = ("monstack/_dumpext.py", "monstack/_dumpproto.py")
#: (file, function) that read the running version without testing it for a behaviour.
ALLOWED = {
    ("monstack/_accel.py", "_verify_layout"): "the ABI self-check: the blob's PY_VERSION_HEX against this one",
    ("monstack/_native.py", "_verdict_key"): "the identity of the interpreter a verdict is valid for",
}
_VERSION_NAMES = {"version_info", "hexversion", "PYVERSION"}


def _is_version_literal(node: ast.AST) -> bool:
    """``(3, 13)`` or ``(3, 11, 4)``: a tuple a version is compared with."""
    return (isinstance(node, ast.Tuple) and 2 <= len(node.elts) <= 3
            and all(isinstance(e, ast.Constant) and type(e.value) is int for e in node.elts)
            and node.elts[0].value == 3)


def _compares_with_a_version(node: ast.Compare) -> bool:
    """``v < (3, 14)``, ``(3, 11) == v``, ``v in ((3, 12), (3, 13))`` (not ``n in (3, 4)``)."""
    left = node.left
    for op, right in zip(node.ops, node.comparators):
        if isinstance(op, (ast.In, ast.NotIn)):
            if isinstance(right, (ast.Tuple, ast.List, ast.Set)) and any(map(_is_version_literal, right.elts)):
                return True
        elif _is_version_literal(left) or _is_version_literal(right):
            return True
        left = right
    return False


def version_tests(source: str, rel: str) -> list[str]:
    """``"file:line: text"`` of every place in ``source`` that reads the running version
    (``sys.version_info``, ``sys.hexversion``, ``_env.PYVERSION``) or compares anything with
    a version literal, outside what this module allows."""
    tree = ast.parse(source)
    found: list[str] = []

    def offends(node: ast.AST) -> bool:
        for sub in ast.walk(node):
            if isinstance(sub, ast.Attribute) and sub.attr in _VERSION_NAMES:
                return True
            if isinstance(sub, ast.Name) and sub.id in _VERSION_NAMES:
                return True
            if isinstance(sub, ast.Compare) and _compares_with_a_version(sub):
                return True
        return False

    def visit(node: ast.AST, function: str, top: bool) -> None:
        if top and rel in SELF_CONTAINED and isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            if all(isinstance(t, ast.Name) and t.id.isupper() for t in targets):
                return  # the module's own named fact
        if (rel, function) in ALLOWED:
            return
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for child in node.body + node.decorator_list:
                visit(child, node.name if not isinstance(node, ast.ClassDef) else function, False)
            return
        if isinstance(node, ast.stmt):
            # statements holding statements: visit those one by one; the rest as one piece
            inner = [getattr(node, f) for f in ("body", "orelse", "finalbody", "handlers", "cases")
                     if isinstance(getattr(node, f, None), list)]
            if inner:
                for field, value in ast.iter_fields(node):
                    if isinstance(value, list) and value and isinstance(value[0], (ast.stmt, ast.excepthandler, ast.match_case)):
                        for child in value:
                            visit(child, function, top and isinstance(node, ast.If))
                    elif isinstance(value, ast.AST) and offends(value):
                        found.append(f"{rel}:{value.lineno}: {ast.get_source_segment(source, value)}")
                return
        elif isinstance(node, (ast.excepthandler, ast.match_case)):
            for child in node.body:
                visit(child, function, False)
            return
        if offends(node):
            found.append(f"{rel}:{node.lineno}: {ast.get_source_segment(source, node)}")

    for stmt in tree.body:
        visit(stmt, "", True)
    return found


def _product_files():
    for path in sorted((REPO / "monstack").rglob("*.py")):
        yield path
    yield from sorted(REPO.glob("_monstack_*.py"))


def test_no_version_test_outside_env():
    found = []
    for path in _product_files():
        rel = path.relative_to(REPO).as_posix()
        if rel == "monstack/_env.py":
            continue
        found += version_tests(path.read_text(encoding="utf-8"), rel)
    assert not found, "name the fact in monstack/_env.py and read it there:\n" + "\n".join(found)


def test_the_version_test_finder():
    """It finds what it must (a test that cannot fail would hide a comparison)."""
    bad = {
        "if sys.version_info >= (3, 13):\n    pass\n": 1,
        "def f():\n    return _env.PYVERSION[:2] == (3, 11)\n": 1,
        "def f():\n    v = _env.PYVERSION\n    return v\n": 1,  # read, to compare later
        "def f(v):\n    if v < (3, 11, 4):\n        return 1\n": 1,  # an aliased version
        "from sys import hexversion\nX = hexversion > 0x30d0000\n": 1,
        "def f(v):\n    return v in ((3, 12), (3, 13))\n": 1,
        "class C:\n    def m(self):\n        try:\n            pass\n        except E:\n"
        "            return sys.version_info[0]\n": 1,
    }
    for source, n in bad.items():
        assert len(version_tests(source, "monstack/_x.py")) == n, source
    fine = ("def f(theirs):\n    return theirs < SINCE\n", "X = (3, 13)\n", "def f(x):\n    return x == (1, 2)\n",
            "def f(words):\n    return len(words) not in (3, 4)\n")
    for source in fine:
        assert version_tests(source, "monstack/_x.py") == [], source
    # a self-contained module names its facts at module level, and nowhere else
    assert version_tests("X = sys.version_info >= (3, 15)\n", "monstack/_dumpext.py") == []
    assert version_tests("def f():\n    return sys.version_info >= (3, 15)\n", "monstack/_dumpext.py")
    assert version_tests("x = sys.version_info >= (3, 15)\n", "monstack/_dumpext.py")
    assert version_tests("def _verify_layout():\n    return sys.hexversion\n", "monstack/_accel.py") == []


def test_the_version_facts_agree_with_the_interpreter(tmp_path):
    """Each fact in _env that can be observed here, observed."""
    assert _env.VERSION_TAG == "%d.%d" % sys.version_info[:2]
    assert _env.VERSION_TEXT == "%d.%d.%d" % sys.version_info[:3]
    assert _env.FRAME_LOCALS_PROXY == (type(sys._getframe().f_locals).__name__ == "FrameLocalsProxy")
    assert _env.REMOTE_DEBUGGING_SINCE == (3, 14) and _env.remote_debugging_in() == hasattr(sys, "remote_exec")
    assert _env.remote_debugging_in((3, 14)) and not _env.remote_debugging_in((3, 13))
    assert _env.is_this_version(sys.version_info[:2]) and not _env.is_this_version((2, 7))
    assert _env.NATIVE_CALLBACKS_FOR_VERSION == (sys.version_info[:2] in ((3, 12), (3, 13), (3, 14), (3, 15)))
    assert _env.EVALFRAME_FOR_VERSION == (sys.version_info[:2] == (3, 11))
    # what the thread machinery says when a start_new_thread function fails
    import _thread

    seen, done = [], _thread.allocate_lock()
    done.acquire()

    def fails():
        try:
            raise ValueError("x")
        finally:
            done.release()

    previous = sys.unraisablehook
    sys.unraisablehook = lambda args: seen.append((args.err_msg, args.object))
    try:
        _thread.start_new_thread(fails, ())
        done.acquire()
        for _ in range(200):
            if seen:
                break
            time.sleep(0.005)
    finally:
        sys.unraisablehook = previous
    assert seen, "no unraisable exception reported"
    # 3.13+: the function is in the message; before: the default hook prints
    # "<err_msg>: <object>" with the function as the object
    formatted = (seen[0] == (f"Exception ignored in thread started by {fails!r}", None))
    assert formatted == _env.FORMAT_UNRAISABLE, seen
    if not formatted:
        assert seen[0][0] == "Exception ignored in thread started by", seen
    # does `python script.py` set __cached__ in the script's globals
    script = tmp_path / "script.py"
    script.write_text("print('__cached__' in globals())\n")
    out = subprocess.run([sys.executable, "-I", str(script)], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == str(_env.SETS_CACHED), out
