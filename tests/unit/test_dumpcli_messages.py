"""The dump command's parsing and messages, without processes (fast; the real processes
are in test_dumpcli.py)."""

from __future__ import annotations

import os
import sys

import pytest

from monstack import _dumpcli
from monstack._dumpcli import DumpError, _parse, _remote_error


def test_parse_pid_and_timeout():
    assert _parse(["123"]) == (123, _dumpcli.DEFAULT_TIMEOUT)
    assert _parse(["123", "--timeout", "2.5"]) == (123, 2.5)
    assert _parse(["--timeout=3", "77"]) == (77, 3.0)


@pytest.mark.parametrize("argv", [[], ["x"], ["-5"], ["1", "--timeout", "-1"], ["1", "--timeout", "inf"], ["1", "-v"]])
def test_parse_refuses(argv):
    with pytest.raises(DumpError):
        _parse(argv)


@pytest.mark.parametrize(
    "text, fragment",
    [
        ("PermissionError: [Errno 1] Operation not permitted", "not permitted to attach to process 7"),
        ("OSError: Permission denied reading memory", "not permitted to attach"),
        ("ProcessLookupError: no process", "no such process: 7"),
        ("RuntimeError: Remote debugging is not enabled in the remote process", "disabled in process 7"),
        ("RuntimeError: Remote debugging is not enabled", "disabled in this interpreter"),
        ("RuntimeError: Failed to find the PyRuntime section", "process 7 is not a Python process"),
        ("RuntimeError: PyRuntime address lookup failed during debug offsets initialization",
         "process 7 is not a Python process"),
        ("RuntimeError: Can't send commands from a Python 3.14 process to a Python 3.13 process",
         "is it CPython 3.14+ of the same version?"),
    ],
)
def test_remote_exec_errors_become_one_line(text, fragment):
    message = str(_remote_error(7, text))
    assert fragment in message and "\n" not in message


def test_main_prints_one_line_and_returns_1(capsys):
    assert _dumpcli.main(["not-a-pid"]) == 1
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and err.startswith("python -m monstack dump: ")


def test_help(capsys):
    with pytest.raises(SystemExit) as exc:
        _dumpcli.main(["--help"])
    assert exc.value.code == 0 and "--timeout" in capsys.readouterr().out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="/proc")
def test_own_process_facts():
    target = _dumpcli._Target(os.getpid())
    assert target.uid == os.geteuid() and target.alive()
    assert _dumpcli._same_interpreter(os.getpid())


def test_error_lines_escape_what_the_target_controls(capsys, monkeypatch):
    """A DumpError may quote the target's environment or executable's name: escaped."""
    def fail(pid, timeout):
        raise DumpError("process 7 sets MONSTACK_DUMP_SIGNAL=USR9\x1b]0;PWNED\x07\x1b[2J")

    monkeypatch.setattr(_dumpcli, "dump_process", fail)
    assert _dumpcli.main(["7"]) == 1
    err = capsys.readouterr().err
    assert "\x1b" not in err and "\x07" not in err and "USR9\\x1b]0;PWNED\\x07\\x1b[2J" in err


def test_another_users_report_keeps_colour_and_escapes_the_rest(monkeypatch):
    text = "head \x1b[1;31mred\x1b[0m\n  File \"x\x1b]52;c;Zm9v\x07.py\"\n\x9b2J end"
    monkeypatch.setattr(os, "geteuid", lambda: 0)  # root dumping: the target (pid 1) is root's too
    out = _dumpcli._safe_report(text, 1)
    assert "\x1b[1;31mred\x1b[0m" in out  # monstack's colour stays
    assert "\x1b]" not in out and "\x07" not in out and "\x9b" not in out
    assert out.count("\n") == text.count("\n") and "x\\x1b]52;c;Zm9v\\x07.py" in out


def test_a_reused_pid_gets_no_remote_script(monkeypatch):
    target = _dumpcli._Target(os.getpid())
    called = []
    monkeypatch.setattr(sys, "remote_exec", lambda *a: called.append(a), raising=False)
    monkeypatch.setattr(_dumpcli.proto, "start_time", lambda pid: (target.start_time or 0) + 1)
    with pytest.raises(DumpError, match="its pid now names another process"):
        _dumpcli._remote_exec(target, "/nonexistent.py", "no signal")
    assert called == []


def test_the_exchange_is_never_created_in_another_mount_namespace(monkeypatch):
    """mkdir then chown in a tree the target controls could chown whatever it bind-mounts
    there in between: in another mount namespace the directory must already exist."""
    target = _dumpcli._Target(os.getpid())
    target.foreign_root = True
    asked = []

    def open_private_dir(uid, *, create=False, gid=-1, root=None, name_uid=None):
        asked.append((create, root is not None))
        raise _dumpcli.proto.Refused("/tmp/monstack-0 does not exist")

    monkeypatch.setattr(_dumpcli.proto, "open_private_dir", open_private_dir)
    with pytest.raises(DumpError, match="does not exist"):
        _dumpcli._Exchange(target)
    assert asked == [(False, True)]
