"""Tracking policy: what is tracked by default, include/exclude rules, caching."""

from __future__ import annotations

import json
import os
import types

import pytest

import monstack
from monstack._policy import Policy, library_dirs


def code_at(filename: str) -> types.CodeType:
    return compile("x = 1", filename, "exec")


def test_default_tracks_user_code_not_stdlib_site_packages_or_monstack():
    p = Policy()
    assert p.is_tracked(test_default_tracks_user_code_not_stdlib_site_packages_or_monstack.__code__)
    assert not p.is_tracked(json.dumps.__code__)
    assert not p.is_tracked(pytest.raises.__code__)  # site-packages (or the venv's)
    assert not p.is_tracked(monstack.install.__code__)
    assert not p.is_tracked(code_at("<frozen importlib._bootstrap>"))
    assert p.is_tracked(code_at("<string>"))  # exec'd user code


def test_all_tracks_the_standard_library_but_never_monstack():
    p = Policy("all")
    assert p.is_tracked(json.dumps.__code__)
    assert not p.is_tracked(monstack.install.__code__)


def test_include_and_exclude_longest_rule_wins(tmp_path):
    pkg = tmp_path / "proj"
    (pkg / "vendor").mkdir(parents=True)
    app = code_at(str(pkg / "app.py"))
    vendored = code_at(str(pkg / "vendor" / "lib.py"))
    p = Policy(exclude=[str(pkg / "vendor")])
    assert p.is_tracked(app) and not p.is_tracked(vendored)
    p = Policy(exclude=[str(pkg)], include=[str(pkg / "vendor")])
    assert not p.is_tracked(app) and p.is_tracked(vendored)


def test_module_rules_match_module_and_submodules():
    p = Policy(exclude=["fw"], include=["fw.user_hooks"])
    assert not p.is_tracked(code_at("/x/fw/ops.py"), "fw.ops")
    assert not Policy(exclude=["fw"]).is_tracked(code_at("/x/fw/__init__.py"), "fw")
    assert p.is_tracked(code_at("/x/fw/user_hooks.py"), "fw.user_hooks")
    assert Policy(exclude=["fw"]).is_tracked(code_at("/x/fwx.py"), "fwx")  # not a prefix match


def test_stdlib_can_be_included_by_module_name():
    p = Policy(include=["json"])
    assert p.is_tracked(json.dumps.__code__, "json")


def test_decision_is_cached_per_file():
    p = Policy()
    c = code_at("/somewhere/user_mod.py")
    assert p.is_tracked(c)
    assert p.tracked_files() == {"/somewhere/user_mod.py": True}
    assert "/somewhere/user_mod.py" in p.tracked_set()


@pytest.mark.parametrize("bad", [[""], [None], [3]])
def test_bad_rules_raise(bad):
    with pytest.raises(ValueError, match="non-empty"):
        Policy(include=bad)


def test_unknown_track_raises_with_choices():
    with pytest.raises(ValueError, match="'user', 'all'"):
        Policy("some")


def test_library_dirs_include_the_stdlib():
    assert any(os.path.dirname(json.__file__).startswith(d.rstrip(os.sep)) for d in library_dirs())


def _same_decisions(a: list, b: list) -> bool:
    """Every directory of each list is one of, or inside one of, the other's: a path is
    a library path for both or for neither. (Debian's patched sysconfig uses its
    ``posix_local`` scheme outside a venv: its site-packages come from site.py there, and
    the computed ``lib/python3.X/site-packages`` is inside the stdlib directory.)"""
    return all(any(d.startswith(e) for e in b) for d in a) and all(any(e.startswith(d) for d in a) for e in b)


def test_library_dirs_agree_with_sysconfig():
    """library_dirs() computes sysconfig's directories without importing sysconfig."""
    from monstack import _policy

    assert _same_decisions(library_dirs(), _policy._library_dirs_sysconfig())


def test_library_dirs_agree_with_sysconfig_in_the_base_interpreter():
    """... also outside a venv (the base interpreter: prefix == base_prefix)."""
    import subprocess
    import sys

    base = getattr(sys, "_base_executable", None)
    if sys.prefix == sys.base_prefix or not base or not os.path.exists(base):
        pytest.skip("not running in a venv: this interpreter is the base one (checked above)")
    root = os.path.dirname(os.path.dirname(monstack.__file__))
    code = ("from monstack import _policy as p; a, b = p.library_dirs(), p._library_dirs_sysconfig(); "
            "print(all(any(d.startswith(e) for e in b) for d in a) and all(any(e.startswith(d) for d in a) for e in b), a, b)")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    env["PYTHONPATH"] = root
    out = subprocess.run([base, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("True "), out.stdout
