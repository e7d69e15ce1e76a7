"""``MONSTACK_DUMP_SIGNAL``: install() installs the handler, uninstall() restores the
previous one, unusable signals are refused with a warning, and a plain ``kill`` writes the
report to stderr, also while the main thread is blocked."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest

import monstack
from monstack import MonstackWarning, _dumpproto, _dumpsig, _errors

pytestmark = pytest.mark.skipif(not hasattr(signal, "SIGUSR1"), reason="POSIX signals")


@pytest.fixture(autouse=True)
def fresh(monkeypatch, tmp_path):
    monkeypatch.setattr(_errors, "_said", set())  # warn_once says each message again
    monkeypatch.setattr(_dumpproto, "BASE", str(tmp_path))  # no stray requests from /tmp
    monstack.uninstall()
    yield
    monstack.uninstall()
    assert _dumpsig._installed == []


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
