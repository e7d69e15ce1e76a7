"""``MONSTACK_DUMP_SIGNAL``: install() installs the handler, uninstall() restores the
previous one, unusable signals are refused with a warning, and a plain ``kill`` writes the
report to stderr, also while the main thread is blocked."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import monstack
from monstack import MonstackWarning, _dump, _dumpproto, _dumpsig, _errors

LINUX = sys.platform.startswith("linux")
REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(_errors, "_said", set())  # warn_once says each message again
    monkeypatch.setattr(_dumpproto, "BASE", str(tmp_path))  # no stray requests from /tmp
    monkeypatch.setattr(_dumpproto, "RUN_BASE", str(tmp_path / "run-user"))
    monstack.uninstall()
    yield
    monstack.uninstall()
    assert _dumpsig._installed == [] and _dumpsig._armed == []
    assert not _dumpsig._busy


def test_no_handler_unless_the_variable_is_set(monkeypatch):
    monkeypatch.delenv("MONSTACK_DUMP_SIGNAL", raising=False)
    before = signal.getsignal(signal.SIGUSR1)
    monstack.install()
    assert signal.getsignal(signal.SIGUSR1) is before
    assert _dumpsig.installed_signal() is None


@pytest.mark.parametrize("value", ["USR1", "sigusr1", " SIGUSR1 "])
def test_install_sets_the_handler_and_uninstall_restores_the_previous(monkeypatch, value):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", value)
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL
    monstack.install()
    assert signal.getsignal(signal.SIGUSR1) is _dumpsig._handler
    assert _dumpsig.installed_signal() == signal.SIGUSR1
    monstack.install(track="all")  # a reinstall keeps one handler
    assert signal.getsignal(signal.SIGUSR1) is _dumpsig._handler
    monstack.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


def test_a_handler_the_program_set_later_is_left_alone(monkeypatch):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR2")
    monstack.install()
    mine = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGUSR2, mine)
    try:
        monstack.uninstall()
        assert signal.getsignal(signal.SIGUSR2) is mine
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


@pytest.mark.parametrize(
    "value, why",
    [
        ("KILL", "cannot be caught"),
        ("STOP", "cannot be caught"),
        ("INT", "KeyboardInterrupt"),
        ("TERM", "must stop the program"),
        ("SEGV", "crash"),
        ("CHLD", "child process ends"),
        ("ALRM", "timers"),
        ("NOSUCHSIG", "does not exist"),
    ],
)
def test_unusable_signals_are_refused_with_a_warning(monkeypatch, value, why):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", value)
    with pytest.warns(MonstackWarning, match=why):
        monstack.install()
    assert _dumpsig.installed_signal() is None
    assert monstack.active_backend() is not None  # monstack itself runs


def test_a_signal_the_program_handles_or_ignores_is_refused(monkeypatch):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR2")
    theirs = lambda signum, frame: None  # noqa: E731
    signal.signal(signal.SIGUSR2, theirs)
    try:
        with pytest.warns(MonstackWarning, match="already handles it"):
            monstack.install()
        assert signal.getsignal(signal.SIGUSR2) is theirs
        monstack.uninstall()
        signal.signal(signal.SIGUSR2, signal.SIG_IGN)
        with pytest.warns(MonstackWarning, match="already ignores it"):
            monstack.install()
    finally:
        signal.signal(signal.SIGUSR2, signal.SIG_DFL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SigCgt is in Linux's /proc")
def test_a_handler_installed_outside_python_is_seen(monkeypatch):
    import faulthandler

    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR2")
    faulthandler.register(signal.SIGUSR2, file=sys.__stderr__)
    try:
        assert signal.getsignal(signal.SIGUSR2) is signal.SIG_DFL  # Python does not know
        with pytest.warns(MonstackWarning, match="already handles it"):
            monstack.install()
    finally:
        faulthandler.unregister(signal.SIGUSR2)


def test_install_outside_the_main_thread_warns(monkeypatch):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR1")
    caught = []

    def other():
        import warnings

        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            monstack.install()
        caught.extend(str(w.message) for w in seen)

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert any("outside the main thread" in m for m in caught), caught
    assert _dumpsig.installed_signal() is None


def test_a_bad_value_installs_nothing(monkeypatch):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR 1")
    monstack.install()  # read_env reports bad values at start-up; install() stays quiet
    assert _dumpsig.installed_signal() is None


def _kill_self_and_wait(signum: int, block: str) -> None:
    """Send ``signum`` to this process from another thread while the main thread blocks."""
    lock = threading.Lock()
    lock.acquire()
    done = threading.Event()

    def sender():
        time.sleep(0.2)
        os.kill(os.getpid(), signum)
        done.wait(5)
        lock.release()

    t = threading.Thread(target=sender, name="sender")
    t.start()
    try:
        if block == "sleep":
            time.sleep(0.6)  # interrupted, handled, then sleeps on (PEP 475)
        elif block == "lock":
            got = lock.acquire(timeout=0.6)  # interrupted, handled, then waits on
            assert not got
        elif block == "join":
            t.join(0.6)
    finally:
        done.set()
        t.join()


@pytest.mark.parametrize("block", ["sleep", "lock", "join"])
def test_a_plain_kill_writes_the_report_to_stderr_while_the_main_thread_blocks(monkeypatch, capfd, block):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR1")
    monstack.install()
    capfd.readouterr()
    _kill_self_and_wait(signal.SIGUSR1, block)
    err = capfd.readouterr().err
    assert "Thread \"MainThread\"" in err and "Thread \"sender\"" in err, err
    assert "_kill_self_and_wait" in err
    assert err.count("monstack dump:") == 1


def test_the_handler_survives_uninstall_from_another_thread(monkeypatch):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR1")
    monstack.install()
    t = threading.Thread(target=monstack.uninstall)
    t.start()
    t.join()
    assert signal.getsignal(signal.SIGUSR1) is _dumpsig._handler  # Python allows no change there
    monstack.install()  # still ours: not installed twice
    monstack.uninstall()
    assert signal.getsignal(signal.SIGUSR1) is signal.SIG_DFL


# -- the armed marker (python -m monstack dump signals only monstack's handler) -----------------


def _marker() -> "int | None":
    pid, uid = os.getpid(), os.geteuid()
    try:
        fd = _dumpproto.open_private_dir(uid)
    except _dumpproto.Refused:
        return None
    try:
        return _dumpproto.read_armed(fd, pid, _dumpproto.start_time(pid), uid)
    finally:
        os.close(fd)


@pytest.mark.skipif(not LINUX, reason="the marker is for the dump command (Linux)")
def test_arming_writes_the_marker_and_disarming_deletes_it(monkeypatch):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR2")
    monstack.install()
    assert _marker() == signal.SIGUSR2
    path = _dumpproto.dir_path(os.geteuid())
    assert [n for n in os.listdir(path) if n.startswith("armed-")] == [
        _dumpproto.armed_name(os.getpid(), _dumpproto.start_time(os.getpid()))]
    t = threading.Thread(target=monstack.uninstall)  # the handler stays: so does the marker
    t.start()
    t.join()
    assert _marker() == signal.SIGUSR2
    monstack.install()  # still armed: the same marker
    assert _marker() == signal.SIGUSR2
    monstack.uninstall()
    assert _marker() is None
    assert os.listdir(path) == []


@pytest.mark.skipif(not LINUX, reason="the marker is for the dump command (Linux)")
def test_no_marker_for_a_refused_signal(monkeypatch):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "TERM")
    with pytest.warns(MonstackWarning, match="must stop the program"):
        monstack.install()
    assert _marker() is None


@pytest.mark.skipif(not LINUX, reason="the marker is for the dump command (Linux)")
def test_a_squatted_directory_keeps_the_signal_and_says_the_command_cannot_use_it(monkeypatch, tmp_path):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR1")
    os.mkdir(_dumpproto.dir_path(os.geteuid()), 0o755)  # not private
    with pytest.warns(MonstackWarning, match="dump cannot find this process's handler"):
        monstack.install()
    assert signal.getsignal(signal.SIGUSR1) is _dumpsig._handler  # a plain kill still dumps
    assert _dumpsig._armed == []


# -- while a report is being built ------------------------------------------------------------


def _request(token: str) -> int:
    fd = _dumpproto.open_private_dir(os.geteuid(), create=True)
    _dumpproto.write_new(fd, _dumpproto.request_name(os.getpid(), token), f"{_dumpproto.MAGIC} {token} plain\n".encode())
    return fd


def _exit_3(signum, frame):
    sys.exit(3)


@pytest.mark.parametrize("exc, signum, handler", [
    (KeyboardInterrupt, signal.SIGINT, signal.default_int_handler),  # Ctrl-C
    (SystemExit, signal.SIGTERM, _exit_3),  # a SIGTERM handler calling sys.exit
])
@pytest.mark.parametrize("requested", [True, False], ids=["request", "plain-kill"])
def test_an_exit_raised_by_another_signal_during_the_report_is_re_raised(monkeypatch, capfd, exc, signum, handler,
                                                                         requested):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR1")
    monstack.install()
    previous = signal.signal(signum, handler)
    fd = _request("ab12") if requested else -1
    real = _dump.report
    calls = []

    def interrupted(**kwargs):
        calls.append(kwargs)
        signal.raise_signal(signum)  # its handler runs here, inside ours
        return real(**kwargs)

    monkeypatch.setattr(_dump, "report", interrupted)
    capfd.readouterr()
    try:
        with pytest.raises(exc):
            signal.raise_signal(signal.SIGUSR1)
        assert len(calls) == 1
        assert capfd.readouterr().err == ""  # no report, no fallback report
        if requested:  # the request is gone, no .part is left, the caller is told
            names = [n for n in os.listdir(fd) if n.startswith("dump-")]
            assert names == [_dumpproto.output_name(os.getpid(), "ab12")]
            text = _dumpproto.read_output(fd, os.getpid(), "ab12", os.geteuid())
            assert f"was interrupted ({exc.__name__})" in text
        assert not _dumpsig._busy
        monkeypatch.setattr(_dump, "report", real)
        signal.raise_signal(signal.SIGUSR1)  # the next signal dumps again
        assert capfd.readouterr().err.count("monstack dump:") == 1
    finally:
        signal.signal(signum, previous)
        if fd >= 0:
            os.close(fd)


def test_signals_during_a_report_add_one_report_not_one_each(monkeypatch, capfd):
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR1")
    monstack.install()
    real = _dump.report
    calls = []

    def flooded(**kwargs):
        calls.append(1)
        if len(calls) == 1:
            for _ in range(20):
                signal.raise_signal(signal.SIGUSR1)  # each runs our handler right here
        return real(**kwargs)

    monkeypatch.setattr(_dump, "report", flooded)
    capfd.readouterr()
    signal.raise_signal(signal.SIGUSR1)
    assert len(calls) == 2
    assert capfd.readouterr().err.count("monstack dump:") == 2


def test_a_request_that_arrives_during_a_report_is_answered_after_it(monkeypatch, capfd):
    """The first report answers request A; meanwhile B's signal comes with B's request, and
    another signal whose request A's report already answered: one follow-up answers B, and
    nothing goes to stderr."""
    monkeypatch.setenv("MONSTACK_DUMP_SIGNAL", "USR1")
    monstack.install()
    fd = _request("aa01")
    real = _dump.report
    calls = []

    def busy(**kwargs):
        calls.append(1)
        if len(calls) == 1:
            signal.raise_signal(signal.SIGUSR1)
            _dumpproto.write_new(fd, _dumpproto.request_name(os.getpid(), "bb02"),
                                 f"{_dumpproto.MAGIC} bb02 plain\n".encode())
            signal.raise_signal(signal.SIGUSR1)
        return real(**kwargs)

    monkeypatch.setattr(_dump, "report", busy)
    capfd.readouterr()
    try:
        signal.raise_signal(signal.SIGUSR1)
        assert len(calls) == 2
        for token in ("aa01", "bb02"):
            assert "monstack dump:" in _dumpproto.read_output(fd, os.getpid(), token, os.geteuid())
        assert capfd.readouterr().err == ""
    finally:
        os.close(fd)


_IMPORT_LOCK_PROGRAM = r"""
import _imp, signal, sys, threading
import monstack

monstack.install()  # MONSTACK_DUMP_SIGNAL=USR1
loaded = set(sys.modules)
held, release, released = threading.Event(), threading.Event(), []

def hold_the_import_lock():
    _imp.acquire_lock()
    held.set()
    release.wait(5)
    released.append(True)
    _imp.release_lock()

t = threading.Thread(target=hold_the_import_lock)
t.start()
held.wait()
signal.raise_signal(signal.SIGUSR1)  # a plain kill: the report on stderr
print("waited for the import lock" if released else "answered while the lock was held", flush=True)
release.set()
t.join()
print("imported by the handler:", sorted(set(sys.modules) - loaded), flush=True)
monstack.uninstall()
"""


def test_the_handler_imports_nothing_even_while_another_thread_holds_the_import_lock(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    env.update(MONSTACK_DUMP_SIGNAL="USR1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _IMPORT_LOCK_PROGRAM], capture_output=True, text=True, env=env,
                         timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["answered while the lock was held", "imported by the handler: []"], out.stdout
    assert "monstack dump:" in out.stderr and "hold_the_import_lock" in out.stderr


def test_without_a_dump_signal_arming_imports_nothing_for_it(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    env.update(PYTHONPATH=str(REPO))
    code = "import sys, monstack; monstack.install(); print(sorted(m for m in sys.modules if 'dump' in m))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60,
                         cwd=str(tmp_path))
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


_FORK_PROGRAM = r"""
import os, sys
import monstack
from monstack import _dumpproto as proto

proto.BASE, proto.RUN_BASE = sys.argv[1], sys.argv[2]
monstack.install()  # MONSTACK_DUMP_SIGNAL=USR1
uid = os.geteuid()

def armed(pid):
    fd = proto.open_private_dir(uid)
    try:
        return proto.read_armed(fd, pid, proto.start_time(pid), uid)
    finally:
        os.close(fd)

child = os.fork()
if child == 0:
    seen = [armed(os.getpid()), armed(os.getppid())]
    monstack.uninstall()  # deletes the child's marker, never the parent's
    seen += [armed(os.getpid()), armed(os.getppid())]
    print("child", seen, flush=True)
    os._exit(0)
os.waitpid(child, 0)
print("parent", [armed(os.getpid())], flush=True)
monstack.uninstall()
print("parent", [armed(os.getpid())], flush=True)
"""


@pytest.mark.skipif(not LINUX or not hasattr(os, "fork"), reason="the marker is for the dump command (Linux)")
def test_a_forked_child_gets_its_own_marker_and_deletes_only_its_own(tmp_path):
    env = {k: v for k, v in os.environ.items() if not k.startswith("MONSTACK")}
    env.update(MONSTACK_DUMP_SIGNAL="USR1", PYTHONPATH=str(REPO))
    out = subprocess.run([sys.executable, "-c", _FORK_PROGRAM, str(tmp_path), str(tmp_path / "run")],
                         capture_output=True, text=True, env=env, timeout=60, cwd=str(tmp_path))
    assert out.returncode == 0 and out.stderr == "", out.stderr
    usr1 = int(signal.SIGUSR1)
    assert out.stdout.splitlines() == [
        f"child [{usr1}, {usr1}, None, {usr1}]", f"parent [{usr1}]", "parent [None]"], out.stdout
    assert os.listdir(tmp_path / f"monstack-{os.geteuid()}") == []
