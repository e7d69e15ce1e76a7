"""``_monstack_boot``: what the ``.pth`` line runs, and its start-up cache.

Each test boots fresh interpreters (``python -S``: no site-packages, so nothing else boots
monstack first) on a private copy of the package, with ``PYTHONPATH`` pointing at it, and
compares what the program sees when the boot imported monstack through the import system
and when it ran the recorded code.
"""

from __future__ import annotations

import json
import marshal
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

#: What a program can see of monstack's modules after start-up, as JSON.
PROBE = r"""
import json, sys, _monstack_boot, monstack
def attrs(m):
    spec = m.__spec__
    return {
        "file": m.__file__, "cached": getattr(m, "__cached__", "-"), "package": m.__package__,
        "loader": [type(m.__loader__).__name__, m.__loader__.name, m.__loader__.path],
        "spec": [spec.name, spec.origin, spec.cached, spec.parent, spec.has_location,
                 spec.submodule_search_locations, spec.loader is m.__loader__,
                 getattr(spec, "_initializing", "-")],
        "path": getattr(m, "__path__", None),
        "dunders": sorted(k for k in vars(m) if k.startswith("__")),
        "in_parent": getattr(sys.modules[m.__name__.rpartition(".")[0] or m.__name__], m.__name__.rpartition(".")[2],
                             None) is m,
    }
names = [n for n in sys.modules if n == "monstack" or n.startswith("monstack.")]
print(json.dumps({
    "route": _monstack_boot.route,
    "order": names,
    "modules": sorted(sys.modules),
    "attrs": {n: attrs(sys.modules[n]) for n in names},
    "backend": monstack.active_backend(),
    "stack": [f.name for f in monstack.snapshot().frames],
    "code_file": monstack._install.install.__code__.co_filename,
    "extra": {k: getattr(sys.modules[k], "MARK", None) for k in names},
    "future": "__future__" in sys.modules,
    "annotations_name": hasattr(monstack._install, "annotations"),
    "hints": monstack._install.install.__annotations__,
    "line": monstack._install.install.__code__.co_firstlineno,
}))
"""


@pytest.fixture
def site(tmp_path) -> Path:
    """A private copy of what a regular install puts in site-packages."""
    root = tmp_path / "site"
    root.mkdir()
    shutil.copy2(REPO / "_monstack_boot.py", root / "_monstack_boot.py")
    shutil.copytree(REPO / "monstack", root / "monstack", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def cache_file(site: Path) -> Path:
    tag = sys.implementation.cache_tag
    opt = f".opt-{sys.flags.optimize}" if sys.flags.optimize else ""
    return site / "__pycache__" / f"_monstack_boot.{tag}{opt}.modules"


def boot(site: Path, *, path: list[Path] | None = None, write: bool = True, flags: list[str] = [],
         prelude: str = "", **env: str) -> dict:
    """A fresh ``python -S`` that runs what the ``.pth`` line runs, then PROBE."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTHON"))}
    e.update(MONSTACK="1", PYTHONPATH=os.pathsep.join(str(p) for p in (path or [site])), **env)
    if not write:
        e["PYTHONDONTWRITEBYTECODE"] = "1"
    code = prelude + "import _monstack_boot; _monstack_boot.main()\n" + PROBE
    out = subprocess.run([sys.executable, "-S", *flags, "-c", code], env=e, cwd=site.parent,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return json.loads(out.stdout)


def same_view(a: dict, b: dict) -> None:
    """What the program sees is the same, whichever route the boot took (but for
    ``__future__``, which only the recorded code does without: the modules' bytecode
    imports it, as the import system's does)."""
    for key in ("order", "modules", "attrs", "backend", "stack", "code_file", "hints", "line"):
        if key == "modules":
            a[key], b[key] = ([m for m in v[key] if m != "__future__"] for v in (a, b))
        assert a[key] == b[key], key


def test_the_first_boot_records_and_the_next_runs_the_record_unchanged(site):
    assert not cache_file(site).exists()
    first = boot(site)
    assert first["route"] == "imports" and cache_file(site).is_file()
    second = boot(site)
    assert second["route"] == "cache"
    same_view(first, second)
    assert second["backend"] == first["backend"] != "none"
    # the package and its start-up modules are all there, each an attribute of the package
    assert {"monstack", "monstack._startup", "monstack._install"} <= set(second["order"])
    assert all(a["in_parent"] for n, a in second["attrs"].items() if n != "monstack")
    assert second["code_file"] == str(site / "monstack" / "_install.py")


def test_the_recorded_code_keeps_the_annotations_and_lines_without_importing_future(site):
    """``from __future__ import annotations`` becomes a compiler flag: the same string
    annotations and line numbers as the source compiled as usual, and no ``__future__``."""
    source = (site / "monstack" / "_install.py").read_text()
    assert "\nfrom __future__ import annotations\n" in source
    usual = compile(source, str(site / "monstack" / "_install.py"), "exec", dont_inherit=True)
    expected_line = next(c.co_firstlineno for c in usual.co_consts if getattr(c, "co_name", "") == "install")
    for view in (boot(site), boot(site)):  # recording, then the recorded code
        assert view["future"] is False
        assert view["line"] == expected_line
        assert view["hints"] and all(isinstance(v, str) for v in view["hints"].values())
    assert view["route"] == "cache"


def compile_all(site: Path) -> None:
    """The ``.pyc`` files an installer writes (pip compiles at install time)."""
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(site)], check=True, capture_output=True,
                   env={k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"})


@pytest.mark.parametrize("how", ["env", "-B"])
def test_without_writing_bytecode_nothing_is_recorded_and_the_bytecode_is_run(site, how):
    """``PYTHONDONTWRITEBYTECODE``/``-B`` (container images): no cache file can be written,
    so nothing is recorded (recording compiles every module) and the start-up modules run
    from the installer's ``.pyc`` files, as the import system would run them."""
    compile_all(site)
    pycs = sorted(p.name for p in site.rglob("*.pyc"))
    imports = boot(site, MONSTACK_STARTUP_CACHE="0")
    view = boot(site, write=False) if how == "env" else boot(site, flags=["-B"])
    assert view["route"] == "bytecode" and not cache_file(site).exists()
    assert sorted(p.name for p in site.rglob("*.pyc")) == pycs  # nothing written
    same_view(imports, view)
    assert view["extra"]["monstack._errors"] is None
    # as the start-up cache leaves them: no __future__ (the modules' imports of it found a
    # stand-in), no `annotations` name, the annotations the same strings
    assert imports["future"] is True and view["future"] is False
    assert view["hints"] == imports["hints"] and all(isinstance(v, str) for v in view["hints"].values())
    assert view["annotations_name"] is False and imports["annotations_name"] is True


def test_the_bytecode_route_runs_an_edited_source_as_edited(site):
    compile_all(site)
    with open(site / "monstack" / "_errors.py", "a") as f:  # its .pyc is now stale
        f.write("\nMARK = 'edited'\n")
    view = boot(site, write=False)
    assert view["route"] == "bytecode" and view["extra"]["monstack._errors"] == "edited"
    assert not cache_file(site).exists()


def test_an_unwritable_install_records_nothing_and_runs_the_bytecode(site):
    compile_all(site)
    modes = {p: p.stat().st_mode for p in [site, *site.rglob("*")] if p.is_dir()}
    # (root may write into a directory without write permission: there, the answer of a
    # read-only file system, EROFS, is made up for the site's directories)
    prelude = "" if os.geteuid() else (
        "import os; _access = os.access; os.access = lambda p, m, **k: "
        f"False if m == os.W_OK and str(p).startswith({str(site)!r}) else _access(p, m, **k)\n")
    for p in modes:
        p.chmod(0o555)
    try:
        view = boot(site, prelude=prelude)
    finally:
        for p, mode in modes.items():
            p.chmod(mode)
    assert view["route"] == "bytecode" and not cache_file(site).exists()


def test_the_bytecode_routes_module_lists_are_what_a_recording_records(site):
    """``_STARTED``/``_FINISHED`` are written out in ``_monstack_boot``: a start-up module
    that imports another module must be listed there too."""
    import _monstack_boot

    boot(site)
    _form, _magic, started, finished, entries = marshal.loads(cache_file(site).read_bytes())
    assert (started, finished) == (_monstack_boot._STARTED, _monstack_boot._FINISHED)
    assert {n for n, e in entries.items() if not e[4]} <= set(_monstack_boot._ON_DEMAND)
    assert {n for n, e in entries.items() if e[0].endswith("__init__.py")} == set(_monstack_boot._PACKAGES)


def test_an_edited_source_is_run_as_edited_and_the_cache_written_again(site):
    boot(site)
    before = cache_file(site).stat().st_mtime_ns
    with open(site / "monstack" / "_errors.py", "a") as f:
        f.write("\nMARK = 'edited'\n")
    edited = boot(site)
    assert edited["route"] == "imports" and edited["extra"]["monstack._errors"] == "edited"
    assert cache_file(site).stat().st_mtime_ns != before
    again = boot(site)
    assert again["route"] == "cache" and again["extra"]["monstack._errors"] == "edited"


@pytest.mark.parametrize("content", [b"", b"not marshal data", marshal.dumps((1, b"", (), (), {}))])
def test_an_unreadable_or_foreign_cache_file_is_ignored_and_replaced(site, content):
    plain = boot(site, write=False)
    cache_file(site).parent.mkdir(exist_ok=True)
    cache_file(site).write_bytes(content)
    view = boot(site)
    assert view["route"] == "imports"
    same_view(plain, view)
    assert boot(site)["route"] == "cache"


def test_recorded_code_that_raises_falls_back_to_the_imports(site):
    """A record whose code raises (it cannot, for unchanged sources; made by hand here):
    the modules it made are taken back and the import system runs the real sources."""
    boot(site)
    data = marshal.loads(cache_file(site).read_bytes())
    entries = data[4]
    rel, mtime, size, _code, *rest = entries["monstack._settings"]
    entries["monstack._settings"] = (rel, mtime, size, compile("raise RuntimeError('x')", rel, "exec"), *rest)
    cache_file(site).write_bytes(marshal.dumps(data[:4] + (entries,)))
    view = boot(site, write=False)
    assert view["route"] == "bytecode"  # (no file can be written: the .pyc route)
    same_view(boot(site), view)


def test_a_package_earlier_on_the_path_wins_over_the_cache(site, tmp_path):
    boot(site)
    other = tmp_path / "other"
    other.mkdir()
    shutil.copytree(site / "monstack", other / "monstack")
    with open(other / "monstack" / "_errors.py", "a") as f:
        f.write("\nMARK = 'other'\n")
    view = boot(site, path=[other, site])
    assert view["route"] == "imports" and view["extra"]["monstack._errors"] == "other"
    assert view["code_file"] == str(other / "monstack" / "_install.py")


def test_a_moved_install_runs_its_own_files(site, tmp_path):
    boot(site)
    moved = tmp_path / "moved"
    shutil.copytree(site, moved, copy_function=shutil.copy2)  # (keeps the modification times)
    view = boot(moved, write=False)
    assert view["route"] == "cache"
    assert view["code_file"] == str(moved / "monstack" / "_install.py")
    assert all(str(moved) in a["file"] for a in view["attrs"].values())


def test_what_the_boot_imports_on_demand_follows_the_settings(site):
    """The backend's modules are recorded but run only when this boot imports them."""
    native = boot(site)
    if "_ctypes" not in native["modules"]:
        pytest.skip("no native code loads here: " + native["backend"])
    walk = boot(site, MONSTACK_BACKEND="walk")
    assert walk["route"] == "cache" and walk["backend"] == "walk" and "_ctypes" not in walk["modules"]
    assert set(walk["order"]) != set(native["order"])
    recorded = cache_file(site).read_bytes()
    cache_file(site).unlink()
    same_view(boot(site, MONSTACK_BACKEND="walk", write=False), walk)
    cache_file(site).write_bytes(recorded)
    same_view(native, boot(site))


def test_modules_first_imported_by_a_later_boot_are_added(site):
    plain = boot(site, MONSTACK_ACCELERATOR="0")
    if plain["backend"] == "walk":
        pytest.skip("no tracking backend here")
    full = boot(site)  # imports more than was recorded: recorded too
    again = boot(site)
    assert again["route"] == "cache"
    same_view(full, again)
    recorded = marshal.loads(cache_file(site).read_bytes())[4]
    assert set(again["order"]) <= set(recorded)


def test_the_cache_is_not_used_when_monstack_is_already_imported(site):
    """``main()`` after the program imported monstack: nothing runs twice."""
    boot(site)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTHON"))}
    e.update(MONSTACK="1", PYTHONPATH=str(site))
    code = ("import monstack, sys; m = sys.modules['monstack._stack']; import _monstack_boot; "
            "_monstack_boot.main(); print(_monstack_boot.route, sys.modules['monstack._stack'] is m)")
    out = subprocess.run([sys.executable, "-S", "-c", code], env=e, capture_output=True, text=True, timeout=120)
    assert (out.stdout.split(), out.stderr) == (["imports", "True"], "")


def boot_watched(site: Path, **env: str) -> tuple[str, list[str]]:
    """A boot as in ``boot()``, with an audit hook that sees every file opened from its
    first line: (the route it took, the opened paths that are the cache file or its
    temporary copy)."""
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTHON"))}
    e.update(MONSTACK="1", PYTHONPATH=str(site), **env)
    code = ("import sys\nopened = []\n"
            "sys.addaudithook(lambda event, args: event == 'open' and opened.append(str(args[0])))\n"
            "import _monstack_boot; _monstack_boot.main()\n"
            "print(_monstack_boot.route); print([p for p in opened if '_monstack_boot.' in p and '.modules' in p])\n")
    out = subprocess.run([sys.executable, "-S", "-c", code], env=e, cwd=site.parent, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    route, opened = out.stdout.splitlines()
    return route, eval(opened)


@pytest.mark.parametrize("off", ["0", "false", "no", " OFF "])
def test_the_switch_off_neither_reads_nor_writes_the_cache(site, off):
    route, opened = boot_watched(site, MONSTACK_STARTUP_CACHE=off)
    assert (route, opened) == ("imports", []) and not cache_file(site).exists()  # not written
    route, opened = boot_watched(site)  # on (unset): written
    assert route == "imports" and opened and cache_file(site).is_file()
    assert boot_watched(site)[0] == "cache"  # and read
    recorded = cache_file(site).read_bytes()
    mtime = cache_file(site).stat().st_mtime_ns
    route, opened = boot_watched(site, MONSTACK_STARTUP_CACHE=off)
    assert (route, opened) == ("imports", [])  # a valid cache there, not even opened
    assert cache_file(site).read_bytes() == recorded and cache_file(site).stat().st_mtime_ns == mtime


@pytest.mark.parametrize("on", ["1", "on", ""])
def test_the_switch_on_uses_the_cache(site, on):
    boot(site)
    assert boot(site, MONSTACK_STARTUP_CACHE=on)["route"] == "cache"


def test_a_bad_switch_value_is_one_warning_and_the_cache_stays_on(site):
    boot(site)
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTHON"))}
    e.update(MONSTACK="1", PYTHONPATH=str(site), MONSTACK_STARTUP_CACHE="maybe")
    code = "import _monstack_boot; _monstack_boot.main(); print(_monstack_boot.route)"
    out = subprocess.run([sys.executable, "-S", "-c", code], env=e, cwd=site.parent, capture_output=True, text=True,
                         timeout=120)
    assert out.stdout == "cache\n"
    assert out.stderr == ("MonstackWarning: monstack-bad-value: MONSTACK_STARTUP_CACHE='maybe' is not valid (valid values: "
                          "1/true/yes/on, 0/false/no/off); using the default (on)\n")


def test_the_boot_spells_the_switch_as_the_settings_do():
    import _monstack_boot

    from monstack import _settings

    assert _monstack_boot._SWITCH == _settings.STARTUP_CACHE_ENV
    assert _settings.STARTUP_CACHE_ENV in [s.var for s in _settings.SETTINGS]


def warm(site: Path) -> subprocess.CompletedProcess:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MONSTACK", "PYTHON"))}
    e.update(PYTHONPATH=str(site), PYTHONDONTWRITEBYTECODE="1")
    return subprocess.run([sys.executable, "-m", "monstack", "warm"], env=e, cwd=site.parent, capture_output=True,
                          text=True, timeout=120)


def test_warm_writes_what_a_start_up_that_writes_nothing_then_uses(site):
    """``python -m monstack warm`` (an image build with PYTHONDONTWRITEBYTECODE set) writes
    the start-up cache and the native code's verdict; a start-up under
    PYTHONDONTWRITEBYTECODE then runs from the cache."""
    compile_all(site)
    out = warm(site)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    assert f"start-up cache: ready ({cache_file(site)})" in out.stdout
    assert cache_file(site).is_file()
    assert boot(site, write=False)["route"] == "cache"


def test_warm_says_so_when_it_cannot_write(site):
    (site / "__pycache__").write_text("")  # (a file where the directory should be)
    out = warm(site)
    assert out.returncode == 1 and "start-up cache: NOT written" in out.stdout
    assert "monstack warm: not everything could be written" in out.stderr


def test_the_bytecode_route_leaves_a_real_future_module_as_it_is(site):
    """Where ``__future__`` was imported before the boot, the modules' imports get it."""
    compile_all(site)
    view = boot(site, write=False, prelude="import __future__\n")
    assert view["route"] == "bytecode" and view["future"] is True and view["annotations_name"] is True
