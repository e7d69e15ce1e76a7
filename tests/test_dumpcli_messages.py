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
