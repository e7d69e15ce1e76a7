"""monstack._colorize: whether to colour, by CPython 3.13's rules, and resolve()'s
precedence (an explicit ``color``, then ``MONSTACK_COLOR``, then those rules)."""

from __future__ import annotations

import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import FakeStream

from monstack import _colorize

REPO = Path(__file__).resolve().parents[2]
COLOR_VARS = ("PYTHON_COLORS", "NO_COLOR", "FORCE_COLOR", "TERM", "MONSTACK_COLOR")




@pytest.fixture
def clean_env(monkeypatch):
    """No colour variable set; returns ``monkeypatch`` to set some."""
    for var in COLOR_VARS:
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


@pytest.mark.parametrize(
    "env, isatty, expected",
    [
        ({}, True, True),
        ({}, False, False),
        ({"NO_COLOR": "1"}, True, False),
        ({"FORCE_COLOR": "1"}, False, True),
        ({"TERM": "dumb"}, True, False),
        ({"PYTHON_COLORS": "0", "FORCE_COLOR": "1"}, True, False),
        ({"PYTHON_COLORS": "1", "NO_COLOR": "1"}, False, True),
    ],
)
def test_colour_rules_follow_cpython(monkeypatch, env, isatty, expected):
    for var in ("PYTHON_COLORS", "NO_COLOR", "FORCE_COLOR", "TERM"):
        monkeypatch.delenv(var, raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)

    class Stream(io.StringIO):
        def isatty(self):
            return isatty

        def fileno(self):
            raise io.UnsupportedOperation

    assert _colorize.can_colorize(Stream()) is expected

# -- can_colorize(): the rules not covered above -----------------------------------------


@pytest.mark.parametrize(
    "env, isatty, expected",
    [
        ({"NO_COLOR": ""}, True, True),  # set but empty: not a request
        ({"FORCE_COLOR": ""}, False, False),
        ({"PYTHON_COLORS": "2"}, True, True),  # neither "0" nor "1": the other rules decide
        ({"PYTHON_COLORS": "2", "NO_COLOR": "1"}, True, False),
        ({"NO_COLOR": "1", "FORCE_COLOR": "1"}, True, False),  # NO_COLOR before FORCE_COLOR
        ({"FORCE_COLOR": "1", "TERM": "dumb"}, False, True),  # FORCE_COLOR before TERM=dumb
        ({"TERM": "xterm-256color"}, False, False),  # a TERM other than dumb does not force
    ],
)
def test_empty_and_other_values_and_the_order_of_the_rules(clean_env, env, isatty, expected):
    for k, v in env.items():
        clean_env.setenv(k, v)
    assert _colorize.can_colorize(FakeStream(isatty)) is expected


@pytest.mark.parametrize("env, expected", [({"PYTHON_COLORS": "1"}, False), ({"PYTHON_COLORS": "0", "FORCE_COLOR": "1"}, True)])
def test_python_colors_is_ignored_under_dash_E(env, expected):
    """``python -E`` ignores PYTHON_* variables, PYTHON_COLORS too (NO_COLOR and
    FORCE_COLOR still count), as CPython's own rules do."""
    environ = {k: v for k, v in os.environ.items() if k not in COLOR_VARS}
    environ.update(env)
    code = "import io, monstack._colorize as c; print(c.can_colorize(io.StringIO()))"
    out = subprocess.run([sys.executable, "-E", "-c", code], capture_output=True, text=True, env=environ, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == str(expected)


def test_default_file_is_sys_stdout(clean_env):
    clean_env.setattr(sys, "stdout", FakeStream(True))
    assert _colorize.can_colorize() is True
    clean_env.setattr(sys, "stdout", FakeStream(False))
    assert _colorize.can_colorize() is False


def test_a_file_without_fileno_is_not_a_terminal(clean_env):
    class Bare:  # claims to be a terminal, but has no file descriptor at all
        def isatty(self):
            return True

        def write(self, text):
            return len(text)

    assert _colorize.can_colorize(Bare()) is False  # type: ignore[arg-type]


def test_real_descriptors_pipe_and_closed_file(clean_env, tmp_path):
    r, w = os.pipe()
    with os.fdopen(r) as rf, os.fdopen(w, "w") as wf:
        assert _colorize.can_colorize(wf) is False
        assert _colorize.can_colorize(rf) is False
    f = open(tmp_path / "out.txt", "w")
    f.close()  # fileno() and isatty() now raise ValueError: never colour, never raise
    assert _colorize.can_colorize(f) is False


@pytest.mark.skipif(not hasattr(os, "openpty"), reason="needs a pseudo-terminal")
def test_a_real_terminal_is_coloured(clean_env):
    master, slave = os.openpty()
    try:
        with os.fdopen(slave, "w") as tty:
            assert _colorize.can_colorize(tty) is True
            clean_env.setenv("TERM", "dumb")
            assert _colorize.can_colorize(tty) is False
    finally:
        os.close(master)


# -- resolve() ------------------------------------------------------------------------------


@pytest.mark.parametrize("color", [True, False, 1, 0])
def test_resolve_an_explicit_color_wins_over_everything(clean_env, color):
    clean_env.setenv("MONSTACK_COLOR", "never" if color else "always")
    clean_env.setenv("FORCE_COLOR" if not color else "NO_COLOR", "1")
    assert _colorize.resolve(color, FakeStream(not color)) is bool(color)


@pytest.mark.parametrize(
    "value, isatty, expected",
    [
        (None, True, True),  # unset: CPython's rules for the stream
        (None, False, False),
        ("always", False, True),
        ("1", False, True),
        ("never", True, False),
        ("off", True, False),
        ("auto", True, True),
        ("auto", False, False),
        ("sometimes", True, True),  # not a valid value: as if unset
        ("sometimes", False, False),
    ],
)
def test_resolve_none_reads_monstack_color_then_the_rules(clean_env, value, isatty, expected):
    if value is not None:
        clean_env.setenv("MONSTACK_COLOR", value)
    assert _colorize.resolve(None, FakeStream(isatty)) is expected


def test_resolve_monstack_color_never_beats_force_color_and_always_beats_no_color(clean_env):
    clean_env.setenv("FORCE_COLOR", "1")
    clean_env.setenv("MONSTACK_COLOR", "never")
    assert _colorize.resolve(None, FakeStream(True)) is False
    clean_env.delenv("FORCE_COLOR")
    clean_env.setenv("NO_COLOR", "1")
    clean_env.setenv("MONSTACK_COLOR", "always")
    assert _colorize.resolve(None, FakeStream(False)) is True


def test_resolve_without_a_file_decides_for_sys_stdout(clean_env):
    clean_env.setattr(sys, "stdout", FakeStream(True))
    assert _colorize.resolve(None) is True
    clean_env.setattr(sys, "stdout", FakeStream(False))
    assert _colorize.resolve(None) is False
