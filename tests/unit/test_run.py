"""``python -m monstack run``: scripts and modules, exit codes, signals, child processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from monstack import _run

from conftest import expected_backend

REPO = Path(__file__).resolve().parents[2]


def run(args: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """``python -m monstack run ARGS`` in a clean environment (monstack from this tree)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    environ["PYTHONPATH"] = str(REPO)
    environ.update(env)
    return subprocess.run(
        [sys.executable, "-m", "monstack", "run", *args],
        cwd=cwd, env=environ, capture_output=True, text=True, timeout=120,
    )


def write(path: Path, source: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(source))
    return path


PROBE = """
    import json, os, sys
    import monstack

    def probe():
        import monstack
        return {"backend": monstack.active_backend(), "policy": monstack.status().get("policy")}
"""


def test_script_args_exit_code_and_child_processes(tmp_path):
    script = write(
        tmp_path / "app" / "prog.py",
        PROBE
        + """
    def spawned(queue):
        queue.put(probe())

    if __name__ == "__main__":
        import multiprocessing, subprocess
        code = "import json, monstack; print(json.dumps([monstack.active_backend(), monstack.status().get('policy')]))"
        child = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        ctx = multiprocessing.get_context("spawn")
        queue = ctx.Queue()
        process = ctx.Process(target=spawned, args=(queue,))
        process.start()
        from_spawn = queue.get(timeout=60)
        process.join()
        print(json.dumps({
            "main": probe(), "argv": sys.argv, "path0": sys.path[0], "name": __name__,
            "subprocess": json.loads(child.stdout) if child.stdout else child.stderr,
            "spawn": from_spawn,
        }))
        sys.exit(int(sys.argv[1]))
    """,
    )
    out = run(["--exclude", "vendored", "--chain-limit=5", str(script), "7", "--track", "-m", "x"], cwd=tmp_path)
    assert out.returncode == 7, out.stderr
    import json

    report = json.loads(out.stdout)
    assert report["argv"] == [str(script), "7", "--track", "-m", "x"]  # after the script: the program's
    assert report["name"] == "__main__" and report["path0"] == str(script.parent)
    policy = "track=user, exclude=['vendored']"
    assert report["main"] == {"backend": expected_backend(), "policy": policy}
    assert report["subprocess"] == [expected_backend(), policy]
    assert report["spawn"] == {"backend": expected_backend(), "policy": policy}
    assert out.stderr == ""


def test_track_all_with_threads_runs_clean(tmp_path):
    """``--track all`` tracks the standard library too, so a new thread's first tracked
    frame is its bottom frame (threading's ``_bootstrap``)."""
    script = write(
        tmp_path / "threads.py",
        """
        import threading, monstack
        t = threading.Thread(target=print, args=("in thread",))
        t.start()
        t.join()
        print(monstack.active_backend(), monstack.status().get("policy"))
        """,
    )
    out = run(["--track", "all", str(script)], cwd=tmp_path)
    assert (out.returncode, out.stderr) == (0, "")
    assert out.stdout == f"in thread\n{expected_backend()} track=all\n"


def test_module_with_bad_inherited_variable(tmp_path):
    write(tmp_path / "pkg" / "__init__.py", "")
    write(
        tmp_path / "pkg" / "tool.py",
        PROBE
        + """
    if __name__ == "__main__":
        print(json.dumps({"main": probe(), "argv": sys.argv, "name": __name__}))
    """,
    )
    out = run(["-m", "pkg.tool", "a", "-b"], cwd=tmp_path, MONSTACK_TRACK="sometimes")
    assert out.returncode == 0, out.stderr
    import json

    report = json.loads(out.stdout)
    assert report["argv"] == [str(tmp_path / "pkg" / "tool.py"), "a", "-b"]
    assert report["main"] == {"backend": expected_backend(), "policy": "track=user"}
    assert out.stderr.count("MonstackWarning") == 1
    assert "MONSTACK_TRACK='sometimes' is not valid (valid values: user, all)" in out.stderr


def test_uncaught_exception_exits_1_with_the_origin_and_without_runner_frames(tmp_path):
    script = write(
        tmp_path / "fail.py",
        """
        from concurrent.futures import ThreadPoolExecutor

        def job():
            raise MemoryError("out of memory")

        with ThreadPoolExecutor(1) as pool:
            future = pool.submit(job)  # the creating line
        future.result()
        """,
    )
    out = run([str(script)], cwd=tmp_path)
    assert out.returncode == 1
    err = out.stderr
    assert err.startswith("Traceback (most recent call last):\n" f'  File "{script}", line 9, in <module>'), err
    assert "runpy" not in err and "_run.py" not in err
    assert "MemoryError: out of memory" in err
    assert "Work created at (most recent call last):" in err and "pool.submit(job)  # the creating line" in err


@pytest.mark.skipif(os.name != "posix", reason="POSIX signals")
@pytest.mark.parametrize(
    "body, expected",
    [
        ("import os, signal\nos.kill(os.getpid(), signal.SIGTERM)\n", -signal.SIGTERM),
        ("raise KeyboardInterrupt\n", -signal.SIGINT),  # CPython re-raises SIGINT on exit
    ],
)
def test_signals_pass_through(tmp_path, body, expected):
    script = write(tmp_path / "sig.py", body)
    out = run([str(script)], cwd=tmp_path)
    assert out.returncode == expected, out.stderr


# -- in this process: option handling (no program is run) -----------------------------------


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["s.py", "--track", "all"], ([], "s.py", None, ["--track", "all"])),
        (["--track", "all", "s.py", "-x"], (["--track", "all"], "s.py", None, ["-x"])),
        (["--track=all", "-m", "pkg.mod", "--track"], (["--track=all"], None, "pkg.mod", ["--track"])),
        (["-mpkg", "a"], ([], None, "pkg", ["a"])),
        (["--include", "a", "--include", "b", "--", "-odd.py", "x"], (["--include", "a", "--include", "b"], "-odd.py", None, ["x"])),
        (["--track", "all"], (["--track", "all"], None, None, [])),
    ],
)
def test_split_argv(argv, expected):
    assert _run.split_argv(argv) == expected


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--track", "bogus", "s.py"], "--track 'bogus': valid values: user, all"),
        (["--chain-limit", "0", "s.py"], "--chain-limit '0': valid values: a whole number >= 1"),
        (["--backend", "turbo", "s.py"], "valid values: auto, monitoring, evalframe, walk"),
        (["--frobnicate", "s.py"], "unrecognized arguments: --frobnicate"),
        ([], "give a script or -m MODULE"),
    ],
)
def test_bad_options_exit_2_naming_valid_values(argv, message, capsys, monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))  # in case it got that far
    with pytest.raises(SystemExit) as caught:
        _run.main(argv)
    assert caught.value.code == 2
    assert message in capsys.readouterr().err


def test_missing_script_exits_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(os, "environ", dict(os.environ))
    assert _run.main([str(tmp_path / "nope.py")]) == 2
    assert "can't open file" in capsys.readouterr().err
    assert "MONSTACK" not in os.environ  # nothing was set up for a program that does not exist


def test_child_environment_uses_sitecustomize_only_without_the_pth():
    env: dict[str, str] = {"PYTHONPATH": "/somewhere"}
    _run.child_environment({"MONSTACK_TRACK": "all", "MONSTACK_INCLUDE": "a,b"}, env)
    assert env["MONSTACK"] == "1" and env["MONSTACK_TRACK"] == "all" and env["MONSTACK_INCLUDE"] == "a,b"
    if _run.pth_active():  # pragma: no cover - monstack installed in this interpreter
        assert env["PYTHONPATH"] == "/somewhere"
    else:
        assert env["PYTHONPATH"] == os.pathsep.join([_run.BOOT_DIR, "/somewhere"])
    _run.child_environment({}, env)  # not added twice
    assert env["PYTHONPATH"].count(_run.BOOT_DIR) <= 1


def test_missing_module_is_reported_like_python_m(capsys, monkeypatch):
    from monstack import _startup

    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")})
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(_startup, "_booted", [])
    assert _run.main(["-m", "monstack_no_such_module.sub"]) == 1
    err = capsys.readouterr().err
    assert err == (
        "python -m monstack run: Error while finding module specification for 'monstack_no_such_module.sub' "
        "(ModuleNotFoundError: No module named 'monstack_no_such_module')\n"
    )


# -- the program sees what plain python shows it ---------------------------------------------

MAIN_PROBE = """
import json, os, sys, __main__

def spec(s):
    return None if s is None else [s.name, s.origin, s.parent, s.submodule_search_locations]

g = globals()
loader = g.get("__loader__")
seen = {
    "file": g.get("__file__"),
    "argv": sys.argv,
    "path": sys.path,
    "spec": spec(__main__.__spec__),
    "name": __name__,
    "package": __package__,
    "loader": [type(loader).__name__, getattr(loader, "name", None), getattr(loader, "path", None)],
    "cached": g.get("__cached__", "absent"),
    "globals": list(g),
    "main_is_this_module": sys.modules["__main__"].__dict__ is g,
    "code_file": sys._getframe().f_code.co_filename,
}
os.chdir("/")
seen["file_after_chdir"] = os.path.exists(__file__)
print(json.dumps(seen))
"""


def _observed(cmd: list[str], cwd: Path) -> dict:
    import json

    environ = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    environ["PYTHONPATH"] = str(REPO)
    out = subprocess.run(cmd, cwd=cwd, env=environ, capture_output=True, text=True, timeout=120)
    assert (out.returncode, out.stderr) == (0, ""), out.stderr
    return json.loads(out.stdout)


@pytest.mark.parametrize(
    "target",
    [
        ["app/prog.py", "a", "--b"],
        ["./app/../app/prog.py"],
        ["link.py", "x"],  # a symbolic link: sys.path[0] is the real file's directory
        ["appdir", "x"],  # a directory with __main__.py
        ["-m", "pkg.tool", "x", "-y"],
        ["-m", "pkg", "x"],  # a package with __main__.py
    ],
)
def test_the_program_sees_what_plain_python_shows_it(tmp_path, target):
    write(tmp_path / "app" / "prog.py", MAIN_PROBE)
    write(tmp_path / "appdir" / "__main__.py", MAIN_PROBE)
    write(tmp_path / "pkg" / "__init__.py", "")
    write(tmp_path / "pkg" / "tool.py", MAIN_PROBE)
    write(tmp_path / "pkg" / "__main__.py", MAIN_PROBE)
    if os.name == "posix":
        (tmp_path / "link.py").symlink_to(tmp_path / "app" / "prog.py")
    elif "link.py" in target:
        pytest.skip("symbolic links")
    plain = _observed([sys.executable, *target], tmp_path)
    under_run = _observed([sys.executable, "-m", "monstack", "run", *target], tmp_path)
    assert under_run == plain
    if target[0] != "-m":
        assert os.path.isabs(plain["file"]) and plain["file_after_chdir"]  # what the runner got wrong


def test_the_program_sees_what_plain_python_shows_it_under_safe_path(tmp_path):
    write(tmp_path / "app" / "prog.py", MAIN_PROBE)
    plain = _observed([sys.executable, "-P", "app/prog.py"], tmp_path)
    under_run = _observed([sys.executable, "-P", "-m", "monstack", "run", "app/prog.py"], tmp_path)
    assert under_run == plain


def _unavailable_backend() -> str:
    from monstack import _select

    return next(name for name, why in _select.reasons().items() if why is not None)


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--backend", "UNAVAILABLE", "s.py"], "--backend 'UNAVAILABLE' cannot run here: "),
        (["--dump-signal", "KILL", "s.py"], "--dump-signal: SIGKILL cannot be used: it cannot be caught"),
        (["--dump-signal", "sigint", "s.py"], "--dump-signal: SIGINT cannot be used"),
        (["--dump-signal", "NOPE", "s.py"], "--dump-signal: SIGNOPE does not exist on this platform"),
        (["--backend", "walk", "--accelerator", "1", "s.py"], "--accelerator on conflicts with --backend walk"),
        (["--include", ",,", "s.py"], "--include ',,': valid values: module names or path prefixes"),
    ],
)
def test_what_would_fail_once_running_is_refused_up_front(tmp_path, argv, message):
    """Rejected before the program runs: one line, exit 2 (not a warning once it runs)."""
    argv = [a.replace("UNAVAILABLE", _unavailable_backend()) for a in argv]
    message = message.replace("UNAVAILABLE", _unavailable_backend())
    write(tmp_path / "s.py", "print('the program ran')\n")
    out = run(argv, cwd=tmp_path)
    assert out.returncode == 2 and out.stdout == "", out.stdout + out.stderr
    assert out.stderr.startswith(f"{_run.PROG}: error: {message}") and out.stderr.count("\n") == 1, out.stderr
