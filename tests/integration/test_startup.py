"""Start-up: boot(), the .pth line, the sitecustomize route, and the
.pth installed by pip into a fresh venv (regular and editable)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import monstack
from monstack import _capture, _errors, _install, _startup
from monstack import MonstackWarning

from conftest import expected_backend

REPO = Path(__file__).resolve().parents[2]
PTH = REPO / "monstack-startup.pth"
BOOT_DIR = REPO / "monstack" / "_boot"


def clean_env(**extra: str) -> dict[str, str]:
    """The test's environment without any MONSTACK* variable, plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    env.pop("PYTHONPATH", None)
    env.update(extra)
    return env


@pytest.fixture
def fresh_boot(monkeypatch):
    """boot() as in a new process: not booted yet, nothing warned yet."""
    monkeypatch.setattr(_startup, "_booted", [])
    monkeypatch.setattr(_errors, "_said", set())


# -- boot() ------------------------------------------------------------------------------


def test_boot_installs_with_the_settings(fresh_boot):
    assert _startup.boot({"MONSTACK": "on", "MONSTACK_TRACK": "all", "MONSTACK_CHAIN_LIMIT": "4"}) == expected_backend()
    status = monstack.status()
    assert status["policy"].startswith("track=all")
    assert _capture._state is not None and _capture._state.options["chain_limit"] == 4


def test_boot_off_installs_nothing_and_says_nothing(fresh_boot):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert _startup.boot({"MONSTACK": "0", "MONSTACK_TRACK": "bogus"}) is None
    assert monstack.active_backend() is None


def test_boot_with_an_unknown_monstack_value_warns_about_it_alone(fresh_boot):
    with pytest.warns(MonstackWarning) as caught:
        assert _startup.boot({"MONSTACK": "maybe", "MONSTACK_TRACK": "bogus"}) is None
    assert [str(w.message).split(" is not valid")[0] for w in caught] == ["monstack-bad-value: MONSTACK='maybe'"]
    assert monstack.active_backend() is None


def test_boot_bad_value_warns_once_and_uses_the_default(fresh_boot):
    env = {"MONSTACK": "1", "MONSTACK_TRACK": "everything"}
    with pytest.warns(MonstackWarning) as caught:
        assert _startup.boot(env) == expected_backend()
        _startup.boot(env, again=True)  # the same message is not repeated
    assert len(caught) == 1
    message = str(caught[0].message)
    assert "MONSTACK_TRACK='everything'" in message and "user, all" in message
    assert monstack.status()["policy"] == "track=user"


def test_boot_retries_with_defaults_when_the_requested_backend_cannot_run(fresh_boot):
    unavailable = "monitoring" if not hasattr(sys, "monitoring") else "evalframe"
    with pytest.warns(MonstackWarning, match=f"install\\(backend='{unavailable}'\\) failed.*using the defaults"):
        assert _startup.boot({"MONSTACK": "1", "MONSTACK_BACKEND": unavailable}) == expected_backend()


def test_boot_never_raises_when_install_is_broken(fresh_boot, monkeypatch):
    def broken(**kwargs):
        raise RuntimeError("half uninstalled")

    monkeypatch.setattr(_install, "install", broken)
    with pytest.warns(MonstackWarning) as caught:
        assert _startup.boot({"MONSTACK": "1"}) is None
    assert "runs without monstack" in str(caught[-1].message)
    assert monstack.active_backend() is None


def test_boot_from_os_environ_runs_once_per_process(fresh_boot, monkeypatch):
    calls = []
    monkeypatch.setattr(_startup, "install_config", lambda config: calls.append(config) or "walk")
    monkeypatch.setenv("MONSTACK", "1")
    assert _startup.boot() == "walk"
    assert _startup.boot() == "walk"  # site.py processes a venv's .pth files twice
    assert len(calls) == 1
    _startup.boot(again=True)
    assert len(calls) == 2


def test_warn_with_warnings_as_errors_writes_to_stderr(fresh_boot, capsys):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _startup.warn("monstack-bad-value", "MONSTACK_X='y' is not valid")
    assert capsys.readouterr().err == "MonstackWarning: monstack-bad-value: MONSTACK_X='y' is not valid\n"


# -- the .pth line, in this process ------------------------------------------------------------


def pth_line() -> str:
    return PTH.read_text(encoding="utf-8")


def test_pth_file_is_one_import_line():
    text = pth_line()
    assert text.count("\n") == 1 and text.endswith("\n")
    assert text.startswith("import ")  # site.py executes only lines starting with "import"
    compile(text, "monstack-startup.pth", "exec")


@pytest.fixture
def run_pth(monkeypatch):
    """Execute the .pth line as site.py does; returns the boot() calls it made."""
    calls: list[int] = []
    monkeypatch.setattr(_startup, "boot", lambda: calls.append(1))
    monkeypatch.delattr(sys, "_monstack_pth", raising=False)

    def run(value: str | None) -> list[int]:
        if value is None:
            monkeypatch.delenv("MONSTACK", raising=False)
        else:
            monkeypatch.setenv("MONSTACK", value)
        exec(pth_line(), {})
        return calls

    yield run
    if hasattr(sys, "_monstack_pth"):
        del sys._monstack_pth


@pytest.mark.parametrize("value", [None, "", "0", "off"])
def test_pth_line_does_nothing_when_off(run_pth, value, monkeypatch):
    monkeypatch.delitem(sys.modules, "_monstack_boot", raising=False)
    before = set(sys.modules)
    assert run_pth(value) == []
    # unset: nothing imported; set to an off value: only the line's own small module
    added = set(sys.modules) - before
    assert added == (set() if value is None else {"_monstack_boot"}) and not hasattr(sys, "_monstack_pth")


def test_pth_line_boots_once(run_pth):
    assert run_pth("1") == [1]
    assert run_pth("1") == [1]  # a second pass over the same site directory


def test_pth_line_survives_a_missing_package(run_pth, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "monstack._startup", None)  # import raises ImportError
    assert run_pth("1") == []
    err = capsys.readouterr().err
    assert err.startswith("monstack: MONSTACK is set but monstack cannot start (ModuleNotFoundError")


# -- the sitecustomize route (one fresh interpreter) -------------------------------------------


def test_sitecustomize_route_boots_and_chains_to_the_existing_sitecustomize(tmp_path):
    user_dir = tmp_path / "user"
    user_dir.mkdir()
    (user_dir / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    code = "import os, monstack; print(monstack.active_backend(), monstack.status().get('policy'), os.environ.get('USER_SITECUSTOMIZE'))"
    env = clean_env(MONSTACK="1", MONSTACK_TRACK="all", PYTHONPATH=os.pathsep.join([str(BOOT_DIR), str(user_dir)]))
    # Not from the repo root: the route itself must find the monstack next to it.
    out = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [expected_backend(), "track=all", "ran"]
    assert out.stderr == ""


# -- pip install into a fresh venv (one venv for the module) -------------------------------------


def _run(cmd: list[str], env: dict[str, str] | None = None, **kwargs) -> subprocess.CompletedProcess:
    """No PYTHONPATH and no MONSTACK* from the test run: pip and the venv's python must see
    only the venv (a PYTHONPATH to the work tree would show pip its egg-info)."""
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env or clean_env(), **kwargs)


@pytest.fixture(scope="module")
def venv(tmp_path_factory):
    """A fresh venv with setuptools (for --no-build-isolation) and a copy of the sources
    (building must not write into the shared work tree)."""
    root = tmp_path_factory.mktemp("pth")
    src = root / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in", "_monstack_build.py", "monstack-startup.pth",
                 "_monstack_pytest.py", "_monstack_boot.py"):
        if (REPO / name).exists():
            shutil.copy2(REPO / name, src / name)
    shutil.copytree(REPO / "monstack", src / "monstack", ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    env_dir = root / "venv"
    # The test interpreter's pip drives the venv (``pip --python``, pip >= 22.3): a venv
    # without its own pip is made in well under a second instead of ~10 s.
    try:
        from importlib.metadata import version

        host_pip = tuple(int(p) for p in version("pip").split(".")[:2]) >= (22, 3)
    except Exception:
        host_pip = False
    out = _run([sys.executable, "-m", "venv", *(["--without-pip"] if host_pip else []), str(env_dir)])
    if out.returncode != 0:
        pytest.skip(f"python -m venv does not work here: {out.stderr.strip()[-300:]}")
    python = env_dir / "bin" / "python"
    if not python.exists():
        python = env_dir / "Scripts" / "python.exe"
    if host_pip:
        pip = [sys.executable, "-m", "pip", "--python", str(python), "--disable-pip-version-check", "-q"]
    else:
        pip = [str(python), "-m", "pip", "--disable-pip-version-check", "-q"]
    out = _run(pip + ["install", "setuptools>=70.1"])
    if out.returncode != 0:
        pytest.skip(f"no setuptools>=70.1 for the venv (offline?): {out.stderr.strip()[-300:]}")
    site = _run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    return {"python": str(python), "pip": pip, "src": src, "site": Path(site)}


def _install_into(venv, *args: str) -> None:
    out = _run(venv["pip"] + ["install", "--no-deps", "--no-build-isolation", *args, str(venv["src"])])
    assert out.returncode == 0, out.stdout + out.stderr


def _py(venv, code: str, **env: str) -> subprocess.CompletedProcess:
    return _run([venv["python"], "-c", code], env=clean_env(**env), cwd=venv["src"].parent)


PROBE = "import sys, monstack; print(monstack.active_backend(), monstack.status().get('policy'), monstack.__file__)"


def test_pip_install_puts_the_pth_in_site_packages(venv):
    _install_into(venv)
    pth = venv["site"] / "monstack-startup.pth"
    assert pth.read_text() == pth_line()
    record = next(venv["site"].glob("monstack-*.dist-info")) / "RECORD"
    assert "monstack-startup.pth," in record.read_text()  # so pip uninstall removes it
    assert (venv["site"] / "monstack" / "_boot" / "sitecustomize.py").is_file()  # the other route

    # Unset: monstack is not even imported.
    out = _py(venv, "import sys; print('monstack' in sys.modules)")
    assert (out.stdout, out.stderr) == ("False\n", "")

    # On, configured by the environment; the script itself is tracked (its snapshot has it).
    code = PROBE + "; print(len(monstack.snapshot()))"
    out = _py(venv, code, MONSTACK="yes", MONSTACK_TRACK="all")
    backend, policy, where, depth = out.stdout.split()
    assert (backend, policy, out.stderr) == (expected_backend(), "track=all", "")
    assert where.startswith(str(venv["site"])) and int(depth) >= 1

    # A bad value: exactly one warning naming the variable; defaults; the program runs.
    out = _py(venv, PROBE, MONSTACK="1", MONSTACK_CHAIN_LIMIT="lots")
    assert out.returncode == 0 and out.stdout.split()[:2] == [expected_backend(), "track=user"]
    assert out.stderr.count("MonstackWarning") == 1, out.stderr
    assert "MONSTACK_CHAIN_LIMIT='lots' is not valid (valid values: a whole number >= 1)" in out.stderr

    # Half uninstalled (the package gone, the .pth left): one line, and the program runs.
    pkg = venv["site"] / "monstack"
    pkg.rename(venv["site"] / "monstack.away")
    try:
        out = _py(venv, "print('still running')", MONSTACK="1")
    finally:
        (venv["site"] / "monstack.away").rename(pkg)
    assert out.returncode == 0 and out.stdout == "still running\n"
    assert out.stderr.splitlines() == [
        "monstack: MONSTACK is set but monstack cannot start (ModuleNotFoundError: No module named 'monstack'); running without it"
    ]


def test_pip_install_editable_puts_the_pth_in_site_packages_and_uninstall_removes_it(venv):
    _install_into(venv, "-e")
    pth = venv["site"] / "monstack-startup.pth"
    assert pth.read_text() == pth_line()
    out = _py(venv, PROBE, MONSTACK="1")
    backend, policy, where = out.stdout.split()
    assert (backend, out.stderr) == (expected_backend(), "")
    assert where == str(venv["src"] / "monstack" / "__init__.py")  # the editable sources

    out = _run(venv["pip"] + ["uninstall", "-y", "monstack"])
    assert out.returncode == 0, out.stderr
    assert not pth.exists()


def test_checking_stored_machine_code_does_not_load_openssl():
    """install() checks the native code against its manifest with an integer checksum, not
    hashlib (which loads OpenSSL: milliseconds of start-up for MONSTACK=1)."""
    code = "import sys, monstack; monstack.install(); print(monstack.active_backend(), 'hashlib' in sys.modules)"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0, out.stderr
    backend, loaded = out.stdout.split()
    assert backend == expected_backend() and loaded == "False"


# -- what start-up imports: nothing the program might want to import first ---------------------

#: Modules monstack must not import at start-up (MONSTACK=1 -> install()) on any version:
#: a program that must run before them (gevent's monkey-patching, a check that threading
#: is not imported yet) behaves the same with and without monstack.
NOT_AT_START_UP = ("threading", "asyncio", "logging", "typing", "json", "re", "traceback",
                   "sysconfig", "platform")
MODULES = "import sys; print(' '.join(sorted(sys.modules)))"


def _modules(cmd: list[str], **env: str) -> set[str]:
    out = subprocess.run(cmd, env=clean_env(**env), capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    return set(out.stdout.split())


def _added_by_boot(**env: str) -> tuple[set[str], str]:
    """(modules boot() adds, backend) in a bare interpreter (-S: nothing but the interpreter's
    own modules before it), with MONSTACK=1 and ``env``."""
    code = (
        "import sys; before = set(sys.modules); import monstack._startup as m; backend = m.boot(); "
        "print(backend, ' '.join(sorted(set(sys.modules) - before)))"
    )
    out = subprocess.run([sys.executable, "-S", "-c", code], env=clean_env(MONSTACK="1", PYTHONPATH=str(REPO), **env),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    backend, *added = out.stdout.split()
    return set(added), backend


def test_start_up_imports_none_of_the_heavy_modules():
    added, backend = _added_by_boot()
    assert backend == expected_backend()
    assert sorted(added & set(NOT_AT_START_UP)) == []
    assert not [m for m in added if m.startswith(("asyncio.", "logging.", "json.", "re.", "concurrent", "multiprocessing"))]
    # nor monstack's own modules that tracking does not need yet: the origins' (with the
    # first thread started: the start_new_thread point is applied at start-up without them),
    # the reports' (with the first uncaught exception once an origin may exist), the
    # formatting (with the first note), the dump signal's (with MONSTACK_DUMP_SIGNAL)
    assert sorted(added & set(NOT_MONSTACK_AT_START_UP)) == []


#: monstack's modules that MONSTACK=1 start-up leaves for later (first use).
NOT_MONSTACK_AT_START_UP = ("monstack._format", "monstack._colorize", "monstack._threads", "monstack._origin",
                            "monstack._points.threading", "monstack._points.reports",
                            "monstack._points.greenlet", "monstack._dump", "monstack._dumpsig")


#: What loading the native code used to import at every start (each 0.3-2.5M instructions):
#: the manifest is marshal data, the image's check an integer checksum, the opcodes and the
#: one build variable are read without their modules.
NOT_FOR_THE_NATIVE_PATH = ("opcode", "types", "_json", "hashlib", "_sha2", "_sha256")


def test_loading_the_native_code_imports_no_parser_hash_or_build_data():
    added, backend = _added_by_boot()
    assert backend == expected_backend()
    assert sorted(added & set(NOT_FOR_THE_NATIVE_PATH)) == []
    assert not [m for m in added if m.startswith("_sysconfigdata")]
    if sys.version_info < (3, 12):
        assert "monstack._sysmon" not in added  # (3.11: sys.monitoring's absence is a fact in _env)


def test_the_dump_signal_loads_its_module_at_start_up_only_when_set():
    added, _backend = _added_by_boot(MONSTACK_DUMP_SIGNAL="USR1")
    assert "monstack._dumpsig" in added


START_NEW_THREAD_FIRST = """\
import _thread, sys
import monstack
assert "monstack._format" not in sys.modules  # loads with the first note, not at a hop
done = _thread.allocate_lock(); done.acquire()
seen = []
def raw():
    try:
        seen.append(monstack.current_origin())
    finally:
        done.release()
_thread.start_new_thread(raw, ())  # the origin
done.acquire()
print(seen[0] is not None and any(f.line == "_thread.start_new_thread(raw, ())  # the origin" for f in seen[0].frames))
"""


def test_start_new_thread_gets_its_origin_when_it_is_the_first_point_used(tmp_path):
    program = tmp_path / "prog.py"  # (a file: -c's source is in linecache on 3.13+ only)
    program.write_text(START_NEW_THREAD_FIRST)
    out = subprocess.run([sys.executable, str(program)], env=clean_env(MONSTACK="1"),
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.split() == ["True"]


@pytest.mark.parametrize("env", [{"MONSTACK_BACKEND": "walk"}, {"MONSTACK_ACCELERATOR": "0"}])
def test_ctypes_is_imported_only_where_native_code_loads(env):
    added, backend = _added_by_boot(**env)
    assert sorted(added & set(NOT_AT_START_UP)) == []
    native = backend == "evalframe"  # the 3.11 shim is that backend's native code
    # (the ctypes package never: monstack._cdata uses its C extension)
    assert ("_ctypes" in added) == native and "ctypes" not in added, (backend, sorted(added))


def test_monstack_1_adds_none_of_the_heavy_modules_to_python_c():
    """Through the .pth line of this interpreter's environment (as a user runs it)."""
    without = _modules([sys.executable, "-c", MODULES])
    with_ = _modules([sys.executable, "-c", MODULES], MONSTACK="1")
    assert "monstack" in with_ and "monstack" not in without
    assert sorted((with_ - without) & set(NOT_AT_START_UP)) == []


THREADING_FIRST = '''\
import sys
first = "threading" in sys.modules  # the program's first line: nothing imported it yet
import monstack
import threading

def work():
    raise ValueError("boom")

caught = []
threading.excepthook = lambda args: caught.append(args.exc_value)
thread = threading.Thread(target=work)
thread.start()  # the origin
thread.join()
report = monstack.format_exception(caught[0], color=False)  # (the exception has no note)
print(first, monstack.active_backend(), "Work created at" in report and not hasattr(caught[0], "__notes__"),
      f'line {ORIGIN_LINE}, in <module>' in report)
'''


def test_threading_is_not_imported_before_the_program_and_still_gets_origins(tmp_path):
    source = THREADING_FIRST.replace("ORIGIN_LINE", str(THREADING_FIRST.splitlines().index("thread.start()  # the origin") + 1))
    program = tmp_path / "prog.py"
    program.write_text(source)
    out = subprocess.run([sys.executable, str(program)], env=clean_env(MONSTACK="1"), capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.split() == ["False", expected_backend(), "True", "True"]


AFTER_INSTALL = '''\
import sys, warnings
warnings.simplefilter("error")
assert "threading" not in sys.modules
import monstack
from monstack import _propagate
monstack.install()
import threading  # patched as it is imported
import concurrent.futures, asyncio, _thread

def fail():
    raise KeyError("x")

def noted(exc):  # an origin with a frame of this program (and no note)
    snap = monstack.origin_of(exc)
    return snap is not None and snap.records()[-1][0] == "<string>" and not hasattr(exc, "__notes__")

results = {}
assert any(owner is threading.Thread and attr == "start" for owner, attr, _ in _propagate.patched())
caught = []
threading.excepthook = lambda args: caught.append(args.exc_value)
t = threading.Thread(target=fail); t.start(); t.join()
results["threading"] = noted(caught[0])
with concurrent.futures.ThreadPoolExecutor(1) as pool:
    results["thread_pool"] = noted(pool.submit(fail).exception())

async def main():
    loop = asyncio.get_running_loop()
    task = asyncio.create_task(asyncio.sleep(0, result=None))
    await task
    async def afail():
        fail()
    t = asyncio.create_task(afail())
    try:
        await t
    except KeyError as exc:
        results["asyncio_tasks"] = noted(exc)
    try:
        await loop.run_in_executor(None, fail)
    except KeyError as exc:
        results["asyncio_executor"] = noted(exc)

asyncio.run(main())
done = _thread.allocate_lock(); done.acquire()
def raw():
    try:
        results["start_new_thread"] = monstack.current_origin() is not None
    finally:
        done.release()
_thread.start_new_thread(raw, ())
done.acquire()
assert not _propagate.FAILED, _propagate.FAILED
print(" ".join(f"{k}={v}" for k, v in sorted(results.items())))
'''


def test_importing_threading_after_install_works_with_every_point():
    out = subprocess.run([sys.executable, "-c", AFTER_INSTALL], env=clean_env(), capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stderr == "", out.stderr
    assert out.stdout.split() == [
        "asyncio_executor=True", "asyncio_tasks=True", "start_new_thread=True", "thread_pool=True", "threading=True",
    ]


def test_a_regular_install_adds_none_of_the_heavy_modules(venv):
    """``pip install`` (not editable) into a fresh venv, MONSTACK=1 through its .pth."""
    _install_into(venv)
    without = _modules([venv["python"], "-c", MODULES])
    with_ = _modules([venv["python"], "-c", MODULES], MONSTACK="1")
    assert "monstack" in with_ and "monstack" not in without
    assert sorted((with_ - without) & set(NOT_AT_START_UP)) == []
