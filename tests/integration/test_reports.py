"""Exceptions the program catches look as they would without monstack;
origins show where failures are reported (the excepthooks, asyncio's handler, pytest's
report, ``python -m monstack run``; logging and ``format_exception`` in their own tests).

Each edge runs for real in a subprocess (pytest replaces ``threading.excepthook`` during a
test, and an uncaught exception ends the process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADING = "Work created at (most recent call last):"


def env(**extra: str) -> dict[str, str]:
    """This checkout first on the path, no MONSTACK* variable but ``extra``."""
    out = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    out["PYTHONPATH"] = str(ROOT)
    out.pop("PYTHONWARNINGS", None)
    out.update(extra)
    return out


def run(code: str, tmp_path: Path, *args: str, **extra: str) -> subprocess.CompletedProcess:
    script = tmp_path / "prog.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, *args, str(script)], env=env(**extra), capture_output=True,
                          text=True, timeout=120, cwd=tmp_path)


def line_of(code: str, marker: str) -> int:
    return next(i for i, line in enumerate(textwrap.dedent(code).splitlines(), 1) if marker in line)


POOL_FAILS = """\
import concurrent.futures, sys

def job():
    raise ValueError("boom")

pool = concurrent.futures.ThreadPoolExecutor(1)
future = pool.submit(job)  # @created
"""


# -- sys.excepthook -----------------------------------------------------------------------------


def test_uncaught_exception_report_shows_the_origin_and_nothing_else_changes(tmp_path):
    code = POOL_FAILS + "future.result()\n"
    out = run(code, tmp_path, MONSTACK="1")
    assert out.returncode == 1
    err = out.stderr
    assert err.startswith("Traceback (most recent call last):\n")
    # the default report, with the origin where notes go (right after the exception line)
    assert f"ValueError: boom\n{HEADING}\n" in err
    assert f'File "{tmp_path / "prog.py"}", line {line_of(code, "@created")}, in <module>' in err
    assert "(no tracked frames)" not in err and "monstack" not in err
    plain = run(code, tmp_path)  # without monstack: the same report minus the origin
    assert plain.returncode == 1 and HEADING not in plain.stderr
    assert err.startswith(plain.stderr.split("ValueError: boom\n")[0])


CHAINED_HOOK = """\
import concurrent.futures, sys

seen = []
def their_hook(typ, value, tb):  # another tool's hook, set before monstack's
    seen.append(list(getattr(value, "__notes__", [])))
    sys.stderr.write("their hook: " + " | ".join(seen[-1]) + "\\n")

sys.excepthook = their_hook
import monstack
monstack.install()
assert sys.excepthook is not their_hook

def job():
    raise ValueError("boom")

with concurrent.futures.ThreadPoolExecutor(1) as pool:
    future = pool.submit(job)  # @created
try:
    future.result()
except ValueError as exc:
    caught = exc
sys.excepthook(type(caught), caught, caught.__traceback__)
print("after:", hasattr(caught, "__notes__"), str(caught))
# an exception without an origin reaches their hook untouched
sys.excepthook(KeyError, KeyError("k"), None)
print("plain:", seen[-1])
monstack.uninstall()
print("restored:", sys.excepthook is their_hook)
"""


def test_sys_excepthook_chains_to_the_hook_it_found_and_uninstall_restores_it(tmp_path):
    out = run(CHAINED_HOOK, tmp_path)
    assert out.returncode == 0, out.stderr
    assert f"their hook: {HEADING}" in out.stderr  # their hook saw the origin as a note...
    assert f'line {line_of(CHAINED_HOOK, "@created")}, in <module>' in out.stderr
    assert "after: False boom" in out.stdout  # ...which was taken off again after
    assert "plain: []" in out.stdout
    assert "restored: True" in out.stdout


LAID_OVER = """\
import sys, monstack
monstack.install()
ours = sys.excepthook
calls = []
def later(typ, value, tb):  # installed over monstack's: calls it, as hooks chain
    calls.append(typ.__name__)
    ours(typ, value, tb)
sys.excepthook = later
monstack.uninstall()
print(sys.excepthook is later, sys.__excepthook__ is not ours)
raise KeyError("after uninstall")
"""


def test_a_hook_laid_over_ours_keeps_working_after_uninstall(tmp_path):
    out = run(LAID_OVER, tmp_path)
    assert out.returncode == 1
    assert out.stdout.split() == ["True", "True"]
    assert "KeyError: 'after uninstall'" in out.stderr and HEADING not in out.stderr


# -- threading.excepthook -----------------------------------------------------------------------


THREAD_FAILS = """\
import threading, sys, monstack
monstack.install()

def work():
    raise ValueError("thread boom")

t = threading.Thread(target=work, name="dies")
t.start()  # @created
t.join()
default = threading.excepthook is not threading.__excepthook__
monstack.uninstall()
print(default, threading.excepthook is threading.__excepthook__, sys.excepthook is sys.__excepthook__)
"""


def test_thread_failure_report_shows_the_origin_and_uninstall_restores_the_hooks(tmp_path):
    out = run(THREAD_FAILS, tmp_path)
    assert out.returncode == 0
    assert out.stdout.split() == ["True", "True", "True"]
    err = out.stderr
    assert err.startswith("Exception in thread dies:\nTraceback (most recent call last):\n")
    assert f"ValueError: thread boom\n{HEADING}\n" in err
    assert f'line {line_of(THREAD_FAILS, "@created")}, in <module>' in err


# -- asyncio ----------------------------------------------------------------------------------------


ASYNCIO = """\
import asyncio, gc, sys, monstack
monstack.install()
handled = []

async def fail():
    raise ValueError("task boom")

async def main(custom):
    loop = asyncio.get_running_loop()
    if custom:
        loop.set_exception_handler(lambda loop, ctx: handled.append(ctx["exception"]))
    task = asyncio.create_task(fail())  # @created
    while not task.done():
        await asyncio.sleep(0)
    await asyncio.sleep(0)
    del task
    gc.collect()

asyncio.run(main(False))
asyncio.run(main(True))
(exc,) = handled
snap = monstack.origin_of(exc)
print("custom:", hasattr(exc, "__notes__"), snap.records()[-1][1])
"""


def test_task_exception_never_retrieved_shows_the_origin_and_a_custom_handler_is_left_alone(tmp_path):
    out = run(ASYNCIO, tmp_path)
    assert out.returncode == 0, out.stderr
    line = line_of(ASYNCIO, "@created")
    err = out.stderr
    assert err.count("Task exception was never retrieved") == 1
    assert f"ValueError: task boom\n{HEADING}\n" in err and f"line {line}, in main" in err
    # the program's own handler got the exception as it is; origin_of knows its origin
    assert f"custom: False {line}" in out.stdout


# -- pytest -----------------------------------------------------------------------------------------


TESTS = """\
import concurrent.futures
import pytest

def job():
    raise ValueError("boom")

def test_match_sees_the_exception_as_it_is():
    with concurrent.futures.ThreadPoolExecutor() as pool:
        future = pool.submit(job)
        with pytest.raises(ValueError, match="^boom$"):
            future.result()
        assert not hasattr(future.exception(), "__notes__")

def test_fails():
    with concurrent.futures.ThreadPoolExecutor() as pool:
        future = pool.submit(job)  # @created
        future.result()
"""


@pytest.mark.parametrize("notes", ["", "1"])
def test_pytest_raises_match_passes_and_the_failure_report_shows_the_origin(tmp_path, notes):
    (tmp_path / "test_prog.py").write_text(TESTS)
    extra = {"MONSTACK": "1"}
    if notes:
        extra["MONSTACK_NOTES"] = notes  # notes mode is off under pytest whatever it says
    out = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-W", "error", "test_prog.py"],
                         env=env(**extra), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    text = out.stdout
    assert "1 failed, 1 passed" in text, text + out.stderr
    assert "monstack: where the failed work was created" in text
    report = text.split("monstack: where the failed work was created")[1]
    assert f"{HEADING}\n" in report
    assert f'test_prog.py", line {line_of(TESTS, "@created")}, in test_fails' in report
    assert "(no tracked frames)" not in text
    # only the failed test's report has the section; monstack off: no section at all
    assert text.count("monstack: where the failed work was created") == 1
    off = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "test_prog.py"],
                         env=env(), capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert "1 failed, 1 passed" in off.stdout and "where the failed work" not in off.stdout and HEADING not in off.stdout


# -- notes mode -------------------------------------------------------------------------------------


NOTES = """\
import sys
if "--pytest" in sys.argv:
    import _pytest  # (pytest's package, imported as pytest runs)
import monstack
if "--keyword" in sys.argv:
    monstack.install(notes=True)
import concurrent.futures

def job():
    raise ValueError("boom")

with concurrent.futures.ThreadPoolExecutor(1) as pool:
    exc = pool.submit(job).exception()  # @created
notes = getattr(exc, "__notes__", [])
print(len(notes), str(exc), monstack.origin_of(exc) is not None)
print(notes[0] if notes else "")
"""


def test_notes_mode_is_opt_in_and_off_under_pytest(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(NOTES)

    def go(*args: str, **extra: str) -> list[str]:
        out = subprocess.run([sys.executable, str(script), *args], env=env(**extra), capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0 and out.stderr == "", out.stderr
        return out.stdout.splitlines()

    assert go(MONSTACK="1")[0] == "0 boom True"  # default: no note
    for lines in (go(MONSTACK="1", MONSTACK_NOTES="1"), go("--keyword")):
        assert lines[0] == "1 boom True"
        assert lines[1] == HEADING
        assert f'line {line_of(NOTES, "@created")}, in <module>' in "\n".join(lines)
    assert go("--pytest", MONSTACK="1", MONSTACK_NOTES="1")[0] == "0 boom True"
    assert go("--pytest", "--keyword")[0] == "0 boom True"


def test_install_refuses_a_notes_value_that_is_not_a_bool():
    import monstack

    with pytest.raises(ValueError, match="notes must be True or False"):
        monstack.install(notes="yes")  # type: ignore[arg-type]


# -- the notes a report borrows ----------------------------------------------------------------------


def test_notes_shown_adds_the_origins_for_the_call_only_and_restores_every_exception():
    import monstack
    from monstack import _origin

    snap = monstack.snapshot()  # @snap
    plain, noted, odd = ValueError("plain"), KeyError("noted"), _PropertyNotes("odd")
    noted.add_note("theirs")
    for exc in (plain, noted, odd):
        monstack.attach(exc, snap)
    group = ExceptionGroup("group", [noted, odd])
    try:
        raise group from plain
    except ExceptionGroup as exc:
        outer = exc
    with _origin.notes_shown(outer):
        assert outer.__dict__.get("__notes__") is None  # (it has no origin)
        assert plain.__notes__[0].startswith(HEADING) and len(plain.__notes__) == 1
        assert noted.__notes__[0] == "theirs" and noted.__notes__[1].startswith(HEADING)
        assert f"line {_this_line('@snap')}," in plain.__notes__[0]
    assert not hasattr(plain, "__notes__") and noted.__notes__ == ["theirs"]
    assert odd.__notes__ == ["its own"] and not hasattr(outer, "__notes__")


class _PropertyNotes(Exception):
    @property
    def __notes__(self):  # type: ignore[override]
        return ["its own"]


def _this_line(marker: str) -> int:
    return next(i for i, line in enumerate(Path(__file__).read_text().splitlines(), 1)
                if marker in line and "_this_line" not in line)


# -- colour ---------------------------------------------------------------------------------------

COLOURED = """\
import concurrent.futures, logging, sys, threading
import monstack
from monstack.logging import OriginFormatter

monstack.install(notes=NOTES)

def job():
    raise ValueError("boom")

pool = concurrent.futures.ThreadPoolExecutor(1)
future = pool.submit(job)  # @created
try:
    future.result()
except ValueError as exc:
    caught = exc
    handler = logging.StreamHandler(sys.stdout)  # (stdout: the log, apart from the reports)
    handler.setFormatter(OriginFormatter("%(message)s"))
    logging.getLogger("t").addHandler(handler)
    logging.getLogger("t").error("logged", exc_info=True)
    print("notes:", repr(getattr(exc, "__notes__", None)))
t = threading.Thread(target=pool.submit(job).result)  # (the thread's report)
t.start(); t.join()
sys.stderr.write("--- main\\n")
raise caught
"""


def _coloured_block(err: str, start: int = 0) -> bool:
    """The "Work created at" block from ``start`` on is coloured: its heading in bold, the
    frame's file name in CPython's colour."""
    at = err.index(HEADING, start)
    return err[at - 4:at] == "\x1b[1m" and "\x1b[" in err[at:err.index("\n", err.index("File ", at))]


def _plain(text: str) -> bool:
    return "\x1b" not in text


@pytest.mark.parametrize("notes", [False, True])
@pytest.mark.parametrize("colour", ["FORCE_COLOR", "MONSTACK_COLOR", "NO_COLOR", "PYTHON_COLORS=0"])
def test_the_reports_monstack_prints_colour_the_origin_as_cpython_colours_the_rest(tmp_path, colour, notes):
    """Where monstack prints the report itself (``sys.excepthook``), the origin block is
    coloured when CPython colours the traceback (3.13+: ``FORCE_COLOR``, ...), or
    ``MONSTACK_COLOR=always``; ``NO_COLOR``/``PYTHON_COLORS=0`` keep it plain. The
    thread's report is coloured only with ``MONSTACK_COLOR=always`` (CPython's threading
    hook never colours). Logs and the exception's notes stay plain."""
    extra = {"FORCE_COLOR": "1"} if colour == "FORCE_COLOR" else {"MONSTACK_COLOR": "always"} \
        if colour == "MONSTACK_COLOR" else {"NO_COLOR": "1"} if colour == "NO_COLOR" else {"PYTHON_COLORS": "0"}
    extra.pop("TERM", None)
    out = run(COLOURED.replace("NOTES", str(notes)), tmp_path, TERM="xterm", **extra)
    assert out.returncode == 1, out.stderr
    thread_report, main_report = out.stderr.split("--- main\n")
    assert HEADING in thread_report and HEADING in main_report
    cpython_colours = colour == "FORCE_COLOR" and sys.version_info >= (3, 13)
    if colour == "MONSTACK_COLOR" or cpython_colours:
        assert _coloured_block(main_report)
        assert ("\x1b[" in main_report[:main_report.index(HEADING) - 4]) == (sys.version_info >= (3, 13))
    else:
        assert _plain(main_report)
    assert _coloured_block(thread_report) if colour == "MONSTACK_COLOR" else _plain(thread_report)
    # the log (its formatter's colour is off by default: MONSTACK_COLOR=always is asked for
    # here, so only the other cases) and the exception's notes
    log, notes_line = out.stdout.rsplit("notes: ", 1)
    assert HEADING in log and (colour == "MONSTACK_COLOR" or _plain(log))
    assert _plain(notes_line) and (HEADING in notes_line) == notes
